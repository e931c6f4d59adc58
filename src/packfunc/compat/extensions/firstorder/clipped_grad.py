"""``ClippedGrad``: DP-SGD's clipped sum of per-sample gradients, stored in ``grad_clipped``.

Not a BackPACK extension: packfunc's equivalent of :func:`packfunc.clipped_grad` for
BackPACK-style code. Clipping needs each sample's own loss, so the loss must be extended
(``extend(lossfunc)``) and use ``reduction='sum'``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from packfunc.compat.extensions.backprop_extension import BackpropExtension, Job
from packfunc.specs import SPECS


class ClippedGrad(BackpropExtension):
    """``Σ_n g_n · min(1, C / (‖g_n‖ + 1e-6))`` per parameter (norms over all): ``grad_clipped``.

    Args:
        max_norm: The bound ``C > 0``; one bound per trainable parameter (a list in
            ``model.parameters()`` order), each clipped alone by its own norm; or bounds by
            name of ``model.named_parameters()``, of parameters or groups of them, as
            :func:`packfunc.clipped_grad` takes them (``{("0.weight", "0.bias"): C}``).

    Example:
        >>> ClippedGrad(1.0).savefield
        'grad_clipped'
    """

    def __init__(self, max_norm: float | list[float] | Mapping[Any, float]) -> None:
        super().__init__(savefield="grad_clipped")
        self.max_norm = max_norm

    def job(self) -> Job:
        """The clipped sum, with the extended loss (its reduction must be ``'sum'``)."""
        bound: float | tuple[float, ...] | dict[Any, float]
        if isinstance(self.max_norm, Mapping):
            bound = dict(self.max_norm)
        elif isinstance(self.max_norm, (list, tuple)):
            bound = tuple(self.max_norm)
        else:
            bound = float(self.max_norm)
        return Job(SPECS["clipped_grad"], (("max_norm", bound),))
