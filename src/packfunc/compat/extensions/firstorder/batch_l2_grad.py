"""``BatchL2Grad``: squared norms of per-sample gradients, stored in ``batch_l2``."""

from __future__ import annotations

from packfunc.compat.extensions.backprop_extension import BackpropExtension, Job
from packfunc.specs import SPECS


class BatchL2Grad(BackpropExtension):
    """``‖grad_batch[n]‖²`` per parameter, ``[N]``, in ``param.batch_l2``.

    Example:
        >>> BatchL2Grad().savefield
        'batch_l2'
    """

    def __init__(self) -> None:
        super().__init__(savefield="batch_l2")

    def job(self) -> Job:
        """Squared per-sample gradient norms."""
        return Job(SPECS["batch_l2_grad"], second_order=False)
