"""Hessian diagonals of the reduced loss, summed or per sample.

The Hessian splits as ``Jᵀ H_f J + ∇²φ``: ``H_f`` is the loss Hessian w.r.t.
the output and ``φ(θ) = ⟨G, f(θ)⟩`` the model linearized in the loss gradient
``G`` (held fixed). The first term is the GGN (its diagonal comes from the
square-root columns, ``engine/statistics.py``), the second the *residual*
curvature of activations, attention and every other nonlinearity. Each leaf
takes the first of three paths that applies:

1. The model is piecewise affine along the leaf's coordinates (ReLU networks,
   residual connections, pooling, BatchNorm in evaluation mode, each layer
   used once; ``engine/piecewise.py`` checks the autograd graph): the residual
   diagonal vanishes and the Hessian diagonal is the GGN diagonal.
2. A linear layer used once: ``z = W x + b`` with ``x`` not depending on
   ``W``, so ``∂²L/∂W² = Σ_n (x_n x_nᵀ) ⊗ ∂²L/∂z_n²`` and the diagonal needs only
   ``d_n = diag(∂²L/∂z_n²)``: BackPACK's backward recursion for chains
   (``engine/chain.py``), else one Hessian-vector product per output unit of
   the layer, for all samples at once (the Hessian w.r.t. ``z`` is
   block-diagonal over samples).
3. Every other leaf: GGN diagonal plus the residual diagonal from exact
   Hessian-vector products of ``φ`` with one-hot tangents — per sample with
   ``φ_n = ⟨G_n, f(x_n, θ)⟩``. When only the summed diagonal is wanted, the
   one-hot products are taken of the loss itself, which gives the whole
   diagonal of these leaves without the GGN pass.

Hessian-vector products are reverse-over-reverse: in torch 2.13 that is ~25 %
faster than forward-over-reverse, whose rules for e.g. ``tanh_backward`` run
as TorchScript decompositions.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial, reduce
from typing import Any, cast

import optree
import torch
from torch import Tensor
from torch.func import grad, vmap

from packfunc.engine.autodiff import naming_missing_derivatives, over_samples, vjp
from packfunc.engine.batch_pass import BatchPass
from packfunc.engine.batch_record import probed_forward, zero_probes
from packfunc.engine.discovery import Recorded
from packfunc.engine.hessian_recursion import layer_output_curvature
from packfunc.engine.memory import DEFAULT_BUDGET, chunks, index_length
from packfunc.engine.modes import twice_differentiable
from packfunc.engine.piecewise import piecewise_affine_leaves
from packfunc.engine.precision import full_precision, to_dtype_of
from packfunc.engine.rules import rule_for
from packfunc.engine.statistics import ggn_statistics
from packfunc.engine.vocabulary import Statistic
from packfunc.engine.whole_model import output_with
from packfunc.functionalize import select_samples

Stats = dict[Statistic, Tensor]


def diagonals(bp: BatchPass, stats: set[Statistic], index: slice | Tensor) -> list[Stats]:
    """Diagonal of the Hessian, summed (``DIAGONAL``) or per sample (``DIAGONAL_PER_SAMPLE``).

    Args:
        bp: The batch pass.
        stats: ``{Statistic.DIAGONAL}``, ``{Statistic.DIAGONAL_PER_SAMPLE}`` or both.
        index: Samples that the per-sample diagonal covers.

    Returns:
        One dict of diagonals per leaf, each shaped like the leaf (per sample: ``[n, *p]``).

    Raises:
        NotImplementedError: where torch has no second derivative of an op, naming the GGN.

    Example:
        >>> fn, p = packfunc.functional(torch.nn.Linear(3, 2))
        >>> bp = BatchPass(fn, p, torch.randn(4, 3), torch.tensor([0, 1, 1, 0]),
        ...               torch.nn.CrossEntropyLoss())
        >>> diagonals(bp, {Statistic.DIAGONAL}, slice(0, 4))[1][Statistic.DIAGONAL].shape
        torch.Size([2, 3])
    """
    instead = (
        "Hessian diagonals differentiate the model twice, and torch has no second derivative "
        "of that op (torch.cdist's, for one): use the GGN quantities (diag_ggn, "
        "batch_diag_ggn) for this model."
    )
    # re-runs: see engine/precision.py
    with twice_differentiable(), full_precision(), naming_missing_derivatives("reverse", instead):
        return _diagonals(bp, stats, index)


def _diagonals(bp: BatchPass, stats: set[Statistic], index: slice | Tensor) -> list[Stats]:
    """Per leaf, the first that applies.

    * The model is piecewise affine in the leaf: the GGN diagonal.
    * A linear layer used once: from the curvature of the layer's output.
    * Otherwise GGN plus residual; for the summed diagonal alone, the loss's own
      one-hot Hessian-vector products instead (no GGN pass for these leaves).
    """
    sites_of: dict[int, list[int]] = {}
    for k in bp.record.inputs:
        for _, leaf in bp.plan.sites[k].call.leaves:
            sites_of.setdefault(leaf, []).append(k)
    used = set(sites_of) | set(bp.whole_model)
    flat = used & piecewise_affine_leaves(bp.model_fn, bp.leaves, bp.treespec, bp.X)
    by_site = {
        leaf: ks[0]
        for leaf, ks in sites_of.items()
        if leaf not in bp.whole_model
        and leaf not in flat
        and len(ks) == 1
        and _from_output_curvature(bp, ks[0])
    }
    others = sorted(used - set(by_site) - flat)
    result = [_zeros(leaf, stats, index) for leaf in bp.leaves]
    if by_site:
        sites = sorted(set(by_site.values()))
        unit_curvature = layer_output_curvature(bp, sites) or _layer_output_curvature_by_hvp(
            bp, sites
        )
        for leaf, k in by_site.items():
            role = dict((i, r) for r, i in bp.plan.sites[k].call.leaves)[leaf]
            result[leaf] = _site_stats(bp, k, role, unit_curvature[k], stats, index)
    loss_products = stats == {Statistic.DIAGONAL}
    if flat or (others and not loss_products):
        ggn = ggn_statistics(bp, stats, index)
        for leaf in flat:
            result[leaf] = {stat: ggn[leaf][stat] for stat in stats}
        if others and not loss_products:
            for leaf, found in zip(others, _parameter_curvature(bp, others, stats, index)):
                result[leaf] = {stat: ggn[leaf][stat] + found[stat] for stat in stats}
    if others and loss_products:
        for leaf, found in zip(others, _loss_curvature(bp, others)):
            result[leaf] = found
    return result


def _from_output_curvature(bp: BatchPass, k: int) -> bool:
    """Whether a site's Hessian diagonals follow from its output's curvature.

    It must be a tapped call with one position per sample whose parameters' rules say so
    (a linear layer on ``[N, in]``).
    """
    site = bp.plan.sites[k]
    recorded = isinstance(bp.record.inputs.get(k), Tensor)
    return (
        recorded
        and len(site.tail) == 1
        and all(
            rule_for(site.call, role).hessian_from_output_curvature for role, _ in site.call.leaves
        )
    )


def _zeros(param: Tensor, stats: set[Statistic], index: slice | Tensor) -> Stats:
    return {
        stat: param.new_zeros((index_length(index), *param.shape))
        if stat == Statistic.DIAGONAL_PER_SAMPLE
        else torch.zeros_like(param)
        for stat in stats
    }


def _site_stats(
    bp: BatchPass,
    k: int,
    role: str,
    curvature: Tensor,
    stats: set[Statistic],
    index: slice | Tensor,
) -> Stats:
    """Hessian diagonal of a linear weight or bias from ``d = diag(∂²L/∂z²)``, ``[N, O]``."""
    x = bp.record.inputs[k]
    assert isinstance(x, Tensor), "_from_output_curvature admits sites with recorded tensors"
    x = to_dtype_of(x, curvature)  # (recorded under the caller's autocast: bfloat16)
    square = x.reshape(x.shape[0], -1).square() if role == "weight" else None
    in_out = square is not None and bp.plan.sites[k].call.transposed  # a weight [in, out]
    found: Stats = {}
    if Statistic.DIAGONAL in stats:
        diagonal = curvature.sum(0) if square is None else curvature.T @ square
        found[Statistic.DIAGONAL] = diagonal.T if in_out else diagonal
    if Statistic.DIAGONAL_PER_SAMPLE in stats:
        d = curvature[index]
        per_sample = d if square is None else d.unsqueeze(2) * square[index, None]
        found[Statistic.DIAGONAL_PER_SAMPLE] = per_sample.transpose(1, 2) if in_out else per_sample
    return found


def _layer_output_curvature_by_hvp(bp: BatchPass, sites: list[int]) -> dict[int, Tensor]:
    """``diag(∂²L/∂z_n²)`` for the outputs ``z`` of the given sites, ``[N, O]`` each.

    One site at a time: its Hessian-vector products then only run back to that
    site, not to the earliest one.
    """
    bp.check_rerun("the Hessian of the layer outputs")
    forward = probed_forward(bp.model_fn, bp.params, bp.leaves, bp.plan, bp.X)
    found = {}
    for k in sites:
        probe = _full_precision_probe(bp, k)
        _, pullback = vjp(grad(partial(_loss_at_site, bp, forward, k)), probe)
        width = probe.shape[1]
        units_at_once = max(1, DEFAULT_BUDGET // max(bp.n * width, 1))
        parts = []
        for units in chunks(width, units_at_once):
            picked = torch.arange(units.start, units.stop, device=probe.device)
            onehot = picked.unsqueeze(1) == torch.arange(width, device=probe.device)
            (products,) = vmap(pullback)(onehot.to(probe.dtype).unsqueeze(1).expand(-1, bp.n, -1))
            parts.append(products[torch.arange(len(picked)), :, picked].T)  # [N, units]
        found[k] = torch.cat(parts, dim=1)
    return found


def _full_precision_probe(bp: BatchPass, k: int) -> Tensor:
    """A zero probe of site ``k``'s output in the dtype a full-precision re-run gives it.

    The plan's dtype is the forward's: bfloat16 for a plan made under autocast, where
    the re-run's output is in the parameters' dtype (a bfloat16 probe would round the
    curvature found through it).
    """
    probe = zero_probes(bp.plan, [k], bp.n)[k]
    leaves = (bp.leaves[leaf] for _, leaf in bp.plan.sites[k].call.leaves)
    return probe.to(reduce(torch.promote_types, (p.dtype for p in leaves), probe.dtype))


def _loss_curvature(bp: BatchPass, wanted: list[int]) -> list[Stats]:
    """Diagonal of the loss Hessian w.r.t. the ``wanted`` leaves by its own one-hot products."""
    bp.check_rerun(_SECOND_DERIVATIVES)  # (outside the transforms: a refusal puts buffers back)
    chosen = [bp.leaves[i] for i in wanted]

    def loss_of(leaves: list[Tensor]) -> Tensor:
        return cast(Tensor, bp.loss(_with_leaves(bp, wanted, leaves, bp.X), bp.y))

    diagonal = _hvp_diagonal(loss_of, chosen, _tangents_at_once(bp))
    return [{Statistic.DIAGONAL: d.view(p.shape)} for d, p in zip(diagonal, chosen)]


def _parameter_curvature(
    bp: BatchPass, wanted: list[int], stats: set[Statistic], index: slice | Tensor
) -> list[Stats]:
    """Diagonal of ``∇²φ`` w.r.t. the ``wanted`` leaves by one-hot Hessian-vector products."""
    bp.check_rerun(_SECOND_DERIVATIVES)
    chosen = [bp.leaves[i] for i in wanted]

    def phi(X: Any, cotangent: Tensor, leaves: list[Tensor]) -> Tensor:
        """``⟨G, f⟩``: the model linearized in the output cotangent ``G``."""
        return (_with_leaves(bp, wanted, leaves, X) * cotangent).sum()

    results: list[Stats] = [{} for _ in wanted]
    if Statistic.DIAGONAL in stats:
        at_once = _tangents_at_once(bp)
        diag = _hvp_diagonal(partial(phi, bp.X, bp.record.output_cotangent), chosen, at_once)
        for found, d, p in zip(results, diag, chosen):
            found[Statistic.DIAGONAL] = d.view(p.shape)
    if Statistic.DIAGONAL_PER_SAMPLE in stats:
        at_once = _tangents_at_once(bp, index_length(index))

        def one_sample(x: Any, cotangent: Tensor) -> list[Tensor]:
            x = optree.tree_map(lambda t: t.unsqueeze(0), x)
            return _hvp_diagonal(partial(phi, x, cotangent.unsqueeze(0)), chosen, at_once)

        xs = select_samples(bp.X, index)
        per_sample = (
            over_samples(one_sample)(xs, bp.record.output_cotangent[index])
            if index_length(index)
            else [p.new_zeros((0, p.numel())) for p in chosen]  # (vmap of no samples fails)
        )
        for found, d, p in zip(results, per_sample, chosen):
            found[Statistic.DIAGONAL_PER_SAMPLE] = d.view(d.shape[0], *p.shape)
    return results


def _with_leaves(bp: BatchPass, wanted: list[int], chosen: list[Tensor], X: Any) -> Tensor:
    """The model output at ``X`` with the ``wanted`` leaves replaced by ``chosen``.

    Its callers refuse a model that cannot run again first (:meth:`BatchPass.check_rerun`).
    """
    return output_with(bp.model_fn, bp.leaves, bp.treespec, dict(zip(wanted, chosen)), X)


_SECOND_DERIVATIVES = "the Hessian's second derivatives"
"""What re-runs the model for :func:`_loss_curvature` and :func:`_parameter_curvature`."""


def _tangents_at_once(bp: BatchPass, samples: int | None = None) -> int:
    """One-hot tangents per vmapped Hessian-vector product, within the memory budget.

    Each tangent carries its own copy of the activations of ``samples`` samples
    (default: the batch), which the recorded calls' widths measure.
    """
    return max(1, DEFAULT_BUDGET // max((samples or bp.n) * bp.column_width(), 1))


def _hvp_diagonal(
    scalar: Callable[[list[Tensor]], Tensor], chosen: list[Tensor], at_once: int
) -> list[Tensor]:
    """Diagonal of the Hessian of ``scalar`` w.r.t. ``chosen`` (flattened per leaf).

    One-hot tangents, ``at_once`` at a time (fewer if their ``[at_once, total]``
    products would exceed the memory budget), are pushed through
    reverse-over-reverse Hessian-vector products.
    """
    sizes = [p.numel() for p in chosen]
    offsets = [0, *torch.tensor(sizes).cumsum(0).tolist()]
    total = offsets[-1]
    diagonal = [p.new_zeros(p.numel()) for p in chosen]
    _, pullback = vjp(grad(scalar), chosen)
    for entries in chunks(total, min(at_once, max(1, DEFAULT_BUDGET // max(total, 1)))):
        units = torch.arange(entries.start, entries.stop, device=chosen[0].device)
        picks = [
            (units.unsqueeze(1) == start + torch.arange(p.numel(), device=units.device)).to(p.dtype)
            for start, p in zip(offsets, chosen)
        ]
        (products,) = vmap(pullback)([pick.view(-1, *p.shape) for pick, p in zip(picks, chosen)])
        diagonal = [
            d + (h.reshape(h.shape[0], -1) * pick).sum(0)
            for d, h, pick in zip(diagonal, products, picks)
        ]
    return diagonal


def _loss_at_site(
    bp: BatchPass,
    forward: Callable[[dict[int, Tensor]], tuple[Tensor, dict[int, Recorded]]],
    k: int,
    probe: Tensor,
) -> Tensor:
    """The loss as a function of the probe added to site ``k``'s output."""
    return cast(Tensor, bp.loss(forward({k: probe})[0], bp.y))
