"""Jacobian-vector products (the R-operator) on an existing autograd graph.

Reverse-mode autograd only offers vector-Jacobian products ``uᵀ J``. That product is
linear in ``u``, so differentiating ``⟨uᵀ J, v⟩`` w.r.t. a dummy ``u`` gives ``J v``:
two backward passes yield a forward-mode product without re-running the function.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

Tensors = Tensor | Sequence[Tensor]


def _as_tuple(tensors: Tensors) -> tuple[Tensor, ...]:
    """Wrap a single tensor into a 1-tuple; turn any other sequence into a tuple."""
    return (tensors,) if isinstance(tensors, Tensor) else tuple(tensors)


def _detached(tensors: Sequence[Tensor]) -> tuple[Tensor, ...]:
    """Cut every tensor off the autograd graph."""
    return tuple(t.detach() for t in tensors)


def R_op(  # noqa: N802 (BackPACK's name)
    ys: Tensors,
    xs: Tensors,
    vs: Tensors,
    retain_graph: bool = True,
    detach: bool = True,
) -> tuple[Tensor, ...]:
    """Multiply ``vs`` with the Jacobian of ``ys`` w.r.t. ``xs``.

    ``ys`` must already have been computed from ``xs`` with autograd recording. Inputs
    in ``xs`` that ``ys`` does not depend on contribute nothing; outputs that depend
    on none of ``xs`` get zero tensors.

    Args:
        ys: Output tensor, or a tuple/list of output tensors.
        xs: Input tensor, or a tuple/list of input tensors.
        vs: Tensor(s) shaped like ``xs`` (one per input).
        retain_graph: Keep the graph behind ``ys`` alive after the first backward
            pass. With ``False`` it is freed and ``ys`` cannot be differentiated again.
        detach: Cut the result off the autograd graph. With ``False`` the result can
            be differentiated further.

    Returns:
        ``J v`` as a tuple with one tensor per output, shaped like ``ys`` (a 1-tuple
        for a single output tensor).

    Example:
        >>> x = torch.tensor([1.0, 2.0], requires_grad=True)
        >>> R_op(x**2, x, torch.tensor([1.0, 1.0]))
        (tensor([2., 4.]),)
    """
    outputs = _as_tuple(ys)
    # The dummy cotangents' value is irrelevant: only the derivative w.r.t. them is used.
    dummies = [torch.zeros_like(y).requires_grad_(True) for y in outputs]
    vjps = torch.autograd.grad(
        outputs,
        xs,
        grad_outputs=dummies,
        create_graph=True,
        retain_graph=retain_graph,
        allow_unused=True,
        materialize_grads=True,
    )
    jvps = torch.autograd.grad(
        vjps,
        dummies,
        grad_outputs=vs,
        create_graph=True,
        retain_graph=True,
        allow_unused=True,
        materialize_grads=True,
    )
    return _detached(jvps) if detach else jvps


def jacobian_vector_product(
    f: Tensors,
    x: Tensors,
    v: Tensors,
    retain_graph: bool = True,
    detach: bool = True,
) -> tuple[Tensor, ...]:
    """Multiply ``v`` with the Jacobian of ``f`` w.r.t. ``x`` (the R-operator).

    Same as :func:`R_op`, under a descriptive name.

    Args:
        f: Output tensor(s) of the differentiated function.
        x: Input tensor(s) the Jacobian is taken with respect to.
        v: Tensor(s) shaped like ``x``.
        retain_graph: Keep the graph behind ``f`` alive (default ``True``).
        detach: Cut the result off the autograd graph (default ``True``).

    Returns:
        ``J v`` as a tuple of tensors shaped like ``f``.

    Example:
        >>> x = torch.tensor([1.0, 2.0], requires_grad=True)
        >>> jacobian_vector_product((x.sum(), 3 * x), x, torch.tensor([1.0, -1.0]))
        (tensor(0.), tensor([ 3., -3.]))
    """
    return R_op(f, x, v, retain_graph=retain_graph, detach=detach)
