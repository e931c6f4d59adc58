"""KFRA's averaged Jacobian sandwiches ``E_n[J_nᵀ H J_n]`` against dense per-sample Jacobians."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.autograd.functional import jacobian

from packfunc.engine.chain import Link
from packfunc.engine.kfra import expected_jacobian_sandwich

OPS = {  # func, further arguments, keyword arguments, shape of one sample
    "max_pool2d (disjoint windows)": (F.max_pool2d, (2,), {}, (2, 4, 4)),
    "max_pool1d (overlapping windows)": (F.max_pool1d, (3,), {"stride": 1}, (2, 6)),
    "adaptive_max_pool2d": (F.adaptive_max_pool2d, (3,), {}, (1, 5, 4)),
    "pad": (F.pad, ((1, 2),), {}, (2, 3)),
    "avg_pool2d": (F.avg_pool2d, (2,), {"stride": 1}, (1, 3, 3)),
    "dropout (eval)": (F.dropout, (0.5,), {"training": False}, (2, 3)),
    "tanh": (torch.tanh, (), {}, (2, 3)),
    "softmax (averaged per sample)": (F.softmax, (), {"dim": -1}, (2, 3)),
}


@pytest.mark.parametrize("n", [1, 4])
@pytest.mark.parametrize("name", list(OPS))
def test_expected_sandwich_equals_average_of_dense_per_sample_sandwiches(name, n):
    func, args, kwargs, shape = OPS[name]
    torch.manual_seed(0)
    x = torch.randn(n, *shape, dtype=torch.float64)
    link = Link(func, (x, *args), kwargs, 0, x, func(x, *args, **kwargs))
    d_out = link.output[0].numel()
    root = torch.randn(d_out, d_out, dtype=torch.float64)
    H = root @ root.T
    expected = (
        sum(
            J.T @ H @ J
            for J in (jacobian(link.apply, x[i : i + 1]).reshape(d_out, -1) for i in range(n))
        )
        / n
    )
    torch.testing.assert_close(expected_jacobian_sandwich(link, H), expected)
