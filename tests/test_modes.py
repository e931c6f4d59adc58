"""How people call models: under ``no_grad``/``inference_mode``, compiled, checkpointed.

Every public function works inside ``torch.no_grad()`` and ``torch.inference_mode()``
(packfunc enables what it needs internally) with the values it has outside them; a
model compiled with ``torch.compile`` runs as its original module; activation
checkpointing (both variants) gives the values without it; a refusal leaves the model's
buffers as they were.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.utils.checkpoint as checkpoint_module
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

import packfunc as pf
from packfunc.compat import backpack, extend
from packfunc.compat.extensions import KFLR, BatchGrad, DiagGGNExact
from tests.cases import (
    HUGGING_FACE,
    assert_trees_close,
    autograd_batch_grad,
    hugging_face_inputs,
)

CALLS = {
    "batch_grad": lambda fn, p, X, y: pf.batch_grad(fn, p, X, y),
    "compute": lambda fn, p, X, y: pf.compute(
        fn, p, X, y, quantities=("grad", "variance", "diag_ggn")
    ),
    "kfac": lambda fn, p, X, y: pf.kfac(fn, p, X, y, generator=torch.Generator().manual_seed(0)),
    "ekfac": lambda fn, p, X, y: pf.ekfac(fn, p, X, y, generator=torch.Generator().manual_seed(0)),
    "diag_hessian": lambda fn, p, X, y: pf.diag_hessian(fn, p, X, y),
    "hessian_vector_product": lambda fn, p, X, y: pf.hessian_vector_product(
        fn, p, X, y, {k: torch.ones_like(t) for k, t in p.items()}
    ),
    "hutchinson_trace": lambda fn, p, X, y: pf.hutchinson_trace(
        fn, p, X, y, num_samples=2, generator=torch.Generator().manual_seed(0)
    ),
    "data": lambda fn, p, X, y: pf.sum_grad_squared(fn, p, data=[(X[:2], y[:2]), (X[2:], y[2:])]),
    "explain": lambda fn, p, X, y: pf.explain(fn, p, X),
}


def _problem():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    return model, torch.randn(5, 3), torch.randint(0, 2, (5,))


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize("call", list(CALLS))
def test_functions_work_inside_no_grad_and_inference_mode(mode, call):
    model, X, y = _problem()
    model_fn, params = pf.functional(model)
    expected = CALLS[call](model_fn, params, X, y)
    with mode():
        inner_X, inner_y = X.clone(), y.clone()  # inference tensors under inference_mode
        found = CALLS[call](model_fn, params, inner_X, inner_y)
    if call == "explain":
        assert found == expected
    else:
        assert_trees_close(found, expected, call)


@pytest.mark.parametrize("call", ["batch_grad", "kfac", "compute"])
@pytest.mark.parametrize("made", ["parameters", "buffers"])
def test_tensors_made_in_inference_mode_used_outside_it_are_named(call, made):
    """Parameters or a BatchNorm's statistics made under ``torch.inference_mode()`` and used
    outside it gave torch's own error ("Setting requires_grad=True on inference tensor..."),
    which names no fix; the model is left as it was."""
    torch.manual_seed(0)
    if made == "parameters":
        with torch.inference_mode():
            model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    else:
        model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
        with torch.inference_mode():
            model[1].running_mean = torch.zeros(4)
    X, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
    model_fn, params = pf.functional(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="torch.inference_mode"):
        CALLS[call](model_fn, params, X, y)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_compiled_module_runs_as_its_original_module():
    model, X, y = _problem()
    model_fn, params = pf.functional(torch.compile(model))
    eager_fn, eager_params = pf.functional(model)
    assert list(params) == list(eager_params)
    assert_trees_close(
        pf.batch_grad(model_fn, params, X, y), pf.batch_grad(eager_fn, eager_params, X, y)
    )


def test_compiled_functions_and_submodules_are_refused_with_the_fix():
    model, X, y = _problem()
    model_fn, params = pf.functional(model)
    with pytest.raises(TypeError, match="torch.compile.*uncompiled"):
        pf.batch_grad(torch.compile(model_fn), params, X, y)
    model[0] = torch.compile(model[0])
    with pytest.raises(ValueError, match=r"\['0'\] are compiled"):
        pf.functional(model)


class _CompiledHelper(nn.Module):
    """A forward calling a function compiled with ``torch.compile`` (the eager backend)."""

    def __init__(self, on_parameter: bool):
        super().__init__()
        self.first, self.head = nn.Linear(5, 7), nn.Linear(7, 3)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 7))
        self.on_parameter = on_parameter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        if self.on_parameter:
            return self.head(_compiled_scaled_tanh(h, self.scale))
        return self.head(_compiled_tanh(h) * self.scale)


@torch.compile(backend="eager")
def _compiled_scaled_tanh(h: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.tanh(h) * scale


@torch.compile(backend="eager")
def _compiled_tanh(h: torch.Tensor) -> torch.Tensor:
    return torch.tanh(h)


@pytest.mark.parametrize("call", ["batch_grad", "explain"])
def test_a_compiled_function_inside_the_model_runs_or_is_refused_with_the_fix(call):
    """A compiled function of activations runs (its results are exact); one that takes a
    parameter meets packfunc's recording in its tracing and failed with a dynamo assertion
    (explain) or an internal error wrapping a plan mismatch about Python loops (found by a
    probe): refused naming the fix."""
    torch.manual_seed(0)
    X, y = torch.randn(6, 5, dtype=torch.float64), torch.randint(0, 3, (6,))
    model_fn, params = pf.functional(_CompiledHelper(on_parameter=True).double())
    function = {"batch_grad": partial(pf.batch_grad, y=y), "explain": pf.explain}[call]
    with pytest.raises(ValueError, match="compiled with torch.compile runs inside the model"):
        function(model_fn, params, X)
    model = _CompiledHelper(on_parameter=False).double()
    model_fn, params = pf.functional(model)
    found = pf.batch_grad(model_fn, params, X, y)
    assert_trees_close(found, autograd_batch_grad(model, nn.CrossEntropyLoss(), X, y))


@pytest.mark.parametrize("compiled", ["model", "submodule"])
@pytest.mark.parametrize("call", ["batch_grad", "compute", "kfac", "diag_hessian", "explain"])
def test_a_module_compiled_in_place_runs_its_own_code_and_stays_compiled(compiled, call):
    """``model.compile()`` has no wrapper to unwrap: its compiled code bypassed packfunc's
    modes and failed as a plan mismatch (found by a probe)."""
    model, X, y = _problem()
    model_fn, params = pf.functional(model)
    expected = CALLS[call](model_fn, params, X, y)
    (model if compiled == "model" else model[0]).compile(backend="eager")
    compiled_fn, compiled_params = pf.functional(model)
    found = CALLS[call](compiled_fn, compiled_params, X, y)
    if call == "explain":
        assert found == expected
    else:
        assert_trees_close(found, expected, call)
    assert (model if compiled == "model" else model[0])._compiled_call_impl is not None


@pytest.mark.parametrize("call", ["batch_grad", "diag_ggn", "kfac", "explain"])
def test_a_refusal_leaves_the_buffers_alone(call):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).train()
    model_fn, params = pf.functional(model)
    X, y = torch.randn(6, 3), torch.randint(0, 2, (6,))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="BatchNorm in training mode"):
        if call == "explain":
            pf.explain(model_fn, params, X)
        else:
            getattr(pf, call)(model_fn, params, X, y)
    assert_trees_close(dict(model.state_dict()), before)


@pytest.mark.parametrize("call", ["explain", "kfac", "ekfac"])
def test_a_probe_or_a_refusal_after_the_batch_pass_leaves_running_statistics(call):
    """InstanceNorm with running statistics in training mode: ``explain``'s probe forward
    kept its update, and so did a Kronecker refusal (no rule for the norm's affine
    parameters) after the batch pass. A computed quantity advances them once, as a step."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.InstanceNorm2d(3, affine=True, track_running_stats=True),
        nn.Flatten(),
        nn.Linear(48, 3),
    ).train()
    model_fn, params = pf.functional(model)
    X, y = torch.randn(5, 2, 4, 4), torch.randint(0, 3, (5,))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    if call == "explain":
        assert pf.explain(model_fn, params, X)["1.weight"] == "closed form (instance_norm)"
    else:
        with pytest.raises(ValueError, match="no Kronecker factors for 1.bias"):
            getattr(pf, call)(model_fn, params, X, y)
    assert_trees_close(dict(model.state_dict()), before)
    pf.batch_grad(model_fn, params, X, y)
    with torch.no_grad():
        copy = nn.InstanceNorm2d(3, affine=True, track_running_stats=True).train()
        copy.load_state_dict(
            {k[2:]: v for k, v in before.items() if k.startswith("1.")}, strict=True
        )
        copy(model[0](X))
    torch.testing.assert_close(model[1].running_mean, copy.running_mean)


class Checkpointed(nn.Module):
    """The MLP of these tests with its first layer under activation checkpointing."""

    def __init__(self, reentrant: bool | None):
        super().__init__()
        self.first, self.second = nn.Linear(3, 4), nn.Linear(4, 2)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def block(t: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.first(t))

        if self.reentrant is None:  # no checkpointing: the reference
            return self.second(block(x))
        return self.second(checkpoint(block, x, use_reentrant=self.reentrant))


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("call", [c for c in CALLS if c != "explain"])
def test_activation_checkpointing_gives_the_values_without_it(reentrant, call):
    torch.manual_seed(0)
    model, reference = Checkpointed(reentrant), Checkpointed(None)
    reference.load_state_dict(model.state_dict())
    X, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
    found = CALLS[call](*pf.functional(model), X, y)
    assert_trees_close(found, CALLS[call](*pf.functional(reference), X, y), call)
    assert checkpoint_module.CheckpointFunction.__name__ == "CheckpointFunction"  # restored


@pytest.mark.parametrize("input_requires_grad", [False, True])
@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_in_the_shim(reentrant, input_requires_grad):
    """A reentrant checkpoint's recomputation runs inside the backward pass: it was recorded
    as a forward of its own, whose inner backward asked for a loss (an input requiring grad),
    and its layer got no Kronecker factors (found by a probe)."""
    torch.manual_seed(0)
    model, reference = Checkpointed(reentrant), Checkpointed(None)
    reference.load_state_dict(model.state_dict())
    X, y = torch.randn(5, 3).requires_grad_(input_requires_grad), torch.randint(0, 2, (5,))
    with backpack(BatchGrad(), DiagGGNExact(), KFLR()):
        extend(nn.CrossEntropyLoss())(extend(model)(X), y).backward()
    model_fn, params = pf.functional(reference)
    expected = pf.compute(model_fn, params, X, y, quantities=("batch_grad", "diag_ggn"))
    factors = pf.kflr(model_fn, params, X, y)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad_batch, expected["batch_grad"][name])
        torch.testing.assert_close(p.diag_ggn_exact, expected["diag_ggn"][name])
        assert_trees_close(p.kflr, factors[name], name)


def test_hugging_face_gradient_checkpointing_gives_the_values_without_it():
    torch.manual_seed(0)
    model = HUGGING_FACE["gpt2"](0.0).double().train()
    X, y = hugging_face_inputs("gpt2", 3), torch.randint(0, 20, (3,))
    model_fn, params = pf.functional(model)
    expected = pf.compute(model_fn, params, X, y, quantities=("batch_grad", "diag_ggn"))
    model.model.gradient_checkpointing_enable()
    found = pf.compute(model_fn, params, X, y, quantities=("batch_grad", "diag_ggn"))
    assert_trees_close(found, expected)
    with backpack(BatchGrad()):
        extend(nn.CrossEntropyLoss())(extend(model)(X), y).backward()
    assert_trees_close(
        {k: p.grad_batch for k, p in model.named_parameters()}, expected["batch_grad"]
    )
    # the reentrant variant: torch refuses autograd.grad through it; the shim's own pass runs
    model.model.gradient_checkpointing_enable({"use_reentrant": True})
    with backpack(BatchGrad()):
        extend(nn.CrossEntropyLoss())(model(X), y).backward()
    assert_trees_close(
        {k: p.grad_batch for k, p in model.named_parameters()}, expected["batch_grad"]
    )


def test_hugging_face_gradient_checkpointing_leaves_products_as_without_it():
    """Its hook sets requires_grad_ on the embeddings' output, which torch.func forbids: every
    quantity differentiating through the model with it failed (found by a probe)."""
    torch.manual_seed(0)
    model = HUGGING_FACE["gpt2"](0.0).double().eval()
    X, y = hugging_face_inputs("gpt2", 3), torch.randint(0, 20, (3,))
    model_fn, params = pf.functional(model)
    v = {k: torch.randn_like(p) for k, p in params.items()}
    calls = {
        "hessian_vector_product": lambda: pf.hessian_vector_product(model_fn, params, X, y, v),
        "ggn_vector_product": lambda: pf.ggn_vector_product(model_fn, params, X, y, v),
    }
    expected = {name: call() for name, call in calls.items()}
    model.model.gradient_checkpointing_enable()
    for name, call in calls.items():
        assert_trees_close(call(), expected[name], name)


def _quantity(name: str, fn, p, X, y):
    return pf.compute(fn, p, X, y, quantities=name)[name]


def _seeded() -> dict:
    return {"generator": torch.Generator().manual_seed(0)}


AUTOCAST_CALLS = {
    **{name: partial(_quantity, name) for name in pf.QUANTITIES if name != "clipped_grad"},
    "clipped_grad": lambda fn, p, X, y: pf.clipped_grad(fn, p, X, y, max_norm=0.1),
    "mc_diag_ggn": lambda fn, p, X, y: pf.diag_ggn(fn, p, X, y, mc_samples=2, **_seeded()),
    "kfac": lambda fn, p, X, y: pf.kfac(fn, p, X, y, on_unsupported="skip", **_seeded()),
    "kflr": lambda fn, p, X, y: pf.kflr(fn, p, X, y, on_unsupported="skip"),
    "ekfac": lambda fn, p, X, y: {
        k: e.eigenvalues
        for k, e in pf.ekfac(fn, p, X, y, on_unsupported="skip", **_seeded()).items()
        if e is not None
    },
    "ggn_vector_product": lambda fn, p, X, y: pf.ggn_vector_product(
        fn, p, X, y, {k: torch.ones_like(t) for k, t in p.items()}
    ),
    "hessian_vector_product": lambda fn, p, X, y: pf.hessian_vector_product(
        fn, p, X, y, {k: torch.ones_like(t) for k, t in p.items()}
    ),
}
AUTOCAST_TOLERANCE = 3e-2
"""bfloat16 autocast against float32: the largest leaf error relative to the largest leaf."""


@pytest.mark.parametrize("name", ["gpt2", "llama", "vit"])
@pytest.mark.parametrize("call", list(AUTOCAST_CALLS))
def test_quantities_under_autocast_are_float32_and_close_to_float32(name, call):
    torch.manual_seed(0)
    model = HUGGING_FACE[name](0.0).eval()
    X = hugging_face_inputs(name, 4)
    model_fn, params = pf.functional(model)
    with torch.no_grad():
        y = torch.randint(0, model(X).shape[1], (4,))
    expected = AUTOCAST_CALLS[call](model_fn, params, X, y)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        found = AUTOCAST_CALLS[call](model_fn, params, X, y)
    found_leaves = [t for t in torch.utils._pytree.tree_leaves(found) if t is not None]
    expected_leaves = [t for t in torch.utils._pytree.tree_leaves(expected) if t is not None]
    assert all(t.dtype == torch.float32 for t in found_leaves)
    scale = max(t.norm() for t in expected_leaves)
    error = max((a - b).norm() for a, b in zip(found_leaves, expected_leaves))
    assert error <= AUTOCAST_TOLERANCE * scale, (float(error), float(scale))


def test_kfra_under_autocast_is_float32_and_close_to_float32():
    """KFRA's chain re-runs the model: under the caller's autocast its activations came back
    bfloat16, and so did some factors (``pf.kron.inverse`` then failed in ``eigh``)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    model_fn, params = pf.functional(model)
    X, y = torch.randn(5, 6), torch.tensor([0, 1, 2, 0, 1])
    expected = pf.kfra(model_fn, params, X, y)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        found = pf.kfra(model_fn, params, X, y)
    for name, factors in found.items():
        for a, b in zip(factors, expected[name]):
            assert a.dtype == torch.float32
            assert (a - b).norm() <= AUTOCAST_TOLERANCE * b.norm()


@pytest.mark.parametrize("quantity", ["diag_hessian", "batch_diag_hessian", "batch_grad"])
def test_a_plan_made_under_autocast_is_not_used_without_it(quantity):
    """The plan keeps its layers' output dtypes: one made under bfloat16 autocast and used by
    a later plain call gave a LayerNorm's Hessian diagonal in bfloat16 precision (2e-3
    off, returned as bfloat16) or torch's dtype error."""

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Tanh(), nn.Linear(7, 3))

    X, y = torch.randn(4, 5), torch.tensor([0, 1, 2, 0])
    expected = getattr(pf, quantity)(*pf.functional(model()), X, y)
    model_fn, params = pf.functional(model())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        getattr(pf, quantity)(model_fn, params, X, y)
    found = getattr(pf, quantity)(model_fn, params, X, y)
    for name in expected:
        assert found[name].dtype == torch.float32
        torch.testing.assert_close(found[name], expected[name], rtol=0, atol=0)


def test_a_compiled_step_runs_packfunc_eagerly_around_its_graph():
    model, X, y = _problem()
    model_fn, params = pf.functional(model)

    def step(p: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        norms = pf.batch_l2_grad(model_fn, p, X, y)
        total = torch.stack(list(norms.values())).sum(0)
        return {k: v - 0.1 * total.mean() for k, v in p.items()}

    torch._dynamo.reset()
    assert_trees_close(torch.compile(step)(params), step(params))


def test_the_shim_under_autocast_is_float32_and_close_to_float32():
    torch.manual_seed(0)
    model = HUGGING_FACE["gpt2"](0.0).eval()
    X, y = hugging_face_inputs("gpt2", 4), torch.randint(0, 20, (4,))
    expected = pf.batch_grad(*pf.functional(model), X, y)
    extend(model)
    with backpack(BatchGrad()):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = extend(nn.CrossEntropyLoss())(model(X), y)
        loss.backward()
    scale = max(v.norm() for v in expected.values())
    for name, p in model.named_parameters():
        assert p.grad_batch.dtype == torch.float32
        assert (p.grad_batch - expected[name]).norm() <= AUTOCAST_TOLERANCE * scale


class _FrozenEncoderClassifier(nn.Module):
    """Embedding, an ``nn.TransformerEncoder`` pooled over positions (padding too), a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(7, 4)
        layer = nn.TransformerEncoderLayer(4, 2, 6, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=True)
        self.head = nn.Linear(4, 3)

    def forward(self, tokens: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embedding(tokens), src_key_padding_mask=padding).mean(1))


def _flat(tree: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tree.values()])


@pytest.mark.filterwarnings("ignore:.*nested tensors.*:UserWarning")
@pytest.mark.parametrize("samples", [1, 3])
def test_a_frozen_encoder_on_nested_tensors_is_refused_where_a_pass_leaves_that_path(samples):
    """With nothing before it trainable, an eval encoder runs nested tensors in the user's
    forward (padded positions zero) but not inside packfunc's torch function modes or vmap,
    which compute them: ggn/hessian_vector_product returned the other function's curvature
    (0.27-0.81 off), the per-sample quantities a wrong RowsNotAloneError (found by a probe).
    Refused naming the fix; with a trainable embedding every path computes them: exact."""
    torch.manual_seed(0)
    tokens, y = torch.randint(0, 7, (samples, 5)), torch.randint(0, 3, (samples,))
    padding = torch.zeros(samples, 5, dtype=torch.bool)
    padding[0, 3:] = True
    loss = nn.CrossEntropyLoss(reduction="sum")
    model_fn, params = pf.functional(_FrozenEncoderClassifier().double().eval())
    for trained in ("head.", "embedding."):
        sub = {k: p for k, p in params.items() if k.startswith(trained)}
        shapes = [(k, p.shape, p.numel()) for k, p in sub.items()]

        def total(theta: torch.Tensor, shapes=shapes) -> torch.Tensor:
            parts, at = {}, 0
            for k, shape, size in shapes:
                parts[k], at = theta[at : at + size].reshape(shape), at + size
            return loss(model_fn({**params, **parts}, (tokens, padding)), y)

        with_sub = lambda p, X: model_fn({**params, **p}, X)  # noqa: E731
        v = {k: torch.randn_like(p) for k, p in sub.items()}
        args = (with_sub, sub, (tokens, padding), y)
        if trained == "head.":
            for quantity in (pf.ggn_vector_product, pf.hessian_vector_product):
                with pytest.raises(ValueError, match="enable_nested_tensor=False"):
                    quantity(*args, v, loss=loss)
            for quantity in (pf.batch_grad, pf.diag_ggn):
                with pytest.raises(ValueError, match="enable_nested_tensor=False"):
                    quantity(*args, loss=loss)
            continue
        with sdpa_kernel(SDPBackend.MATH):  # (twice differentiable)
            hessian = torch.autograd.functional.hessian(total, _flat(sub))
        found = _flat(pf.hessian_vector_product(*args, v, loss=loss))
        torch.testing.assert_close(found, hessian @ _flat(v))
        gradient = torch.autograd.functional.jacobian(total, _flat(sub))
        rows = pf.batch_grad(*args, loss=loss)
        torch.testing.assert_close(_flat({k: g.sum(0) for k, g in rows.items()}), gradient)
    assert not torch.nn.modules.module._global_forward_hooks  # (no hook left behind)


@pytest.mark.filterwarnings("ignore:.*nested tensors.*:UserWarning")
def test_per_batch_steps_run_inside_packfunc_passes():
    """per_batch returns a generator, whose batches ran after its call's block had closed:
    outside packfunc's passes and their refusals, so the frozen encoder above went through
    and its padded samples' Hessian diagonals were 11 % off (found by a probe)."""
    torch.manual_seed(0)
    model_fn, params = pf.functional(_FrozenEncoderClassifier().double().eval())
    head = {k: p for k, p in params.items() if k.startswith("head.")}
    tokens, y = torch.randint(0, 7, (4, 5)), torch.randint(0, 3, (4,))
    padding = torch.zeros(4, 5, dtype=torch.bool)
    padding[1:3, 3:] = True
    stream = pf.per_batch(
        pf.batch_diag_hessian,
        lambda p, X: model_fn({**params, **p}, X),
        head,
        data=[((tokens, padding), y)],
    )
    with pytest.raises(ValueError, match="enable_nested_tensor=False"):
        next(stream)
    assert not torch.nn.modules.module._global_forward_hooks


class _PaddedEncoder(nn.Module):
    """``nn.TransformerEncoder`` (nested tensors on) with every sample padding its last token."""

    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(4, 2, 6, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=True)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        padding = torch.zeros(x.shape[:2], dtype=torch.bool)
        padding[:, -1] = True
        return self.head(self.encoder(x, src_key_padding_mask=padding)).transpose(1, 2)


def test_an_eval_encoder_whose_fast_path_zeroes_padding_is_exact():
    """In eval mode without gradients the encoder runs nested tensors (padded positions come
    out zero); with them, or in a torch function mode, it does not. The check of the last
    sample alone ran it the first way and the batch the second: refused, 1.12 apart."""
    torch.manual_seed(0)
    model = _PaddedEncoder().double().eval()
    X, y = torch.randn(2, 3, 4, dtype=torch.float64), torch.randint(0, 3, (2, 3))
    model_fn, params = pf.functional(model)
    loss = nn.CrossEntropyLoss(reduction="sum")
    found = pf.batch_grad(model_fn, params, X, y, loss=loss)
    for name, p in model.named_parameters():
        rows = [
            torch.autograd.grad(loss(model(X[n : n + 1]), y[n : n + 1]), p)[0] for n in range(2)
        ]
        torch.testing.assert_close(found[name], torch.stack(rows), msg=name)


def test_an_inference_mode_block_in_the_forward_names_no_grad():
    """Differentiating a quantity of a model whose forward has a torch.inference_mode()
    block: the refusal blamed the parameters, buffers or batch, which were normal tensors
    (found by a probe). It names the block and torch.no_grad() too."""
    torch.manual_seed(0)
    params = {"w1": torch.randn(3, 4, dtype=torch.float64), "w2": torch.randn(4, 2)}
    params = {k: p.double() for k, p in params.items()}
    X, y = torch.randn(3, 3, dtype=torch.float64), torch.tensor([0, 1, 1])

    def model_fn(p: dict[str, torch.Tensor], X: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            scale = (X @ p["w1"]).abs().sum(-1, keepdim=True)
        return (torch.tanh(X @ p["w1"]) * (1 + 0.1 * scale.clone())) @ p["w2"]

    penalty = lambda q: pf.batch_l2_grad(model_fn, q, X, y)["w1"].sum()  # noqa: E731
    with pytest.raises(ValueError, match=r"inference_mode\(\) block.*torch.no_grad\(\)"):
        torch.func.grad(penalty)(params)
