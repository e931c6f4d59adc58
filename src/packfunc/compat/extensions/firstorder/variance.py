"""``Variance``: variance of per-sample gradients."""

from __future__ import annotations

from packfunc.compat.extensions.backprop_extension import BackpropExtension, Job
from packfunc.specs import SPECS


class Variance(BackpropExtension):
    """``mean_n(grad_batch²) − mean_n(grad_batch)²`` in ``param.variance``.

    Example:
        >>> Variance().savefield
        'variance'
    """

    def __init__(self) -> None:
        super().__init__(savefield="variance")

    def job(self) -> Job:
        """The gradient variance over the batch."""
        return Job(SPECS["variance"], second_order=False)
