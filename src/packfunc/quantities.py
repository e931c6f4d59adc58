"""Every quantity, computed together: one batch pass shared by all of them.

A quantity is a statistic of *column gradients* (see ``engine/statistics.py``)
for one source of output cotangents: the loss gradient (first order) or the
columns of the loss Hessian's square root (the GGN, exact or Monte-Carlo);
Hessian diagonals come from ``engine/hessian.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import optree
import torch
from torch import Tensor, nn

from packfunc.data import BatchToXY, over_data
from packfunc.distributed import ProcessGroup
from packfunc.engine import hessian
from packfunc.engine.batch_pass import BatchPass, check_pass_arguments
from packfunc.engine.statistics import ggn_statistics, leaf_statistics
from packfunc.engine.vocabulary import Statistic
from packfunc.functionalize import as_index, batch_size
from packfunc.losses import check_loss_inputs, default_loss
from packfunc.types import Targets

Stats = dict[Statistic, Tensor]

Source = Literal["gradient", "ggn", "hessian"]
"""Where the output cotangents come from: the loss gradient, the columns of the loss
Hessian's square root, or (for Hessian diagonals) the exact Hessian."""


@dataclass(frozen=True)
class Quantity:
    """How a public quantity is made: its cotangent source, statistics and final step."""

    source: Source
    stats: frozenset[Statistic]
    finish: Callable[[Stats, int], Tensor]


def _made_of(source: Source, stat: Statistic) -> Quantity:
    """The quantity that is one statistic of one source."""
    return Quantity(source, frozenset({stat}), lambda stats, n: stats[stat])


def _variance(stats: Stats, n: int) -> Tensor:
    return stats[Statistic.DIAGONAL] / n - (stats[Statistic.SUM] / n) ** 2


def _per_sample_gradients(stats: Stats, n: int) -> Tensor:
    return stats[Statistic.COLUMNS][0]  # one column: the loss gradient


QUANTITIES: dict[str, Quantity] = {
    "grad": _made_of("gradient", Statistic.SUM),
    "batch_grad": Quantity("gradient", frozenset({Statistic.COLUMNS}), _per_sample_gradients),
    "batch_l2_grad": _made_of("gradient", Statistic.SQUARED_NORMS),
    "sum_grad_squared": _made_of("gradient", Statistic.DIAGONAL),
    "variance": Quantity("gradient", frozenset({Statistic.DIAGONAL, Statistic.SUM}), _variance),
    "sqrt_ggn": _made_of("ggn", Statistic.COLUMNS),
    "diag_ggn": _made_of("ggn", Statistic.DIAGONAL),
    "batch_diag_ggn": _made_of("ggn", Statistic.DIAGONAL_PER_SAMPLE),
    "diag_hessian": _made_of("hessian", Statistic.DIAGONAL),
    "batch_diag_hessian": _made_of("hessian", Statistic.DIAGONAL_PER_SAMPLE),
}
"""Every name :func:`compute` accepts."""

FIRST_ORDER = ("grad", "batch_grad", "batch_l2_grad", "sum_grad_squared", "variance")
"""The first-order quantities."""

SECOND_ORDER = ("sqrt_ggn", "diag_ggn", "batch_diag_ggn", "diag_hessian", "batch_diag_hessian")
"""The second-order quantities."""


@over_data("compute")
def compute(
    model_fn: Callable,
    params: Any,
    X: Any = None,
    y: Targets = None,
    *,
    quantities: Sequence[str],
    loss: nn.Module | None = None,
    subsampling: Sequence[int] | Tensor | None = None,
    mc_samples: int | None = None,
    generator: torch.Generator | None = None,
    chunk_size: int | None = None,
    data: Iterable[Any] | None = None,
    batch_to_xy: BatchToXY | None = None,
    progress: bool = False,
    process_group: ProcessGroup | None = None,
) -> dict[str, Any]:
    """Compute several quantities in one pass over the model.

    One forward and one vector-Jacobian product are shared by all quantities;
    closed forms avoid materializing per-sample tensors where a layer allows it.

    Args:
        model_fn: ``model_fn(params, X) -> output``.
        params: Pytree of floating-point tensors.
        X: Inputs (tensor or pytree) with leading batch dimension ``N``.
        y: Targets with leading batch dimension.
        quantities: Names from :data:`QUANTITIES` (one string is one name): ``grad``,
            ``batch_grad``, ``batch_l2_grad``, ``sum_grad_squared``, ``variance``,
            ``sqrt_ggn``, ``diag_ggn``, ``batch_diag_ggn``, ``diag_hessian``,
            ``batch_diag_hessian``. Kronecker factors (``pf.kfac``, ``pf.kflr``,
            ``pf.kfra``) and curvature products have their own functions.
        loss: A ``torch.nn`` loss with ``reduction`` ``'mean'`` or ``'sum'``
            (default ``CrossEntropyLoss()``).
        subsampling: Sample indices for the per-sample quantities (``batch_grad``,
            ``batch_l2_grad``, ``sqrt_ggn``, ``batch_diag_ggn``, ``batch_diag_hessian``);
            the others always use the whole batch.
        mc_samples: ``None``: exact GGN; an int: Monte-Carlo GGN with that many samples.
        generator: Random generator for the Monte-Carlo samples.
        chunk_size: Samples per chunk when per-sample tensors must be
            materialized (``None``: automatic, bounded memory).
        data: An iterable of ``(X, y)`` batches in place of ``X, y`` (aggregate
            quantities only; see :mod:`packfunc.data`).
        batch_to_xy: Function from one item of ``data`` to ``(X, y)``.
        progress: Show a tqdm progress bar over the batches.
        process_group: A ``torch.distributed`` group to combine the ranks' shards
            (see :mod:`packfunc.distributed`).

    Returns:
        A dict with ``"loss"`` (the reduced loss) and one pytree shaped like
        ``params`` per requested quantity.

    Raises:
        ValueError: for an unknown quantity name, a bad loss reduction or shapes.
        TypeError: for an unsupported loss or non-floating params.

    Example:
        >>> model_fn, params = packfunc.functional(torch.nn.Linear(3, 2))
        >>> X, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
        >>> out = compute(model_fn, params, X, y, quantities=("batch_grad", "diag_ggn"))
        >>> out["batch_grad"]["weight"].shape, out["diag_ggn"]["bias"].shape
        (torch.Size([8, 2, 3]), torch.Size([2]))
    """
    quantities = _quantity_names(quantities)
    if set(quantities) == {"grad"}:
        return plain_gradient(model_fn, params, X, y, loss or default_loss(), chunk_size)
    bp = BatchPass(model_fn, params, X, y, loss or default_loss(), chunk_size)
    return evaluate(bp, quantities, subsampling, mc_samples, generator)


def plain_gradient(
    model_fn: Callable, params: Any, X: Any, y: Targets, loss: nn.Module, chunk_size: int | None
) -> dict[str, Any]:
    """The gradient alone: one forward and one backward, nothing recorded.

    Checks its arguments as :class:`~packfunc.engine.batch_pass.BatchPass` does.

    Args:
        model_fn: As in :func:`compute`.
        params: As in :func:`compute`.
        X: As in :func:`compute`.
        y: As in :func:`compute`.
        loss: A supported loss module.
        chunk_size: Checked only (nothing is chunked).

    Returns:
        ``{"loss": reduced loss, "grad": pytree like params}``.

    Example:
        >>> fn, p = packfunc.functional(torch.nn.Linear(3, 2))
        >>> plain_gradient(fn, p, torch.randn(4, 3), torch.tensor([0, 1, 1, 0]),
        ...                torch.nn.CrossEntropyLoss(), None)["grad"]["weight"].shape
        torch.Size([2, 3])
    """
    check_pass_arguments(model_fn, params, loss, chunk_size)
    leaves, treespec = optree.tree_flatten(params)
    n = batch_size(X)
    with torch.enable_grad():
        watched = [leaf.detach().requires_grad_() for leaf in leaves]
        output = model_fn(optree.tree_unflatten(treespec, watched), X)
        check_loss_inputs(loss, output, y, n)
        value = loss(output, y)
        grads = torch.autograd.grad(value, watched, allow_unused=True, materialize_grads=True)
    return {"loss": value.detach(), "grad": optree.tree_unflatten(treespec, list(grads))}


def compute_one(
    quantity: str, model_fn: Callable, params: Any, X: Any, y: Tensor, **options: Any
) -> Any:
    """Compute one quantity (see :func:`compute`); the public wrappers call this.

    Args:
        quantity: A name from :data:`QUANTITIES`.
        model_fn: As in :func:`compute`.
        params: As in :func:`compute`.
        X: As in :func:`compute`.
        y: As in :func:`compute`.
        **options: Keyword arguments of :func:`compute`.

    Returns:
        The quantity, a pytree like ``params``.

    Example:
        >>> fn, p = packfunc.functional(torch.nn.Linear(3, 2))
        >>> compute_one("grad", fn, p, torch.randn(4, 3), torch.tensor([0, 1, 1, 0]))["bias"].shape
        torch.Size([2])
    """
    return compute(model_fn, params, X, y, quantities=(quantity,), **options)[quantity]


_OWN_FUNCTIONS = (
    "kfac",
    "kflr",
    "kfra",
    "ggn_vector_product",
    "hessian_vector_product",
    "ggn_block_products",
    "hessian_block_products",
    "pch_block_products",
)
"""Public functions that :func:`compute` does not cover (their options differ)."""


def _quantity_names(quantities: Sequence[str]) -> tuple[str, ...]:
    """The requested names as a tuple (one string is one name), all known.

    Args:
        quantities: The ``quantities=`` argument of :func:`compute`.

    Returns:
        The names, in order.

    Raises:
        ValueError: for an unknown name; Kronecker factors and products are named
            with the function that computes them.
    """
    names = (quantities,) if isinstance(quantities, str) else tuple(quantities)
    unknown = [name for name in names if name not in QUANTITIES]
    if not unknown:
        return names
    own = [name for name in unknown if name in _OWN_FUNCTIONS]
    hint = (
        (
            f" {own} are computed by their own functions: call "
            + ", ".join(f"pf.{name}(...)" for name in own)
            + " instead."
        )
        if own
        else ""
    )
    raise ValueError(
        f"unknown quantities {unknown}; compute() takes names from {list(QUANTITIES)}.{hint}"
    )


def evaluate(
    bp: BatchPass,
    quantities: Sequence[str],
    subsampling: Sequence[int] | Tensor | None = None,
    mc_samples: int | None = None,
    generator: torch.Generator | None = None,
) -> dict[str, Any]:
    """Compute quantities from an existing batch pass (see :func:`compute`).

    Args:
        bp: The batch pass.
        quantities: Names from :data:`QUANTITIES`.
        subsampling: Sample indices for the per-sample quantities.
        mc_samples: ``None`` (exact GGN) or the number of Monte-Carlo samples.
        generator: Random generator for the samples.

    Returns:
        As :func:`compute`.

    Example:
        >>> fn, p = packfunc.functional(torch.nn.Linear(3, 2))
        >>> bp = BatchPass(fn, p, torch.randn(4, 3), torch.tensor([0, 1, 1, 0]),
        ...               torch.nn.CrossEntropyLoss())
        >>> evaluate(bp, ("grad",))["grad"]["bias"].shape
        torch.Size([2])
    """
    index = as_index(subsampling, bp.n, bp.record.output.device)
    wanted: dict[Source, set[Statistic]] = {}
    for name in quantities:
        wanted.setdefault(QUANTITIES[name].source, set()).update(QUANTITIES[name].stats)
    stats = {
        source: _source_statistics(bp, source, needed, index, mc_samples, generator)
        for source, needed in wanted.items()
    }
    result: dict[str, Any] = {"loss": bp.loss_value}
    for name in quantities:
        quantity = QUANTITIES[name]
        values = [quantity.finish(leaf, bp.n) for leaf in stats[quantity.source]]
        result[name] = optree.tree_unflatten(bp.treespec, values)
    return result


def _source_statistics(
    bp: BatchPass,
    source: Source,
    stats: set[Statistic],
    index: slice | Tensor,
    mc_samples: int | None,
    generator: torch.Generator | None,
) -> list[Stats]:
    """Statistics of every leaf for one cotangent source."""
    if source == "gradient":
        return leaf_statistics(bp.gradient_columns(), stats, index)
    if source == "hessian":
        return hessian.diagonals(bp, stats, index)
    return ggn_statistics(bp, stats, index, mc_samples, generator)


__all__ = ["FIRST_ORDER", "QUANTITIES", "SECOND_ORDER", "Quantity", "compute", "evaluate"]
