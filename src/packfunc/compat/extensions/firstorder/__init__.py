"""First-order extensions."""

from packfunc.compat.extensions.firstorder.batch_grad import BatchGrad
from packfunc.compat.extensions.firstorder.batch_l2_grad import BatchL2Grad
from packfunc.compat.extensions.firstorder.clipped_grad import ClippedGrad
from packfunc.compat.extensions.firstorder.sum_grad_squared import SumGradSquared
from packfunc.compat.extensions.firstorder.variance import Variance

__all__ = ["BatchGrad", "BatchL2Grad", "ClippedGrad", "SumGradSquared", "Variance"]
