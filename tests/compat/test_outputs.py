"""The shim on extended models that return several tensors (a tuple, a dict, a ``ModelOutput``)."""

from __future__ import annotations

import dataclasses
import types
from typing import NamedTuple

import pytest
import torch
from torch import nn

import packfunc as pf
from packfunc.compat import backpack, extend
from packfunc.compat import extensions as ours
from tests.cases import HUGGING_FACE, hugging_face_inputs


class _Outputs(NamedTuple):
    logits: torch.Tensor
    features: torch.Tensor
    aux: torch.Tensor


@dataclasses.dataclass(frozen=True)
class _FrozenOutputs:
    logits: torch.Tensor
    rest: tuple[torch.Tensor, torch.Tensor]  # (features, aux): a pytree inside the object
    note: str = "kept"


class _SeveralOutputs(nn.Module):
    """Logits, the features they are computed from, and a second head's logits."""

    def __init__(self, container: str) -> None:
        super().__init__()
        self.body, self.head, self.aux = nn.Linear(3, 4), nn.Linear(4, 2), nn.Linear(4, 2)
        self.container = container

    def forward(self, x: torch.Tensor):
        features = torch.tanh(self.body(x))
        found = (self.head(features), features, self.aux(features))
        if self.container == "dict":
            return dict(zip(_Outputs._fields, found))
        if self.container == "namespace":
            return types.SimpleNamespace(**dict(zip(_Outputs._fields, found)))
        if self.container == "frozen dataclass":
            return _FrozenOutputs(found[0], found[1:])
        return _Outputs(*found) if self.container == "namedtuple" else found


def _take(out, name: str) -> torch.Tensor:
    index = _Outputs._fields.index(name)
    if isinstance(out, _FrozenOutputs):
        assert out.note == "kept"
        return out.logits if name == "logits" else out.rest[index - 1]
    if isinstance(out, types.SimpleNamespace):
        return getattr(out, name)
    return out[name] if isinstance(out, dict) else out[index]


def _batch(n: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 0, 1][:n])


@pytest.mark.parametrize(
    "container", ["tuple", "dict", "namedtuple", "namespace", "frozen dataclass"]
)
@pytest.mark.parametrize("taken", ["logits", "aux"])
def test_the_quantities_are_those_of_the_output_the_loss_takes(container, taken):
    """Before: a warning, and nothing computed (an object the pytree does not know, a
    dataclass or a ``SimpleNamespace``: not even a warning, and the last step's
    ``grad_batch`` stayed). Per-sample gradients against a loop of autograd, the GGN
    diagonal against packfunc's functional API on that output alone."""
    torch.manual_seed(0)
    model, lossfunc = extend(_SeveralOutputs(container).double()), extend(nn.CrossEntropyLoss())
    X, y = _batch()
    with backpack(ours.BatchGrad(), ours.DiagGGNExact()):
        out = model(X)
        assert type(out) is type(_SeveralOutputs(container)(X.float()))
        lossfunc(_take(out, taken), y).backward()

    def alone(params, inputs):
        return _take(torch.func.functional_call(model, params, (inputs,)), taken)

    params = {name: p.detach() for name, p in model.named_parameters()}
    ggn = pf.diag_ggn(alone, params, X, y, loss=nn.CrossEntropyLoss())
    for name, p in model.named_parameters():
        rows = [
            torch.autograd.grad(lossfunc(_take(model(X[n : n + 1]), taken), y[n : n + 1]), p,
                                allow_unused=True)[0]
            for n in range(5)
        ]  # fmt: skip
        expected = torch.stack([torch.zeros_like(p) if r is None else r / 5 for r in rows])
        torch.testing.assert_close(p.grad_batch, expected, msg=name)
        torch.testing.assert_close(p.diag_ggn_exact, ggn[name], msg=name)


def test_a_loss_of_an_output_computed_on_the_way_to_another_is_exact():
    """``features`` is also the input of ``logits``: its hook sees the loss's own share only."""
    torch.manual_seed(0)
    model = extend(_SeveralOutputs("tuple").double())
    X, _ = _batch()
    with backpack(ours.BatchGrad()):
        _, features, _ = model(X)
        features.square().sum().backward()
    for p in model.body.parameters():
        torch.testing.assert_close(p.grad_batch.sum(0), p.grad)
    for p in [*model.head.parameters(), *model.aux.parameters()]:  # not reached: zeros
        assert p.grad is None and not p.grad_batch.any()


@pytest.mark.parametrize("second", ["aux", "features"])
def test_a_loss_of_several_outputs_is_refused_by_name(second):
    """Two heads, or a penalty on the features the logits come from: refused, not computed
    from one output's gradient (the features' share through the logits would be counted
    twice, or the other head's left out)."""
    model, lossfunc = extend(_SeveralOutputs("dict")), extend(nn.CrossEntropyLoss())
    X, y = _batch()
    with backpack(ours.BatchGrad()), pytest.raises(ValueError, match="several outputs"):
        out = model(X.float())
        (lossfunc(out["logits"], y) + out[second].square().sum()).backward()


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_hugging_face_model_output_under_the_shim(name):
    """A ``ModelOutput`` with logits ``[N, T, V]``: per-sample gradients of a loss over the
    positions, exact against a loop; the model's own ``.loss`` is refused by name."""
    torch.manual_seed(0)
    model = extend(HUGGING_FACE[name](0.0).model.double().eval())
    lossfunc = extend(nn.CrossEntropyLoss(reduction="sum"))
    X = hugging_face_inputs(name, 3)
    y = torch.randint(0, 20, X.shape)

    def loss_of(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return lossfunc(model(tokens).logits.reshape(-1, 20), targets.reshape(-1))

    with backpack(ours.BatchGrad(), ours.DiagGGNExact()):
        loss_of(X, y).backward()
    weight = model.lm_head.weight
    expected = torch.stack([torch.autograd.grad(loss_of(X[n : n + 1], y[n : n + 1]), weight)[0]
                            for n in range(3)])  # fmt: skip
    torch.testing.assert_close(weight.grad_batch, expected)
    assert weight.diag_ggn_exact.shape == weight.shape
    with backpack(ours.BatchGrad()), pytest.raises(ValueError, match="no row per sample"):
        model(X, labels=y).loss.backward()


def test_a_second_order_rerun_follows_the_output_the_loss_takes_now():
    """The function up to the loss was kept per model and layout, not per output: after a
    loss on ``logits``, a loss on ``aux`` (same shape) took ``logits``' Hessian (0.39 off)."""
    torch.manual_seed(0)
    model, lossfunc = extend(_SeveralOutputs("tuple").double()), extend(nn.CrossEntropyLoss())
    X, y = _batch()
    params = {name: p.detach() for name, p in model.named_parameters()}
    for taken in ("logits", "aux"):
        with backpack(ours.DiagHessian()):
            lossfunc(_take(model(X), taken), y).backward()

        def alone(params, inputs, taken=taken):
            return _take(torch.func.functional_call(model, params, (inputs,)), taken)

        expected = pf.diag_hessian(alone, params, X, y, loss=nn.CrossEntropyLoss())
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.diag_h, expected[name], msg=f"{taken}: {name}")


class _WithNoiseScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(3, 2)
        self.log_sigma = nn.Parameter(torch.tensor(0.3))

    def forward(self, x: torch.Tensor):
        return self.layer(x), self.log_sigma


def test_a_parameter_returned_as_an_output_and_taken_by_the_loss_is_refused():
    """It had no autograd node, so it was not watched: its per-sample gradients came out
    zero where its gradient was -0.31."""
    model = extend(_WithNoiseScale())
    X, y = torch.randn(5, 3), torch.randn(5, 2)
    with backpack(ours.BatchGrad()), pytest.raises(ValueError, match="several outputs"):
        mean, log_sigma = model(X)
        (((mean - y) / log_sigma.exp()).square().sum() / 2 + 10 * log_sigma).backward()
    with backpack(ours.BatchGrad()):  # a loss of the mean alone is computed
        mean, _ = model(X)
        mean.square().sum().backward()
    assert model.layer.weight.grad_batch.shape == (5, 2, 3)


def test_a_plain_backward_of_any_outputs_runs_as_without_extend():
    """Outside ``backpack(...)`` nothing is computed, so nothing is refused: a model's own
    loss, or a loss of several outputs, backpropagates as it would unextended."""
    model = extend(_WithNoiseScale())
    X, y = torch.randn(5, 3), torch.randn(5, 2)
    mean, log_sigma = model(X)
    (((mean - y) / log_sigma.exp()).square().sum() + log_sigma).backward()
    assert model.log_sigma.grad is not None and model.layer.weight.grad is not None
    hf = extend(HUGGING_FACE["gpt2"](0.0).model.eval())
    X = hugging_face_inputs("gpt2", 2)
    hf(X, labels=X).loss.backward()
    assert hf.lm_head.weight.grad is not None
