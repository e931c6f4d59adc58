"""Hessian-vector products: the R-operator applied to a gradient."""

from __future__ import annotations

import torch
from torch import Tensor

from .rop import R_op, Tensors, _as_tuple, _detached


def hessian_vector_product(
    f: Tensor,
    params: Tensors,
    v: Tensors,
    grad_params: Tensors | None = None,
    detach: bool = True,
) -> tuple[Tensor, ...]:
    """Multiply ``v`` with the Hessian of the scalar ``f`` w.r.t. ``params``.

    The gradient of ``f`` is computed with ``create_graph=True`` (unless supplied as
    ``grad_params``) and then differentiated once more along ``v``. The graph behind
    ``f`` is kept alive. Parameters ``f`` does not depend on, and parameters ``f`` is
    linear in, get zero tensors.

    Args:
        f: Scalar tensor, e.g. a loss.
        params: Tensor, or a tuple/list of tensors, w.r.t. which ``f`` is differentiated.
        v: Tensor(s) shaped like ``params``.
        grad_params: Gradient of ``f`` w.r.t. ``params`` computed beforehand with
            ``create_graph=True``; saves the first backward pass.
        detach: Cut the result off the autograd graph. With ``False`` the result can
            be differentiated further.

    Returns:
        ``H v`` as a tuple with one tensor per parameter, shaped like ``params``.

    Raises:
        ValueError: If ``grad_params`` is given but none of its tensors is part of an
            autograd graph (it was not computed with ``create_graph=True``).

    Example:
        >>> x = torch.tensor([1.0, 2.0], requires_grad=True)
        >>> hessian_vector_product((x**3).sum(), x, torch.tensor([1.0, 1.0]))
        (tensor([ 6., 12.]),)
    """
    if grad_params is None:
        grads = torch.autograd.grad(
            f, params, create_graph=True, retain_graph=True, materialize_grads=True
        )
    else:
        grads = _as_tuple(grad_params)
        if not any(g.requires_grad for g in grads):
            raise ValueError(
                "grad_params carries no autograd graph: compute it with "
                "torch.autograd.grad(..., create_graph=True)"
            )

    # A gradient entry without a graph is constant in params: its Hessian rows vanish.
    live = [i for i, g in enumerate(grads) if g.requires_grad]
    products: list[Tensor] = [torch.zeros_like(g) for g in grads]
    if live:
        parts = R_op(tuple(grads[i] for i in live), params, v, detach=detach)
        for i, part in zip(live, parts):
            products[i] = part
    return _detached(products) if detach else tuple(products)
