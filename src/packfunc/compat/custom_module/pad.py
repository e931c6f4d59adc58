"""``Pad``: ``torch.nn.functional.pad`` as a module."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn
from torch.nn.functional import pad


class Pad(nn.Module):
    """Pad the input with ``torch.nn.functional.pad(input, pad, mode, value)``.

    Args:
        pad: Padding sizes, two per padded dimension starting from the last.
        mode: ``'constant'``, ``'reflect'``, ``'replicate'`` or ``'circular'``.
        value: The fill value of constant padding.

    Example:
        >>> import torch
        >>> Pad((1, 0), value=9.0)(torch.zeros(1, 2))
        tensor([[9., 0., 0.]])
    """

    def __init__(self, pad: Sequence[int], mode: str = "constant", value: float = 0.0):
        super().__init__()
        self.pad = pad
        self.mode = mode
        self.value = value

    def forward(self, input: Tensor) -> Tensor:
        """Return the padded ``input``."""
        return pad(input, self.pad, mode=self.mode, value=self.value)
