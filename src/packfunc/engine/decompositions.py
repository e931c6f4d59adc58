"""Ops whose batching rules in torch give wrong derivatives nested: run as plain ops.

The Hessian paths differentiate the model twice under ``vmap`` over samples and then
over tangents. For ``torch.prelu`` torch's batching rules of its backward mix the two
levels (an error, or wrong values where the two sizes are equal). Its decomposition into
``where`` and ``mul`` has exact rules; the modes run it in its place. (The op-local rule
avoids nesting altogether: see ``engine/rules/local.py``.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = ["DECOMPOSED_OPS", "prelu"]


def prelu(input: Tensor, weight: Tensor) -> Tensor:
    """``torch.prelu`` as ``where(x ≥ 0, x, a·x)``, ``a`` per channel (dim 1) or one for all.

    Args:
        input: Any tensor; its dim 1 holds the channels where it has two dims or more.
        weight: One slope, or one per channel.

    Returns:
        ``torch.prelu(input, weight)``.

    Example:
        >>> x, a = torch.randn(2, 3, 4), torch.rand(3)
        >>> torch.allclose(prelu(x, a), torch.prelu(x, a))
        True
    """
    if weight.numel() == 1 or input.dim() < 2:
        slope = weight.reshape(())
    else:
        slope = weight.reshape(1, -1, *[1] * (input.dim() - 2))
    return torch.where(input >= 0, input, slope * input)


DECOMPOSED_OPS: dict[Callable[..., Any], Callable[..., Tensor]] = {torch.prelu: prelu}
"""Op -> the decomposition the modes run in its place."""
