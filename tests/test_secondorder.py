"""Second-order quantities against dense torch.func GGNs and Hessians on tiny float64 models."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

import packfunc as pf
from packfunc.engine.batch_pass import BatchPass
from tests.cases import CASES, assert_trees_close, dense_curvature, make_problem

SECOND_ORDER_LOSSES = ["cross_entropy", "mse", "bce_with_logits"]


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert_trees_close(actual, expected, what, rtol=1e-8, atol=1e-10)


REPRESENTATIVE = ("mlp", "residual", "shared_layer", "raw_parameter", "spatial_output")
"""Cases that also run the losses other than cross-entropy."""

PRODUCT_CASES = (
    "mlp",
    "conv2d",
    "residual",
    "shared_layer",
    "lstm",
    "transformer",
    "custom_module",
)
"""Cases of :func:`test_curvature_vector_products`."""

COMBINATIONS = [
    (case, loss, reduction, n)
    for case in CASES
    for loss in SECOND_ORDER_LOSSES
    if loss == "cross_entropy" or case in REPRESENTATIVE
    for reduction in ("mean", "sum")
    for n in (1, 3)
]
"""Each case with each loss it runs, both reductions, one and three samples (a mean's dense
oracle is the sum's scaled: ``tests/cases.py``)."""


@pytest.mark.parametrize(("case", "loss_name", "reduction", "n"), COMBINATIONS, indirect=["case"])
def test_second_order_quantities_match_dense_references(case, loss_name, reduction, n):
    problem = make_problem(case, loss_name, reduction, n)
    dense = problem.dense()
    out = pf.compute(
        *problem.functional(), problem.X, problem.y, loss=problem.loss, quantities=pf.SECOND_ORDER
    )

    root = dense.flatten(out["sqrt_ggn"], leading=2)  # [K, N, P]
    _close(torch.einsum("knp,knq->pq", root, root), dense.ggn, "sqrt_ggn reproduces the GGN")
    _close(dense.flatten(out["diag_ggn"]), dense.ggn.diagonal(), "diag_ggn")
    _close(
        dense.flatten(out["batch_diag_ggn"], leading=1),
        dense.sample_ggn.diagonal(dim1=1, dim2=2),
        "batch_diag_ggn",
    )
    _close(dense.flatten(out["diag_hessian"]), dense.hessian.diagonal(), "diag_hessian")
    _close(
        dense.flatten(out["batch_diag_hessian"], leading=1),
        dense.sample_hessian.diagonal(dim1=1, dim2=2),
        "batch_diag_hessian",
    )


@pytest.mark.parametrize("case", PRODUCT_CASES, indirect=True)
def test_curvature_vector_products(case):
    problem = make_problem(case, "cross_entropy", "mean", 3)
    dense = problem.dense()  # shared with test_second_order_quantities_match_dense_references
    model_fn, params = problem.functional()
    X, y, loss = problem.X, problem.y, problem.loss
    v = {k: torch.randn_like(p) for k, p in params.items()}
    flat_v = dense.flatten(v)
    gv = pf.ggn_vector_product(model_fn, params, X, y, v, loss=loss)
    hv = pf.hessian_vector_product(model_fn, params, X, y, v, loss=loss)
    _close(dense.flatten(gv), dense.ggn @ flat_v, "ggn_vector_product")
    _close(dense.flatten(hv), dense.hessian @ flat_v, "hessian_vector_product")


@pytest.mark.parametrize(
    "case", ["mlp", "conv2d", "embedding", "raw_parameter", "linear_solve"], indirect=True
)
def test_subsampled_square_root_and_diagonals(case):
    problem = make_problem(case, n=5)
    model_fn, params = problem.functional()
    X, y, loss = problem.X, problem.y, problem.loss
    names = ("sqrt_ggn", "batch_diag_ggn", "batch_diag_hessian")
    full = pf.compute(model_fn, params, X, y, loss=loss, quantities=names)
    subset = [4, 1, 4]
    sub = pf.compute(model_fn, params, X, y, loss=loss, quantities=names, subsampling=subset)
    for name in params:
        _close(sub["sqrt_ggn"][name], full["sqrt_ggn"][name][:, subset], "sqrt_ggn")
        _close(sub["batch_diag_ggn"][name], full["batch_diag_ggn"][name][subset], "batch_diag")
        _close(
            sub["batch_diag_hessian"][name],
            full["batch_diag_hessian"][name][subset],
            "batch_diag_hessian",
        )


def test_monte_carlo_ggn_converges_to_the_exact_one():
    problem = make_problem("mlp", n=4)
    model_fn, params = problem.functional()
    X, y, loss = problem.X, problem.y, problem.loss
    exact = pf.diag_ggn(model_fn, params, X, y, loss=loss)

    def error(samples: int) -> float:
        generator = torch.Generator().manual_seed(0)
        mc = pf.diag_ggn(model_fn, params, X, y, loss=loss, mc_samples=samples, generator=generator)
        return max(float((mc[k] - exact[k]).abs().max() / exact[k].abs().max()) for k in exact)

    few, many = error(10), error(20_000)
    assert many < 0.05, many
    assert many < few / 5, (few, many)


@pytest.mark.parametrize("loss_name", SECOND_ORDER_LOSSES)
def test_monte_carlo_square_root_is_reproducible_and_unbiased(loss_name):
    problem = make_problem("mlp", loss_name, "sum", 3)
    model_fn, params = problem.functional()
    X, y, loss = problem.X, problem.y, problem.loss

    def draw(seed: int, samples: int):
        generator = torch.Generator().manual_seed(seed)
        return pf.compute(
            model_fn,
            params,
            X,
            y,
            loss=loss,
            mc_samples=samples,
            generator=generator,
            quantities=("sqrt_ggn", "batch_diag_ggn"),
        )

    first, again = draw(7, 3), draw(7, 3)
    for name in params:
        assert first["sqrt_ggn"][name].shape == (3, 3, *params[name].shape)
        assert torch.equal(first["sqrt_ggn"][name], again["sqrt_ggn"][name])
    exact = pf.batch_diag_ggn(model_fn, params, X, y, loss=loss)
    mean = draw(1, 30_000)["batch_diag_ggn"]
    for name in params:
        scale = exact[name].abs().max()
        assert float((mean[name] - exact[name]).abs().max() / scale) < 0.05


def _shrink_budget(monkeypatch, budget: int) -> None:
    """Set the chunking budget in ``memory`` and in every module that copied it at import."""
    for name, module in list(sys.modules.items()):
        if (name == "packfunc" or name.startswith("packfunc.")) and hasattr(
            module, "DEFAULT_BUDGET"
        ):
            monkeypatch.setattr(module, "DEFAULT_BUDGET", budget)


def test_thousand_class_head_is_chunked_and_exact(monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1000)).double()
    X, y = torch.randn(4, 6, dtype=torch.float64), torch.randint(0, 1000, (4,))
    model_fn, params = pf.functional(model)
    quantities = ("diag_ggn", "batch_diag_ggn", "sqrt_ggn")
    pulled: list[int] = []  # square-root columns pulled back at once, per pullback
    original = BatchPass.columns
    monkeypatch.setattr(
        BatchPass,
        "columns",
        lambda self, cotangents: pulled.append(cotangents.shape[0]) or original(self, cotangents),
    )
    whole = pf.compute(model_fn, params, X, y, quantities=quantities)
    assert pulled == [1000]  # the default budget holds all 1000 classes at once
    pulled.clear()
    _shrink_budget(monkeypatch, 2**16)
    out = pf.compute(model_fn, params, X, y, quantities=quantities)
    assert len(pulled) > 1 and max(pulled) < 1000 and sum(pulled) == 1000, pulled
    assert_trees_close(out, whole, "chunked", rtol=1e-12, atol=1e-14)
    # the output bias sees the loss Hessian directly: diag = Σ_n (p − p²) / N
    probs = torch.softmax(model(X), 1)
    _close(out["diag_ggn"]["2.bias"], (probs - probs**2).sum(0).detach() / 4, "bias")
    _close(out["batch_diag_ggn"]["0.weight"].sum(0), out["diag_ggn"]["0.weight"], "sum")


def test_nll_loss_is_refused_for_second_order():
    problem = make_problem("mlp", "nll")  # the model ends in LogSoftmax
    with pytest.raises(ValueError, match="CrossEntropyLoss on logits"):
        pf.diag_ggn(*problem.functional(), problem.X, problem.y, loss=problem.loss)


DEEP_CHAINS = {
    "deep_tanh_mlp": (
        lambda: nn.Sequential(
            nn.Linear(3, 5),
            nn.Tanh(),
            nn.Linear(5, 4),
            nn.Sigmoid(),
            nn.Linear(4, 4),
            nn.ELU(),
            nn.Linear(4, 3),
        ),
        (3,),
    ),
    "conv_then_mlp": (
        lambda: nn.Sequential(
            nn.Conv1d(2, 2, 2),
            nn.Tanh(),
            nn.MaxPool1d(2),
            nn.Flatten(),
            nn.Linear(8, 4),
            nn.Softplus(),
            nn.Linear(4, 3),
        ),
        (2, 9),
    ),
}


@pytest.mark.parametrize("name", list(DEEP_CHAINS))
def test_hessian_diagonals_of_deep_chains(name, monkeypatch):
    """The chain recursion (with its expansion of diagonals into columns) is exact."""
    from packfunc.engine import hessian

    def refuse(*args):
        raise AssertionError("fell back to one product per unit")

    monkeypatch.setattr(hessian, "_layer_output_curvature_by_hvp", refuse)
    torch.manual_seed(0)
    build, shape = DEEP_CHAINS[name]
    model, loss = build().double(), nn.CrossEntropyLoss()
    X, y = torch.randn(3, *shape, dtype=torch.float64), torch.tensor([0, 2, 1])
    dense = dense_curvature(model, loss, X, y)
    out = pf.compute(
        *pf.functional(model), X, y, loss=loss, quantities=("diag_hessian", "batch_diag_hessian")
    )
    _close(dense.flatten(out["diag_hessian"]), dense.hessian.diagonal(), "diag_hessian")
    _close(
        dense.flatten(out["batch_diag_hessian"], leading=1),
        dense.sample_hessian.diagonal(dim1=1, dim2=2),
        "batch_diag_hessian",
    )
