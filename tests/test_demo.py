"""The DP-SGD demo: a short end-to-end run and the clipping helpers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import packfunc as pf

pytest.importorskip("sklearn")

from packfunc import demo  # noqa: E402


def test_short_run_learns() -> None:
    metrics = demo.main(["--epochs", "2"])
    assert len(metrics["losses"]) == 2
    assert metrics["losses"][1] < metrics["losses"][0]
    assert metrics["test_accuracy"] > 0.5  # chance is 0.1


def test_clip_bounds_large_and_keeps_small() -> None:
    torch.manual_seed(0)
    clip = 1.0
    grads = {"w": torch.randn(6, 3, 4), "b": torch.randn(6, 3)}
    scales = torch.tensor([1e-3, 1e-2, 0.1, 5.0, 50.0, 1.0])
    grads = {name: g * scales.view(-1, *[1] * (g.dim() - 1)) for name, g in grads.items()}
    norms = torch.sqrt(sum(g.flatten(1).square().sum(1) for g in grads.values()))
    clipped = demo.clip_per_sample(grads, norms, clip)
    new_norms = torch.sqrt(sum(g.flatten(1).square().sum(1) for g in clipped.values()))
    assert torch.all(new_norms <= clip + 1e-5)
    small = norms <= clip
    assert small.any() and (~small).any()
    for name in grads:
        torch.testing.assert_close(clipped[name][small], grads[name][small], rtol=0, atol=0)
    torch.testing.assert_close(new_norms[~small], torch.full_like(new_norms[~small], clip))


def test_norms_from_packfunc_match_batch_grad() -> None:
    torch.manual_seed(0)
    model_fn, params = pf.functional(demo.build_mlp(8, 5, 3))
    X, y = torch.randn(7, 8), torch.randint(0, 3, (7,))
    out = pf.compute(model_fn, params, X, y, loss=nn.CrossEntropyLoss(reduction="sum"),
                         quantities=("batch_grad", "batch_l2_grad"))
    norms = demo.per_sample_norms(out["batch_l2_grad"])
    expected = torch.sqrt(sum(g.flatten(1).square().sum(1) for g in out["batch_grad"].values()))
    torch.testing.assert_close(norms, expected)
    clipped = demo.clip_per_sample(out["batch_grad"], norms, 0.1)
    new_norms = torch.sqrt(sum(g.flatten(1).square().sum(1) for g in clipped.values()))
    assert torch.all(new_norms <= 0.1 + 1e-6)


def test_noisy_mean_without_noise_is_mean_and_is_reproducible() -> None:
    g = {"w": torch.randn(5, 2, 3)}
    exact = demo.noisy_mean(g, clip=1.0, noise=0.0, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(exact["w"], g["w"].mean(0))
    a = demo.noisy_mean(g, 1.0, 1.0, torch.Generator().manual_seed(3))
    b = demo.noisy_mean(g, 1.0, 1.0, torch.Generator().manual_seed(3))
    torch.testing.assert_close(a["w"], b["w"], rtol=0, atol=0)


def test_sgd_update_is_functional() -> None:
    params = {"w": torch.ones(3)}
    new = demo.sgd_update(params, {"w": torch.full((3,), 2.0)}, lr=0.25)
    torch.testing.assert_close(new["w"], torch.full((3,), 0.5))
    torch.testing.assert_close(params["w"], torch.ones(3))


def test_rejects_zero_epochs() -> None:
    with pytest.raises(SystemExit):
        demo.parse_args(["--epochs", "0"])
