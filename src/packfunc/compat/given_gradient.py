"""The shim's stand-in loss for first-order quantities: the user's own output gradient."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from packfunc.losses import OutputGradientLoss


class GivenGradient(OutputGradientLoss):
    """A linear stand-in loss ``⟨G, f⟩`` whose gradient w.r.t. the output is ``G``.

    First-order quantities only need the loss gradient w.r.t. the output; the
    BackPACK shim uses this when that gradient comes from the user's own
    backward pass (any loss, extended or not). It has no curvature.

    Args:
        gradient: ``∂L/∂f`` for the whole batch.

    Example:
        >>> GivenGradient(torch.ones(2, 3))(torch.ones(2, 3), None)
        tensor(6.)
    """

    def __init__(self, gradient: Tensor):
        super().__init__()
        self.gradient = gradient

    def forward(self, output: Tensor, target: object) -> Tensor:
        """Return ``⟨G, output⟩``; its gradient w.r.t. ``output`` is ``G`` itself.

        ``G`` may depend on ``output`` through an autograd graph (a backward pass with
        ``create_graph=True``); that dependence is not differentiated.
        """
        return _InnerProduct.apply(output, self.gradient)


class _InnerProduct(torch.autograd.Function):
    """``⟨f, G⟩`` whose derivative w.r.t. ``f`` is ``G``, keeping ``G``'s own graph."""

    generate_vmap_rule = True

    @staticmethod
    def forward(output: Tensor, gradient: Tensor) -> Tensor:
        return (output * gradient.detach()).sum()

    @staticmethod
    def setup_context(
        ctx: torch.autograd.function.FunctionCtx, inputs: tuple[Tensor, Tensor], output: Tensor
    ) -> None:
        ctx.save_for_backward(inputs[1])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        (gradient,) = ctx.saved_tensors
        return grad * gradient, None
