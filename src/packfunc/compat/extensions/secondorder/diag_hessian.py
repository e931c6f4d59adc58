"""Hessian diagonals: ``DiagHessian`` and ``BatchDiagHessian``."""

from __future__ import annotations

from packfunc.compat.extensions.backprop_extension import BackpropExtension, Job
from packfunc.specs import SPECS


class DiagHessian(BackpropExtension):
    """Diagonal of the loss Hessian in ``param.diag_h``.

    Example:
        >>> DiagHessian().savefield
        'diag_h'
    """

    def __init__(self) -> None:
        super().__init__(savefield="diag_h")

    def job(self) -> Job:
        """The Hessian diagonal."""
        return Job(SPECS["diag_hessian"])


class BatchDiagHessian(BackpropExtension):
    """Per-sample Hessian diagonals ``[N, *p]`` in ``param.diag_h_batch``.

    Example:
        >>> BatchDiagHessian().savefield
        'diag_h_batch'
    """

    def __init__(self) -> None:
        super().__init__(savefield="diag_h_batch")

    def job(self) -> Job:
        """Per-sample Hessian diagonals."""
        return Job(SPECS["batch_diag_hessian"])
