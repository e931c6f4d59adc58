"""First-order quantities against per-sample autograd loops, on every model of cases.py."""

from __future__ import annotations

import math
import pathlib
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import packfunc as pf
from packfunc.engine import batch_pass
from tests.cases import (
    LOSSES,
    assert_batch_grad_is_a_loop,
    assert_trees_close,
    autograd_batch_grad,
    make_problem,
    moments,
)

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
from memory import peak_bytes  # noqa: E402

TIGHT = {"rtol": 1e-9, "atol": 1e-11}


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("loss_name", LOSSES)
def test_all_quantities_match_autograd(case, loss_name: str, reduction: str, n: int):
    problem = make_problem(case, loss_name, reduction, n)
    model, loss, X, y = problem.model, problem.loss, problem.X, problem.y
    expected = moments(autograd_batch_grad(model, loss, X, y))
    result = pf.compute(*problem.functional(), X, y, loss=loss, quantities=pf.FIRST_ORDER)
    torch.testing.assert_close(result["loss"], loss(model(X), y))
    for quantity in pf.FIRST_ORDER:
        assert_trees_close(result[quantity], expected[quantity], f"{case.name}/{quantity}", **TIGHT)
    alone = pf.compute(*problem.functional(), X, y, loss=loss, quantities="grad")  # plain vjp
    torch.testing.assert_close(alone["loss"], result["loss"])
    assert_trees_close(alone["grad"], expected["grad"], f"{case.name}/grad alone", **TIGHT)


def test_batch_grad_sums_to_gradient(case):
    """Independent of the loop oracle: Σ_n batch_grad[n] is the autograd gradient."""
    problem = make_problem(case, n=4, seed=1)
    model, loss, X, y = problem.model, problem.loss, problem.X, problem.y
    per_sample = pf.batch_grad(*problem.functional(), X, y, loss=loss)
    grads = torch.autograd.grad(loss(model(X), y), list(model.parameters()))
    for (name, _), g in zip(model.named_parameters(), grads):
        torch.testing.assert_close(per_sample[name].sum(0), g)


@pytest.mark.parametrize(
    "function", [pf.batch_grad, pf.batch_l2_grad, pf.sum_grad_squared, pf.variance]
)
def test_single_quantity_functions_agree_with_first_order(function):
    problem = make_problem("shared_layer", n=5)
    model_fn, params = problem.functional()
    X, y, loss = problem.X, problem.y, problem.loss
    name = function.__name__
    together = pf.compute(model_fn, params, X, y, loss=loss, quantities=(name,))[name]
    assert_trees_close(function(model_fn, params, X, y, loss=loss), together, name, **TIGHT)


@pytest.mark.parametrize(
    "case",
    [
        "mlp",
        "conv2d",
        "embedding",
        "raw_parameter",
        "lstm",
        # op-local parameters: a restricted call copies a broadcast derivation (the class
        # token of the vision transformer) to its rows
        "prelu",
        "linear_solve",
        "vision_transformer",
    ],
    indirect=True,
)
def test_subsampling_selects_samples_with_batch_scaling(case):
    problem = make_problem(case, n=5)
    model_fn, params = problem.functional()
    X, y, loss = problem.X, problem.y, problem.loss
    full = pf.compute(
        model_fn,
        params,
        X,
        y,
        loss=loss,
        quantities=("batch_grad", "batch_l2_grad", "sum_grad_squared"),
    )
    subset = [3, 0, 3]
    sub = pf.compute(
        model_fn,
        params,
        X,
        y,
        loss=loss,
        subsampling=subset,
        quantities=("batch_grad", "batch_l2_grad", "sum_grad_squared"),
    )
    for name in params:
        torch.testing.assert_close(sub["batch_grad"][name], full["batch_grad"][name][subset])
        torch.testing.assert_close(sub["batch_l2_grad"][name], full["batch_l2_grad"][name][subset])
        torch.testing.assert_close(sub["sum_grad_squared"][name], full["sum_grad_squared"][name])


@pytest.mark.parametrize("chunk_size", [1, 2, 7])
@pytest.mark.parametrize("case", ["conv2d", "raw_parameter", "shared_layer", "lstm"], indirect=True)
def test_chunking_gives_identical_results(case, chunk_size: int, monkeypatch):
    problem = make_problem(case, "cross_entropy", "sum", 5)
    model_fn, params = problem.functional()
    X, y, loss = problem.X, problem.y, problem.loss
    splits: list[list[int]] = []  # per materialization: the lengths of its chunks
    original = batch_pass.split_index

    def spy(index, length):
        found = original(index, length)
        splits.append([batch_pass.index_length(chunk) for chunk in found])
        return found

    monkeypatch.setattr(batch_pass, "split_index", spy)
    reference = pf.compute(model_fn, params, X, y, loss=loss, quantities=pf.FIRST_ORDER)
    assert splits and all(lengths == [5] for lengths in splits), splits  # one chunk: all 5
    splits.clear()
    chunked = pf.compute(
        model_fn, params, X, y, loss=loss, chunk_size=chunk_size, quantities=pf.FIRST_ORDER
    )
    expected = [min(chunk_size, 5 - start) for start in range(0, 5, chunk_size)]
    assert len(expected) == math.ceil(5 / chunk_size)
    assert splits and all(lengths == expected for lengths in splits), (splits, expected)
    for quantity in pf.FIRST_ORDER:
        assert_trees_close(chunked[quantity], reference[quantity], quantity, **TIGHT)


def test_hand_written_model_fn_over_nested_pytree():
    torch.manual_seed(0)
    params = {
        "layers": [
            {"w": torch.randn(3, 4, dtype=torch.float64)},
            {"w": torch.randn(4, 2, dtype=torch.float64)},
        ],
        "b": torch.randn(2, dtype=torch.float64),
    }

    def model_fn(p, X):
        return torch.tanh(X @ p["layers"][0]["w"]) @ p["layers"][1]["w"] + p["b"]

    X, y = torch.randn(4, 3, dtype=torch.float64), torch.randint(0, 2, (4,))
    loss = nn.CrossEntropyLoss()
    result = pf.batch_grad(model_fn, params, X, y, loss=loss)
    for n in range(4):

        def loss_n(p, n=n):
            return loss(model_fn(p, X[n : n + 1]), y[n : n + 1]) / 4

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
    alone = pf.compute(model_fn, params, X, y, quantities="grad")["grad"]
    assert torch.count_nonzero(alone["unused.weight"]) == 0


def test_gradient_alone_checks_its_arguments_like_every_quantity():
    model_fn, params = pf.functional(nn.Linear(3, 2))
    X, y = torch.randn(4, 3), torch.randint(0, 2, (4,))
    with pytest.raises(ValueError, match="reduction='mean' or reduction='sum'"):
        pf.compute(
            model_fn, params, X, y, loss=nn.CrossEntropyLoss(reduction="none"), quantities="grad"
        )
    with pytest.raises(ValueError, match="4 samples"):
        pf.compute(lambda p, x: model_fn(p, x)[:2], params, X, y, quantities="grad")
    with pytest.raises(ValueError, match="chunk_size"):
        pf.compute(model_fn, params, X, y, quantities="grad", chunk_size=0)


def test_chunked_per_sample_gradients_are_written_into_one_output(monkeypatch):
    """Chunks of per-sample gradients go into one output: no second ``[N, *p]`` tensor is made
    by joining them (a spy on ``torch.cat``/``torch.stack`` sees nothing of that size)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    model_fn, params = pf.functional(model)
    X, y = torch.randn(32, 20), torch.randint(0, 3, (32,))
    expected = pf.batch_grad(model_fn, params, X, y)
    largest = 32 * max(p.numel() for p in params.values())
    joined: list[int] = []
    cat, stack = torch.cat, torch.stack

    def spy(join):
        def wrapped(*args, **kwargs):
            out = join(*args, **kwargs)
            joined.append(out.numel())
            return out

        return wrapped

    monkeypatch.setattr(torch, "cat", spy(cat))
    monkeypatch.setattr(torch, "stack", spy(stack))
    found = pf.batch_grad(model_fn, params, X, y, chunk_size=4)  # 8 chunks per leaf
    monkeypatch.undo()
    assert_trees_close(found, expected)
    assert not [n for n in joined if n >= largest], joined


@pytest.mark.parametrize("architecture", ["mlp", "cnn", "transformer"])
def test_per_sample_gradients_cost_their_size_plus_a_backward(architecture):
    """``batch_grad``'s tensors peak at most at its output's size plus 1.1× a plain
    backward's peak (CNN 1.66×, transformer 1.55× of that bound before each layer's
    per-sample gradients were formed during the backward pass, its cotangent and input
    dropped there; MLP 1.2× before chunks written into the output were made small)."""
    torch.manual_seed(0)
    if architecture == "mlp":
        model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
        X, y = torch.randn(1024, 64), torch.randint(0, 10, (1024,))
    elif architecture == "cnn":
        model = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 16, 3, padding=1),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(16 * 8 * 8, 10),
        )
        X, y = torch.randn(64, 3, 8, 8), torch.randint(0, 10, (64,))
    else:
        layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
        model = nn.Sequential(nn.Embedding(50, 32), layer, nn.Flatten(), nn.Linear(32 * 16, 10))
        X, y = torch.randint(0, 50, (64, 16)), torch.randint(0, 10, (64,))
    model_fn, params = pf.functional(model)
    output = len(X) * sum(p.numel() for p in params.values()) * 4

    def plain():
        nn.functional.cross_entropy(model(X), y).backward()
        model.zero_grad(set_to_none=True)

    found = peak_bytes(lambda: pf.batch_grad(model_fn, params, X, y))
    assert found <= output + 1.1 * peak_bytes(plain)


@pytest.mark.parametrize("case", ["norms_and_scales", "conv2d", "prelu"], indirect=True)
def test_subsampling_one_sample_twice(case):
    """``subsampling=[0, 0]`` of a batch of one: a norm layer's op-local call kept its input
    at one row beside cotangents of two (torch's shape error)."""
    problem = make_problem(case, n=1)
    model_fn, params = problem.functional()
    X, y, loss = problem.X, problem.y, problem.loss
    full = pf.batch_grad(model_fn, params, X, y, loss=loss)
    twice = pf.batch_grad(model_fn, params, X, y, loss=loss, subsampling=[0, 0])
    for name in params:
        torch.testing.assert_close(twice[name], full[name][[0, 0]])


@pytest.mark.parametrize("case", ["mlp", "conv2d", "embedding", "transformer"], indirect=True)
@pytest.mark.parametrize(
    "quantity", ["batch_grad", "batch_l2_grad", "sqrt_ggn", "batch_diag_ggn", "batch_diag_hessian"]
)
def test_no_samples_subsampled_gives_empty_per_sample_results(case, quantity):
    """``subsampling=[]`` (BackPACK's extensions accept it): no rows, each shaped as one's."""
    problem = make_problem(case, n=3)
    model_fn, params = problem.functional()
    compute = getattr(pf, quantity)
    args = (model_fn, params, problem.X, problem.y)
    one = compute(*args, loss=problem.loss, subsampling=[0])
    none = compute(*args, loss=problem.loss, subsampling=[])
    dim = 1 if quantity == "sqrt_ggn" else 0
    for name in params:
        expected = list(one[name].shape)
        expected[dim] = 0
        assert list(none[name].shape) == expected


def test_an_eval_batch_norm_of_one_channel_gives_each_sample_its_own_gradient():
    """``BatchNorm1d(1)`` in eval mode on ``[N, 1]``: its running statistics expanded over
    the samples have stride 0, and torch's kernel read past them: sample 0's weight gradient
    was unwritten memory (5e-311), sample 1's sometimes too."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm1d(1), nn.Linear(1, 3)).double()
    model[0].running_mean.normal_()
    model[0].running_var.uniform_(0.5, 2)
    model.eval()
    X, y = torch.randn(5, 1, dtype=torch.float64), torch.tensor([0, 1, 2, 0, 1])
    assert_batch_grad_is_a_loop(*pf.functional(model), X, y)


def _central_differences(model: nn.Module, X, y, loss, param: torch.Tensor) -> torch.Tensor:
    """The loss's gradient in ``param`` by central differences (float64 models)."""
    found, step = torch.zeros_like(param), 1e-6
    for j in range(param.numel()):
        with torch.no_grad():
            param.view(-1)[j] += step
            up = loss(model(X), y)
            param.view(-1)[j] -= 2 * step
            down = loss(model(X), y)
            param.view(-1)[j] += step
        found.view(-1)[j] = (up - down) / (2 * step)
    return found


class _TransposedNorms(nn.Module):
    """A 1×1 conv, two eval BatchNorm2d, then ``reshape`` and ``transpose``: for one sample
    the norms' backward receives a gradient in channels-last strides."""

    def __init__(self, first: nn.Module, second: nn.Module) -> None:
        super().__init__()
        self.conv, self.first, self.second = nn.Conv2d(2, 2, 1), first, second

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.second(self.first(self.conv(x)))
        return h.reshape(h.shape[0], 2, 6).transpose(1, 2).mean(1)


@pytest.mark.parametrize("affine", [(True, True), (True, False), (False, False)])
def test_batch_norms_before_a_transpose_take_their_gradients_in_a_contiguous_layout(affine):
    """Two eval BatchNorm2d, then ``reshape`` and ``transpose``, one sample: torch's kernel
    reads a gradient in channels-last strides wrongly (plain autograd and torch.func give
    the wrong value here); packfunc's pass handed it such a gradient (0.0099 against 0.0023
    by central differences). It hands it a contiguous one, also where a BatchNorm has no
    parameters (``affine=False``: its call was not seen, and the conv's gradients came out
    as zeros against 0.33 and -0.43)."""
    torch.manual_seed(0)
    model = _TransposedNorms(*(nn.BatchNorm2d(2, affine=a) for a in affine)).double()
    for norm in (model.first, model.second):
        norm.running_mean.normal_()
        norm.running_var.uniform_(0.5, 2)
        if norm.affine:
            with torch.no_grad():
                norm.weight.normal_()
                norm.bias.normal_()
    model.eval()
    X, y = torch.randn(1, 2, 2, 3, dtype=torch.float64), torch.tensor([1])
    loss = nn.CrossEntropyLoss(reduction="sum")
    found = pf.batch_grad(*pf.functional(model), X, y, loss=loss)
    for name, param in model.named_parameters():
        central = _central_differences(model, X, y, loss, param)
        torch.testing.assert_close(found[name][0], central, rtol=1e-6, atol=1e-8)


class _OneSampleRunningStatistics(nn.BatchNorm1d):
    """In training mode, normalizes one sample alone with the running statistics (a common
    guard: a batch of one has no variance), a larger batch with its own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and x.shape[0] == 1:
            return nn.functional.batch_norm(
                x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps
            )
        return super().forward(x)


def test_a_refused_training_batch_norm_leaves_the_running_statistics_as_they_were():
    """Discovery (on one sample) sees the running statistics, the batch its own statistics:
    the refusal comes before the batch's BatchNorm updates a running statistic."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), _OneSampleRunningStatistics(3), nn.Linear(3, 3))
    model = model.double().train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model_fn, params = pf.functional(model)
    X, y = torch.randn(5, 4, dtype=torch.float64), torch.tensor([0, 1, 2, 0, 1])
    with pytest.raises(ValueError, match="BatchNorm in training mode"):
        pf.clipped_grad(
            model_fn, params, X, y, loss=nn.CrossEntropyLoss(reduction="sum"), max_norm=1.0
        )
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


class _StandardizedConv(nn.Conv2d):
    """timm's ``StdConv2d``: the weight standardized by a training-mode ``F.batch_norm`` of
    the weight itself (BiT's ResNetV2, NFNets' scaled form)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = F.batch_norm(
            self.weight.reshape(1, self.out_channels, -1),
            None,
            None,
            training=True,
            momentum=0.0,
            eps=1e-6,
        ).reshape_as(self.weight)
        return F.conv2d(x, weight, self.bias, self.stride, self.padding)


def test_weight_standardization_by_a_batch_norm_of_the_weight():
    """A training-mode BatchNorm of a parameter normalizes no samples: it was refused as
    BatchNorm in training mode (a probe). Per-sample gradients equal a loop's."""
    torch.manual_seed(0)
    model = nn.Sequential(
        _StandardizedConv(2, 3, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(48, 2)
    ).double()
    X, y = torch.randn(3, 2, 4, 4, dtype=torch.float64), torch.tensor([0, 1, 1])
    loss = nn.CrossEntropyLoss(reduction="sum")
    found = pf.batch_grad(*pf.functional(model), X, y, loss=loss)
    assert_trees_close(found, autograd_batch_grad(model, loss, X, y))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_variance_of_agreeing_samples_is_zero_not_negative(dtype: torch.dtype) -> None:
    """``mean(g²) − mean(g)²`` rounds below zero where the samples agree (``-3e-8`` in
    float32 for one sample, or three identical ones; a probe): a variance is never negative."""
    torch.manual_seed(0)
    model_fn, params = pf.functional(
        torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3)).to(dtype)
    )
    for X in (torch.randn(1, 5, dtype=dtype), torch.randn(1, 5, dtype=dtype).expand(3, 5)):
        y = torch.zeros(len(X), dtype=torch.long)
        for value in pf.variance(model_fn, params, X, y).values():
            assert bool((value >= 0).all())
            torch.testing.assert_close(value, torch.zeros_like(value), atol=1e-6, rtol=0)
