"""Randomized trace and diagonal estimators of the GGN and the Hessian, matrix-free.

Each estimator multiplies the curvature of the reduced loss (``curvature="ggn"``: the
GGN ``G``; ``"hessian"``: the Hessian ``H``) with random probe vectors ``v`` with
``E[v vᵀ] = I`` — Rademacher (``±1``) or standard normal entries:

* Hutchinson's trace, ``tr(A) ≈ mean_s v_sᵀ A v_s``; with Rademacher probes its
  variance per probe is ``2 (‖A‖_F² − Σ_i A_ii²)``, with normal ones ``2 ‖A‖_F²``;
* the diagonal, ``diag(A) ≈ mean_s v_s ⊙ A v_s`` (Bekas et al. 2007); per probe
  and Rademacher, entry ``i`` has variance ``Σ_{j≠i} A_ij²``;
* Hutch++ (Meyer et al. 2021): with ``m`` products, a third sketch the range of
  ``A`` (``Q = orth(A S)``), a third give ``tr(Qᵀ A Q)`` exactly, and the last third
  estimate the trace of the rest, ``(I − QQᵀ) A (I − QQᵀ)``, by Hutchinson. It is
  unbiased, and exact when ``A`` has rank at most ``m / 3``.

Probes are multiplied in stacks of ``chunk_size`` at once by ``vmap`` over
:func:`packfunc.ggn_vector_product` / :func:`packfunc.hessian_vector_product`
(faster than one product per probe, and than the per-parameter block products).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, cast

import optree
import torch
from torch import Tensor, nn
from torch.func import vmap

from packfunc.engine.randomness import check_generator, random_model_error
from packfunc.functionalize import public_entry
from packfunc.products import ggn_vector_product, hessian_vector_product
from packfunc.types import Inputs, ModelFn, Params, ParamsT, shares_arguments

EstimatedCurvature = Literal["ggn", "hessian"]
"""The matrix an estimator probes: the GGN or the Hessian of the reduced loss."""

ProbeDistribution = Literal["rademacher", "normal"]
"""The entries of the probe vectors: ``±1`` with equal probability, or standard normal."""

_PRODUCTS: dict[str, Callable[..., Any]] = {
    "ggn": ggn_vector_product,
    "hessian": hessian_vector_product,
}


@shares_arguments("model_fn", "params", "X", "y", "loss")
@public_entry
def hutchinson_trace(
    model_fn: ModelFn,
    params: Params,
    X: Inputs,
    y: Tensor,
    *,
    loss: nn.Module | None = None,
    curvature: EstimatedCurvature = "ggn",
    num_samples: int = 100,
    distribution: ProbeDistribution = "rademacher",
    generator: torch.Generator | None = None,
    chunk_size: int = 32,
) -> Tensor:
    """Estimate the trace of the GGN (or Hessian) with Hutchinson's estimator.

    Args:
        curvature: ``"ggn"`` or ``"hessian"`` (of the reduced loss).
        num_samples: Number of probe vectors (one matrix-vector product each).
        distribution: ``"rademacher"`` or ``"normal"`` probe entries.
        generator: Random generator for the probes (on the parameters' device).
        chunk_size: Probes multiplied at once (bounds memory; the result does not
            depend on it).

    Returns:
        A scalar tensor: ``mean_s v_sᵀ A v_s``, an unbiased estimate of ``tr(A)``.

    Example:
        >>> model_fn, params = packfunc.functional(torch.nn.Linear(3, 2))
        >>> hutchinson_trace(model_fn, params, torch.randn(4, 3),
        ...                  torch.tensor([0, 1, 1, 0]), num_samples=10).shape
        torch.Size([])
    """
    _check_count("num_samples", num_samples, minimum=1)
    matvec = _flat_products(model_fn, params, X, y, loss, curvature, chunk_size)
    probes = _probes(params, num_samples, distribution, generator)
    return (probes * matvec(probes)).sum() / num_samples


@shares_arguments("model_fn", "params", "X", "y", "loss")
@public_entry
def hutchinson_diagonal(
    model_fn: ModelFn,
    params: ParamsT,
    X: Inputs,
    y: Tensor,
    *,
    loss: nn.Module | None = None,
    curvature: EstimatedCurvature = "ggn",
    num_samples: int = 100,
    distribution: ProbeDistribution = "rademacher",
    generator: torch.Generator | None = None,
    chunk_size: int = 32,
) -> ParamsT:
    """Estimate the diagonal of the GGN (or Hessian) from probes, ``mean_s v_s ⊙ A v_s``.

    Args:
        curvature: ``"ggn"`` or ``"hessian"`` (of the reduced loss).
        num_samples: Number of probe vectors (one matrix-vector product each).
        distribution: ``"rademacher"`` or ``"normal"`` probe entries.
        generator: Random generator for the probes (on the parameters' device).
        chunk_size: Probes multiplied at once (bounds memory).

    Returns:
        Pytree shaped like ``params``: an unbiased estimate of ``diag(A)``.

    Example:
        >>> model_fn, params = packfunc.functional(torch.nn.Linear(3, 2))
        >>> hutchinson_diagonal(model_fn, params, torch.randn(4, 3),
        ...                     torch.tensor([0, 1, 1, 0]), num_samples=10)["weight"].shape
        torch.Size([2, 3])
    """
    _check_count("num_samples", num_samples, minimum=1)
    matvec = _flat_products(model_fn, params, X, y, loss, curvature, chunk_size)
    probes = _probes(params, num_samples, distribution, generator)
    return cast(ParamsT, _unflatten((probes * matvec(probes)).mean(0), params))


@shares_arguments("model_fn", "params", "X", "y", "loss")
@public_entry
def hutchpp_trace(
    model_fn: ModelFn,
    params: Params,
    X: Inputs,
    y: Tensor,
    *,
    loss: nn.Module | None = None,
    curvature: EstimatedCurvature = "ggn",
    num_matvecs: int = 99,
    distribution: ProbeDistribution = "rademacher",
    generator: torch.Generator | None = None,
    chunk_size: int = 32,
) -> Tensor:
    """Estimate the trace of the GGN (or Hessian) with Hutch++ (Meyer et al. 2021).

    ``k = num_matvecs // 3`` products sketch the range, ``k`` more give the trace on
    it exactly, and the remaining ``num_matvecs − 2k`` estimate the rest.

    Args:
        curvature: ``"ggn"`` or ``"hessian"`` (of the reduced loss).
        num_matvecs: Total number of matrix-vector products (at least 3).
        distribution: ``"rademacher"`` or ``"normal"`` probe entries.
        generator: Random generator for the probes (on the parameters' device).
        chunk_size: Products computed at once (bounds memory).

    Returns:
        A scalar tensor: an unbiased estimate of ``tr(A)``, exact when ``A`` has rank
        at most ``num_matvecs // 3``.

    Example:
        >>> model_fn, params = packfunc.functional(torch.nn.Linear(3, 2))
        >>> hutchpp_trace(model_fn, params, torch.randn(4, 3),
        ...               torch.tensor([0, 1, 1, 0]), num_matvecs=9).shape
        torch.Size([])
    """
    _check_count("num_matvecs", num_matvecs, minimum=3)
    matvec = _flat_products(model_fn, params, X, y, loss, curvature, chunk_size)
    sketch_size = num_matvecs // 3
    residual_size = num_matvecs - 2 * sketch_size
    sketch = _probes(params, sketch_size, distribution, generator)
    residual_probes = _probes(params, residual_size, distribution, generator)
    basis = torch.linalg.qr(matvec(sketch).T).Q.T  # [k, D]: orthonormal rows spanning A S
    projected = residual_probes - (residual_probes @ basis.T) @ basis  # (I − QQᵀ) g
    both = torch.cat([basis, projected])
    quadratic = (both * matvec(both)).sum(1)  # one stack of products for both terms
    captured = quadratic[: len(basis)].sum()  # tr(Qᵀ A Q)
    return captured + quadratic[len(basis) :].sum() / residual_size


def _check_count(name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int of at least {minimum}; got {value!r}.")


def _flat_products(
    model_fn: ModelFn,
    params: Params,
    X: Inputs,
    y: Tensor,
    loss: nn.Module | None,
    curvature: str,
    chunk_size: int,
) -> Callable[[Tensor], Tensor]:
    """The curvature as a map from stacked flat vectors ``[V, D]`` to ``[V, D]``."""
    if curvature not in _PRODUCTS:
        raise ValueError(f"curvature must be one of {tuple(_PRODUCTS)}; got {curvature!r}.")
    _check_count("chunk_size", chunk_size, minimum=1)
    product = _PRODUCTS[curvature]

    def one(flat: Tensor) -> Tensor:
        result = product(model_fn, params, X, y, _unflatten(flat, params), loss=loss)
        return _flatten(result)

    def stacked(vectors: Tensor) -> Tensor:
        try:
            return torch.cat([vmap(one)(chunk) for chunk in torch.split(vectors, chunk_size)])
        except RuntimeError as error:  # (torch's vmap refuses the draws of a random model)
            if "randomness" not in str(error):
                raise
            rerun = "each of the estimator's curvature products"
            raise random_model_error("e.g. dropout in training mode", rerun) from error

    return stacked


def _probes(
    params: Params, count: int, distribution: str, generator: torch.Generator | None
) -> Tensor:
    """``count`` random flat vectors ``[count, D]`` with ``E[v vᵀ] = I``."""
    check_generator(generator, "the estimators (hutchinson_diagonal, hutchinson_trace, ...)")
    leaves: list[Tensor] = optree.tree_leaves(cast(Any, params))
    if not leaves or any(not torch.is_floating_point(p) for p in leaves):
        raise ValueError("params must be a non-empty pytree of floating-point tensors.")
    dtype, device = leaves[0].dtype, leaves[0].device
    if any(p.dtype != dtype or p.device != device for p in leaves):
        raise ValueError(
            "The estimators need every parameter on one device with one dtype; "
            "convert them first, e.g. {k: p.double() for k, p in params.items()}."
        )
    if generator is not None and generator.device.type != device.type:
        raise ValueError(
            f"generator is on {generator.device} but the parameters on {device}; "
            f"use torch.Generator(device={str(device)!r})."
        )
    shape = (count, sum(p.numel() for p in leaves))
    if distribution == "rademacher":
        signs = torch.randint(0, 2, shape, generator=generator, device=device)
        return signs.to(dtype) * 2 - 1
    if distribution == "normal":
        return torch.randn(shape, generator=generator, dtype=dtype, device=device)
    raise ValueError(f"distribution must be 'rademacher' or 'normal'; got {distribution!r}.")


def _flatten(tree: Any) -> Tensor:
    """Concatenate a pytree's leaves into one flat vector."""
    return torch.cat([leaf.reshape(-1) for leaf in optree.tree_leaves(tree)])


def _unflatten(flat: Tensor, like: Any) -> Any:
    """Split a flat vector into a pytree shaped like ``like``."""
    leaves, treespec = optree.tree_flatten(like)
    pieces = torch.split(flat, [p.numel() for p in leaves])
    return optree.tree_unflatten(treespec, [v.reshape(p.shape) for v, p in zip(pieces, leaves)])


__all__ = [
    "EstimatedCurvature",
    "ProbeDistribution",
    "hutchinson_diagonal",
    "hutchinson_trace",
    "hutchpp_trace",
]
