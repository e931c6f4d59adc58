"""How people call models: under ``no_grad``/``inference_mode``, compiled, refused.

Every public function works inside ``torch.no_grad()`` and ``torch.inference_mode()``
(packfunc enables what it needs internally) with the values it has outside them; a
model compiled with ``torch.compile`` runs as its original module; a refusal leaves the
model's buffers as they were.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import packfunc as pf
from tests.cases import assert_trees_close

CALLS = {
    "batch_grad": lambda fn, p, X, y: pf.batch_grad(fn, p, X, y),
    "compute": lambda fn, p, X, y: pf.compute(
        fn, p, X, y, quantities=("grad", "variance", "diag_ggn")
    ),
    "kfac": lambda fn, p, X, y: pf.kfac(fn, p, X, y, generator=torch.Generator().manual_seed(0)),
    "ekfac": lambda fn, p, X, y: pf.ekfac(fn, p, X, y, generator=torch.Generator().manual_seed(0)),
    "diag_hessian": lambda fn, p, X, y: pf.diag_hessian(fn, p, X, y),
    "hessian_vector_product": lambda fn, p, X, y: pf.hessian_vector_product(
        fn, p, X, y, {k: torch.ones_like(t) for k, t in p.items()}
    ),
    "hutchinson_trace": lambda fn, p, X, y: pf.hutchinson_trace(
        fn, p, X, y, num_samples=2, generator=torch.Generator().manual_seed(0)
    ),
    "data": lambda fn, p, X, y: pf.sum_grad_squared(fn, p, data=[(X[:2], y[:2]), (X[2:], y[2:])]),
    "explain": lambda fn, p, X, y: pf.explain(fn, p, X),
}


def _problem():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    return model, torch.randn(5, 3), torch.randint(0, 2, (5,))


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize("call", list(CALLS))
def test_functions_work_inside_no_grad_and_inference_mode(mode, call):
    model, X, y = _problem()
    model_fn, params = pf.functional(model)
    expected = CALLS[call](model_fn, params, X, y)
    with mode():
        inner_X, inner_y = X.clone(), y.clone()  # inference tensors under inference_mode
        found = CALLS[call](model_fn, params, inner_X, inner_y)
    if call == "explain":
        assert found == expected
    else:
        assert_trees_close(found, expected, call)


def test_a_compiled_module_runs_as_its_original_module():
    model, X, y = _problem()
    model_fn, params = pf.functional(torch.compile(model))
    eager_fn, eager_params = pf.functional(model)
    assert list(params) == list(eager_params)
    assert_trees_close(
        pf.batch_grad(model_fn, params, X, y), pf.batch_grad(eager_fn, eager_params, X, y)
    )


def test_compiled_functions_and_submodules_are_refused_with_the_fix():
    model, X, y = _problem()
    model_fn, params = pf.functional(model)
    with pytest.raises(TypeError, match="torch.compile.*uncompiled"):
        pf.batch_grad(torch.compile(model_fn), params, X, y)
    model[0] = torch.compile(model[0])
    with pytest.raises(ValueError, match=r"\['0'\] are compiled"):
        pf.functional(model)


@pytest.mark.parametrize("call", ["batch_grad", "diag_ggn", "kfac", "explain"])
def test_a_refusal_leaves_the_buffers_alone(call):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).train()
    model_fn, params = pf.functional(model)
    X, y = torch.randn(6, 3), torch.randint(0, 2, (6,))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="BatchNorm in training mode"):
        if call == "explain":
            pf.explain(model_fn, params, X)
        else:
            getattr(pf, call)(model_fn, params, X, y)
    assert_trees_close(dict(model.state_dict()), before)
