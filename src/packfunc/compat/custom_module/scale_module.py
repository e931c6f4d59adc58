"""``ScaleModule``: multiply by a constant."""

from __future__ import annotations

from torch import Tensor, nn


class ScaleModule(nn.Module):
    """Multiply the input by a constant float ``weight`` (not a parameter).

    Args:
        weight: The factor.

    Raises:
        ValueError: if ``weight`` is not a float (as in BackPACK).

    Example:
        >>> import torch
        >>> ScaleModule(0.5)(torch.ones(2))
        tensor([0.5000, 0.5000])
    """

    def __init__(self, weight: float = 1.0):
        super().__init__()
        if not isinstance(weight, float):
            raise ValueError(f"ScaleModule's weight must be a float, got {weight!r}.")
        self.weight = weight

    def forward(self, input: Tensor) -> Tensor:
        """Return ``input * weight``."""
        return input * self.weight
