"""packfunc: per-sample gradients, their moments and curvature as pure torch.func functions."""

from packfunc.firstorder import (
    QUANTITIES,
    batch_grad,
    batch_l2_grad,
    first_order,
    sum_grad_squared,
    variance,
)
from packfunc.functional import functional

__all__ = [
    "QUANTITIES",
    "batch_grad",
    "batch_l2_grad",
    "first_order",
    "functional",
    "sum_grad_squared",
    "variance",
]
__version__ = "0.1.0"
