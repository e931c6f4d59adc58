"""``SumGradSquared``: sum of squared per-sample gradients."""

from __future__ import annotations

from packfunc.compat.extensions.backprop_extension import BackpropExtension, Job
from packfunc.specs import SPECS


class SumGradSquared(BackpropExtension):
    """``Σ_n grad_batch[n]²`` in ``param.sum_grad_squared``.

    Example:
        >>> SumGradSquared().savefield
        'sum_grad_squared'
    """

    def __init__(self) -> None:
        super().__init__(savefield="sum_grad_squared")

    def job(self) -> Job:
        """The second moment of per-sample gradients, summed."""
        return Job(SPECS["sum_grad_squared"], second_order=False)
