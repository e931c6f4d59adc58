"""Square roots of the GGN: ``SqrtGGNExact`` and ``SqrtGGNMC``."""

from __future__ import annotations

from packfunc.compat.extensions.backprop_extension import BackpropExtension, Job
from packfunc.specs import SPECS


class SqrtGGNExact(BackpropExtension):
    """GGN square root ``[C, N, *p]`` in ``param.sqrt_ggn_exact``.

    Args:
        subsampling: Sample indices to compute (default: all).

    Example:
        >>> SqrtGGNExact().savefield
        'sqrt_ggn_exact'
    """

    def __init__(self, subsampling: list[int] | None = None):
        super().__init__(savefield="sqrt_ggn_exact", subsampling=subsampling)

    def job(self) -> Job:
        """The exact square root."""
        return Job(SPECS["sqrt_ggn"], (("subsampling", self.subsampling),))


class SqrtGGNMC(BackpropExtension):
    """Monte-Carlo GGN square root ``[M, N, *p]`` in ``param.sqrt_ggn_mc``.

    Args:
        mc_samples: Targets sampled per sample.
        subsampling: Sample indices to compute (default: all).

    Example:
        >>> SqrtGGNMC(mc_samples=3).savefield
        'sqrt_ggn_mc'
    """

    def __init__(self, mc_samples: int = 1, subsampling: list[int] | None = None):
        super().__init__(savefield="sqrt_ggn_mc", subsampling=subsampling)
        self.mc_samples = mc_samples

    def get_num_mc_samples(self) -> int:
        """The number of Monte-Carlo samples."""
        return self.mc_samples

    def job(self) -> Job:
        """The sampled square root."""
        return Job(
            SPECS["sqrt_ggn"],
            (("subsampling", self.subsampling), ("mc_samples", self.mc_samples)),
        )
