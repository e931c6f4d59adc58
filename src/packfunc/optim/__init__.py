"""Curvature preconditioners: optax-style transformations and ``torch.optim`` optimizers.

* :mod:`packfunc.optim.transforms`: pure gradient transformations —
  :func:`scale_by_kfac`, :func:`scale_by_ekfac`, :func:`scale_by_diag_ggn` return
  ``(C + damping·I)⁻¹ g``; compose them with :func:`scale` and :func:`chain`, and add
  the updates with :func:`apply_updates`. ``update`` also takes the batch ``(X, y)``.
* :mod:`packfunc.optim.optimizers`: :class:`KFAC`, :class:`EKFAC`, :class:`DiagGGN`
  (and their base :class:`CurvatureOptimizer`), whose ``step(closure=None, *,
  batch=(X, y))`` reads the gradients from ``.grad`` and the learning rate from the
  parameter group at every step.
"""

from packfunc.optim.optimizers import EKFAC, KFAC, CurvatureOptimizer, DiagGGN
from packfunc.optim.transforms import (
    Batch,
    CurvatureState,
    EkfacCurvature,
    EmptyState,
    GradientTransformation,
    MissingBatchError,
    apply_updates,
    chain,
    scale,
    scale_by_diag_ggn,
    scale_by_ekfac,
    scale_by_kfac,
)

__all__ = [
    "EKFAC",
    "KFAC",
    "Batch",
    "CurvatureOptimizer",
    "CurvatureState",
    "DiagGGN",
    "EkfacCurvature",
    "EmptyState",
    "GradientTransformation",
    "MissingBatchError",
    "apply_updates",
    "chain",
    "scale",
    "scale_by_diag_ggn",
    "scale_by_ekfac",
    "scale_by_kfac",
]
