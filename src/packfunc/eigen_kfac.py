"""EKFAC: the KFAC eigenbasis with eigenvalues re-fitted to the column gradients."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import optree
import torch
from torch import nn

from packfunc.engine.batch_pass import BatchPass, ColumnGradients
from packfunc.engine.eigenvalue_fit import fitted_eigenvalues
from packfunc.engine.layer_factors import checked_approx, refuse_unsupported, sqrt_factors
from packfunc.engine.randomness import check_generator
from packfunc.evaluation import refuse_complex_squares
from packfunc.functionalize import public_entry
from packfunc.kron import Curvature, Eigen, batched_eigh
from packfunc.losses import default_loss, given_targets
from packfunc.types import (
    Inputs,
    KfacApprox,
    ModelFn,
    OnUnsupported,
    Params,
    PyTree,
    Targets,
    shares_arguments,
)


@shares_arguments(
    "model_fn", "params", "X", "y", "loss", "generator", "kfac_approx", "on_unsupported"
)
@public_entry
def ekfac(
    model_fn: ModelFn,
    params: Params,
    X: Inputs,
    y: Targets,
    *,
    loss: nn.Module | None = None,
    mc_samples: int | None = 1,
    generator: torch.Generator | None = None,
    kfac_approx: KfacApprox = "sum",
    on_unsupported: OnUnsupported = "raise",
    eigenvectors: PyTree = None,
) -> Curvature:
    """EKFAC (George et al., 2018): KFAC's eigenbasis, eigenvalues fitted to the gradients.

    Each weight with a Kronecker rule gets ``Eigen([Q_A, Q_B], λ)`` (a bias
    ``Eigen([Q_A], λ)``): ``Q_A``, ``Q_B`` the eigenvectors of its KFAC factors
    (``mc_samples=None``: of its KFLR factors) and
    ``λ[i, j] = Σ_{k,n} ((Q_Aᵀ G_kn Q_B)[i, j])²``, ``G_kn`` the weight's gradient
    (Kronecker layout ``[dim A, dim B]``) for square-root column ``k`` of sample ``n``
    — exact, or the same Monte-Carlo samples as the factors. ``λ`` is thus the
    diagonal of the GGN block (of the reduced loss, with its scale) in the eigenbasis,
    and ``(Q_A ⊗ Q_B) diag(vec λ) (Q_A ⊗ Q_B)ᵀ`` approximates the block. Use the result
    with :mod:`packfunc.kron` (``inverse``, ``matvec``, ...). One batch at a time (no
    ``data=``): for several batches, fix the basis with ``eigenvectors=`` and combine the
    eigenvalues as the loss's reduction combines the batches.

    Args:
        mc_samples: Monte-Carlo targets per sample (KFAC basis), or ``None`` for the exact
            square-root columns (KFLR basis).
        eigenvectors: A pytree like ``params`` of :class:`~packfunc.kron.Eigen` (e.g. an
            earlier result): fit the eigenvalues in these bases instead of computing new
            ones (``kfac_approx`` is then unused).

    Returns:
        Pytree like ``params``; each leaf an :class:`~packfunc.kron.Eigen` (or ``None``).

    Raises:
        ValueError: for unsupported leaves (with ``on_unsupported="raise"``), a bad
            ``kfac_approx`` or eigenvectors that do not match the parameters.

    Example:
        >>> model_fn, params = packfunc.functional(torch.nn.Linear(3, 2))
        >>> e = ekfac(model_fn, params, torch.randn(5, 3), torch.randint(0, 2, (5,)))["weight"]
        >>> [q.shape for q in e.eigenvectors], e.eigenvalues.shape
        ([torch.Size([2, 2]), torch.Size([3, 3])], torch.Size([2, 3]))
    """
    fitted = _fit(
        model_fn,
        params,
        X,
        y,
        loss,
        mc_samples,
        generator,
        kfac_approx,
        on_unsupported,
        eigenvectors,
        combine=None,
    )[1]
    return cast(Curvature, fitted)


def ekfac_and_factors(
    model_fn: ModelFn,
    params: Params,
    X: Inputs,
    y: Targets,
    combine: Callable[[Any], Any],
    *,
    loss: nn.Module | None = None,
    mc_samples: int | None = 1,
    generator: torch.Generator | None = None,
    kfac_approx: KfacApprox = "sum",
) -> tuple[Any, Any]:
    """EKFAC in the eigenbasis of ``combine(batch's KFAC factors)``, from one batch pass.

    For a preconditioner that averages the factors over steps: the basis comes from the
    averaged factors, the eigenvalues are fitted to this batch's column gradients (the
    same Monte-Carlo samples as its factors), and the forward pass is shared.

    Args:
        combine: Maps the batch's factor pytree (as :func:`packfunc.kfac` returns it) to
            the factors whose eigenvectors form the basis (e.g. a moving average).
        mc_samples: As for :func:`ekfac`.

    Returns:
        ``(combine(factors), ekfac)``.

    Example:
        >>> model_fn, params = packfunc.functional(torch.nn.Linear(3, 2))
        >>> X, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
        >>> factors, e = ekfac_and_factors(model_fn, params, X, y, lambda f: f)
        >>> factors["weight"][0].shape, e["weight"].eigenvalues.shape
        (torch.Size([2, 2]), torch.Size([2, 3]))
    """
    return _fit(
        model_fn,
        params,
        X,
        y,
        loss,
        mc_samples,
        generator,
        kfac_approx,
        "raise",
        None,
        combine,
    )


def _fit(
    model_fn: ModelFn,
    params: Params,
    X: Inputs,
    y: Targets,
    loss: nn.Module | None,
    mc_samples: int | None,
    generator: torch.Generator | None,
    kfac_approx: str,
    on_unsupported: str,
    eigenvectors: Any,
    combine: Callable[[Any], Any] | None,
) -> tuple[Any, Any]:
    """The (combined) factors, ``None`` for given eigenvectors, and the EKFAC pytree."""
    if on_unsupported not in ("raise", "skip"):
        raise ValueError(f"on_unsupported must be 'raise' or 'skip'; got {on_unsupported!r}.")
    checked_approx(kfac_approx)
    check_generator(generator, "ekfac()")
    refuse_complex_squares(params, ["ekfac"])
    bp = BatchPass(model_fn, params, X, given_targets(y, "ekfac"), loss or default_loss())
    with bp.undone_on_refusal():
        if mc_samples is not None and generator is None:  # both passes must see the same samples
            seed = int(torch.randint(0, 2**62, (1,)).item())
            generator = torch.Generator(bp.record.output.device).manual_seed(seed)
        start = generator.get_state() if generator is not None else None
        factors, columns = None, None
        if eigenvectors is None:
            factors, columns = _kfac_factors(bp, kfac_approx, mc_samples, generator, on_unsupported)
            if combine is not None:
                factors = combine(factors)
            bases = _bases(bp, factors)
        else:
            bases = _given_bases(bp, eigenvectors)
        if generator is not None and start is not None:
            generator.set_state(start)  # the factors' samples, if their columns were not kept
        values = fitted_eigenvalues(bp, bases, mc_samples, generator, columns)
        found = [
            None if basis is None or value is None else Eigen(basis, value)
            for basis, value in zip(bases, values)
        ]
        return factors, optree.tree_unflatten(bp.treespec, found)


def _kfac_factors(
    bp: BatchPass,
    approx: str,
    mc_samples: int | None,
    generator: torch.Generator | None,
    on_unsupported: str,
) -> tuple[Any, ColumnGradients | None]:
    """Every leaf's KFAC (or KFLR) factors as a pytree like ``params``, and their columns."""
    found = sqrt_factors(bp, approx, mc_samples, generator)
    refuse_unsupported(bp, found, on_unsupported)
    return optree.tree_unflatten(bp.treespec, found.per_leaf), found.columns


def _bases(bp: BatchPass, factors: Any) -> list[list[torch.Tensor] | None]:
    """Eigenvectors of every leaf's factors, one ``eigh`` per distinct factor shape."""
    per_leaf = cast(list[list[torch.Tensor] | None], bp.treespec.flatten_up_to(factors))
    flat = [f for entry in per_leaf if entry is not None for f in entry]
    vectors = iter([q for _, q in batched_eigh(flat)])
    return [None if entry is None else [next(vectors) for _ in entry] for entry in per_leaf]


def _given_bases(bp: BatchPass, eigenvectors: Any) -> list[list[torch.Tensor] | None]:
    """The eigenvectors of a params-like pytree of ``Eigen``, checked against the leaves."""
    try:
        entries = bp.treespec.flatten_up_to(eigenvectors)
    except ValueError as error:
        raise ValueError(f"eigenvectors must be a pytree like params: {error}") from None
    bases: list[list[torch.Tensor] | None] = []
    for name, leaf, entry in zip(bp.names, bp.leaves, entries):
        if entry is None:
            bases.append(None)
            continue
        if not isinstance(entry, Eigen):
            raise ValueError(
                f"eigenvectors[{name!r}] must be a packfunc.kron.Eigen (e.g. from ekfac or "
                f"kron.eigh), or None; got {type(entry).__name__}."
            )
        sizes = [q.shape[0] for q in entry.eigenvectors]
        if torch.Size(sizes).numel() != leaf.numel():
            raise ValueError(
                f"eigenvectors[{name!r}] of sizes {sizes} do not match the parameter of shape "
                f"{tuple(leaf.shape)}."
            )
        bases.append(list(entry.eigenvectors))
    return bases


__all__ = ["ekfac", "ekfac_and_factors"]
