"""Chunking bounds how many per-sample gradients exist at once; results do not change."""

from __future__ import annotations

import pytest
import torch
from tests.cases import make_problem
from torch import nn

import packfunc as pf
from packfunc.engine import memory, statistics, whole_model
from packfunc.engine.batch_pass import ColumnGradients
from packfunc.engine.memory import (
    chunk_length,
    chunks,
    index_length,
    is_plain,
    new_output,
    split_index,
)


def _raw_parameter_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    _, params = pf.functional(model)

    def time_major(p, X):  # the first weight meets the samples along dim 1: whole-model path
        hidden = torch.tanh((p["0.weight"] @ X.T).T + p["0.bias"])
        return nn.functional.linear(hidden, p["2.weight"], p["2.bias"])

    return time_major, params


@pytest.fixture
def whole_model_passes(monkeypatch):
    """The samples of each call of the whole-model path, in order."""
    seen: list[int] = []
    original = whole_model.column_grads
    monkeypatch.setattr(
        whole_model, "column_grads", lambda *a: seen.append(index_length(a[-1])) or original(*a)
    )
    return seen


def test_automatic_chunks_respect_the_budget(monkeypatch, whole_model_passes):
    model_fn, params = _raw_parameter_model()
    X, y = torch.randn(10, 6, dtype=torch.float64), torch.randint(0, 3, (10,))
    unbounded = pf.compute(model_fn, params, X, y, quantities=pf.FIRST_ORDER)
    seen = whole_model_passes
    seen.clear()
    monkeypatch.setattr(memory, "DEFAULT_BUDGET", 2 * 48)  # two samples' worth of 0.weight
    bounded = pf.compute(model_fn, params, X, y, quantities=("sum_grad_squared", "variance"))
    assert max(seen) == 2 and sum(seen) == 10
    for quantity in ("sum_grad_squared", "variance"):
        for name in params:
            torch.testing.assert_close(bounded[quantity][name], unbounded[quantity][name])


def test_explicit_chunk_size_is_used(whole_model_passes):
    model_fn, params = _raw_parameter_model()
    X, y = torch.randn(7, 6, dtype=torch.float64), torch.randint(0, 3, (7,))
    seen = whole_model_passes
    pf.batch_grad(model_fn, params, X, y, chunk_size=3)
    assert seen == [3, 3, 1]


def test_chunk_helpers():
    assert chunk_length(100, 10, None) == 100
    assert chunk_length(100, memory.DEFAULT_BUDGET, None) == 1
    assert chunk_length(5, 1, 2) == 2
    assert chunks(5, 2) == [slice(0, 2), slice(2, 4), slice(4, 5)]
    assert split_index(slice(1, 6), 2) == [slice(1, 3), slice(3, 5), slice(5, 6)]
    assert [t.tolist() for t in split_index(torch.tensor([4, 0, 4]), 2)] == [[4, 0], [4]]
    assert index_length(slice(1, 6)) == 5 and index_length(torch.tensor([4, 0, 4])) == 3
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_length(5, 1, -1)


def test_large_outputs_are_ordinary_tensors():
    like = torch.zeros(1)
    big = new_output((2**23, 2), like)  # 64 MiB
    big.fill_(2.0)
    assert big.shape == (2**23, 2) and big.dtype == like.dtype and float(big.sum()) == 2**25
    assert is_plain(like) and not is_plain(torch.zeros(1, requires_grad=True))


@pytest.mark.parametrize("case", ["mlp", "embedding"], indirect=True)
def test_moments_of_closed_form_layers_never_materialize(monkeypatch, case):
    def refuse(*args):
        raise AssertionError("materialized per-sample gradients")

    monkeypatch.setattr(ColumnGradients, "leaf_columns", refuse)
    monkeypatch.setattr(whole_model, "column_grads", refuse)
    problem = make_problem(case, n=6)
    result = pf.compute(
        *problem.functional(),
        problem.X,
        problem.y,
        quantities=("grad", "batch_l2_grad", "sum_grad_squared", "variance"),
    )
    grads = torch.autograd.grad(
        problem.loss(problem.model(problem.X), problem.y), list(problem.model.parameters())
    )
    for (name, _), g in zip(problem.model.named_parameters(), grads):
        torch.testing.assert_close(result["grad"][name], g)


def test_clipped_sums_form_whole_model_gradients_once_within_the_budget(
    monkeypatch, whole_model_passes
):
    """Per-sample gradients of the whole-model path were formed twice by ``clipped_grad``
    (for the norms, then again for the reweighted sum: 2× a ``batch_grad``); within the
    budget they are kept and summed with the factors. Beyond it, formed again: equal sums."""
    model_fn, params = _raw_parameter_model()
    X, y = torch.randn(10, 6, dtype=torch.float64), torch.randint(0, 3, (10,))
    passes = whole_model_passes
    kept = pf.clipped_grad(model_fn, params, X, y, max_norm=0.1)
    assert passes == [10]
    passes.clear()
    monkeypatch.setattr(statistics, "DEFAULT_BUDGET", 48)  # one sample of 0.weight
    again = pf.clipped_grad(model_fn, params, X, y, max_norm=0.1)
    assert passes == [10, 10]
    for name in params:
        torch.testing.assert_close(kept[name], again[name])
