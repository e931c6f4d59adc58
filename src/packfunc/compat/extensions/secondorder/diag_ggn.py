"""GGN diagonals: ``DiagGGNExact``, ``DiagGGNMC`` and their per-sample versions."""

from __future__ import annotations

from packfunc.compat.extensions.backprop_extension import BackpropExtension, Job
from packfunc.specs import SPECS


class DiagGGNExact(BackpropExtension):
    """Exact GGN diagonal in ``param.diag_ggn_exact``.

    Example:
        >>> DiagGGNExact().savefield
        'diag_ggn_exact'
    """

    def __init__(self) -> None:
        super().__init__(savefield="diag_ggn_exact")

    def job(self) -> Job:
        """The exact GGN diagonal."""
        return Job(SPECS["diag_ggn"])


class DiagGGNMC(BackpropExtension):
    """Monte-Carlo GGN diagonal in ``param.diag_ggn_mc``.

    Args:
        mc_samples: Targets sampled per sample from the model's predictive distribution.

    Example:
        >>> DiagGGNMC(mc_samples=2).savefield
        'diag_ggn_mc'
    """

    def __init__(self, mc_samples: int = 1):
        super().__init__(savefield="diag_ggn_mc")
        self.mc_samples = mc_samples

    def get_num_mc_samples(self) -> int:
        """The number of Monte-Carlo samples."""
        return self.mc_samples

    def job(self) -> Job:
        """The sampled GGN diagonal."""
        return Job(SPECS["diag_ggn"], (("mc_samples", self.mc_samples),))


class BatchDiagGGNExact(BackpropExtension):
    """Per-sample exact GGN diagonals ``[N, *p]`` in ``param.diag_ggn_exact_batch``.

    Example:
        >>> BatchDiagGGNExact().savefield
        'diag_ggn_exact_batch'
    """

    def __init__(self) -> None:
        super().__init__(savefield="diag_ggn_exact_batch")

    def job(self) -> Job:
        """Per-sample exact GGN diagonals."""
        return Job(SPECS["batch_diag_ggn"])


class BatchDiagGGNMC(BackpropExtension):
    """Per-sample Monte-Carlo GGN diagonals in ``param.diag_ggn_mc_batch``.

    Args:
        mc_samples: Targets sampled per sample from the model's predictive distribution.

    Example:
        >>> BatchDiagGGNMC().savefield
        'diag_ggn_mc_batch'
    """

    def __init__(self, mc_samples: int = 1):
        super().__init__(savefield="diag_ggn_mc_batch")
        self.mc_samples = mc_samples

    def get_num_mc_samples(self) -> int:
        """The number of Monte-Carlo samples."""
        return self.mc_samples

    def job(self) -> Job:
        """Per-sample sampled GGN diagonals."""
        return Job(SPECS["batch_diag_ggn"], (("mc_samples", self.mc_samples),))
