"""The shim never changes the user's model, and runs models nobody here wrote.

Stored inputs and outputs never overwrite or delete a parameter, buffer, child or
attribute of the user's (``stored_io`` has them); Hugging Face models work in the shim
with the functional API's values; compiled modules and changed losses are named.
"""

from __future__ import annotations

import copy
import io
import warnings
from collections import OrderedDict

import pytest
import torch
from torch import Tensor, nn

import packfunc as pf
from packfunc.compat import backpack, extend, stored_io
from packfunc.compat.extensions import (
    KFAC,
    KFLR,
    KFRA,
    BatchGrad,
    BatchL2Grad,
    DiagGGNExact,
    DiagGGNMC,
    SumGradSquared,
    Variance,
)
from packfunc.engine import batch_pass
from packfunc.engine.randomness import RandomModelError
from tests.cases import (
    HUGGING_FACE,
    assert_trees_close,
    autograd_batch_grad,
    dense_curvature,
    hugging_face_inputs,
    hugging_face_problem,
)


class InputNamedChild(nn.Module):
    """A module whose child is called ``input0`` and which keeps an attribute ``output``."""

    def __init__(self) -> None:
        super().__init__()
        self.input0 = nn.Linear(3, 4)
        self.head = nn.Linear(4, 2)
        self.output = "the user's own"

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.input0(x)))


def _state(model: nn.Module) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    "build",
    [
        lambda: nn.Sequential(
            OrderedDict(hidden=nn.Linear(3, 4), act=nn.ReLU(), output=nn.Linear(4, 2))
        ),
        InputNamedChild,
    ],
    ids=["child_output", "child_input0"],
)
def test_children_and_attributes_named_like_stored_fields_survive(build):
    torch.manual_seed(0)
    model = extend(build())
    lossfunc = extend(nn.CrossEntropyLoss())
    X, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
    before, children = _state(model), dict(model.named_children())
    expected = model(X).detach()
    for _ in range(2):
        model.zero_grad()
        with backpack(BatchGrad(), BatchL2Grad()):
            lossfunc(model(X), y).backward()
    assert dict(model.named_children()) == children
    assert_trees_close(_state(model), before)
    assert torch.equal(model(X), expected)
    for p in model.parameters():
        torch.testing.assert_close(p.grad_batch.sum(0), p.grad)
    if isinstance(model, InputNamedChild):
        assert model.output == "the user's own"


def test_stored_values_of_taken_names_are_in_stored_io():
    layer = extend(nn.Linear(3, 2))
    layer.register_buffer("output", torch.zeros(2))
    seen = {}

    def hook(module: nn.Module) -> None:
        seen[module] = (module.output, stored_io(module))

    x = torch.randn(4, 3, requires_grad=True)
    with backpack(BatchGrad(), extension_hook=hook):
        out = layer(x)
        extend(nn.MSELoss())(out, torch.randn(4, 2)).backward()
    own, stored = seen[layer]
    assert torch.equal(own, torch.zeros(2))  # the buffer, not the stored output
    assert stored["output"] is out and stored["input0"] is x
    assert torch.equal(layer.output, torch.zeros(2)) and stored_io(layer) == {}
    assert not hasattr(layer, "input0")  # the shim's own attribute is gone after backward


def _shim_values(model: nn.Module, X: Tensor, y: Tensor) -> dict:
    extend(model)
    lossfunc = extend(nn.CrossEntropyLoss())
    found = {}
    for ext in [BatchGrad(), BatchL2Grad(), DiagGGNExact(), KFLR()]:
        model.zero_grad()
        with backpack(ext), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # parameters without a Kronecker rule
            lossfunc(model(X), y).backward()
        found[ext.savefield] = {
            k: getattr(p, ext.savefield)
            for k, p in model.named_parameters()
            if hasattr(p, ext.savefield)
        }
    return found


@pytest.mark.parametrize("name", list(HUGGING_FACE))
def test_hugging_face_models_in_the_shim_equal_the_functional_api(name):
    model, X, y = hugging_face_problem(name)
    before = _state(model)
    model_fn, params = pf.functional(model)
    expected = {
        "grad_batch": pf.batch_grad(model_fn, params, X, y),
        "batch_l2": pf.batch_l2_grad(model_fn, params, X, y),
        "diag_ggn_exact": pf.diag_ggn(model_fn, params, X, y),
    }
    kflr = pf.kflr(model_fn, params, X, y, on_unsupported="skip")
    expected["kflr"] = {k: v for k, v in kflr.items() if v is not None}
    assert expected["kflr"], "no layer got Kronecker factors"
    found = _shim_values(model, X, y)
    assert_trees_close(found, expected, name)
    assert_trees_close(_state(model), before)
    with backpack(KFAC()), pytest.warns(UserWarning, match="no Kronecker rule"):
        extend(nn.CrossEntropyLoss())(model(X), y).backward()


@pytest.mark.parametrize("name", list(HUGGING_FACE))
def test_hugging_face_models_with_dropout_are_consistent_or_refused(name):
    torch.manual_seed(0)
    model = extend(HUGGING_FACE[name](0.3).train())
    X = hugging_face_inputs(name, 3)
    before = _state(model)
    out = model(X)
    y = torch.randint(0, out.shape[1], (3,))
    try:
        with backpack(BatchGrad()):
            extend(nn.CrossEntropyLoss())(out, y).backward()
    except RandomModelError as error:
        assert "model.eval()" in str(error)
    else:
        for p in model.parameters():
            torch.testing.assert_close(p.grad_batch.sum(0), p.grad)
    assert_trees_close(_state(model), before)


@pytest.mark.parametrize("name", ["bert", "gpt2", "llama", "vit"])
def test_the_shim_reuses_the_users_forward_of_hugging_face_models(name, monkeypatch):
    own_passes = []
    monkeypatch.setattr(batch_pass, "record", lambda *a, **k: own_passes.append(a))
    torch.manual_seed(0)
    model = extend(HUGGING_FACE[name](0.2).train())  # dropout: a re-run would be refused
    X = hugging_face_inputs(name, 3)
    out = model(X)
    y = torch.randint(0, out.shape[1], (3,))
    with backpack(BatchGrad(), DiagGGNExact(), KFLR()), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "kflr has no Kronecker rule")
        extend(nn.CrossEntropyLoss())(out, y).backward()
    assert not own_passes
    for p in model.parameters():
        torch.testing.assert_close(p.grad_batch.sum(0), p.grad)
    assert any(hasattr(p, "kflr") for p in model.parameters())


def test_extend_refuses_a_compiled_module():
    with pytest.raises(ValueError, match="torch.compile"):
        extend(torch.compile(nn.Linear(2, 2)))


@pytest.mark.parametrize("extension", [KFAC, KFRA, KFLR, DiagGGNExact, DiagGGNMC])
@pytest.mark.parametrize("loss_cls", [nn.CrossEntropyLoss, nn.MSELoss])
def test_second_order_extensions_warn_about_a_changed_loss(extension, loss_cls):
    def loss(scale: float) -> Tensor:
        prediction = torch.rand(5, 2, requires_grad=True)  # no extended model before it
        target = torch.randint(0, 2, (5,)) if loss_cls is nn.CrossEntropyLoss else torch.rand(5, 2)
        return extend(loss_cls())(prediction, target) * scale

    with backpack(extension()), warnings.catch_warnings():
        warnings.simplefilter("error")
        loss(1.0).backward()
    with backpack(extension()), pytest.warns(UserWarning, match="modified"):
        loss(2.0).backward()


class Counting(nn.Module):
    """Counts its forward passes; a hook keeps the last hidden activation (common user state).

    With ``scaled``, the count scales the output (a warm-up factor): the forward then
    depends on state it updates.
    """

    def __init__(self, scaled: bool = False) -> None:
        super().__init__()
        self.hidden, self.head = nn.Linear(3, 4), nn.Linear(4, 2)
        self.calls, self.scaled = 0, scaled
        self.hidden.register_forward_hook(_keep_activation)

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        factor = min(1.0, self.calls / 10) if self.scaled else 1.0
        return self.head(torch.tanh(self.hidden(x)) * factor)


def _keep_activation(module: nn.Module, inputs: tuple, output: Tensor) -> None:
    module.kept = output.detach()


X3, Y3 = torch.randn(5, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 0, 1])


@pytest.mark.parametrize("quantity", ["batch_grad", "diag_ggn", "diag_hessian", "kfac"])
def test_the_functional_api_runs_the_users_forward_once(quantity):
    """Discovery, the last sample's check and re-runs put back what they set on the model:
    a call counts as one forward (the batch pass), whose activation the hook keeps."""
    model = Counting().double()
    model_fn, params = pf.functional(model)
    for calls in (1, 2):
        getattr(pf, quantity)(model_fn, params, X3, Y3)
        assert model.calls == calls
        assert model.hidden.kept.shape == (5, 4)


@pytest.mark.parametrize("frozen", [False, True])
def test_the_shim_leaves_the_users_forward_state(frozen):
    """The shim's passes (discovery, its own pass where a layer is frozen) set nothing on
    the model: the counter counts the user's forwards, the hook keeps the user's batch."""
    model = extend(Counting().double())
    model.hidden.requires_grad_(not frozen)
    lossfunc = extend(nn.CrossEntropyLoss())
    expected = []
    for n in range(len(X3)):
        model.zero_grad()
        lossfunc(model(X3[n : n + 1]), Y3[n : n + 1]).backward()
        expected.append(model.head.weight.grad.clone() / len(X3))
    model.calls = 0
    for step in (1, 2):
        with backpack(BatchGrad()):
            lossfunc(model(X3), Y3).backward()
        assert model.calls == step
        assert model.hidden.kept.shape == (5, 4)
        torch.testing.assert_close(model.head.weight.grad_batch, torch.stack(expected))


def test_a_forward_that_depends_on_state_it_updates_is_refused_not_rerun():
    """The shim's own pass (for an earlier forward, whose recording a later one released)
    would run another function than the user's forward: refused against the rows it kept,
    and the model is left as the user's forwards left it."""
    model = extend(Counting(scaled=True).double())
    lossfunc = extend(nn.CrossEntropyLoss())
    with backpack(BatchGrad()), pytest.raises(ValueError, match="computed another output"):
        first = lossfunc(model(X3), Y3)
        model(X3)  # a later forward: the first one is answered by packfunc's own pass
        first.backward()
    assert model.calls == 2


@pytest.mark.parametrize("extension", [DiagGGNExact, KFLR, KFRA])
def test_a_second_order_pass_for_an_earlier_forward_is_checked_against_its_rows(extension):
    """Second-order passes compute the loss input, whose rows were not kept when a later
    forward released the output: nothing was compared, and a forward depending on state it
    updates gave another function's curvature (a probe: DiagGGNExact off by 0.58)."""
    model = extend(Counting(scaled=True).double())
    lossfunc = extend(nn.CrossEntropyLoss())
    with backpack(extension()), pytest.raises(ValueError, match="computed another output"):
        first = lossfunc(model(X3), Y3)
        model(X3)
        first.backward()


class Tempered(nn.Module):
    """``l2(tanh(l1(x) / temperature))``, the temperature a plain attribute."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2, self.temperature = nn.Linear(3, 4), nn.Linear(4, 2), 1.0

    def forward(self, x: Tensor) -> Tensor:
        return self.l2(torch.tanh(self.l1(x) / self.temperature))


def test_kfra_after_a_change_the_model_state_does_not_cover_is_refused():
    """KFRA runs the model again; a Python attribute changed between the forward and the
    backward gave another function's factors (a probe: off by 0.098 of 0.113)."""
    torch.manual_seed(0)
    model = extend(Tempered().double())
    lossfunc = extend(nn.CrossEntropyLoss())
    with backpack(KFRA()), pytest.raises(ValueError, match="computed another output"):
        loss = lossfunc(model(X3), Y3)
        model.temperature = 3.0
        loss.backward()


@pytest.mark.parametrize("order", ["hook before extend", "hook after extend", "the forward"])
def test_an_output_the_user_keeps_under_the_stored_name_is_never_deleted(order):
    """``mod.output = out`` (a hook keeping activations) holds the very tensor the shim
    stores; the shim's cleanup took it for its own and deleted it (found by a probe)."""

    class Keeping(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(3, 2)

        def forward(self, x: Tensor) -> Tensor:
            out = torch.tanh(self.linear(x))
            if order == "the forward":
                self.output = out
            return out

    model = nn.Sequential(Keeping(), nn.Linear(2, 2)).double()

    def keep(module: nn.Module, inputs: tuple, out: Tensor) -> None:
        module.output = out

    if order == "hook before extend":
        model[0].register_forward_hook(keep)
    extend(model)
    if order == "hook after extend":
        model[0].register_forward_hook(keep)
    with backpack(BatchGrad()):
        extend(nn.CrossEntropyLoss())(model(X3), Y3).backward()
    assert isinstance(model[0].output, Tensor)
    assert not hasattr(model[1], "output")  # the shim's own, deleted as in BackPACK


@pytest.mark.parametrize("extension", [BatchGrad, DiagGGNExact])
def test_a_hook_registered_after_extend_that_replaces_the_output_is_followed(extension):
    """The shim recorded the output before such a hook ran: BatchGrad was refused as mixing
    samples and DiagGGNExact found no loss (a probe); BackPACK computes it."""
    torch.manual_seed(0)
    model = extend(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double())
    model.register_forward_hook(lambda module, inputs, out: 2 * out)
    with backpack(extension()):
        extend(nn.CrossEntropyLoss())(model(X3), Y3).backward()
    doubled, params = pf.functional(model)  # (its forward runs the hook)
    assert torch.allclose(doubled(params, X3), 2 * model[:](X3))
    if extension is BatchGrad:
        expected = pf.batch_grad(doubled, params, X3, Y3)
        assert_trees_close({k: p.grad_batch for k, p in model.named_parameters()}, expected)
    else:
        expected = pf.diag_ggn(doubled, params, X3, Y3)
        assert_trees_close({k: p.diag_ggn_exact for k, p in model.named_parameters()}, expected)


class _Attending(nn.Module):
    """Attention between two linear layers: the shim runs its own pass (not the user's)."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Linear(3, 4), nn.Linear(4, 2)
        self.attention = nn.MultiheadAttention(4, 2, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.embed(x))
        return self.head(self.attention(h, h, h)[0].mean(1))


@pytest.mark.parametrize("registered", ["before extend", "after extend"])
@pytest.mark.parametrize("extension", [BatchGrad, DiagGGNExact, KFRA])
def test_a_forward_pre_hook_on_the_model_is_applied_once(registered, extension):
    """A pre-hook that scales the model's inputs: packfunc's passes ran the model from the
    inputs its forward saw, the hook applied again (refused as mixing samples, or as an own
    pass computing another output, by a probe; a hook changing inner rows only would have
    passed the first and last rows' checks). They now start from the caller's inputs."""
    torch.manual_seed(0)
    if extension is KFRA:  # (a sequential model)
        model, X, y = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double(), X3, Y3
    else:  # (its own pass)
        model, X = _Attending().double().eval(), torch.randn(4, 3, 3, dtype=torch.float64)
        y = torch.tensor([0, 1, 1, 0])
    plain = copy.deepcopy(model)
    scale = lambda module, inputs: (2 * inputs[0],)  # noqa: E731
    if registered == "before extend":
        model.register_forward_pre_hook(scale)
    model = extend(model)
    if registered == "after extend":
        model.register_forward_pre_hook(scale)
    loss = nn.CrossEntropyLoss()
    with backpack(extension()):
        extend(copy.deepcopy(loss))(model(X), y).backward()
    if extension is BatchGrad:
        expected = autograd_batch_grad(plain, loss, 2 * X, y)
        assert_trees_close({k: p.grad_batch for k, p in model.named_parameters()}, expected)
    elif extension is DiagGGNExact:
        dense = dense_curvature(plain, loss, 2 * X, y)
        found = dense.flatten({k: p.diag_ggn_exact for k, p in model.named_parameters()})
        torch.testing.assert_close(found, dense.ggn.diagonal())
    else:
        expected = pf.kfra(*pf.functional(plain), 2 * X, y, loss=loss)
        assert_trees_close({k: p.kfra for k, p in model.named_parameters()}, expected)


def test_a_pre_hook_put_before_the_shims_is_refused_then_follows_it():
    """A pre-hook registered with ``prepend=True`` after ``extend`` changes the inputs before
    the shim sees them: that forward's backward is refused with the fix; the shim's goes
    first from the next forward on, whose results are the hooked model's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    plain = copy.deepcopy(model)
    model = extend(model)
    model.register_forward_pre_hook(lambda module, inputs: (2 * inputs[0],), prepend=True)
    lossfunc = extend(nn.CrossEntropyLoss())
    with backpack(BatchGrad()), pytest.raises(ValueError, match="prepend=True"):
        lossfunc(model(X3), Y3).backward()
    with backpack(BatchGrad()):
        lossfunc(model(X3), Y3).backward()
    expected = autograd_batch_grad(plain, nn.CrossEntropyLoss(), 2 * X3, Y3)
    assert_trees_close({k: p.grad_batch for k, p in model.named_parameters()}, expected)


def test_an_input_changed_in_place_after_the_forward_is_refused_on_a_rerun():
    model = extend(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double())
    lossfunc = extend(nn.CrossEntropyLoss())
    buffer = X3.clone()
    with backpack(BatchGrad()), pytest.raises(ValueError, match="changed in place"):
        loss = lossfunc(model(buffer), Y3)
        model(X3)  # a later forward: the first one is answered by packfunc's own pass
        buffer.mul_(2)  # a reused input buffer
        loss.backward()


def test_a_frozen_layer_and_dropout_reuse_the_users_forward():
    """Fine-tuning: the frozen layer is a constant of the user's forward, whose dropout
    masks the quantities come from (no own pass, which dropout would refuse): as BackPACK."""
    bp = pytest.importorskip("backpack")
    from backpack import extensions as bp_extensions

    def build() -> nn.Module:
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Dropout(0.4), nn.Linear(6, 2))
        model[0].requires_grad_(False)
        return model.double()

    found = {}
    for name, (ours, extension) in {
        "packfunc": ((extend, backpack), BatchGrad()),
        "backpack": ((bp.extend, bp.backpack), bp_extensions.BatchGrad()),
    }.items():
        extend_with, context = ours
        model, lossfunc = extend_with(build()), extend_with(nn.CrossEntropyLoss())
        torch.manual_seed(7)
        with context(extension):
            lossfunc(model(X3), Y3).backward()
        found[name] = model[3].weight.grad_batch
    torch.testing.assert_close(found["packfunc"], found["backpack"])


def test_an_extended_model_pickles_after_a_step():
    model = extend(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double())
    lossfunc = extend(nn.CrossEntropyLoss())
    with backpack(BatchGrad()):
        lossfunc(model(X3), Y3).backward()
    torch.save(model, io.BytesIO())


def test_a_refused_call_of_the_functional_api_leaves_the_model_as_it_was():
    model = Counting(scaled=True).double()
    model_fn, params = pf.functional(model)
    with pytest.raises(ValueError, match="Python state it updates"):
        pf.batch_grad(model_fn, params, X3, Y3)
    assert model.calls == 0 and not hasattr(model.hidden, "kept")


@pytest.mark.parametrize("hooked", ["model", "model_pre", "loss"])
def test_full_backward_hooks_on_the_model_or_the_loss_are_the_users(hooked):
    """The identity a full backward hook wraps the output (or the loss input) in is no
    rearrangement: second-order extensions find the loss; packfunc's own runs of the loss
    do not call the user's hook (it runs once, in the user's backward), as in BackPACK."""

    def run(hook: bool) -> tuple[Tensor, int]:
        torch.manual_seed(0)
        model = extend(nn.Sequential(nn.Linear(3, 4), nn.Sigmoid(), nn.Linear(4, 2)).double())
        lossfunc, calls = extend(nn.CrossEntropyLoss()), []
        if hook and hooked == "model":
            model.register_full_backward_hook(lambda *_: calls.append(1))
        if hook and hooked == "model_pre":
            model.register_full_backward_pre_hook(lambda *_: calls.append(1))
        if hook and hooked == "loss":
            lossfunc.register_full_backward_hook(lambda *_: calls.append(1))
        with backpack(DiagGGNExact(), BatchGrad()):
            lossfunc(model(X3), Y3).backward()
        return model[0].weight.diag_ggn_exact, len(calls)

    (expected, _), (found, calls) = run(hook=False), run(hook=True)
    torch.testing.assert_close(found, expected)
    assert calls == 1


class _HookedNet(nn.Module):
    """Sums the squared output gradient its inner layer sees into a buffer, by a full
    backward hook on the layer (``hook="module"``) or a tensor hook its forward registers."""

    def __init__(self, hook: str) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.hook = hook
        self.body, self.head = nn.Linear(3, 4).double(), nn.Linear(4, 2).double()
        self.register_buffer("seen", torch.zeros(4, dtype=torch.float64))
        if hook == "module":
            self.body.register_full_backward_hook(self._note)

    def _note(self, module: nn.Module, grad_input: tuple, grad_output: tuple) -> None:
        self._seen(grad_output[0])

    def _seen(self, g: Tensor) -> None:
        self.seen.add_(g.pow(2).sum(0))

    def forward(self, x: Tensor) -> Tensor:
        hidden = self.body(x)
        if self.hook == "tensor":
            hidden.register_hook(self._seen)
        return self.head(torch.tanh(hidden))


@pytest.mark.parametrize("extension", [BatchGrad, BatchL2Grad, SumGradSquared, Variance])
@pytest.mark.parametrize("hook", ["module", "tensor"])
def test_hooks_inside_the_model_run_once_with_first_order_extensions(extension, hook):
    """A full backward hook on an inner layer that sums what it sees into a buffer (a
    gradient statistic), or a tensor hook the forward registers (Grad-CAM's): packfunc's
    pullback of the output's gradient ran them a second time (the buffer twice a plain
    step's, BackPACK's once). First-order extensions take the user's backward pass's
    cotangents instead: once, the buffer as in a plain step, the results a plain loop's."""
    plain, lossfunc = _HookedNet(hook), nn.CrossEntropyLoss()
    lossfunc(plain(X3), Y3).backward()
    model = extend(_HookedNet(hook))
    with backpack(extension()):
        extend(nn.CrossEntropyLoss())(model(X3), Y3).backward()
    torch.testing.assert_close(model.seen, plain.seen)
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
        if extension is BatchGrad:
            torch.testing.assert_close(p.grad_batch.sum(0), q.grad)


def test_an_input_made_in_inference_mode_is_read_without_a_version():
    """A tensor made under ``torch.inference_mode()`` keeps no version counter; a frozen
    first layer does not save it, so plain PyTorch runs: so does the shim."""
    model = extend(nn.Sequential(nn.Linear(3, 2)).double())
    model[0].weight.requires_grad_(False)
    lossfunc = extend(nn.CrossEntropyLoss(reduction="sum"))
    with torch.inference_mode():
        X = X3.clone()
    with backpack(BatchGrad()):
        lossfunc(model(X), Y3).backward()
    rows = [torch.nn.functional.one_hot(Y3, 2).double()]
    expected = torch.softmax(model(X3), 1).detach() - rows[0]  # the bias's per-sample gradients
    torch.testing.assert_close(model[0].bias.grad_batch, expected)


def test_a_loss_on_a_slice_of_the_output_names_the_slice():
    """The refusal told the user to do what they did (extend the loss, apply it to the
    output); the slice between them is what the shim cannot follow (a probe)."""
    model = extend(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double())
    with backpack(DiagGGNExact()), pytest.raises(ValueError, match=r"a slice out\[:, -1\]"):
        out = model(X3)
        extend(nn.CrossEntropyLoss())(out[:, :2] / 2, Y3).backward()


def test_an_encoder_on_nested_tensors_is_refused_not_changed_by_the_recording():
    """PyTorch's nested-tensor path (evaluation mode, a padding mask, frozen weights) leaves
    padded positions zero; under the shim's recording mode it took its other path, and the
    model's output changed under extend() (found by a probe)."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=12, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=True).double().eval()
    encoder.requires_grad_(False)
    head = nn.Linear(8, 2).double()

    class Classifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder, self.head = encoder, head

        def forward(self, x, mask):
            return self.head(self.encoder(x, src_key_padding_mask=mask).mean(1))

    model = extend(Classifier())
    x, mask = torch.randn(3, 4, 8, dtype=torch.float64), torch.zeros(3, 4, dtype=torch.bool)
    mask[1, -2:] = True
    with backpack(BatchGrad()), pytest.raises(ValueError, match="enable_nested_tensor=False"):
        model(x, mask)
    with backpack(BatchGrad()):  # an input requiring grad: both take the other path
        extend(nn.CrossEntropyLoss())(
            model(x.clone().requires_grad_(), mask), torch.tensor([0, 1, 1])
        ).backward()
    assert torch.allclose(head.weight.grad_batch.sum(0), head.weight.grad)
    head.zero_grad()
    encoder.use_nested_tensor = False  # (as built with enable_nested_tensor=False)
    with backpack(BatchGrad()):  # the refusal left the shim's state as it was
        extend(nn.CrossEntropyLoss())(model(x, mask), torch.tensor([0, 1, 1])).backward()
    assert torch.allclose(head.weight.grad_batch.sum(0), head.weight.grad)


def test_a_statistic_of_a_parameter_under_no_grad_is_a_constant_in_the_shim():
    """Its derivation was replayed with gradients (found by a probe, functional API too)."""

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale, self.linear = nn.Parameter(torch.randn(3)), nn.Linear(3, 2)

        def forward(self, x: Tensor) -> Tensor:
            with torch.no_grad():
                twice = self.scale * 2
            return self.linear(x * twice + x * self.scale)

    torch.manual_seed(0)
    model = extend(Scaled().double())
    with backpack(BatchGrad()):
        extend(nn.CrossEntropyLoss(reduction="sum"))(model(X3), Y3).backward()
    assert torch.allclose(model.scale.grad_batch.sum(0), model.scale.grad)
