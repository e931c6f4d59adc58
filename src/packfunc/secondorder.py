"""Second-order quantities: the GGN (exact or Monte-Carlo) and Hessian diagonals.

The generalized Gauss-Newton of the reduced loss is ``G = Σ_n J_nᵀ H_n J_n``
with ``H_n`` the loss Hessian of sample ``n``'s output; with ``H_n = S_n S_nᵀ``
its square root has columns ``J_nᵀ S_n[:, k]``. ``mc_samples=None`` uses the
exact factorization (``K`` = number of outputs per sample), an integer draws
that many targets from the model's predictive distribution (``K = mc_samples``).
Every function returns a pytree shaped like ``params``; :func:`packfunc.compute`
gives several quantities in one pass.
"""

from __future__ import annotations

import torch
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


@over_data(SPECS["sqrt_ggn"])
@shares_arguments(
    "model_fn",
    "params",
    "X",
    "y",
    "loss",
    "mc_samples",
    "generator",
    "subsampling",
    "chunk_size",
    *DATA_ARGUMENTS,
)
def sqrt_ggn(
    model_fn: ModelFn,
    params: ParamsT,
    X: Inputs = None,
    y: Targets = None,
    *,
    loss: nn.Module | None = None,
    mc_samples: int | None = None,
    generator: torch.Generator | None = None,
    subsampling: Samples = None,
    chunk_size: int | None = None,
    **dataset: Unpack[DataOptions],
) -> ParamsT:
    """Square root of the GGN, per sample (BackPACK's ``SqrtGGNExact`` / ``SqrtGGNMC``).

    Returns:
        Pytree like ``params``; leaf ``V [K, N, *p]`` with
        ``GGN = Σ_{k,n} vec(V[k, n]) vec(V[k, n])ᵀ``.

    Example:
        >>> model_fn, params = packfunc.functional(torch.nn.Linear(3, 4))
        >>> V = sqrt_ggn(model_fn, params, torch.randn(5, 3), torch.randint(0, 4, (5,)))
        >>> V["weight"].shape
        torch.Size([4, 5, 4, 3])
    """
    return one_quantity(
        "sqrt_ggn",
        model_fn,
        params,
        X,
        y,
        loss,
        mc_samples=mc_samples,
        generator=generator,
        subsampling=subsampling,
        chunk_size=chunk_size,
    )


@over_data(SPECS["diag_ggn"])
@shares_arguments(
    "model_fn", "params", "X", "y", "loss", "mc_samples", "generator", "chunk_size", *DATA_ARGUMENTS
)
def diag_ggn(
    model_fn: ModelFn,
    params: ParamsT,
    X: Inputs = None,
    y: Targets = None,
    *,
    loss: nn.Module | None = None,
    mc_samples: int | None = None,
    generator: torch.Generator | None = None,
    chunk_size: int | None = None,
    **dataset: Unpack[DataOptions],
) -> ParamsT:
    """Diagonal of the GGN (BackPACK's ``DiagGGNExact`` / ``DiagGGNMC``).

    Returns:
        Pytree like ``params``; leaf ``diag(GGN)`` shaped like the parameter.

    Example:
        >>> model_fn, params = packfunc.functional(torch.nn.Linear(3, 4))
        >>> d = diag_ggn(model_fn, params, torch.randn(5, 3), torch.randint(0, 4, (5,)))
        >>> d["weight"].shape
        torch.Size([4, 3])
    """
    return one_quantity(
        "diag_ggn",
        model_fn,
        params,
        X,
        y,
        loss,
        mc_samples=mc_samples,
        generator=generator,
        chunk_size=chunk_size,
    )


@over_data(SPECS["batch_diag_ggn"])
@shares_arguments(
    "model_fn",
    "params",
    "X",
    "y",
    "loss",
    "mc_samples",
    "generator",
    "subsampling",
    "chunk_size",
    *DATA_ARGUMENTS,
)
def batch_diag_ggn(
    model_fn: ModelFn,
    params: ParamsT,
    X: Inputs = None,
    y: Targets = None,
    *,
    loss: nn.Module | None = None,
    mc_samples: int | None = None,
    generator: torch.Generator | None = None,
    subsampling: Samples = None,
    chunk_size: int | None = None,
    **dataset: Unpack[DataOptions],
) -> ParamsT:
    """Per-sample diagonals of the GGN (BackPACK's ``BatchDiagGGNExact`` / ``BatchDiagGGNMC``).

    Returns:
        Pytree like ``params``; leaf ``[N, *p]`` whose sum over samples is ``diag_ggn``.

    Example:
        >>> model_fn, params = packfunc.functional(torch.nn.Linear(3, 4))
        >>> d = batch_diag_ggn(model_fn, params, torch.randn(5, 3), torch.randint(0, 4, (5,)))
        >>> d["bias"].shape
        torch.Size([5, 4])
    """
    return one_quantity(
        "batch_diag_ggn",
        model_fn,
        params,
        X,
        y,
        loss,
        mc_samples=mc_samples,
        generator=generator,
        subsampling=subsampling,
        chunk_size=chunk_size,
    )


@over_data(SPECS["diag_hessian"])
@shares_arguments("model_fn", "params", "X", "y", "loss", "chunk_size", *DATA_ARGUMENTS)
def diag_hessian(
    model_fn: ModelFn,
    params: ParamsT,
    X: Inputs = None,
    y: Targets = None,
    *,
    loss: nn.Module | None = None,
    chunk_size: int | None = None,
    **dataset: Unpack[DataOptions],
) -> ParamsT:
    """Diagonal of the loss Hessian w.r.t. the parameters (BackPACK's ``DiagHessian``).

    Returns:
        Pytree like ``params``; leaf ``diag(∇²L)`` shaped like the parameter.

    Example:
        >>> model_fn, params = packfunc.functional(torch.nn.Linear(3, 4))
        >>> h = diag_hessian(model_fn, params, torch.randn(5, 3), torch.randint(0, 4, (5,)))
        >>> h["weight"].shape
        torch.Size([4, 3])
    """
    return one_quantity("diag_hessian", model_fn, params, X, y, loss, chunk_size=chunk_size)


@over_data(SPECS["batch_diag_hessian"])
@shares_arguments(
    "model_fn", "params", "X", "y", "loss", "subsampling", "chunk_size", *DATA_ARGUMENTS
)
def batch_diag_hessian(
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
    """Per-sample diagonals of the loss Hessian (BackPACK's ``BatchDiagHessian``).

    Returns:
        Pytree like ``params``; leaf ``[N, *p]`` whose sum over samples is ``diag_hessian``.

    Example:
        >>> model_fn, params = packfunc.functional(torch.nn.Linear(3, 4))
        >>> h = batch_diag_hessian(model_fn, params, torch.randn(5, 3), torch.randint(0, 4, (5,)))
        >>> h["bias"].shape
        torch.Size([5, 4])
    """
    return one_quantity(
        "batch_diag_hessian",
        model_fn,
        params,
        X,
        y,
        loss,
        subsampling=subsampling,
        chunk_size=chunk_size,
    )
