"""Transposed-Jacobian-vector products (the L-operator): one backward pass."""

from __future__ import annotations

import torch
from torch import Tensor

from .rop import Tensors, _detached


def L_op(  # noqa: N802 (BackPACK's name)
    ys: Tensors,
    xs: Tensors,
    ws: Tensors,
    retain_graph: bool = True,
    detach: bool = True,
) -> tuple[Tensor, ...]:
    """Multiply ``ws`` with the transposed Jacobian of ``ys`` w.r.t. ``xs``.

    This is the vector-Jacobian product ``Jᵀ w`` of reverse-mode autodiff. Inputs in
    ``xs`` that ``ys`` does not depend on get zero tensors.

    Args:
        ys: Output tensor, or a tuple/list of output tensors.
        xs: Input tensor, or a tuple/list of input tensors.
        ws: Tensor(s) shaped like ``ys`` (one per output).
        retain_graph: Keep the graph behind ``ys`` alive after the backward pass.
        detach: Cut the result off the autograd graph. With ``False`` the result can
            be differentiated further.

    Returns:
        ``Jᵀ w`` as a tuple with one tensor per input, shaped like ``xs`` (a 1-tuple
        for a single input tensor).

    Example:
        >>> x = torch.tensor([1.0, 2.0], requires_grad=True)
        >>> L_op(x**2, x, torch.tensor([1.0, 1.0]))
        (tensor([2., 4.]),)
    """
    vjps = torch.autograd.grad(
        ys,
        xs,
        grad_outputs=ws,
        create_graph=True,
        retain_graph=retain_graph,
        allow_unused=True,
        materialize_grads=True,
    )
    return _detached(vjps) if detach else vjps


def transposed_jacobian_vector_product(
    f: Tensors,
    x: Tensors,
    v: Tensors,
    retain_graph: bool = True,
    detach: bool = True,
) -> tuple[Tensor, ...]:
    """Multiply ``v`` with the transposed Jacobian of ``f`` w.r.t. ``x`` (the L-operator).

    Same as :func:`L_op`, under a descriptive name.

    Args:
        f: Output tensor(s) of the differentiated function.
        x: Input tensor(s) the Jacobian is taken with respect to.
        v: Tensor(s) shaped like ``f``.
        retain_graph: Keep the graph behind ``f`` alive (default ``True``).
        detach: Cut the result off the autograd graph (default ``True``).

    Returns:
        ``Jᵀ v`` as a tuple of tensors shaped like ``x``.

    Example:
        >>> a = torch.tensor([1.0, 2.0], requires_grad=True)
        >>> b = torch.tensor(3.0, requires_grad=True)
        >>> transposed_jacobian_vector_product(a * b, (a, b), torch.tensor([1.0, 1.0]))
        (tensor([3., 3.]), tensor(3.))
    """
    return L_op(f, x, v, retain_graph=retain_graph, detach=detach)
