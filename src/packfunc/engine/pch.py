"""Positive-curvature Hessian (PCH) block products, and the residual curvature of a chain.

The Hessian w.r.t. a layer's output is carried backward through the chain's
elementwise ops, each adding its residual curvature ``δ ⊙ φ''`` (clipped or made
absolute for the PCH, BackPACK's ``HBP``); a parameter's block product follows
from the curvature at its layer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.func import grad, vmap

from packfunc.engine.autodiff import jvp, vjp
from packfunc.engine.batch_pass import BatchPass
from packfunc.engine.chain import Link, NotSequentialError, passes_recursions, trace_chain
from packfunc.engine.ops import ELEMENTWISE


def pch_block_product(bp: BatchPass, leaf: int, mats: Tensor, modify: str) -> Tensor:
    """Positive-curvature Hessian block of one layer parameter times ``mats [V, *p]``.

    Tangents are pushed from the parameter forward through the chain (``jvp``),
    the loss Hessian and each elementwise op's modified curvature
    ``mod(δ ⊙ φ'')`` are applied, and the result is pulled back (``vjp``).

    Args:
        bp: The batch pass of a sequential model.
        leaf: Index of a weight or bias of one linear or convolution layer.
        mats: ``[V, *param.shape]``.
        modify: ``"clip"``, ``"abs"`` or ``"none"`` (the exact Hessian block).

    Returns:
        ``[V, *param.shape]``.

    Raises:
        NotSequentialError: for a non-sequential model, or the parameter not in one layer.
        ValueError: for a nonlinearity that is neither elementwise nor piecewise linear.
    """
    bp.check_rerun("the positive-curvature Hessian's chain")
    links = trace_chain(bp.model_fn, bp.params, bp.leaves, bp.X)
    owners = [
        i
        for i, link in enumerate(links)
        if link.call and any(j == leaf for _, j in link.call.leaves)
    ]
    if len(owners) != 1:
        raise NotSequentialError(
            f"{bp.names[leaf]} is not the weight or bias of exactly one linear or convolution "
            "layer of the chain; the PCH block product is defined for such parameters."
        )
    start = owners[0]
    owner = links[start].call
    assert owner is not None  # an owner is a layer call
    role = next(r for r, j in owner.leaves if j == leaf)
    downstream = links[start + 1 :]
    for link in downstream:
        if not passes_recursions(link):
            raise ValueError(
                f"{getattr(link.func, '__name__', link.func)} is not elementwise; the "
                "positive-curvature Hessian only modifies elementwise nonlinearities."
            )
    curvature = modified_curvature(bp, downstream, modify)
    loss_hessian = loss_hessian_product(bp.loss, bp.record.output, bp.y)

    def through_layer(value: Tensor) -> Tensor:
        return cast(Tensor, links[start].with_argument(role, value))

    def one(m: Tensor) -> Tensor:
        t = jvp(through_layer, (bp.leaves[leaf],), (m,))[1]
        tangents = []
        for link in downstream:
            tangents.append(t)
            t = jvp(link.apply, (link.input,), (t,))[1]
        c = loss_hessian(t)
        for link, t_in, r in zip(reversed(downstream), reversed(tangents), reversed(curvature)):
            c = vjp(link.apply, link.input)[1](c)[0]
            if r is not None:
                c = c + r * t_in
        return cast(Tensor, vjp(through_layer, bp.leaves[leaf])[1](c)[0])

    return vmap(one)(mats)


def loss_hessian_product(loss: nn.Module, output: Tensor, y: Any) -> Callable[[Tensor], Tensor]:
    """``t -> (∇²_f L) t``: the loss Hessian w.r.t. the model output times a tangent.

    Reverse-over-reverse: the Hessian is symmetric, so pulling ``t`` back through the
    loss gradient gives the product. Forward mode through a loss's backward is not
    reliable in torch (``MSELoss(reduction='mean')`` fails on an immutable ZeroTensor
    for the target's tangent, ``HuberLoss`` has no forward-mode formula).

    Args:
        loss: The loss module.
        output: The model output ``[N, ...]``.
        y: The targets.

    Returns:
        A function of a tangent shaped like ``output`` (``vmap``-able).

    Example:
        >>> product = loss_hessian_product(torch.nn.MSELoss(), torch.zeros(2, 3), torch.ones(2, 3))
        >>> product(torch.ones(2, 3))[0]
        tensor([0.3333, 0.3333, 0.3333])
    """

    def loss_of(out: Tensor) -> Tensor:
        return cast(Tensor, loss(out, y))

    _, pullback = vjp(grad(loss_of), output)
    return lambda t: pullback(t)[0]


def _second_derivative(apply: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """``φ''(x)`` of an elementwise op, by forward-over-forward differentiation."""
    ones = torch.ones_like(x)
    return cast(Tensor, jvp(lambda z: jvp(apply, (z,), (ones,))[1], (x,), (ones,))[1])


def modified_curvature(bp: BatchPass, links: list[Link], modify: str) -> list[Tensor | None]:
    """``mod(δ ⊙ φ'')`` at the input of each elementwise link (``None`` for the others)."""
    delta = bp.record.output_cotangent
    found: list[Tensor | None] = []
    for link in reversed(links):
        r = None
        if link.func in ELEMENTWISE:
            r = delta * _second_derivative(link.apply, link.input)
            r = {"clip": r.clamp_min(0), "abs": r.abs()}.get(modify, r)
        found.append(r)
        delta = vjp(link.apply, link.input)[1](delta)[0]
    return found[::-1]


RESIDUAL_MODIFICATIONS = {
    "none": lambda r: r,
    "clip": lambda r: r.clamp_min(0),
    "abs": lambda r: r.abs(),
}
"""How the Hessian variants treat the activations' residual curvature: keep, clip, abs."""


def summed_residual_curvature(bp: BatchPass, links: list[Link], modify: str) -> list[Tensor | None]:
    """``mod(Σ_n δ_n ⊙ φ''_n)`` at the input of each elementwise link of the whole chain.

    The diagonal that the Hessian variants of KFRA add to the batch-averaged curvature
    at an elementwise op (BackPACK's HBP residual: summed over samples, then modified).

    Args:
        bp: The batch pass of a sequential model.
        links: Its chain, from :func:`trace_chain`.
        modify: A key of :data:`RESIDUAL_MODIFICATIONS`.

    Returns:
        Per link, ``[D_in]`` for elementwise ops, ``None`` for the others.

    Raises:
        ValueError: for an op that is neither a layer, elementwise, a reshape nor
            piecewise linear (its curvature is not diagonal).
    """
    for link in links:
        if not passes_recursions(link):
            raise ValueError(
                f"{getattr(link.func, '__name__', link.func)} is neither a layer, elementwise, a "
                "reshape nor piecewise linear; the residual curvature the Hessian variants add "
                "is only defined (diagonal) for elementwise nonlinearities."
            )
    per_sample = modified_curvature(bp, links, "none")
    return [
        None if r is None else RESIDUAL_MODIFICATIONS[modify](r.sum(0).reshape(-1))
        for r in per_sample
    ]
