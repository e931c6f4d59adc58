"""Kronecker-factored curvature: ``KFAC``, ``KFLR``, ``KFRA`` and the general ``HBP``."""

from __future__ import annotations

from packfunc.compat.extensions.backprop_extension import BackpropExtension, Job

BOTEV_MARTENS = "E[J^T E(H) J]"
"""The expectation approximation packfunc implements (BackPACK's default)."""


class HBP(BackpropExtension):
    """Hessian backpropagation for Kronecker factors, configured by strategies.

    Args:
        curv_type: ``"ggn"`` (the only curvature with Kronecker factors here).
        loss_hessian_strategy: ``"exact"``, ``"sampling"`` or ``"sum"``.
        backprop_strategy: ``"sqrt"`` or ``"average"``.
        ea_strategy: ``"E[J^T E(H) J]"``.
        savefield: Attribute to store the factors in.

    Raises:
        NotImplementedError: for combinations other than those of KFAC, KFLR and KFRA.

    Example:
        >>> HBP("ggn", "exact", "sqrt", "E[J^T E(H) J]").job().name
        'kflr'
    """

    def __init__(self, curv_type: str, loss_hessian_strategy: str, backprop_strategy: str,
                 ea_strategy: str, savefield: str = "hbp"):
        super().__init__(savefield=savefield)
        method = {("exact", "sqrt"): "kflr", ("sampling", "sqrt"): "kfac",
                  ("sum", "average"): "kfra"}.get((loss_hessian_strategy, backprop_strategy))
        if curv_type != "ggn" or ea_strategy != BOTEV_MARTENS or method is None:
            raise NotImplementedError(
                f"HBP({curv_type!r}, {loss_hessian_strategy!r}, {backprop_strategy!r}, "
                f"{ea_strategy!r}) is not available; packfunc provides the GGN factorizations "
                "of KFAC (sampling, sqrt), KFLR (exact, sqrt) and KFRA (sum, average).")
        self.method, self.mc_samples = method, 1

    def get_num_mc_samples(self) -> int:
        """The number of Monte-Carlo samples (KFAC)."""
        return self.mc_samples

    def job(self) -> Job:
        """The Kronecker factorization."""
        options = (("mc_samples", self.mc_samples),) if self.method == "kfac" else ()
        return Job("kronecker", self.method, options)


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

    def __init__(self):
        super().__init__("ggn", "exact", "sqrt", BOTEV_MARTENS, savefield="kflr")


class KFRA(HBP):
    """KFRA factors (batch-averaged recursion, sequential models) in ``param.kfra``.

    Example:
        >>> KFRA().savefield
        'kfra'
    """

    def __init__(self):
        super().__init__("ggn", "sum", "average", BOTEV_MARTENS, savefield="kfra")
