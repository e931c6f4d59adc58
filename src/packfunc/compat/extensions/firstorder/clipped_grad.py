"""``ClippedGrad``: DP-SGD's clipped sum of per-sample gradients, stored in ``grad_clipped``.

Not a BackPACK extension: packfunc's equivalent of :func:`packfunc.clipped_grad` for
BackPACK-style code. Clipping needs each sample's own loss, so the loss must be extended
(``extend(lossfunc)``) and use ``reduction='sum'``.
"""

from __future__ import annotations

from packfunc.compat.extensions.backprop_extension import BackpropExtension, Job
from packfunc.specs import SPECS


class ClippedGrad(BackpropExtension):
    """``Σ_n g_n · min(1, C / (‖g_n‖ + 1e-6))`` per parameter (norms over all): ``grad_clipped``.

    Args:
        max_norm: The bound ``C > 0``, or one bound per trainable parameter (in
            ``model.parameters()`` order), each clipped alone by its own norm.

    Example:
        >>> ClippedGrad(1.0).savefield
        'grad_clipped'
    """

    def __init__(self, max_norm: float | list[float]) -> None:
        super().__init__(savefield="grad_clipped")
        self.max_norm = max_norm

    def job(self) -> Job:
        """The clipped sum, with the extended loss (its reduction must be ``'sum'``)."""
        if isinstance(self.max_norm, (list, tuple)):
            bound: float | tuple[float, ...] = tuple(self.max_norm)
        else:
            bound = float(self.max_norm)
        return Job(SPECS["clipped_grad"], (("max_norm", bound),))
