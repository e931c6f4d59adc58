"""Every quantity as one typed spec: what the engine records, and how batches and ranks combine.

A :class:`Quantity` says which output cotangents and statistics the engine must
produce for it (``None`` for a quantity with a function of its own: Kronecker
factors, curvature products), how its per-batch values combine over ``data=``
batches and ``process_group=`` ranks (:class:`Combine`), and how it scales with the
loss. :func:`packfunc.compute`, the dataset driver (:mod:`packfunc.data`), the
public functions and the BackPACK shim's jobs and rank reductions all read these
specs; nothing else lists quantities. A new quantity is one new entry in
:data:`SPECS` (and its statistic rule if the statistic is new), plus its public
function of the same name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from enum import Enum

from torch import Tensor

from packfunc.engine.vocabulary import Statistic

Stats = Mapping[Statistic, Tensor]
"""One parameter leaf's statistics, by statistic."""


class Cotangents(Enum):
    """Which output cotangents a quantity's statistics are pulled back from."""

    GRADIENT = "gradient"
    """The loss gradient (one column per sample): first-order quantities."""

    GGN = "ggn"
    """The columns of the loss Hessian's square root, exact or Monte-Carlo."""

    HESSIAN = "hessian"
    """The exact Hessian (second derivatives through the model): Hessian diagonals."""

    CLIPPED_GRADIENT = "clipped gradient"
    """The loss gradient with sample ``n``'s rows scaled by ``min(1, C / ‖g_n‖)``: DP-SGD."""


class Combine(Enum):
    """How a quantity's per-batch values combine over batches and ranks."""

    SUM = "sum"
    """A sum over samples: summed, then scaled by ``(1/Z) ** loss_power``."""

    PER_SAMPLE = "per-sample"
    """One entry per sample: streamed batch by batch, each scaled for the dataset."""

    KRONECKER = "kronecker"
    """Factor lists ``[A, B]``: ``A`` as :attr:`SUM`, ``B`` a count-weighted mean."""

    MOMENTS = "moments"
    """Made from the combined values of other quantities (its :attr:`Quantity.parts`)."""

    ONE_BATCH = "one-batch"
    """Not a sum over samples (nested batch averages): one batch on one process only."""


class Family(Enum):
    """Which public function computes a quantity (and which shim job runs it)."""

    STATISTIC = "statistic"
    """A statistic of column gradients: :func:`packfunc.compute` and its thin wrappers."""

    FACTORS = "factors"
    """Kronecker factors per parameter: ``kfac``, ``kflr``, ``kfra``."""

    PRODUCTS = "products"
    """Curvature products with given vectors or matrices."""


@dataclass(frozen=True)
class Quantity:
    """One quantity: its name, what the engine computes, how it combines and scales.

    Attributes:
        name: The public function's name (and :func:`packfunc.compute`'s name for it).
        summary: One line: what it is (BackPACK's name, where BackPACK has it).
        family: Which function computes it.
        combine: How batches and ranks combine it.
        loss_power: ``p`` in ``× (1/Z) ** p`` when the loss is rescaled by ``1/Z``
            (for Kronecker factors: the output-side factor ``A``).
        cotangents: The output cotangents (statistics only).
        statistic: The one statistic it is made of (statistics only).
        parts: :attr:`Combine.MOMENTS` only: the quantities it is made of.
        from_parts: :attr:`Combine.MOMENTS` only: ``(parts' values, sample count) -> value``.
        per_sample_loss: Whether it needs each sample's own loss (``reduction='sum'``),
            as clipping does: a mean would clip gradients scaled by ``1/N``.
        reruns_model: Whether it runs the model again beyond the forward pass whose loss
            it reports (KFRA's chain, curvature products): the BackPACK shim computes the
            others from the user's own forward pass, these with a pass of its own (refused
            for a model that changed since, draws random numbers or changes a buffer).
        differentiable: Whether its gradient with respect to the parameters is right. The
            Hessian diagonals and KFRA hold the second derivatives through the layers
            before a parameter (and KFRA's chain) constant: their gradients are refused.

    Example:
        >>> SPECS["batch_l2_grad"].combine, SPECS["batch_l2_grad"].loss_power
        (<Combine.PER_SAMPLE: 'per-sample'>, 2)
    """

    name: str
    summary: str
    family: Family
    combine: Combine
    loss_power: float = 1
    cotangents: Cotangents | None = None
    statistic: Statistic | None = None
    parts: tuple[str, ...] = ()
    from_parts: Callable[[tuple[Tensor, ...], float], Tensor] | None = field(
        default=None, repr=False
    )
    per_sample_loss: bool = False
    reruns_model: bool = False
    differentiable: bool = True


def _variance(parts: tuple[Tensor, ...], samples: float) -> Tensor:
    """The gradient variance over samples from the gradient and ``sum_grad_squared``.

    The difference rounds below zero where the samples agree (one sample: ``-3e-8`` in
    float32); a variance is not negative, so those entries read 0.
    """
    gradient, squares = parts
    return (squares / samples - (gradient / samples) ** 2).clamp(min=0)


def _statistic(
    name: str,
    summary: str,
    cotangents: Cotangents,
    statistic: Statistic,
    combine: Combine = Combine.SUM,
    loss_power: float = 1,
) -> Quantity:
    """A quantity that is one statistic of one kind of output cotangents."""
    return Quantity(
        name, summary, Family.STATISTIC, combine, loss_power, cotangents, statistic=statistic
    )


def _own(
    name: str,
    summary: str,
    family: Family,
    combine: Combine,
    reruns_model: bool = False,
) -> Quantity:
    """A quantity with a function of its own (not a statistic :func:`compute` makes)."""
    return Quantity(
        name,
        summary,
        family,
        combine,
        reruns_model=reruns_model,
    )


GRADIENT, GGN, HESSIAN = Cotangents.GRADIENT, Cotangents.GGN, Cotangents.HESSIAN
_PER_SAMPLE = Combine.PER_SAMPLE

SPECS: dict[str, Quantity] = {
    spec.name: spec
    for spec in (
        _statistic("grad", "the gradient", GRADIENT, Statistic.SUM),
        _statistic(
            "batch_grad",
            "per-sample gradients (BatchGrad)",
            GRADIENT,
            Statistic.COLUMNS,
            _PER_SAMPLE,
        ),
        _statistic(
            "batch_l2_grad",
            "per-sample squared gradient norms (BatchL2Grad)",
            GRADIENT,
            Statistic.SQUARED_NORMS,
            _PER_SAMPLE,
            loss_power=2,
        ),
        _statistic(
            "sum_grad_squared",
            "sum of squared per-sample gradients (SumGradSquared)",
            GRADIENT,
            Statistic.DIAGONAL,
            loss_power=2,
        ),
        Quantity(
            "variance",
            "gradient variance over samples (Variance)",
            Family.STATISTIC,
            Combine.MOMENTS,
            cotangents=GRADIENT,
            parts=("grad", "sum_grad_squared"),
            from_parts=_variance,
        ),
        _statistic(
            "sqrt_ggn",
            "the GGN's per-sample square root (SqrtGGNExact/MC)",
            GGN,
            Statistic.COLUMNS,
            _PER_SAMPLE,
            loss_power=0.5,
        ),
        _statistic("diag_ggn", "the GGN diagonal (DiagGGNExact/MC)", GGN, Statistic.DIAGONAL),
        _statistic(
            "batch_diag_ggn",
            "per-sample GGN diagonals (BatchDiagGGNExact/MC)",
            GGN,
            Statistic.DIAGONAL_PER_SAMPLE,
            _PER_SAMPLE,
        ),
        replace(
            _statistic(
                "diag_hessian", "the Hessian diagonal (DiagHessian)", HESSIAN, Statistic.DIAGONAL
            ),
            differentiable=False,
        ),
        replace(
            _statistic(
                "batch_diag_hessian",
                "per-sample Hessian diagonals (BatchDiagHessian)",
                HESSIAN,
                Statistic.DIAGONAL_PER_SAMPLE,
                _PER_SAMPLE,
            ),
            differentiable=False,
        ),
        Quantity(
            "clipped_grad",
            "the sum of per-sample gradients clipped to norm max_norm (DP-SGD)",
            Family.STATISTIC,
            Combine.SUM,
            cotangents=Cotangents.CLIPPED_GRADIENT,
            statistic=Statistic.SUM,
            per_sample_loss=True,
        ),
        _own(
            "kfac",
            "Kronecker factors, Monte-Carlo or empirical Fisher (KFAC)",
            Family.FACTORS,
            Combine.KRONECKER,
        ),
        _own("kflr", "Kronecker factors, exact GGN (KFLR)", Family.FACTORS, Combine.KRONECKER),
        replace(
            _own(
                "kfra",
                "Kronecker factors, recursive (KFRA)",
                Family.FACTORS,
                Combine.ONE_BATCH,
                reruns_model=True,
            ),
            differentiable=False,
        ),
        *(
            _own(name, summary, Family.PRODUCTS, Combine.SUM, reruns_model=True)
            for name, summary in (
                ("ggn_vector_product", "GGN-vector product"),
                ("hessian_vector_product", "Hessian-vector product"),
                ("ggn_block_products", "GGN block-matrix products (GGNMP)"),
                ("hessian_block_products", "Hessian block-matrix products (HMP)"),
                ("pch_block_products", "positive-curvature Hessian block products (PCHMP)"),
            )
        ),
    )
}
"""Every quantity packfunc computes, by public function name."""

QUANTITIES: dict[str, Quantity] = {
    name: spec for name, spec in SPECS.items() if spec.family is Family.STATISTIC
}
"""The quantities :func:`packfunc.compute` makes (the others have their own functions)."""

FIRST_ORDER = tuple(name for name, spec in QUANTITIES.items() if spec.cotangents is GRADIENT)
"""The first-order quantities."""

SECOND_ORDER = tuple(name for name, spec in QUANTITIES.items() if spec.cotangents in (GGN, HESSIAN))
"""The second-order quantities."""

__all__ = [
    "FIRST_ORDER",
    "QUANTITIES",
    "SECOND_ORDER",
    "SPECS",
    "Combine",
    "Cotangents",
    "Family",
    "Quantity",
]
