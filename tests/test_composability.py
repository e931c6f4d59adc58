"""The quantities compose with torch.func: vmap over an ensemble, grad through them."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.func import functional_call, grad, stack_module_state, vmap

import packfunc as pf
from tests.cases import CASE_IDS, CASES

COMPOSED_CASES = ["mlp", "conv2d", "convtranspose1d", "embedding", "raw_parameter", "lstm",
                  "shared_layer"]


def _case(name: str, n: int = 4):
    torch.manual_seed(0)
    case = CASES[CASE_IDS.index(name)]
    model = case.build().double()
    X = case.inputs(n)
    X = X.double() if X.is_floating_point() else X
    y = torch.randint(0, case.classes, (n,))
    return case, model, X, y


@pytest.mark.parametrize("case_name", COMPOSED_CASES)
def test_vmap_over_an_ensemble_equals_each_member(case_name: str):
    case, model, X, y = _case(case_name)
    members = [model] + [copy.deepcopy(model) for _ in range(2)]
    for member in members[1:]:
        for p in member.parameters():
            p.data.normal_()
    stacked, _ = stack_module_state(members)
    base = copy.deepcopy(model).to("meta")

    def model_fn(params, X):
        return functional_call(base, params, (X,))

    def quantities(params):
        out = pf.compute(model_fn, params, X, y, quantities=("batch_grad", "variance"))
        return out["batch_grad"], out["variance"]

    batch, var = vmap(quantities)(stacked)
    for i, member in enumerate(members):
        fn, params = pf.functional(member)
        expected = pf.compute(fn, params, X, y, quantities=("batch_grad", "variance"))
        for name in params:
            torch.testing.assert_close(batch[name][i], expected["batch_grad"][name])
            torch.testing.assert_close(var[name][i], expected["variance"][name])


@pytest.mark.parametrize("case_name", COMPOSED_CASES)
def test_grad_of_mean_batch_l2_matches_double_backward(case_name: str):
    case, model, X, y = _case(case_name, n=3)
    model_fn, params = pf.functional(model)
    loss = torch.nn.CrossEntropyLoss()

    def mean_l2(params):
        l2 = pf.batch_l2_grad(model_fn, params, X, y, loss=loss)
        return sum(v.mean() for v in l2.values())

    actual = grad(mean_l2)(params)
    live = {k: v.clone().requires_grad_() for k, v in params.items()}
    total = 0.0
    for n in range(X.shape[0]):
        term = torch.nn.functional.cross_entropy(model_fn(live, X[n:n + 1]), y[n:n + 1]) / 3
        per_sample = torch.autograd.grad(term, list(live.values()), create_graph=True)
        total = total + sum(g.square().sum() for g in per_sample) / 3
    expected = torch.autograd.grad(total, list(live.values()), allow_unused=True)
    for name, e in zip(live, expected):
        torch.testing.assert_close(actual[name], torch.zeros_like(actual[name]) if e is None else e)


def test_results_are_differentiable_with_plain_autograd():
    _, model, X, y = _case("mlp")
    model_fn, _ = pf.functional(model)
    params = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    sgs = pf.sum_grad_squared(model_fn, params, X, y)
    total = sum(v.sum() for v in sgs.values())
    grads = torch.autograd.grad(total, list(params.values()))
    assert all(torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)


def test_params_and_model_are_not_mutated():
    _, model, X, y = _case("batchnorm_eval")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model_fn, params = pf.functional(model)
    pf.compute(model_fn, params, X, y, quantities=pf.FIRST_ORDER)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    assert all(not p.requires_grad for p in params.values())
