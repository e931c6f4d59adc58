"""Curvature-vector products: GGN and Hessian times a vector, matrix-free.

``v`` is a pytree shaped like ``params``; so is the result. Both products are
exact for every supported loss and model: the GGN product is
``J_θᵀ (∇²_f L) J_θ v`` (a forward-mode product through the model, the loss
Hessian w.r.t. the output, a reverse-mode product back), the Hessian product
forward-over-reverse differentiation of the loss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn
from torch.func import grad, jvp, vjp

from packfunc.engine.taps import functional_mode, twice_differentiable
from packfunc.functional import flatten_params
from packfunc.losses import check_loss, check_loss_inputs, default_loss, hessian_factors


def _model(model_fn: Callable, X: Any) -> Callable[[Any], Tensor]:
    def forward(params: Any) -> Tensor:
        with functional_mode():
            return model_fn(params, X)
    return forward


def ggn_vector_product(model_fn: Callable, params: Any, X: Any, y: Tensor, v: Any, *,
                       loss: nn.Module | None = None) -> Any:
    """Multiply the GGN of the reduced loss with ``v`` (BackPACK's ``ggn_vector_product``).

    Args:
        model_fn: ``model_fn(params, X) -> output``.
        params: Pytree of floating-point tensors.
        X: Inputs with leading batch dimension ``N``.
        y: Targets.
        v: Pytree shaped like ``params``.
        loss: Loss module (default ``CrossEntropyLoss()``); ``NLLLoss`` is refused.

    Returns:
        ``G v``, a pytree shaped like ``params``.

    Example:
        >>> model_fn, params = packfunc.functional(torch.nn.Linear(3, 2))
        >>> v = {k: torch.ones_like(p) for k, p in params.items()}
        >>> ggn_vector_product(model_fn, params, torch.randn(4, 3), torch.tensor([0, 1, 1, 0]),
        ...                    v)["weight"].shape
        torch.Size([2, 3])
    """
    loss = loss or default_loss()
    check_loss(loss)
    flatten_params(params)
    with twice_differentiable():
        output, jv = jvp(_model(model_fn, X), (params,), (v,))
        check_loss_inputs(loss, output, y, output.shape[0])
        hessian_factors(loss, output.detach(), y)  # refuses losses without a usable curvature
        _, hjv = jvp(grad(lambda out: loss(out, y)), (output,), (jv,))
        _, pullback = vjp(_model(model_fn, X), params)
        return pullback(hjv)[0]


def hessian_vector_product(model_fn: Callable, params: Any, X: Any, y: Tensor, v: Any, *,
                           loss: nn.Module | None = None) -> Any:
    """Multiply the Hessian of the reduced loss w.r.t. the parameters with ``v``.

    Args:
        model_fn: ``model_fn(params, X) -> output``.
        params: Pytree of floating-point tensors.
        X: Inputs with leading batch dimension ``N``.
        y: Targets.
        v: Pytree shaped like ``params``.
        loss: Loss module (default ``CrossEntropyLoss()``).

    Returns:
        ``H v``, a pytree shaped like ``params``.

    Example:
        >>> model_fn, params = packfunc.functional(torch.nn.Linear(3, 2))
        >>> v = {k: torch.ones_like(p) for k, p in params.items()}
        >>> hessian_vector_product(model_fn, params, torch.randn(4, 3),
        ...                        torch.tensor([0, 1, 1, 0]), v)["bias"].shape
        torch.Size([2])
    """
    loss = loss or default_loss()
    check_loss(loss)
    flatten_params(params)
    forward = _model(model_fn, X)

    def total(params: Any) -> Tensor:
        output = forward(params)
        check_loss_inputs(loss, output, y, output.shape[0])
        return loss(output, y)

    with twice_differentiable():
        return jvp(grad(total), (params,), (v,))[1]
