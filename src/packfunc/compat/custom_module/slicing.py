"""``Slicing``: index the input."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn


class Slicing(nn.Module):
    """Return ``input[slice_info]``.

    Args:
        slice_info: Anything tensor indexing takes, e.g. ``(slice(None), slice(0, 2))``.

    Example:
        >>> import torch
        >>> Slicing((slice(None), 0))(torch.arange(6).view(2, 3))
        tensor([0, 3])
    """

    def __init__(self, slice_info: Any):
        super().__init__()
        self.slice_info = slice_info

    def forward(self, input: Tensor) -> Tensor:
        """Return the slice of ``input``."""
        return input[self.slice_info]
