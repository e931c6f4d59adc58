"""In-place activations right after tapped layers (VGG-style nets): the functional API gives
the values of the same model without in-place ops, and per-sample gradients sum to autograd's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import packfunc as pf
from tests.cases import assert_trees_close


def _models() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    inplace = nn.Sequential(
        nn.Conv1d(2, 3, 3),
        nn.ReLU(inplace=True),
        nn.Flatten(),
        nn.Linear(12, 4),
        nn.ReLU(inplace=True),
        nn.Linear(4, 3),
    ).double()
    plain = nn.Sequential(
        nn.Conv1d(2, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(12, 4), nn.ReLU(), nn.Linear(4, 3)
    ).double()
    plain.load_state_dict(inplace.state_dict())
    return inplace, plain


@pytest.mark.parametrize(
    "quantity", ["batch_grad", "batch_l2_grad", "diag_ggn", "diag_hessian", "kflr"]
)
def test_inplace_activations_give_the_values_without_them(quantity):
    inplace, plain = _models()
    X, y = torch.randn(5, 2, 6, dtype=torch.float64), torch.randint(0, 3, (5,))
    ours = getattr(pf, quantity)(*pf.functional(inplace), X, y)
    expected = getattr(pf, quantity)(*pf.functional(plain), X, y)
    assert_trees_close(ours, expected)


def test_inplace_batch_grad_sums_to_the_autograd_gradient():
    inplace, _ = _models()
    X, y = torch.randn(5, 2, 6, dtype=torch.float64), torch.randint(0, 3, (5,))
    model_fn, params = pf.functional(inplace)
    batch = pf.batch_grad(model_fn, params, X, y)
    gradient = torch.autograd.grad(nn.CrossEntropyLoss()(inplace(X), y), list(inplace.parameters()))
    for name, g in zip(params, gradient):
        torch.testing.assert_close(batch[name].sum(0), g)
