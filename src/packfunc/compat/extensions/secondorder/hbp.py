"""Kronecker-factored curvature: ``KFAC``, ``KFLR``, ``KFRA`` and the general ``HBP``."""

from __future__ import annotations

from packfunc.compat.extensions.backprop_extension import BackpropExtension, Job
from packfunc.engine.api import CURVATURES
from packfunc.specs import SPECS

BOTEV_MARTENS = "E[J^T E(H) J]"
"""The expectation approximation packfunc implements (BackPACK's default)."""

BACKPACK_POSITIONS = "sum"
"""BackPACK's ``kfac_approx`` for KFAC/KFLR: positions summed in both factors (see
:mod:`packfunc.kronecker_factors`)."""


class HBP(BackpropExtension):
    """Hessian backpropagation for Kronecker factors, configured by strategies.

    The square-root strategies give KFLR (``"exact"``) and KFAC (``"sampling"``),
    ``("sum", "average")`` gives KFRA; with ``curv_type`` ``"hessian"``, ``"pch-clip"``
    or ``"pch-abs"`` KFRA adds the activations' residual curvature (kept, clipped,
    absolute) to the propagated matrix, as BackPACK does.

    Args:
        curv_type: ``"ggn"``, ``"hessian"``, ``"pch-clip"`` or ``"pch-abs"``.
        loss_hessian_strategy: ``"exact"``, ``"sampling"`` or ``"sum"``.
        backprop_strategy: ``"sqrt"`` or ``"average"``.
        ea_strategy: ``"E[J^T E(H) J]"``.
        savefield: Attribute to store the factors in.

    Raises:
        NotImplementedError: for other combinations, and for a curvature other than the
            GGN with the square-root strategy: square-root columns cannot carry the
            residual curvature, which may be negative (BackPACK 1.7.1 drops it silently
            and returns the GGN factors).

    Example:
        >>> HBP("ggn", "exact", "sqrt", "E[J^T E(H) J]").job().name
        'kflr'
        >>> HBP("hessian", "sum", "average", "E[J^T E(H) J]").job().options
        (('curvature', 'hessian'),)
    """

    def __init__(
        self,
        curv_type: str,
        loss_hessian_strategy: str,
        backprop_strategy: str,
        ea_strategy: str,
        savefield: str = "hbp",
    ):
        super().__init__(savefield=savefield)
        method = {
            ("exact", "sqrt"): "kflr",
            ("sampling", "sqrt"): "kfac",
            ("sum", "average"): "kfra",
        }.get((loss_hessian_strategy, backprop_strategy))
        description = (
            f"HBP({curv_type!r}, {loss_hessian_strategy!r}, {backprop_strategy!r}, {ea_strategy!r})"
        )
        if ea_strategy != BOTEV_MARTENS or method is None or curv_type not in CURVATURES:
            raise NotImplementedError(
                f"{description} is not available; packfunc provides KFAC (sampling, sqrt), "
                f"KFLR (exact, sqrt) and KFRA (sum, average) with {BOTEV_MARTENS!r}, and "
                f"curv_type one of {tuple(CURVATURES)}."
            )
        if curv_type != "ggn" and method != "kfra":
            raise NotImplementedError(
                f"{description}: the square-root strategy propagates columns whose outer "
                "products are positive semi-definite, so it cannot carry the activations' "
                f"residual curvature of {curv_type!r} (BackPACK 1.7.1 drops that term silently "
                "and returns the GGN factors). Use curv_type='ggn' for KFLR/KFAC, or "
                f"HBP({curv_type!r}, 'sum', 'average', ...) for the Kronecker-factored "
                "curvature with residual terms."
            )
        self.method, self.mc_samples, self.curv_type = method, 1, curv_type

    def get_num_mc_samples(self) -> int:
        """The number of Monte-Carlo samples (KFAC)."""
        return self.mc_samples

    def job(self) -> Job:
        """The Kronecker factorization."""
        options: tuple[tuple[str, object], ...] = ()
        if self.method == "kflr":
            options = (("kfac_approx", BACKPACK_POSITIONS),)
        elif self.method == "kfac":
            options = (("mc_samples", self.mc_samples), ("kfac_approx", BACKPACK_POSITIONS))
        elif self.method == "kfra" and self.curv_type != "ggn":
            options = (("curvature", self.curv_type),)
        return Job(SPECS[self.method], options)


class KFAC(HBP):
    """KFAC factors (Monte-Carlo loss Hessian) in ``param.kfac``.

    Args:
        mc_samples: Targets sampled per sample.

    Example:
        >>> KFAC().savefield
        'kfac'
    """

    def __init__(self, mc_samples: int = 1):
        super().__init__("ggn", "sampling", "sqrt", BOTEV_MARTENS, savefield="kfac")
        self.mc_samples = mc_samples


class KFLR(HBP):
    """KFLR factors (exact loss Hessian) in ``param.kflr``.

    Example:
        >>> KFLR().savefield
        'kflr'
    """

    def __init__(self) -> None:
        super().__init__("ggn", "exact", "sqrt", BOTEV_MARTENS, savefield="kflr")


class KFRA(HBP):
    """KFRA factors (batch-averaged recursion, sequential models) in ``param.kfra``.

    Example:
        >>> KFRA().savefield
        'kfra'
    """

    def __init__(self) -> None:
        super().__init__("ggn", "sum", "average", BOTEV_MARTENS, savefield="kfra")
