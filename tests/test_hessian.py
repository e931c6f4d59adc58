"""Hessian diagonals of non-sequential models against dense autograd Hessians (float64).

Covers each path of ``engine/hessian.py``: leaves in which the model is piecewise
affine (the GGN diagonal), linear layers used once (layer-output curvature), and the
rest (one-hot Hessian-vector products), plus the affinity check of ``engine/piecewise.py``.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import Tensor, nn

import packfunc as pf
from packfunc.engine.piecewise import piecewise_affine_leaves
from packfunc.functionalize import flatten_params
from tests.cases import Dense, assert_trees_close, dense_curvature


class Block(nn.Module):
    """conv-BN-act-conv-BN plus a skip connection (a 1×1 convolution when shapes change)."""

    def __init__(self, c_in: int, c_out: int, act: type[nn.Module], kernel: int = 3):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(c_in, c_out, kernel, padding=kernel // 2),
            nn.BatchNorm2d(c_out),
            act(),
            nn.Conv2d(c_out, c_out, 1),
            nn.BatchNorm2d(c_out),
        )
        self.skip = nn.Identity() if c_in == c_out else nn.Conv2d(c_in, c_out, 1)
        self.act = act()

    def forward(self, x: Tensor) -> Tensor:
        return self.act(self.body(x) + self.skip(x))


def resnet(act: type[nn.Module]) -> nn.Module:
    """A tiny two-block ResNet with BatchNorm in evaluation mode and a final Linear."""
    model = nn.Sequential(
        nn.Conv2d(1, 2, 3, padding=1),
        nn.BatchNorm2d(2),
        act(),
        Block(2, 2, act),
        Block(2, 3, act, kernel=1),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(3, 3),
    )
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.running_mean.uniform_(-1, 1)
                module.running_var.uniform_(0.5, 2)
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.5, 0.5)
    return model.double().eval()


class TwiceUsed(nn.Module):
    """One square weight applied twice, ``W relu(W x)``, then a Linear head."""

    def __init__(self):
        super().__init__()
        self.square = nn.Linear(3, 3)
        self.head = nn.Linear(3, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.square(torch.relu(self.square(x))))


MODELS = {
    "resnet_relu": (lambda: resnet(nn.ReLU), (1, 3, 3)),
    "resnet_tanh": (lambda: resnet(nn.Tanh), (1, 3, 3)),
    "twice_used": (lambda: TwiceUsed().double(), (3,)),
}


LOSSES = {"cross_entropy": nn.CrossEntropyLoss(), "mse_sum": nn.MSELoss(reduction="sum")}


def _problem(name: str, loss_name: str) -> tuple[nn.Module, Tensor, Tensor]:
    """Model, inputs and targets of two samples."""
    torch.manual_seed(0)
    build, shape = MODELS[name]
    model = build()
    X = torch.randn(2, *shape, dtype=torch.float64)
    with torch.no_grad():
        output = model(X)
    if loss_name == "cross_entropy":
        return model, X, torch.randint(0, output.shape[1], (2,))
    return model, X, torch.randn_like(output)


@functools.cache
def _dense(name: str, loss_name: str) -> Dense:
    """The dense oracle of a problem, shared by the tests."""
    model, X, y = _problem(name, loss_name)
    return dense_curvature(model, LOSSES[loss_name], X, y)


def _close(actual: Tensor, expected: Tensor, what: str) -> None:
    assert_trees_close(actual, expected, what, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("loss_name", list(LOSSES))
@pytest.mark.parametrize("name", list(MODELS))
def test_hessian_diagonals_match_dense_hessian(name, loss_name):
    model, X, y = _problem(name, loss_name)
    loss, dense = LOSSES[loss_name], _dense(name, loss_name)
    model_fn, params = pf.functional(model)
    out = pf.compute(
        model_fn, params, X, y, loss=loss, quantities=("diag_hessian", "batch_diag_hessian")
    )
    alone = pf.diag_hessian(model_fn, params, X, y, loss=loss)  # the loss's own products
    _close(dense.flatten(out["diag_hessian"]), dense.hessian.diagonal(), "diag_hessian")
    _close(dense.flatten(alone), dense.hessian.diagonal(), "diag_hessian alone")
    _close(
        dense.flatten(out["batch_diag_hessian"], leading=1),
        dense.sample_hessian.diagonal(dim1=1, dim2=2),
        "batch_diag_hessian",
    )


@pytest.mark.parametrize("name", list(MODELS))
def test_hessian_diagonals_of_a_subset_of_parameters(name):
    model, X, y = _problem(name, "cross_entropy")
    dense = _dense(name, "cross_entropy")
    model_fn, params = pf.functional(model)
    names = list(params)
    kept = names[::3] + names[-1:]
    subset = {k: params[k] for k in kept}
    loss = LOSSES["cross_entropy"]
    diag = pf.diag_hessian(model_fn, subset, X, y, loss=loss)
    batch = pf.batch_diag_hessian(model_fn, subset, X, y, loss=loss)
    starts = dict(zip(names, [0, *torch.tensor([p.numel() for p in params.values()]).cumsum(0)]))
    for k in kept:
        entries = slice(int(starts[k]), int(starts[k]) + params[k].numel())
        _close(diag[k].flatten(), dense.hessian.diagonal()[entries], f"diag_hessian {k}")
        _close(
            batch[k].flatten(1),
            dense.sample_hessian.diagonal(dim1=1, dim2=2)[:, entries],
            f"batch_diag_hessian {k}",
        )


def _curved_names(model: nn.Module, X: Tensor) -> set[str]:
    model_fn, params = pf.functional(model)
    leaves, treespec, names = flatten_params(params)
    flat = piecewise_affine_leaves(model_fn, leaves, treespec, X)
    return {names[i] for i in range(len(leaves)) if i not in flat}


def test_piecewise_affine_leaves_of_relu_resnet_are_all():
    assert _curved_names(resnet(nn.ReLU), torch.randn(2, 1, 3, 3, dtype=torch.float64)) == set()


def test_leaves_below_a_curved_op_or_used_twice_are_curved():
    X = torch.randn(2, 3)
    tanh_head = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 2))
    assert _curved_names(tanh_head, X) == {"0.weight", "0.bias"}
    assert _curved_names(TwiceUsed(), X) == {"square.weight"}  # W relu(W x + b) + b: affine in b
    layer_norm = nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3), nn.Linear(3, 2))
    assert _curved_names(layer_norm, X) == {"0.weight", "0.bias"}  # normalized input
    batch_norm = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.ReLU(), nn.Linear(3, 2))
    assert _curved_names(batch_norm.eval(), X) == set()
    assert _curved_names(batch_norm.train(), X) == {"0.weight", "0.bias"}  # batch statistics


def test_piecewise_affine_check_steps_aside_inside_transforms():
    """Under ``vmap`` no autograd graph can be built: the Hessian-vector paths serve."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double()
    model_fn, params = pf.functional(model)
    X, y = torch.randn(4, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 0])
    leaves, treespec, _ = flatten_params(params)
    inside = torch.func.vmap(
        lambda x: torch.tensor(len(piecewise_affine_leaves(model_fn, leaves, treespec, x)))
    )(X.unsqueeze(1))
    assert inside.tolist() == [0] * 4
    ensemble = {k: torch.stack([p, 2 * p]) for k, p in params.items()}
    stacked = torch.func.vmap(lambda p: pf.diag_hessian(model_fn, p, X, y))(ensemble)
    for member in range(2):
        alone = pf.diag_hessian(model_fn, {k: p[member] for k, p in ensemble.items()}, X, y)
        assert_trees_close({k: v[member] for k, v in stacked.items()}, alone, "ensemble member")


@pytest.mark.parametrize("name", ["diag_hessian", "batch_diag_hessian"])
def test_hessian_diagonals_of_some_parameters_carry_no_graph_to_the_others(name: str) -> None:
    """``params`` a subset of ``pf.functional``'s: the model reads the others from the
    module, where they require grad, and the result kept a graph to them; a backward pass
    through it wrote a wrong gradient into ``0.weight`` (0.72 off the third derivative; a
    probe). The others are constants (docs/conventions.md): the result is detached."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3)
    ).double()
    model_fn, params = pf.functional(model)
    X, y = torch.randn(4, 3, dtype=torch.float64), torch.randint(0, 3, (4,))
    found = getattr(pf, name)(model_fn, {"2.weight": params["2.weight"]}, X, y)["2.weight"]
    assert found.grad_fn is None and not found.requires_grad
    assert model[0].weight.requires_grad
