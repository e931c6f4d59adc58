"""BackPACK code run through ``packfunc.compat``: the seeds' examples, semantics, misuse.

Every deterministic extension is compared with BackPACK itself on models BackPACK
supports; Monte-Carlo extensions by shape and statistics; models BackPACK refuses
are checked against packfunc's functional API (itself checked against autograd).
"""

from __future__ import annotations

import copy
import gc
import threading
import weakref
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.convert_parameters import parameters_to_vector

import packfunc as pf
from packfunc.compat import backpack, disable, extend
from packfunc.compat import extensions as ours
from packfunc.compat.extensions.firstorder.base import FirstOrderModuleExtension
from packfunc.compat.extensions.module_extension import ModuleExtension
from packfunc.compat.extensions.secondorder.diag_ggn import DiagGGNExact
from packfunc.compat.hessianfree.ggnvp import ggn_vector_product
from packfunc.compat.utils.convert_parameters import vector_to_parameter_list
from tests.cases import (
    PackedTagger,
    make_problem,
    pooled_convolution,
    ragged_tokens,
    run_backward_with,
)

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing")

DETERMINISTIC = [
    "BatchGrad",
    "BatchL2Grad",
    "SumGradSquared",
    "Variance",
    "DiagGGNExact",
    "BatchDiagGGNExact",
    "DiagHessian",
    "BatchDiagHessian",
    "SqrtGGNExact",
    "KFLR",
    "KFRA",
]
MONTE_CARLO = ["DiagGGNMC", "BatchDiagGGNMC", "SqrtGGNMC", "KFAC"]


def _mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.Sigmoid(), nn.Linear(6, 3)
    ).double()


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(2, 3, 2, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(12, 3)
    ).double()


def _data(model_name: str, n: int = 5):
    torch.manual_seed(1)
    shape = (4,) if model_name == "mlp" else (2, 3, 3)
    return torch.randn(n, *shape, dtype=torch.float64), torch.randint(0, 3, (n,))


def _run(package, exts, model, lossfunc, X, y):
    return run_backward_with(package, exts, model, lossfunc, X, y)


def _assert_same(a, b, what):
    if isinstance(b, (list, tuple)):
        assert len(a) == len(b), what
        for x, z in zip(a, b):
            torch.testing.assert_close(x, z, msg=lambda m: f"{what}: {m}")
    else:
        torch.testing.assert_close(a, b, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("model_name", ["mlp", "cnn"])
def test_all_extensions_side_by_side_with_backpack(model_name, reduction, backpack_oracle):
    theirs = backpack_oracle.extensions
    torch.manual_seed(0)
    model = _mlp() if model_name == "mlp" else _cnn()
    lossfunc = nn.CrossEntropyLoss(reduction=reduction)
    X, y = _data(model_name)
    names = DETERMINISTIC + MONTE_CARLO
    mine = _run(pf.compat, [getattr(ours, n)() for n in names], model, lossfunc, X, y)
    ref = _run(backpack_oracle, [getattr(theirs, n)() for n in names], model, lossfunc, X, y)
    for (name, p), (_, q) in zip(mine.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad)
        for ext in names:
            field = getattr(ours, ext)().savefield
            a, b = getattr(p, field), getattr(q, field)
            if ext in DETERMINISTIC:
                _assert_same(a, b, f"{ext}/{name}")
            else:
                shapes = [t.shape for t in a] if isinstance(a, list) else a.shape
                assert shapes == ([t.shape for t in b] if isinstance(b, list) else b.shape)


FIRST_ORDER = ["BatchGrad", "BatchL2Grad", "SumGradSquared", "Variance"]


@pytest.mark.parametrize("subsampling", [None, [3, 1, 1]])
@pytest.mark.parametrize("model_name", ["mlp", "cnn"])
def test_first_order_extensions_together_side_by_side_with_backpack(
    model_name, subsampling, backpack_oracle
):
    """First-order extensions alone take the layers' cotangents from the user's backward
    pass, at its end; several in one block share them (the second one got zeros for every
    layer but the head, before its cotangents were kept for it)."""
    theirs = backpack_oracle.extensions
    torch.manual_seed(0)
    model = _mlp() if model_name == "mlp" else _cnn()
    lossfunc = nn.CrossEntropyLoss()
    X, y = _data(model_name)

    def made(package):
        first, *rest = (getattr(package, name) for name in FIRST_ORDER)
        return [first(subsampling=subsampling), *(e() for e in rest)]

    mine = _run(pf.compat, made(ours), model, lossfunc, X, y)
    ref = _run(backpack_oracle, made(theirs), model, lossfunc, X, y)
    for (name, p), (_, q) in zip(mine.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad)
        for ext in FIRST_ORDER:
            field = getattr(ours, ext)().savefield
            _assert_same(getattr(p, field), getattr(q, field), f"{ext}/{name}")


def test_monte_carlo_extensions_have_the_right_statistics():
    torch.manual_seed(0)
    model, lossfunc = _mlp(), nn.CrossEntropyLoss()
    X, y = _data("mlp", 4)
    mine = _run(
        pf.compat, [ours.DiagGGNMC(mc_samples=20_000), ours.DiagGGNExact()], model, lossfunc, X, y
    )
    for p in mine.parameters():
        error = (p.diag_ggn_mc - p.diag_ggn_exact).abs().max() / p.diag_ggn_exact.abs().max()
        assert error < 0.05


def test_intro_example_mlp_with_kfac(backpack_oracle):
    torch.manual_seed(0)
    X, y = torch.randn(16, 784), torch.randint(0, 10, (16,))
    model = nn.Sequential(nn.Linear(784, 64), nn.ReLU(), nn.Linear(64, 10))
    lossfunc = nn.CrossEntropyLoss()
    model, lossfunc = extend(model), extend(lossfunc)
    loss = lossfunc(model(X), y)
    with backpack(ours.KFAC()):
        loss.backward()
    for param in model.parameters():
        assert param.grad is not None
        expected = [(param.shape[0], param.shape[0])]
        if param.dim() == 2:
            expected.append((param.shape[1], param.shape[1]))
        assert [tuple(f.shape) for f in param.kfac] == expected
    reference = _run(
        backpack_oracle,
        [backpack_oracle.extensions.KFAC()],
        nn.Sequential(*copy.deepcopy(list(model))),
        nn.CrossEntropyLoss(),
        X,
        y,
    )
    torch.testing.assert_close(model[0].weight.kfac[1], reference[0].weight.kfac[1])


def einsum(*operands_and_pattern):
    """``einops.einsum``, as BackPACK's tutorial writes it (imported when the tutorial runs)."""
    import einops

    return einops.einsum(*operands_and_pattern)


class ScaleModule(nn.Module):
    """The tutorial's custom module: multiply the input by a scalar weight."""

    def __init__(self, weight: float = 2.0):
        super().__init__()
        self.weight = nn.Parameter(torch.tensor([weight]))

    def forward(self, input):
        return input * self.weight


class ScaleModuleBatchGrad(FirstOrderModuleExtension):
    def __init__(self):
        super().__init__(params=["weight"])

    def weight(self, ext, module, g_inp, g_out, bpQuantities):
        return einsum(g_out[0], module.input0, "batch d,batch d->batch").unsqueeze(-1)


class ScaleModuleDiagGGNExact(ModuleExtension):
    def __init__(self):
        super().__init__(params=["weight"])

    def backpropagate(self, ext, module, grad_inp, grad_out, bpQuantities):
        return bpQuantities * module.weight

    def weight(self, ext, module, g_inp, g_out, bpQuantities):
        V_theta = einsum(bpQuantities, module.input0, "c batch d, batch d -> c batch")
        return einsum(V_theta, V_theta, "c batch, c batch ->").unsqueeze(0)


class ScaleModuleBatchGradFromInputGradient(FirstOrderModuleExtension):
    """The scale's per-sample gradients from ``g_inp``: ``Σ_i g_inp[n, i] x[n, i] / w``."""

    def __init__(self):
        super().__init__(params=["weight"])

    def weight(self, ext, module, g_inp, g_out, bpQuantities):
        return (g_inp[0] * module.input0).sum(1, keepdim=True) / module.weight


def test_a_custom_module_extension_gets_the_input_gradient():
    """``g_inp`` was always ``(None,)``, where BackPACK passes the module's input gradient
    (a probe); the model's input, which takes none, gets ``None`` as there."""
    torch.manual_seed(0)
    model = extend(nn.Sequential(nn.Linear(5, 3), ScaleModule(), nn.Linear(3, 3)))
    lossfunc = extend(nn.CrossEntropyLoss(reduction="sum"))
    X, y = torch.randn(4, 5), torch.randint(0, 3, (4,))
    ext = ours.BatchGrad()
    ext.set_module_extension(ScaleModule, ScaleModuleBatchGradFromInputGradient())
    with backpack(ext):
        lossfunc(model(X), y).backward()
    found = model[1].weight.grad_batch
    with backpack(ours.BatchGrad()):
        lossfunc(model(X), y).backward()
    torch.testing.assert_close(found, model[1].weight.grad_batch)


class ScaleModuleKFLR(ModuleExtension):
    """The scale's 1×1 factor: ``Σ_{c,n} (Σ_i backproped[c, n, i] x[n, i])²``."""

    def __init__(self):
        super().__init__(params=["weight"])

    def weight(self, ext, module, g_inp, g_out, backproped):
        return [torch.einsum("cni,ni->cn", backproped, module.input0).square().sum().view(1, 1)]


def test_a_custom_module_extension_of_kflr_is_called_and_of_kfra_refused():
    """Module extensions of KFAC/KFLR/KFRA were never called, their parameters left out
    with a warning (BackPACK calls them; a probe). KFLR's is the exact GGN of the scale
    here (one parameter); KFRA runs the model again, without them: refused."""
    torch.manual_seed(0)
    model = extend(nn.Sequential(nn.Linear(5, 3), ScaleModule(), nn.Linear(3, 3)).double())
    lossfunc = extend(nn.CrossEntropyLoss(reduction="sum"))
    X, y = torch.randn(4, 5, dtype=torch.float64), torch.randint(0, 3, (4,))
    ext = ours.KFLR()
    ext.set_module_extension(ScaleModule, ScaleModuleKFLR())
    with backpack(ext):
        lossfunc(model(X), y).backward()
    (factor,) = model[1].weight.kflr
    expected = pf.diag_ggn(*pf.functional(model), X, y, loss=lossfunc)["1.weight"]
    torch.testing.assert_close(factor.view(1), expected)
    assert len(model[0].weight.kflr) == 2  # packfunc's own beside it
    refused = ours.KFRA()
    refused.set_module_extension(ScaleModule, ScaleModuleKFLR())
    with backpack(refused), pytest.raises(ValueError, match="does not call module extensions"):
        lossfunc(model(X), y).backward()
    without_scale = extend(nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 3)).double())
    with backpack(refused):  # (no module of that type: it runs)
        lossfunc(without_scale(X), y).backward()
    assert len(without_scale[0].weight.kfra) == 2


def test_a_module_extension_naming_a_parameter_without_its_method_is_refused():
    """BackPACK raises NotImplementedError at construction; packfunc accepted it and
    failed at the backward pass with an AttributeError (a probe)."""
    with pytest.raises(NotImplementedError, match="defines no method weight"):
        ModuleExtension(params=["weight"])


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_custom_module_tutorial(reduction):
    pytest.importorskip("einops")
    torch.manual_seed(0)
    inputs, targets = torch.randn(10, 4), torch.randint(0, 2, (10,))
    lossfunc = nn.CrossEntropyLoss(reduction=reduction)
    my_module = ScaleModule()

    expected = []
    for input_n, target_n in zip(inputs.split(1), targets.split(1)):
        loss_n = lossfunc(my_module(input_n), target_n)
        expected.append(torch.autograd.grad(loss_n, [my_module.weight])[0])
    expected = torch.stack(expected)
    if reduction == "mean":
        expected /= 10

    batch_grad = ours.BatchGrad()
    batch_grad.set_module_extension(ScaleModule, ScaleModuleBatchGrad())
    diag_ggn = DiagGGNExact()
    diag_ggn.set_module_extension(ScaleModule, ScaleModuleDiagGGNExact())
    calls = []
    original = ScaleModuleBatchGrad.weight
    ScaleModuleBatchGrad.weight = lambda *a: calls.append(1) or original(*a)
    try:
        my_module, lossfunc = extend(my_module), extend(lossfunc)
        outputs = my_module(inputs)
        loss = lossfunc(outputs, targets)
        with backpack(batch_grad, diag_ggn):
            loss.backward(retain_graph=True)
    finally:
        ScaleModuleBatchGrad.weight = original
    assert calls, "the registered first-order extension was not used"
    torch.testing.assert_close(my_module.weight.grad_batch, expected)

    params = list(my_module.parameters())
    dim = sum(p.numel() for p in params)
    diagonal = torch.zeros(dim)
    for d in range(dim):
        e_d = vector_to_parameter_list(torch.eye(dim)[d], params)
        diagonal[d] = parameters_to_vector(ggn_vector_product(loss, outputs, my_module, e_d))[d]
    torch.testing.assert_close(parameters_to_vector([p.diag_ggn_exact for p in params]), diagonal)


def test_fields_are_reset_by_each_backward_and_grad_accumulates():
    torch.manual_seed(0)
    model, lossfunc = extend(_mlp()), extend(nn.CrossEntropyLoss())
    X, y = _data("mlp")
    for _ in range(2):
        with backpack(ours.BatchGrad()):
            lossfunc(model(X), y).backward()
    weight = model[0].weight
    single = pf.batch_grad(*pf.functional(model), X, y)["0.weight"]
    torch.testing.assert_close(weight.grad_batch, single)  # not doubled
    torch.testing.assert_close(weight.grad, 2 * single.sum(0))  # accumulated, as in PyTorch


def test_first_order_works_without_extending_the_loss_and_with_any_loss():
    torch.manual_seed(0)
    model = extend(_mlp())
    X, y = _data("mlp")
    output = model(X)
    loss = nn.functional.cross_entropy(output, y) + 0.1 * output.square().mean()
    with backpack(ours.BatchGrad(), ours.Variance()):
        loss.backward()
    model_fn, params = pf.functional(model)
    for n in range(X.shape[0]):

        def term(p, n=n):
            rows = list(model_fn(params, X).detach().unbind(0))
            rows[n] = model_fn(p, X[n : n + 1])[0]
            out = torch.stack(rows)
            return nn.functional.cross_entropy(out, y) + 0.1 * out.square().mean()

        expected = torch.func.grad(term)(params)
        torch.testing.assert_close(model[2].weight.grad_batch[n], expected["2.weight"])


def test_second_order_needs_the_extended_loss():
    model = extend(_mlp())
    X, y = _data("mlp")
    loss = nn.CrossEntropyLoss()(model(X), y)
    with pytest.raises(ValueError, match=r"extend\(lossfunc\)"), backpack(ours.DiagGGNExact()):
        loss.backward()


def test_extension_classes_instead_of_instances_are_refused():
    with pytest.raises(ValueError, match=r"BatchGrad\(\)"):
        backpack(ours.BatchGrad)


def test_batchnorm_in_training_mode_is_refused():
    model = extend(nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 3)).double())
    X, y = _data("mlp")
    loss = extend(nn.CrossEntropyLoss())(model(X), y)
    with pytest.raises(ValueError, match=r"model\.eval\(\)"), backpack(ours.BatchGrad()):
        loss.backward()


def test_extension_hook_runs_on_each_module_after_the_extensions():
    torch.manual_seed(0)
    model, lossfunc = extend(_mlp()), extend(nn.CrossEntropyLoss())
    X, y = _data("mlp")
    seen, norms = [], []

    def hook(module):
        seen.append(type(module).__name__)
        for p in module.parameters(recurse=False):
            norms.append(p.grad_batch.norm())  # the extensions already ran
            del p.grad_batch  # compact memory, as BackPACK's docs suggest

    loss = lossfunc(model(X), y)
    with backpack(ours.BatchGrad(), extension_hook=hook):
        loss.backward()
    assert seen[0] == "CrossEntropyLoss" and seen.count("Linear") == 3 and len(norms) == 6
    assert not hasattr(model[0].weight, "grad_batch")


def test_retain_graph_allows_a_second_backward():
    torch.manual_seed(0)
    model, lossfunc = extend(_mlp()), extend(nn.CrossEntropyLoss())
    X, y = _data("mlp")
    loss = lossfunc(model(X), y)
    with backpack(ours.DiagGGNExact(), retain_graph=True):
        loss.backward(retain_graph=True)
    first = model[0].weight.diag_ggn_exact.clone()
    with backpack(ours.DiagGGNExact()):
        loss.backward()
    torch.testing.assert_close(model[0].weight.diag_ggn_exact, first)
    assert not hasattr(model[0], "input0")  # released after the last backward


def test_disable_stores_nothing_and_cannot_run_extensions():
    model, lossfunc = extend(_mlp()), extend(nn.CrossEntropyLoss())
    X, y = _data("mlp")
    with disable():
        loss = lossfunc(model(X), y)
        assert not hasattr(model[0], "input0") and not hasattr(loss, "_packfunc_record")
        with pytest.raises(RuntimeError, match="disable"):
            backpack(ours.BatchGrad()).__enter__()
    loss.backward()
    assert not hasattr(model[0].weight, "grad_batch")


def test_a_loss_holding_a_gradient_penalty_is_refused_where_a_plain_one_is_computed():
    """``l + λ‖∂l/∂X‖²`` (double backprop): the penalty reaches the weights through the
    model's backward, not its output; the shim gave per-sample gradients off by 15 % that no
    longer summed to ``.grad``, silently (BackPACK raises an AttributeError). The
    ``autograd.grad`` with ``create_graph=True`` itself, and a loss without it, compute."""
    torch.manual_seed(0)
    model, lossfunc = extend(_mlp()), extend(nn.CrossEntropyLoss())
    X, y = _data("mlp")
    with backpack(ours.BatchGrad()):
        inputs = X.clone().requires_grad_()
        loss = lossfunc(model(inputs), y)
        (gradient,) = torch.autograd.grad(loss, inputs, create_graph=True)
        with pytest.raises(RuntimeError, match="create_graph=True.*gradient penalty"):
            (loss + 3.0 * gradient.square().sum()).backward()
    model.zero_grad()
    with backpack(ours.BatchGrad()):
        lossfunc(model(X), y).backward()
    torch.testing.assert_close(model[0].weight.grad_batch.sum(0), model[0].weight.grad)


def test_a_changed_layer_shape_gets_new_factors_and_no_stale_ones_stay():
    """After a first backward, a pooling kernel changed the convolution's input size: the
    shim warned "no Kronecker rule" for the convolution and left the first step's ``kflr`` on
    it, silently stale. The plan is made again; and a parameter left without factors keeps
    no earlier ones."""
    torch.manual_seed(0)
    model = extend(pooled_convolution())
    lossfunc = extend(nn.CrossEntropyLoss())
    X, y = torch.randn(4, 2, 8, 8, dtype=torch.float64), torch.tensor([0, 1, 1, 0])
    with backpack(ours.KFLR()):
        lossfunc(model(X), y).backward()
    model[0].kernel_size = model[0].stride = 1
    with backpack(ours.KFLR()):
        lossfunc(model(X), y).backward()
    expected = pf.kflr(*pf.functional(model), X, y)["1.weight"]
    torch.testing.assert_close(model[1].weight.kflr, expected)
    model[1].forward = lambda x: F.conv2d(x, model[1].weight * 1.0, model[1].bias)  # computed
    with pytest.warns(UserWarning, match="no Kronecker rule"), backpack(ours.KFLR()):
        lossfunc(model(X), y).backward()
    assert not hasattr(model[1].weight, "kflr")


def test_a_backward_under_disable_of_a_recorded_forward_computes_as_in_backpack():
    """disable() stops recording forward passes only (BackPACK's): a backward inside it of
    a forward recorded in backpack(...) runs the extensions. The shim took the user's
    disable() for one of its own passes and left the previous step's results, silently."""
    torch.manual_seed(0)
    model, lossfunc = extend(_mlp()), extend(nn.CrossEntropyLoss())
    X, y = _data("mlp")
    with backpack(ours.BatchGrad(), ours.DiagGGNExact()):
        lossfunc(model(X), y).backward()
    first = model[0].weight.grad_batch
    model.zero_grad()
    with backpack(ours.BatchGrad(), ours.DiagGGNExact()):
        loss = lossfunc(model(X[:3]), y[:3])
        with disable():
            loss.backward()
    assert model[0].weight.grad_batch is not first
    torch.testing.assert_close(model[0].weight.grad_batch.sum(0), model[0].weight.grad)
    expected = pf.diag_ggn(*pf.functional(model), X[:3], y[:3])["0.weight"]
    torch.testing.assert_close(model[0].weight.diag_ggn_exact, expected)


@pytest.mark.parametrize("how", ["deepcopy", "submodule"])
def test_a_forward_under_disable_deletes_old_results_of_copies_and_submodules(how):
    """A backward inside backpack(...) through a forward run under disable() deletes that
    model's earlier results (BackPACK raises). Only the object extend() returned was
    hooked: a deep copy of it, or its first layer called alone, kept last step's
    grad_batch, silently."""
    torch.manual_seed(0)
    model, lossfunc = extend(_mlp()), extend(nn.CrossEntropyLoss())
    if how == "deepcopy":
        model = copy.deepcopy(model)
    X, y = _data("mlp")
    with backpack(ours.BatchGrad()):
        lossfunc(model(X), y).backward()
    assert hasattr(model[0].weight, "grad_batch")
    with disable():
        hidden = model(X) if how == "deepcopy" else model[0](X)
    with backpack(ours.BatchGrad()):
        output = hidden if how == "deepcopy" else model[2](model[1](hidden))
        lossfunc(output, y).backward()
    assert not hasattr(model[0].weight, "grad_batch")


@pytest.mark.parametrize("extension", [ours.KFRA, ours.DiagGGNExact, ours.BatchGrad])
def test_new_values_through_data_between_forward_and_backward_are_named(extension):
    """``w.data = ...`` bumps no version: KFRA's own pass ran the model with the new weight,
    silently (BackPACK uses the recorded forward's); the others failed the mixing check,
    whose message blamed the model. Each now names the change."""
    torch.manual_seed(0)
    model, lossfunc = extend(_mlp()), extend(nn.CrossEntropyLoss())
    X, y = _data("mlp")
    loss = lossfunc(model(X), y)
    model[0].weight.data = model[0].weight.data + 1.0
    changed = "'0.weight' was given new values through .data"
    with pytest.raises(ValueError, match=changed), backpack(extension()):
        loss.backward()


@pytest.mark.slow
def test_a_training_loop_does_not_keep_activations_alive():
    torch.manual_seed(0)
    model, lossfunc = extend(_mlp()), extend(nn.CrossEntropyLoss())
    X, y = _data("mlp")
    alive = []
    for _ in range(50):
        output = model(X)
        alive.append(weakref.ref(output))
        with backpack(ours.BatchGrad(), ours.DiagGGNExact()):
            lossfunc(output, y).backward()
        del output
    gc.collect()
    assert sum(ref() is not None for ref in alive) == 0


@pytest.mark.parametrize("extension", ["BatchGrad", "KFAC", "DiagGGNExact", "ClippedGrad"])
def test_a_step_lets_its_activations_go_without_the_garbage_collector(extension):
    """The record of a step's forward was held in a reference cycle (its pullbacks held it,
    and it held them) until the garbage collector ran: in a loop of KFAC steps on an MLP,
    the previous step's layer inputs were alive beside the next step's (a peak of 59.5 MiB
    for five steps against 43.5 MiB for one)."""
    torch.manual_seed(0)
    clipped = extension == "ClippedGrad"  # (a sum: each sample's own loss)
    model = extend(_mlp())
    lossfunc = extend(nn.CrossEntropyLoss(reduction="sum" if clipped else "mean"))
    X, y = _data("mlp")
    made = ours.ClippedGrad(1.0) if clipped else getattr(ours, extension)()
    with backpack(made):  # (a first step makes the plan)
        lossfunc(model(X), y).backward()
    seen: list[weakref.ref] = []
    hook = model[0].register_forward_hook(lambda m, i, o: seen.append(weakref.ref(o)))
    gc.collect()
    gc.disable()
    try:
        with backpack(made):
            lossfunc(model(X), y).backward()
        alive = sum(ref() is not None for ref in seen)
    finally:
        gc.enable()
        hook.remove()
    assert seen and alive == 0


def test_debug_prints_what_runs(capsys):
    model, lossfunc = extend(_mlp(), debug=True), extend(nn.CrossEntropyLoss())
    X, y = _data("mlp")
    with backpack(ours.BatchGrad(), debug=True):
        lossfunc(model(X), y).backward()
    printed = capsys.readouterr().out
    assert "extended Linear" in printed and "BatchGrad on Sequential" in printed


@pytest.mark.parametrize("case", ["residual", "shared_layer", "custom_module"], indirect=True)
def test_second_order_beyond_backpack(case):
    problem = make_problem(case, n=4)
    model, X, y = problem.model, problem.X, problem.y
    functional = pf.compute(
        *pf.functional(model), X, y, quantities=("diag_ggn", "diag_hessian", "batch_grad")
    )
    model, lossfunc = extend(model), extend(nn.CrossEntropyLoss())
    with backpack(ours.DiagGGNExact(), ours.DiagHessian(), ours.BatchGrad()):
        lossfunc(model(X), y).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.diag_ggn_exact, functional["diag_ggn"][name])
        torch.testing.assert_close(p.diag_h, functional["diag_hessian"][name])
        torch.testing.assert_close(p.grad_batch, functional["batch_grad"][name])


def test_block_products_are_functions_on_the_parameters():
    torch.manual_seed(0)
    model, lossfunc = extend(_mlp()), extend(nn.CrossEntropyLoss())
    X, y = _data("mlp")
    with backpack(ours.GGNMP(), ours.HMP(), ours.PCHMP()):
        lossfunc(model(X), y).backward()
    mats = {k: torch.randn(2, *p.shape, dtype=torch.float64) for k, p in model.named_parameters()}
    ggn = pf.ggn_block_products(*pf.functional(model), X, y, mats)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.ggnmp(mats[name]), ggn[name])
        assert p.hmp(mats[name]).shape == p.pchmp(mats[name]).shape == mats[name].shape


def test_the_users_own_forward_pass_is_reused(monkeypatch):
    from packfunc.engine import batch_pass

    def refuse(*args):
        raise AssertionError("ran the model again")

    monkeypatch.setattr(batch_pass, "record", refuse)
    torch.manual_seed(0)
    model, lossfunc = extend(_mlp()), extend(nn.CrossEntropyLoss())
    X, y = _data("mlp")
    with backpack(ours.BatchGrad(), ours.DiagGGNExact()):
        lossfunc(model(X), y).backward()
    assert model[0].weight.grad_batch.shape == (5, 6, 4)


@pytest.mark.parametrize("case", ["lstm", "transformer", "batchnorm_eval"], indirect=True)
def test_models_whose_forward_cannot_be_reused_still_work(case):
    problem = make_problem(case, n=3)
    model, X, y = problem.model, problem.X, problem.y
    expected = pf.batch_grad(*pf.functional(model), X, y)
    model, lossfunc = extend(model), extend(nn.CrossEntropyLoss())
    with backpack(ours.BatchGrad()):
        lossfunc(model(X), y).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad_batch, expected[name])


def test_hbp_configurations_are_kfac_kflr_and_kfra():
    torch.manual_seed(0)
    model, lossfunc = extend(_mlp()), extend(nn.CrossEntropyLoss())
    X, y = _data("mlp")
    general = ours.HBP("ggn", "exact", "sqrt", "E[J^T E(H) J]", savefield="mine")
    with backpack(general, ours.KFLR()):
        lossfunc(model(X), y).backward()
    for p in model.parameters():
        _assert_same(p.mine, p.kflr, "HBP == KFLR")
    with pytest.raises(NotImplementedError, match="KFAC"):
        ours.HBP("hessian", "exact", "sqrt", "E[J^T E(H) J]")


def test_kfac_and_kflr_ask_for_backpacks_position_convention_by_name():
    """The shim names ``kfac_approx="sum"`` itself rather than rely on packfunc's default."""
    for extension in (ours.KFAC(), ours.KFLR()):
        assert dict(extension.job().options)["kfac_approx"] == "sum"


def test_clipped_grad_extension_matches_the_functional_api():
    """``ClippedGrad`` (packfunc's own extension) writes ``pf.clipped_grad`` to ``grad_clipped``;
    a mean-reduced loss is refused (clipping needs each sample's own loss)."""
    import packfunc as pf
    from packfunc.compat import backpack, extend
    from packfunc.compat.extensions import ClippedGrad

    torch.manual_seed(0)
    model = extend(
        torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    )
    X, y = torch.randn(7, 4), torch.randint(0, 3, (7,))
    lossfunc = extend(torch.nn.CrossEntropyLoss(reduction="sum"))
    with backpack(ClippedGrad(0.2)):
        lossfunc(model(X), y).backward()
    model_fn, params = pf.functional(model)
    expected = pf.clipped_grad(model_fn, params, X, y, loss=lossfunc, max_norm=0.2)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad_clipped, expected[name])
    mean = extend(torch.nn.CrossEntropyLoss())
    with pytest.raises(ValueError, match="reduction='sum'"), backpack(ClippedGrad(0.2)):
        mean(model(X), y).backward()


def test_clipped_grad_extension_clips_the_trainable_parameters_by_their_own_bounds():
    """A frozen parameter is outside the norm (as in ``pf.clipped_grad`` on the trainable
    ones, DPOptimizer and opacus); bounds, one per trainable parameter, follow
    ``model.parameters()`` order (not the sorted names); an int bound is a bound."""
    import packfunc as pf
    from packfunc.compat import backpack, extend
    from packfunc.compat.extensions import ClippedGrad

    torch.manual_seed(0)
    model = extend(
        torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    ).double()
    X, y = torch.randn(7, 4, dtype=torch.float64), torch.randint(0, 3, (7,))
    lossfunc = extend(torch.nn.CrossEntropyLoss(reduction="sum"))
    model[0].weight.requires_grad_(False)
    model_fn, params = pf.functional(model)
    trainable = {k: v for k, v in params.items() if k != "0.weight"}
    bounds = {"0.bias": 1e3, "2.weight": 1e-2, "2.bias": 1e3}  # model.parameters() order
    for max_norm, expected_bound in ((1, 1.0), (list(bounds.values()), bounds)):
        with backpack(ClippedGrad(max_norm)):
            lossfunc(model(X), y).backward()
        expected = pf.clipped_grad(
            model_fn, trainable, X, y, loss=lossfunc, max_norm=expected_bound
        )
        for name, p in model.named_parameters():
            assert (name in trainable) == hasattr(p, "grad_clipped")
            if name in trainable:
                torch.testing.assert_close(p.grad_clipped, expected[name])
    too_few = backpack(ClippedGrad([1.0, 1.0]))
    with pytest.raises(ValueError, match="2 clipping bounds for 3 trainable"), too_few:
        lossfunc(model(X), y).backward()


def _clipped_sum_by_loop(
    params: list[torch.Tensor], losses: Callable[[int], torch.Tensor], n: int, c: float
) -> list[torch.Tensor]:
    """``Σ_n g_n min(1, C / (‖g_n‖ + 1e-6))``, the norm over ``params`` together, by a loop."""
    total = [torch.zeros_like(p) for p in params]
    for i in range(n):
        grads = torch.autograd.grad(losses(i), params)
        norm = torch.sqrt(sum(g.square().sum() for g in grads))
        for t, g in zip(total, grads):
            t += g * min(1.0, c / (float(norm) + 1e-6))
    return total


def test_clipped_grad_extension_refuses_modules_extended_apart_and_chained():
    """``lf(l2(act(l1(X))), y)`` with ``l1`` and ``l2`` extended apart: each record holds its
    own parameters, so each clipped its samples by its own norm (a sample added √2·C: a
    probe); refused, and no ``grad_clipped`` is left on any of them. A chain whose other
    stages have no trainable parameter (an extended activation) clips by the one norm there
    is, as a per-sample loop does."""
    from packfunc.compat import backpack, extend
    from packfunc.compat.extensions import ClippedGrad

    torch.manual_seed(0)
    X, y, c = torch.randn(5, 6, dtype=torch.float64), torch.randint(0, 3, (5,)), 0.3
    lossfunc = extend(torch.nn.CrossEntropyLoss(reduction="sum"))
    l1, act, l2 = (extend(m.double()) for m in (nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)))
    with pytest.raises(ValueError, match="chained in plain code"), backpack(ClippedGrad(c)):
        lossfunc(l2(act(l1(X))), y).backward()
    assert not any(hasattr(p, "grad_clipped") for p in [*l1.parameters(), *l2.parameters()])
    model = extend(nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double())
    with pytest.raises(ValueError, match="chained in plain code"), backpack(ClippedGrad(c)):
        lossfunc(model[2](model[1](model[0](X))), y).backward()
    assert not any(hasattr(p, "grad_clipped") for p in model.parameters())

    scale = extend(nn.Tanh())  # (no parameter: the norm is l1's alone)
    with backpack(ClippedGrad(c)):
        lossfunc(scale(act(l1(X))), y).backward()
    expected = _clipped_sum_by_loop(
        list(l1.parameters()), lambda i: lossfunc(scale(act(l1(X[i : i + 1]))), y[i : i + 1]), 5, c
    )
    for p, want in zip(l1.parameters(), expected):
        torch.testing.assert_close(p.grad_clipped, want)


def _lstm_model() -> nn.Module:
    """An LSTM head: its forward is never reused (packfunc's own pass runs it again)."""

    class Recurrent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp, self.lstm, self.out = (
                nn.Linear(3, 4),
                nn.LSTM(4, 4, batch_first=True),
                nn.Linear(4, 2),
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.lstm(self.inp(x))[0][:, -1])

    return Recurrent()


def _step(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.9)  # what optimizer.step() does: in place, under no_grad


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (_step, r"'[\w.]+' was changed in place since the forward pass"),
        (lambda model: model.eval(), "switched to evaluation mode"),
    ],
)
@pytest.mark.parametrize("architecture", ["mlp, two forwards", "lstm"])
def test_a_model_changed_between_forward_and_backward_is_refused_where_it_would_run_again(
    change, message, architecture
):
    """packfunc's own pass ran the changed model: other values than the forward's (silently)."""
    torch.manual_seed(0)
    X, y = torch.randn(4, 5, 3), torch.tensor([0, 1, 1, 0])
    if architecture == "lstm":
        model = extend(_lstm_model())
    else:  # a second forward releases the first one's recording
        model, X = extend(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))), X[:, 0]
    lossfunc = extend(nn.CrossEntropyLoss())
    with backpack(ours.BatchGrad()):
        value = lossfunc(model(X), y)
        if architecture != "lstm":
            lossfunc(model(X), y)  # (validation with grad enabled)
        change(model)
        with pytest.raises(ValueError, match=message):
            value.backward()


def test_an_output_changed_in_place_after_the_forward_is_refused_by_name():
    """The recorded output no longer held the forward's values: refused, blaming the model."""
    model = extend(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)))
    lossfunc = extend(nn.CrossEntropyLoss())
    with backpack(ours.BatchGrad()), pytest.raises(ValueError, match="out = out \\+ 1"):
        out = model(torch.randn(5, 3))
        out.add_(1.0)
        lossfunc(out, torch.tensor([0, 1, 1, 0, 1])).backward()


class _SecondChunk(nn.Module):
    """Returns the second half of a layer's output: the second output of one autograd node."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(3, 4)
        self.kept: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, second = self.layer(x).chunk(2, dim=1)
        self.kept = first
        return second


def test_an_output_that_is_a_later_output_of_its_node_takes_its_own_gradient():
    """The hook took the node's first gradient (the other chunk's, None): an AttributeError."""
    torch.manual_seed(0)
    model = extend(_SecondChunk().double())
    X, y = torch.randn(5, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 0, 1])
    lossfunc = extend(nn.CrossEntropyLoss(reduction="sum"))
    with backpack(ours.BatchGrad()):
        lossfunc(model(X), y).backward()
    weight = model.layer.weight
    for n in range(5):
        expected = torch.autograd.grad(lossfunc(model(X[n : n + 1]), y[n : n + 1]), weight)[0]
        torch.testing.assert_close(weight.grad_batch[n], expected)
    with backpack(ours.BatchGrad()), pytest.raises(ValueError, match="another tensor than its"):
        model(X)
        model.kept.square().sum().backward()  # reaches the node through the kept chunk only


def test_a_parameter_changed_through_data_before_the_backward_is_named_in_the_refusal():
    """``.data`` writes bump no version: the rows check refuses, naming them as a cause."""
    model = extend(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)))
    lossfunc = extend(nn.CrossEntropyLoss())
    with backpack(ours.BatchGrad()), pytest.raises(ValueError, match=r"changed through \.data"):
        value = lossfunc(model(torch.randn(5, 3)), torch.tensor([0, 1, 1, 0, 1]))
        model[0].weight.data.mul_(2)
        value.backward()


def test_an_unchanged_model_is_run_again_exactly():
    """The LSTM's re-run, with nothing changed, is the forward's own: grad_batch sums to .grad."""
    torch.manual_seed(0)
    model, lossfunc = extend(_lstm_model()), extend(nn.CrossEntropyLoss())
    with backpack(ours.BatchGrad()):
        lossfunc(model(torch.randn(4, 5, 3)), torch.tensor([0, 1, 1, 0])).backward()
    for p in model.parameters():
        torch.testing.assert_close(p.grad_batch.sum(0), p.grad)


def test_kronecker_factors_come_from_the_forward_of_a_model_with_dropout(backpack_oracle):
    """KFLR and KFAC take the forward's own activations (its dropout mask), as BackPACK does.

    (They ran the model again, with another mask: 0.75 off; then were refused.)
    """
    theirs = backpack_oracle.extensions
    X, y = torch.randn(6, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 0, 1, 0])
    found = {}
    for package, extensions in ((pf.compat, ours), (backpack_oracle, theirs)):
        torch.manual_seed(1)
        model = package.extend(
            nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Dropout(0.5), nn.Linear(8, 2)).double()
        )
        value = package.extend(nn.CrossEntropyLoss())(model(X), y)  # the same mask
        with package.backpack(extensions.KFLR(), extensions.KFAC()):
            value.backward()
        found[package] = model
    mine, reference = found[pf.compat], found[backpack_oracle]
    for (name, p), q in zip(mine.named_parameters(), reference.parameters()):
        _assert_same(p.kflr, q.kflr, f"KFLR/{name}")
        _assert_same(p.kfac[1:], q.kfac[1:], f"KFAC's input factor/{name}")  # A is sampled


def test_kfra_refuses_a_model_it_would_run_again_with_other_random_numbers():
    """KFRA runs the model's chain again: with dropout that was another mask than the forward's."""
    model = extend(nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.5), nn.Linear(4, 2)))
    lossfunc = extend(nn.CrossEntropyLoss())
    value = lossfunc(model(torch.randn(4, 3)), torch.tensor([0, 1, 1, 0]))
    with backpack(ours.KFRA()), pytest.raises(pf.RandomModelError):
        value.backward()


def test_kronecker_factors_refuse_a_model_that_changes_its_buffers():
    """Spectral norm in training mode: a second run advanced the power iteration again."""
    torch.manual_seed(0)
    layer = nn.utils.spectral_norm(nn.Linear(3, 4))
    model, lossfunc = extend(nn.Sequential(layer, nn.Tanh(), nn.Linear(4, 2))), extend(nn.MSELoss())
    value = lossfunc(model(torch.randn(4, 3)), torch.randn(4, 2))
    u = layer.weight_u.clone()
    with backpack(ours.KFLR()), pytest.raises(ValueError, match="changes its buffer '0.weight_u'"):
        value.backward()
    assert torch.equal(layer.weight_u, u)


def test_block_product_closures_refuse_a_model_changed_after_the_backward_pass():
    """BackPACK's closures keep the backward pass's curvature; ours would run the new model."""
    torch.manual_seed(0)
    model = extend(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)))
    lossfunc = extend(nn.CrossEntropyLoss())
    with backpack(ours.GGNMP()):
        lossfunc(model(torch.randn(4, 3)), torch.tensor([0, 1, 1, 0])).backward()
    weight = model[2].weight
    before = weight.ggnmp(torch.ones_like(weight))
    assert before.shape == weight.shape
    _step(model)
    with pytest.raises(ValueError, match="block product"):
        weight.ggnmp(torch.ones_like(weight))


def test_a_model_returning_no_tensor_with_a_row_per_sample_warns_that_nothing_is_recorded():
    """Tensors over the whole batch (a loss computed inside the model, a mean) have no
    per-sample output to differentiate: a warning, no results (it was silent)."""

    class BatchSummaries(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(3, 5)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            features = torch.tanh(self.body(x))
            return features.mean(0), features.square().sum()  # [5] for 4 samples, and []

    model = extend(BatchSummaries())
    with backpack(ours.BatchGrad()):
        with pytest.warns(UserWarning, match="without a tensor with one row per sample"):
            mean, energy = model(torch.randn(4, 3))
        (mean.sum() + energy).backward()
    assert not hasattr(model.body.weight, "grad_batch")


def test_results_of_another_model_stay_as_in_backpack():
    """An ensemble, one block per model: each model kept its results (until its own next
    backward), where every new block had deleted those of all models."""
    torch.manual_seed(0)
    lossfunc = extend(nn.CrossEntropyLoss())
    X, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
    models = [extend(nn.Sequential(nn.Linear(3, 2))) for _ in range(2)]
    for model in models:
        with backpack(ours.BatchGrad(), ours.KFLR()):
            lossfunc(model(X), y).backward()
    for model in models:
        assert model[0].weight.grad_batch.shape == (4, 2, 3)
        assert len(model[0].weight.kflr) == 2


def test_a_backward_that_computes_nothing_leaves_no_stale_results():
    """Forward under disable(), backward inside backpack(...): the last step's grad_batch
    stayed on the parameters, silently (BackPACK raises). A value the user set stays."""
    torch.manual_seed(0)
    model, lossfunc = extend(nn.Sequential(nn.Linear(3, 2))), extend(nn.CrossEntropyLoss())
    X, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
    with backpack(ours.BatchGrad()):
        lossfunc(model(X), y).backward()
    assert model[0].weight.grad_batch.shape == (4, 2, 3)
    model[0].bias.grad_batch = "the user's own"
    with disable():
        value = lossfunc(model(X), y)
    with backpack(ours.BatchGrad()):
        value.backward()
    assert not hasattr(model[0].weight, "grad_batch")
    assert model[0].bias.grad_batch == "the user's own"


@pytest.mark.parametrize("extended", ["both", "one"])
@pytest.mark.parametrize("extension", ["BatchGrad", "DiagGGNExact"])
def test_a_layer_shared_by_two_extended_models_in_one_loss_is_refused(extended, extension):
    """Two models sharing an encoder, one loss of both: the shared weights' results were one
    model's part alone (per-sample gradients 0.04 off, not summing to .grad; one head's GGN)
    where BackPACK raises. Extending one model extends the shared encoder too, whose own
    record met the same fate. Each loss in a backward pass of its own still runs."""
    torch.manual_seed(0)
    encoder = nn.Linear(4, 5)
    first = nn.Sequential(encoder, nn.Tanh(), nn.Linear(5, 3)).double()
    second = nn.Sequential(encoder, nn.Sigmoid(), nn.Linear(5, 2)).double()
    X = torch.randn(6, 4, dtype=torch.float64)
    lossfunc = extend(nn.CrossEntropyLoss())
    y1, y2 = torch.randint(0, 3, (6,)), torch.randint(0, 2, (6,))
    extend(first)
    if extended == "both":
        extend(second)
    if extended == "both":
        with backpack(getattr(ours, extension)()):  # steps before: no stale results stay
            lossfunc(first(X), y1).backward()
            lossfunc(second(X), y2).backward()
    # (the encoder's own record, run inside the other model, is not its loss's: refused so)
    refusal = "through another extended model's output|needs the loss function|outside the model"
    with backpack(getattr(ours, extension)()), pytest.raises(ValueError, match=refusal):
        (lossfunc(first(X), y1) + lossfunc(second(X), y2)).backward()
    field = getattr(ours, extension)().savefield
    assert not hasattr(encoder.weight, field)
    if extended == "both":
        assert not hasattr(first[2].weight, field) and not hasattr(second[2].weight, field)
    if extended == "one":
        return
    with backpack(getattr(ours, extension)()):
        lossfunc(first(X), y1).backward()
        lossfunc(second(X), y2).backward()
    quantity = "batch_grad" if extension == "BatchGrad" else "diag_ggn"
    expected = pf.compute(*pf.functional(second), X, y2, loss=lossfunc, quantities=(quantity,))
    torch.testing.assert_close(getattr(encoder.weight, field), expected[quantity]["0.weight"])


class _TwoExtendedLayers(nn.Module):
    """Two layers extended apart (not the model): each runs its own extensions."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = extend(nn.Linear(3, 4)), extend(nn.Linear(4, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x)))


def test_a_refused_backward_pass_leaves_no_last_step_results():
    """Layers extended apart, BatchGrad with DiagGGNExact: the second-order extension is
    refused at the last layer (its loss input is no extended loss's), which stops the
    backward pass; both layers kept the last step's grad_batch (silently stale)."""
    torch.manual_seed(0)
    model, lossfunc = _TwoExtendedLayers(), extend(nn.CrossEntropyLoss())
    X, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
    with backpack(ours.BatchGrad()):
        lossfunc(model(X), y).backward()
    assert hasattr(model.first.weight, "grad_batch") and hasattr(model.second.bias, "grad_batch")
    with (
        backpack(ours.BatchGrad(), ours.DiagGGNExact()),
        pytest.raises(ValueError, match="needs the loss function"),
    ):
        lossfunc(model(X), y).backward()
    for param in model.parameters():
        assert not hasattr(param, "grad_batch") and not hasattr(param, "diag_ggn_exact")


class _WithFeatures(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = torch.tanh(self.first(x))
        return self.second(features), features


@pytest.mark.parametrize("penalty", ["on the features", "on the logits"])
def test_a_refused_backward_pass_leaves_the_model_as_it_was(penalty):
    """A penalty beside the loss: refused (a loss of two outputs; a term the GGN does not
    follow). The stored ``input0``/``output`` of every module and of the loss stayed on the
    user's modules, and, for two outputs, the last step's ``grad_batch`` (a probe)."""
    torch.manual_seed(0)
    model, lossfunc = extend(_WithFeatures()), extend(nn.CrossEntropyLoss())
    X, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
    with backpack(ours.BatchGrad(), ours.DiagGGNExact()):
        lossfunc(model(X)[0], y).backward()
    assert hasattr(model.first.weight, "grad_batch")
    with (
        backpack(ours.BatchGrad(), ours.DiagGGNExact()),
        pytest.raises(ValueError, match="several outputs|not that of the extended"),
    ):
        logits, features = model(X)
        extra = features if penalty == "on the features" else logits
        (lossfunc(logits, y) + extra.square().sum()).backward()
    for module in [*model.modules(), lossfunc]:
        assert not {"input0", "input1", "output"} & set(vars(module)), module
    for param in model.parameters():
        assert not hasattr(param, "grad_batch") and not hasattr(param, "diag_ggn_exact")


@pytest.mark.parametrize("extensions", [("DiagGGNExact",), ("BatchGrad", "KFAC")])
def test_a_parameter_frozen_between_steps_keeps_no_results(extensions):
    """``requires_grad_(False)`` between two steps: with a second-order extension in the
    block, the frozen bias kept the first step's results (a probe; BackPACK keeps them)."""
    torch.manual_seed(0)
    model = extend(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)))
    lossfunc = extend(nn.CrossEntropyLoss())
    X, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
    made = [getattr(ours, name)() for name in extensions]
    with backpack(*made):
        lossfunc(model(X), y).backward()
    assert all(hasattr(model[0].bias, ext.savefield) for ext in made)
    model[0].bias.requires_grad_(False)
    with backpack(*made):
        lossfunc(model(X), y).backward()
    assert not any(hasattr(model[0].bias, ext.savefield) for ext in made)
    assert all(hasattr(model[0].weight, ext.savefield) for ext in made)


@pytest.mark.parametrize("extension", ["DiagHessian", "BatchDiagHessian", "KFRA", "GGNMP", "HMP"])
def test_results_without_a_right_gradient_refuse_it_under_create_graph(extension):
    """``backward(create_graph=True)``: DiagHessian's gradient left out its residual terms'
    dependence on the weights (3.4 off at scale 3.2), and KFRA's factors and the block
    products were constants, whose gradient went missing from a sum (a probe). They
    refuse it now, naming what to use; DiagGGNExact keeps its right gradient."""
    torch.manual_seed(0)
    model = extend(nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)))
    lossfunc = extend(nn.CrossEntropyLoss())
    X, y = torch.randn(4, 5), torch.randint(0, 3, (4,))
    made = getattr(ours, extension)()
    with backpack(made):
        lossfunc(model(X), y).backward(create_graph=True)
    weight = model[0].weight
    found = getattr(weight, made.savefield)
    if callable(found):
        found = found(torch.ones(1, *weight.shape))
    value = (weight**2).sum() + sum(
        t.sum() for t in (found if isinstance(found, list) else [found])
    )
    with pytest.raises(RuntimeError, match="not differentiable"):
        torch.autograd.grad(value, weight)
    model.zero_grad(set_to_none=True)


class _Scale(nn.Module):
    """``x * weight``: a module packfunc differentiates, given a module extension in tests."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class _ScaleBatchGrad(ModuleExtension):
    def __init__(self) -> None:
        super().__init__(params=["weight"])

    def weight(self, ext, module, g_inp, g_out, backproped):
        return g_out[0] * module.input0


def _later_forward(model, lossfunc, X, y):
    out = model(X)
    model(X + 1)  # a validation batch: the record of the first forward cannot be reused
    lossfunc(out, y).backward(create_graph=True)


def _second_backward(model, lossfunc, X, y):
    out = model(X)
    lossfunc(out, 0 * y).backward(retain_graph=True, create_graph=True)
    lossfunc(out, y).backward(create_graph=True)


@pytest.mark.parametrize("steps", [_later_forward, _second_backward])
def test_results_of_packfuncs_own_pass_refuse_a_gradient_under_create_graph(steps):
    """Under ``create_graph=True``, results packfunc computed in a pass of its own (another
    forward since, a second backward pass, chained models, a recurrent layer) ran on the
    parameters detached: the gradient of ``Σ grad_batch²`` missed 0.092 of 0.094 (a probe).
    They refuse it now."""
    torch.manual_seed(0)
    model = extend(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)))
    lossfunc = extend(nn.MSELoss())
    X, y = torch.randn(3, 3), torch.randn(3, 2)
    with backpack(ours.BatchGrad()):
        steps(model, lossfunc, X, y)
    weight = model[0].weight
    with pytest.raises(RuntimeError, match="a pass of its own"):
        torch.autograd.grad(weight.grad_batch.pow(2).sum(), weight)
    model.zero_grad(set_to_none=True)


def test_module_extension_results_refuse_a_gradient_under_create_graph():
    """A module extension's result is computed from ``g_out`` without a graph: under
    ``create_graph=True`` its gradient was missing (``None``, and 2–6 % off in a sum with the
    other layers' results; a probe). It refuses it now; the other layers' results keep
    their right gradients."""
    torch.manual_seed(0)
    model = extend(nn.Sequential(nn.Linear(3, 3), nn.Tanh(), _Scale(3), nn.Linear(3, 2)))
    model = model.double()
    lossfunc = extend(nn.MSELoss())
    X, y = torch.randn(3, 3, dtype=torch.float64), torch.randn(3, 2, dtype=torch.float64)
    made = ours.BatchGrad()
    made.set_module_extension(_Scale, _ScaleBatchGrad())
    with backpack(made):
        lossfunc(model(X), y).backward(create_graph=True)
    with pytest.raises(RuntimeError, match="module extension"):
        torch.autograd.grad(model[2].weight.grad_batch.pow(2).sum(), model[3].weight)
    found = torch.autograd.grad(model[0].weight.grad_batch.pow(2).sum(), model[3].weight)[0]
    plain = copy.deepcopy(model)
    per_sample = torch.stack(
        [
            torch.autograd.grad(
                nn.MSELoss()(plain(X[n : n + 1]), y[n : n + 1]) / 3,
                plain[0].weight,
                create_graph=True,
            )[0]
            for n in range(3)
        ]
    )
    expected = torch.autograd.grad(per_sample.pow(2).sum(), plain[3].weight)[0]
    torch.testing.assert_close(found, expected)
    model.zero_grad(set_to_none=True)


def _tied_scale() -> tuple[nn.Module, str]:
    model = nn.Sequential(_Scale(3), nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 2))
    model[1].bias = model[0].weight
    return model, "1.bias"


def _scale_twice() -> tuple[nn.Module, str]:
    scale = _Scale(3)
    return nn.Sequential(nn.Linear(3, 3), nn.Tanh(), scale, nn.Tanh(), scale, nn.Linear(3, 2)), (
        "4.weight"
    )


@pytest.mark.parametrize("build", [_tied_scale, _scale_twice])
def test_a_module_extension_of_a_parameter_registered_twice_is_refused(build):
    """A module extension's parameter that a Linear holds too, or its module called at two
    places: the extension's result (one call's share) replaced the whole parameter's, a
    ``grad_batch`` not summing to ``.grad`` (1.04 off; a probe; BackPACK's is wrong too).
    Refused, leaving no result."""
    torch.manual_seed(0)
    model, other = build()
    model, lossfunc = extend(model), extend(nn.MSELoss())
    made = ours.BatchGrad()
    made.set_module_extension(_Scale, _ScaleBatchGrad())
    with pytest.raises(ValueError, match=f"also registered as {other}"), backpack(made):
        lossfunc(model(torch.randn(3, 3)), torch.randn(3, 2)).backward()
    assert not any(hasattr(p, "grad_batch") for p in model.parameters())


@pytest.mark.parametrize("extension", ["BatchGrad", "SumGradSquared", "BatchL2Grad"])
def test_first_order_results_of_a_backward_pass_that_leaves_layers_out(extension):
    """``backward(inputs=[last weight])`` with first-order extensions alone: the layers that
    pass leaves out got zeros (their cotangents never reached the hooks; a probe). packfunc
    pulls them back itself there, as with a second-order extension in the block."""
    torch.manual_seed(0)
    model = extend(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double())
    lossfunc = extend(nn.MSELoss(reduction="sum"))
    X, y = torch.randn(3, 3, dtype=torch.float64), torch.randn(3, 2, dtype=torch.float64)
    made = getattr(ours, extension)()
    with backpack(made):
        lossfunc(model(X), y).backward(inputs=[model[2].weight])
    with backpack(made):
        lossfunc(model(X), y).backward()
    for p in model.parameters():
        assert p.grad is not None
    expected = {p: getattr(p, made.savefield).clone() for p in model.parameters()}
    model.zero_grad(set_to_none=True)
    with backpack(made):
        lossfunc(model(X), y).backward(inputs=[model[2].weight])
    for p in model.parameters():
        torch.testing.assert_close(getattr(p, made.savefield), expected[p])
    assert model[0].weight.grad is None


def test_clipped_grad_under_autocast_is_not_refused_for_rounding():
    """The check that no term reaches a layer besides the output's gradient compared the
    user's bfloat16 cotangents with packfunc's float32 ones to float32's rounding: a plain
    loss was refused at random (8 of 120 batches; a probe)."""
    torch.manual_seed(0)
    model = extend(nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 10)))
    lossfunc = extend(nn.CrossEntropyLoss(reduction="sum"))
    for seed in range(30):
        torch.manual_seed(seed)
        X, y = torch.randn(16, 32) * 5, torch.randint(0, 10, (16,))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            value = lossfunc(model(X), y)
        with backpack(ours.ClippedGrad(max_norm=0.05)):
            value.backward()
        assert model[0].weight.grad_clipped.shape == model[0].weight.shape


def test_a_forward_pre_hook_that_raises_leaves_the_shim_as_it_was():
    """A user's pre-hook (registered before extend) that raises before the shim's own: the
    shim's forward hook, always called, undid an entry never made, and every extended model
    after it ran as an inner module: DiagGGNExact on a model with dropout raised that its
    forward could not be reused, ``input0`` stayed on the model after the backward pass."""
    torch.manual_seed(0)
    X, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    checked = nn.Linear(4, 3)

    def reject(module, args):
        raise ValueError("input rejected")

    checked.register_forward_pre_hook(reject)
    extend(checked)
    with backpack(ours.BatchGrad()), pytest.raises(ValueError, match="input rejected"):
        checked(X)
    model = extend(nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 3)))
    with backpack(ours.DiagGGNExact()):
        extend(nn.CrossEntropyLoss())(model(X), y).backward()
    assert model[0].weight.diag_ggn_exact.shape == (16, 4)
    assert not hasattr(model, "input0") and not hasattr(model[0], "input0")


def test_a_training_loop_on_the_shim_discovers_its_model_once(monkeypatch):
    """Each backward pass discovered the model again (a one-sample forward, and the checks of
    a fresh plan: two more): the shim made a new model function per pass, and packfunc keeps
    its plans per model function."""
    from packfunc.engine import discovery

    found = []
    original = discovery.discover
    monkeypatch.setattr(discovery, "discover", lambda *a, **k: found.append(1) or original(*a, **k))
    model = extend(nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.5), nn.Linear(4, 2)))
    lossfunc = extend(nn.CrossEntropyLoss())
    X, y = torch.randn(5, 3), torch.tensor([0, 1, 1, 0, 1])
    for _ in range(4):
        model.zero_grad()
        with backpack(ours.BatchGrad(), ours.DiagGGNExact()):
            lossfunc(model(X), y).backward()
    assert len(found) == 2  # the model's, and the model's up to the loss
    for p in model.parameters():
        torch.testing.assert_close(p.grad_batch.sum(0), p.grad)


class _Branching(nn.Module):
    """Takes one of two layers as an attribute says: the cached plan no longer fits."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second, self.drop = nn.Linear(3, 2), nn.Linear(3, 2), nn.Dropout(0.5)
        self.use_second = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.second if self.use_second else self.first)(self.drop(x))


def test_a_forward_that_left_the_cached_plan_is_discovered_again_not_run_again():
    """A model with dropout cannot be run again: its forward's own recording must serve, also
    when the plan kept from the last step no longer fits it."""
    torch.manual_seed(0)
    model, lossfunc = extend(_Branching()), extend(nn.CrossEntropyLoss(reduction="sum"))
    X, y = torch.randn(5, 3), torch.tensor([0, 1, 1, 0, 1])
    for use_second in (False, True):
        model.use_second = use_second
        with backpack(ours.BatchGrad()):
            lossfunc(model(X), y).backward()
    torch.testing.assert_close(model.second.weight.grad_batch.sum(0), model.second.weight.grad)


def test_dropout_switched_on_after_the_plan_was_kept_is_refused_where_a_rerun_would_run():
    """The plan kept from a step without dropout said "draws nothing": a later step with
    dropout on computed the Hessian from another mask than its forward's (0.63 off)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Dropout(0.0), nn.Linear(4, 2))
    model, lossfunc = extend(model.double()), extend(nn.CrossEntropyLoss())
    X, y = torch.randn(5, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 0, 1])
    with backpack(ours.DiagHessian()):
        lossfunc(model(X), y).backward()
    model[2].p = 0.5
    with backpack(ours.DiagHessian()), pytest.raises(pf.RandomModelError):
        lossfunc(model(X), y).backward()
    model_fn, params = pf.functional(model)  # the functional API, on its kept plan
    model[2].p = 0.0
    pf.diag_hessian(model_fn, params, X, y)
    model[2].p = 0.5
    with pytest.raises(pf.RandomModelError):
        pf.diag_hessian(model_fn, params, X, y)


def test_second_order_through_checkpointed_dropout_is_the_forwards_ggn():
    """A checkpointed block with dropout in training mode: the batched pullback through your
    graph recomputed the checkpoint inside vmap, where torch cannot draw random numbers
    (its raw error). The columns are pulled back one at a time; the recomputation restores
    the forward's random state, so the masks are the forward's."""
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Dropout(0.5))
            self.head = nn.Linear(6, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(checkpoint(self.block, x, use_reentrant=False))

    torch.manual_seed(0)
    model, lossfunc = extend(Checkpointed().double()), extend(nn.CrossEntropyLoss())
    X, y = torch.randn(4, 3, dtype=torch.float64), torch.tensor([0, 1, 2, 0])
    torch.manual_seed(1)
    with backpack(ours.DiagGGNExact()):
        lossfunc(model(X), y).backward()
    weight = model.block[0].weight

    def output(w: torch.Tensor) -> torch.Tensor:
        with torch.random.fork_rng():
            torch.manual_seed(1)  # the forward's mask
            return torch.func.functional_call(model, {"block.0.weight": w}, (X,))

    J = torch.autograd.functional.jacobian(output, weight.detach()).reshape(12, -1)
    out = output(weight.detach()).detach()
    H = torch.autograd.functional.hessian(lambda o: lossfunc(o, y), out).reshape(12, 12)
    expected = (J.T @ H @ J).diagonal().reshape(weight.shape)
    torch.testing.assert_close(weight.diag_ggn_exact, expected)


def test_an_extended_model_called_with_keywords_names_the_wrapper():
    """``model(**batch)`` (Hugging Face's habit): refused, now naming the wrapper module that
    takes the inputs positionally."""

    class Keywords(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(3, 2)

        def forward(self, inputs: torch.Tensor) -> torch.Tensor:
            return self.layer(inputs)

    model, lossfunc = extend(Keywords()), extend(nn.CrossEntropyLoss())
    refused = pytest.raises(ValueError, match="positional inputs only.*forward\\(self, input_ids")
    with refused, backpack(ours.BatchGrad()):
        lossfunc(model(inputs=torch.randn(4, 3)), torch.tensor([0, 1, 1, 0])).backward()


class _LastStep(nn.Module):
    """The last step of a sequence-first ``[T, N, d]`` input."""

    def forward(self, x):
        return x[-1]


def test_a_sequence_first_input_names_the_layout():
    """An extended model taking ``[T, N, d]`` (its last step the logits): the refusal said
    only that ``model_fn`` returned too many rows, a name shim users never wrote (a probe)."""
    torch.manual_seed(0)
    model = extend(nn.Sequential(nn.Linear(2, 4), nn.Tanh(), _LastStep(), nn.Linear(4, 3)))
    X, y = torch.randn(5, 3, 2), torch.randint(0, 3, (3,))
    with backpack(ours.BatchGrad()), pytest.raises(ValueError, match="sequence-first"):
        extend(nn.CrossEntropyLoss())(model(X), y).backward()


class _AuxAfterOutput(nn.Module):
    """An auxiliary head computed after the output, kept for a second loss term."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.body, self.head, self.aux = nn.Linear(4, 6), nn.Linear(6, 3), nn.Linear(6, 2)

    def forward(self, x):
        hidden = torch.tanh(self.body(x))
        out = self.head(hidden)
        self.kept = self.aux(hidden)  # (its node runs before the output's in the backward)
        return out


def test_a_layer_whose_node_runs_before_the_outputs_gets_its_per_sample_gradients():
    """First-order extensions take the layers' cotangents from the user's backward pass: a
    head computed after the output (a second loss term on it) runs before the output's node,
    where hooks registered at the output missed it: its ``grad_batch`` was zeros, silently
    (a probe). The hooks are registered when the forward is recorded."""
    torch.manual_seed(0)
    X, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    model, lossfunc = (
        extend(_AuxAfterOutput().double()),
        extend(nn.CrossEntropyLoss(reduction="sum")),
    )
    with backpack(ours.BatchGrad()):
        out = model(X)
        (lossfunc(out, y) + model.kept.pow(2).sum()).backward()
    plain = _AuxAfterOutput().double()
    for n in range(len(X)):
        out = plain(X[n : n + 1])
        term = nn.CrossEntropyLoss(reduction="sum")(out, y[n : n + 1]) + plain.kept.pow(2).sum()
        for p, g in zip(model.parameters(), torch.autograd.grad(term, plain.parameters())):
            torch.testing.assert_close(p.grad_batch[n], g)


def test_results_read_during_the_backward_pass_are_not_the_last_steps():
    """First-order results are stored at the end of the backward pass: read during it (a
    parameter's post-accumulate hook) they were the last step's, silently (a probe); they
    are removed when the backward pass reaches the model."""
    torch.manual_seed(0)
    model, lossfunc = extend(_mlp()), extend(nn.CrossEntropyLoss())
    X, y = _data("mlp")
    seen = []
    model[0].weight.register_post_accumulate_grad_hook(
        lambda p: seen.append(getattr(p, "grad_batch", None))
    )
    for _ in range(2):
        with backpack(ours.BatchGrad()):
            lossfunc(model(X), y).backward()
    assert seen == [None, None]
    assert model[0].weight.grad_batch.shape == (5, 6, 4)


class _Paused(nn.Module):
    """A layer whose forward waits for another thread's (to overlap two forwards)."""

    def __init__(self, arrive: threading.Event, wait: threading.Event) -> None:
        super().__init__()
        self.arrive, self.wait, self.layer = arrive, wait, nn.Linear(3, 2)

    def forward(self, x):
        self.arrive.set()
        self.wait.wait(timeout=10)
        return self.layer(x)


def test_forwards_overlapping_in_two_threads_leave_the_shim_recording():
    """Thread A's extended forward starts, B's starts, A's ends, then B's: the shim's count of
    running forwards was one list for all threads, left holding B's entry for good; every
    later forward recorded nothing, and a step's ``grad_batch`` was the one before (a probe).
    The count is per thread, as PyTorch's modes are."""
    torch.manual_seed(0)
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    first, second = extend(_Paused(a_in, b_in)), extend(_Paused(b_in, a_out))

    def run_first():
        first(torch.randn(5, 3))
        a_out.set()

    threads = [
        threading.Thread(target=run_first),
        threading.Thread(target=lambda: (a_in.wait(timeout=10), second(torch.randn(5, 3)))),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    model, lossfunc = extend(_mlp()), extend(nn.CrossEntropyLoss())
    X, y = _data("mlp")
    with backpack(ours.BatchGrad()):
        lossfunc(model(X), y).backward()
    torch.testing.assert_close(model[0].weight.grad_batch.sum(0), model[0].weight.grad)


def test_an_extended_model_compiled_after_extend_is_refused_in_backpack():
    """``model.compile()`` after ``extend`` (``torch.compile(model)`` too): the shim's hooks
    were traced and recorded nothing; BatchGrad left the last step's ``grad_batch`` (0.13
    off this step's, silently; a probe), and their torch function modes stayed pushed for
    the process. The traced forward now raises, results removed; outside ``backpack(...)``
    it runs, unrecorded. (One case per process: torch 2.13's dynamo raised
    an internal guard error compiling a second extended model after a first.)"""
    torch._dynamo.reset()  # (a frame compiled too often before runs eagerly: recorded)
    torch.manual_seed(0)
    model = extend(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)))
    lossfunc = extend(nn.CrossEntropyLoss())
    X, y = torch.randn(7, 6), torch.randint(0, 3, (7,))
    with backpack(ours.BatchGrad()):
        lossfunc(model(X), y).backward()
    model.compile()
    model(X)  # (no extensions: runs, and leaves no recorder's mode pushed, as it did)
    assert not torch.overrides._get_current_function_mode_stack()
    with backpack(ours.BatchGrad()), pytest.raises(RuntimeError, match="runs compiled"):
        lossfunc(model(X), y).backward()
    assert not hasattr(model[0].weight, "grad_batch")


def test_a_compiled_loss_keeps_first_order_results_and_second_order_names_the_compile():
    """A loss called in compiled code: its traced hook stored IO as a side effect that
    dynamo replayed or not, and second-order extensions were refused with "extend the
    loss" where it was extended (a probe). Traced, the hook records nothing; the refusal
    names the compile."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = extend(nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)))
    lossfunc = extend(nn.CrossEntropyLoss())
    compiled = torch.compile(lambda out, target: lossfunc(out, target))
    X, y = torch.randn(6, 5), torch.randint(0, 3, (6,))
    with backpack(ours.BatchGrad()):
        compiled(model(X), y).backward()
    expected = pf.batch_grad(*pf.functional(model), X, y)["0.weight"]
    torch.testing.assert_close(model[0].weight.grad_batch, expected)
    with backpack(ours.DiagGGNExact()), pytest.raises(ValueError, match="torch.compile"):
        compiled(model(X), y).backward()


@pytest.mark.parametrize("extension", ["SumGradSquared", "Variance", "DiagGGNExact", "KFLR"])
def test_a_backward_inside_autocast_computes_the_extensions_in_float32(extension):
    """``with torch.autocast(...), backpack(...): loss.backward()``: the extensions' own
    arithmetic ran under the caller's autocast: float16 results, inf where the per-sample
    squares overflow it (13 of 40 entries; a probe). It runs in float32 now, autocast kept
    for packfunc's own forwards."""
    torch.manual_seed(0)
    model = extend(nn.Linear(8, 5))
    lossfunc = extend(nn.CrossEntropyLoss(reduction="sum"))
    X, y = torch.randn(16, 8) * 100, torch.randint(0, 5, (16,))
    made = getattr(ours, extension)()
    with torch.autocast("cpu", dtype=torch.float16), backpack(made):
        lossfunc(model(X), y).backward()
    found = getattr(model.weight, made.savefield)
    for tensor in found if isinstance(found, list) else [found]:
        assert tensor.dtype == torch.float32 and bool(tensor.isfinite().all())


@pytest.mark.parametrize("backward_inside", [True, False])
def test_packfuncs_own_pass_runs_under_the_forwards_autocast(backward_inside):
    """An attention layer makes the shim run a pass of its own: under a bfloat16 forward
    whose backward ran after the autocast block, that pass ran in float32 (grad_batch 3.7 %
    off the bfloat16 rows, its sum 2 % off .grad, within the check's bfloat16 tolerance;
    a probe). It runs under the forward's autocast, wherever the backward runs."""
    torch.manual_seed(0)

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(20, 16)
            self.layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
            self.head = nn.Linear(16, 5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.layer(self.embed(x)).mean(1))

    model = extend(Encoder().eval())
    lossfunc = extend(nn.CrossEntropyLoss(reduction="sum"))
    X, y = torch.randint(0, 20, (4, 7)), torch.randint(0, 5, (4,))
    weight = model.layer.linear1.weight
    with torch.autocast("cpu", dtype=torch.bfloat16):
        rows = F.cross_entropy(model(X).float(), y, reduction="none")
    expected = torch.stack([torch.autograd.grad(row, weight, retain_graph=True)[0] for row in rows])
    with backpack(ours.BatchGrad()):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = lossfunc(model(X), y)
            if backward_inside:
                loss.backward()
        if not backward_inside:
            loss.backward()
    for found, wanted in ((weight.grad_batch, expected), (weight.grad_batch.sum(0), weight.grad)):
        assert (found - wanted).abs().max() < 1e-2 * wanted.abs().max()  # bfloat16's rounding


class _TinyGPT2(nn.Module):
    """A one-layer GPT-2 from a config, logits as ``[N, V, T]``."""

    def __init__(self) -> None:
        super().__init__()
        transformers = pytest.importorskip("transformers")
        config = transformers.GPT2Config(
            n_layer=1, n_head=2, n_embd=16, vocab_size=32, n_positions=8,
            resid_pdrop=0, embd_pdrop=0, attn_pdrop=0,
        )  # fmt: skip
        self.model = transformers.GPT2LMHeadModel(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=x).logits.permute(0, 2, 1)


def test_clipped_grad_of_gpt2_under_autocast_is_not_refused_for_rounding():
    """GPT-2's attention takes packfunc's own pass, whose float32 cotangents of bfloat16 ops
    differed from the user's by 5e-4 of the squared norm, beyond float32's rounding: the
    check for extra loss terms refused ClippedGrad in 5 of 5 batches (a probe). The
    forward's autocast dtype sets the rounding now."""
    for seed in range(3):
        torch.manual_seed(seed)
        model = extend(_TinyGPT2().eval())
        lossfunc = extend(nn.CrossEntropyLoss(reduction="sum"))
        X, y = torch.randint(0, 32, (16, 4)), torch.randint(0, 32, (16, 4))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            value = lossfunc(model(X), y)
        with backpack(ours.ClippedGrad(max_norm=0.1)):
            value.backward()
        assert all(hasattr(p, "grad_clipped") for p in model.parameters())


@pytest.mark.parametrize(
    ("extension", "message"),
    [
        (ours.DiagGGNExact, "extended Linear this backward.*a penalty"),
        (ours.BatchGrad, r"extended Linear \(0\) called outside.*a penalty"),
    ],
)
def test_a_penalty_on_a_layers_own_call_is_named_in_the_refusal(extension, message):
    """``loss + model[0](X).square().mean()``: with DiagGGNExact the refusal said to extend
    the loss (it was), with BatchGrad that two extended models shared a layer; neither named
    the layer's call or the penalty. The results are removed."""
    model = extend(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)))
    lossfunc = extend(nn.CrossEntropyLoss())
    X, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
    loss = lossfunc(model(X), y) + model[0](X).square().mean()
    with backpack(extension()), pytest.raises(ValueError, match=message):
        loss.backward()
    assert not any(hasattr(p, extension().savefield) for p in model.parameters())


def test_clipped_grad_takes_bounds_by_name_and_group():
    """As ``pf.clipped_grad`` and ``DPOptimizer`` do; it raised float()'s TypeError."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    lossfunc = extend(nn.CrossEntropyLoss(reduction="sum"))
    X, y = torch.randn(6, 3), torch.randint(0, 2, (6,))
    bounds = {("0.weight", "0.bias"): 0.3, "2.weight": 0.1, "2.bias": 0.05}
    model_fn, params = pf.functional(model)
    expected = pf.clipped_grad(model_fn, params, X, y, loss=lossfunc, max_norm=bounds)
    extended = extend(model)
    with backpack(ours.ClippedGrad(bounds)):
        lossfunc(extended(X), y).backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad_clipped, expected[name])


def test_a_random_model_under_reentrant_checkpointing_is_refused_naming_the_fix():
    """Dropout inside ``checkpoint(..., use_reentrant=True)``: the refusal named recurrent
    and attention layers only; ``use_reentrant=False`` keeps the forward (a probe)."""
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second, self.drop = nn.Linear(8, 16), nn.Linear(16, 3), nn.Dropout(0.5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            def block(h: torch.Tensor) -> torch.Tensor:
                return self.drop(torch.tanh(self.first(h)))

            return self.second(checkpoint(block, x, use_reentrant=True))

    model = extend(Checkpointed().train())
    X, y = torch.randn(6, 8), torch.randint(0, 3, (6,))
    with (
        backpack(ours.BatchGrad()),
        pytest.raises(pf.RandomModelError, match="use_reentrant=False"),
    ):
        extend(nn.CrossEntropyLoss())(model(X), y).backward()


def test_a_model_that_packs_its_batch_gets_each_samples_gradient():
    """``pack_padded_sequence`` in the forward, an LSTM on the packed data (it was refused
    in packfunc's passes): per-sample gradients equal a loop over samples, norms theirs."""
    torch.manual_seed(0)
    model = extend(PackedTagger().double())
    lossfunc = extend(nn.CrossEntropyLoss())
    tokens, y = ragged_tokens(5), torch.tensor([0, 1, 2, 0, 1])
    with backpack(ours.BatchGrad(), ours.BatchL2Grad()):
        lossfunc(model(tokens), y).backward()
    params = list(model.parameters())
    rows = [
        torch.autograd.grad(lossfunc(model(tokens[n : n + 1]), y[n : n + 1]) / 5, params)
        for n in range(5)
    ]
    for i, param in enumerate(params):
        expected = torch.stack([row[i] for row in rows])
        torch.testing.assert_close(param.grad_batch, expected)
        torch.testing.assert_close(param.batch_l2, expected.flatten(1).square().sum(1))


def test_a_packed_sequence_given_to_the_model_gets_each_samples_gradient():
    """``model(pack_sequence(...))``: the shim's pass refused the input (no batch along
    dim 0); it is passed padded and packed again, per-sample gradients equal a loop."""
    torch.manual_seed(0)

    class OnPacked(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn, self.head = nn.GRU(3, 4, batch_first=True), nn.Linear(4, 2)

        def forward(self, packed):
            return self.head(self.rnn(packed)[1][-1])

    model, lossfunc = extend(OnPacked().double()), extend(nn.CrossEntropyLoss())
    sequences = [torch.randn(length, 3, dtype=torch.float64) for length in (3, 5, 1, 4)]
    y = torch.tensor([0, 1, 1, 0])
    with backpack(ours.BatchGrad()):
        packed = nn.utils.rnn.pack_sequence(sequences, enforce_sorted=False)
        lossfunc(model(packed), y).backward()
    params = list(model.parameters())
    rows = [
        torch.autograd.grad(
            lossfunc(model(nn.utils.rnn.pack_sequence([s])), y[n : n + 1]) / 4, params
        )
        for n, s in enumerate(sequences)
    ]
    for i, param in enumerate(params):
        torch.testing.assert_close(param.grad_batch, torch.stack([row[i] for row in rows]))
