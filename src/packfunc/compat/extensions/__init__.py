"""Extensions that can be passed to ``with backpack(...)`` (BackPACK's 19 classes)."""

from packfunc.compat.extensions.curvmatprod import GGNMP, HMP, PCHMP
from packfunc.compat.extensions.firstorder import (
    BatchGrad,
    BatchL2Grad,
    ClippedGrad,
    SumGradSquared,
    Variance,
)
from packfunc.compat.extensions.secondorder import (
    HBP,
    KFAC,
    KFLR,
    KFRA,
    BatchDiagGGNExact,
    BatchDiagGGNMC,
    BatchDiagHessian,
    DiagGGNExact,
    DiagGGNMC,
    DiagHessian,
    SqrtGGNExact,
    SqrtGGNMC,
)

__all__ = [
    "GGNMP",
    "HMP",
    "PCHMP",
    "BatchGrad",
    "BatchL2Grad",
    "ClippedGrad",
    "SumGradSquared",
    "Variance",
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
