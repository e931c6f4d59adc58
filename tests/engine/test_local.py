"""Op-local paths: parameters outside linear-like ops, derivations, explain, frozen parts."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.cases import (
    Dense,
    LinearSolve,
    assert_batch_grad_is_a_loop,
    assert_trees_close,
    autograd_batch_grad,
    dense_curvature,
)
from tests.test_properties import SETTINGS
from torch import Tensor, nn

import packfunc as pf
from packfunc.engine import batch_pass, decompositions, modes
from packfunc.engine.rules import local as local_rule


class Derived(nn.Module):
    """Parameters that reach the samples only through tensors computed from them."""

    def __init__(self):
        super().__init__()
        self.direction = nn.Parameter(torch.randn(6, 4))  # weight-normalized linear
        self.gain = nn.Parameter(torch.randn(6, 1))
        self.packed = nn.Parameter(torch.randn(8, 6))  # split in two, used transposed
        self.offset = nn.Parameter(torch.randn(4))  # copied over the batch with expand
        self.pos = nn.Parameter(torch.randn(7, 4))  # sliced to the sequence length
        self.head = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = x + self.pos[: x.shape[1]] + self.offset.expand(x.shape[0], x.shape[1], 4)
        h = F.linear(h, self.gain * self.direction / self.direction.norm(dim=1, keepdim=True))
        first, second = self.packed.split(4)
        h = torch.tanh(h @ first.T) * (h @ second.t())
        return self.head(h.mean(1))


def _diagonal(dense: Dense) -> dict[str, Tensor]:
    """The dense GGN's diagonal, by parameter name."""
    parts = dense.ggn.diagonal().split([shape.numel() for shape in dense.shapes])
    return {n: part.view(s) for n, part, s in zip(dense.names, parts, dense.shapes)}


def _problem(model: nn.Module, X: Tensor, classes: int = 3):
    torch.manual_seed(1)
    model = model.double()
    X = X.double() if X.is_floating_point() else X
    y = torch.randint(0, classes, (X.shape[0],))
    return model, X, y, nn.CrossEntropyLoss()


def test_derivations_are_local_and_exact():
    torch.manual_seed(0)
    model, X, y, loss = _problem(Derived(), torch.randn(3, 5, 4))
    model_fn, params = pf.functional(model)
    paths = pf.explain(model_fn, params, X)
    assert all(not path.startswith("whole model") for path in paths.values()), paths
    expected = autograd_batch_grad(model, loss, X, y)
    out = pf.compute(model_fn, params, X, y, loss=loss, quantities=("batch_grad", "batch_l2_grad"))
    assert_trees_close(out["batch_grad"], expected, "batch_grad")
    norms = {k: g.flatten(1).square().sum(1) for k, g in expected.items()}
    assert_trees_close(out["batch_l2_grad"], norms, "batch_l2_grad")
    diag = pf.diag_ggn(model_fn, params, X, y, loss=loss)
    assert_trees_close(diag, _diagonal(dense_curvature(model, loss, X, y)), "diag_ggn")


class Added(nn.Module):
    """Parameters added to or subtracted from the samples, broadcast over them."""

    def __init__(self):
        super().__init__()
        self.position = nn.Parameter(torch.randn(5, 4))
        self.shift = nn.Parameter(torch.randn(1, 5, 4))
        self.row = nn.Parameter(torch.randn(4))
        self.offset = nn.Parameter(torch.randn(5, 1))
        self.level = nn.Parameter(torch.randn(()))
        self.head = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(x + self.position)
        h = torch.tanh(torch.add(h, self.shift, alpha=2.0))
        h = torch.tanh(self.row - h)  # the parameter first: its sign is +1
        h = torch.tanh(torch.sub(h, self.offset, alpha=0.5))
        h = h.add(self.level)
        return self.head(h.mean(1))


@pytest.mark.parametrize("n", [1, 3])
def test_added_parameters_have_a_closed_form(n):
    torch.manual_seed(0)
    model, X, y, loss = _problem(Added(), torch.randn(n, 5, 4))
    model_fn, params = pf.functional(model)
    paths = pf.explain(model_fn, params, X)
    assert {paths[k] for k in ("position", "shift", "row", "offset", "level")} == {
        "closed form (add)",
        "closed form (sub)",
    }, paths
    expected = autograd_batch_grad(model, loss, X, y)
    quantities = ("batch_grad", "sum_grad_squared")
    out = pf.compute(model_fn, params, X, y, loss=loss, quantities=quantities)
    assert_trees_close(out["batch_grad"], expected, "batch_grad")
    squares = {k: g.square().sum(0) for k, g in expected.items()}
    assert_trees_close(out["sum_grad_squared"], squares, "sum_grad_squared")
    summed = nn.CrossEntropyLoss(reduction="sum")
    clipped = pf.clipped_grad(model_fn, params, X, y, loss=summed, max_norm=0.1)
    per_sample = pf.clip_per_sample(autograd_batch_grad(model, summed, X, y), 0.1)
    assert_trees_close(clipped, {k: g.sum(0) for k, g in per_sample.items()}, "clipped_grad")


def _check_closed_forms(monkeypatch, model: nn.Module, X: Tensor, y: Tensor, loss) -> None:
    """Per-sample quantities and the clipped sum equal autograd's, with the op-local vjp refused."""
    model_fn, params = pf.functional(model)

    def refused(*args, **kwargs):
        raise AssertionError("the op-local vjp ran where a closed form applies")

    monkeypatch.setattr(local_rule.LocalRule, "columns", refused)
    expected = autograd_batch_grad(model, loss, X, y)
    quantities = ("batch_grad", "sum_grad_squared", "batch_l2_grad")
    out = pf.compute(model_fn, params, X, y, loss=loss, quantities=quantities)
    assert_trees_close(out["batch_grad"], expected, "batch_grad")
    squares = {k: g.square().sum(0) for k, g in expected.items()}
    assert_trees_close(out["sum_grad_squared"], squares, "sum_grad_squared")
    norms = {k: g.reshape(len(g), -1).square().sum(1) for k, g in expected.items()}
    assert_trees_close(out["batch_l2_grad"], norms, "batch_l2_grad")
    summed = nn.CrossEntropyLoss(reduction="sum")
    clipped = pf.clipped_grad(model_fn, params, X, y, loss=summed, max_norm=0.1)
    per_sample = pf.clip_per_sample(autograd_batch_grad(model, summed, X, y), 0.1)
    assert_trees_close(clipped, {k: g.sum(0) for k, g in per_sample.items()}, "clipped_grad")


class AddedDerived(nn.Module):
    """Operands computed from one parameter each, added to the samples (a position table)."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(7, 4))  # looked up at arange(T): Hugging Face's wpe
        self.pos = nn.Parameter(torch.randn(9, 4))  # sliced, and subtracted with a scale
        self.log_scale = nn.Parameter(torch.randn(5, 1))  # exp, broadcast over features
        self.head = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        positions = torch.arange(x.shape[1]).unsqueeze(0)
        h = torch.tanh(x + F.embedding(positions, self.table))
        h = torch.tanh(torch.sub(h, self.pos[: x.shape[1]], alpha=0.5))
        h = torch.tanh(self.log_scale.exp() + h)
        return self.head(h.mean(1))


class Multiplied(nn.Module):
    """Scales multiplied with the samples: an RMSNorm written by hand, and others."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4))  # Hugging Face's LlamaRMSNorm: weight * h
        self.gain = nn.Parameter(torch.randn(5, 1))  # the parameter first, broadcast over features
        self.log_gain = nn.Parameter(torch.randn(1, 5, 4))  # derived (exp), one row for all
        self.level = nn.Parameter(torch.randn(()))
        self.head = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        h = torch.tanh(self.weight * h)
        h = torch.tanh(self.gain.mul(h))
        h = torch.tanh(torch.mul(h, self.log_gain.exp()))
        h = h * self.level
        return self.head(h.mean(1))


@pytest.mark.parametrize("n", [1, 3])
def test_multiplied_parameters_have_a_closed_form(monkeypatch, n):
    torch.manual_seed(0)
    model, X, y, loss = _problem(Multiplied(), torch.randn(n, 5, 4))
    model_fn, params = pf.functional(model)
    paths = pf.explain(model_fn, params, X)
    assert {paths[k] for k in ("weight", "gain", "log_gain", "level")} == {"closed form (mul)"}
    _check_closed_forms(monkeypatch, model, X, y, loss)


class Products(nn.Module):
    """A scale broadcast over a new dim of the samples, and a product of two parameters."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(5, 4))  # x [N, 1, 4] times it: [N, 5, 4]
        self.a = nn.Parameter(torch.randn(4))
        self.b = nn.Parameter(torch.randn(4))
        self.head = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = (x.unsqueeze(1) * self.scale).tanh()
        return self.head((h * (self.a * self.b)).mean(1))


def test_explain_says_which_products_take_the_closed_form():
    torch.manual_seed(0)
    model, X, y, loss = _problem(Products(), torch.randn(3, 4))
    model_fn, params = pf.functional(model)
    paths = pf.explain(model_fn, params, X)
    assert paths["scale"] == "closed form (mul)"
    assert paths["a"] == paths["b"] == "op-local (mul)"  # two parameters in one operand
    expected = autograd_batch_grad(model, loss, X, y)
    assert_trees_close(pf.batch_grad(model_fn, params, X, y, loss=loss), expected, "batch_grad")


class Prompted(nn.Module):
    """Rows of parameters copied over the batch and concatenated with it (prompt, registers)."""

    def __init__(self):
        super().__init__()
        self.prompt = nn.Parameter(torch.randn(1, 2, 4))  # prompt tuning: before the tokens
        self.registers = nn.Parameter(torch.randn(3, 4))  # after them, along dim -2
        self.head = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        n = x.shape[0]
        h = torch.cat([self.prompt.expand(n, -1, -1), x], dim=1)
        h = torch.tanh(torch.cat((h, self.registers.expand(n, 3, 4)), -2))
        return self.head((h * torch.arange(1.0, 11.0).view(10, 1)).mean(1))


class Divided(nn.Module):
    """Parameters dividing the samples (temperatures) or divided by them."""

    def __init__(self):
        super().__init__()
        self.temperature = nn.Parameter(torch.tensor(1.5))
        self.log_scale = nn.Parameter(torch.randn(5, 1))  # derived (exp), broadcast over features
        self.numerator = nn.Parameter(torch.randn(4))
        self.head = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(x / self.temperature)
        h = torch.tanh(torch.div(h, self.log_scale.exp()))
        h = torch.tanh(self.numerator.div(h.square() + 1))
        return self.head(h.mean(1))


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("module", [AddedDerived, Prompted, Divided])
def test_added_divided_or_concatenated_parameters_have_a_closed_form(monkeypatch, module, n):
    torch.manual_seed(0)
    model, X, y, loss = _problem(module(), torch.randn(n, 5, 4))
    _check_closed_forms(monkeypatch, model, X, y, loss)


class AddedAlone(nn.Module):
    """One parameter of a given shape added to (or subtracted from) ``[N, 3, 4]`` inputs."""

    def __init__(self, shape: tuple[int, ...], func, first: bool, alpha: float | None):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(shape))
        self.func, self.first, self.alpha = func, first, alpha
        self.head = nn.Linear(12, 3)

    def forward(self, x: Tensor) -> Tensor:
        pair = (self.weight, x) if self.first else (x, self.weight)
        kwargs = {} if self.alpha is None else {"alpha": self.alpha}
        return self.head(torch.tanh(self.func(*pair, **kwargs)).flatten(1))


@settings(SETTINGS, max_examples=25)
@given(
    shape=st.sampled_from([(4,), (1, 4), (3, 4), (3, 1), (1, 3, 4), (1, 1, 1), ()]),
    func=st.sampled_from([torch.add, torch.sub, Tensor.add, Tensor.sub]),
    first=st.booleans(),
    alpha=st.sampled_from([None, 2.0, -0.5]),
    n=st.integers(1, 3),
)
def test_added_parameter_property(shape, func, first, alpha, n):
    torch.manual_seed(0)
    model, X, y, loss = _problem(AddedAlone(shape, func, first, alpha), torch.randn(n, 3, 4))
    model_fn, params = pf.functional(model)
    assert pf.explain(model_fn, params, X)["weight"].startswith("closed form")
    expected = autograd_batch_grad(model, loss, X, y)
    assert_trees_close(pf.batch_grad(model_fn, params, X, y, loss=loss), expected, "batch_grad")


def test_explain_names_each_path():
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(3, 4)
            self.norm = nn.LayerNorm(4)
            self.scale = nn.Parameter(torch.ones(4))
            self.time_major = nn.Parameter(torch.randn(4, 4))
            self.unused = nn.Parameter(torch.zeros(2))

        def forward(self, x: Tensor) -> Tensor:
            h = torch.maximum(self.norm(self.linear(x)), self.scale)
            return (self.time_major @ h.T).T

    model_fn, params = pf.functional(Mixed())
    paths = pf.explain(model_fn, params, torch.randn(5, 3))
    assert paths["linear.weight"] == "closed form (F.linear)"
    assert paths["norm.bias"] == "closed form (layer_norm)"
    assert paths["scale"] == "op-local (maximum)"
    assert paths["time_major"].startswith("whole model: used by matmul")
    assert paths["unused"] == "unused"


def test_rows_of_a_parameter_per_sample_are_refused():
    weights = {"rows": torch.randn(4, 3, dtype=torch.float64)}

    def model_fn(params, X):  # sample n meets row n: depends on its place in the batch
        return X * params["rows"][: X.shape[0]]

    X, y = torch.randn(4, 3, dtype=torch.float64), torch.randint(0, 3, (4,))
    with pytest.raises(ValueError, match="differently for different batch sizes"):
        pf.batch_grad(model_fn, weights, X, y)


class _Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(7, 4)
        self.rnn = nn.LSTM(4, 5, batch_first=True)
        self.head = nn.Linear(5, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.rnn(self.embed(x))[0][:, -1])


@functools.cache
def _recurrent_problem() -> tuple[nn.Module, Tensor, Tensor, nn.Module, dict[str, Tensor]]:
    torch.manual_seed(0)
    model, X, y, loss = _problem(_Recurrent(), torch.randint(0, 7, (4, 6)))
    return model, X, y, loss, _diagonal(dense_curvature(model, loss, X, y))


@pytest.mark.parametrize("requested", ["head", "embed+head", "all"])
def test_recurrent_layers_are_decomposed_only_when_requested(monkeypatch, requested):
    model, X, y, loss, dense = _recurrent_problem()
    model_fn, params = pf.functional(model)
    prefixes = {"head": ("head",), "embed+head": ("embed", "head"), "all": ("",)}[requested]
    chosen = {k: v for k, v in params.items() if k.startswith(prefixes)}
    decomposed: list[object] = []
    original = modes.run_recurrent
    monkeypatch.setattr(modes, "run_recurrent", lambda *a: decomposed.append(a) or original(*a))
    grads = pf.batch_grad(model_fn, chosen, X, y, loss=loss)
    assert bool(decomposed) == (requested == "all")
    expected = autograd_batch_grad(model, loss, X, y)
    assert_trees_close(grads, {k: expected[k] for k in chosen})
    diag = pf.diag_ggn(model_fn, chosen, X, y, loss=loss)
    assert_trees_close(diag, {k: v for k, v in dense.items() if k in chosen}, "diag_ggn")


NORMS = {
    "layer": lambda c: nn.LayerNorm([c, 3]),
    "rms": lambda c: nn.RMSNorm(3),
    "group": lambda c: nn.GroupNorm(1 if c == 1 else 2, c),
    "instance": lambda c: nn.InstanceNorm1d(c, affine=True),
    "batch_eval": lambda c: nn.BatchNorm1d(c),
    "instance_running": lambda c: nn.InstanceNorm1d(c, affine=True, track_running_stats=True),
}


@settings(SETTINGS, max_examples=12)
@given(
    norm=st.sampled_from(sorted(NORMS)),
    channels=st.sampled_from([1, 2, 4]),
    n=st.integers(1, 3),
    double=st.booleans(),
    reduction=st.sampled_from(["mean", "sum"]),
)
def test_norm_affine_closed_forms(norm, channels, n, double, reduction):
    torch.manual_seed(0)
    layer = NORMS[norm](channels)
    if norm in ("batch_eval", "instance_running"):
        layer.running_mean.uniform_(-1, 1)
        layer.running_var.uniform_(0.5, 2)
    with torch.no_grad():
        for p in layer.parameters():
            p.uniform_(-1, 1)
    model = nn.Sequential(
        nn.Conv1d(2, channels, 2), layer, nn.Flatten(), nn.Linear(3 * channels, 2)
    )
    model = model.eval().to(torch.float64 if double else torch.float32)
    X = torch.randn(n, 2, 4, dtype=next(model.parameters()).dtype)
    y, loss = torch.randint(0, 2, (n,)), nn.CrossEntropyLoss(reduction=reduction)
    model_fn, params = pf.functional(model)
    assert pf.explain(model_fn, params, X)["1.weight"].startswith("closed form")
    got = pf.compute(model_fn, params, X, y, loss=loss, quantities=("batch_grad", "variance"))
    expected = autograd_batch_grad(model, loss, X, y)
    tolerance = {} if double else {"atol": 1e-5, "rtol": 1e-4}
    assert_trees_close(got["batch_grad"], expected, "batch_grad", **tolerance)
    variance = {k: g.square().mean(0) - g.mean(0).square() for k, g in expected.items()}
    assert_trees_close(got["variance"], variance, "variance", **tolerance)


CHANNEL_NORMS = {
    "batch_eval": (F.batch_norm, lambda s: (s[0], s[1], None, None, False, 0.1, 1e-3)),
    "batch_train": (F.batch_norm, lambda s: (None, None, None, None, True)),
    "group": (F.group_norm, lambda s: (2, None, None, 1e-4)),
    "instance": (F.instance_norm, lambda s: ()),
    "instance_running": (F.instance_norm, lambda s: (s[0], s[1], None, None, False)),
}


@pytest.mark.parametrize("norm", sorted(CHANNEL_NORMS))
@pytest.mark.parametrize(
    ("shape", "layout"),
    [((3, 4), "contiguous"), ((3, 4, 5), "contiguous"), ((2, 4, 3, 3), "channels_last")],
)
def test_channel_norm_weight_columns_are_fused_and_exact(norm, shape, layout):
    """The fused weight columns of batch/group/instance norm equal per-sample autograd."""
    from packfunc.engine.local import CallArguments, LocalInputs
    from packfunc.engine.rules.norm import NORM_RULES, _fused_weight_columns

    if norm.startswith("instance") and len(shape) == 2:
        pytest.skip("instance norm needs positions")
    torch.manual_seed(0)
    func, arguments = CHANNEL_NORMS[norm]
    x = torch.randn(shape, dtype=torch.float64)
    if layout == "channels_last":
        x = x.to(memory_format=torch.channels_last)
    channels = shape[1]
    stats = (torch.randn(channels, dtype=x.dtype), torch.rand(channels, dtype=x.dtype) + 0.5)
    weight, bias = torch.randn(channels, dtype=x.dtype), torch.randn(channels, dtype=x.dtype)
    args = [x, *arguments(stats)]
    position = {F.batch_norm: 3, F.group_norm: 2, F.instance_norm: 3}[func]
    args += [None] * (position + 2 - len(args))
    args[position], args[position + 1] = weight, bias
    local = LocalInputs(
        func,
        CallArguments.of(tuple(args), {}),
        {position: 0, position + 1: 1},
        (0,),
        frozenset(),
        {0: weight, 1: bias},
    )
    g = torch.randn(3, *shape, dtype=x.dtype)
    assert _fused_weight_columns(local, g) is not None
    got = NORM_RULES[func].columns(local, g, None, weight)

    w = weight.clone().requires_grad_()
    # from a contiguous input: torch 2.13's group-norm backward crashes on a channels_last one
    # with a contiguous gradient
    out = func(*[w if a is weight else a.contiguous() if a is x else a for a in args])
    expected = torch.stack(
        [
            torch.stack(
                [
                    torch.autograd.grad(out[i], w, g[k, i], retain_graph=True)[0]
                    for i in range(shape[0])
                ]
            )
            for k in range(3)
        ]
    )
    torch.testing.assert_close(got, expected)


def test_the_shim_reuses_the_forward_of_models_with_norms(monkeypatch):
    from packfunc.compat import backpack, extend
    from packfunc.compat.extensions import BatchGrad, DiagGGNExact

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(3, 4), nn.LayerNorm(4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2)
    )
    model = model.double().eval()
    X, y = torch.randn(5, 3, dtype=torch.float64), torch.randint(0, 2, (5,))
    expected = autograd_batch_grad(model, nn.CrossEntropyLoss(), X, y)
    diagonal = _diagonal(dense_curvature(model, nn.CrossEntropyLoss(), X, y))
    own_passes: list[object] = []
    original = batch_pass.record
    monkeypatch.setattr(batch_pass, "record", lambda *a: own_passes.append(a) or original(*a))
    extended, loss = extend(model), extend(nn.CrossEntropyLoss())
    with backpack(BatchGrad(), DiagGGNExact()):
        loss(extended(X), y).backward()
    assert not own_passes
    params = dict(extended.named_parameters())
    assert_trees_close({k: p.grad_batch for k, p in params.items()}, expected)
    assert_trees_close({k: p.diag_ggn_exact for k, p in params.items()}, diagonal)


def test_a_python_number_read_from_a_parameter_is_a_constant():
    weights = {"w": torch.randn(3, 2, dtype=torch.float64), "scale": torch.ones(())}

    def model_fn(params, X):  # .item() leaves autograd: the scale gets no gradient
        return (X @ params["w"]) * params["scale"].item()

    X, y = torch.randn(4, 3, dtype=torch.float64), torch.randint(0, 2, (4,))
    grads = pf.batch_grad(model_fn, weights, X, y)
    torch.testing.assert_close(grads["scale"], torch.zeros(4))
    expected = torch.stack(
        [
            torch.func.grad(
                lambda w, i=i: nn.functional.cross_entropy(X[i : i + 1] @ w, y[i : i + 1]) / 4
            )(weights["w"])
            for i in range(4)
        ]
    )
    torch.testing.assert_close(grads["w"], expected)


def test_normalizing_again_leaves_the_running_statistics_alone():
    """``x̂`` of a batch norm in training (the unfused path: other dtypes, transforms) uses
    the batch's statistics without updating the running ones a second time."""
    from packfunc.engine.local import CallArguments, LocalInputs
    from packfunc.engine.rules.norm import _normalized

    x, mean, var = torch.randn(4, 3, 5), torch.zeros(3), torch.ones(3)
    weight, bias = torch.ones(3), torch.zeros(3)
    arguments = CallArguments.of((x, mean, var, weight, bias, True), {})
    local = LocalInputs(
        F.batch_norm, arguments, {3: 0, 4: 1}, (0,), frozenset(), {0: weight, 1: bias}
    )
    torch.testing.assert_close(_normalized(local), F.batch_norm(x, None, None, training=True))
    assert torch.equal(mean, torch.zeros(3)) and torch.equal(var, torch.ones(3))


class _RadialBasis(nn.Module):
    """Learned centres compared with ``torch.cdist`` (an RBF network)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner, self.head = nn.Linear(3, 2), nn.Linear(5, 3)
        self.centres = nn.Parameter(torch.randn(5, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.exp(-torch.cdist(self.inner(x), self.centres).square()))


class _SignedScale(nn.Module):
    """A scale that also decides a sign through ``torch.where``'s condition."""

    def __init__(self) -> None:
        super().__init__()
        self.inner, self.head = nn.Linear(3, 4), nn.Linear(4, 3)
        self.scale = nn.Parameter(torch.rand(4) * 0.5 + 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inner(x)
        return self.head(torch.where(self.scale > 0.3, h, -h) * self.scale)


@pytest.mark.parametrize("budget", [None, 8])  # 8 elements: one column at a time
@pytest.mark.parametrize("n", [3, 4])  # 3 = the number of classes: the columns' count
@pytest.mark.parametrize("layer", ["cdist", "prelu", "where"])
def test_local_ops_whose_nested_batching_rules_are_wrong_give_exact_ggn_diagonals(
    layer, n, budget, monkeypatch
):
    """torch's rules for prelu's, cdist's and where's backward, vmapped over samples and then
    over columns, mixed the two levels (where: an error when the columns were not as many as
    the samples): wrong where the columns were as many as the samples
    (2e-3 off entries of 7e-3 for PReLU, 0.1 off 0.12 for the centres), an error otherwise.
    Against the dense GGN ``Σ_n J_nᵀ H_n J_n`` (the Hessian of cdist has no second
    derivative in torch: not compared)."""
    if budget is not None:
        monkeypatch.setattr(local_rule, "DEFAULT_BUDGET", budget)
    torch.manual_seed(0)
    models = {
        "cdist": _RadialBasis,
        "prelu": lambda: nn.Sequential(nn.Linear(3, 4), nn.PReLU(4), nn.Linear(4, 3)),
        "where": _SignedScale,
    }
    model = models[layer]().double()
    X, y = torch.randn(n, 3, dtype=torch.float64), torch.randint(0, 3, (n,))
    model_fn, params = pf.functional(model)
    loss = nn.CrossEntropyLoss()
    flat = torch.cat([p.detach().reshape(-1) for p in params.values()])
    sizes = [p.numel() for p in params.values()]

    def output(vector: torch.Tensor) -> torch.Tensor:
        tensors = [t.view_as(p) for t, p in zip(vector.split(sizes), params.values())]
        return model_fn(dict(zip(params, tensors)), X)

    jac = torch.autograd.functional.jacobian(output, flat).reshape(n, 3, -1)
    logits = output(flat).detach()
    h_out = torch.autograd.functional.hessian(lambda o: loss(o, y), logits).reshape(n, 3, n, 3)
    ggn = sum(jac[i].T @ h_out[i, :, i] @ jac[i] for i in range(n))
    expected = dict(zip(params, ggn.diagonal().split(sizes)))
    found = pf.diag_ggn(model_fn, params, X, y, loss=loss)
    for name, value in found.items():
        torch.testing.assert_close(value.reshape(-1), expected[name], msg=name)


def test_op_local_columns_that_do_not_add_up_to_the_batch_gradient_are_refused(monkeypatch):
    """torch's rule for ``linalg.solve``'s backward of a broadcast matrix, without packfunc's
    decomposition, gives columns whose sum is 0.0175 off the batch's vjp (entries of 0.11):
    refused, naming the op, instead of returned."""
    monkeypatch.delitem(decompositions.DECOMPOSED_OPS, torch.linalg.solve)
    torch.manual_seed(0)
    model = LinearSolve().double()
    X, y = torch.randn(1, 3, dtype=torch.float64), torch.tensor([1])
    model_fn, params = pf.functional(model)
    with pytest.raises(RuntimeError, match="through linalg_solve do not add up"):
        pf.diag_ggn(model_fn, params, X, y)


def test_an_op_whose_form_depends_on_its_row_count_runs_for_any_batch_size():
    """``torch.cdist`` picks its Euclidean form by row count (more than 25: products): a
    decomposition of it that did the same called other ops for one sample than for a batch
    of 30 (refused, where the op itself is exact)."""
    torch.manual_seed(0)
    model = _RadialBasis().double()
    X, y = torch.randn(30, 3, dtype=torch.float64), torch.randint(0, 3, (30,))
    model_fn, params = pf.functional(model)
    found = pf.batch_grad(model_fn, params, X, y)
    assert_trees_close(found, autograd_batch_grad(model, nn.CrossEntropyLoss(), X, y))


class _SpectralFilter(nn.Module):
    """A learned complex filter on a sequence's spectrum (GFNet): a real parameter viewed as
    complex multiplies (or divides, or is divided by) the batched spectrum."""

    def __init__(self, op: str) -> None:
        super().__init__()
        self.op = op
        self.filter = nn.Parameter(torch.randn(4, 3, 2, dtype=torch.float64) * 0.3 + 1)
        self.head = nn.Linear(3, 3).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spectrum, weight = torch.fft.rfft(x, dim=1), torch.view_as_complex(self.filter)
        filtered = {
            "mul": spectrum * weight,
            "dividend": spectrum / weight,
            "divisor": weight / (spectrum + 3),
        }[self.op]
        return self.head(torch.tanh(torch.fft.irfft(filtered, n=x.shape[1], dim=1)).mean(1))


@pytest.mark.parametrize("op", ["mul", "dividend", "divisor"])
def test_a_complex_factor_takes_the_conjugate_in_its_closed_form(op):
    """The closed forms of a product and a quotient multiplied the cotangent by the other
    operand, not its conjugate: a complex filter's per-sample gradients were off by 0.056
    (and their sum from the gradient), its GGN diagonal by 2e-3, silently."""
    torch.manual_seed(0)
    model = _SpectralFilter(op)
    X, y = torch.randn(4, 6, 3, dtype=torch.float64), torch.randint(0, 3, (4,))
    loss = nn.CrossEntropyLoss(reduction="sum")
    model_fn, params = pf.functional(model)
    assert pf.explain(model_fn, params, X)["filter"].startswith("closed form")
    found = pf.batch_grad(model_fn, params, X, y, loss=loss)
    expected = autograd_batch_grad(model, loss, X, y)
    torch.testing.assert_close(found["filter"], expected["filter"])


class _LookedUpPosition(nn.Module):
    """A position table looked up by index and added to the tokens' features (GPT-2's
    ``wpe(arange(T)).to(device)``), in the variants the row-adding pullback must tell apart."""

    def __init__(self, variant: str) -> None:
        super().__init__()
        padding = 0 if variant == "padding_idx" else None
        self.position = nn.Embedding(5, 4, padding_idx=padding).double()
        self.head = nn.Linear(4, 3).double()
        self.variant = variant

    def forward(self, x: Tensor) -> Tensor:
        ids = torch.arange(x.shape[1])
        if self.variant == "repeated":
            ids = ids % 2  # rows looked up twice: their cotangents add
        looked_up = self.position(ids[None])
        if self.variant == "converted":
            looked_up = looked_up.to(x.device).float().double()
        return self.head(torch.tanh(x + looked_up)).sum(1)


@pytest.mark.parametrize("variant", ["plain", "converted", "repeated", "padding_idx"])
def test_a_looked_up_position_takes_its_rows_cotangents(variant, monkeypatch):
    """A position table looked up by constant indices gets its per-sample gradients by adding
    each position's cotangent into its row (one index_add, where a vmap of its vjp took 0.9 ms
    of GPT-2's DP step); a lookup with ``padding_idx`` (whose row gets no gradient) keeps the
    vjp. Both equal per-sample autograd."""
    from packfunc.engine.rules import broadcast

    added = []
    spy = broadcast._added_into_rows
    monkeypatch.setattr(broadcast, "_added_into_rows", lambda *a: added.append(1) or spy(*a))
    torch.manual_seed(0)
    model = _LookedUpPosition(variant)
    model_fn, params = pf.functional(model)
    X, y = torch.randn(4, 3, 4, dtype=torch.float64), torch.randint(0, 3, (4,))
    assert_batch_grad_is_a_loop(model_fn, params, X, y)
    assert bool(added) == (variant != "padding_idx")
