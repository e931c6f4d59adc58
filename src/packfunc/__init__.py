"""packfunc: per-sample gradients, their moments and curvature as pure torch.func functions."""

__version__ = "0.1.0"

from packfunc import kron, losses, optim, privacy
from packfunc.data import per_batch
from packfunc.eigen_kfac import ekfac
from packfunc.engine.randomness import RandomModelError
from packfunc.estimators import hutchinson_diagonal, hutchinson_trace, hutchpp_trace
from packfunc.explanation import explain
from packfunc.firstorder import batch_grad, batch_l2_grad, sum_grad_squared, variance
from packfunc.functionalize import functional
from packfunc.kronecker_factors import kfac, kflr, kfra
from packfunc.privacy import clip_and_noise, clip_per_sample, clipped_grad
from packfunc.products import (
    ggn_block_products,
    ggn_vector_product,
    hessian_block_products,
    hessian_vector_product,
    pch_block_products,
)
from packfunc.quantities import FIRST_ORDER, QUANTITIES, SECOND_ORDER, compute
from packfunc.secondorder import (
    batch_diag_ggn,
    batch_diag_hessian,
    diag_ggn,
    diag_hessian,
    sqrt_ggn,
)

__all__ = [
    "FIRST_ORDER",
    "QUANTITIES",
    "SECOND_ORDER",
    "RandomModelError",
    "batch_diag_ggn",
    "batch_diag_hessian",
    "batch_grad",
    "batch_l2_grad",
    "clip_and_noise",
    "clip_per_sample",
    "clipped_grad",
    "compute",
    "diag_ggn",
    "diag_hessian",
    "explain",
    "ekfac",
    "functional",
    "ggn_block_products",
    "ggn_vector_product",
    "hessian_block_products",
    "hessian_vector_product",
    "hutchinson_diagonal",
    "hutchinson_trace",
    "hutchpp_trace",
    "kfac",
    "kflr",
    "kfra",
    "kron",
    "losses",
    "optim",
    "pch_block_products",
    "privacy",
    "per_batch",
    "sqrt_ggn",
    "sum_grad_squared",
    "variance",
]
