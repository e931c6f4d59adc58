"""Rough edges a new user hit (issue 10): each fails or warns with a message naming the fix."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import packfunc as pf
from packfunc.compat import backpack, extend
from packfunc.compat.extensions import BatchGrad, DiagGGNExact
from tests.cases import assert_batch_grad_is_a_loop, assert_trees_close, autograd_batch_grad


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


_DATA = torch.Generator().manual_seed(0)
X, Y = torch.randn(5, 3, generator=_DATA), torch.randint(0, 2, (5,), generator=_DATA)


def test_functional_params_do_not_require_grad_and_the_documented_fix_works():
    model_fn, params = pf.functional(_model())
    assert not any(p.requires_grad for p in params.values())  # the engine's fast path
    assert "requires_grad_()" in pf.functional.__doc__
    leaves = {k: p.requires_grad_() for k, p in params.items()}
    (g,) = torch.autograd.grad(
        nn.functional.cross_entropy(model_fn(leaves, X), Y), leaves["2.bias"]
    )
    expected = pf.batch_grad(model_fn, params, X, Y)["2.bias"].sum(0)
    torch.testing.assert_close(g, expected)


def test_int32_class_targets_name_the_fix():
    model_fn, params = pf.functional(_model())
    with pytest.raises(ValueError, match=r"torch\.int64.*y\.long\(\)"):
        pf.batch_grad(model_fn, params, X, Y.int())


def test_compute_takes_one_string_as_one_quantity():
    model_fn, params = pf.functional(_model())
    out = pf.compute(model_fn, params, X, Y, quantities="grad")
    torch.testing.assert_close(
        out["grad"]["0.weight"], pf.batch_grad(model_fn, params, X, Y)["0.weight"].sum(0)
    )


@pytest.mark.parametrize("name", ["kfac", "kflr", "kfra"])
def test_compute_names_the_function_for_kronecker_factors(name):
    model_fn, params = pf.functional(_model())
    with pytest.raises(ValueError, match=rf"pf\.{name}\(\.\.\.\)"):
        pf.compute(model_fn, params, X, Y, quantities=("grad", name))


_FUNCTIONS = [
    lambda fn, p: pf.batch_grad(fn, p, X, Y),
    lambda fn, p: pf.diag_ggn(fn, p, X, Y),
    lambda fn, p: pf.compute(fn, p, X, Y, quantities=("variance",)),
    lambda fn, p: pf.kfac(fn, p, X, Y),
    lambda fn, p: pf.kfra(fn, p, X, Y),
    lambda fn, p: pf.ggn_vector_product(fn, p, X, Y, p),
    lambda fn, p: pf.hessian_block_products(fn, p, X, Y, p),
    lambda fn, p: pf.pch_block_products(fn, p, X, Y, p),
]


@pytest.mark.parametrize("call", _FUNCTIONS)
def test_passing_the_module_as_model_fn_names_the_fix(call):
    model = _model()
    _, params = pf.functional(model)
    with pytest.raises(TypeError, match=r"use model_fn, params = pf\.functional\(model\)"):
        call(model, params)


@pytest.mark.parametrize("call", _FUNCTIONS)
def test_passing_a_parameter_list_names_the_fix(call):
    model = _model()
    model_fn, _ = pf.functional(model)
    with pytest.raises(TypeError, match=r"use model_fn, params = pf\.functional\(model\)"):
        call(model_fn, list(model.parameters()))


def test_passing_the_parameter_generator_names_the_fix():
    model = _model()
    model_fn, _ = pf.functional(model)
    with pytest.raises(TypeError, match=r"pf\.functional\(model\)"):
        pf.batch_grad(model_fn, model.parameters(), X, Y)
    with pytest.raises(TypeError, match=r"pf\.functional\(model\)"):
        pf.batch_grad(lambda p, X: X, model.parameters(), X, Y)


def test_hand_written_model_fn_may_take_a_list():
    model_fn, params = pf.functional(_model())
    names = list(params)

    def listed(p: list[torch.Tensor], X: torch.Tensor) -> torch.Tensor:
        return model_fn(dict(zip(names, p)), X)

    g = pf.batch_grad(listed, list(params.values()), X, Y)
    torch.testing.assert_close(g[0], pf.batch_grad(model_fn, params, X, Y)["0.weight"])


def test_dropout_with_p_zero_does_not_warn():
    model_fn, params = pf.functional(
        nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.0), nn.Linear(4, 2)).train()
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pf.batch_grad(model_fn, params, X, Y)


def test_empty_batch_is_refused_clearly():
    model_fn, params = pf.functional(_model())
    with pytest.raises(ValueError, match="empty batch"):
        pf.batch_grad(model_fn, params, X[:0], Y[:0])


def _reference_batch_grad(model: nn.Module, X: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    model_fn, params = pf.functional(model)
    return pf.batch_grad(model_fn, params, X, y)["0.weight"]


def test_shim_second_forward_backpropagated_is_right():
    model, lossfunc = extend(_model()), extend(nn.CrossEntropyLoss())
    X2, Y2 = torch.randn(6, 3), torch.randint(0, 2, (6,))
    model(X)
    out2 = model(X2)
    torch.testing.assert_close(model[0].input0, X2)  # as in BackPACK: the last forward's
    with backpack(BatchGrad(), DiagGGNExact()):
        lossfunc(out2, Y2).backward()
    torch.testing.assert_close(model[0].weight.grad_batch, _reference_batch_grad(model, X2, Y2))


def test_shim_first_forward_backpropagated_is_right():
    model, lossfunc = extend(_model()), extend(nn.CrossEntropyLoss())
    out1 = model(X)
    model(torch.randn(6, 3))
    with backpack(BatchGrad()):
        lossfunc(out1, Y).backward()
    torch.testing.assert_close(model[0].weight.grad_batch, _reference_batch_grad(model, X, Y))


def test_shim_two_forwards_in_one_backward_are_refused():
    """And leave no results (the first forward's were left, from half of the loss)."""
    model, lossfunc = extend(_model()), extend(nn.CrossEntropyLoss())
    out1, out2 = model(X), model(X[:4])
    with backpack(BatchGrad()), pytest.raises(ValueError, match="two forward passes"):
        (lossfunc(out1, Y) + lossfunc(out2, Y[:4])).backward()
    assert not any(hasattr(p, "grad_batch") for p in model.parameters())


def test_shim_hook_after_an_earlier_forward_is_refused():
    model, lossfunc = extend(_model()), extend(nn.CrossEntropyLoss())
    out1 = model(X)
    model(X[:4])
    with (
        backpack(BatchGrad(), extension_hook=lambda module: None),
        pytest.raises(ValueError, match="latest forward"),
    ):
        lossfunc(out1, Y).backward()


@pytest.mark.filterwarnings("error::UserWarning")
def test_vmapped_attention_does_not_warn():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0, batch_first=True)
    model_fn, params = pf.functional(layer)
    X3, y3 = torch.randn(3, 4, 8), torch.randint(0, 8, (3,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pf.batch_grad(lambda p, x: model_fn(p, x).mean(1), params, X3, y3)
        pf.diag_ggn(lambda p, x: model_fn(p, x).mean(1), params, X3, y3)
    assert not [w for w in caught if "performance drop" in str(w.message)]


class _RunningCentered(nn.Module):
    """Centres its input by a running mean it updates in training mode (a buffer)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2)
        self.register_buffer("mean", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.mean.mul_(0.9).add_(0.1 * x.mean(0))
        return self.linear(x - self.mean)


def test_a_forward_that_updates_a_buffer_is_run_once_per_call_as_in_training():
    """Discovery's one-sample forward puts the buffers back: the first call's gradient is
    at the user's state and the buffer moves once, as in a plain training step."""
    import copy

    torch.manual_seed(0)
    model = _RunningCentered()
    plain = copy.deepcopy(model)
    loss = nn.CrossEntropyLoss(reduction="sum")
    model_fn, params = pf.functional(model)
    found = pf.clipped_grad(model_fn, params, X, Y, loss=loss, max_norm=1e9)  # no clipping
    loss(plain(X), Y).backward()
    torch.testing.assert_close(model.mean, plain.mean)
    for name, p in plain.named_parameters():
        torch.testing.assert_close(found[name], p.grad)


def test_a_rerun_of_a_model_that_updates_a_buffer_is_refused():
    """spectral_norm in training mode advances its power iteration in each forward: the
    whole-model path's re-run would see another weight, so it is refused."""
    torch.manual_seed(0)
    layer = nn.utils.parametrizations.spectral_norm(nn.Linear(3, 4))
    model = nn.Sequential(layer, nn.Tanh(), nn.Linear(4, 2))
    model_fn, params = pf.functional(model)
    with pytest.raises(ValueError, match="changes its buffer '0.parametrizations.weight.0._u'"):
        pf.batch_grad(model_fn, params, X, Y)
    model.eval()
    # in evaluation mode its weight is op-local (the flatten of its 1-D vector u, which
    # returns u itself, read as an in-place change: the whole-model path)
    assert pf.explain(model_fn, params, X)["0.parametrizations.weight.original"] == (
        "op-local (linear)"
    )
    expected = {}
    for n in range(len(X)):
        model.zero_grad()
        nn.functional.cross_entropy(model(X[n : n + 1]), Y[n : n + 1]).backward()
        for name, p in model.named_parameters():
            expected.setdefault(name, []).append(p.grad.clone())
    found = pf.batch_grad(model_fn, params, X, Y, loss=nn.CrossEntropyLoss(reduction="sum"))
    for name, grads in expected.items():
        torch.testing.assert_close(found[name], torch.stack(grads), atol=1e-6, rtol=1e-5)


class _ScaleOldStyle(torch.autograd.Function):
    """``x * w`` with its own backward (no ``setup_context``: no torch.func transforms)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w, g * x


class _ScaleWithoutVmap(torch.autograd.Function):
    """``x * w`` with its own backward and ``setup_context`` but no vmap rule."""

    @staticmethod
    def forward(x, w):
        return x * w

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w, g * x


class _Scale(_ScaleWithoutVmap):
    """``x * w`` with its own backward, usable under ``vmap``."""

    generate_vmap_rule = True


class _CustomScaled(nn.Module):
    def __init__(self, function: type[torch.autograd.Function]) -> None:
        super().__init__()
        self.function = function
        self.scale = nn.Parameter(torch.randn(3))
        self.linear = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.function.apply(x, self.scale))


class _PlainScale:
    """``x * w`` in plain torch ops: the oracle's model."""

    @staticmethod
    def apply(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * w


@pytest.mark.parametrize("function", [_Scale, _ScaleOldStyle, _ScaleWithoutVmap])
def test_a_parameter_inside_a_custom_autograd_function_takes_the_whole_model(function):
    """Its call inside the Function's forward has no graph to tap: the parameter's
    gradients come from the whole model, by vmap or, where torch.func cannot transform
    the Function (no setup_context, no vmap rule), by plain autograd per sample: exact.
    ``explain`` says so (it said "op-local (mul)", its probe forward ran without gradients
    throughout; a probe)."""
    torch.manual_seed(0)
    model = _CustomScaled(function).double()
    loss = nn.CrossEntropyLoss(reduction="sum")
    model_fn, params = pf.functional(model)
    X64 = X.double()
    assert pf.explain(model_fn, params, X64)["scale"].startswith("whole model")
    found = pf.batch_grad(model_fn, params, X64, Y, loss=loss)
    for n in range(len(X)):
        model.zero_grad()
        loss(model(X64[n : n + 1]), Y[n : n + 1]).backward()
        for name, p in model.named_parameters():
            torch.testing.assert_close(found[name][n], p.grad)
    plain = copy.deepcopy(model)
    plain.function = _PlainScale
    plain_fn, plain_params = pf.functional(plain)
    for quantity in ("diag_ggn", "variance"):
        expected = getattr(pf, quantity)(plain_fn, plain_params, X64, Y, loss=loss)
        got = getattr(pf, quantity)(model_fn, params, X64, Y, loss=loss)
        for name in expected:
            torch.testing.assert_close(got[name], expected[name])
    expected = pf.clipped_grad(plain_fn, plain_params, X64, Y, loss=loss, max_norm=0.3)
    got = pf.clipped_grad(model_fn, params, X64, Y, loss=loss, max_norm=0.3)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name])


class _RoundStraightThrough(torch.autograd.Function):
    """A weight quantizer: rounds to quarters, its backward the identity (an STE)."""

    @staticmethod
    def forward(w):
        return torch.round(w * 4) / 4

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g

    generate_vmap_rule = True


class _HalfGradient(torch.autograd.Function):
    """The identity, its backward halving the gradient (no setup_context)."""

    @staticmethod
    def forward(ctx, w):
        return w.clone()

    @staticmethod
    def backward(ctx, g):
        return g * 0.5


class _QuantizedLinear(nn.Linear):
    def __init__(self, function: type[torch.autograd.Function]) -> None:
        super().__init__(3, 2)
        self.function = function

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.function.apply(self.weight), self.bias)


@pytest.mark.parametrize("function", [_RoundStraightThrough, _HalfGradient])
def test_a_parameter_transformed_by_a_custom_function_before_its_layer_is_exact(function):
    """A parameter alone through a custom Function (a quantizer's straight-through estimator,
    a gradient scale) was followed through the Function's forward ops as a derivation: its
    per-sample gradients read their derivative (rounding's: zero), not the backward's, in the
    functional API and the shim (0.2-1.0 off, clipped sums too; found by a probe). Such a
    parameter takes the whole-model path."""
    torch.manual_seed(0)
    model = nn.Sequential(_QuantizedLinear(function), nn.Tanh(), nn.Linear(2, 2)).double()
    loss = nn.CrossEntropyLoss(reduction="sum")
    model_fn, params = pf.functional(model)
    X64 = X.double()
    assert pf.explain(model_fn, params, X64)["0.weight"].startswith("whole model")
    expected = autograd_batch_grad(model, loss, X64, Y)
    assert_trees_close(pf.batch_grad(model_fn, params, X64, Y, loss=loss), expected)
    extended = extend(copy.deepcopy(model))
    with backpack(BatchGrad()):
        extend(loss)(extended(X64), Y).backward()
    shim = {name: p.grad_batch for name, p in extended.named_parameters()}
    assert_trees_close(shim, expected)


def test_a_gradient_hook_on_a_tensor_made_of_a_parameter_takes_the_whole_model():
    """``w = p * 1; w.register_hook(lambda g: 0.5 * g)`` in the forward: packfunc followed
    ``w``'s uses, whose inputs and output gradients the hook does not change, and its
    per-sample gradients were twice autograd's (found by a probe). The parameter takes the
    whole-model path, whose autograd applies the hook."""

    class Hooked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = nn.Linear(3, 4), nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            weight = self.first.weight * 1.0
            weight.register_hook(lambda g: g * 0.5)
            hidden = torch.tanh(nn.functional.linear(x, weight, self.first.bias))
            return self.second(hidden)

    torch.manual_seed(0)
    model_fn, params = pf.functional(Hooked().double())
    X64 = X.double()
    assert "gradient hook" in pf.explain(model_fn, params, X64)["first.weight"]
    assert_batch_grad_is_a_loop(model_fn, params, X64, Y)  # (torch.func applies the hook)


def test_hessians_through_a_custom_function_torch_func_cannot_transform_name_the_fix():
    model_fn, params = pf.functional(_CustomScaled(_ScaleOldStyle))
    with pytest.raises(ValueError, match="a setup_context staticmethod and a vmap rule"):
        pf.batch_diag_hessian(model_fn, params, X, Y, loss=nn.CrossEntropyLoss())


class _CountingGRU(nn.Module):
    """A GRU and a head; the forward advances a buffer (a running count), scaled by it first.

    (Scaled, only the head can be trained: the update changes a value saved for backward.)
    """

    def __init__(self, scaled: bool) -> None:
        super().__init__()
        self.rnn, self.head = nn.GRU(3, 4, batch_first=True), nn.Linear(4, 2)
        self.register_buffer("scale", torch.ones(()))
        self.scaled = scaled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.rnn(x)[0][:, -1]
        out = self.head(features * self.scale if self.scaled else features)
        with torch.no_grad():
            self.scale += 1.0
        return out


@pytest.mark.parametrize("quantity", ["diag_hessian", "batch_diag_hessian"])
def test_the_hessian_of_a_model_that_updates_a_buffer_runs_it_once_or_refuses_unchanged(quantity):
    """Of the head alone the Hessian needs no re-run, but its piecewise-affine probe ran the
    forward once more and kept its update (the buffer moved twice per call). Of every
    parameter the refusal came from inside torch.func, whose transform refused to put the
    buffer back: torch's error, and the buffer left moved by two forwards."""
    torch.manual_seed(0)
    model = _CountingGRU(scaled=True).double()
    X, y = torch.randn(5, 2, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 0, 1])
    loss = nn.CrossEntropyLoss(reduction="sum")
    model_fn, params = pf.functional(model)
    head = {k: v for k, v in params.items() if k.startswith("head")}
    found = getattr(pf, quantity)(model_fn, head, X, y, loss=loss)
    assert model.scale.item() == 2.0  # one forward, as a training step's
    with torch.no_grad():
        features = model.rnn(X)[0][:, -1]  # at scale 1, the forward whose loss is reported
    for n in range(len(X)) if quantity == "batch_diag_hessian" else [None]:
        rows = slice(None) if n is None else slice(n, n + 1)
        hessian = torch.autograd.functional.hessian(
            lambda w, b, rows=rows: loss(features[rows] @ w.T + b, y[rows]),
            (model.head.weight.detach(), model.head.bias.detach()),
        )
        got = found["head.bias"] if n is None else found["head.bias"][n]
        torch.testing.assert_close(got, torch.diagonal(hessian[1][1]))
    model = _CountingGRU(scaled=False).double()
    model_fn, params = pf.functional(model)
    with pytest.raises(ValueError, match="changes its buffer 'scale'.*second derivatives"):
        getattr(pf, quantity)(model_fn, params, X, y, loss=loss)
    assert model.scale.item() == 1.0  # the refused call's forward put back


@pytest.mark.parametrize("product", ["hessian_vector_product", "ggn_vector_product"])
def test_a_product_through_a_model_that_updates_a_buffer_is_refused_in_packfunc_words(product):
    """torch.func refuses the in-place update under its transforms; its message named no fix."""
    model = _RunningCentered()
    model_fn, params = pf.functional(model)
    before = model.mean.clone()
    v = {k: torch.ones_like(p) for k, p in params.items()}
    with pytest.raises(ValueError, match="changes in place a tensor.*model.eval()"):
        getattr(pf, product)(model_fn, params, X, Y, v=v)
    assert torch.equal(model.mean, before)


class _TopOneExperts(nn.Module):
    """A top-1 mixture of experts over all tokens of the batch, scattered by boolean masks."""

    def __init__(self, skips_unused: bool) -> None:
        super().__init__()
        self.gate, self.head = nn.Linear(3, 3), nn.Linear(3, 3)
        self.experts = nn.ModuleList(nn.Linear(3, 3) for _ in range(3))
        self.skips_unused = skips_unused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, length, width = x.shape
        tokens = x.reshape(-1, width)
        weight, expert = self.gate(tokens).softmax(-1).max(-1)
        out = torch.zeros_like(tokens)
        for i, layer in enumerate(self.experts):
            mask = expert == i
            if not self.skips_unused or mask.any():
                out[mask] = layer(tokens[mask]) * weight[mask, None]
        return self.head((tokens + out).reshape(n, length, width).amax(1))


def test_a_mixture_of_experts_with_boolean_masks_runs_per_sample_or_names_the_branch():
    """Boolean-mask indexing cannot run under vmap (torch's raw error): the per-sample loop
    takes it, as for other value branches. Skipping an expert no token of the batch uses
    calls other layers for one sample than for the batch: the refusal names that branch."""
    torch.manual_seed(0)
    model = _TopOneExperts(skips_unused=False).double()
    X, y = torch.randn(5, 4, 3, dtype=torch.float64), torch.randint(0, 3, (5,))
    loss = nn.CrossEntropyLoss(reduction="sum")
    model_fn, params = pf.functional(model)
    found = pf.batch_grad(model_fn, params, X, y, loss=loss)
    expected = autograd_batch_grad(model, loss, X, y)
    for name in expected:
        torch.testing.assert_close(found[name], expected[name])
    torch.manual_seed(0)
    skipping = pf.functional(_TopOneExperts(skips_unused=True).double())
    with pytest.raises(RuntimeError, match="a branch on values.*'if mask.any\\(\\):'"):
        pf.batch_grad(*skipping, X, y, loss=loss)


class _BroadcastBias(nn.Module):
    """A linear layer whose bias torch broadcasts over its outputs (or a Conv1D's addmm)."""

    def __init__(self, bias_shape: tuple[int, ...], addmm: bool) -> None:
        super().__init__()
        shape = (3, 4) if addmm else (4, 3)  # [in, out] for addmm, [out, in] for F.linear
        self.weight = nn.Parameter(torch.randn(shape, dtype=torch.float64))
        self.bias = nn.Parameter(torch.randn(bias_shape, dtype=torch.float64))
        self.addmm = addmm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.addmm:  # GPT-2's Conv1D on [N, T, d]: the weight stored [in, out]
            flat = torch.addmm(self.bias, x.reshape(-1, 3), self.weight)
            return flat.view(*x.shape[:-1], 4).sum(1)
        return nn.functional.linear(x, self.weight, self.bias)


@pytest.mark.parametrize(
    ("bias_shape", "addmm"), [((1,), False), ((), False), ((1, 4), False), ((1,), True)]
)
def test_a_bias_torch_broadcasts_over_the_outputs_is_not_taken_for_one_per_output(
    bias_shape, addmm
):
    """A bias of shape (1,) broadcast by F.linear took the closed form for one entry per
    output: batch_grad [N, C] for a [N, 1] bias, diag_ggn and the clipped sum off (and with
    the joint norm, the other parameters' clipped sums too), silently."""
    torch.manual_seed(0)
    model = _BroadcastBias(bias_shape, addmm)
    X = torch.randn(5, 2, 3, dtype=torch.float64) if addmm else torch.randn(5, 3).double()
    y = torch.randn(5, 4, dtype=torch.float64)
    loss = nn.MSELoss(reduction="sum")
    model_fn, params = pf.functional(model)
    found = pf.batch_grad(model_fn, params, X, y, loss=loss)
    expected = autograd_batch_grad(model, loss, X, y)
    for name in expected:
        assert found[name].shape == (5, *params[name].shape)
        torch.testing.assert_close(found[name], expected[name])
    clipped = pf.clipped_grad(model_fn, params, X, y, loss=loss, max_norm=1.0)
    norms = torch.stack([expected[k].reshape(5, -1).square().sum(1) for k in expected])
    norms = norms.sum(0).sqrt()
    factors = (1.0 / (norms + 1e-6)).clamp(max=1.0)
    for name in expected:
        weighted = expected[name] * factors.view(-1, *[1] * params[name].dim())
        torch.testing.assert_close(clipped[name], weighted.sum(0))


@pytest.mark.parametrize("bias_shape", [(4,), (1,)])
def test_a_plain_addmm_of_the_batch_is_a_linear_layer(bias_shape):
    """``torch.addmm(b, x, W)`` of a batch ``[N, in]``: only Conv1D's ``addmm`` of a flat view
    was taken for a layer; this one ran op-local and had no Kronecker factors (a probe)."""

    class Addmm(nn.Module):
        def __init__(self, view: bool) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(3, 4, dtype=torch.float64))
            self.bias = nn.Parameter(torch.randn(bias_shape, dtype=torch.float64))
            self.view = view

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            rows = x.view(-1, 3) if self.view else x
            return torch.tanh(torch.addmm(self.bias, rows, self.weight))

    torch.manual_seed(0)
    X, y = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)
    loss = nn.MSELoss(reduction="sum")
    model = Addmm(view=False)
    model_fn, params = pf.functional(model)
    paths = pf.explain(model_fn, params, X)
    path = "closed form" if bias_shape == (4,) else "op-local (linear_in_out)"  # (broadcast)
    assert all(found.startswith(path) for found in paths.values()), paths
    found = pf.batch_grad(model_fn, params, X, y, loss=loss)
    assert_trees_close(found, autograd_batch_grad(model, loss, X, y), "addmm")
    if bias_shape != (4,):
        return
    viewed = Addmm(view=True)
    viewed.load_state_dict(model.state_dict())
    factors = pf.kflr(model_fn, params, X, y, loss=loss)
    assert_trees_close(factors, pf.kflr(*pf.functional(viewed), X, y, loss=loss), "kflr")


def test_a_float64_parameter_beside_a_float32_one_keeps_float64_precision():
    """The loss was formed in the first leaf's dtype: a float64 parameter's per-sample
    gradients had float32 rounding (4.6e-8) when a float32 leaf came first in key order."""
    torch.manual_seed(0)
    params = {"a": torch.randn(4, 4), "b": torch.randn(4, 3, dtype=torch.float64)}
    X, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    loss = nn.CrossEntropyLoss(reduction="sum")

    def model_fn(p: dict, X: torch.Tensor) -> torch.Tensor:
        return torch.tanh(X @ p["a"].double()) @ p["b"]

    found = pf.batch_grad(model_fn, params, X, y, loss=loss)["b"]
    assert found.dtype == torch.float64
    expected = torch.stack(
        [
            torch.func.grad(
                lambda b, n=n: loss(model_fn({**params, "b": b}, X[n : n + 1]), y[n : n + 1])
            )(params["b"])
            for n in range(5)
        ]
    )
    torch.testing.assert_close(found, expected, rtol=1e-12, atol=1e-12)


class _ChangedInPlaceOverPositions(nn.Module):
    """A linear layer over positions whose output is changed in place (VGG-style ReLU, a
    Hugging Face padding mask written as ``h[~mask] = 0``)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.proj, self.head = nn.Linear(4, 4), nn.Linear(20, 2)
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)  # F.linear on [N, T, d]: a view of the flat product
        if self.how == "relu_":
            h.relu_()
        elif self.how == "masked_fill_":
            h.masked_fill_(x[..., :1] > 0.5, 0.0)
        else:
            h[x[..., 0] > 0.5] = 0.0
        return self.head(h.flatten(1))


@pytest.mark.parametrize("how", ["relu_", "masked_fill_", "setitem"])
def test_a_linear_output_over_positions_changed_in_place_keeps_its_gradients(how):
    """The view's old gradient edge left the graph when it was changed in place: the
    layer's per-sample gradients (and norms, GGN, clipped sums, the shim's grad_batch)
    were exactly zero, silently (Wav2Vec2 with an attention mask)."""
    torch.manual_seed(0)
    model = _ChangedInPlaceOverPositions(how).double()
    X, y = torch.randn(3, 5, 4, dtype=torch.float64), torch.tensor([0, 1, 1])
    loss = nn.CrossEntropyLoss(reduction="sum")
    model_fn, params = pf.functional(model)
    found = pf.batch_grad(model_fn, params, X, y, loss=loss)
    expected = autograd_batch_grad(model, loss, X, y)
    assert expected["proj.weight"].abs().sum() > 0
    for name in expected:
        torch.testing.assert_close(found[name], expected[name])
    shimmed, lossfunc = extend(copy.deepcopy(model)), extend(copy.deepcopy(loss))
    with backpack(BatchGrad()):
        lossfunc(shimmed(X), y).backward()
    torch.testing.assert_close(shimmed.proj.weight.grad_batch, expected["proj.weight"])


class _DroppedPosition(nn.Module):
    """A learned position passed through dropout (DeBERTa's relative embeddings)."""

    def __init__(self) -> None:
        super().__init__()
        self.position = nn.Parameter(torch.randn(3, dtype=torch.float64))
        self.drop, self.head = nn.Dropout(0.1), nn.Linear(3, 2).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x * self.drop(self.position))


def test_dropout_in_evaluation_mode_is_no_in_place_change():
    """Dropout in evaluation mode returns its input itself, which read as an in-place change
    ("changed in place by dropout"): the whole-model path, for a closed form's parameter."""
    torch.manual_seed(0)
    model = _DroppedPosition().eval()
    X, y = torch.randn(4, 3, dtype=torch.float64), torch.randint(0, 2, (4,))
    loss = nn.CrossEntropyLoss(reduction="sum")
    model_fn, params = pf.functional(model)
    assert pf.explain(model_fn, params, X)["position"] == "closed form (mul)"
    found = pf.batch_grad(model_fn, params, X, y, loss=loss)
    expected = autograd_batch_grad(model, loss, X, y)
    for name in expected:
        torch.testing.assert_close(found[name], expected[name])


@pytest.mark.parametrize(
    "bad_call",
    [
        lambda fn, p, X, y: pf.batch_grad(fn, p, X, y.double()),  # fails in the loss
        lambda fn, p, X, y: pf.batch_grad(fn, p, X, torch.tensor([0, 1, 2, 3])),  # out of range
    ],
)
def test_a_failed_call_does_not_leave_its_batch_to_check_the_next_one(bad_call):
    """A call that fails after discovery kept a plan holding its first sample's output.

    The next call on another batch compared its own first row with it and was refused
    as mixing samples (found by a probe).
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    fn, p = pf.functional(model)
    X1, X2 = torch.randn(4, 5, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)
    y = torch.randint(0, 3, (4,))
    with pytest.raises((ValueError, IndexError)):
        bad_call(fn, p, X1, y)
    found = pf.batch_grad(fn, p, X2, y)
    expected = torch.func.grad(lambda q: nn.functional.cross_entropy(fn(q, X2), y))(p)
    assert all(torch.allclose(found[k].sum(0), expected[k]) for k in p)


class _AddsToItsInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x):
        x.add_(1.0)
        return self.b(torch.tanh(self.a(x)))


@pytest.mark.parametrize("quantity", ["diag_hessian", "batch_diag_hessian"])
def test_a_refused_hessian_changes_an_input_changed_in_place_once(quantity):
    """The piecewise-affine probe ran the model on the batch's memory: a model adding to its
    input in place changed the batch twice before the refusal (found by a probe)."""
    fn, p = pf.functional(_AddsToItsInput().double())
    X = torch.zeros(4, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="changes its input in place"):
        getattr(pf, quantity)(fn, p, X, torch.tensor([0, 1, 1, 0]))
    assert torch.equal(X, torch.ones(4, 3, dtype=torch.float64))


def test_a_product_through_a_model_changing_its_input_names_the_input():
    fn, p = pf.functional(_AddsToItsInput().double())
    v = {k: torch.ones_like(t) for k, t in p.items()}
    with pytest.raises(ValueError, match="its input X"):
        pf.hessian_vector_product(fn, p, torch.zeros(4, 3).double(), torch.tensor([0, 1, 1, 0]), v)


def test_a_refused_product_puts_back_the_buffers_its_forward_updated():
    """Spectral norm's power iteration (training mode) ran in the product's forward before
    the refusal, and its buffers stayed changed (found by a probe)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    torch.nn.utils.parametrizations.spectral_norm(model[0])
    before = {k: b.clone() for k, b in model.named_buffers()}
    fn, p = pf.functional(model)
    v = {k: torch.ones_like(t) for k, t in p.items()}
    with pytest.raises((ValueError, RuntimeError)):
        pf.ggn_vector_product(fn, p, torch.randn(4, 3).double(), torch.tensor([0, 1, 1, 0]), v)
    assert all(torch.equal(b, before[k]) for k, b in model.named_buffers())


def test_kronecker_factors_of_a_layer_with_a_computed_weight_say_why_they_are_missing():
    """The refusal said conv2d has no Kronecker rule, even for the plain bias (a probe)."""

    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(2, 2, 3, padding=1)
            self.register_buffer("mask", torch.tril(torch.ones(3, 3)))

        def forward(self, x):
            weight = self.conv.weight * self.mask
            return nn.functional.conv2d(x, weight, self.conv.bias, padding=1).flatten(1)

    fn, p = pf.functional(Masked())
    with pytest.raises(
        ValueError, match="conv.bias: used by conv2d with a weight or bias computed"
    ):
        pf.kfac(fn, p, torch.randn(3, 2, 4, 4), torch.randint(0, 32, (3,)))


def test_a_product_through_a_full_backward_hook_names_the_hook():
    """The refusal spoke of the user's custom Function; they wrote a hook (a probe)."""
    model = _model()
    model[0].register_full_backward_hook(lambda *_: None)
    fn, p = pf.functional(model)
    v = {k: torch.ones_like(t) for k, t in p.items()}
    with pytest.raises(ValueError, match="register_full_backward_hook"):
        pf.ggn_vector_product(fn, p, X, Y, v)


def _complex_layer(p, X):
    h = X.to(p["W"].dtype) @ p["W"]
    return torch.cat([h.real, h.imag], 1)  # a real output


@pytest.mark.parametrize("quantity", ["batch_l2_grad", "sum_grad_squared", "diag_ggn", "kfac"])
def test_squares_and_curvature_of_complex_parameters_are_refused(quantity):
    """Squared norms came out complex (g², not |g|²), and clipped_grad failed in torch's
    words (found by a probe); gradients themselves are right and stay."""
    p = {"W": torch.randn(4, 3, dtype=torch.complex128)}
    X, y = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 6, dtype=torch.float64)
    loss = nn.MSELoss(reduction="sum")
    with pytest.raises(ValueError, match="complex parameters"):
        getattr(pf, quantity)(_complex_layer, p, X, y, loss=loss)
    found = pf.batch_grad(_complex_layer, p, X, y, loss=loss)["W"]
    for n in range(5):
        one = torch.func.grad(lambda q, x, t: loss(_complex_layer(q, x), t))
        torch.testing.assert_close(found[n], one(p, X[n : n + 1], y[n : n + 1])["W"])


def _real_parts_layer(p, X):
    return X @ p["W"].real + (X @ torch.view_as_real(p["W"])[..., 1]) ** 2


def test_per_sample_gradients_of_a_complex_parameter_read_through_its_real_parts():
    """``w.real`` / ``view_as_real(w)``: a real output of a complex parameter got the
    parameter's complex cotangent, and torch's vjp raised its dtype error (a probe)."""
    torch.manual_seed(0)
    p = {"W": torch.randn(3, 2, dtype=torch.complex128)}
    X, y = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    loss = nn.MSELoss(reduction="sum")
    found = pf.batch_grad(_real_parts_layer, p, X, y, loss=loss)["W"]
    for n in range(4):
        one = torch.func.grad(lambda q, x, t: loss(_real_parts_layer(q, x), t))
        torch.testing.assert_close(found[n], one(p, X[n : n + 1], y[n : n + 1])["W"])


def _written_row(p, X):
    W = p["W"].clone()
    W[0] = 0  # (__setitem__ returns None: its write was not seen as one)
    return X @ W


def _statistic_under_no_grad(p, X):
    with torch.no_grad():
        twice = p["s"] * 2  # a constant to differentiation
    return X * twice + X * p["s"]


@pytest.mark.parametrize("model_fn", [_written_row, _statistic_under_no_grad])
def test_a_parameter_derived_and_written_or_derived_under_no_grad_is_replayed_as_it_ran(model_fn):
    """Both were replayed as plain derivations (found by a probe): the written row's
    gradients were not zero, and the no_grad statistic was differentiated (3× too large)."""
    torch.manual_seed(0)
    key = "W" if model_fn is _written_row else "s"
    params = {
        key: torch.randn(3, 3, dtype=torch.float64) if key == "W" else torch.randn(3).double()
    }
    X, y = torch.randn(4, 3, dtype=torch.float64), torch.tensor([0, 1, 2, 0])
    assert_batch_grad_is_a_loop(model_fn, params, X, y)


def test_a_ggn_product_treats_an_embeddings_padding_row_as_a_constant():
    """Its forward-mode derivative counted the padding row, its reverse mode not: the product
    was neither the GGN's nor symmetric (a probe: off by 0.087 of 1.12)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(5, 3, padding_idx=0), nn.Flatten(), nn.Linear(6, 3)).double()
    fn, p = pf.functional(model)
    X, y = torch.tensor([[0, 1], [2, 0], [3, 4]]), torch.tensor([0, 1, 2])
    v = {k: torch.randn_like(t) for k, t in p.items()}
    found = pf.ggn_vector_product(fn, p, X, y, v)
    jacobian = torch.func.jacrev(lambda q: fn(q, X))(p)  # reverse mode: the padding row's is 0
    out = fn(p, X)
    hessian = torch.autograd.functional.hessian(lambda o: nn.functional.cross_entropy(o, y), out)
    flat = {k: j.reshape(out.numel(), -1) for k, j in jacobian.items()}
    jv = sum(flat[k] @ v[k].reshape(-1) for k in p)
    hjv = hessian.reshape(out.numel(), out.numel()) @ jv
    for k in p:
        torch.testing.assert_close(found[k], (flat[k].T @ hjv).reshape(p[k].shape))


@pytest.mark.parametrize("product", ["ggn_vector_product", "hessian_vector_product"])
def test_a_product_refuses_max_norm_before_it_renormalizes_the_weight(product):
    model = nn.Sequential(nn.Embedding(5, 3, max_norm=0.1), nn.Flatten(), nn.Linear(6, 3)).double()
    before = model[0].weight.detach().clone()
    fn, p = pf.functional(model)
    v = {k: torch.ones_like(t) for k, t in p.items()}
    with pytest.raises(ValueError, match="max_norm"):
        getattr(pf, product)(fn, p, torch.tensor([[0, 1], [2, 3]]), torch.tensor([0, 1]), v)
    assert torch.equal(model[0].weight.detach(), before)


@pytest.mark.parametrize("quantity", ["diag_hessian", "batch_diag_hessian", "kfra"])
def test_a_gradient_with_respect_to_the_inputs_of_a_non_differentiable_quantity_is_refused(
    quantity,
):
    """Only gradients with respect to the parameters were refused; those with respect to X
    were as wrong (a probe: 0.22 against a finite difference of 0.78)."""
    fn, p = pf.functional(_model().double())
    X = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    found = getattr(pf, quantity)(fn, p, X, Y)
    total = sum(t.sum() for t in torch.utils._pytree.tree_leaves(found))
    with pytest.raises(RuntimeError, match="not differentiable with respect to the parameters or"):
        total.backward()


def test_a_gradient_of_pch_block_products_is_refused():
    """Its chain holds second derivatives constant as KFRA's does (a probe: 0.08 against a
    finite difference of -4.23)."""
    fn, p = pf.functional(_model().double())
    leaves = {k: t.requires_grad_() for k, t in p.items()}
    mats = {k: torch.ones(1, *t.shape, dtype=torch.float64) for k, t in p.items()}
    found = pf.pch_block_products(fn, leaves, X.double(), Y, mats)
    with pytest.raises(RuntimeError, match="pch_block_products is not differentiable"):
        sum(t.sum() for t in found.values()).backward()


@pytest.mark.parametrize("layer", ["linear", "conv"])
def test_half_precision_squared_norms_do_not_overflow_where_the_gradients_do_not(layer):
    """An input of norm above 256 overflowed float16 in ‖x‖² although every gradient and its
    squared norm were small: the norms read inf and clipped_grad refused (a probe)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 2) if layer == "linear" else nn.Conv1d(64, 2, 1))
    model.append(nn.Flatten()).half()
    X = ((torch.randn(4, 64) if layer == "linear" else torch.randn(4, 64, 1)) * 60).half()
    fn, p = pf.functional(model)
    with torch.no_grad():
        y = model(X) + 1e-3  # a small output gradient
    loss = nn.MSELoss(reduction="sum")
    found = pf.batch_l2_grad(fn, p, X, y, loss=loss)["0.weight"]
    per_sample = pf.batch_grad(fn, p, X, y, loss=loss)["0.weight"]
    expected = per_sample.double().flatten(1).square().sum(1)
    assert torch.isfinite(found).all() and expected.max() < 10
    torch.testing.assert_close(found.double(), expected, rtol=1e-2, atol=1e-4)


def test_a_zero_dimensional_tensor_among_the_inputs_is_shared_by_the_samples():
    """A temperature passed with the batch ({"x": X, "t": tensor(2.0)}) failed to be sliced
    per sample (found by a probe); it has no batch dimension, as batch_size reads it."""

    def model_fn(p, X):
        return (X["x"] @ p["w"]) / X["t"]

    params = {"w": torch.randn(3, 2, dtype=torch.float64)}
    inputs = {"x": torch.randn(4, 3, dtype=torch.float64), "t": torch.tensor(2.0).double()}
    assert_batch_grad_is_a_loop(model_fn, params, inputs, torch.tensor([0, 1, 1, 0]))


def _mixing_when_padded(p, X):
    x, mask = X
    h = x @ p["w"]
    if not bool(mask.all()):  # another sequence of calls for a batch with padding
        h = h + 0 * (mask[..., None].to(h.dtype) @ p["w"][:1])
    return h.mean(1) - 0.5 * h.mean(1).mean(0)  # mixes samples


def test_a_plan_refused_on_another_sample_than_the_first_stays_refused_for_smaller_batches():
    """A refused plan discovered on sample 3 was compared with row 3 of a batch of two."""
    p = {"w": torch.randn(3, 2, dtype=torch.float64)}
    x, mask = torch.randn(4, 5, 3, dtype=torch.float64), torch.ones(4, 5, dtype=torch.float64)
    mask[3, -1] = 0
    y = torch.tensor([0, 1, 1, 0])
    for batch in (slice(0, 4), slice(2, 4)):
        with pytest.raises(ValueError, match="sample 3 alone"):
            pf.batch_grad(_mixing_when_padded, p, (x[batch], mask[batch]), y[batch])


class _InstanceNormed(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = nn.Conv1d(2, 4, 1)
        self.norm = nn.InstanceNorm1d(4, affine=True, track_running_stats=True)
        self.head = nn.Linear(12, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.norm(self.pre(x))).flatten(1))


@pytest.mark.parametrize("call", ["compute", "ggn_vector_product", "ggn_block_products"])
def test_instance_norm_running_statistics_advance_once_per_forward_of_yours(call):
    """Op-local replays and the products' passes updated them again (a probe: 3 and up to 12
    updates); a call counts as one forward, and products (batch statistics) as none."""
    torch.manual_seed(0)
    model = _InstanceNormed().double()
    reference = copy.deepcopy(model)
    X, y = torch.randn(4, 2, 3, dtype=torch.float64), torch.tensor([0, 1, 2, 0])
    fn, p = pf.functional(model)
    if call == "compute":
        pf.compute(fn, p, X, y, quantities=("grad", "batch_l2_grad"))
        reference(X)  # one forward's update
    elif call == "ggn_vector_product":
        pf.ggn_vector_product(fn, p, X, y, {k: torch.ones_like(t) for k, t in p.items()})
    else:
        pf.ggn_block_products(
            fn, p, X, y, {k: torch.ones(1, *t.shape).double() for k, t in p.items()}
        )
    for name, buffer in reference.named_buffers():
        torch.testing.assert_close(model.get_buffer(name), buffer, rtol=0, atol=0)


def test_options_among_the_inputs_reach_the_whole_model_path():
    """``X = {"input_ids": ids, "output_hidden_states": True}``: the whole-model path mapped
    every input over samples, a bool too (torch's raw vmap ``in_dims`` error)."""
    torch.manual_seed(0)
    W = torch.randn(3, 4, dtype=torch.float64)

    def model_fn(p: dict[str, torch.Tensor], X: dict) -> torch.Tensor:
        h = torch.einsum("ni,ij->jn", X["x"], p["W"]).T  # (its first dim leaves the samples)
        return h * 2 if X["double"] else h

    X = {"x": torch.randn(5, 3, dtype=torch.float64), "double": True}
    assert pf.explain(model_fn, {"W": W}, X)["W"].startswith("whole model")
    assert_batch_grad_is_a_loop(model_fn, {"W": W}, X, torch.tensor([0, 1, 2, 3, 0]))


class _InputChangedAfterUse(nn.Module):
    """A layer's input doubled in place after the layer used it (plain autograd raises)."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second, self.third = nn.Linear(4, 5), nn.Linear(5, 3), nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.first(x)
        out = self.second(hidden)
        hidden.mul_(2)
        return out + self.third(hidden)


@pytest.mark.parametrize("quantity", ["batch_grad", "diag_ggn", "clipped_grad"])
def test_a_layer_input_changed_in_place_after_its_use_is_refused(quantity):
    """The closed forms read the recorded input after the change: ``second.weight``'s
    per-sample gradients came out 2x (norms and GGN diagonal 4x), silently (a probe)."""
    torch.manual_seed(0)
    model_fn, params = pf.functional(_InputChangedAfterUse().double())
    X, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    options = {"max_norm": 1.0} if quantity == "clipped_grad" else {}
    loss = nn.CrossEntropyLoss(reduction="sum")
    with pytest.raises(ValueError, match="changed in place after that call used it"):
        getattr(pf, quantity)(model_fn, params, X, y, loss=loss, **options)


def test_a_ggn_product_through_spectral_norm_in_training_mode_names_the_fix():
    """spectral_norm in training mode runs its power iteration under no_grad with an out= op,
    which forward mode (the GGN products' J t) does not support: torch's NotImplementedError
    named no fix (a probe). Refused in packfunc's words; its vectors stay as they were."""
    torch.manual_seed(0)
    layer = nn.utils.parametrizations.spectral_norm(nn.Linear(4, 4))
    model = nn.Sequential(layer, nn.Tanh(), nn.Linear(4, 3)).double().train()
    model_fn, params = pf.functional(model)
    before = layer.parametrizations.weight[0]._u.clone()
    X4, Y4 = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    with pytest.raises(ValueError, match="under torch.no_grad.*model.eval()"):
        pf.ggn_vector_product(model_fn, params, X4, Y4, params)
    assert torch.equal(layer.parametrizations.weight[0]._u, before)


@torch.library.custom_op("packfunc_tests::signed_square", mutates_args=())
def _signed_square(x: torch.Tensor) -> torch.Tensor:
    return x * x.abs()


@_signed_square.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _keep_input(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[0])


def _signed_square_backward(ctx, g: torch.Tensor) -> torch.Tensor:
    (x,) = ctx.saved_tensors
    return g * 2 * x.abs()


_signed_square.register_autograd(_signed_square_backward, setup_context=_keep_input)


def test_a_custom_op_without_a_vmap_rule_is_refused_naming_register_vmap():
    """A torch.library.custom_op (autograd registered, no vmap rule) on a parameter: the
    refusal told how to fix an autograd.Function (setup_context, generate_vmap_rule), which
    a custom op has not (found by a probe); it names torch.library.register_vmap too."""
    params = {"w": torch.randn(3, 2, dtype=torch.float64)}
    model_fn = lambda p, X: X @ _signed_square(p["w"])  # noqa: E731
    with pytest.raises(ValueError, match=r"torch.library.register_vmap"):
        pf.batch_grad(model_fn, params, X.double(), Y)
