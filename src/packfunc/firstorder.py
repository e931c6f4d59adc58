"""First-order quantities: per-sample gradients and their moments.

Scaling follows BackPACK: ``batch_grad[n]`` is the gradient of sample ``n``'s
term of the *reduced* loss, so ``batch_grad.sum(0)`` is the gradient. Every
function returns a pytree shaped like ``params``; :func:`packfunc.compute`
gives several quantities in one pass.
"""

from __future__ import annotations

from torch import nn
from typing_extensions import Unpack

from packfunc.data import DataOptions, over_data
from packfunc.evaluation import one_quantity
from packfunc.specs import SPECS
from packfunc.types import (
    DATA_ARGUMENTS,
    Inputs,
    ModelFn,
    ParamsT,
    Samples,
    Targets,
    shares_arguments,
)


@over_data(SPECS["batch_grad"])
@shares_arguments(
    "model_fn", "params", "X", "y", "loss", "subsampling", "chunk_size", *DATA_ARGUMENTS
)
def batch_grad(
    model_fn: ModelFn,
    params: ParamsT,
    X: Inputs = None,
    y: Targets = None,
    *,
    loss: nn.Module | None = None,
    subsampling: Samples = None,
    chunk_size: int | None = None,
    **dataset: Unpack[DataOptions],
) -> ParamsT:
    """Per-sample gradients (BackPACK's ``BatchGrad``, ``grad_batch``).

    Returns:
        Pytree like ``params``; leaf ``[N, *p]`` (or ``[len(subsampling), *p]``)
        with ``batch_grad.sum(0)`` equal to the gradient of the reduced loss.

    Example:
        >>> model_fn, params = packfunc.functional(torch.nn.Linear(3, 2))
        >>> g = batch_grad(model_fn, params, torch.randn(5, 3), torch.randint(0, 2, (5,)))
        >>> g["weight"].shape
        torch.Size([5, 2, 3])
    """
    return one_quantity(
        "batch_grad",
        model_fn,
        params,
        X,
        y,
        loss,
        subsampling=subsampling,
        chunk_size=chunk_size,
    )


@over_data(SPECS["batch_l2_grad"])
@shares_arguments(
    "model_fn", "params", "X", "y", "loss", "subsampling", "chunk_size", *DATA_ARGUMENTS
)
def batch_l2_grad(
    model_fn: ModelFn,
    params: ParamsT,
    X: Inputs = None,
    y: Targets = None,
    *,
    loss: nn.Module | None = None,
    subsampling: Samples = None,
    chunk_size: int | None = None,
    **dataset: Unpack[DataOptions],
) -> ParamsT:
    """Squared L2 norm of each per-sample gradient, per leaf (BackPACK's ``BatchL2Grad``).

    Returns:
        Pytree like ``params``; leaf ``[N]`` with ``‖batch_grad[n]‖²``.

    Example:
        >>> model_fn, params = packfunc.functional(torch.nn.Linear(3, 2))
        >>> l2 = batch_l2_grad(model_fn, params, torch.randn(5, 3), torch.randint(0, 2, (5,)))
        >>> l2["bias"].shape
        torch.Size([5])
    """
    return one_quantity(
        "batch_l2_grad",
        model_fn,
        params,
        X,
        y,
        loss,
        subsampling=subsampling,
        chunk_size=chunk_size,
    )


@over_data(SPECS["sum_grad_squared"])
@shares_arguments("model_fn", "params", "X", "y", "loss", "chunk_size", *DATA_ARGUMENTS)
def sum_grad_squared(
    model_fn: ModelFn,
    params: ParamsT,
    X: Inputs = None,
    y: Targets = None,
    *,
    loss: nn.Module | None = None,
    chunk_size: int | None = None,
    **dataset: Unpack[DataOptions],
) -> ParamsT:
    """Sum over samples of squared per-sample gradients (BackPACK's ``SumGradSquared``).

    Returns:
        Pytree like ``params``; leaf ``Σ_n batch_grad[n]²``.

    Example:
        >>> model_fn, params = packfunc.functional(torch.nn.Linear(3, 2))
        >>> s = sum_grad_squared(model_fn, params, torch.randn(5, 3), torch.randint(0, 2, (5,)))
        >>> s["weight"].shape
        torch.Size([2, 3])
    """
    return one_quantity("sum_grad_squared", model_fn, params, X, y, loss, chunk_size=chunk_size)


@over_data(SPECS["variance"])
@shares_arguments("model_fn", "params", "X", "y", "loss", "chunk_size", *DATA_ARGUMENTS)
def variance(
    model_fn: ModelFn,
    params: ParamsT,
    X: Inputs = None,
    y: Targets = None,
    *,
    loss: nn.Module | None = None,
    chunk_size: int | None = None,
    **dataset: Unpack[DataOptions],
) -> ParamsT:
    """Variance of the per-sample gradients over the batch (BackPACK's ``Variance``).

    Returns:
        Pytree like ``params``; leaf ``mean_n(batch_grad²) − mean_n(batch_grad)²``.

    Example:
        >>> model_fn, params = packfunc.functional(torch.nn.Linear(3, 2))
        >>> v = variance(model_fn, params, torch.randn(5, 3), torch.randint(0, 2, (5,)))
        >>> v["bias"].shape
        torch.Size([2])
    """
    return one_quantity("variance", model_fn, params, X, y, loss, chunk_size=chunk_size)
