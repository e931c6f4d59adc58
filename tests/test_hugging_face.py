"""Hugging Face models on packfunc's fast paths: GPT-2's ``Conv1D``, shared position ids.

``Conv1D`` computes ``torch.addmm(b, x.view(-1, d), W)`` with ``W`` stored ``[in, out]``:
packfunc runs it as a linear layer on ``x``. Every quantity must equal that of a copy
whose ``Conv1D``s are ``nn.Linear``s (weights transposed); Kronecker factors come in
the weight's own order, ``[in×in, out×out]``.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import packfunc as pf
from tests.cases import (
    HUGGING_FACE,
    assert_batch_grad_is_a_loop,
    assert_trees_close,
    autograd_batch_grad,
    hugging_face_problem,
    moments,
    tiny_t5_config,
)

transformers = pytest.importorskip("transformers")
Conv1D = transformers.pytorch_utils.Conv1D


class Blocks(nn.Module):
    """Two token-wise layers and a pooled head; ``layer(in, out)`` builds each layer."""

    def __init__(self, layer) -> None:
        super().__init__()
        self.first, self.second = layer(4, 6), layer(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.second(torch.tanh(self.first(x))).mean(1)


def _conv1d_and_linear() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    conv = Blocks(lambda i, o: Conv1D(o, i)).double()
    linear = Blocks(nn.Linear).double()
    with torch.no_grad():
        for name, p in linear.named_parameters():
            p.copy_(
                conv.get_parameter(name).T if name.endswith("weight") else conv.get_parameter(name)
            )
    return conv, linear


def _transposed(tree: dict[str, Tensor]) -> dict[str, Tensor]:
    """Linear weights ``[..., out, in]`` in Conv1D's ``[..., in, out]`` layout."""
    return {k: v.transpose(-1, -2) if k.endswith("weight") else v for k, v in tree.items()}


QUANTITIES = {
    "batch_grad": True,
    "batch_l2_grad": False,
    "sum_grad_squared": True,
    "variance": True,
    "diag_ggn": True,
    "batch_diag_ggn": True,
    "diag_hessian": True,
    "batch_diag_hessian": True,
}
"""Quantity -> whether its weights come in the parameter's layout (else per-sample scalars)."""


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("quantity", list(QUANTITIES))
def test_conv1d_equals_linear(quantity, reduction):
    conv, linear = _conv1d_and_linear()
    X, y = torch.randn(5, 7, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    loss = nn.CrossEntropyLoss(reduction=reduction)
    conv_fn, conv_params = pf.functional(conv)
    linear_fn, linear_params = pf.functional(linear)
    assert set(pf.explain(conv_fn, conv_params, X).values()) == {"closed form (x @ W)"}
    found = getattr(pf, quantity)(conv_fn, conv_params, X, y, loss=loss)
    expected = getattr(pf, quantity)(linear_fn, linear_params, X, y, loss=loss)
    assert_trees_close(found, _transposed(expected) if QUANTITIES[quantity] else expected, quantity)


@pytest.mark.parametrize("function", ["kfac", "kflr", "ekfac"])
def test_conv1d_kronecker_factors_are_linear_ones_in_the_weights_order(function):
    conv, linear = _conv1d_and_linear()
    X, y = torch.randn(5, 7, 4, dtype=torch.float64), torch.randint(0, 3, (5,))

    def factors(model: nn.Module):
        model_fn, params = pf.functional(model)
        seeded = {} if function == "kflr" else {"generator": torch.Generator().manual_seed(0)}
        return getattr(pf, function)(model_fn, params, X, y, **seeded)

    found, expected = factors(conv), factors(linear)
    if function == "ekfac":  # eigenvalues in each weight's layout; same bases
        for name in found:
            values = expected[name].eigenvalues
            flip = name.endswith("weight")
            assert_trees_close(found[name].eigenvalues, values.T if flip else values, name)
        return
    for name in found:
        reordered = expected[name][::-1] if name.endswith("weight") else expected[name]
        assert_trees_close(list(found[name]), list(reordered), name)


@pytest.mark.parametrize("function", ["batch_grad", "kflr"])
def test_conv1d_on_samples_without_positions_is_a_linear_layer(function):
    """On ``[N, d]`` inputs its ``x.view(-1, d)`` keeps the shape: it was op-local (addmm),
    without Kronecker factors (found by a probe)."""
    conv, linear = _conv1d_and_linear()
    X, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    conv_fn, conv_params = pf.functional(nn.Sequential(conv.first, nn.Tanh(), conv.second))
    linear_fn, linear_params = pf.functional(nn.Sequential(linear.first, nn.Tanh(), linear.second))
    assert set(pf.explain(conv_fn, conv_params, X).values()) == {"closed form (x @ W)"}
    found = getattr(pf, function)(conv_fn, conv_params, X, y)
    expected = getattr(pf, function)(linear_fn, linear_params, X, y)
    if function == "kflr":
        expected = {k: v[::-1] if k.endswith("weight") else v for k, v in expected.items()}
        for name in found:
            assert_trees_close(list(found[name]), list(expected[name]), name)
    else:
        assert_trees_close(found, _transposed(expected))


def test_conv1d_kronecker_preconditioning_is_the_linear_one_transposed():
    conv, linear = _conv1d_and_linear()
    X, y = torch.randn(5, 7, 4, dtype=torch.float64), torch.randint(0, 3, (5,))

    def preconditioned(model: nn.Module) -> dict[str, Tensor]:
        model_fn, params = pf.functional(model)
        grads = pf.compute(model_fn, params, X, y, quantities="grad")["grad"]
        return pf.kron.matvec(pf.kron.inverse(pf.kflr(model_fn, params, X, y), 0.1), grads)

    assert_trees_close(preconditioned(conv), _transposed(preconditioned(linear)))


@pytest.mark.parametrize("name", list(HUGGING_FACE))
def test_every_parameter_of_hugging_face_models_is_on_a_fast_path(name):
    model, X, y = hugging_face_problem(name)
    model_fn, params = pf.functional(model)
    paths = pf.explain(model_fn, params, X)
    assert not [k for k, path in paths.items() if path.startswith("whole model")], paths
    expected = autograd_batch_grad(model, nn.CrossEntropyLoss(), X, y)
    assert_trees_close(pf.batch_grad(model_fn, params, X, y), expected, name)


TOLERANCES = {"rtol": 1e-5, "atol": 1e-8}
"""LLaMA's RMSNorm and T5's layer norm compute in float32 even in a float64 model."""


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", list(HUGGING_FACE))
def test_first_order_quantities_of_hugging_face_models_match_autograd(name, reduction):
    model, X, y = hugging_face_problem(name)
    loss = nn.CrossEntropyLoss(reduction=reduction)
    expected = moments(autograd_batch_grad(model, loss, X, y))
    found = pf.compute(*pf.functional(model), X, y, quantities=list(expected), loss=loss)
    for quantity, values in expected.items():
        assert_trees_close(found[quantity], values, f"{name} {quantity}", **TOLERANCES)


@pytest.mark.parametrize("name", list(HUGGING_FACE))
def test_ggn_diagonals_of_hugging_face_models_match_jacobians(name):
    model, X, y = hugging_face_problem(name)
    loss = nn.CrossEntropyLoss()
    params = dict(model.named_parameters())
    out = model(X)
    hessian = torch.func.hessian(lambda f: loss(f, y))(out.detach())
    expected = {k: torch.zeros(len(X), *p.shape, dtype=p.dtype) for k, p in params.items()}
    for n in range(len(X)):  # sample n's GGN diagonal from its Jacobian rows
        rows = [
            torch.autograd.grad(out[n, c], list(params.values()), retain_graph=True)
            for c in range(out.shape[1])
        ]
        for j, name_j in enumerate(params):
            jac = torch.stack([row[j] for row in rows])
            expected[name_j][n] = torch.einsum("cd,c...,d...->...", hessian[n, :, n], jac, jac)
    found = pf.compute(
        *pf.functional(model), X, y, quantities=("diag_ggn", "batch_diag_ggn", "sqrt_ggn")
    )
    assert_trees_close(found["batch_diag_ggn"], expected, "batch_diag_ggn", **TOLERANCES)
    summed = {k: v.sum(0) for k, v in expected.items()}
    assert_trees_close(found["diag_ggn"], summed, "diag_ggn", **TOLERANCES)
    squares = {k: v.square().sum(0) for k, v in found["sqrt_ggn"].items()}
    assert_trees_close(squares, expected, "sqrt_ggn", **TOLERANCES)


def test_per_sample_runs_of_a_model_that_branches_on_its_mask_loop_over_samples():
    model, X, y = hugging_face_problem("bert")  # Hugging Face's mask code calls .all() on the mask
    found = pf.batch_diag_hessian(*pf.functional(model), X, y)
    for n in range(len(X)):  # each sample's share alone: the same model on one sample
        alone = pf.diag_hessian(*pf.functional(model), X[n : n + 1], y[n : n + 1])
        scaled = {k: v / len(X) for k, v in alone.items()}  # mean reduction over N
        assert_trees_close({k: v[n] for k, v in found.items()}, scaled, **TOLERANCES)


class _T5Encoder(nn.Module):
    """A tiny T5 encoder (relative attention bias) with a padding mask; three outputs."""

    def __init__(self):
        super().__init__()
        self.encoder = transformers.T5EncoderModel(tiny_t5_config(vocab_size=12))

    def forward(self, ids: Tensor, mask: Tensor) -> Tensor:
        hidden = self.encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        return hidden.mean(1)[:, :3]


@pytest.mark.parametrize("padded", [0, 1, 2])
def test_a_batch_padded_elsewhere_than_its_first_sample_gets_a_plan(padded):
    """Hugging Face's mask code skips an all-ones mask: discovery on an unpadded first sample
    saw other calls than the batch, which was refused as a plan mismatch (found by a probe)."""
    torch.manual_seed(0)
    model = _T5Encoder().double().eval()
    ids, mask = torch.randint(3, 12, (3, 5)), torch.ones(3, 5, dtype=torch.long)
    ids[padded, -2:], mask[padded, -2:] = 0, 0
    assert_batch_grad_is_a_loop(*pf.functional(model), (ids, mask), torch.tensor([0, 2, 1]))
    paths = pf.explain(*pf.functional(model), (ids, mask))  # (raised PlanMismatch for 1, 2)
    assert not any(path.startswith("whole model") for path in paths.values()), paths


def test_a_padded_decoder_mask_after_an_unpadded_plan_gets_its_own():
    """T5's decoder position bias meets the mask only where a sample is padded: after a
    batch without padding, or with an unpadded first sample, a padded batch was refused as
    a row-per-sample derivation (its hint, put a padded sample first, did not help). It is
    a plan mismatch: discovery runs again on other samples."""
    torch.manual_seed(0)
    config = tiny_t5_config()
    t5 = transformers.T5ForConditionalGeneration(config).double().eval()
    seq2seq, params = pf.functional(t5)

    def model_fn(p, X):
        return seq2seq(p, X).logits.transpose(1, 2)

    ids, labels = torch.randint(1, 20, (3, 5)), torch.randint(1, 20, (3, 4))
    first_unpadded = torch.ones(3, 4, dtype=torch.long)
    first_unpadded[1:, -1] = 0
    for mask in (torch.ones(3, 4, dtype=torch.long), first_unpadded):
        X = {
            "input_ids": ids,
            "decoder_input_ids": t5._shift_right(labels),
            "decoder_attention_mask": mask,
        }
        assert_batch_grad_is_a_loop(model_fn, params, X, labels)


@pytest.mark.parametrize("name", list(HUGGING_FACE))
def test_curvature_products_of_hugging_face_models_match_autograd(name):
    model, X, y = hugging_face_problem(name)
    loss = nn.CrossEntropyLoss()
    params = dict(model.named_parameters())
    v = {k: torch.randn_like(p) for k, p in params.items()}
    with sdpa_kernel([SDPBackend.MATH]):  # CPU flash attention has no second derivatives
        # Hessian-vector product: double backward of the loss
        value = loss(model(X), y)
        grads = torch.autograd.grad(value, list(params.values()), create_graph=True)
        dot = sum((g * v[k]).sum() for g, k in zip(grads, params))
        hv = dict(zip(params, torch.autograd.grad(dot, list(params.values()))))
        # GGN-vector product: Jᵀ H J v from a forward-mode Jacobian-vector product, whose
        # F.embedding counts the padding row that its reverse mode (J's transpose) drops
        model_fn, detached = pf.functional(model)
        tangent = dict(v)
        for name, module in model.named_modules():
            if isinstance(module, nn.Embedding) and module.padding_idx is not None:
                tangent[f"{name}.weight"] = v[f"{name}.weight"].index_fill(
                    0, torch.tensor(module.padding_idx), 0.0
                )
        out, jv = torch.func.jvp(lambda p: model_fn(p, X), (detached,), (tangent,))
        hjv = torch.func.jvp(torch.func.grad(lambda f: loss(f, y)), (out,), (jv,))[1]
        gv = dict(zip(params, torch.autograd.grad(model(X), list(params.values()), hjv)))
    assert_trees_close(pf.ggn_vector_product(model_fn, detached, X, y, v), gv, **TOLERANCES)
    assert_trees_close(pf.hessian_vector_product(model_fn, detached, X, y, v), hv, **TOLERANCES)


@pytest.mark.parametrize("name", ["gpt2", "vit"])
def test_hessian_diagonal_of_hugging_face_models_matches_autograd(name):
    model, X, y = hugging_face_problem(name, n=2)
    params = dict(model.named_parameters())
    with sdpa_kernel([SDPBackend.MATH]):  # CPU flash attention has no second derivatives
        value = nn.CrossEntropyLoss()(model(X), y)
        grads = torch.autograd.grad(value, list(params.values()), create_graph=True)
    expected = {}
    for (k, p), g in zip(params.items(), grads):  # one double backward per coordinate
        flat = g.reshape(-1)
        rows = [
            torch.autograd.grad(flat[i], p, retain_graph=True)[0].reshape(-1)[i]
            for i in range(flat.numel())
        ]
        expected[k] = torch.stack(rows).view_as(p)
    found = pf.diag_hessian(*pf.functional(model), X, y)
    assert_trees_close(found, expected, **TOLERANCES)


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_monte_carlo_ggn_diagonal_of_hugging_face_models_approaches_the_exact_one(name):
    model, X, y = hugging_face_problem(name)
    model_fn, params = pf.functional(model)
    exact = pf.diag_ggn(model_fn, params, X, y)
    sampled = pf.diag_ggn(
        model_fn, params, X, y, mc_samples=4000, generator=torch.Generator().manual_seed(0)
    )
    scale = max(v.abs().max() for v in exact.values())
    assert max((sampled[k] - exact[k]).abs().max() for k in exact) < 0.1 * scale


@pytest.mark.parametrize(("name", "layer"), [("bert", "classifier"), ("vit", "classifier")])
def test_kflr_of_a_hugging_face_head_is_its_ggn_block_for_one_sample(name, layer):
    model, X, y = hugging_face_problem(name, n=1)  # one sample, one position: A ⊗ B is exact
    weight = model.model.get_parameter(f"{layer}.weight")
    out = model(X)
    hessian = torch.func.hessian(lambda f: nn.CrossEntropyLoss()(f, y))(out.detach())[0, :, 0]
    rows = torch.stack(
        [torch.autograd.grad(out[0, c], weight, retain_graph=True)[0].reshape(-1) for c in range(3)]
    )
    expected = rows.T @ hessian @ rows  # the exact GGN block of the weight
    factors = pf.kflr(*pf.functional(model), X, y, on_unsupported="skip")
    a, b = factors[f"model.{layer}.weight"]
    torch.testing.assert_close(torch.kron(a, b), expected, **TOLERANCES)


def test_a_compiled_step_has_no_graph_break_from_packfunc():
    model, X, y = hugging_face_problem("gpt2")
    model_fn, params = pf.functional(model)

    def step(p: dict[str, Tensor]) -> Tensor:
        norms = pf.batch_l2_grad(model_fn, p, X, y)
        return torch.stack(list(norms.values())).sum()

    torch._dynamo.reset()
    explained = torch._dynamo.explain(step)(params)
    assert explained.graph_break_count == 0, explained.break_reasons


class HandWritten(nn.Module):
    """``x @ W + b`` with raw parameters, then a head: the hand-written linear layer."""

    def __init__(self) -> None:
        super().__init__()
        self.w, self.b = nn.Parameter(torch.randn(4, 6)), nn.Parameter(torch.randn(6))

    def forward(self, x: Tensor) -> Tensor:
        return (torch.tanh(x @ self.w + self.b)).mean(1)[:, :3]


def test_a_hand_written_matmul_is_a_linear_layer():
    torch.manual_seed(0)
    model = HandWritten().double()
    linear = nn.Linear(4, 6).double()
    with torch.no_grad():
        linear.weight.copy_(model.w.T)
        linear.bias.copy_(model.b)
    X, y = torch.randn(5, 7, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    model_fn, params = pf.functional(model)
    assert pf.explain(model_fn, params, X)["w"] == "closed form (x @ W)"
    found = pf.kflr(model_fn, params, X, y, on_unsupported="skip")["w"]
    copy_fn, copy_params = pf.functional(nn.Sequential(linear, nn.Tanh(), Mean(), Slice()))
    expected = pf.kflr(copy_fn, copy_params, X, y)["0.weight"]
    assert_trees_close(list(found), list(expected[::-1]))
    grads = pf.batch_grad(model_fn, params, X, y)["w"]
    assert_trees_close(grads, pf.batch_grad(copy_fn, copy_params, X, y)["0.weight"].mT)


class Mean(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.mean(1)


class Slice(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x[:, :3]


class StackedPositions(nn.Module):
    """Position ids stacked once per sample (a batch-sized list): not fixed, yet exact."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(7, 4), nn.Embedding(5, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        ids = torch.stack([torch.arange(x.shape[1])] * x.shape[0])  # [N, T], from N copies
        return self.head(torch.tanh(self.tokens(x) + self.positions(ids)).mean(1))


def test_position_ids_built_per_sample_are_exact():
    torch.manual_seed(0)
    model = StackedPositions().double()
    X, y = torch.randint(0, 7, (4, 5)), torch.randint(0, 3, (4,))
    found = pf.batch_grad(*pf.functional(model), X, y)
    assert_trees_close(found, autograd_batch_grad(model, nn.CrossEntropyLoss(), X, y))
