"""Fixed per-call overhead: work a quantity does not need is not done, values unchanged."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import packfunc as pf
from packfunc.losses import categorical_draws, hessian_factors


def _mlp() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    return model, torch.randn(5, 4, dtype=torch.float64), torch.tensor([0, 2, 1, 2, 0])


@pytest.mark.parametrize(
    "loss",
    [nn.CrossEntropyLoss(), nn.CrossEntropyLoss(reduction="sum", ignore_index=1)],
    ids=["mean", "sum_ignore"],
)
@pytest.mark.parametrize("mc_samples", [1, 3])
def test_sampled_cross_entropy_columns_are_scaled_p_minus_onehot(
    loss: nn.CrossEntropyLoss, mc_samples: int
) -> None:
    """Each column is ``√(c/D) (p − e_draw) / √K`` with one drawn class per sample and position."""
    output = torch.randn(6, 4, 3, dtype=torch.float64)  # [N, C, positions]
    target = torch.randint(0, 4, (6, 3))
    target[0, 0] = 1
    columns = hessian_factors(
        loss, output, target, mc_samples=mc_samples, generator=torch.Generator().manual_seed(7)
    ).all()

    probs = output.softmax(1)
    kept = (target != loss.ignore_index).to(probs.dtype)
    divisor = kept.sum() if loss.reduction == "mean" else 1.0
    root_scale = (kept / divisor).sqrt().unsqueeze(1)
    live = root_scale.expand_as(probs) > 0
    onehot = probs - columns * mc_samples**0.5 / root_scale.clamp_min(1e-300)
    assert torch.all(columns[:, ~live] == 0)
    torch.testing.assert_close(onehot[:, live], onehot[:, live].round(), rtol=0, atol=1e-12)
    assert torch.all(onehot.round().sum(2)[:, live[:, 0]] == 1)  # one class per position


def test_categorical_draws_follow_the_probabilities() -> None:
    """Oracle: class frequencies of many draws match the probabilities; zero mass is never drawn."""
    probs = torch.tensor([[0.0, 0.2, 0.5, 0.3, 0.0], [0.7, 0.0, 0.1, 0.1, 0.1]])
    draws = categorical_draws(probs * 3, 100_000, torch.Generator().manual_seed(0))
    frequencies = torch.stack([torch.bincount(row, minlength=5) for row in draws]) / 100_000
    torch.testing.assert_close(frequencies, probs, rtol=0, atol=0.01)
    assert frequencies[0, 0] == frequencies[0, 4] == frequencies[1, 1] == 0


def test_kronecker_factors_skip_the_loss_gradient(monkeypatch: pytest.MonkeyPatch) -> None:
    """KFAC and KFLR pull back the loss Hessian's columns only: one backward pass, not two."""
    model, X, y = _mlp()
    model_fn, params = pf.functional(model)
    pf.kflr(model_fn, params, X, y)  # discovery runs outside the count
    calls = []
    grad = torch.autograd.grad
    monkeypatch.setattr(torch.autograd, "grad", lambda *a, **k: calls.append(1) or grad(*a, **k))
    pf.kfac(model_fn, params, X, y, generator=torch.Generator().manual_seed(0))
    pf.kflr(model_fn, params, X, y)
    assert len(calls) == 2


def test_lazy_loss_gradient_matches_autograd() -> None:
    """The loss and ``∂L/∂output`` computed on demand equal plain autograd's."""
    from packfunc.engine.batch_pass import BatchPass

    model, X, y = _mlp()
    model_fn, params = pf.functional(model)
    bp = BatchPass(model_fn, params, X, y, nn.CrossEntropyLoss())
    output = model(X).detach().requires_grad_()
    loss = nn.functional.cross_entropy(output, y)
    (cotangent,) = torch.autograd.grad(loss, output)
    torch.testing.assert_close(bp.loss_value, loss.detach())
    torch.testing.assert_close(bp.record.output_cotangent, cotangent)
    assert bp.record.output_cotangent is bp.record.output_cotangent  # computed once
