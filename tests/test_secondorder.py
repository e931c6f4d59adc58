"""Second-order quantities against dense torch.func GGNs and Hessians on tiny float64 models."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import packfunc as pf
from tests.cases import CASE_IDS, CASES, dense_curvature, make_loss, make_targets

SECOND_ORDER_LOSSES = ["cross_entropy", "mse", "bce_with_logits"]


def _setup(case_name: str, loss_name: str, reduction: str, n: int, seed: int = 0):
    torch.manual_seed(seed)
    case = CASES[CASE_IDS.index(case_name)]
    model = case.build().double()
    X = case.inputs(n)
    X = X.double() if X.is_floating_point() else X
    with torch.no_grad():
        y = make_targets(loss_name, model(X), case.classes)
    if loss_name not in ("cross_entropy", "nll"):
        y = y.double()
    return model, make_loss(loss_name, reduction), X, y


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-8, atol=1e-10,
                               msg=lambda m: f"{what}: {m}")


REPRESENTATIVE = ("mlp", "residual", "shared_layer", "raw_parameter", "spatial_output")
"""Cases that also run the losses other than cross-entropy."""

COMBINATIONS = [(case, loss) for case in CASE_IDS for loss in SECOND_ORDER_LOSSES
                if loss == "cross_entropy" or case in REPRESENTATIVE]


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize(("case_name", "loss_name"), COMBINATIONS)
def test_second_order_quantities_match_dense_references(case_name, loss_name, reduction, n):
    model, loss, X, y = _setup(case_name, loss_name, reduction, n)
    dense = dense_curvature(model, loss, X, y)
    model_fn, params = pf.functional(model)
    out = pf.compute(model_fn, params, X, y, loss=loss, quantities=pf.SECOND_ORDER)

    root = dense.flatten(out["sqrt_ggn"], leading=2)  # [K, N, P]
    _close(torch.einsum("knp,knq->pq", root, root), dense.ggn, "sqrt_ggn reproduces the GGN")
    _close(dense.flatten(out["diag_ggn"]), dense.ggn.diagonal(), "diag_ggn")
    _close(dense.flatten(out["batch_diag_ggn"], leading=1),
           dense.sample_ggn.diagonal(dim1=1, dim2=2), "batch_diag_ggn")
    _close(dense.flatten(out["diag_hessian"]), dense.hessian.diagonal(), "diag_hessian")
    _close(dense.flatten(out["batch_diag_hessian"], leading=1),
           dense.sample_hessian.diagonal(dim1=1, dim2=2), "batch_diag_hessian")


@pytest.mark.parametrize("case_name", ["mlp", "conv2d", "residual", "shared_layer", "lstm",
                                       "transformer", "custom_module"])
def test_curvature_vector_products(case_name):
    model, loss, X, y = _setup(case_name, "cross_entropy", "mean", 3)
    dense = dense_curvature(model, loss, X, y)
    model_fn, params = pf.functional(model)
    v = {k: torch.randn_like(p) for k, p in params.items()}
    flat_v = dense.flatten(v)
    gv = pf.ggn_vector_product(model_fn, params, X, y, v, loss=loss)
    hv = pf.hessian_vector_product(model_fn, params, X, y, v, loss=loss)
    _close(dense.flatten(gv), dense.ggn @ flat_v, "ggn_vector_product")
    _close(dense.flatten(hv), dense.hessian @ flat_v, "hessian_vector_product")


@pytest.mark.parametrize("case_name", ["mlp", "conv2d", "embedding", "raw_parameter"])
def test_subsampled_square_root_and_diagonals(case_name):
    model, loss, X, y = _setup(case_name, "cross_entropy", "mean", 5)
    model_fn, params = pf.functional(model)
    names = ("sqrt_ggn", "batch_diag_ggn", "batch_diag_hessian")
    full = pf.compute(model_fn, params, X, y, loss=loss, quantities=names)
    subset = [4, 1, 4]
    sub = pf.compute(model_fn, params, X, y, loss=loss, quantities=names, subsampling=subset)
    for name in params:
        _close(sub["sqrt_ggn"][name], full["sqrt_ggn"][name][:, subset], "sqrt_ggn")
        _close(sub["batch_diag_ggn"][name], full["batch_diag_ggn"][name][subset], "batch_diag")
        _close(sub["batch_diag_hessian"][name], full["batch_diag_hessian"][name][subset],
               "batch_diag_hessian")


def test_monte_carlo_ggn_converges_to_the_exact_one():
    model, loss, X, y = _setup("mlp", "cross_entropy", "mean", 4)
    model_fn, params = pf.functional(model)
    exact = pf.diag_ggn(model_fn, params, X, y, loss=loss)

    def error(samples: int) -> float:
        generator = torch.Generator().manual_seed(0)
        mc = pf.diag_ggn(model_fn, params, X, y, loss=loss, mc_samples=samples,
                         generator=generator)
        return max(float((mc[k] - exact[k]).abs().max() / exact[k].abs().max()) for k in exact)

    few, many = error(10), error(20_000)
    assert many < 0.05, many
    assert many < few / 5, (few, many)


@pytest.mark.parametrize("loss_name", SECOND_ORDER_LOSSES)
def test_monte_carlo_square_root_is_reproducible_and_unbiased(loss_name):
    model, loss, X, y = _setup("mlp", loss_name, "sum", 3)
    model_fn, params = pf.functional(model)

    def draw(seed: int, samples: int):
        generator = torch.Generator().manual_seed(seed)
        return pf.compute(model_fn, params, X, y, loss=loss, mc_samples=samples,
                          generator=generator, quantities=("sqrt_ggn", "batch_diag_ggn"))

    first, again = draw(7, 3), draw(7, 3)
    for name in params:
        assert first["sqrt_ggn"][name].shape == (3, 3, *params[name].shape)
        assert torch.equal(first["sqrt_ggn"][name], again["sqrt_ggn"][name])
    exact = pf.batch_diag_ggn(model_fn, params, X, y, loss=loss)
    mean = draw(1, 30_000)["batch_diag_ggn"]
    for name in params:
        scale = exact[name].abs().max()
        assert float((mean[name] - exact[name]).abs().max() / scale) < 0.05


def test_thousand_class_head_is_chunked_and_exact(monkeypatch):
    from packfunc.engine import memory

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1000)).double()
    X, y = torch.randn(4, 6, dtype=torch.float64), torch.randint(0, 1000, (4,))
    model_fn, params = pf.functional(model)
    monkeypatch.setattr(memory, "DEFAULT_BUDGET", 2**16)  # forces chunks of ~15 classes
    out = pf.compute(model_fn, params, X, y, quantities=("diag_ggn", "batch_diag_ggn"))
    # the output bias sees the loss Hessian directly: diag = Σ_n (p − p²) / N
    probs = torch.softmax(model(X), 1)
    _close(out["diag_ggn"]["2.bias"], (probs - probs**2).sum(0).detach() / 4, "bias")
    _close(out["batch_diag_ggn"]["0.weight"].sum(0), out["diag_ggn"]["0.weight"], "sum")


def test_nll_loss_is_refused_for_second_order():
    model, _, X, y = _setup("mlp", "nll", "mean", 3)
    model_fn, params = pf.functional(nn.Sequential(model, nn.LogSoftmax(1)))
    with pytest.raises(ValueError, match="CrossEntropyLoss on logits"):
        pf.diag_ggn(model_fn, params, X, y, loss=nn.NLLLoss())


DEEP_CHAINS = {
    "deep_tanh_mlp": (lambda: nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 4),
                                            nn.Sigmoid(), nn.Linear(4, 4), nn.ELU(),
                                            nn.Linear(4, 3)), (3,)),
    "conv_then_mlp": (lambda: nn.Sequential(nn.Conv1d(2, 2, 2), nn.Tanh(), nn.MaxPool1d(2),
                                            nn.Flatten(), nn.Linear(8, 4), nn.Softplus(),
                                            nn.Linear(4, 3)), (2, 9)),
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
    out = pf.compute(*pf.functional(model), X, y, loss=loss,
                     quantities=("diag_hessian", "batch_diag_hessian"))
    _close(dense.flatten(out["diag_hessian"]), dense.hessian.diagonal(), "diag_hessian")
    _close(dense.flatten(out["batch_diag_hessian"], leading=1),
           dense.sample_hessian.diagonal(dim1=1, dim2=2), "batch_diag_hessian")
