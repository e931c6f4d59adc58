"""Hessian diagonals: the GGN's diagonal plus the model's own curvature.

With ``G = ∂L/∂f`` the loss gradient and ``H_f`` its Hessian w.r.t. the output,
the Hessian of ``L(f(θ))`` is ``Jᵀ H_f J + ∇²φ`` where ``φ(θ) = ⟨G, f(θ)⟩`` is
the model linearized in the loss (``G`` held fixed). The first term is the GGN
(its diagonal comes from the square-root columns, ``engine/statistics.py``);
this module adds the diagonal of ``∇²φ``, the *residual* curvature of
activations, attention and every other nonlinearity, per sample or summed.

For a linear layer used once, ``z = W x + b`` with ``x`` not depending on
``W``, so ``∂²φ/∂W² = Σ_n (x_n x_nᵀ) ⊗ ∂²φ_n/∂z_n²`` and the diagonal needs
only ``d_n = diag(∂²φ_n/∂z_n²)``: one forward-over-reverse product per output
unit of the layer, all samples at once (samples do not interact). Every other
parameter gets exact Hessian-vector products with one-hot tangents.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import torch
from torch import Tensor
from torch.func import grad, jvp, vmap

from packfunc.engine.memory import DEFAULT_BUDGET, chunks, index_length
from packfunc.engine.persample import Backprop
from packfunc.engine.statistics import ggn_statistics
from packfunc.engine.taps import (
    functional_mode,
    probed_forward,
    twice_differentiable,
    zero_probes,
)
from packfunc.functional import select_samples

Stats = dict[str, Tensor]


def diagonals(bp: Backprop, stats: set[str], index: slice | Tensor) -> list[Stats]:
    """Diagonal of the Hessian, summed (``sum_grad_squared``) or per sample (``batch_sum_squares``).

    Args:
        bp: The batch pass.
        stats: ``{"sum_grad_squared"}``, ``{"batch_sum_squares"}`` or both.
        index: Samples that the per-sample diagonal covers.

    Returns:
        One dict of diagonals per leaf, each shaped like the leaf (per sample: ``[n, *p]``).

    Example:
        >>> fn, p = packfunc.functional(torch.nn.Linear(3, 2))
        >>> bp = Backprop(fn, p, torch.randn(4, 3), torch.tensor([0, 1, 1, 0]),
        ...               torch.nn.CrossEntropyLoss())
        >>> diagonals(bp, {"sum_grad_squared"}, slice(0, 4))[1]["sum_grad_squared"].shape
        torch.Size([2, 3])
    """
    ggn = ggn_statistics(bp, stats, index)
    with twice_differentiable():
        residual = _residual(bp, stats, index)
    return [{stat: ggn[leaf][stat] + residual[leaf][stat] for stat in stats}
            for leaf in range(len(bp.leaves))]


def _residual(bp: Backprop, stats: set[str], index: slice | Tensor) -> list[Stats]:
    """Diagonal of ``∇²φ`` per leaf: by layer-output products where possible."""
    sites_of: dict[int, list[int]] = {}
    for k in bp.record.inputs:
        for _, leaf in bp.plan.sites[k].call.leaves:
            sites_of.setdefault(leaf, []).append(k)
    by_site = {leaf: ks[0] for leaf, ks in sites_of.items()
               if leaf not in bp.generic and len(ks) == 1 and _single_position_linear(bp, ks[0])}
    others = sorted((set(sites_of) | set(bp.generic)) - set(by_site))
    result = [_zeros(leaf, stats, index) for leaf in bp.leaves]
    if by_site:
        unit_curvature = _layer_output_curvature(bp, sorted(set(by_site.values())))
        for leaf, k in by_site.items():
            role = dict((i, r) for r, i in bp.plan.sites[k].call.leaves)[leaf]
            result[leaf] = _site_stats(bp, k, role, unit_curvature[k], stats, index)
    if others:
        for leaf, found in zip(others, _parameter_curvature(bp, others, stats, index)):
            result[leaf] = found
    return result


def _single_position_linear(bp: Backprop, k: int) -> bool:
    site = bp.plan.sites[k]
    return site.call.family == "linear" and len(site.tail) == 1


def _zeros(param: Tensor, stats: set[str], index: slice | Tensor) -> Stats:
    return {stat: param.new_zeros((index_length(index), *param.shape))
            if stat == "batch_sum_squares" else torch.zeros_like(param) for stat in stats}


def _site_stats(bp: Backprop, k: int, role: str, curvature: Tensor, stats: set[str],
                index: slice | Tensor) -> Stats:
    """Residual diagonal of a linear weight or bias from ``d = diag(∂²φ/∂z²)``, ``[N, O]``."""
    x = bp.record.inputs[k]
    square = x.reshape(x.shape[0], -1).square() if role == "weight" else None
    found: Stats = {}
    if "sum_grad_squared" in stats:
        found["sum_grad_squared"] = curvature.sum(0) if square is None else curvature.T @ square
    if "batch_sum_squares" in stats:
        d = curvature[index]
        found["batch_sum_squares"] = d if square is None else d.unsqueeze(2) * square[index, None]
    return found


def _layer_output_curvature(bp: Backprop, sites: list[int]) -> dict[int, Tensor]:
    """``diag(∂²φ_n/∂z_n²)`` for the outputs ``z`` of the given sites, ``[N, O]`` each."""
    forward = probed_forward(bp.model_fn, bp.params, bp.leaves, bp.plan, bp.X)
    # forward-mode duals need tensors without overlapping memory: no stride-0 zeros here
    probes = {k: p.contiguous() for k, p in zero_probes(bp.plan, sites, bp.n).items()}
    cotangent = bp.record.output_cotangent

    def grad_phi(probes: dict[int, Tensor]) -> dict[int, Tensor]:
        return grad(lambda p: (forward(p)[0] * cotangent).sum())(probes)

    widths = {k: bp.plan.sites[k].tail[0] for k in sites}
    offsets = dict(zip(sites, [0, *torch.tensor(list(widths.values())).cumsum(0).tolist()]))
    total = sum(widths.values())
    found = {k: probes[k].new_zeros(bp.n, widths[k]) for k in sites}
    rows_at_once = max(1, DEFAULT_BUDGET // max(bp.n * bp.column_width(), 1))
    for rows in chunks(total, rows_at_once):
        units = torch.arange(rows.start, rows.stop, device=cotangent.device)
        picks = {k: (units.unsqueeze(1) == offsets[k] + torch.arange(
            widths[k], device=units.device)).to(probes[k].dtype) for k in sites}
        tangents = {k: pick.unsqueeze(1).expand(-1, bp.n, -1).contiguous()
                    for k, pick in picks.items()}
        products = vmap(lambda t: jvp(grad_phi, (probes,), (t,))[1])(tangents)
        for k in sites:
            found[k] = found[k] + (products[k] * tangents[k]).sum(0)
    return found


def _parameter_curvature(bp: Backprop, wanted: list[int], stats: set[str],
                         index: slice | Tensor) -> list[Stats]:
    """Diagonal of ``∇²φ`` w.r.t. the ``wanted`` leaves by one-hot Hessian-vector products."""
    chosen = [bp.leaves[i] for i in wanted]
    sizes = [p.numel() for p in chosen]
    offsets = [0, *torch.tensor(sizes).cumsum(0).tolist()]
    phi = _linearized(bp, wanted)
    results: list[Stats] = [{} for _ in wanted]
    if "sum_grad_squared" in stats:
        diag = _hvp_diagonal(phi, chosen, offsets, bp.X, bp.record.output_cotangent)
        for found, d, p in zip(results, diag, chosen):
            found["sum_grad_squared"] = d.view(p.shape)
    if "batch_sum_squares" in stats:
        def one_sample(x: Any, cotangent: Tensor) -> list[Tensor]:
            x = optree.tree_map(lambda t: t.unsqueeze(0), x)
            return _hvp_diagonal(phi, chosen, offsets, x, cotangent.unsqueeze(0))

        xs = select_samples(bp.X, index)
        per_sample = vmap(one_sample)(xs, bp.record.output_cotangent[index])
        for found, d, p in zip(results, per_sample, chosen):
            found["batch_sum_squares"] = d.view(d.shape[0], *p.shape)
    return results


def _linearized(bp: Backprop, wanted: list[int]) -> Callable[[list[Tensor], Any, Tensor], Tensor]:
    """``φ(chosen leaves, X, G) = ⟨G, model_fn(params, X)⟩`` as a function of some leaves."""

    def phi(chosen: list[Tensor], X: Any, cotangent: Tensor) -> Tensor:
        current = list(bp.leaves)
        for i, leaf in zip(wanted, chosen):
            current[i] = leaf
        with functional_mode():
            output = bp.model_fn(optree.tree_unflatten(bp.treespec, current), X)
        return (output * cotangent).sum()

    return phi


def _hvp_diagonal(phi: Callable, chosen: list[Tensor], offsets: list[int], X: Any,
                  cotangent: Tensor) -> list[Tensor]:
    """Diagonal of ``∇²φ`` w.r.t. ``chosen`` (flattened per leaf), from one-hot products."""
    total = offsets[-1]
    diagonal = [p.new_zeros(p.numel()) for p in chosen]
    gradient = grad(phi)
    for entries in chunks(total, max(1, DEFAULT_BUDGET // max(total, 1))):
        units = torch.arange(entries.start, entries.stop, device=chosen[0].device)
        picks = [(units.unsqueeze(1) == start + torch.arange(p.numel(), device=units.device)
                  ).to(p.dtype) for start, p in zip(offsets, chosen)]
        tangents = [pick.view(-1, *p.shape) for pick, p in zip(picks, chosen)]
        products = vmap(lambda t: jvp(lambda c: gradient(c, X, cotangent), (chosen,), (t,))[1]
                        )(tangents)
        diagonal = [d + (h.reshape(h.shape[0], -1) * pick).sum(0)
                    for d, h, pick in zip(diagonal, products, picks)]
    return diagonal
