"""DP-SGD's clipping and noise against per-sample autograd loops."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import packfunc as pf
from tests.cases import autograd_batch_grad


def _problem() -> tuple[nn.Module, nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    X, y = torch.randn(9, 6, dtype=torch.float64), torch.randint(0, 3, (9,))
    return model, nn.CrossEntropyLoss(reduction="sum"), X, y


def _clipped_mean_by_loop(batch: dict[str, torch.Tensor], max_norm: float) -> dict:
    """Clip each sample's gradient over all parameters, one sample at a time, and average."""
    names = list(batch)
    num_samples = batch[names[0]].shape[0]
    total = {name: torch.zeros_like(batch[name][0]) for name in names}
    for n in range(num_samples):
        norm = torch.cat([batch[name][n].flatten() for name in names]).norm()
        factor = min(1.0, max_norm / (norm.item() + 1e-6))
        for name in names:
            total[name] += factor * batch[name][n]
    return {name: g / num_samples for name, g in total.items()}


@pytest.mark.parametrize("with_batch_l2", [False, True])
def test_clip_and_noise_without_noise_is_the_clipped_mean(with_batch_l2: bool) -> None:
    model, loss, X, y = _problem()
    expected_batch = autograd_batch_grad(model, loss, X, y)
    norms = torch.stack([g.flatten(1).square().sum(1) for g in expected_batch.values()])
    max_norm = norms.sum(0).sqrt().median().item()  # some samples clipped, some not
    expected = _clipped_mean_by_loop(expected_batch, max_norm)

    model_fn, params = pf.functional(model)
    out = pf.compute(model_fn, params, X, y, loss=loss, quantities=("batch_grad", "batch_l2_grad"))
    batch_l2 = out["batch_l2_grad"] if with_batch_l2 else None
    result = pf.clip_and_noise(out["batch_grad"], max_norm, 0.0, batch_l2=batch_l2)
    assert result.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(result[name], expected[name])


def test_noise_has_std_sigma_times_clip_over_n_and_is_reproducible() -> None:
    batch = {"w": torch.randn(4, 64, 64), "b": torch.randn(4, 64)}
    max_norm, sigma = 0.5, 2.0
    clean = pf.clip_and_noise(batch, max_norm, 0.0)

    def noisy(seed: int) -> dict:
        return pf.clip_and_noise(
            batch, max_norm, sigma, generator=torch.Generator().manual_seed(seed)
        )

    z = (noisy(0)["w"] - clean["w"]) * 4 / (sigma * max_norm)
    assert abs(z.mean().item()) < 0.05
    assert abs(z.std().item() - 1.0) < 0.05
    torch.testing.assert_close(noisy(0)["b"], noisy(0)["b"], rtol=0, atol=0)
    assert not torch.equal(noisy(0)["b"], noisy(1)["b"])


def test_clip_per_sample_bounds_large_samples_and_keeps_small_ones() -> None:
    torch.manual_seed(0)
    scales = torch.tensor([1e-3, 1e-2, 0.1, 5.0, 50.0, 1.0])
    grads = (torch.randn(6, 3, 4) * scales.view(-1, 1, 1), [torch.randn(6, 3) * scales[:, None]])
    norms = (grads[0].flatten(1).square().sum(1) + grads[1][0].square().sum(1)).sqrt()
    clipped = pf.clip_per_sample(grads, max_norm=1.0)
    assert isinstance(clipped, tuple) and isinstance(clipped[1], list)  # the pytree is kept
    new_norms = (clipped[0].flatten(1).square().sum(1) + clipped[1][0].square().sum(1)).sqrt()
    small = norms <= 1.0
    assert small.any() and (~small).any()
    torch.testing.assert_close(clipped[0][small], grads[0][small], rtol=0, atol=0)
    torch.testing.assert_close(new_norms[~small], torch.ones_like(new_norms[~small]))


def test_gradients_flow_through_clipping() -> None:
    g = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda g: pf.clip_and_noise({"w": g}, 0.7, 0.0)["w"], (g,))


@pytest.mark.parametrize(
    ("batch", "max_norm", "noise", "match"),
    [
        ({"w": torch.ones(3, 2)}, 0.0, 1.0, "max_norm"),
        ({"w": torch.ones(3, 2)}, 1.0, -1.0, "noise_multiplier"),
        ({"w": torch.ones(3, 2), "b": torch.ones(4)}, 1.0, 1.0, "leading"),
        ({}, 1.0, 1.0, "leading"),
    ],
)
def test_rejects_invalid_arguments(batch: dict, max_norm: float, noise: float, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        pf.clip_and_noise(batch, max_norm, noise)
