"""Second-order extensions."""

from packfunc.compat.extensions.secondorder.diag_ggn import (
    BatchDiagGGNExact,
    BatchDiagGGNMC,
    DiagGGNExact,
    DiagGGNMC,
)
from packfunc.compat.extensions.secondorder.diag_hessian import BatchDiagHessian, DiagHessian
from packfunc.compat.extensions.secondorder.hbp import HBP, KFAC, KFLR, KFRA
from packfunc.compat.extensions.secondorder.sqrt_ggn import SqrtGGNExact, SqrtGGNMC

__all__ = [
    "HBP",
    "KFAC",
    "KFLR",
    "KFRA",
    "BatchDiagGGNExact",
    "BatchDiagGGNMC",
    "BatchDiagHessian",
    "DiagGGNExact",
    "DiagGGNMC",
    "DiagHessian",
    "SqrtGGNExact",
    "SqrtGGNMC",
]
