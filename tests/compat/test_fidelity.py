"""BackPACK code that used to go wrong or fail on the shim (issue 8), checked against
autograd and, where BackPACK computes the case, BackPACK itself."""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch
from torch import nn

import packfunc as pf
from packfunc.compat import backpack, disable, extend
from packfunc.compat import extensions as ours
from packfunc.compat.custom_module.slicing import Slicing
from tests.cases import run_backward_with

pytestmark = pytest.mark.filterwarnings(
    "ignore:Full backward hook is firing", "ignore:Using backward\\(\\) with create_graph=True"
)


def _data(n: int = 5, d: int = 3, classes: int = 2):
    torch.manual_seed(0)
    return (torch.randn(n, d, dtype=torch.float64), torch.randint(0, classes, (n,)))


def _per_sample_grads(model: nn.Module, loss: nn.Module, X, y) -> list[torch.Tensor]:
    """Autograd oracle: sample n's gradient of the reduced loss."""
    scale = 1.0 / len(X) if loss.reduction == "mean" else 1.0
    single = type(loss)(reduction="sum")
    rows = [
        torch.autograd.grad(
            single(model(X[n : n + 1]), y[n : n + 1]) * scale, list(model.parameters())
        )
        for n in range(len(X))
    ]
    return [torch.stack(column) for column in zip(*rows)]


def _mlp(inplace: bool = False) -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(
        nn.Linear(3, 4), nn.ReLU(inplace=inplace), nn.Linear(4, 4), nn.Sigmoid(), nn.Linear(4, 2)
    ).double()


def _functional_diag_ggn(model: nn.Module, loss: nn.Module, X, y) -> dict:
    fn, params = pf.functional(model)
    return pf.diag_ggn(fn, params, X, y, loss=loss)


# ---------------------------------------------------------------- silently wrong before


def test_create_graph_gives_right_and_differentiable_first_order_quantities():
    X, y = _data()
    model, lossfunc = extend(_mlp()), extend(nn.CrossEntropyLoss())
    loss = lossfunc(model(X), y)
    with backpack(ours.BatchGrad(), ours.Variance(), ours.BatchL2Grad()):
        loss.backward(create_graph=True)
    expected = _per_sample_grads(_mlp(), nn.CrossEntropyLoss(), X, y)
    for p, g in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad_batch, g)
        assert p.grad_batch.requires_grad and p.variance.requires_grad
    # gradient of the summed variance w.r.t. the first weight, against autograd
    w = model[0].weight
    (ours_grad,) = torch.autograd.grad(model[2].weight.variance.sum(), w)
    reference = _mlp()

    def variance_sum(weight):
        fn, params = pf.functional(reference)
        params = {**params, "0.weight": weight}
        return pf.variance(fn, params, X, y, loss=nn.CrossEntropyLoss())["2.weight"].sum()

    expected_grad = torch.func.grad(variance_sum)(reference[0].weight.detach())
    torch.testing.assert_close(ours_grad, expected_grad)


def test_inplace_activation_after_a_layer_is_right():
    X, y = _data()
    model, lossfunc = extend(_mlp(inplace=True)), extend(nn.CrossEntropyLoss())
    loss = lossfunc(model(X), y)
    with backpack(ours.BatchGrad(), ours.DiagGGNExact()):
        loss.backward()
    expected = _per_sample_grads(_mlp(), nn.CrossEntropyLoss(), X, y)
    ggn = _functional_diag_ggn(_mlp(), nn.CrossEntropyLoss(), X, y)
    for (name, p), g in zip(model.named_parameters(), expected):
        torch.testing.assert_close(p.grad_batch, g)
        torch.testing.assert_close(p.grad_batch.sum(0), p.grad)
        torch.testing.assert_close(p.diag_ggn_exact, ggn[name])


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_second_loss_on_the_same_output_is_not_used(reduction):
    X, y = _data()
    model = extend(_mlp())
    lossfunc = extend(nn.CrossEntropyLoss(reduction=reduction))
    logger = extend(nn.CrossEntropyLoss(reduction="none"))
    output = model(X)
    loss = lossfunc(output, y)
    logger(output, y)  # per-sample losses for logging, never backpropagated
    with backpack(ours.DiagGGNExact()):
        loss.backward()
    ggn = _functional_diag_ggn(_mlp(), nn.CrossEntropyLoss(reduction=reduction), X, y)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.diag_ggn_exact, ggn[name])


def test_two_extended_losses_in_one_backward_are_refused_for_second_order():
    X, y = _data()
    model, first, second = (
        extend(_mlp()),
        extend(nn.CrossEntropyLoss()),
        extend(nn.CrossEntropyLoss(reduction="sum")),
    )
    output = model(X)
    with backpack(ours.DiagGGNExact()), pytest.raises(ValueError, match="2 extended losses"):
        (first(output, y) + second(output, y)).backward()


# ---------------------------------------------------------------- worked on BackPACK only


@pytest.mark.parametrize("extension", ["DiagGGNExact", "KFLR", "DiagHessian"])
def test_loss_on_a_reshaped_output_matches_backpack(extension):
    X, y = _data()
    model, lossfunc = extend(_mlp()), extend(nn.CrossEntropyLoss())
    f = model(X)
    loss = lossfunc(f.view(-1, f.size(-1)), y.view(-1))
    with backpack(getattr(ours, extension)()):
        loss.backward()
    bp = pytest.importorskip("backpack")
    theirs = pytest.importorskip("backpack.extensions")
    reference = run_backward_with(
        bp, [getattr(theirs, extension)()], _mlp(), nn.CrossEntropyLoss(), X, y
    )
    field = getattr(ours, extension)().savefield
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(getattr(p, field), getattr(q, field))


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_sequence_loss_on_flattened_positions_is_exact(reduction):
    """``[N, T, C]`` logits flattened to ``[N·T, C]``: every sample owns T rows."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 5)).double()
    X, y = torch.randn(4, 6, 3, dtype=torch.float64), torch.randint(0, 5, (4, 6))
    extend(model)
    lossfunc = extend(nn.CrossEntropyLoss(reduction=reduction))
    f = model(X)
    loss = lossfunc(f.reshape(-1, 5), y.reshape(-1))
    with backpack(ours.DiagGGNExact(), ours.BatchGrad()):
        loss.backward()
    fn, params = pf.functional(model)
    canonical = pf.diag_ggn(
        lambda p, x: fn(p, x).transpose(1, 2),
        params,
        X,
        y,
        loss=nn.CrossEntropyLoss(reduction=reduction),
    )
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.diag_ggn_exact, canonical[name])
        torch.testing.assert_close(p.grad_batch.sum(0), p.grad)


def test_separately_extended_layers_chained_in_plain_code():
    X, y = _data()
    torch.manual_seed(2)
    l1, l2 = nn.Linear(3, 4).double(), nn.Linear(4, 2).double()
    reference = nn.Sequential(l1, nn.Identity(), l2)
    ggn = _functional_diag_ggn(reference, nn.CrossEntropyLoss(), X, y)
    hessian = pf.diag_hessian(*pf.functional(reference), X, y, loss=nn.CrossEntropyLoss())
    l1, l2, lossfunc = extend(l1), extend(l2), extend(nn.CrossEntropyLoss())
    loss = lossfunc(l2(l1(X)), y)
    with backpack(ours.DiagGGNExact(), ours.DiagHessian()):
        loss.backward()
    for name, p in [("0.weight", l1.weight), ("0.bias", l1.bias), ("2.weight", l2.weight)]:
        torch.testing.assert_close(p.diag_ggn_exact, ggn[name])
        torch.testing.assert_close(p.diag_h, hessian[name])


def test_loss_through_an_extended_slicing_module_with_retain_graph():
    X = torch.rand(3, 6, dtype=torch.float64)
    model = extend(nn.Sequential(nn.Linear(6, 5), nn.Sigmoid(), nn.Linear(5, 6)).double())
    lossfunc = extend(nn.MSELoss())
    full = _functional_diag_ggn(model, nn.MSELoss(), X, X)
    output = model(X)
    total = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
    for start in (0, 3):
        part = (slice(None), slice(start, start + 3))
        loss = lossfunc(extend(Slicing(part))(output), X[part])
        with backpack(ours.DiagGGNExact(), retain_graph=True):
            loss.backward(retain_graph=True)
        for name, p in model.named_parameters():
            total[name] += p.diag_ggn_exact / 2
    for name in total:
        torch.testing.assert_close(total[name], full[name])


def test_curvature_products_take_a_single_matrix_and_run_inside_the_context():
    X, y = _data()
    model, lossfunc = extend(_mlp()), extend(nn.MSELoss())
    target = torch.randn(len(X), 2, dtype=torch.float64)
    loss = lossfunc(model(X), target)
    with backpack(ours.GGNMP(), ours.HMP()):
        loss.backward()
        for p in model.parameters():
            mat = torch.randn(p.shape, dtype=torch.float64)
            single = p.ggnmp(mat)
            assert single.shape == p.shape
            torch.testing.assert_close(single, p.ggnmp(mat.unsqueeze(0))[0])
            assert p.hmp(mat).shape == p.shape


def test_extension_hook_visits_each_computing_module_once():
    X, y = _data()
    model = extend(
        nn.Sequential(nn.Sequential(nn.Linear(3, 4), nn.ReLU()), nn.Linear(4, 2)).double()
    )
    lossfunc = extend(nn.CrossEntropyLoss())
    visited: list[nn.Module] = []
    loss = lossfunc(model(X), y)
    with backpack(ours.BatchGrad(), extension_hook=visited.append):
        loss.backward()
    assert [type(m).__name__ for m in visited] == ["CrossEntropyLoss", "Linear", "ReLU", "Linear"]


def test_inputs_and_outputs_are_stored_as_backpack_stores_them():
    X, y = _data()
    model, lossfunc = extend(_mlp()), extend(nn.CrossEntropyLoss())
    with torch.no_grad():
        model(X)
    assert not hasattr(model[0], "input0")
    loss = lossfunc(model(X), y)
    assert model[0].input0 is X and hasattr(model[4], "output")
    loss.backward()  # outside backpack(...): the stored inputs and outputs are dropped
    assert not hasattr(model[0], "input0") and not hasattr(model[4], "output")
    with disable():
        assert not disable.should_store_io()
        model(X)
    assert disable.should_store_io() and not hasattr(model[0], "input0")


def test_modified_loss_output_warns():
    X, y = _data()
    model, lossfunc = extend(_mlp()), extend(nn.CrossEntropyLoss())
    loss = lossfunc(model(X), y)
    with backpack(ours.DiagGGNExact()), pytest.warns(UserWarning, match="seems to have been"):
        (2 * loss).backward()
    loss = lossfunc(model(X), y)
    with backpack(ours.DiagGGNExact()), warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        loss.backward()


@pytest.mark.parametrize(
    ("extension", "oracle"), [(ours.DiagGGNExact, pf.diag_ggn), (ours.DiagHessian, pf.diag_hessian)]
)
def test_second_order_refuses_a_penalty_on_the_output_beside_the_loss(extension, oracle):
    """``(lossfunc(out, y) + 0.1 * out.pow(2).mean()).backward()``: first-order quantities took
    the penalty's gradient while the curvature silently left it out (in the report, a last
    bias's diagonal 0.25 for 0.31; BackPACK's does the same). Refused, naming the fix, which works;
    a scaled loss only warns, and first-order extensions take the penalty."""
    X, y = _data()
    model, lossfunc = extend(_mlp()), extend(nn.CrossEntropyLoss())
    out = model(X)
    with backpack(extension()), pytest.raises(ValueError, match="outside the backpack"):
        (lossfunc(out, y) + 0.1 * out.pow(2).mean()).backward()
    out = model(X)  # the fix the message names: the term in a backward pass of its own
    with backpack(extension()):
        lossfunc(out, y).backward(retain_graph=True)
    (0.1 * out.pow(2).mean()).backward()
    fn, params = pf.functional(_mlp())
    expected = oracle(fn, params, X, y, loss=nn.CrossEntropyLoss())
    for name, p in model.named_parameters():
        torch.testing.assert_close(getattr(p, extension().savefield), expected[name])
    out = model(X)
    with backpack(extension()), pytest.warns(UserWarning, match="seems to have been"):
        (3.0 * lossfunc(out.view(-1, 2), y)).backward()  # a scaled loss: its warning only
    model.zero_grad()
    out = model(X)
    with backpack(ours.BatchGrad()):
        (lossfunc(out, y) + 0.1 * out.pow(2).mean()).backward()
    for p in model.parameters():
        torch.testing.assert_close(p.grad_batch.sum(0), p.grad)


class _KeepsHidden(nn.Module):
    """An MLP that keeps its hidden activation (for a loss term on it)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.inner, self.head = nn.Linear(3, 4).double(), nn.Linear(4, 2).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.hidden = torch.tanh(self.inner(x))
        return self.head(self.hidden)


@pytest.mark.parametrize("extension", ["BatchGrad", "BatchL2Grad", "Variance", "SumGradSquared"])
def test_a_loss_term_on_a_hidden_activation_is_in_first_order_results(extension, backpack_oracle):
    """``(lossfunc(out, y) + 0.5 * model.hidden.pow(2).sum()).backward()``: the term reaches
    the inner layer's output directly. First-order extensions take the layers' cotangents from
    the user's backward pass, so their results hold it, as BackPACK's do (and as a loop of
    per-sample gradients of the loss with the term); it was refused."""
    X, y = _data()
    results = []
    for extend_, backpack_, extensions in (
        (extend, backpack, ours),
        (backpack_oracle.extend, backpack_oracle.backpack, backpack_oracle.extensions),
    ):
        model, lossfunc = extend_(_KeepsHidden()), extend_(nn.CrossEntropyLoss())
        with backpack_(getattr(extensions, extension)()):
            out = model(X)
            (lossfunc(out, y) + 0.5 * model.hidden.pow(2).sum()).backward()
        savefield = getattr(ours, extension)().savefield
        results.append([getattr(p, savefield) for p in model.parameters()])
    for ours_, theirs in zip(*results, strict=True):
        torch.testing.assert_close(ours_, theirs)
    if extension == "BatchGrad":
        model = _KeepsHidden()
        for n in range(len(X)):
            term = nn.CrossEntropyLoss(reduction="sum")(model(X[n : n + 1]), y[n : n + 1]) / len(X)
            found = torch.autograd.grad(term + 0.5 * model.hidden.pow(2).sum(), model.parameters())
            for p, g in zip(results[0], found, strict=True):
                torch.testing.assert_close(p[n], g)


def test_a_small_term_on_a_hidden_activation_and_clipped_sums_are_refused_too():
    """Found by a probe of the check: ``ClippedGrad`` (which uses the loss function) took the
    term's absence silently (1.48 off ``.grad`` with nothing clipped), a term of weight 1e-4
    passed a fixed 1e-4 tolerance in float64, and a refusal left ``grad_clipped`` and the
    second-order results behind."""
    X, y = _data()
    model, lossfunc = extend(_KeepsHidden()), extend(nn.CrossEntropyLoss(reduction="sum"))
    extensions = (ours.ClippedGrad(1e6), ours.BatchGrad(), ours.DiagGGNExact())
    for weight, used in ((0.5, extensions[:1]), (1e-4, extensions)):
        out = model(X)
        with backpack(*used), pytest.raises(ValueError, match="activation the forward keeps"):
            (lossfunc(out, y) + weight * model.hidden.pow(2).sum()).backward()
        for p in model.parameters():
            assert not any(hasattr(p, e.savefield) for e in extensions)


def test_a_hook_on_the_output_is_refused_and_a_retained_output_gradient_kept():
    """Found by a probe: a hook on the model's output ran again in packfunc's own pullback
    (``grad_batch`` summing to twice ``.grad``, 0.24 off), and ``out.retain_grad()`` came
    out three times the plain backward's. The hook is refused naming the fix (on a copy),
    which works; the retained gradient is put back."""
    X, y = _data()
    model, lossfunc = extend(_KeepsHidden()), extend(nn.CrossEntropyLoss())
    out = model(X)
    out.register_hook(lambda g: 2 * g)
    with backpack(ours.BatchGrad()), pytest.raises(ValueError, match=r"out.clone\(\)"):
        lossfunc(out, y).backward()
    model.zero_grad()
    out = model(X).clone()
    out.register_hook(lambda g: 2 * g)
    with backpack(ours.BatchGrad()):
        lossfunc(out, y).backward()
    for p in model.parameters():
        torch.testing.assert_close(p.grad_batch.sum(0), p.grad)
    plain = model(X)
    plain.retain_grad()
    lossfunc(plain, y).backward()
    out = model(X)
    out.retain_grad()
    with backpack(ours.BatchGrad(), ours.DiagGGNExact()):
        lossfunc(out, y).backward()
    torch.testing.assert_close(out.grad, plain.grad)


@pytest.mark.parametrize("extensions", [("BatchGrad",), ("BatchGrad", "DiagGGNExact"), ("KFAC",)])
def test_a_retained_gradient_inside_the_model_is_the_plain_backwards(extensions):
    """``model.hidden.retain_grad()`` inside an extended model: packfunc's pullbacks through
    the user's graph added to the retained ``.grad`` again (twice, three times the plain
    backward's). It is put back after them, as the output's is."""
    X, y = _data()
    model, lossfunc = extend(_KeepsHidden()), extend(nn.CrossEntropyLoss())
    lossfunc(model(X), y).backward()
    plain = model.hidden.grad
    assert plain is None  # (not retained: no .grad)
    out = model(X)
    model.hidden.retain_grad()
    lossfunc(out, y).backward()
    expected = model.hidden.grad.clone()
    model.zero_grad()
    out = model(X)
    model.hidden.retain_grad()
    with backpack(*(getattr(ours, name)() for name in extensions)):
        lossfunc(out, y).backward()
    torch.testing.assert_close(model.hidden.grad, expected)


class _RetainsHidden(_KeepsHidden):
    """Retains its hidden activation's gradient in its own forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        self.hidden.retain_grad()
        return out


class _HooksHidden(_KeepsHidden):
    """Doubles its hidden activation's gradient by a hook registered in its own forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        self.hidden.register_hook(lambda g: 2 * g)
        return out


@pytest.mark.parametrize("extension", ["BatchGrad", "DiagGGNExact", "KFAC"])
@pytest.mark.parametrize("model_class", [_RetainsHidden, _HooksHidden])
def test_a_forward_that_retains_or_hooks_a_hidden_gradient(extension, model_class):
    """``self.hidden.retain_grad()`` or ``self.hidden.register_hook(...)`` (Grad-CAM's way) in
    the forward raised torch's "can't retain_grad on Tensor that has requires_grad=False" /
    "cannot register a hook on a tensor that doesn't require gradient" from packfunc's
    gradient-free passes (discovery, the one-sample check); the shim's and the functional
    API's results are now as without them (the hook's doubling included)."""
    X, y = _data()
    model, lossfunc = extend(model_class()), extend(nn.CrossEntropyLoss())
    lossfunc(model(X), y).backward()
    retained = model.hidden.grad.clone() if model_class is _RetainsHidden else None
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with backpack(getattr(ours, extension)()):
        lossfunc(model(X), y).backward()
    if retained is not None:
        torch.testing.assert_close(model.hidden.grad, retained)
    for p, grad in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad, grad)
        if extension == "BatchGrad":
            torch.testing.assert_close(p.grad_batch.sum(0), grad)
    plain, summed = model_class(), nn.CrossEntropyLoss(reduction="sum")
    found = pf.batch_grad(*pf.functional(plain), X, y, loss=summed)
    for n in range(len(X)):  # (torch.func.grad refuses retain_grad: a loop of backwards)
        plain.zero_grad()
        summed(plain(X[n : n + 1]), y[n : n + 1]).backward()
        for name, p in plain.named_parameters():
            torch.testing.assert_close(found[name][n], p.grad)


def test_terms_beside_the_layers_outputs_are_not_refused():
    """Weight decay in the loss (BackPACK's results leave it out too), a penalty on the output
    (taken, as BackPACK takes it) and a hook that scales a hidden gradient (packfunc's
    pullback runs it too) change no layer's output gradient behind the output's back."""
    X, y = _data()
    model, lossfunc = extend(_KeepsHidden()), extend(nn.CrossEntropyLoss())
    out = model(X)
    decay = 0.1 * sum(p.pow(2).sum() for p in model.parameters())
    with backpack(ours.BatchGrad()):
        (lossfunc(out, y) + decay + 0.1 * out.pow(2).mean()).backward()
    assert model.inner.weight.grad_batch.shape == (5, 4, 3)
    model.zero_grad()
    out = model(X)
    model.hidden.register_hook(lambda g: 2 * g)
    with backpack(ours.BatchGrad()):
        lossfunc(out, y).backward()
    for p in model.parameters():
        torch.testing.assert_close(p.grad_batch.sum(0), p.grad)


def test_a_scaled_loss_gives_the_unscaled_hessian_and_clipped_sum():
    """As docs/shim.md says: ``(s * loss).backward()`` gives the unscaled loss's Hessian
    diagonals (BackPACK's add an ``s``-times residual to the unscaled GGN) and ``ClippedGrad``
    clips the unscaled per-sample gradients (the bound clips none of them, every scaled one)."""
    X, y = _data()
    model, lossfunc = extend(_mlp()), extend(nn.CrossEntropyLoss(reduction="sum"))
    loss = nn.CrossEntropyLoss(reduction="sum")
    fn, params = pf.functional(_mlp())
    g = pf.batch_grad(fn, params, X, y, loss=loss)
    bound = 2.0 * float(torch.sqrt(sum(v.flatten(1).pow(2).sum(1) for v in g.values())).max())
    extensions = (ours.DiagHessian(), ours.BatchDiagHessian(), ours.ClippedGrad(bound))
    with backpack(*extensions), pytest.warns(UserWarning, match="seems to have been"):
        (8.0 * lossfunc(model(X), y)).backward()
    diag = pf.diag_hessian(fn, params, X, y, loss=loss)
    batch = pf.batch_diag_hessian(fn, params, X, y, loss=loss)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.diag_h, diag[name])
        torch.testing.assert_close(p.diag_h_batch, batch[name])
        torch.testing.assert_close(p.grad_clipped, g[name].sum(0))  # none clipped unscaled


def test_forward_passes_without_backward_keep_one_graph_alive():
    """Like BackPACK's ``module.output``: only the latest forward's output stays referenced."""
    model, lossfunc = extend(_mlp()), extend(nn.CrossEntropyLoss())
    X, y = _data()
    alive = []
    for _ in range(4):
        output = model(X)
        lossfunc(output.view(-1, 2), y)
        alive.append(weakref.ref(output))
        del output
    gc.collect()
    assert [ref() is not None for ref in alive] == [False, False, False, True]
    loss = lossfunc(model(X), y)  # an earlier forward is still answered right
    earlier = model(X)
    with backpack(ours.BatchGrad()):
        loss.backward()
    expected = _per_sample_grads(_mlp(), nn.CrossEntropyLoss(), X, y)
    for p, g in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad_batch, g)
    del earlier


def test_time_major_rows_are_regrouped_by_sample():
    """``[N, T, C]`` logits with time-major rows (a transpose before the reshape)."""
    torch.manual_seed(0)
    model = extend(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 5)).double())
    X, y = torch.randn(4, 6, 3, dtype=torch.float64), torch.randint(0, 5, (4, 6))
    lossfunc = extend(nn.CrossEntropyLoss())
    f = model(X)
    loss = lossfunc(f.transpose(0, 1).reshape(-1, 5), y.transpose(0, 1).reshape(-1))
    with backpack(ours.DiagGGNExact()):
        loss.backward()
    fn, params = pf.functional(model)
    canonical = pf.diag_ggn(
        lambda p, x: fn(p, x).transpose(1, 2), params, X, y, loss=nn.CrossEntropyLoss()
    )
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.diag_ggn_exact, canonical[name])


class _OwnL1(nn.Module):
    """A loss of the user's own: no parameters, not a torch.nn loss."""

    reduction = "sum"

    def forward(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (output - target).abs().sum()


class _L1AsMSE(nn.MSELoss):
    """A subclass of a torch.nn loss with a forward of its own."""

    def forward(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (output - target).abs().sum()


def test_an_extended_loss_of_the_users_own_gives_first_order_and_refuses_curvature():
    """BackPACK's BatchGrad takes any loss, extended or not. The shim took an extended
    module without parameters for the model (its output a scalar) and failed; a subclass
    of MSELoss with its own forward gave MSE's GGN (12 where an L1 loss has 0)."""
    torch.manual_seed(0)
    X, y = torch.randn(6, 3, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
    for loss in (_OwnL1(), _L1AsMSE(reduction="sum")):
        model, lossfunc = extend(_mlp()), extend(loss)
        with backpack(ours.BatchGrad()):
            lossfunc(model(X), y).backward()
        oracle = [
            torch.stack(column)
            for column in zip(
                *(
                    torch.autograd.grad(
                        loss(model(X[n : n + 1]), y[n : n + 1]), list(model.parameters())
                    )
                    for n in range(len(X))
                )
            )
        ]
        for p, expected in zip(model.parameters(), oracle):
            torch.testing.assert_close(p.grad_batch, expected)
    refusals = (
        (_OwnL1(), ValueError, "needs the loss function, one of torch.nn's losses"),
        (_L1AsMSE(reduction="sum"), TypeError, "_L1AsMSE overrides the forward of torch.nn.MSE"),
    )
    for loss, error, message in refusals:
        model, lossfunc = extend(_mlp()), extend(loss)
        with pytest.raises(error, match=message), backpack(ours.DiagGGNExact()):
            lossfunc(model(X), y).backward()
