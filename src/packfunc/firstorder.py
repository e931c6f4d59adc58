"""First-order quantities: per-sample gradients and their moments.

Scaling follows BackPACK: ``batch_grad[n]`` is the gradient of sample ``n``'s
term of the *reduced* loss, so ``batch_grad.sum(0)`` is the gradient. Every
function returns a pytree shaped like ``params``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import optree
import torch
from torch import Tensor, nn

from packfunc.engine.memory import chunks
from packfunc.engine.persample import PerSampleGradients
from packfunc.functional import as_index
from packfunc.losses import default_loss

QUANTITIES = ("grad", "batch_grad", "batch_l2_grad", "sum_grad_squared", "variance")
"""Names accepted by :func:`first_order`."""

_STATS = {
    "grad": {"grad"},
    "batch_grad": {"batch_grad"},
    "batch_l2_grad": {"batch_l2"},
    "sum_grad_squared": {"sum_grad_squared"},
    "variance": {"sum_grad_squared", "grad"},
}
_PER_SAMPLE = {"batch_grad", "batch_l2"}


def first_order(
    model_fn: Callable,
    params: Any,
    X: Any,
    y: Tensor,
    *,
    quantities: Sequence[str] = QUANTITIES,
    loss: nn.Module | None = None,
    subsampling: Sequence[int] | Tensor | None = None,
    chunk_size: int | None = None,
) -> dict[str, Any]:
    """Compute several first-order quantities in one pass.

    One forward and one vector-Jacobian product are shared by all quantities;
    closed forms avoid materializing ``[N, *param]`` where a layer allows it.

    Args:
        model_fn: ``model_fn(params, X) -> output``.
        params: Pytree of floating-point tensors.
        X: Inputs (tensor or pytree) with leading batch dimension ``N``.
        y: Targets with leading batch dimension.
        quantities: Any of ``"grad"``, ``"batch_grad"``, ``"batch_l2_grad"``,
            ``"sum_grad_squared"``, ``"variance"``.
        loss: A ``torch.nn`` loss with ``reduction`` ``'mean'`` or ``'sum'``
            (default ``CrossEntropyLoss()``).
        subsampling: Sample indices for the per-sample quantities (``batch_grad``,
            ``batch_l2_grad``); moments always use the whole batch.
        chunk_size: Samples per chunk when per-sample gradients must be
            materialized (``None``: automatic, bounded memory).

    Returns:
        A dict with ``"loss"`` (the reduced loss) and one pytree shaped like
        ``params`` per requested quantity.

    Raises:
        ValueError: for an unknown quantity name, a bad loss reduction or shapes.
        TypeError: for an unsupported loss or non-floating params.

    Example:
        >>> model_fn, params = packfunc.functional(torch.nn.Linear(3, 2))
        >>> X, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
        >>> out = first_order(model_fn, params, X, y, quantities=("batch_grad", "variance"))
        >>> out["batch_grad"]["weight"].shape, out["variance"]["bias"].shape
        (torch.Size([8, 2, 3]), torch.Size([2]))
    """
    unknown = set(quantities) - set(QUANTITIES)
    if unknown:
        raise ValueError(f"unknown quantities {sorted(unknown)}; choose from {QUANTITIES}.")
    stats = set().union(*(_STATS[q] for q in quantities))
    grads = PerSampleGradients(model_fn, params, X, y, loss or default_loss(), chunk_size)
    index = as_index(subsampling, grads.n, grads.record.output.device)
    per_leaf = _leaf_stats(grads, stats, index)
    result: dict[str, Any] = {"loss": grads.loss}
    for q in quantities:
        values = [_quantity(q, stats_of_leaf, grads.n) for stats_of_leaf in per_leaf]
        result[q] = optree.tree_unflatten(grads.treespec, values)
    return result


def _quantity(name: str, stats: dict[str, Tensor], n: int) -> Tensor:
    """Assemble a public quantity from a leaf's statistics."""
    if name == "variance":
        return stats["sum_grad_squared"] / n - (stats["grad"] / n) ** 2
    return stats["batch_l2" if name == "batch_l2_grad" else name]


def _leaf_stats(grads: PerSampleGradients, stats: set[str], index: slice | Tensor
                ) -> list[dict[str, Tensor]]:
    """Return, per leaf, the statistics in ``stats``; closed forms first.

    The gradient is summed from materialized per-sample gradients when the
    squared sum is (one pass over them serves both), else taken in closed form.
    """
    per_leaf: list[dict[str, Tensor]] = [{} for _ in grads.leaves]
    for leaf, found in enumerate(per_leaf):
        for stat in stats - {"batch_grad", "grad"}:
            value = grads.closed_form(leaf, stat)
            if value is not None:
                found[stat] = value[index] if stat == "batch_l2" else value
        squares_materialized = "sum_grad_squared" in stats - found.keys()
        if "grad" in stats and not squares_materialized:
            value = grads.closed_form(leaf, "grad")
            if value is not None:
                found["grad"] = value
    tapped = [i for i in range(len(grads.leaves)) if i not in grads.generic]
    for group in [[i] for i in tapped] + [grads.generic]:
        missing = stats - per_leaf[group[0]].keys() if group else set()
        if missing:
            for leaf, found in zip(group, _materialized(grads, group, missing, index)):
                per_leaf[leaf].update(found)
    return per_leaf


def _materialized(grads: PerSampleGradients, group: list[int], stats: set[str],
                  index: slice | Tensor) -> list[dict[str, Tensor]]:
    """Reduce materialized per-sample gradients of ``group`` to ``stats``.

    Per-sample statistics cover ``index``; moments cover the whole batch. One
    pass serves both when ``index`` is the whole batch.
    """
    everyone = slice(0, grads.n)
    whole = isinstance(index, slice) and index == everyone
    per_sample, moments = stats & _PER_SAMPLE, stats - _PER_SAMPLE
    if whole or not per_sample or not moments:
        return _reduce(grads.iter_batch_grads(group, index if per_sample else everyone), stats)
    first = _reduce(grads.iter_batch_grads(group, index), per_sample)
    second = _reduce(grads.iter_batch_grads(group, everyone), moments)
    return [a | b for a, b in zip(first, second)]


def _reduce(parts: Iterable[list[Tensor]], stats: set[str]) -> list[dict[str, Tensor]]:
    """Fold chunks of per-sample gradients (one tensor per leaf) into statistics."""
    collected: list[dict[str, list[Tensor]]] | None = None
    for chunk in parts:
        if collected is None:
            collected = [{stat: [] for stat in stats} for _ in chunk]
        for found, per_sample in zip(collected, chunk):
            for stat in stats:
                found[stat].append(_statistic(stat, per_sample))
    if collected is None:
        raise ValueError("the batch is empty; pass at least one sample.")
    return [{stat: _combine(stat, values) for stat, values in found.items()}
            for found in collected]


_SQUARES_AT_ONCE = 2**20
"""Elements squared per temporary: small enough for the allocator to reuse its memory."""


def _statistic(stat: str, per_sample: Tensor) -> Tensor:
    """One chunk's contribution to a statistic, without a temporary of the chunk's size."""
    n = per_sample.shape[0]
    if stat == "batch_grad":
        return per_sample
    if stat == "grad":
        return per_sample.sum(0)
    if stat == "batch_l2":
        return torch.linalg.vector_norm(per_sample.reshape(n, -1), dim=1).square()
    length = max(1, _SQUARES_AT_ONCE // max(per_sample[0].numel(), 1))
    return sum(per_sample[s].square().sum(0) for s in chunks(n, length))


def _combine(stat: str, values: list[Tensor]) -> Tensor:
    """Join the chunks' contributions to a statistic."""
    if stat in _PER_SAMPLE:
        return values[0] if len(values) == 1 else torch.cat(values)
    return values[0] if len(values) == 1 else sum(values[1:], values[0])


def _single(quantity: str, model_fn: Callable, params: Any, X: Any, y: Tensor, **kwargs: Any
            ) -> Any:
    return first_order(model_fn, params, X, y, quantities=(quantity,), **kwargs)[quantity]


def batch_grad(model_fn: Callable, params: Any, X: Any, y: Tensor, *,
               loss: nn.Module | None = None,
               subsampling: Sequence[int] | Tensor | None = None,
               chunk_size: int | None = None) -> Any:
    """Per-sample gradients (BackPACK's ``BatchGrad``, ``grad_batch``).

    Args:
        model_fn: ``model_fn(params, X) -> output``.
        params: Pytree of floating-point tensors.
        X: Inputs with leading batch dimension ``N``.
        y: Targets.
        loss: Loss module (default ``CrossEntropyLoss()``).
        subsampling: Only these samples (default: all).
        chunk_size: Samples per chunk on the generic path (default: automatic).

    Returns:
        Pytree like ``params``; leaf ``[N, *p]`` (or ``[len(subsampling), *p]``)
        with ``batch_grad.sum(0)`` equal to the gradient of the reduced loss.

    Example:
        >>> model_fn, params = packfunc.functional(torch.nn.Linear(3, 2))
        >>> g = batch_grad(model_fn, params, torch.randn(5, 3), torch.randint(0, 2, (5,)))
        >>> g["weight"].shape
        torch.Size([5, 2, 3])
    """
    return _single("batch_grad", model_fn, params, X, y, loss=loss, subsampling=subsampling,
                   chunk_size=chunk_size)


def batch_l2_grad(model_fn: Callable, params: Any, X: Any, y: Tensor, *,
                  loss: nn.Module | None = None,
                  subsampling: Sequence[int] | Tensor | None = None,
                  chunk_size: int | None = None) -> Any:
    """Squared L2 norm of each per-sample gradient, per leaf (BackPACK's ``BatchL2Grad``).

    Args:
        model_fn: ``model_fn(params, X) -> output``.
        params: Pytree of floating-point tensors.
        X: Inputs with leading batch dimension ``N``.
        y: Targets.
        loss: Loss module (default ``CrossEntropyLoss()``).
        subsampling: Only these samples (default: all).
        chunk_size: Samples per chunk where gradients are materialized.

    Returns:
        Pytree like ``params``; leaf ``[N]`` with ``‖batch_grad[n]‖²``.

    Example:
        >>> model_fn, params = packfunc.functional(torch.nn.Linear(3, 2))
        >>> l2 = batch_l2_grad(model_fn, params, torch.randn(5, 3), torch.randint(0, 2, (5,)))
        >>> l2["bias"].shape
        torch.Size([5])
    """
    return _single("batch_l2_grad", model_fn, params, X, y, loss=loss, subsampling=subsampling,
                   chunk_size=chunk_size)


def sum_grad_squared(model_fn: Callable, params: Any, X: Any, y: Tensor, *,
                     loss: nn.Module | None = None, chunk_size: int | None = None) -> Any:
    """Sum over samples of squared per-sample gradients (BackPACK's ``SumGradSquared``).

    Args:
        model_fn: ``model_fn(params, X) -> output``.
        params: Pytree of floating-point tensors.
        X: Inputs with leading batch dimension ``N``.
        y: Targets.
        loss: Loss module (default ``CrossEntropyLoss()``).
        chunk_size: Samples per chunk where gradients are materialized.

    Returns:
        Pytree like ``params``; leaf ``Σ_n batch_grad[n]²``.

    Example:
        >>> model_fn, params = packfunc.functional(torch.nn.Linear(3, 2))
        >>> s = sum_grad_squared(model_fn, params, torch.randn(5, 3), torch.randint(0, 2, (5,)))
        >>> s["weight"].shape
        torch.Size([2, 3])
    """
    return _single("sum_grad_squared", model_fn, params, X, y, loss=loss, chunk_size=chunk_size)


def variance(model_fn: Callable, params: Any, X: Any, y: Tensor, *,
             loss: nn.Module | None = None, chunk_size: int | None = None) -> Any:
    """Variance of the per-sample gradients over the batch (BackPACK's ``Variance``).

    Args:
        model_fn: ``model_fn(params, X) -> output``.
        params: Pytree of floating-point tensors.
        X: Inputs with leading batch dimension ``N``.
        y: Targets.
        loss: Loss module (default ``CrossEntropyLoss()``).
        chunk_size: Samples per chunk where gradients are materialized.

    Returns:
        Pytree like ``params``; leaf ``mean_n(batch_grad²) − mean_n(batch_grad)²``.

    Example:
        >>> model_fn, params = packfunc.functional(torch.nn.Linear(3, 2))
        >>> v = variance(model_fn, params, torch.randn(5, 3), torch.randint(0, 2, (5,)))
        >>> v["bias"].shape
        torch.Size([2])
    """
    return _single("variance", model_fn, params, X, y, loss=loss, chunk_size=chunk_size)
