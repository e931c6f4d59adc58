"""DP-SGD's clipping and noise against per-sample autograd loops."""

from __future__ import annotations

import copy
import math
import pathlib
import sys
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import packfunc as pf
from packfunc.engine import statistics
from tests.cases import assert_trees_close, autograd_batch_grad, make_problem

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
from memory import peak_bytes  # noqa: E402


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


@pytest.mark.parametrize("shape", ["one", "by name", "per leaf"])
def test_a_clipping_bound_requiring_grad_is_refused(shape: str) -> None:
    """The bound is read as a number (float): a tensor C requiring grad had its derivative
    silently dropped (2.28 expected by a probe's oracle). Refused, naming .detach()."""
    model_fn, params = pf.functional(nn.Linear(3, 2))
    X, y = torch.randn(4, 3), torch.randint(0, 2, (4,))
    bound = torch.tensor(0.5, requires_grad=True)
    max_norm = {"one": bound, "by name": {"weight": bound, "bias": 1.0}, "per leaf": [1.0, bound]}
    with pytest.raises(ValueError, match=r"max_norm.detach\(\)"):
        pf.clipped_grad(model_fn, params, X, y, max_norm=max_norm[shape])
    found = pf.clipped_grad(model_fn, params, X, y, max_norm=bound.detach())
    assert found["weight"].shape == (2, 3)


def test_clipped_grad_of_no_parameters_is_empty() -> None:
    """As ``batch_grad`` of no parameters: an empty pytree (it raised from ``torch.stack``)."""
    model_fn, _ = pf.functional(nn.Linear(3, 2))
    X, y = torch.randn(4, 3), torch.randint(0, 2, (4,))
    assert pf.clipped_grad(model_fn, {}, X, y, max_norm=1.0) == {}
    assert pf.batch_grad(model_fn, {}, X, y) == {}


def _clipped_sum_by_loop(batch: dict[str, torch.Tensor], max_norm: float) -> dict:
    """``Σ_n clip(g_n)``: the clipped mean of the loop times the batch size."""
    num_samples = next(iter(batch.values())).shape[0]
    return {k: g * num_samples for k, g in _clipped_mean_by_loop(batch, max_norm).items()}


@pytest.mark.parametrize("clipped", ["all", "none", "mixed"])
def test_clipped_grad_is_the_clipped_sum_of_per_sample_gradients(case, clipped: str) -> None:
    """Against a per-sample autograd loop and ``clip_per_sample(batch_grad).sum(0)``, float64."""
    problem = make_problem(case, "cross_entropy", "sum", n=4)
    expected_batch = autograd_batch_grad(problem.model, problem.loss, problem.X, problem.y)
    norms = torch.stack([g.reshape(len(g), -1).square().sum(1) for g in expected_batch.values()])
    norms = norms.sum(0).sqrt()
    max_norm = {"all": norms.min() / 2, "none": norms.max() * 2, "mixed": norms.median()}
    bound = float(max_norm[clipped])
    model_fn, params = problem.functional()
    found = pf.clipped_grad(
        model_fn, params, problem.X, problem.y, loss=problem.loss, max_norm=bound
    )
    assert_trees_close(found, _clipped_sum_by_loop(expected_batch, bound), "loop")
    batch = pf.batch_grad(model_fn, params, problem.X, problem.y, loss=problem.loss)
    by_clipping = {k: g.sum(0) for k, g in pf.clip_per_sample(batch, bound).items()}
    assert_trees_close(found, by_clipping, "clip_per_sample")


def test_clipped_grad_with_padding_and_ignore_index() -> None:
    """A sequence model whose ignored tokens are padding: a sample's norm covers its tokens."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(11, 6), nn.Linear(6, 5)).double()
    X = torch.randint(0, 11, (5, 7))
    y = torch.randint(0, 5, (5, 7))
    y[:, 4:] = -100  # padding
    y[2] = -100  # a sample with no tokens: zero gradient, zero norm
    loss = nn.CrossEntropyLoss(reduction="sum")
    model_fn, params = pf.functional(model)

    def forward(p, X):
        return model_fn(p, X).transpose(1, 2)  # [N, C, T] for the loss

    batch = autograd_batch_grad(_Transposed(model), loss, X, y)
    batch = {k.removeprefix("inner."): g for k, g in batch.items()}
    found = pf.clipped_grad(forward, params, X, y, loss=loss, max_norm=0.5)
    assert_trees_close(found, _clipped_sum_by_loop(batch, 0.5))


class _Transposed(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        return self.inner(X).transpose(1, 2)


def test_clipped_grad_over_data_and_for_a_subset_of_parameters() -> None:
    """Batches' clipped sums add up; frozen parameters are left out of the norm and the sum."""
    model, loss, X, y = _problem()
    model_fn, params = pf.functional(model)
    head = {k: v for k, v in params.items() if k.startswith("2.")}
    whole = pf.clipped_grad(model_fn, head, X, y, loss=loss, max_norm=0.3)
    batches = [(X[:4], y[:4]), (X[4:], y[4:])]
    over_data = pf.clipped_grad(model_fn, head, data=batches, loss=loss, max_norm=0.3)
    assert_trees_close(over_data, whole)
    expected = {k: g for k, g in autograd_batch_grad(model, loss, X, y).items() if k in head}
    assert_trees_close(whole, _clipped_sum_by_loop(expected, 0.3))


def test_clipped_grad_refuses_a_mean_and_a_bad_bound() -> None:
    model, _, X, y = _problem()
    model_fn, params = pf.functional(model)
    with pytest.raises(ValueError, match="reduction='sum'"):
        pf.clipped_grad(model_fn, params, X, y, loss=nn.CrossEntropyLoss(), max_norm=1.0)
    with pytest.raises(ValueError, match="reduction='sum'"):
        pf.clipped_grad(model_fn, params, data=[(X, y)], loss=nn.CrossEntropyLoss(), max_norm=1.0)
    with pytest.raises(ValueError, match="max_norm > 0"):
        pf.clipped_grad(model_fn, params, X, y, max_norm=0.0)
    with pytest.raises(TypeError, match="max_norm"):
        pf.clipped_grad(model_fn, params, data=[(X, y)])  # type: ignore[call-arg]


@pytest.mark.parametrize("first", ["clipped_grad", "batch_l2_grad"])
def test_clipped_grad_with_norms_and_loss_in_one_pass(first: str) -> None:
    """Clipping scales its own copy of the cotangents: the norms beside it are unchanged."""
    model, loss, X, y = _problem()
    model_fn, params = pf.functional(model)
    names = (first, *({"clipped_grad", "batch_l2_grad"} - {first}))
    out = pf.compute(model_fn, params, X, y, loss=loss, max_norm=0.3, quantities=names)
    assert set(out) == {"loss", "clipped_grad", "batch_l2_grad"}
    alone = pf.clipped_grad(model_fn, params, X, y, loss=loss, max_norm=0.3)
    assert_trees_close(out["clipped_grad"], alone)
    assert_trees_close(out["batch_l2_grad"], pf.batch_l2_grad(model_fn, params, X, y, loss=loss))


def test_add_noise_has_the_stated_distribution() -> None:
    """``(noisy - sum) / (σ C)`` is standard normal (fixed generator); σ = 0 adds nothing."""
    total = {"w": torch.randn(200, 100), "b": torch.randn(100)}
    noisy = pf.privacy.add_noise(total, 0.5, 2.0, generator=torch.Generator().manual_seed(0))
    z = torch.cat([((noisy[k] - total[k]) / (0.5 * 2.0)).flatten() for k in total])
    assert abs(z.mean().item()) < 0.02 and abs(z.std().item() - 1) < 0.02
    assert abs(((z**4).mean() - 3).item()) < 0.1  # Gaussian kurtosis
    assert_trees_close(pf.privacy.add_noise(total, 0.5, 0.0), total)


def test_add_noise_draws_in_buffers_of_bounded_size(monkeypatch) -> None:
    """Noise is drawn for runs of leaves of one dtype, at most ``_NOISE_BUFFER`` elements a
    call unless one leaf is larger (one buffer for a 55M model added its whole size to the
    peak resident memory); every leaf gets independent noise of the stated scale."""
    monkeypatch.setattr(pf.privacy, "_NOISE_BUFFER", 10)
    sizes = []
    real_randn = torch.randn

    def counted(*args, **kwargs):
        sizes.append(args[0])
        return real_randn(*args, **kwargs)

    monkeypatch.setattr(torch, "randn", counted)
    total = {
        "a": torch.zeros(4),
        "b": torch.zeros(2, 2),
        "c": torch.zeros(4),
        "d": torch.zeros(20),
        "e": torch.zeros(3, dtype=torch.float64),
        "f": torch.zeros(3),
    }
    noisy = pf.privacy.add_noise(total, 1.0, 1.0, generator=torch.Generator().manual_seed(0))
    assert sizes == [8, 4, 20, 3, 3]
    for name, value in total.items():
        assert noisy[name].shape == value.shape and noisy[name].dtype == value.dtype
    drawn = torch.cat([noisy[k].flatten().double() for k in total])
    assert len(set(drawn.tolist())) == drawn.numel()  # no leaf reuses another's noise


def test_poisson_batches_include_each_example_with_probability_q() -> None:
    batches = pf.privacy.PoissonBatches(
        50, 0.2, steps=400, generator=torch.Generator().manual_seed(0)
    )
    counts = torch.zeros(50)
    sizes = []
    for indices in batches:
        counts[indices] += 1
        sizes.append(len(indices))
    assert abs(counts.mean().item() / 400 - 0.2) < 0.01
    assert 0 in sizes or min(sizes) < 5  # variable sizes
    assert len(set(sizes)) > 5
    empty = next(iter(pf.privacy.PoissonBatches(3, 1e-9, steps=1)))
    assert empty.numel() == 0
    for steps in (0, -1):
        with pytest.raises(ValueError, match="steps >= 1"):
            pf.privacy.PoissonBatches(3, 0.5, steps=steps)


def test_accounting_equals_opacus() -> None:
    pytest.importorskip("opacus")
    from opacus.accountants import PRVAccountant, RDPAccountant
    from opacus.accountants.utils import get_noise_multiplier

    for kind, accountant in (("rdp", RDPAccountant()), ("prv", PRVAccountant())):
        for _ in range(300):
            accountant.step(noise_multiplier=1.1, sample_rate=0.02)
        expected = accountant.get_epsilon(delta=1e-5)
        found = pf.privacy.epsilon(
            noise_multiplier=1.1, sample_rate=0.02, steps=300, delta=1e-5, accountant=kind
        )
        assert found == pytest.approx(expected, rel=1e-6)
    sigma = pf.privacy.noise_multiplier(epsilon=3.0, delta=1e-5, sample_rate=0.02, steps=300)
    assert sigma == get_noise_multiplier(
        target_epsilon=3.0, target_delta=1e-5, sample_rate=0.02, steps=300
    )


@pytest.mark.parametrize("shape", [(32,), (4, 32)])  # one position per sample, or a sequence
def test_clipped_grad_materializes_no_per_sample_gradient(monkeypatch, shape) -> None:
    """A linear weight gives its norms and clipped sum in closed form: no ``[N, out, in]``
    tensor where the Gram form over positions is the cheaper (the narrow head's may be
    formed, by the cost rule; a bias's ``[N, out]`` is the size of a layer output)."""
    from packfunc.engine import batch_pass

    leaf_columns = batch_pass.ColumnGradients.leaf_columns

    def materialized(self, leaf, index):
        wide = self.bp.leaves[leaf].shape == (48, 32)  # Gram form cheaper even with 4 positions
        assert not wide, "a per-sample weight gradient was materialized"
        return leaf_columns(self, leaf, index)

    model = nn.Sequential(nn.Linear(32, 48), nn.Tanh(), nn.Linear(48, 3)).double()
    loss = nn.CrossEntropyLoss(reduction="sum")
    X = torch.randn(9, *shape, dtype=torch.float64)
    y = torch.randint(0, 3, (9, *shape[:-1]))
    model_fn, params = pf.functional(model)

    def forward(p, X):
        out = model_fn(p, X)
        return out if out.dim() == 2 else out.transpose(1, 2)

    expected = pf.clipped_grad(forward, params, X, y, loss=loss, max_norm=0.2)
    monkeypatch.setattr(batch_pass.ColumnGradients, "leaf_columns", materialized)
    assert_trees_close(pf.clipped_grad(forward, params, X, y, loss=loss, max_norm=0.2), expected)


def _noiseless_dp_sgd(
    model: nn.Module,
    loss: nn.Module,
    *,
    lr: float,
    expected_batch_size: int,
    max_norm: pf.types.MaxNorm = 0.3,
) -> pf.privacy.DPOptimizer:
    """DP-SGD on ``model`` with ``C = 0.3`` (or the bounds given) and no noise."""
    return pf.privacy.DPOptimizer(
        model,
        torch.optim.SGD(model.parameters(), lr=lr),
        max_norm=max_norm,
        noise_multiplier=0.0,
        expected_batch_size=expected_batch_size,
        loss=loss,
    )


def test_dp_optimizer_steps_with_the_private_gradient() -> None:
    """Without noise, ``.grad`` is the clipped sum over the expected batch size; the inner
    optimizer steps; the module's parameters are the ones updated."""
    model, loss, X, y = _problem()
    model_fn, params = pf.functional(model)
    expected = pf.clipped_grad(model_fn, params, X, y, loss=loss, max_norm=0.3)
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    opt = _noiseless_dp_sgd(model, loss, lr=0.5, expected_batch_size=6)
    opt.step(batch=(X, y))
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name] / 6)
        torch.testing.assert_close(p.detach(), before[name] - 0.5 * expected[name] / 6)
    opt.zero_grad()
    opt.step(batch=(X[:0], y[:0]))  # an empty Poisson batch: the noise alone (here zero)
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters())


def test_dp_optimizer_step_without_the_batch_names_its_own_backward() -> None:
    """opacus' habit, ``loss.backward(); optimizer.step()``, met Python's "missing 1 required
    keyword-only argument" (a newcomer's probe); a batch given by position, "takes 1
    positional argument"."""
    model, loss, X, y = _problem()
    opt = _noiseless_dp_sgd(model, loss, lr=0.5, expected_batch_size=6)
    for call in (lambda: opt.step(), lambda: opt.step((X, y))):
        with pytest.raises(TypeError, match=r"step\(batch=\(X, y\)\) runs its own forward"):
            call()


def test_targets_empty_beside_inputs_with_samples_are_refused_not_taken_for_an_empty_batch():
    """A batch of six inputs and no targets (a collate bug) was taken for an empty Poisson
    batch: the step was the noise alone, the six samples dropped silently (found by a
    probe). It is refused as ``clipped_grad`` refuses it; inputs and targets both empty
    stay the noise alone."""
    model, loss, X, y = _problem()
    model_fn, params = pf.functional(model)
    transform = pf.privacy.private_gradient(
        model_fn, max_norm=1.0, noise_multiplier=0.0, expected_batch_size=6, loss=loss
    )
    with pytest.raises(ValueError, match="batch"):
        transform.update(None, None, params, (X, y[:0]))
    opt = _noiseless_dp_sgd(model, loss, lr=0.5, expected_batch_size=6)
    with pytest.raises(ValueError, match="batch"):
        opt.step(batch=(X, y[:0]))
    updates, _ = transform.update(None, None, params, (X[:0], y[:0]))
    assert all(torch.equal(u, torch.zeros_like(u)) for u in updates.values())


def test_dp_optimizer_reads_a_list_of_bounds_in_the_optimizers_order() -> None:
    """A list of per-parameter bounds, as opacus' ``DPPerLayerOptimizer`` takes it: in the
    optimizer's ``param_groups`` order (here the head's group first). It was read in
    ``model.named_parameters()`` order, which gave every parameter another bound than
    opacus, silently (found by a probe); an optimizer over some parameters could take no
    list. A list of the wrong length names the rule."""
    model, loss, X, y = _problem()
    order = ["2.weight", "2.bias", "0.weight", "0.bias"]
    bounds = [0.05, 0.1, 0.15, 0.2]
    model_fn, params = pf.functional(model)
    expected = pf.clipped_grad(model_fn, params, X, y, loss=loss, max_norm=dict(zip(order, bounds)))
    groups = [{"params": list(model[2].parameters())}, {"params": list(model[0].parameters())}]
    options = {"noise_multiplier": 0.0, "expected_batch_size": 1, "loss": loss}
    opt = pf.privacy.DPOptimizer(model, torch.optim.SGD(groups, lr=0.0), max_norm=bounds, **options)
    opt.step(batch=(X, y))
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name])
    head = pf.privacy.DPOptimizer(
        model, torch.optim.SGD(model[2].parameters(), lr=0.0), max_norm=[0.1, 0.2], **options
    )
    head.step(batch=(X, y))
    trained = {k: params[k] for k in ("2.weight", "2.bias")}
    found = pf.clipped_grad(
        model_fn, trained, X, y, loss=loss, max_norm={"2.weight": 0.1, "2.bias": 0.2}
    )
    torch.testing.assert_close(model[2].weight.grad, found["2.weight"])
    with pytest.raises(ValueError, match="one bound per such parameter, in the optimizer's"):
        _noiseless_dp_sgd(model, loss, lr=0.0, expected_batch_size=1, max_norm=bounds[:-1])


def test_dp_arguments_of_other_number_types_or_out_of_range() -> None:
    """numpy and torch integers count steps; fractional sizes and steps, an infinite expected
    batch size (every gradient 0) and a batch that is not a pair are refused by name."""
    pytest.importorskip("opacus")
    spent = partial(pf.privacy.epsilon, noise_multiplier=1.0, sample_rate=0.01, delta=1e-5)
    for steps in (np.int64(100), torch.tensor(100)):
        assert spent(steps=steps) == spent(steps=100)
    assert len(pf.privacy.PoissonBatches(10, 0.15)) == 6  # int(1 / q), as opacus
    for size, steps in ((10, 2.5), (10.5, None)):
        with pytest.raises(ValueError, match="whole"):
            pf.privacy.PoissonBatches(size, 0.1, steps=steps)
    model, loss, X, y = _problem()
    with pytest.raises(ValueError, match="positive and finite"):
        _noiseless_dp_sgd(model, loss, lr=0.0, expected_batch_size=math.inf)
    opt = _noiseless_dp_sgd(model, loss, lr=0.0, expected_batch_size=1)
    with pytest.raises(TypeError, match=r"batch=\(X, y\)"):
        opt.step(batch=X)


def test_dp_optimizer_follows_the_parameters_at_each_step() -> None:
    """New values (``vector_to_parameters`` rebinds ``.data``) and a layer frozen or
    unfrozen after construction are seen: the norm covers what is trained now."""
    model, loss, X, y = _problem()
    model[2].weight.requires_grad_(False)
    opt = _noiseless_dp_sgd(model, loss, lr=0.0, expected_batch_size=1)
    flat = torch.randn(sum(p.numel() for p in model.parameters()), dtype=torch.float64)
    torch.nn.utils.vector_to_parameters(flat, model.parameters())
    model[0].weight.requires_grad_(False)
    model[2].weight.requires_grad_(True)
    opt.step(batch=(X, y))
    model_fn, params = pf.functional(model)
    trained = {k: v for k, v in params.items() if k != "0.weight"}
    expected = pf.clipped_grad(model_fn, trained, X, y, loss=loss, max_norm=0.3)
    assert model[0].weight.grad is None
    for name, p in model.named_parameters():
        if name in trained:
            torch.testing.assert_close(p.grad, expected[name])


def test_clipped_grad_per_parameter_bounds(case) -> None:
    """One bound per leaf: each leaf's per-sample gradient clipped alone (opacus' per-layer)."""
    problem = make_problem(case, "cross_entropy", "sum", n=4)
    batch = autograd_batch_grad(problem.model, problem.loss, problem.X, problem.y)
    model_fn, params = problem.functional()
    names = sorted(params)  # the flattening order of a dict
    bounds = [0.1 * (i + 1) for i in range(len(names))]
    expected = {}
    for name, bound in zip(names, bounds):
        g = batch[name]
        norms = g.reshape(len(g), -1).norm(dim=1)
        factors = (bound / (norms + 1e-6)).clamp(max=1.0)
        expected[name] = torch.tensordot(factors, g, dims=1)
    found = pf.clipped_grad(
        model_fn, params, problem.X, problem.y, loss=problem.loss, max_norm=bounds
    )
    assert_trees_close(found, expected)
    with pytest.raises(ValueError, match="one per parameter"):
        pf.clipped_grad(
            model_fn,
            params,
            problem.X,
            problem.y,
            loss=problem.loss,
            max_norm=bounds[:-1] if len(bounds) > 1 else [1.0, 1.0],
        )


def test_private_gradient_transformation() -> None:
    """``chain(private_gradient, scale(-lr))``: the clipped sum over the expected batch size,
    then the step; with per-parameter bounds the noise is scaled by ``√Σ C_i²``."""
    model, loss, X, y = _problem()
    model_fn, params = pf.functional(model)
    dp = pf.optim.chain(
        pf.privacy.private_gradient(
            model_fn, max_norm=0.3, noise_multiplier=0.0, expected_batch_size=6, loss=loss
        ),
        pf.optim.scale(-0.5),
    )
    updates, state = dp.update(None, dp.init(params), params, (X, y))
    expected = pf.clipped_grad(model_fn, params, X, y, loss=loss, max_norm=0.3)
    assert_trees_close(updates, {k: -0.5 * g / 6 for k, g in expected.items()})
    bounds = [0.1, 0.2, 0.2, 0.4]
    noisy = _unit_noise(model_fn, loss, bounds)
    found, _ = noisy.update(None, noisy.init(params), params, (X[:0], y[:0]))
    assert 0.7 < _over_sensitivity(found, bounds).std().item() < 1.3  # the noise alone
    with pytest.raises(TypeError, match="needs the batch X, y"):  # not the noise alone
        noisy.update(None, noisy.init(params), params, (X, None))


def _unit_noise(model_fn, loss: nn.Module, bounds) -> object:
    """``private_gradient`` with ``σ = 1`` over a batch size of 1, seeded."""
    return pf.privacy.private_gradient(
        model_fn,
        max_norm=bounds,
        noise_multiplier=1.0,
        expected_batch_size=1,
        loss=loss,
        generator=torch.Generator().manual_seed(0),
    )


def _over_sensitivity(found: dict, bounds) -> torch.Tensor:
    """Every value of ``found`` divided by the sensitivity ``√Σ C_i²``."""
    values = bounds.values() if isinstance(bounds, dict) else bounds
    return torch.cat([v.flatten() for v in found.values()]) / sum(c**2 for c in values) ** 0.5


def test_clipped_grad_needs_little_more_memory_than_a_plain_backward() -> None:
    """On an LM whose activations dominate, ``clipped_grad``'s tensors peak at most 1.1×
    a plain forward + backward's (1.01× measured; 1.73× before norms were taken during the
    backward, sites released as their sums were taken and the output let go: issue 22;
    1.17× while the head's cotangent went through its flat product's edge, 045e893).
    """
    torch.manual_seed(0)
    layer = partial(nn.TransformerEncoderLayer, 256, 4, 1024, dropout=0.0, batch_first=True)
    model = nn.Sequential(
        nn.Embedding(2000, 256),
        *[layer(norm_first=True) for _ in range(2)],
        nn.LayerNorm(256),
        nn.Linear(256, 2000),
    )
    X, y = torch.randint(0, 2000, (8, 128)), torch.randint(0, 2000, (8, 128))
    loss = nn.CrossEntropyLoss(reduction="sum")
    model_fn, params = pf.functional(model)

    def forward(p, X):
        return model_fn(p, X).transpose(1, 2)

    def plain() -> None:
        loss(model(X).transpose(1, 2), y).backward()
        model.zero_grad(set_to_none=True)

    clipped = peak_bytes(lambda: pf.clipped_grad(forward, params, X, y, loss=loss, max_norm=1.0))
    assert clipped <= 1.1 * peak_bytes(plain)


def test_clipped_grad_forms_normalization_gradients_during_the_backward(monkeypatch) -> None:
    """Cotangents reach the clipping during the backward pass: a layer norm's is dropped
    there (its per-sample gradients formed), a linear layer's with a Gram form kept."""
    from packfunc.engine import statistics

    seen: list[tuple[bool, bool]] = []  # (during the backward, dropped)
    consume = statistics._NormsDuringBackward.__call__

    def spy(self, k, g):
        kept = consume(self, k, g)
        seen.append((torch._C._current_graph_task_id() != -1, kept is None))
        return kept

    monkeypatch.setattr(statistics._NormsDuringBackward, "__call__", spy)
    # the middle linear layer's Gram form over 4 positions is cheaper than its [N, 48, 32];
    # the first layer's cotangent is taken at the end (where the backward pass stops)
    model = nn.Sequential(
        nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 48), nn.LayerNorm(48), nn.Linear(48, 3)
    ).double()
    X, y = torch.randn(5, 4, 32, dtype=torch.float64), torch.randint(0, 3, (5, 4))
    model_fn, params = pf.functional(model)
    loss = nn.CrossEntropyLoss(reduction="sum")

    def forward(p, X):
        return model_fn(p, X).transpose(1, 2)

    found = pf.clipped_grad(forward, params, X, y, loss=loss, max_norm=0.3)
    assert seen[1:3] == [(True, True), (True, False)]  # layer norm dropped, linear kept
    batch = pf.batch_grad(forward, params, X, y, loss=loss)
    expected = {k: g.sum(0) for k, g in pf.clip_per_sample(batch, 0.3).items()}
    assert_trees_close(found, expected)


def test_a_gradient_that_cancels_over_positions_is_clipped_not_nan() -> None:
    """The Gram form of a squared norm that cancels rounds below zero in float32; it is
    clamped: no NaN in the norms and none spread into every clipped sum."""
    torch.manual_seed(0)
    layer = nn.Linear(64, 64, bias=False)
    model_fn, params = pf.functional(layer)
    X = torch.randn(3, 1, 64).expand(3, 2, 64).contiguous()  # the same input at both positions
    with torch.no_grad():
        out = layer(X)
    residual = torch.randn(3, 1, 64, generator=torch.Generator().manual_seed(10))
    y = torch.cat([out[:, :1] + residual, out[:, 1:] - residual], 1)  # each gradient ~ 0
    loss = nn.MSELoss(reduction="sum")
    assert bool((pf.batch_l2_grad(model_fn, params, X, y, loss=loss)["weight"] >= 0).all())
    found = pf.clipped_grad(model_fn, params, X, y, loss=loss, max_norm=1.0)
    expected = _clipped_mean_by_loop(autograd_batch_grad(layer, loss, X, y), 1.0)
    torch.testing.assert_close(found["weight"], 3 * expected["weight"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("layer", ["linear", "conv1d", "tied"])
def test_a_crafted_sample_whose_positions_cancel_is_still_clipped(layer: str) -> None:
    """Positions whose cotangents nearly cancel (``v`` and ``-v + δ`` on the same input,
    ``‖v‖ ≫ ‖δ‖``): the Gram form's rounding is of the order of ``‖v‖²``, so it read a
    squared norm of about zero (the sample went unclipped, ``‖g‖ = 3`` for ``C = 1``).
    The norm comes from the sample's gradient there: right to rounding, and clipped."""
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(16, generator=gen)
    x = 10 * x / x.norm()
    outputs = 1000 if layer == "tied" else 16  # (a vocabulary: the tied Gram form is cheaper)
    v, delta = torch.randn(outputs, generator=gen), torch.randn(outputs, generator=gen)
    v, delta = 1e4 * v / v.norm(), 0.3 * delta / delta.norm()
    if layer == "conv1d":
        model: nn.Module = nn.Conv1d(16, 16, 1, bias=False)
        X = torch.stack([x, x], -1)[None]  # one sample, two positions
    elif layer == "linear":
        model = nn.Linear(16, 16, bias=False)
        X = torch.stack([x, x])[None]
    else:  # the head's weight tied to an embedding the sample does not look up
        model = _TiedHead()
        X = torch.stack([x, x])[None]
    model_fn, params = pf.functional(model)
    with torch.no_grad():
        out = model(X)
    target = out.clone()
    first, second = (target[0, :, 0], target[0, :, 1]) if layer == "conv1d" else target[0]
    first -= v / 2
    second += v / 2 - delta / 2
    loss = nn.MSELoss(reduction="sum")
    expected = autograd_batch_grad(model.double(), loss, X.double(), target.double())
    name = next(iter(params))
    true_norm = expected[name].flatten(1).norm(dim=1)
    model.float()
    squares = pf.batch_l2_grad(model_fn, params, X, target, loss=loss)[name]
    torch.testing.assert_close(squares.sqrt().double(), true_norm, rtol=1e-2, atol=0)
    clipped = pf.clipped_grad(model_fn, params, X, target, loss=loss, max_norm=1.0)[name]
    assert 0.99 < float(clipped.norm()) < 1.01  # (was 3: not clipped)


def _largest_move_by_cancelling_samples(
    model_fn: Callable, params: dict, max_norm: Any, bound: float, features: int
) -> float:
    """The most one crafted float32 sample moves the clipped sum of three others, over ``bound``.

    The sample's two positions take inputs ``v`` and ``-v + δ`` (``‖v‖ ~ 1e5``, ``δ`` zero
    or 1e-3): its gradient is below the rounding of its positions' terms. It goes between
    the others (packfunc runs the first and the last sample alone as a check, and a
    convolution of one sample rounds this one's cancellation otherwise).
    """
    loss = nn.MSELoss(reduction="sum")
    gen = torch.Generator().manual_seed(0)
    normal, normal_y = torch.randn(3, 2, features, generator=gen), torch.randn(3, 4, generator=gen)
    without = pf.clipped_grad(model_fn, params, normal, normal_y, loss=loss, max_norm=max_norm)
    largest = 0.0
    for seed in range(8):
        gen.manual_seed(seed)
        v = torch.randn(features, generator=gen) * 1e5
        crafted = torch.stack([v, -v + torch.randn(features, generator=gen) * 1e-3 * (seed % 2)])
        X = torch.cat([normal[:1], crafted[None], normal[1:]])
        y = torch.cat([normal_y[:1], torch.randn(1, 4, generator=gen) * 1e2, normal_y[1:]])
        with_it = pf.clipped_grad(model_fn, params, X, y, loss=loss, max_norm=max_norm)
        moved = math.sqrt(sum(float((with_it[k] - without[k]).square().sum()) for k in params))
        largest = max(largest, moved / bound)
    return largest


class _PositionsSummed(nn.Module):
    """A layer over ``[N, 2, 16]`` inputs (as rows or as a sequence), its positions summed."""

    def __init__(self, layer: str):
        super().__init__()
        self.layer = layer
        self.op = nn.Conv1d(16, 4, 1) if layer == "conv1d" else nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.layer == "conv1d":
            return self.op(x.mT).sum(-1)
        return self.op(x).sum(1)


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("layer", ["linear", "conv1d"])
def test_a_sample_whose_positions_cancel_below_rounding_adds_at_most_its_bound(
    layer: str, grouped: bool
) -> None:
    """DP's sensitivity: adding one sample moves the clipped sum by at most ``C``. A crafted
    float32 sample (inputs ``v`` and ``-v + δ``, ``‖v‖ ~ 4e5``) has a gradient below the
    rounding of its positions' terms; its norm came from its formed gradient, its sum from the
    batch's contraction, which rounds otherwise: it added up to 737·C, and 2.7·C where the
    cancellation was not exact (a probe). It is now summed from the gradient that set its
    norm. Per-parameter groups bound it by ``√(Σ C_g²)``."""
    model_fn, params = pf.functional(_PositionsSummed(layer))
    c = 1e-2
    max_norm = {name: c for name in params} if grouped else c
    bound = c * math.sqrt(len(params)) if grouped else c
    assert _largest_move_by_cancelling_samples(model_fn, params, max_norm, bound, 16) <= 1 + 1e-4


def test_a_cancelling_sample_beyond_the_memory_budget_adds_at_most_its_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A layer whose per-sample gradients are formed for their norms (no cheaper Gram form)
    but not kept (beyond the memory budget) was summed by the batch's contraction: a crafted
    float32 sample whose positions cancel (inputs ``v`` and ``-v + δ``) moved the clipped sum
    by more than ``C`` (1.0081·C at L=2048 with 8192² weights, a probe; here a budget of one
    sample's gradient and a 4×4 layer). Such samples are now summed from their gradients."""
    monkeypatch.setattr(statistics, "DEFAULT_BUDGET", 16)  # one sample of the weight
    model_fn, params = pf.functional(nn.Sequential(nn.Linear(4, 4, bias=False), _SumOfPositions()))
    assert _largest_move_by_cancelling_samples(model_fn, params, 1e-2, 1e-2, 4) <= 1 + 1e-4


class _SameWeight(torch.autograd.Function):
    """The weight itself, through a custom Function: packfunc takes the whole-model path."""

    @staticmethod
    def forward(weight: torch.Tensor) -> torch.Tensor:
        return weight.clone()

    @staticmethod
    def setup_context(ctx: object, inputs: tuple, output: torch.Tensor) -> None:
        pass

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad

    @staticmethod
    def vmap(info: object, in_dims: tuple, weight: torch.Tensor) -> tuple:
        return weight.clone(), in_dims[0]


class _CustomLinear(nn.Module):
    """A linear layer over positions whose weight passes a custom Function, positions summed."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4, generator=torch.Generator().manual_seed(1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, _SameWeight.apply(self.weight)).sum(1)


@pytest.mark.parametrize("grouped", [False, True])
def test_a_cancelling_sample_on_the_whole_model_path_adds_at_most_its_bound(
    monkeypatch: pytest.MonkeyPatch, grouped: bool
) -> None:
    """A whole-model leaf's per-sample gradients beyond the memory budget were formed again
    from cotangents scaled by the clipping factors: a crafted float32 sample whose positions
    cancel had its terms rounded at its (huge) factor, and moved the clipped sum by 1.4·C.
    They are now formed unscaled, as for the norms, and weighted as formed."""
    monkeypatch.setattr(statistics, "DEFAULT_BUDGET", 16)  # one sample of the weight
    model_fn, params = pf.functional(_CustomLinear())
    max_norm = {"weight": 1e-2} if grouped else 1e-2
    assert _largest_move_by_cancelling_samples(model_fn, params, max_norm, 1e-2, 4) <= 1 + 1e-4


class _SumOfPositions(nn.Module):
    """``[N, L, F] -> [N, F]``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(1)


@pytest.mark.parametrize("share", [0.015, 0.14])
def test_a_crafted_gram_norm_of_a_wide_layer_adds_at_most_its_bound(share: float) -> None:
    """The Gram form's entries are float32 dot products of 16384 features; a crafted sample
    of constant-valued cotangents (``a`` and ``-a + d`` on one input, its squared norm
    ``share`` of its terms) rounds them coherently: above the old threshold (``32·√ε``,
    1.1 %) its norm read 8e-4 low, and it added 1.0008·C (a probe). The threshold grows with
    the features (12.6 % here), and just above it the rounding is 8e-5 of the norm."""
    features, c = 16384, 1e-2
    loss = nn.MSELoss(reduction="sum")
    gen = torch.Generator().manual_seed(0)
    model = nn.Linear(16, features, bias=False)
    model_fn, params = pf.functional(model)
    normal, normal_y = torch.randn(4, 2, 16, generator=gen), torch.randn(4, 2, features)
    x = torch.randn(16, generator=gen)
    a = torch.full((features,), 1e4 * (1 + 2**-12))
    d = torch.full((features,), float(a.norm()) * math.sqrt(2 * share / features))
    crafted = torch.stack([x, x])[None]
    with torch.no_grad():
        target = model(crafted) - torch.stack([a, -a + d])[None] / 2
    X, y = (
        torch.cat([normal[:2], crafted, normal[2:]]),
        torch.cat([normal_y[:2], target, normal_y[2:]]),
    )
    with_it = pf.clipped_grad(model_fn, params, X, y, loss=loss, max_norm=c)["weight"]
    without = pf.clipped_grad(model_fn, params, normal, normal_y, loss=loss, max_norm=c)["weight"]
    assert float((with_it.double() - without.double()).norm()) / c <= 1 + 2e-4


class _WideShift(nn.Module):
    """``Σ_i (x_i + s_i)²`` over ``2²²`` features: one wide per-sample gradient, all positive."""

    def __init__(self) -> None:
        super().__init__()
        self.shift = nn.Parameter(torch.full((2**22,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x + self.shift).square().sum(-1, keepdim=True)


def test_the_norm_of_a_wide_kept_gradient_is_right_to_rounding() -> None:
    """``torch.linalg.vector_norm`` of a long float32 row reads low on a CPU (4e-6 here, 3e-4
    at 2²⁴ entries: a probe's ordinary sample then exceeded ``C`` by 2.7e-4); the kept
    per-sample gradients' norms are now taken by segments."""
    model_fn, params = pf.functional(_WideShift())
    X = torch.rand(3, 2**22, generator=torch.Generator().manual_seed(0))
    loss = nn.MSELoss(reduction="sum")
    found = pf.clipped_grad(model_fn, params, X, torch.zeros(3, 1), loss=loss, max_norm=1.0)
    shifted = X.double() + params["shift"].double()
    per_sample = 4 * shifted.square().sum(-1, keepdim=True) * shifted
    factors = (1 / (per_sample.norm(dim=1, keepdim=True) + 1e-6)).clamp(max=1)
    expected = (per_sample * factors).sum(0)
    assert float((found["shift"].double() - expected).norm() / expected.norm()) < 1e-6


class _ScaledTokens(nn.Module):
    """Embeddings of ``tokens`` scaled by ``weights`` and summed over positions."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(5, 4)

    def forward(self, tokens: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return (self.embedding(tokens) * weights[..., None]).sum(1)


def test_a_sample_whose_repeated_tokens_cancel_adds_at_most_its_bound() -> None:
    """One token three times in a float32 sample, its cotangents ``a``, ``b`` and ``-(a + b)``
    (``|a| ~ 1e7``): the row's per-sample sum (which set the norm) is rounding, its clipping
    factor huge, and the batch's scatter-add rounded the scaled terms otherwise: the sample
    moved the clipped sum by 13·C (a probe). Its norm and sum now come from its gradient."""
    model_fn, params = pf.functional(_ScaledTokens())
    loss, c = nn.MSELoss(reduction="sum"), 1e-2
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 5, (6, 3), generator=gen)
    tokens[:, 0] = 1  # (the others' sums share the crafted row)
    weights, y = torch.randn(6, 3, generator=gen), torch.randn(6, 4, generator=gen)
    without = pf.clipped_grad(model_fn, params, (tokens, weights), y, loss=loss, max_norm=c)
    largest = 0.0
    for seed in range(12):
        gen.manual_seed(seed)
        a, b = (torch.randn(2, generator=gen) * 1e7).tolist()
        crafted = (torch.tensor([[1, 1, 1]]), torch.tensor([[a, b, -(a + b)]]))
        X = tuple(torch.cat([t[:3], extra, t[3:]]) for t, extra in zip((tokens, weights), crafted))
        target = torch.cat([y[:3], torch.randn(1, 4, generator=gen), y[3:]])
        with_it = pf.clipped_grad(model_fn, params, X, target, loss=loss, max_norm=c)
        largest = max(
            largest, float((with_it["embedding.weight"] - without["embedding.weight"]).norm()) / c
        )
    assert largest <= 1 + 1e-4, largest


class _TiedHead(nn.Module):
    """A linear head whose weight an embedding shares (rows never looked up here)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(1000, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        unused_rows = self.embedding(torch.zeros(x.shape[:2], dtype=torch.long)) * 0
        return nn.functional.linear(x + unused_rows, self.embedding.weight)


class _SumPooled(nn.Module):
    """Embedding or linear features summed over positions: autograd expands their cotangent."""

    def __init__(self, embedding: bool):
        super().__init__()
        self.features = nn.Embedding(10, 4) if embedding else nn.Linear(64, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).sum(1))


@pytest.mark.parametrize("embedding", [True, False])
def test_cotangents_expanded_over_positions_are_reweighted_in_a_copy(embedding: bool) -> None:
    """A stride-0 cotangent (the gradient of a sum) is not scaled in place: that raised."""
    torch.manual_seed(0)
    model = _SumPooled(embedding).double()
    X = torch.randint(0, 10, (8, 5)) if embedding else torch.randn(8, 2, 64, dtype=torch.float64)
    y, loss = torch.randint(0, 3, (8,)), nn.CrossEntropyLoss(reduction="sum")
    model_fn, params = pf.functional(model)
    found = pf.clipped_grad(model_fn, params, X, y, loss=loss, max_norm=0.5)
    expected = _clipped_mean_by_loop(autograd_batch_grad(model, loss, X, y), 0.5)
    assert_trees_close(found, {k: 8 * g for k, g in expected.items()})


def test_bounds_by_name_number_like_or_refused() -> None:
    """``max_norm`` per parameter by name equals the list in leaf order; a 0-d tensor or a
    numpy float is a bound; NaN, a missing name, or a partial ``batch_l2`` are refused."""
    import numpy as np

    model, loss, X, y = _problem()
    model_fn, params = pf.functional(model)
    names = sorted(params)  # the flattening order of a dict
    bounds = dict(zip(names, [0.1, 0.2, 0.3, 0.4]))
    by_list = pf.clipped_grad(
        model_fn, params, X, y, loss=loss, max_norm=[bounds[k] for k in names]
    )
    by_name = pf.clipped_grad(
        model_fn, params, X, y, loss=loss, max_norm=dict(reversed(bounds.items()))
    )
    assert_trees_close(by_name, by_list)
    one = pf.clipped_grad(model_fn, params, X, y, loss=loss, max_norm=0.5)
    for like in (np.float32(0.5), torch.tensor(0.5)):
        assert_trees_close(pf.clipped_grad(model_fn, params, X, y, loss=loss, max_norm=like), one)
    with pytest.raises(ValueError, match="missing \\['2.bias'\\], unknown \\['2.b'\\]"):
        wrong = {**{k: 1.0 for k in names if k != "2.bias"}, "2.b": 1.0}
        pf.clipped_grad(model_fn, params, X, y, loss=loss, max_norm=wrong)
    with pytest.raises(ValueError, match="max_norm > 0"):
        pf.clipped_grad(
            model_fn, params, X, y, loss=loss, max_norm={k: float("nan") for k in names}
        )
    dp = _unit_noise(model_fn, loss, bounds)
    noise, _ = dp.update(None, dp.init(params), params, (X[:0], y[:0]))
    assert 0.5 < _over_sensitivity(noise, bounds).std().item() < 1.5
    batch = autograd_batch_grad(model, loss, X, y)
    nan = float("nan")
    with pytest.raises(ValueError, match="noise_multiplier"):
        pf.clip_and_noise(batch, 1.0, nan)
    with pytest.raises(ValueError, match="noise_multiplier"):
        pf.privacy.add_noise(one, 1.0, nan)
    with pytest.raises(ValueError, match="max_norm must be positive"):
        pf.clip_per_sample(batch, nan)
    partial_l2 = {"0.weight": batch["0.weight"].flatten(1).square().sum(1)}
    with pytest.raises(ValueError, match="one \\[N\\] tensor of squared norms per leaf"):
        pf.clip_per_sample(batch, 1.0, batch_l2=partial_l2)


def test_a_norm_that_overflows_float32_is_refused_not_dropped() -> None:
    """A sample whose squared gradient norm exceeds float32's range read norm ∞, factor 0:
    it was left out of the sum instead of entering at norm C (float64 says where it goes)."""
    torch.manual_seed(0)
    layer = nn.Linear(3, 2)
    X, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
    X[0] *= 1e19
    model_fn, params = pf.functional(layer)
    with pytest.raises(FloatingPointError, match="sample 0 overflows torch.float32.*float64"):
        pf.clipped_grad(model_fn, params, X, y, max_norm=1.0)
    with pytest.raises(FloatingPointError, match="sample 0 overflows"):
        pf.clipped_grad(model_fn, params, X, y, max_norm={"weight": 1.0, "bias": 1.0})
    batch = pf.batch_grad(model_fn, params, X, y, loss=nn.CrossEntropyLoss(reduction="sum"))
    with pytest.raises(FloatingPointError, match="sample 0 overflows"):
        pf.privacy.clip_per_sample(batch, 1.0)
    wide = layer.double()
    model_fn, params = pf.functional(wide)
    found = pf.clipped_grad(model_fn, params, X.double(), y, max_norm=1.0)
    expected = _clipped_mean_by_loop(
        autograd_batch_grad(wide, nn.CrossEntropyLoss(reduction="sum"), X.double(), y), 1.0
    )
    assert_trees_close(found, {k: 4 * v for k, v in expected.items()})


def test_float16_norms_above_256_clip_as_their_squares_overflow_only_float16() -> None:
    """float16's squared norms overflow above a norm of 256: ``clipped_grad`` and
    ``clip_per_sample`` refused such samples as overflowing (a probe: norms of 3452 and 4905),
    though the norms, the factors and the clipped sums fit. Squares are taken in float32."""
    torch.manual_seed(0)
    half = nn.Linear(3, 2).half()
    X, y = (300 * torch.randn(4, 3)).half(), torch.tensor([0, 1, 1, 0])
    loss = nn.CrossEntropyLoss(reduction="sum")
    wide = copy.deepcopy(half).double()
    per_sample = autograd_batch_grad(wide, loss, X.double(), y)
    norms = sum(g.reshape(4, -1).square().sum(1) for g in per_sample.values()).sqrt()
    assert bool((norms > 256).all()) and bool((norms < 60000).all())
    clipped = pf.clip_per_sample(per_sample, 100.0)  # (each of norm 100: entries up to 100)
    expected = {k: g.sum(0) for k, g in clipped.items()}
    model_fn, params = pf.functional(half)
    found = pf.clipped_grad(model_fn, params, X, y, loss=loss, max_norm=100.0)
    assert_trees_close({k: v.double() for k, v in found.items()}, expected, rtol=2e-3, atol=0.2)
    batch = pf.batch_grad(model_fn, params, X, y, loss=loss)
    found = pf.privacy.clip_per_sample(batch, 100.0)
    assert_trees_close({k: v.double() for k, v in found.items()}, clipped, rtol=2e-3, atol=0.1)


class _ClassesSecond(nn.Module):
    """``[N, T, C] -> [N, C, T]``: a sequence model's logits as CrossEntropyLoss takes them."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2)


def test_clipped_grad_and_norms_compose_with_torch_func():
    """Under vmap over an ensemble the value checks (a Gram norm's cancellation, an
    overflowed norm) branched on values: torch's "data-dependent control flow". Under
    torch.func.grad the in-place reweighting read storage a wrapper has none of."""
    torch.manual_seed(0)
    members = [
        nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3), _ClassesSecond()).double()
        for _ in "ab"
    ]
    X, y = torch.randn(4, 2, 16, dtype=torch.float64), torch.randint(0, 3, (4, 2))
    loss = nn.CrossEntropyLoss(reduction="sum")
    model_fn, params = pf.functional(members[0])
    stacked = {
        k: torch.stack([dict(m.named_parameters())[k].detach() for m in members]) for k in params
    }

    def both(p: dict) -> tuple[dict, dict]:
        names = ("clipped_grad", "batch_l2_grad")
        out = pf.compute(model_fn, p, X, y, loss=loss, quantities=names, max_norm=0.5)
        return out["clipped_grad"], out["batch_l2_grad"]

    found = torch.func.vmap(both)(stacked)
    for i, member in enumerate(members):
        alone = both(pf.functional(member)[1])
        for got, expected in zip(found, alone):
            for key in expected:
                torch.testing.assert_close(got[key][i], expected[key])

    def total(p: dict) -> torch.Tensor:
        clipped = pf.clipped_grad(model_fn, p, X, y, loss=loss, max_norm=0.5)
        return sum(v.square().sum() for v in clipped.values())

    by_transform = torch.func.grad(total)(params)
    leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
    total(leaves).backward()
    for key, value in leaves.items():
        torch.testing.assert_close(by_transform[key], value.grad)


def _colliding() -> tuple[dict, object, torch.Tensor, torch.Tensor]:
    """Params whose two leaves both join to the name ``a.0``, a model using both, a batch."""
    torch.manual_seed(0)
    params = {"a": [torch.randn(4, 5, dtype=torch.float64)], "a.0": torch.randn(5, 3).double()}

    def model_fn(p: dict, X: torch.Tensor) -> torch.Tensor:
        return torch.tanh(X @ p["a"][0]) @ p["a.0"]

    return params, model_fn, torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))


def test_two_leaves_of_one_dotted_name_are_refused() -> None:
    """``{"a": [w0], "a.0": w1}``: both leaves were named ``a.0``, ``max_norm={"a.0": C}``
    clipped each to ``C`` (one sample's contribution of norm √2·C) while the noise was sized
    for ``C`` (std 1.000·C where √2·C = 1.414·C was due)."""
    params, model_fn, X, y = _colliding()
    found = "both named 'a.0': the paths \\('a', 0\\) and \\('a.0',\\).*Rename a key"
    with pytest.raises(ValueError, match=found):
        pf.functionalize.flatten_params(params)
    loss = nn.CrossEntropyLoss(reduction="sum")
    with pytest.raises(ValueError, match=found):
        pf.clipped_grad(model_fn, params, X, y, loss=loss, max_norm={"a.0": 1.0})
    private = _unit_noise(model_fn, loss, {"a.0": 1.0})
    with pytest.raises(ValueError, match=found):  # the noise alone, from an empty batch
        private.update(None, private.init(params), params, (X[:0], y[:0]))
    renamed = {"a": params["a"], "b": params["a.0"]}
    assert pf.functionalize.flatten_params(renamed)[2] == ["a.0", "b"]


def test_private_gradient_checks_bounds_by_name_also_for_the_noise_alone() -> None:
    """An empty batch draws the noise without clipping: a bound missing for a parameter
    would have sized the noise for the others alone."""
    model, loss, X, y = _problem()
    model_fn, params = pf.functional(model)
    private = _unit_noise(model_fn, loss, {"0.weight": 1.0})
    with pytest.raises(ValueError, match="missing \\['0.bias', '2.bias', '2.weight'\\]"):
        private.update(None, private.init(params), params, (X[:0], y[:0]))


@pytest.mark.parametrize("sigma", [float("inf"), -1.0, float("nan")])
def test_a_noise_multiplier_negative_infinite_or_nan_is_refused(sigma: float) -> None:
    """σ = inf made every entry of the private gradient ±inf; private_gradient and
    DPOptimizer took any σ at construction."""
    model, loss, X, y = _problem()
    model_fn, params = pf.functional(model)
    batch = autograd_batch_grad(model, loss, X, y)
    calls = {
        "add_noise": lambda: pf.privacy.add_noise({"w": torch.zeros(3)}, 1.0, sigma),
        "clip_and_noise": lambda: pf.clip_and_noise(batch, 1.0, sigma),
        "private_gradient": lambda: pf.privacy.private_gradient(
            model_fn, max_norm=1.0, noise_multiplier=sigma, expected_batch_size=4, loss=loss
        ),
        "DPOptimizer": lambda: pf.privacy.DPOptimizer(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            max_norm=1.0,
            noise_multiplier=sigma,
            expected_batch_size=4,
            loss=loss,
        ),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match=f"{name} needs a finite noise_multiplier σ >= 0"):
            call()


def test_a_mean_loss_is_refused_when_the_private_gradient_is_made() -> None:
    """A mean was accepted at construction (and an empty batch's step), refused only at the
    first step with samples."""
    model, _, _, _ = _problem()
    model_fn, _ = pf.functional(model)
    mean = nn.CrossEntropyLoss()
    with pytest.raises(ValueError, match="private_gradient needs a loss with reduction='sum'"):
        pf.privacy.private_gradient(
            model_fn, max_norm=1.0, noise_multiplier=1.0, expected_batch_size=4, loss=mean
        )
    with pytest.raises(ValueError, match="DPOptimizer needs a loss with reduction='sum'"):
        pf.privacy.DPOptimizer(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            max_norm=1.0,
            noise_multiplier=1.0,
            expected_batch_size=4,
            loss=mean,
        )


def _noisy_dp_adam(model: nn.Module, seed: int | None) -> pf.privacy.DPOptimizer:
    """DP-Adam with noise, from ``torch.Generator().manual_seed(seed)`` (``None``: global)."""
    return pf.privacy.DPOptimizer(
        model,
        torch.optim.Adam(model.parameters(), lr=0.1),
        max_norm=0.3,
        noise_multiplier=1.0,
        expected_batch_size=4,
        loss=nn.CrossEntropyLoss(reduction="sum"),
        generator=None if seed is None else torch.Generator().manual_seed(seed),
    )


def test_dp_optimizer_resumes_from_a_checkpoint_as_if_never_stopped() -> None:
    """``state_dict``/``load_state_dict`` did not exist (AttributeError): a run stopped after
    two steps and resumed in a fresh model and optimizer ends where the unbroken run does
    (Adam's moments and the noise generator restored)."""
    model, _, X, y = _problem()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    unbroken = _noisy_dp_adam(model, seed=0)
    for _ in range(4):
        unbroken.step(batch=(X, y))
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(start)
    first = _noisy_dp_adam(model, seed=0)
    for _ in range(2):
        first.step(batch=(X, y))
    checkpoint = (model.state_dict(), first.state_dict())
    resumed_model = _problem()[0]
    resumed_model.load_state_dict(checkpoint[0])
    resumed = _noisy_dp_adam(resumed_model, seed=123)
    resumed.load_state_dict(checkpoint[1])
    for _ in range(2):
        resumed.step(batch=(X, y))
    assert_trees_close(dict(resumed_model.state_dict()), expected)
    with pytest.raises(ValueError, match="has no generator"):
        _noisy_dp_adam(resumed_model, seed=None).load_state_dict(checkpoint[1])


def test_dp_optimizer_param_groups_are_the_optimizers_for_schedulers() -> None:
    """``dp.param_groups`` raised AttributeError; a scheduler takes ``dp.optimizer``."""
    model, _, X, y = _problem()
    dp = _noisy_dp_adam(model, seed=0)
    assert dp.param_groups is dp.optimizer.param_groups
    scheduler = torch.optim.lr_scheduler.StepLR(dp.optimizer, step_size=1, gamma=0.5)
    dp.step(batch=(X, y))
    scheduler.step()
    assert dp.param_groups[0]["lr"] == 0.05
    dp.load_state_dict(dp.optimizer.state_dict())  # the wrapped optimizer's own, as saved
    assert dp.param_groups[0]["lr"] == 0.05


def test_gram_norms_whose_position_terms_overflow_are_formed_and_finite():
    """float32, two positions whose terms cancel: each term's square overflows (inf - inf),
    the norm (~1e14) does not. The Gram form gave NaN norms and a NaN clipped sum without a
    refusal; such samples' gradients are formed, as cancelled ones are."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 16, bias=False)
    torch.nn.init.zeros_(layer.weight)
    model_fn, params = pf.functional(layer)
    v = 2.0**30 * torch.randint(-4, 5, (3, 16)).float()
    dv = 512.0 * torch.randint(-3, 4, (3, 16)).float()
    X = torch.stack([v, -v + dv], 1)  # the two positions sum to dv exactly
    y = -(2.0**30) * torch.randint(1, 4, (3, 1, 16)).float().expand(3, 2, 16).contiguous()
    loss = torch.nn.MSELoss(reduction="sum")
    exact = torch.stack([(2 * y[n, 0]).double().norm() * dv[n].double().norm() for n in range(3)])
    norms = pf.batch_l2_grad(model_fn, params, X, y, loss=loss)["weight"].double().sqrt()
    torch.testing.assert_close(norms, exact, rtol=1e-5, atol=0)
    clipped = pf.clipped_grad(model_fn, params, X, y, loss=loss, max_norm=1.0)["weight"]
    assert clipped.isfinite().all() and clipped.norm() <= 3.0 + 1e-4


def test_a_sample_with_a_nan_gradient_is_refused_by_the_clipping():
    """A NaN in one sample's input gave that sample a NaN norm and the clipped sum NaN
    (DPOptimizer would step with it); an infinite norm was already refused."""
    model_fn, params = pf.functional(torch.nn.Linear(3, 2))
    X, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
    X[2, 1] = float("nan")
    loss = torch.nn.CrossEntropyLoss(reduction="sum")
    with pytest.raises(FloatingPointError, match="sample 2 is NaN"):
        pf.clipped_grad(model_fn, params, X, y, loss=loss, max_norm=1.0)


def test_dp_optimizer_refuses_a_stepped_tensor_that_is_not_the_models() -> None:
    """A soft prompt kept outside the module, in the optimizer: DPOptimizer clipped and
    noised the model's parameters only and let the optimizer step the prompt with its raw
    gradient (or never, after zero_grad), silently."""
    model, loss, X, y = _problem()
    prompt = torch.zeros(X.shape[1], requires_grad=True)
    prompt.grad = torch.ones_like(prompt)
    opt = pf.privacy.DPOptimizer(
        model,
        torch.optim.SGD([*model.parameters(), prompt], lr=0.1),
        max_norm=0.3,
        noise_multiplier=1.0,
        expected_batch_size=6,
        loss=loss,
    )
    with pytest.raises(ValueError, match="not a parameter of the model"):
        opt.step(batch=(X, y))
    assert torch.equal(prompt, torch.zeros_like(prompt))


def test_a_loss_without_reduction_is_told_to_sum_where_clipping_needs_it():
    """Found by a probe: ``reduction='none'`` was told to "pass reduction='mean' or
    reduction='sum'", and then 'mean' was refused by all three."""
    model = nn.Linear(3, 2)
    model_fn, params = pf.functional(model)
    X, y, none = (
        torch.randn(4, 3),
        torch.tensor([0, 1, 1, 0]),
        nn.CrossEntropyLoss(reduction="none"),
    )
    with pytest.raises(ValueError, match=r"clipped_grad and DP-SGD: 'sum'"):
        pf.clipped_grad(model_fn, params, X, y, loss=none, max_norm=1.0)
    with pytest.raises(ValueError, match=r"private_gradient needs a loss with reduction='sum'"):
        pf.privacy.private_gradient(
            model_fn, max_norm=1.0, noise_multiplier=1.0, expected_batch_size=4, loss=none
        )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"DPOptimizer needs a loss with reduction='sum'"):
        pf.privacy.DPOptimizer(
            model, optimizer, max_norm=1.0, noise_multiplier=1.0, expected_batch_size=4, loss=none
        )


def test_a_norm_made_nan_by_an_overflowed_input_names_the_overflow():
    """Found by a probe: a saturated tanh gives a layer a zero output gradient while its
    input's squared norm overflows (inputs of 1e160 in float64): the closed form's 0 · inf is
    NaN, refused with a message that blamed a NaN or inf input. It names the overflow too."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    model_fn, params = pf.functional(model)
    X, y = torch.randn(6, 4, dtype=torch.float64) * 1e160, torch.randint(0, 3, (6,))
    with pytest.raises(FloatingPointError, match="squared norm overflows the dtype"):
        pf.clipped_grad(
            model_fn, params, X, y, loss=nn.CrossEntropyLoss(reduction="sum"), max_norm=1.0
        )


def test_clipped_grad_per_group_bounds(case) -> None:
    """Groups of parameters (a tuple of names as a key of ``max_norm``), each clipped by its
    joint per-sample norm; a group of one is a parameter clipped alone. The private
    gradient's noise is sized by ``√Σ C_g²``."""
    problem = make_problem(case, "cross_entropy", "sum", n=4)
    batch = autograd_batch_grad(problem.model, problem.loss, problem.X, problem.y)
    model_fn, params = problem.functional()
    names = sorted(params)
    halves = [tuple(names[: len(names) // 2 + 1]), tuple(names[len(names) // 2 + 1 :])]
    groups = {group: 0.2 * (i + 1) for i, group in enumerate(halves) if group}
    expected = {}
    for group, bound in groups.items():
        norms = torch.cat([batch[k].reshape(len(batch[k]), -1) for k in group], 1).norm(dim=1)
        factors = (bound / (norms + 1e-6)).clamp(max=1.0)
        expected |= {k: torch.tensordot(factors, batch[k], dims=1) for k in group}
    clipped = partial(pf.clipped_grad, model_fn, params, problem.X, problem.y, loss=problem.loss)
    assert_trees_close(clipped(max_norm=groups), expected)
    bounds = [0.1 * (i + 1) for i in range(len(names))]
    assert_trees_close(
        clipped(max_norm=dict(zip([(k,) for k in names], bounds))), clipped(max_norm=bounds)
    )


def test_group_bounds_name_every_parameter_once() -> None:
    """A parameter in two groups, or in none, or a key that is not a name or a tuple of
    names, is refused naming it; the sensitivity of groups is ``√Σ C_g²``."""
    model, loss, X, y = _problem()
    model_fn, params = pf.functional(model)
    names = sorted(params)
    with pytest.raises(ValueError, match=r"in two groups \['0.weight'\]"):
        twice = {tuple(names[:2]): 1.0, tuple(names[1:]): 1.0}
        pf.clipped_grad(model_fn, params, X, y, loss=loss, max_norm=twice)
    with pytest.raises(ValueError, match=r"missing \['2.weight'\]"):
        pf.clipped_grad(model_fn, params, X, y, loss=loss, max_norm={tuple(names[:3]): 1.0})
    with pytest.raises(TypeError, match="tuples of them"):
        pf.clipped_grad(model_fn, params, X, y, loss=loss, max_norm={0: 1.0})
    groups = {tuple(names[:2]): 0.3, tuple(names[2:]): 0.4}
    dp = _unit_noise(model_fn, loss, groups)
    noise, _ = dp.update(None, dp.init(params), params, (X[:0], y[:0]))
    assert 0.5 < _over_sensitivity(noise, groups).std().item() < 1.5


def test_dp_optimizer_takes_group_bounds() -> None:
    """``DPOptimizer(max_norm={(names...): C})`` writes the grouped clipped sum (no noise)."""
    model, loss, X, y = _problem()
    groups = {("0.weight", "0.bias"): 0.3, ("2.weight", "2.bias"): 0.2}
    model_fn, params = pf.functional(model)
    expected = pf.clipped_grad(model_fn, params, X, y, loss=loss, max_norm=groups)
    opt = _noiseless_dp_sgd(model, loss, lr=0.0, expected_batch_size=len(X), max_norm=groups)
    opt.step(batch=(X, y))
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name] / len(X))


def test_clipping_under_autocast_bounds_each_sample_by_max_norm():
    """Under bfloat16 autocast, the clipping factors were rounded to the recorded
    cotangents' bfloat16 before scaling them: a sample's clipped gradient reached 1.004
    times the bound (DP's sensitivity exceeded) and the sum was 0.3 % off the same call's
    ``Σ c_n g_n`` (a probe)."""
    torch.manual_seed(0)
    fn, p = pf.functional(nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 10)))
    X, y = torch.randn(16, 32) * 5, torch.randint(0, 10, (16,))
    loss, bound = nn.CrossEntropyLoss(reduction="sum"), 0.05
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = pf.compute(
            fn,
            p,
            X,
            y,
            loss=loss,
            quantities=("clipped_grad", "batch_grad", "batch_l2_grad"),
            max_norm=bound,
        )
    norms = sum(out["batch_l2_grad"][k].double() for k in p).sqrt()
    factors = (bound / (norms + 1e-6)).clamp(max=1)
    for k, g in out["batch_grad"].items():
        expected = (g.double() * factors.view(-1, *[1] * (g.dim() - 1))).sum(0)
        torch.testing.assert_close(out["clipped_grad"][k].double(), expected, rtol=1e-5, atol=1e-8)
    for n in range(len(X)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            alone = pf.clipped_grad(fn, p, X[n : n + 1], y[n : n + 1], loss=loss, max_norm=bound)
        assert sum((t.double() ** 2).sum() for t in alone.values()).sqrt() <= bound * (1 + 1e-6)


def test_the_gradient_through_clipped_sums_is_finite_where_a_sample_has_no_gradient():
    """A fully padded sequence (``ignore_index``) has a zero gradient: ``sqrt``'s infinite
    derivative at its zero norm made a gradient through ``clipped_grad`` and
    ``clip_per_sample`` NaN (a probe). It equals that of the batch without the sample."""
    torch.manual_seed(0)
    params = {
        "W1": torch.randn(3, 4, dtype=torch.float64),
        "W2": torch.randn(4, 3, dtype=torch.float64),
    }

    def model_fn(p, X):
        return (torch.tanh(X @ p["W1"]) @ p["W2"]).transpose(1, 2)  # [N, C, T]

    X = torch.randn(4, 5, 3, dtype=torch.float64)
    y = torch.randint(0, 3, (4, 5))
    y[1] = -100  # sample 1 is all padding
    loss = nn.CrossEntropyLoss(reduction="sum", ignore_index=-100)
    weights = {k: torch.randn_like(v) for k, v in params.items()}

    def through_clipped_grad(p, X, y):
        clipped = pf.clipped_grad(model_fn, p, X, y, loss=loss, max_norm=0.5)
        return sum((clipped[k] * weights[k]).sum() for k in p)

    def through_clip_per_sample(p, X, y):
        clipped = pf.clip_per_sample(pf.batch_grad(model_fn, p, X, y, loss=loss), 0.5)
        return sum((clipped[k].sum(0) * weights[k]).sum() for k in p)

    kept = torch.tensor([0, 2, 3])
    for objective in (through_clipped_grad, through_clip_per_sample):
        found = torch.func.grad(objective)(params, X, y)
        expected = torch.func.grad(objective)(params, X[kept], y[kept])
        for k in params:
            torch.testing.assert_close(found[k], expected[k])
