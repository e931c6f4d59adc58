"""Kronecker factors and block curvature products: dense references, BackPACK, conventions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.functional import hessian, jacobian

import packfunc as pf
from packfunc.engine.chain import NotSequentialError
from tests.cases import (
    assert_trees_close,
    dense_curvature,
    loss_and_targets,
    make_problem,
    pooled_convolution,
    run_backward_with,
)

pytestmark = pytest.mark.filterwarnings(  # BackPACK explains its transposed-kernel convention
    "ignore:The Kronecker factors stored in the weight parameters of transpose"
)

SEQUENTIAL = {
    "mlp": (
        lambda: nn.Sequential(
            nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 5), nn.Sigmoid(), nn.Linear(5, 3)
        ),
        (4,),
    ),
    "cnn": (
        lambda: nn.Sequential(
            nn.Conv2d(2, 3, 2, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(12, 3),
        ),
        (2, 3, 3),
    ),
    "pools": (
        lambda: nn.Sequential(
            nn.Conv2d(2, 3, 2, padding=1),
            nn.ReLU(),
            nn.ZeroPad2d(1),
            nn.MaxPool2d(3, stride=1),
            nn.AvgPool2d(2),
            nn.Flatten(),
            nn.Linear(12, 3),
        ),
        (2, 3, 3),
    ),
    "conv1d": (
        lambda: nn.Sequential(
            nn.Conv1d(2, 3, 3, stride=2, dilation=1), nn.Tanh(), nn.Flatten(), nn.Linear(9, 3)
        ),
        (2, 8),
    ),
    "transposed1d": (
        lambda: nn.Sequential(
            nn.ConvTranspose1d(2, 3, 3, stride=2, dilation=2),
            nn.Tanh(),
            nn.Flatten(),
            nn.Linear(57, 3),
        ),
        (2, 8),
    ),
    "transposed2d": (
        lambda: nn.Sequential(
            nn.ConvTranspose2d(2, 3, (2, 3), stride=(2, 1), padding=(0, 1), output_padding=(1, 0)),
            nn.Sigmoid(),
            nn.Flatten(),
            nn.Linear(63, 3),
        ),
        (2, 3, 3),
    ),
    "transposed3d": (
        lambda: nn.Sequential(
            nn.ConvTranspose3d(2, 2, 2, stride=2, bias=False),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(128, 3),
        ),
        (2, 2, 2, 2),
    ),
}
"""Sequential models BackPACK's KFAC, KFLR and KFRA support. For transposed convolutions the
weight's factors approximate the curvature of ``weight.transpose(0, 1)`` (BackPACK's convention)."""


def _problem(name: str, loss_cls: type, reduction: str, n: int = 5):
    torch.manual_seed(0)
    build, shape = SEQUENTIAL[name]
    model = build().double()
    X = torch.randn(n, *shape, dtype=torch.float64)
    loss, y = loss_and_targets(model, X, loss_cls, reduction)
    return model, loss, X, y


def _backpack(backpack, model, loss, X, y, *exts):
    return run_backward_with(backpack, list(exts), model, loss, X, y)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("loss_cls", [nn.CrossEntropyLoss, nn.MSELoss])
@pytest.mark.parametrize("name", list(SEQUENTIAL))
def test_kflr_kfra_and_kfac_inputs_equal_backpack(name, loss_cls, reduction, backpack_oracle):
    extensions = backpack_oracle.extensions
    model, loss, X, y = _problem(name, loss_cls, reduction)
    theirs = _backpack(
        backpack_oracle, model, loss, X, y, extensions.KFLR(), extensions.KFRA(), extensions.KFAC()
    )
    model_fn, params = pf.functional(model)
    kflr = pf.kflr(model_fn, params, X, y, loss=loss)
    kfra = pf.kfra(model_fn, params, X, y, loss=loss)
    kfac = pf.kfac(model_fn, params, X, y, loss=loss)
    for param_name, p in theirs.named_parameters():
        for ours, reference in ((kflr, p.kflr), (kfra, p.kfra)):
            assert len(ours[param_name]) == len(reference)
            for a, b in zip(ours[param_name], reference):
                torch.testing.assert_close(a, b)
        assert [f.shape for f in kfac[param_name]] == [f.shape for f in p.kfac]
        if len(p.kfac) == 2:
            torch.testing.assert_close(kfac[param_name][1], p.kfac[1])


def test_kfac_output_factor_converges_to_kflr():
    model, loss, X, y = _problem("mlp", nn.CrossEntropyLoss, "mean")
    model_fn, params = pf.functional(model)
    exact = pf.kflr(model_fn, params, X, y, loss=loss)

    def error(samples: int) -> float:
        sampled = pf.kfac(
            model_fn,
            params,
            X,
            y,
            loss=loss,
            mc_samples=samples,
            generator=torch.Generator().manual_seed(0),
        )
        return max(
            float((sampled[k][0] - exact[k][0]).abs().max() / exact[k][0].abs().max())
            for k in params
        )

    few, many = error(5), error(20_000)
    assert many < 0.05 and many < few / 5, (few, many)


def _ggn_block(model, loss, X, y, name: str) -> torch.Tensor:
    dense = dense_curvature(model, loss, X, y)
    sizes = [s.numel() for s in dense.shapes]
    start = sum(sizes[: dense.names.index(name)])
    size = sizes[dense.names.index(name)]
    return dense.ggn[start : start + size, start : start + size]


def test_single_linear_layer_kflr_is_the_exact_ggn_block():
    torch.manual_seed(0)
    model = nn.Linear(4, 3).double()
    X, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    loss = nn.MSELoss()
    model_fn, params = pf.functional(model)
    A, B = pf.kflr(model_fn, params, X, y, loss=loss)["weight"]
    torch.testing.assert_close(torch.kron(A, B), _ggn_block(model, loss, X, y, "weight"))
    (A_bias,) = pf.kflr(model_fn, params, X, y, loss=loss)["bias"]
    torch.testing.assert_close(A_bias, _ggn_block(model, loss, X, y, "bias"))


@pytest.mark.parametrize("kfac_approx", ["sum", "expand", "reduce"])
def test_weight_and_bias_output_factors_are_their_exact_blocks_and_separate_tensors(kfac_approx):
    """The position-summed output factor is computed once per layer call, owned by each leaf."""
    model, X, y, loss = _per_position_problem()
    model_fn, params = pf.functional(model)
    found = pf.kflr(model_fn, params, X, y, loss=loss, kfac_approx=kfac_approx)
    (A_bias,) = found["shared.bias"]
    torch.testing.assert_close(A_bias, _ggn_block(model, loss, X, y, "shared.bias"))
    A_weight = found["shared.weight"][0]
    if kfac_approx != "expand":
        torch.testing.assert_close(A_weight, A_bias)
    assert A_weight.data_ptr() != A_bias.data_ptr()
    sampled = pf.kfac(  # sampled columns are dense over positions: Σ_l s sᵀ ≠ (Σ_l s)(Σ_l s)ᵀ
        model_fn,
        params,
        X,
        y,
        loss=loss,
        kfac_approx=kfac_approx,
        mc_samples=2,
        generator=torch.Generator().manual_seed(0),
    )
    summed = torch.allclose(sampled["shared.weight"][0], sampled["shared.bias"][0])
    assert summed == (kfac_approx != "expand")
    mlp_fn, mlp_params = pf.functional(nn.Linear(3, 2).double())
    one_position = pf.kflr(mlp_fn, mlp_params, X[:, 0], y[:, :2], loss=loss, kfac_approx="expand")
    torch.testing.assert_close(one_position["weight"][0], one_position["bias"][0])
    assert one_position["weight"][0].data_ptr() != one_position["bias"][0].data_ptr()


class PerPosition(nn.Module):
    """A linear layer applied to every position of a sequence, twice (weight sharing)."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(3, 2)

    def forward(self, x):
        return torch.cat([self.shared(x), self.shared(2 * x.flip(1))], 1).flatten(1)


class Broadcast(nn.Module):
    """A linear layer applied to the same input at every position."""

    def __init__(self, positions: int = 4):
        super().__init__()
        self.positions = positions
        self.layer = nn.Linear(3, 2)

    def forward(self, x):
        return torch.tanh(self.layer(x.unsqueeze(1).expand(-1, self.positions, -1))).flatten(1)


def _per_position_problem() -> tuple[nn.Module, torch.Tensor, torch.Tensor, nn.Module]:
    """``PerPosition`` in float64 with inputs, targets and a summed MSE."""
    torch.manual_seed(0)
    model = PerPosition().double()
    X = torch.randn(3, 4, 3, dtype=torch.float64)
    y = torch.randn(3, 16, dtype=torch.float64)
    return model, X, y, nn.MSELoss(reduction="sum")


def test_expand_is_exact_for_positions_and_shared_calls():
    model, X, y, loss = _per_position_problem()
    model_fn, params = pf.functional(model)
    A, B = pf.kflr(model_fn, params, X, y, loss=loss, kfac_approx="expand")["shared.weight"]
    torch.testing.assert_close(torch.kron(A, B), _ggn_block(model, loss, X, y, "shared.weight"))


def test_reduce_is_exact_when_every_position_sees_the_same_input():
    torch.manual_seed(0)
    model = Broadcast().double()
    X, y = torch.randn(1, 3, dtype=torch.float64), torch.randn(1, 8, dtype=torch.float64)
    loss = nn.MSELoss()
    model_fn, params = pf.functional(model)
    A, B = pf.kflr(model_fn, params, X, y, loss=loss, kfac_approx="reduce")["layer.weight"]
    torch.testing.assert_close(torch.kron(A, B), _ggn_block(model, loss, X, y, "layer.weight"))
    summed = pf.kflr(model_fn, params, X, y, loss=loss, kfac_approx="sum")["layer.weight"]
    torch.testing.assert_close(summed[1], 4 * B)  # Σ over the 4 positions, / N


def test_sum_is_the_default_and_reduces_a_with_expands_b_times_the_positions():
    """``"sum"``: ``"reduce"``'s ``A`` and ``"expand"``'s ``B`` times the ``L`` positions."""
    model, loss, X, y = _problem("conv1d", nn.CrossEntropyLoss, "mean")
    model_fn, params = pf.functional(model)
    found = {
        approx: pf.kflr(model_fn, params, X, y, loss=loss, kfac_approx=approx)["0.weight"]
        for approx in ("sum", "expand", "reduce")
    }
    positions = 3  # Conv1d(kernel 3, stride 2) over 8 entries
    torch.testing.assert_close(found["sum"][0], found["reduce"][0])
    torch.testing.assert_close(found["sum"][1], positions * found["expand"][1])
    assert not torch.allclose(found["sum"][0], found["expand"][0])
    assert not torch.allclose(found["sum"][1], found["reduce"][1])
    for a, b in zip(pf.kflr(model_fn, params, X, y, loss=loss)["0.weight"], found["sum"]):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("name", ["cnn", "conv1d", "transposed2d"])
def test_backpack_uses_the_sum_convention(name, backpack_oracle):
    """BackPACK's KFLR (and KFAC's ``B``) on layers with positions is ``"sum"``, neither of
    curvlinops' conventions."""
    extensions = backpack_oracle.extensions
    model, loss, X, y = _problem(name, nn.CrossEntropyLoss, "mean")
    theirs = _backpack(backpack_oracle, model, loss, X, y, extensions.KFLR(), extensions.KFAC())
    weight = dict(theirs.named_parameters())["0.weight"]
    model_fn, params = pf.functional(model)
    for approx in ("sum", "expand", "reduce"):
        A, B = pf.kflr(model_fn, params, X, y, loss=loss, kfac_approx=approx)["0.weight"]
        same = torch.allclose(A, weight.kflr[0]) and torch.allclose(B, weight.kflr[1])
        assert same == (approx == "sum"), approx
    sampled = pf.kfac(model_fn, params, X, y, loss=loss, kfac_approx="sum")["0.weight"]
    torch.testing.assert_close(sampled[1], weight.kfac[1])


@pytest.mark.parametrize("approx", ["backpack", "mean", "Sum"])
def test_unknown_and_former_kfac_approx_names_are_refused(approx):
    model, loss, X, y = _problem("conv1d", nn.CrossEntropyLoss, "mean")
    model_fn, params = pf.functional(model)
    match = "'sum'" if approx == "backpack" else "must be one of"
    calls = (pf.kflr, pf.kfac, pf.ekfac)
    for function in calls:
        with pytest.raises(ValueError, match=match):
            function(model_fn, params, X, y, loss=loss, kfac_approx=approx)


CURVLINOPS_MODELS = {
    "linear_over_sequences": (
        lambda: nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Flatten(), nn.Linear(21, 3)),
        (7, 4),
    ),
    "conv2d": (
        lambda: nn.Sequential(
            nn.Conv2d(2, 3, 3, padding=1, stride=2), nn.ReLU(), nn.Flatten(), nn.Linear(27, 3)
        ),
        (2, 6, 6),
    ),
}
"""Layers with positions (7 sequence entries ``[N, L, d]``, 9 pixels) that curvlinops takes."""


@pytest.mark.parametrize(
    ("fisher_type", "reduction"),
    [("type-2", "sum"), ("type-2", "mean"), ("empirical", "sum"), ("empirical", "mean")],
)
@pytest.mark.parametrize("loss_cls", [nn.CrossEntropyLoss, nn.MSELoss])
@pytest.mark.parametrize("kfac_approx", ["expand", "reduce"])
@pytest.mark.parametrize("name", list(CURVLINOPS_MODELS))
def test_expand_and_reduce_equal_curvlinops(name, kfac_approx, loss_cls, fisher_type, reduction):
    """Weight factors equal curvlinops' ``KFACLinearOperator`` (exact: ``"type-2"``, or the
    empirical Fisher; with a mean its factors were ``N`` times curvlinops', ``Σ g_n g_nᵀ``
    of the per-sample gradients of the mean, found by a probe: now ``Σ ∇ℓ_n ∇ℓ_nᵀ / N``,
    scaled as the loss as every other factor is)."""
    curvlinops = pytest.importorskip("curvlinops")
    torch.manual_seed(0)
    build, shape = CURVLINOPS_MODELS[name]
    model = build().double()
    X = torch.randn(5, *shape, dtype=torch.float64)
    loss, y = loss_and_targets(model, X, loss_cls, reduction)
    operator = curvlinops.KFACLinearOperator(
        model,
        loss,
        list(model.parameters()),
        [(X, y)],
        fisher_type=fisher_type,
        kfac_approx=kfac_approx,
        check_deterministic=False,
    )
    operator.compute_kronecker_factors()
    model_fn, params = pf.functional(model)
    if fisher_type == "type-2":
        found = pf.kflr(model_fn, params, X, y, loss=loss, kfac_approx=kfac_approx)
    else:
        found = pf.kfac(
            model_fn, params, X, y, loss=loss, kfac_approx=kfac_approx, fisher_type="empirical"
        )
    for layer in ("0", "3"):
        A, B = found[f"{layer}.weight"]
        torch.testing.assert_close(A, operator._gradient_covariances[layer])
        torch.testing.assert_close(B, operator._input_covariances[layer])


def test_layers_written_with_torch_functional_and_residual_nets_are_detected():
    torch.manual_seed(0)
    params = {
        "w1": torch.randn(4, 3, dtype=torch.float64),
        "b1": torch.zeros(4).double(),
        "k": torch.randn(2, 1, 3, dtype=torch.float64),
        "w2": torch.randn(3, 4 + 2 * 2, dtype=torch.float64),
    }

    def model_fn(p, X):
        h = torch.tanh(F.linear(X, p["w1"], p["b1"]))
        c = F.conv1d(h.unsqueeze(1), p["k"]).flatten(1)
        return F.linear(torch.cat([h, c], 1), p["w2"])  # residual-style concatenation

    X, y = torch.randn(5, 3, dtype=torch.float64), torch.randint(0, 3, (5,))
    factors = pf.kflr(model_fn, params, X, y)
    assert [f.shape for f in factors["k"]] == [(2, 2), (3, 3)]
    assert [f.shape for f in factors["w2"]] == [(3, 3), (8, 8)]
    with pytest.raises(NotSequentialError, match="sequential"):
        pf.kfra(model_fn, params, X, y)


def test_kfra_refuses_residual_nets_with_a_clear_error():
    problem = make_problem("residual", n=4)
    with pytest.raises(ValueError, match="sequential networks"):
        pf.kfra(*problem.functional(), problem.X, problem.y)


def test_kfra_leaves_out_a_branch_that_does_not_reach_the_output():
    """A forward hook that logs an activation's statistics reads the activation: no
    residual connection; KFRA equals the model's without the hook (it refused before)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    X, y = torch.randn(5, 3, dtype=torch.float64), torch.randint(0, 2, (5,))
    expected = pf.kfra(*pf.functional(model), X, y)
    logged = []
    model[1].register_forward_hook(lambda m, i, out: logged.append(out.detach().abs().mean()))
    found = pf.kfra(*pf.functional(model), X, y)
    assert logged
    for name in expected:
        for a, b in zip(found[name], expected[name]):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize(
    "case", ["custom_module", "layernorm_groupnorm", "tied_embedding"], indirect=True
)
def test_parameters_without_a_kronecker_rule_are_reported(case):
    problem = make_problem(case, n=4)
    model_fn, params = problem.functional()
    X, y = problem.X, problem.y
    with pytest.raises(ValueError, match="on_unsupported='skip'"):
        pf.kflr(model_fn, params, X, y)
    skipped = pf.kflr(model_fn, params, X, y, on_unsupported="skip")
    assert any(v is None for v in skipped.values())
    assert any(v is not None for v in skipped.values())


@pytest.mark.parametrize(
    "case", ["mlp", "residual", "raw_parameter", "shared_layer", "conv2d", "lstm"], indirect=True
)
def test_block_products_equal_dense_blocks(case):
    problem = make_problem(case, n=3)
    X, y, loss = problem.X, problem.y, problem.loss
    dense = problem.dense()
    model_fn, params = problem.functional()
    mats = {k: torch.randn(4, *p.shape, dtype=torch.float64) for k, p in params.items()}
    ggn = pf.ggn_block_products(model_fn, params, X, y, mats, loss=loss)
    hess = pf.hessian_block_products(model_fn, params, X, y, mats, loss=loss)
    start = 0
    for name, shape in zip(dense.names, dense.shapes):
        size = shape.numel()
        block = slice(start, start + size)
        start += size
        flat = mats[name].reshape(4, -1)
        torch.testing.assert_close(ggn[name].reshape(4, -1), flat @ dense.ggn[block, block])
        torch.testing.assert_close(hess[name].reshape(4, -1), flat @ dense.hessian[block, block])


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_block_products_and_positive_curvature(name, backpack_oracle):
    extensions = backpack_oracle.extensions
    model, loss, X, y = _problem(name, nn.CrossEntropyLoss, "mean")
    theirs = _backpack(
        backpack_oracle,
        model,
        loss,
        X,
        y,
        extensions.GGNMP(),
        extensions.HMP(),
        extensions.PCHMP(modify="abs"),
    )
    model_fn, params = pf.functional(model)
    mats = {k: torch.randn(3, *p.shape, dtype=torch.float64) for k, p in params.items()}
    ggn = pf.ggn_block_products(model_fn, params, X, y, mats, loss=loss)
    hess = pf.hessian_block_products(model_fn, params, X, y, mats, loss=loss)
    exact = pf.pch_block_products(model_fn, params, X, y, mats, loss=loss, modify="none")
    clip = pf.pch_block_products(model_fn, params, X, y, mats, loss=loss, modify="clip")
    absolute = pf.pch_block_products(model_fn, params, X, y, mats, loss=loss, modify="abs")
    for param_name, p in theirs.named_parameters():
        m = mats[param_name]
        torch.testing.assert_close(ggn[param_name], p.ggnmp(m))
        torch.testing.assert_close(hess[param_name], p.hmp(m))
        torch.testing.assert_close(exact[param_name], hess[param_name])  # no modification
        # m·(PCH − GGN)·m = Σ mod(r) (J m)² ≥ 0, and |·| bounds the clipped and exact ones
        quad = {
            key: (v[param_name] * m).flatten(1).sum(1) - (ggn[param_name] * m).flatten(1).sum(1)
            for key, v in (("clip", clip), ("abs", absolute), ("none", exact))
        }
        assert torch.all(quad["clip"] >= -1e-12) and torch.all(quad["abs"] >= quad["clip"] - 1e-12)
        assert torch.all(quad["abs"] >= quad["none"].abs() - 1e-12)


def _pch_first_layer_curvature(model: nn.Sequential, loss: nn.Module, X, y, modify: str):
    """Per sample, the positive-curvature Hessian w.r.t. the first layer's output, by autograd.

    For ``Linear, act₀, Linear, act₁, Linear``: ``C_n = J_outᵀ H_out J_out +
    diag(m(r₀)) + J₁ᵀ diag(m(r₁)) J₁`` with residuals ``r_l = ∂ℓ_n/∂act_l ⊙ act_l''(z_l)``,
    ``J_out``, ``J₁`` the Jacobians of the output and of ``z₁`` w.r.t. ``z₀``, ``m`` the
    modification (``abs`` or ``clip``: ``max(r, 0)``, ``none``: ``r``). With ``none`` it
    is the Hessian w.r.t. ``z₀``, which the caller checks against ``torch`` as well.
    """
    modified = {"abs": torch.abs, "clip": lambda r: r.clamp(min=0), "none": lambda r: r}[modify]
    _, act0, lin1, act1, lin2 = model
    n = X.shape[0]
    scale = 1 / n if loss.reduction == "mean" else 1.0

    def derivative(act, z, order: int = 1):  # elementwise act' or act'' at z
        scalar = act
        for _ in range(order):
            scalar = torch.func.grad(scalar)
        return torch.func.vmap(scalar)(z)

    curvatures = []
    for i in range(n):
        z0 = model[0](X[i : i + 1]).detach()[0]
        z1 = lin1(act0(z0)).detach()

        def share(out, i=i):
            return loss(out.unsqueeze(0), y[i : i + 1]) * scale

        out = lin2(act1(z1)).detach()
        g_out = torch.func.grad(share)(out)
        g_h1 = g_out @ lin2.weight  # ∂ℓ/∂act₁
        g_h0 = (g_h1 * derivative(act1, z1)) @ lin1.weight  # ∂ℓ/∂act₀
        r1 = g_h1 * derivative(act1, z1, order=2)
        r0 = g_h0 * derivative(act0, z0, order=2)
        J_out = jacobian(lambda z: lin2(act1(lin1(act0(z)))), z0)
        J_1 = jacobian(lambda z: lin1(act0(z)), z0)
        C = J_out.T @ hessian(share, out) @ J_out + torch.diag(modified(r0))
        curvatures.append(C + J_1.T @ torch.diag(modified(r1)) @ J_1)
        if modify == "none":
            exact = hessian(lambda z, share=share: share(lin2(act1(lin1(act0(z))))), z0)
            torch.testing.assert_close(curvatures[-1], exact)  # the oracle itself is exact
    return curvatures


@pytest.mark.parametrize("modify", ["abs", "clip", "none"])
def test_pch_products_of_the_first_layer_equal_an_autograd_oracle(modify):
    """BackPACK 1.7.1's PCHMP multiplies the residual by the gradient twice; autograd decides."""
    model, loss, X, y = _problem("mlp", nn.CrossEntropyLoss, "mean")
    model_fn, params = pf.functional(model)
    mats = {k: torch.randn(2, *p.shape, dtype=torch.float64) for k, p in params.items()}
    ours = pf.pch_block_products(model_fn, params, X, y, mats, loss=loss, modify=modify)
    per_sample = _pch_first_layer_curvature(model, loss, X, y, modify)
    bias_block = sum(per_sample)
    weight_block = sum(torch.kron(C, torch.outer(x, x)) for C, x in zip(per_sample, X))
    torch.testing.assert_close(ours["0.bias"], mats["0.bias"] @ bias_block)
    torch.testing.assert_close(
        ours["0.weight"].flatten(1), mats["0.weight"].flatten(1) @ weight_block
    )


def test_pch_refuses_non_elementwise_nonlinearities():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Softmax(dim=1), nn.Linear(4, 2)).double()
    model_fn, params = pf.functional(model)
    X = torch.randn(3, 3, dtype=torch.float64)
    mats = {k: torch.ones(1, *p.shape, dtype=torch.float64) for k, p in params.items()}
    with pytest.raises(ValueError, match="elementwise"):
        pf.pch_block_products(model_fn, params, X, torch.tensor([0, 1, 0]), mats)


def test_grouped_convolutions_share_the_input_factor_across_groups():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(4, 6, 2, groups=2), nn.Flatten(), nn.Linear(6 * 4, 3)).double()
    X, y = torch.randn(5, 4, 3, 3, dtype=torch.float64), torch.randint(0, 3, (5,))
    model_fn, params = pf.functional(model)
    A, B = pf.kflr(model_fn, params, X, y)["0.weight"]
    assert A.shape == (6, 6) and B.shape == (2 * 4, 2 * 4)
    unfolded = F.unfold(X, 2).view(5, 2, 2 * 4, -1)  # [N, groups, C_in/G · k, positions]
    expected = torch.einsum("ngil,ngjl->ij", unfolded, unfolded) / (5 * 2)
    torch.testing.assert_close(B, expected)
    (A_bias,) = pf.kflr(model_fn, params, X, y)["0.bias"]
    diagonal = pf.diag_ggn(model_fn, params, X, y)["0.bias"]
    torch.testing.assert_close(torch.diagonal(A_bias), diagonal)


def _transposed_problem(layer: nn.Module, shape: tuple[int, ...], n: int = 4):
    torch.manual_seed(0)
    model = nn.Sequential(layer, nn.Tanh(), nn.Flatten())
    X = torch.randn(n, *shape)
    model.append(nn.Linear(model(X).shape[1], 3))
    model, X = model.double(), X.double()
    loss, y = loss_and_targets(model, X, nn.CrossEntropyLoss, "mean")
    return model, loss, X, y


def test_transposed_convolution_input_factor_counts_every_output_position(backpack_oracle):
    """BackPACK 1.7.1 unfolds the input with ``output_padding=0``: when padding crops the
    output, the positions ``output_padding`` restores are missing from its input factor
    (so only the output factor is compared with BackPACK; the input factor with unfoldNd)."""
    unfold_transposeNd = pytest.importorskip("unfoldNd").unfold_transposeNd
    layer = nn.ConvTranspose1d(2, 3, 3, stride=2, padding=1, output_padding=1, dilation=2)
    model, loss, X, y = _transposed_problem(layer, (2, 5))
    theirs = _backpack(backpack_oracle, model, loss, X, y, backpack_oracle.extensions.KFLR())
    kflr = pf.kflr(*pf.functional(model), X, y, loss=loss)
    unfolded = unfold_transposeNd(X, 3, stride=2, padding=1, output_padding=1, dilation=2)
    torch.testing.assert_close(
        kflr["0.weight"][1], torch.einsum("nil,njl->ij", unfolded, unfolded) / 4
    )
    torch.testing.assert_close(kflr["0.weight"][0], theirs[0].weight.kflr[0])


@pytest.mark.parametrize("dims", [1, 2])
def test_grouped_transposed_convolutions_share_the_input_factor_across_groups(dims):
    """BackPACK refuses groups > 1; each group is a transposed convolution of its own."""
    layer = getattr(nn, f"ConvTranspose{dims}d")(4, 6, 2, stride=2, padding=1, groups=2)
    model, loss, X, y = _transposed_problem(layer, (4, *[3] * dims))
    model_fn, params = pf.functional(model)
    for method in (pf.kflr, pf.kfra):
        factors = method(model_fn, params, X, y, loss=loss)
        A, B = factors["0.weight"]
        assert A.shape == (6, 6) and B.shape == (2 * 2**dims, 2 * 2**dims)
        torch.testing.assert_close(A, factors["0.bias"][0])  # positions summed, as for the bias
        per_group = []
        for group in range(2):
            alone = getattr(nn, f"ConvTranspose{dims}d")(2, 3, 2, stride=2, padding=1).double()
            alone_fn, alone_params = pf.functional(nn.Sequential(alone, nn.Flatten()))
            inputs = X[:, 2 * group : 2 * group + 2]
            targets = torch.randn(4, alone(inputs).flatten(1).shape[1], dtype=torch.float64)
            per_group.append(
                pf.kflr(alone_fn, alone_params, inputs, targets, loss=nn.MSELoss())["0.weight"][1]
            )
        torch.testing.assert_close(B, sum(per_group) / 2)
    diagonal = pf.diag_ggn(model_fn, params, X, y, loss=loss)["0.bias"]
    torch.testing.assert_close(
        torch.diagonal(pf.kflr(model_fn, params, X, y, loss=loss)["0.bias"][0]), diagonal
    )


def test_kfac_of_a_transposed_convolution_converges_to_kflr():
    model, loss, X, y = _transposed_problem(nn.ConvTranspose2d(2, 3, 2, stride=2), (2, 2, 2))
    model_fn, params = pf.functional(model)
    exact = pf.kflr(model_fn, params, X, y, loss=loss)["0.weight"]
    sampled = pf.kfac(
        model_fn,
        params,
        X,
        y,
        loss=loss,
        mc_samples=20_000,
        generator=torch.Generator().manual_seed(0),
    )["0.weight"]
    torch.testing.assert_close(sampled[1], exact[1])
    assert float((sampled[0] - exact[0]).abs().max() / exact[0].abs().max()) < 0.05


@pytest.mark.parametrize("kfac_approx", ["expand", "reduce"])
def test_transposed_convolution_positions_follow_kfac_approx(kfac_approx):
    """Each factor against its definition: ``G_n`` the GGN w.r.t. the layer's output
    ``[C_out, L]`` (autograd), ``u`` the input unfolded per output position (unfoldNd)."""
    unfold_transposeNd = pytest.importorskip("unfoldNd").unfold_transposeNd
    layer = nn.ConvTranspose1d(2, 3, 3, stride=2, output_padding=1)
    model, loss, X, y = _transposed_problem(layer, (2, 4))
    model_fn, params = pf.functional(model)
    A, B = pf.kflr(model_fn, params, X, y, loss=loss, kfac_approx=kfac_approx)["0.weight"]
    n, positions = X.shape[0], 10  # output length (4 − 1)·2 + 3 + 1
    rest = model[1:]
    ggns = []
    for i in range(n):
        z = model[0](X[i : i + 1]).detach()  # [1, C_out, L]
        J = jacobian(rest, z).reshape(3, -1)  # 3 classes × (C_out·L)
        H = hessian(lambda out, i=i: loss(out.unsqueeze(0), y[i : i + 1]) / n, rest(z)[0].detach())
        ggns.append((J.T @ H @ J).reshape(3, positions, 3, positions))
    u = unfold_transposeNd(X, 3, stride=2, output_padding=1)  # [N, C_in·k, L]
    if kfac_approx == "expand":  # positions as samples
        expected_A = sum(torch.einsum("iljl->ij", G) for G in ggns)
        expected_B = torch.einsum("nil,njl->ij", u, u) / (n * positions)
    else:  # positions summed; the input averaged over them
        expected_A = sum(G.sum((1, 3)) for G in ggns)
        expected_B = torch.einsum("ni,nj->ij", u.mean(2), u.mean(2)) / n
    torch.testing.assert_close(A, expected_A)
    torch.testing.assert_close(B, expected_B)


HESSIAN_CHAINS = {
    "mlp": (
        lambda: nn.Sequential(
            nn.Linear(3, 4), nn.Sigmoid(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3)
        ),
        (3,),
        nn.CrossEntropyLoss(),
    ),
    "cnn": (
        lambda: nn.Sequential(
            nn.Conv2d(2, 3, 2, padding=1),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Tanh(),
            nn.Linear(12, 3),
        ),
        (2, 3, 3),
        nn.MSELoss(),
    ),
}
"""Chains BackPACK's HBP supports with residual curvature (its activations see flat inputs:
for spatial ones BackPACK 1.7.1 fails an assertion on the residual's shape)."""


def _hessian_chain(name: str, n: int = 4):
    torch.manual_seed(0)
    build, shape, loss = HESSIAN_CHAINS[name]
    model = build().double()
    X = torch.randn(n, *shape, dtype=torch.float64)
    _, y = loss_and_targets(model, X, type(loss), loss.reduction)
    return model, loss, X, y


@pytest.mark.parametrize("curvature", ["hessian", "pch-clip", "pch-abs"])
@pytest.mark.parametrize("name", list(HESSIAN_CHAINS))
def test_kfra_hessian_variants_equal_backpack_hbp(name, curvature, backpack_oracle):
    import packfunc.compat as compat

    model, loss, X, y = _hessian_chain(name)
    strategies = (curvature, "sum", "average", "E[J^T E(H) J]")
    theirs = _backpack(
        backpack_oracle, model, loss, X, y, backpack_oracle.extensions.HBP(*strategies)
    )
    shim = run_backward_with(compat, [compat.extensions.HBP(*strategies)], model, loss, X, y)
    model_fn, params = pf.functional(model)
    ours = pf.kfra(model_fn, params, X, y, loss=loss, curvature=curvature)
    ggn = pf.kfra(model_fn, params, X, y, loss=loss)
    for (param_name, p), q in zip(theirs.named_parameters(), shim.parameters()):
        for a, b, c in zip(ours[param_name], p.hbp, q.hbp):
            torch.testing.assert_close(a, b)
            torch.testing.assert_close(c, b)
    # a precondition, not the check: the chain has residual curvature, so the variants differ
    assert not torch.allclose(ours["0.weight"][0], ggn["0.weight"][0])


def test_kfra_hessian_of_one_sample_is_the_exact_hessian_block_of_the_first_layer():
    """With one sample KFRA's expectations are exact: ``H`` at the first layer's output is
    the loss Hessian there, the bias block itself, and ``H ⊗ x xᵀ`` the weight block."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 4), nn.Sigmoid(), nn.Linear(4, 3)
    ).double()
    X, y = torch.randn(1, 3, dtype=torch.float64), torch.tensor([2])
    loss = nn.CrossEntropyLoss()
    dense = dense_curvature(model, loss, X, y)
    model_fn, params = pf.functional(model)
    sizes = {name: shape.numel() for name, shape in zip(dense.names, dense.shapes)}
    starts = dict(zip(dense.names, torch.tensor([0, *sizes.values()]).cumsum(0).tolist()))

    def block(matrix, name):
        return matrix[
            starts[name] : starts[name] + sizes[name], starts[name] : starts[name] + sizes[name]
        ]

    for curvature, matrix in (("hessian", dense.hessian), ("ggn", dense.ggn)):
        factors = pf.kfra(model_fn, params, X, y, loss=loss, curvature=curvature)
        torch.testing.assert_close(factors["0.bias"][0], block(matrix, "0.bias"))
        torch.testing.assert_close(torch.kron(*factors["0.weight"]), block(matrix, "0.weight"))


def test_kfra_hessian_does_not_depend_on_where_a_spatial_activation_is_flattened():
    torch.manual_seed(0)
    conv, head = nn.Conv1d(2, 3, 2), nn.Linear(9, 3)
    before = nn.Sequential(conv, nn.Tanh(), nn.Flatten(), head).double()
    after = nn.Sequential(conv, nn.Flatten(), nn.Tanh(), head).double()
    X, y = torch.randn(4, 2, 4, dtype=torch.float64), torch.tensor([0, 2, 1, 1])
    first = pf.kfra(*pf.functional(before), X, y, curvature="hessian")
    second = pf.kfra(*pf.functional(after), X, y, curvature="hessian")
    for name in ("0.weight", "0.bias"):
        for a, b in zip(first[name], second[name]):
            torch.testing.assert_close(a, b)


def test_hessian_variants_refuse_what_they_cannot_compute():
    from packfunc.compat.extensions import HBP

    with pytest.raises(NotImplementedError, match="cannot carry the activations' residual"):
        HBP("hessian", "exact", "sqrt", "E[J^T E(H) J]")
    model = nn.Sequential(nn.Linear(3, 4), nn.Softmax(dim=1), nn.Linear(4, 2)).double()
    X = torch.randn(3, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="elementwise"):
        pf.kfra(*pf.functional(model), X, torch.tensor([0, 1, 0]), curvature="hessian")
    with pytest.raises(ValueError, match="curvature must be one of"):
        pf.kfra(*pf.functional(model), X, torch.tensor([0, 1, 0]), curvature="fisher")


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_empirical_kfac_uses_the_loss_gradient_at_each_layer_output(reduction):
    """A = Z · Σ_n δ_n δ_nᵀ (δ_n: sample n's share of ∂L/∂z at the layer output, Z = N for a
    mean: the empirical Fisher Σ ∇ℓ_n ∇ℓ_nᵀ / N of the mean, as curvlinops'), B = Σ_n u uᵀ / N."""
    torch.manual_seed(0)
    model = SEQUENTIAL["mlp"][0]().double()
    X, n = torch.randn(6, 4, dtype=torch.float64), 6
    y = torch.randint(0, 3, (n,))
    loss = nn.CrossEntropyLoss(reduction=reduction)
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    hooks = [
        m.register_forward_hook(lambda m, i, o, name=name: seen.__setitem__(name, (i[0], o)))
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear)
    ]
    value = loss(model(X), y)
    for hook in hooks:
        hook.remove()
    deltas = torch.autograd.grad(value, [o for _, o in seen.values()])
    model_fn, params = pf.functional(model)
    found = pf.kfac(model_fn, params, X, y, loss=loss, fisher_type="empirical")
    per_sample = pf.batch_grad(model_fn, params, X, y, loss=loss)
    Z = n if reduction == "mean" else 1
    for (name, (u, _)), delta in zip(seen.items(), deltas):
        A, B = found[f"{name}.weight"]
        torch.testing.assert_close(A, Z * delta.T @ delta)
        torch.testing.assert_close(B, u.T @ u / n)
        g = per_sample[f"{name}.bias"]  # a bias's block is the exact empirical Fisher
        torch.testing.assert_close(found[f"{name}.bias"][0], Z * g.T @ g)
    halves = [(X[:3], y[:3]), (X[3:], y[3:])]
    over_data = pf.kfac(model_fn, params, data=halves, loss=loss, fisher_type="empirical")
    for key, factors in found.items():
        for a, b in zip(factors, over_data[key]):
            torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="fisher_type must be one of"):
        pf.kfac(model_fn, params, X, y, fisher_type="type-2")


@pytest.mark.parametrize("kfac_approx", ["expand", "reduce"])
def test_kfac_unfolds_a_convolution_input_a_few_samples_at_a_time(kfac_approx, monkeypatch):
    """During the backward pass (one column), a convolution's input is unfolded for its
    input factor no more than the input's own size at once (issue 23: the whole unfolded
    input beside the activations was the CNN's peak); the factors are those of one unfold."""
    from packfunc.engine.rules.conv import ConvWeight

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(4, 6, 3, padding=1, groups=2), nn.ReLU(), nn.Flatten(), nn.Linear(6 * 25, 3)
    ).double()
    X, y = torch.randn(16, 4, 5, 5, dtype=torch.float64), torch.randint(0, 3, (16,))
    model_fn, params = pf.functional(model)
    unfolded_samples: list[int] = []
    canonical = ConvWeight.canonical

    def spy(self, x, g, call, param):
        unfolded_samples.append(x.shape[0])
        return canonical(self, x, g, call, param)

    monkeypatch.setattr(ConvWeight, "canonical", spy)
    options = {"fisher_type": "empirical", "kfac_approx": kfac_approx}
    chunked = pf.kfac(model_fn, params, X, y, **options)
    assert max(unfolded_samples) == 16 // 9  # the unfold is 9× the input
    monkeypatch.setattr(ConvWeight, "canonical_input_size", lambda self, x, *_: x[0].numel())
    unfolded_samples.clear()
    at_once = pf.kfac(model_fn, params, X, y, **options)
    assert unfolded_samples == [16]
    for name in ("0.weight", "0.bias"):
        for found, expected in zip(chunked[name], at_once[name]):
            torch.testing.assert_close(found, expected)


def test_a_layer_of_another_shape_after_a_model_change_gets_its_factors_again():
    """A cached plan met a convolution whose input's spatial size changed (its pooling
    kernel set to 1): the layer took the whole-model path and KFLR refused it as "used
    outside a linear or convolution layer", on every later call. The plan is made again."""
    model = pooled_convolution()
    X, y = torch.randn(4, 2, 8, 8, dtype=torch.float64), torch.tensor([0, 1, 1, 0])
    model_fn, params = pf.functional(model)
    pf.kflr(model_fn, params, X, y)
    model[0].kernel_size = model[0].stride = 1
    expected = pf.kflr(*pf.functional(model), X, y)
    assert_trees_close(pf.kflr(model_fn, params, X, y), expected)


def test_kfra_follows_an_op_with_several_outputs_and_refuses_reading_them_twice():
    """``h.max(-1)`` returns values and indices: KFRA's chain lost its values (a batch-sized
    constant re-applied to one sample: torch's shape error). As the next activation they are
    ``amax``'s; read beside ``h`` (``h * h.max(-1).values``) they are a clear refusal."""

    class Pool(nn.Module):
        def __init__(self, pick) -> None:
            super().__init__()
            self.pick = pick

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return self.pick(h.view(h.shape[0], 2, 2))

    def model(pick) -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), Pool(pick), nn.Linear(2, 3)).double()

    X, y = torch.randn(5, 3, dtype=torch.float64), torch.tensor([0, 1, 2, 0, 1])
    found = pf.kfra(*pf.functional(model(lambda h: h.max(-1).values)), X, y)
    expected = pf.kfra(*pf.functional(model(lambda h: h.amax(-1))), X, y)
    assert_trees_close(found, expected)
    twice = model(lambda h: (h * h.max(-1, keepdim=True).values).flatten(1)[:, :2])
    with pytest.raises(NotSequentialError, match="reads an earlier activation"):
        pf.kfra(*pf.functional(twice), X, y)
