"""``BatchGrad``: per-sample gradients, stored in ``grad_batch``."""

from __future__ import annotations

from packfunc.compat.extensions.backprop_extension import BackpropExtension, Job
from packfunc.specs import SPECS


class BatchGrad(BackpropExtension):
    """Per-sample gradients ``[N, *p]`` (``[len(subsampling), *p]``) in ``param.grad_batch``.

    Args:
        subsampling: Sample indices to compute (default: all).

    Example:
        >>> BatchGrad().savefield
        'grad_batch'
    """

    def __init__(self, subsampling: list[int] | None = None):
        super().__init__(savefield="grad_batch", subsampling=subsampling)

    def job(self) -> Job:
        """Per-sample gradients, from the backward pass's own output gradient."""
        return Job(SPECS["batch_grad"], (("subsampling", self.subsampling),), second_order=False)
