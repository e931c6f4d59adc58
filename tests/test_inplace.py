"""In-place activations right after tapped layers (VGG-style nets): the functional API gives
the values of the same model without in-place ops, and per-sample gradients sum to autograd's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import packfunc as pf
from packfunc.compat import backpack, extend
from packfunc.compat.extensions import BatchGrad
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


class _HalvesNegativeInputs(nn.Module):
    """Scales its input's negative entries in place (none in the first sample)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x[x < 0] *= 0.5
        return self.layer(x + 0)


class _RectifiesItsInput(nn.Module):
    """``x.relu_()`` on its input, then a linear layer that saves it for its backward."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x.relu_())


def test_a_model_changing_its_input_changes_the_batch_once():
    """The check of the last sample's row ran the model on a view of the user's batch: its
    negative entries were scaled twice (0.25, not 0.5), and the refusal blamed samples
    mixed; in the shim, an idempotent ``x.relu_()`` raised autograd's version error (a
    probe). That run takes a copy now; the model is refused for what it does."""
    torch.manual_seed(0)
    X, y = torch.randn(6, 5), torch.randint(0, 3, (6,))
    X[0] = X[0].abs()
    model = _HalvesNegativeInputs()
    batch = X.clone()
    with pytest.raises(ValueError, match="out of place"):
        pf.batch_grad(*pf.functional(model), batch, y)
    torch.testing.assert_close(batch, torch.where(X < 0, X * 0.5, X))
    rectifying, loss = extend(_RectifiesItsInput()), extend(nn.CrossEntropyLoss(reduction="sum"))
    batch = X.clone()
    with backpack(BatchGrad()):
        loss(rectifying(batch), y).backward()
    torch.testing.assert_close(batch, X.relu())
    for n in range(6):
        rectifying.zero_grad()
        loss(rectifying(X[n : n + 1].clone()), y[n : n + 1]).backward()
        torch.testing.assert_close(
            rectifying.layer.weight.grad_batch[n], rectifying.layer.weight.grad
        )
