"""``ReduceTuple``: pick one element of a tuple (e.g. an RNN's output)."""

from __future__ import annotations

from typing import Any

from torch import nn


class ReduceTuple(nn.Module):
    """Return ``input[index]``, e.g. the output sequence of ``nn.LSTM``'s ``(output, state)``.

    Args:
        index: The element to keep.

    Example:
        >>> import torch
        >>> lstm = torch.nn.Sequential(torch.nn.LSTM(3, 4, batch_first=True), ReduceTuple())
        >>> lstm(torch.randn(2, 5, 3)).shape
        torch.Size([2, 5, 4])
    """

    def __init__(self, index: int = 0):
        super().__init__()
        self.index = index

    def forward(self, input: tuple) -> Any:
        """Return element ``index`` of ``input``."""
        return input[self.index]
