"""First-order quantities against per-sample autograd loops, on every model of cases.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import packfunc as pf
from tests.cases import (
    CASE_IDS,
    CASES,
    LOSSES,
    autograd_batch_grad,
    make_loss,
    make_targets,
    moments,
    wrap_for_loss,
)


def _setup(case_name: str, loss_name: str, reduction: str, n: int, seed: int = 0):
    torch.manual_seed(seed)
    case = CASES[CASE_IDS.index(case_name)]
    model = wrap_for_loss(case.build(), loss_name).double()
    X = case.inputs(n)
    X = X.double() if X.is_floating_point() else X
    with torch.no_grad():
        y = make_targets(loss_name, model(X), case.classes).to(
            torch.float64 if loss_name in ("mse", "bce_with_logits") else torch.long)
    return model, make_loss(loss_name, reduction), X, y


def _assert_tree_close(actual: dict, expected: dict, what: str) -> None:
    assert actual.keys() == expected.keys(), what
    for name in expected:
        assert actual[name].shape == expected[name].shape, (what, name)
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-9, atol=1e-11,
                                   msg=lambda m, name=name: f"{what}[{name}]: {m}")


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("loss_name", LOSSES)
@pytest.mark.parametrize("case_name", CASE_IDS)
def test_all_quantities_match_autograd(case_name: str, loss_name: str, reduction: str, n: int):
    model, loss, X, y = _setup(case_name, loss_name, reduction, n)
    expected = moments(autograd_batch_grad(model, loss, X, y))
    model_fn, params = pf.functional(model)
    result = pf.compute(model_fn, params, X, y, loss=loss, quantities=pf.FIRST_ORDER)
    torch.testing.assert_close(result["loss"], loss(model(X), y))
    for quantity in pf.FIRST_ORDER:
        _assert_tree_close(result[quantity], expected[quantity], f"{case_name}/{quantity}")


@pytest.mark.parametrize("case_name", CASE_IDS)
def test_batch_grad_sums_to_gradient(case_name: str):
    """Independent of the loop oracle: Σ_n batch_grad[n] is the autograd gradient."""
    model, loss, X, y = _setup(case_name, "cross_entropy", "mean", 4, seed=1)
    model_fn, params = pf.functional(model)
    per_sample = pf.batch_grad(model_fn, params, X, y, loss=loss)
    grads = torch.autograd.grad(loss(model(X), y), list(model.parameters()))
    for (name, _), g in zip(model.named_parameters(), grads):
        torch.testing.assert_close(per_sample[name].sum(0), g)


@pytest.mark.parametrize("function", [pf.batch_grad, pf.batch_l2_grad, pf.sum_grad_squared,
                                      pf.variance])
def test_single_quantity_functions_agree_with_first_order(function):
    model, loss, X, y = _setup("shared_layer", "cross_entropy", "mean", 5)
    model_fn, params = pf.functional(model)
    name = function.__name__
    together = pf.compute(model_fn, params, X, y, loss=loss, quantities=(name,))[name]
    _assert_tree_close(function(model_fn, params, X, y, loss=loss), together, name)


@pytest.mark.parametrize("case_name", ["mlp", "conv2d", "embedding", "raw_parameter", "lstm"])
def test_subsampling_selects_samples_with_batch_scaling(case_name: str):
    model, loss, X, y = _setup(case_name, "cross_entropy", "mean", 5)
    model_fn, params = pf.functional(model)
    full = pf.compute(model_fn, params, X, y, loss=loss,
                          quantities=("batch_grad", "batch_l2_grad", "sum_grad_squared"))
    subset = [3, 0, 3]
    sub = pf.compute(model_fn, params, X, y, loss=loss, subsampling=subset,
                         quantities=("batch_grad", "batch_l2_grad", "sum_grad_squared"))
    for name in params:
        torch.testing.assert_close(sub["batch_grad"][name], full["batch_grad"][name][subset])
        torch.testing.assert_close(sub["batch_l2_grad"][name], full["batch_l2_grad"][name][subset])
        torch.testing.assert_close(sub["sum_grad_squared"][name], full["sum_grad_squared"][name])


@pytest.mark.parametrize("chunk_size", [1, 2, 7])
@pytest.mark.parametrize("case_name", ["conv2d", "raw_parameter", "shared_layer", "lstm"])
def test_chunking_gives_identical_results(case_name: str, chunk_size: int):
    model, loss, X, y = _setup(case_name, "cross_entropy", "sum", 5)
    model_fn, params = pf.functional(model)
    reference = pf.compute(model_fn, params, X, y, loss=loss, quantities=pf.FIRST_ORDER)
    chunked = pf.compute(model_fn, params, X, y, loss=loss, chunk_size=chunk_size,
                         quantities=pf.FIRST_ORDER)
    for quantity in pf.FIRST_ORDER:
        _assert_tree_close(chunked[quantity], reference[quantity], quantity)


def test_hand_written_model_fn_over_nested_pytree():
    torch.manual_seed(0)
    params = {"layers": [{"w": torch.randn(3, 4, dtype=torch.float64)},
                         {"w": torch.randn(4, 2, dtype=torch.float64)}],
              "b": torch.randn(2, dtype=torch.float64)}

    def model_fn(p, X):
        return torch.tanh(X @ p["layers"][0]["w"]) @ p["layers"][1]["w"] + p["b"]

    X, y = torch.randn(4, 3, dtype=torch.float64), torch.randint(0, 2, (4,))
    loss = nn.CrossEntropyLoss()
    result = pf.batch_grad(model_fn, params, X, y, loss=loss)
    for n in range(4):
        def loss_n(p, n=n):
            return loss(model_fn(p, X[n:n + 1]), y[n:n + 1]) / 4
        expected = torch.func.grad(loss_n)(params)
        torch.testing.assert_close(result["layers"][1]["w"][n], expected["layers"][1]["w"])
        torch.testing.assert_close(result["b"][n], expected["b"])


def test_unused_parameter_gets_zeros():
    model = nn.ModuleDict({"used": nn.Linear(3, 2), "unused": nn.Linear(3, 2)}).double()
    params = {k: v.detach() for k, v in model.named_parameters()}

    def model_fn(p, X):
        return torch.nn.functional.linear(X, p["used.weight"], p["used.bias"])

    X, y = torch.randn(4, 3, dtype=torch.float64), torch.randint(0, 2, (4,))
    result = pf.compute(model_fn, params, X, y, quantities=pf.FIRST_ORDER)
    assert torch.count_nonzero(result["batch_grad"]["unused.weight"]) == 0
    assert result["batch_l2_grad"]["unused.bias"].shape == (4,)
    assert torch.count_nonzero(result["batch_grad"]["used.weight"]) > 0
