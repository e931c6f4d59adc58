"""Several quantities in one pass: :func:`compute`, the public entry of :mod:`packfunc.evaluation`.

Which names it takes, and how each combines over batches and ranks, is in
:mod:`packfunc.specs`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from typing_extensions import Unpack

from packfunc.data import DataOptions, over_data
from packfunc.evaluation import compute_batch, statistic_quantities
from packfunc.losses import default_loss
from packfunc.specs import FIRST_ORDER, QUANTITIES, SECOND_ORDER
from packfunc.types import Inputs, MaxNorm, ModelFn, ParamsT, Samples, Targets


@over_data(None)
def compute(
    model_fn: ModelFn,
    params: ParamsT,
    X: Inputs = None,
    y: Targets = None,
    *,
    quantities: str | Sequence[str],
    loss: nn.Module | None = None,
    subsampling: Samples = None,
    mc_samples: int | None = None,
    generator: torch.Generator | None = None,
    chunk_size: int | None = None,
    max_norm: MaxNorm | None = None,
    **dataset: Unpack[DataOptions],
) -> dict[str, Any]:
    """Compute several quantities in one pass over the model.

    One forward and one vector-Jacobian product are shared by all quantities;
    closed forms avoid materializing per-sample tensors where a layer allows it.

    Args:
        model_fn: ``model_fn(params, X) -> output``.
        params: Pytree of floating-point tensors.
        X: Inputs (tensor or pytree) with leading batch dimension ``N``.
        y: Targets with leading batch dimension.
        quantities: Names from :data:`QUANTITIES` (one string is one name):
    {names}
            Kronecker factors (``pf.kfac``, ``pf.kflr``, ``pf.kfra``) and curvature
            products have their own functions.
        loss: A ``torch.nn`` loss with ``reduction`` ``'mean'`` or ``'sum'``
            (default ``CrossEntropyLoss()``).
        subsampling: Sample indices for the per-sample quantities (``batch_grad``,
            ``batch_l2_grad``, ``sqrt_ggn``, ``batch_diag_ggn``, ``batch_diag_hessian``);
            the others always use the whole batch.
        mc_samples: ``None``: exact GGN; an int: Monte-Carlo GGN with that many samples.
        generator: Random generator for the Monte-Carlo samples.
        chunk_size: Samples per chunk when per-sample tensors must be
            materialized (``None``: automatic, bounded memory).
        max_norm: ``clipped_grad``'s bound on each sample's gradient norm.
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
    names = statistic_quantities(quantities)
    return compute_batch(
        model_fn,
        params,
        X,
        y,
        names,
        loss or default_loss(),
        subsampling=subsampling,
        mc_samples=mc_samples,
        generator=generator,
        chunk_size=chunk_size,
        max_norm=max_norm,
    )


compute.__doc__ = (compute.__doc__ or "").replace(
    "{names}",
    "\n".join(f"            ``{name}``: {spec.summary};" for name, spec in QUANTITIES.items()),
)

__all__ = ["FIRST_ORDER", "QUANTITIES", "SECOND_ORDER", "compute"]
