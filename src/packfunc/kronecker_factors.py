"""Kronecker-factored curvature: KFAC, KFLR and KFRA.

For a linear or convolution weight the result is ``[A, B]`` with ``A ⊗ B``
approximating the parameter's GGN block in row-major order (BackPACK's order:
Linear ``[out×out, in×in]``; convolution ``[C_out×C_out, (C_in/groups·k…)×(…)]``);
for a bias ``[A]``, its exact (KFLR) or sampled (KFAC) GGN block. A transposed
convolution's weight ``[C_in, C_out/groups, k…]`` gets the factors of its kernel
with the channel axes swapped, ``weight.transpose(0, 1)`` for one group (BackPACK's
convention): ``B`` from the input unfolded per output position.

Positions — sequence entries of a linear layer, pixels of a convolution, and
the calls of a layer used several times (which are concatenated) — follow
``kfac_approx``, with ``s`` the pulled-back square-root columns and ``u`` the
(unfolded) inputs, ``N`` samples, ``L`` positions:

* ``"sum"`` (default; BackPACK's ``KFAC``/``KFLR`` for convolutions, its only
  layers with positions): positions summed in both factors, none averaged,
  ``A = Σ_{k,n} (Σ_l s)(Σ_l s)ᵀ``, ``B = Σ_{n,l} u uᵀ / N``;
* ``"expand"`` (positions as extra samples; exact for a layer applied
  independently per position): ``A = Σ_{k,n,l} s sᵀ``, ``B = Σ_{n,l} u uᵀ / (N L)``;
* ``"reduce"`` (positions summed; exact when the input is the same at every
  position): ``A = Σ_{k,n} (Σ_l s)(Σ_l s)ᵀ``, ``B = Σ_n ū ūᵀ / N`` with ``ū`` the
  mean over positions.

``"expand"`` and ``"reduce"`` are the conventions of curvlinops'
``KFACLinearOperator(kfac_approx=...)``; ``"sum"`` is ``"reduce"``'s ``A`` with
``"expand"``'s ``B`` times ``L``, so its ``A ⊗ B`` is ``L`` times that pair's.
The former name ``"backpack"`` raises a ``ValueError`` naming ``"sum"``. With one
position all three coincide. Grouped convolutions share ``B`` across groups
(averaged). Parameters without a Kronecker rule (a raw parameter, a norm layer, an
embedding, tied weights) raise a
``ValueError`` naming them, or get ``None`` with ``on_unsupported="skip"``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, cast

import optree
import torch
from torch import Tensor, nn
from typing_extensions import Unpack

from packfunc.data import DataOptions, over_data
from packfunc.engine.autodiff import refuse_differentiation
from packfunc.engine.batch_pass import BatchPass
from packfunc.engine.layer_factors import (
    CURVATURES,
    Factors,
    checked_approx,
    kfra_factors,
    refuse_unsupported,
    sqrt_factors,
)
from packfunc.evaluation import refuse_complex_squares
from packfunc.losses import default_loss, given_targets
from packfunc.specs import SPECS
from packfunc.types import (
    DATA_ARGUMENTS,
    Curvature,
    FactorTree,
    FisherType,
    Inputs,
    KfacApprox,
    ModelFn,
    OnUnsupported,
    ParamsT,
    Targets,
    shares_arguments,
)

FISHER_TYPES = ("mc", "empirical")
"""KFAC's output-side columns: sampled from the model (``"mc"``) or the loss gradient."""


@over_data(SPECS["kfac"])
@shares_arguments(
    "model_fn",
    "params",
    "X",
    "y",
    "loss",
    "generator",
    "kfac_approx",
    "on_unsupported",
    *DATA_ARGUMENTS,
)
def kfac(
    model_fn: ModelFn,
    params: ParamsT,
    X: Inputs = None,
    y: Targets = None,
    *,
    loss: nn.Module | None = None,
    mc_samples: int | None = 1,
    generator: torch.Generator | None = None,
    kfac_approx: KfacApprox = "sum",
    on_unsupported: OnUnsupported = "raise",
    fisher_type: FisherType = "mc",
    **dataset: Unpack[DataOptions],
) -> FactorTree:
    """KFAC: Kronecker factors from Monte-Carlo square-root columns (BackPACK's ``KFAC``).

    Args:
        mc_samples: Targets sampled per sample from the model's predictive distribution;
            ``None``: the exact loss Hessian, i.e. :func:`kflr` (as ``mc_samples=None`` means
            exact in every function).
        fisher_type: ``"mc"`` (the sampled Fisher), or ``"empirical"``: the factors of the
            empirical Fisher of the reduced loss ``L = Σ_n ℓ_n / Z``, ``Σ_n ∇ℓ_n ∇ℓ_nᵀ / Z``
            at the given targets ``y`` (``Z = 1`` for ``reduction='sum'``, where it is
            ``Σ_n g_n g_nᵀ`` with ``g_n = batch_grad[n]``; ``mc_samples`` unused), scaled as
            the loss, as the other factors and curvlinops' ``fisher_type``.

    Returns:
        Pytree like ``params``; each leaf a list of factors (or ``None``).

    Example:
        >>> model_fn, params = packfunc.functional(torch.nn.Linear(3, 2))
        >>> A, B = kfac(model_fn, params, torch.randn(5, 3), torch.randint(0, 2, (5,)))["weight"]
        >>> A.shape, B.shape
        (torch.Size([2, 2]), torch.Size([3, 3]))
    """
    columns = (kfac_approx, mc_samples, generator, fisher_type)
    factors = _sqrt_factors(model_fn, params, X, y, loss, on_unsupported, *columns, False)[0]
    return cast(FactorTree, factors)


@over_data(SPECS["kflr"])
@shares_arguments(
    "model_fn", "params", "X", "y", "loss", "kfac_approx", "on_unsupported", *DATA_ARGUMENTS
)
def kflr(
    model_fn: ModelFn,
    params: ParamsT,
    X: Inputs = None,
    y: Targets = None,
    *,
    loss: nn.Module | None = None,
    kfac_approx: KfacApprox = "sum",
    on_unsupported: OnUnsupported = "raise",
    **dataset: Unpack[DataOptions],
) -> FactorTree:
    """KFLR: Kronecker factors from the exact square-root columns (BackPACK's ``KFLR``).

    Returns:
        Pytree like ``params``; each leaf a list of factors (or ``None``).

    Example:
        >>> model_fn, params = packfunc.functional(torch.nn.Linear(3, 2))
        >>> [A] = kflr(model_fn, params, torch.randn(5, 3), torch.randint(0, 2, (5,)))["bias"]
        >>> A.shape
        torch.Size([2, 2])
    """
    factors = _sqrt_factors(
        model_fn, params, X, y, loss, on_unsupported, kfac_approx, None, None, "mc", False
    )[0]
    return cast(FactorTree, factors)


@over_data(SPECS["kfra"])
@shares_arguments("y", "loss", *DATA_ARGUMENTS)
def kfra(
    model_fn: ModelFn,
    params: ParamsT,
    X: Inputs = None,
    y: Targets = None,
    *,
    loss: nn.Module | None = None,
    curvature: Curvature = "ggn",
    on_unsupported: OnUnsupported = "raise",
    **dataset: Unpack[DataOptions],
) -> FactorTree:
    """KFRA: Kronecker factors from the batch-averaged GGN of a sequential model.

    The loss Hessian summed over samples is propagated from the output to the
    input, ``H ← E_n[J_nᵀ H J_n]`` op by op (BackPACK's ``KFRA``). Only defined for
    sequential models: residual connections or reused activations raise.
    ``curvature="hessian"`` also adds each elementwise nonlinearity's residual
    curvature ``Σ_n δ_n ⊙ φ''_n`` (``δ`` the loss gradient at its output) to the
    diagonal of ``H``; ``"pch-clip"``/``"pch-abs"`` add its clipped/absolute value
    (BackPACK's ``HBP(curv_type, "sum", "average", ...)``).

    Args:
        model_fn: ``model_fn(params, X) -> output``, a chain of ops.
        params: Pytree of floating-point tensors.
        X: Input tensor with leading batch dimension ``N``.
        curvature: ``"ggn"``, ``"hessian"``, ``"pch-clip"`` or ``"pch-abs"``.
        on_unsupported: ``"raise"`` or ``"skip"`` (``None`` for those leaves).

    Returns:
        Pytree like ``params``; each leaf a list of factors (or ``None``).

    Raises:
        ValueError: for a model that is not sequential, unsupported leaves, or a
            Hessian variant with a nonlinearity that is not elementwise.

    Example:
        >>> model_fn, params = packfunc.functional(torch.nn.Linear(3, 2))
        >>> A, B = kfra(model_fn, params, torch.randn(5, 3), torch.randint(0, 2, (5,)))["weight"]
        >>> A.shape, B.shape
        (torch.Size([2, 2]), torch.Size([3, 3]))
    """
    if curvature not in CURVATURES:
        raise ValueError(f"curvature must be one of {tuple(CURVATURES)}; got {curvature!r}.")
    factors, bp = _factors(
        model_fn, params, X, y, loss, on_unsupported, True, lambda bp: kfra_factors(bp, curvature)
    )
    return cast(FactorTree, refuse_differentiation(factors, bp.leaves, "kfra", bp.X))


def sqrt_factors_and_loss(
    model_fn: ModelFn,
    params: ParamsT,
    X: Inputs,
    y: Targets,
    *,
    loss: nn.Module,
    mc_samples: int | None,
    generator: torch.Generator | None = None,
    kfac_approx: KfacApprox = "sum",
    fisher_type: FisherType = "mc",
    on_unsupported: OnUnsupported = "raise",
) -> tuple[Any, Tensor]:
    """:func:`kfac` (``mc_samples``) or :func:`kflr` (``None``) and the batch's reduced loss.

    One batch pass gives both (for clients such as the laplace backend, which report the
    loss beside the curvature); the loss is detached.

    Args:
        model_fn: ``model_fn(params, X) -> output``.
        params: Pytree of floating-point tensors.
        X: Inputs with leading batch dimension.
        y: Targets.
        loss: The loss module.
        mc_samples: Monte-Carlo samples (KFAC) or ``None`` (KFLR).
        generator: Random generator for the samples.
        kfac_approx: Position convention, as in :func:`kfac`.
        fisher_type: ``"mc"`` or ``"empirical"``, as in :func:`kfac`.
        on_unsupported: ``"raise"`` or ``"skip"``.

    Returns:
        ``(factors, loss)``: the factor pytree and ``loss(model_fn(params, X), y)``.

    Example:
        >>> model_fn, params = packfunc.functional(torch.nn.Linear(3, 2))
        >>> X, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
        >>> factors, value = sqrt_factors_and_loss(
        ...     model_fn, params, X, y, loss=torch.nn.CrossEntropyLoss(), mc_samples=None)
        >>> bool(value == torch.nn.CrossEntropyLoss()(model_fn(params, X), y))
        True
    """
    columns = (kfac_approx, mc_samples, generator, fisher_type)
    factors, bp = _sqrt_factors(model_fn, params, X, y, loss, on_unsupported, *columns, True)
    return factors, bp.loss_value.detach()


def _sqrt_factors(
    model_fn: ModelFn,
    params: ParamsT,
    X: Inputs,
    y: Targets,
    loss: nn.Module | None,
    on_unsupported: str,
    kfac_approx: str,
    mc_samples: int | None,
    generator: torch.Generator | None,
    fisher_type: FisherType,
    keeps_loss: bool,
) -> tuple[Any, BatchPass]:
    """KFAC/KFLR factors from square-root columns, and the batch pass they came from.

    Without ``keeps_loss`` the pass's loss is not taken (:attr:`BatchPass.keeps_loss`).
    """
    return _factors(
        model_fn,
        params,
        X,
        y,
        loss,
        on_unsupported,
        keeps_loss,
        partial(
            _columns_factors,
            last=True,
            mc_samples=mc_samples,
            generator=generator,
            kfac_approx=kfac_approx,
            fisher_type=fisher_type,
        ),
    )


def factors_from_pass(bp: BatchPass, name: str, options: Mapping[str, Any]) -> Factors:
    """KFAC's or KFLR's factors from a batch pass that ran, its graph kept for others.

    The BackPACK shim takes them from the user's own forward pass this way (inside the
    user's backward pass, whose graph goes on): the layers' activations and the random
    numbers of that pass, not another run's.

    Args:
        bp: The batch pass.
        name: ``"kfac"`` or ``"kflr"``.
        options: Their keyword options (``mc_samples``, ``generator``, ``kfac_approx``,
            ``fisher_type``; KFLR ``kfac_approx`` only), as :func:`kfac` takes them; an
            option left out takes :func:`kfac`'s default.

    Returns:
        The :class:`~packfunc.engine.layer_factors.Factors`, per leaf of ``bp``.

    Raises:
        ValueError: for another ``name``.

    Example:
        >>> fn, p = packfunc.functional(torch.nn.Linear(3, 2))
        >>> bp = BatchPass(fn, p, torch.randn(5, 3), torch.randint(0, 2, (5,)),
        ...                torch.nn.CrossEntropyLoss())
        >>> [f.shape for f in factors_from_pass(bp, "kflr", {}).per_leaf[0]]
        [torch.Size([2, 2])]
    """
    if name not in ("kfac", "kflr"):
        raise ValueError(f"factors_from_pass computes 'kfac' or 'kflr', not {name!r}.")
    exact = {"mc_samples": None} if name == "kflr" else {}
    return _columns_factors(bp, last=False, **{**options, **exact})


def _columns_factors(
    bp: BatchPass,
    *,
    last: bool,
    mc_samples: int | None = 1,
    generator: torch.Generator | None = None,
    kfac_approx: str = "sum",
    fisher_type: FisherType = "mc",
) -> Factors:
    """KFAC (``mc_samples``) or KFLR (``None``) factors of ``bp`` with :func:`kfac`'s options."""
    return sqrt_factors(
        bp, _approx(kfac_approx), mc_samples, generator, _empirical(fisher_type), last=last
    )


def _empirical(fisher_type: FisherType) -> bool:
    if fisher_type not in FISHER_TYPES:
        raise ValueError(f"fisher_type must be one of {FISHER_TYPES}; got {fisher_type!r}.")
    return fisher_type == "empirical"


def _approx(kfac_approx: str) -> str:
    return checked_approx(kfac_approx)


def _factors(
    model_fn: ModelFn,
    params: Any,
    X: Any,
    y: Targets,
    loss: nn.Module | None,
    on_unsupported: str,
    keeps_loss: bool,
    method: Callable[[BatchPass], Factors],
) -> tuple[Any, BatchPass]:
    """The factor pytree that ``method`` finds in the batch pass, and the pass."""
    if on_unsupported not in ("raise", "skip"):
        raise ValueError(f"on_unsupported must be 'raise' or 'skip'; got {on_unsupported!r}.")
    refuse_complex_squares(params, ["Kronecker factors"])
    bp = BatchPass(model_fn, params, X, given_targets(y, "kfac"), loss or default_loss())
    bp.keeps_loss = keeps_loss
    with bp.undone_on_refusal():
        found = method(bp)
        refuse_unsupported(bp, found, on_unsupported)
    return optree.tree_unflatten(bp.treespec, found.per_leaf), bp
