"""Reduce column gradients to the statistics quantities are made of.

Statistics of a leaf, for column gradients ``c[k, n] = batch_grad[k, n]``:

* ``batch_grad``: ``c`` itself, ``[K, n, *p]`` over the requested samples;
* ``batch_l2``: ``Σ_k ‖c[k, n]‖²``, ``[n]``;
* ``batch_sum_squares``: ``Σ_k c[k, n]²``, ``[n, *p]``;
* ``grad``: ``Σ_{k,n} c[k, n]`` and ``sum_grad_squared``: ``Σ_{k,n} c[k, n]²``, over all samples.

Closed forms come first; what is left is reduced from column gradients
materialized in chunks, one pass serving every missing statistic.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from packfunc.engine.memory import chunk_length, chunks
from packfunc.engine.persample import Backprop, ColumnGradients
from packfunc.losses import hessian_factors

PER_SAMPLE = frozenset({"batch_grad", "batch_l2", "batch_sum_squares"})
"""Statistics with one entry per requested sample; the others sum over the whole batch."""

_SQUARES_AT_ONCE = 2**20
"""Elements squared per temporary: small enough for the allocator to reuse its memory."""


def leaf_statistics(
    columns: ColumnGradients, stats: set[str], index: slice | Tensor
) -> list[dict[str, Tensor]]:
    """Return, per leaf, the statistics in ``stats``.

    The gradient is summed from materialized column gradients when the squared
    sum is (one pass over them serves both), else taken in closed form.

    Args:
        columns: Column gradients of every leaf.
        stats: Names of the statistics wanted.
        index: Samples that per-sample statistics cover.

    Returns:
        One dict of statistics per leaf.

    Example:
        >>> fn, p = packfunc.functional(torch.nn.Linear(3, 2))
        >>> bp = Backprop(fn, p, torch.randn(4, 3), torch.tensor([0, 1, 1, 0]),
        ...               torch.nn.CrossEntropyLoss())
        >>> stats = leaf_statistics(bp.gradient_columns(), {"batch_l2"}, slice(0, 4))
        >>> stats[0]["batch_l2"].shape
        torch.Size([4])
    """
    everyone = slice(0, columns.bp.n)
    per_leaf: list[dict[str, Tensor]] = [{} for _ in columns.bp.leaves]
    for leaf, found in enumerate(per_leaf):
        for stat in stats - {"batch_grad", "grad"}:
            value = columns.closed_form(leaf, stat, index if stat in PER_SAMPLE else everyone)
            if value is not None:
                found[stat] = value
        squares_materialized = "sum_grad_squared" in stats - found.keys()
        if "grad" in stats and not squares_materialized:
            value = columns.closed_form(leaf, "grad", everyone)
            if value is not None:
                found["grad"] = value
    tapped = [i for i in range(len(columns.bp.leaves)) if i not in columns.bp.generic]
    for group in [[i] for i in tapped] + [columns.bp.generic]:
        missing = stats - per_leaf[group[0]].keys() if group else set()
        if missing:
            for leaf, found in zip(group, _materialized(columns, group, missing, index)):
                per_leaf[leaf].update(found)
    return per_leaf


def _materialized(
    columns: ColumnGradients, group: list[int], stats: set[str], index: slice | Tensor
) -> list[dict[str, Tensor]]:
    """Reduce materialized column gradients of ``group`` to ``stats``.

    Per-sample statistics cover ``index``; the others the whole batch. One
    pass serves both when ``index`` is the whole batch.
    """
    everyone = slice(0, columns.bp.n)
    whole = isinstance(index, slice) and index == everyone
    per_sample, totals = stats & PER_SAMPLE, stats - PER_SAMPLE
    if whole or not per_sample or not totals:
        samples = index if per_sample else everyone
        return _reduce(columns.iter_batch_grads(group, samples), stats)
    first = _reduce(columns.iter_batch_grads(group, index), per_sample)
    second = _reduce(columns.iter_batch_grads(group, everyone), totals)
    return [a | b for a, b in zip(first, second)]


def _reduce(parts: Iterable[list[Tensor]], stats: set[str]) -> list[dict[str, Tensor]]:
    """Fold chunks of column gradients (one ``[K, n, *p]`` tensor per leaf) into statistics."""
    collected: list[dict[str, list[Tensor]]] | None = None
    for chunk in parts:
        if collected is None:
            collected = [{stat: [] for stat in stats} for _ in chunk]
        for found, per_sample in zip(collected, chunk):
            for stat in stats:
                found[stat].append(_statistic(stat, per_sample))
    if collected is None:
        raise ValueError("the batch is empty; pass at least one sample.")
    return [{stat: _combine(stat, values) for stat, values in found.items()} for found in collected]


def _statistic(stat: str, columns: Tensor) -> Tensor:
    """One chunk's contribution to a statistic, without a temporary of the chunk's size."""
    if stat == "batch_grad":
        return columns
    if stat == "grad":
        return columns.sum((0, 1))
    if stat == "batch_l2":
        per_sample = columns.transpose(0, 1).reshape(columns.shape[1], -1)
        return torch.linalg.vector_norm(per_sample, dim=1).square()
    if stat == "batch_sum_squares":
        return columns.square().sum(0)
    flat = columns.reshape(-1, *columns.shape[2:])
    length = max(1, _SQUARES_AT_ONCE // max(flat[0].numel(), 1))
    total = torch.zeros_like(flat[0])
    for s in chunks(flat.shape[0], length):
        total = total + flat[s].square().sum(0)
    return total


def _combine(stat: str, values: list[Tensor]) -> Tensor:
    """Join the chunks' contributions to a statistic."""
    if len(values) == 1:
        return values[0]
    if stat == "batch_grad":
        return torch.cat(values, dim=1)
    if stat in PER_SAMPLE:
        return torch.cat(values)
    return sum(values[1:], values[0])


def ggn_statistics(
    bp: Backprop,
    stats: set[str],
    index: slice | Tensor,
    mc_samples: int | None = None,
    generator: torch.Generator | None = None,
) -> list[dict[str, Tensor]]:
    """Statistics of the columns of the GGN's square root, ``J_nᵀ S_n``, per leaf.

    The loss Hessian's square-root columns are pulled back in slices small
    enough for the memory budget; the slices' statistics are combined.

    Args:
        bp: The batch pass.
        stats: Names of the statistics wanted.
        index: Samples that per-sample statistics cover.
        mc_samples: ``None`` for the exact GGN, else Monte-Carlo samples.
        generator: Random generator for the samples.

    Returns:
        One dict of statistics per leaf.

    Example:
        >>> fn, p = packfunc.functional(torch.nn.Linear(3, 2))
        >>> bp = Backprop(fn, p, torch.randn(4, 3), torch.tensor([0, 1, 1, 0]),
        ...               torch.nn.CrossEntropyLoss())
        >>> ggn_statistics(bp, {"batch_grad"}, slice(0, 4))[1]["batch_grad"].shape
        torch.Size([2, 4, 2, 3])
    """
    factors = hessian_factors(
        bp.loss, bp.record.output, bp.y, mc_samples=mc_samples, generator=generator
    )
    length = chunk_length(factors.count, bp.n * bp.column_width(), None)
    parts = [
        leaf_statistics(bp.columns(factors.make(s)), stats, index)
        for s in chunks(factors.count, length)
    ]
    return [_join_columns([part[leaf] for part in parts]) for leaf in range(len(bp.leaves))]


def _join_columns(parts: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Combine the statistics of consecutive slices of columns."""
    if len(parts) == 1:
        return parts[0]
    joined = {}
    for stat in parts[0]:
        values = [part[stat] for part in parts]
        joined[stat] = torch.cat(values) if stat == "batch_grad" else sum(values[1:], values[0])
    return joined
