"""One forward, one randomness: models that draw random numbers (dropout in training mode).

Every quantity must come from the forward pass whose loss it reports, or be refused
with :class:`RandomModelError`. The oracle is autograd on that one forward: per-sample
gradients as the gradients of each sample's share of the reduced loss, the GGN from
per-sample Jacobians of the same output — so the masks are those of the forward.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

import packfunc as pf
from packfunc.compat import backpack, extend
from packfunc.compat.extensions import (
    KFAC,
    BatchGrad,
    BatchL2Grad,
    DiagGGNExact,
    SumGradSquared,
    Variance,
)
from packfunc.engine.randomness import RandomModelError
from tests.cases import assert_trees_close, moments

TOLERANCES = {"rtol": 1e-7, "atol": 1e-9}


class Noisy(nn.Module):
    """Adds Gaussian noise in training mode (a random op that is not dropout)."""

    def forward(self, x: Tensor) -> Tensor:
        return x + 0.1 * torch.randn_like(x) if self.training else x


class WeightTimesInput(nn.Module):
    """A parameter used as ``w @ x.T``: the whole-model path."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 4))
        self.drop = nn.Dropout(0.5)

    def forward(self, x: Tensor) -> Tensor:
        return (self.w @ self.drop(x).T).T


class RecurrentDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(4, 5, num_layers=2, dropout=0.3, batch_first=True)
        self.head = nn.Linear(5, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.lstm(x)[0][:, -1])


def _models() -> dict[str, tuple[nn.Module, tuple[int, ...], bool]]:
    """Name -> (model in training mode, per-sample input shape, plain forward = packfunc's).

    The last flag says whether packfunc's batch pass draws exactly what a plain forward
    draws from the same seed (dropout modules, noise), so a plain forward is the oracle.
    Recurrent and attention layers are decomposed by packfunc's own pass, which draws its
    masks in another order: only internal consistency is checked there.
    """
    return {
        "tanh_dropout": (
            nn.Sequential(nn.Linear(4, 5), nn.Dropout(0.4), nn.Tanh(), nn.Linear(5, 3)),
            (4,),
            True,
        ),
        "relu_dropout": (
            nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Dropout(0.5), nn.Linear(5, 3)),
            (4,),
            True,
        ),
        "alpha_dropout": (
            nn.Sequential(nn.Linear(4, 5), nn.SELU(), nn.AlphaDropout(0.3), nn.Linear(5, 3)),
            (4,),
            True,
        ),
        "noise": (nn.Sequential(nn.Linear(4, 5), Noisy(), nn.Tanh(), nn.Linear(5, 3)), (4,), True),
        "weight_times_input": (WeightTimesInput(), (4,), True),
        "lstm": (RecurrentDropout(), (6, 4), False),
        "attention": (
            nn.Sequential(
                nn.TransformerEncoderLayer(4, 2, 8, dropout=0.2, batch_first=True),
                nn.Flatten(),
                nn.Linear(12, 3),
            ),
            (3, 4),
            False,
        ),
    }


def _problem(name: str, n: int, reduction: str, seed: int):
    torch.manual_seed(seed)
    model, shape, plain = _models()[name]
    model = model.double().train()
    X = torch.randn(n, *shape, dtype=torch.float64)
    y = torch.randint(0, 3, (n,))
    return model, X, y, nn.CrossEntropyLoss(reduction=reduction), plain


def _one_forward_oracle(model: nn.Module, out: Tensor, loss: nn.Module, y: Tensor) -> dict:
    """First-order quantities and GGN diagonals of the forward that produced ``out``."""
    params = dict(model.named_parameters())
    n = out.shape[0]
    rows = torch.arange(n).view(-1, *([1] * (out.dim() - 1)))
    per_sample = []
    for i in range(n):  # sample i's share: only its row of the output keeps its graph
        share = loss(torch.where(rows == i, out, out.detach()), y)
        grads = torch.autograd.grad(share, list(params.values()), retain_graph=True)
        per_sample.append(grads)
    batch = {name: torch.stack([g[j] for g in per_sample]) for j, name in enumerate(params)}
    found = moments(batch)
    # GGN: per-sample Jacobians of the same output, the loss Hessian w.r.t. each row
    hessian = torch.func.hessian(lambda f: loss(f, y))(out.detach())  # [N, C, N, C]
    diag = {name: torch.zeros(n, *p.shape, dtype=p.dtype) for name, p in params.items()}
    for i in range(n):
        jac = [
            torch.autograd.grad(out[i, c], list(params.values()), retain_graph=True)
            for c in range(out.shape[1])
        ]
        for j, name in enumerate(params):
            rows_j = torch.stack([row[j] for row in jac])  # [C, *p]
            h = hessian[i, :, i, :]
            diag[name][i] = torch.einsum("cd,c...,d...->...", h, rows_j, rows_j)
    found["batch_diag_ggn"] = diag
    found["diag_ggn"] = {name: d.sum(0) for name, d in diag.items()}
    clipped = pf.clip_per_sample(batch, CLIP)
    found["clipped_grad"] = {name: g.sum(0) for name, g in clipped.items()}
    return found


CLIP = 0.5
"""The clipping bound of ``clipped_grad``."""


FUNCTIONAL = list(pf.QUANTITIES)  # every name compute() takes


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(list(_models())),
    quantity=st.sampled_from(FUNCTIONAL),
    n=st.sampled_from([1, 3]),
    reduction=st.sampled_from(["mean", "sum"]),
    seed=st.integers(0, 2**16),
)
def test_functional_quantities_come_from_the_forward_of_their_loss(
    name, quantity, n, reduction, seed
):
    model, X, y, loss, plain = _problem(name, n, reduction, seed)
    model_fn, params = pf.functional(model)
    torch.manual_seed(seed + 1)
    options = {"max_norm": CLIP} if quantity == "clipped_grad" else {}
    try:
        result = pf.compute(
            model_fn, params, X, y, quantities=("grad", quantity), loss=loss, **options
        )
    except RandomModelError as error:
        assert "model.eval()" in str(error)
        return
    except ValueError as error:  # clipping needs each sample's own (summed) loss
        assert quantity == "clipped_grad" and reduction == "mean", error
        assert "reduction='sum'" in str(error)
        return
    if plain:  # a plain forward from the same seed draws the same masks
        torch.manual_seed(seed + 1)
        out = model(X)
        oracle = _one_forward_oracle(model, out, loss, y)
        torch.testing.assert_close(result["loss"], loss(out, y).detach())
        if quantity == "sqrt_ggn":
            per_sample = {k: v.square().sum(0) for k, v in result[quantity].items()}
            assert_trees_close(per_sample, oracle["batch_diag_ggn"], quantity, **TOLERANCES)
        elif quantity in ("diag_hessian", "batch_diag_hessian"):
            # only the piecewise-linear model runs (its Hessian diagonal is the GGN's)
            assert name == "relu_dropout", name
            expected = oracle[quantity.replace("hessian", "ggn")]
            assert_trees_close(result[quantity], expected, quantity, **TOLERANCES)
        else:
            assert_trees_close(result[quantity], oracle[quantity], quantity, **TOLERANCES)
        assert_trees_close(result["grad"], oracle["grad"], "grad", **TOLERANCES)
    elif quantity == "batch_grad":
        summed = {k: v.sum(0) for k, v in result["batch_grad"].items()}
        assert_trees_close(summed, result["grad"], "batch_grad.sum(0)", **TOLERANCES)


@pytest.mark.parametrize("name", list(_models()))
@pytest.mark.parametrize(
    "function", ["kfac", "kflr", "kfra", "ekfac", "ggn_vector_product", "hessian_vector_product"]
)
def test_other_functions_run_or_refuse_clearly(name, function):
    model, X, y, loss, _ = _problem(name, 3, "mean", 0)
    model_fn, params = pf.functional(model)
    ones = {k: torch.ones_like(p) for k, p in params.items()}
    extra = {"v": ones} if "product" in function else {}
    options = {"on_unsupported": "skip"} if function in ("kfac", "kflr", "ekfac") else {}
    try:
        getattr(pf, function)(model_fn, params, X, y, loss=loss, **extra, **options)
    except RandomModelError as error:
        assert "model.eval()" in str(error)
    except ValueError as error:  # KFRA on a model that is not a chain
        assert function == "kfra" and "sequential" in str(error), error


@settings(max_examples=25, deadline=None)
@given(
    name=st.sampled_from(list(_models())),
    n=st.sampled_from([1, 3]),
    reduction=st.sampled_from(["mean", "sum"]),
    seed=st.integers(0, 2**16),
)
def test_shim_results_come_from_the_users_forward(name, n, reduction, seed):
    model, X, y, loss, _ = _problem(name, n, reduction, seed)
    extend(model)
    lossfunc = extend(loss)
    extensions = [BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance(), DiagGGNExact()]
    out = model(X)
    try:
        with backpack(*extensions, retain_graph=True):
            lossfunc(out, y).backward(retain_graph=True)
    except RandomModelError as error:
        assert "model.eval()" in str(error)
        return
    oracle = _one_forward_oracle(model, out, loss, y)
    for ext, quantity in zip(
        extensions, ["batch_grad", "batch_l2_grad", "sum_grad_squared", "variance", "diag_ggn"]
    ):
        found = {k: getattr(p, ext.savefield) for k, p in model.named_parameters()}
        assert_trees_close(found, oracle[quantity], quantity, **TOLERANCES)
    grads = {k: p.grad for k, p in model.named_parameters()}
    assert_trees_close(grads, oracle["grad"], ".grad", **TOLERANCES)


def test_discovery_leaves_the_users_random_stream_alone():
    model = nn.Sequential(nn.Linear(4, 5), nn.Dropout(0.5), nn.Linear(5, 3)).train()
    model_fn, params = pf.functional(model)
    X, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    torch.manual_seed(3)
    expected = model(X)  # a plain forward from seed 3
    torch.manual_seed(3)
    pf.explain(model_fn, params, X)  # probes only
    assert torch.equal(model(X), expected)
    torch.manual_seed(3)
    loss = pf.compute(model_fn, params, X, y, quantities=("batch_grad",))["loss"]
    torch.manual_seed(3)
    torch.testing.assert_close(loss, nn.CrossEntropyLoss()(model(X), y).detach())


def test_refusal_names_the_random_call_and_the_fix():
    model = WeightTimesInput().train()
    model_fn, params = pf.functional(model)
    with pytest.raises(RandomModelError, match=r"dropout\(p=0\.5\).*whole-model path.*eval"):
        pf.batch_grad(model_fn, params, torch.randn(3, 4), torch.randint(0, 3, (3,)))
    model.eval()  # deterministic: the whole-model path is exact
    pf.batch_grad(model_fn, params, torch.randn(3, 4), torch.randint(0, 3, (3,)))


def test_a_weight_dropped_by_a_parametrization_is_refused_not_drawn_again():
    """DropConnect (dropout of the weight in a parametrization, training mode): a call on
    parameters alone, which the closed forms recompute from the parameters, drawing
    another mask (torch's raw 'called random operation while in randomness error mode'
    under vmap). Refused by name; in evaluation mode the closed forms are exact."""
    import torch.nn.utils.parametrize as parametrize

    class DropConnect(nn.Module):
        def forward(self, weight: Tensor) -> Tensor:
            return nn.functional.dropout(weight, 0.5, training=self.training)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    parametrize.register_parametrization(model[0], "weight", DropConnect())
    model_fn, params = pf.functional(model)
    X, y = torch.randn(5, 3, dtype=torch.float64), torch.randint(0, 2, (5,))
    with pytest.raises(RandomModelError, match=r"dropout\(p=0\.5\).*eval"):
        pf.batch_grad(model_fn, params, X, y)
    model.eval()
    from tests.cases import assert_batch_grad_is_a_loop

    assert_batch_grad_is_a_loop(model_fn, params, X, y)


def test_shim_refuses_a_random_model_it_must_run_again():
    model = extend(RecurrentDropout().train())
    lossfunc = extend(nn.CrossEntropyLoss())
    with backpack(BatchGrad()), pytest.raises(RandomModelError, match=r"lstm.*dropout"):
        lossfunc(model(torch.randn(3, 6, 4)), torch.randint(0, 3, (3,))).backward()


def test_shim_kfac_skips_parameters_without_a_rule_with_a_warning():
    model = extend(nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5), nn.Linear(5, 3)))
    lossfunc = extend(nn.CrossEntropyLoss())
    with backpack(KFAC()), pytest.warns(UserWarning, match="no Kronecker rule.*1.weight"):
        lossfunc(model(torch.randn(3, 4)), torch.randint(0, 3, (3,))).backward()
    assert len(model[0].weight.kfac) == 2
    assert not hasattr(model[1].weight, "kfac")


def test_a_models_own_generator_draws_for_the_batch_as_one_forward_would():
    """A drop path drawing from the model's own ``torch.Generator``: discovery's forward of
    one sample drew from it too, so the batch pass used another mask than the user's
    forward would and the generator ended one forward ahead."""

    class DropPath(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.branch, self.head = nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 3)
            self.generator = torch.Generator().manual_seed(5)
            self.mask = torch.zeros(0)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.first(x))
            keep = torch.full((x.shape[0], 1), 0.6)
            self.mask = torch.bernoulli(keep, generator=self.generator)
            return self.head(h + torch.tanh(self.branch(h)) * self.mask / 0.6)

    torch.manual_seed(0)
    model = DropPath()
    X, y = torch.randn(6, 3), torch.tensor([0, 1, 2, 0, 1, 2])
    model(X)
    mask, state = model.mask, model.generator.get_state()
    model.generator.manual_seed(5)
    pf.batch_grad(*pf.functional(model), X, y)
    torch.testing.assert_close(model.mask, mask)
    assert torch.equal(model.generator.get_state(), state)


class _StackedLSTM(nn.Module):
    """Two LSTM layers with dropout between them, a head on the mean over time."""

    def __init__(self) -> None:
        super().__init__()
        self.core = nn.LSTM(4, 4, num_layers=2, dropout=0.5, batch_first=True)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.core(x)[0].mean(1))


def test_dropout_between_recurrent_layers_draws_the_masks_of_the_models_own_forward():
    """packfunc's recurrent path drew the masks sample-major, torch's kernels draw them
    time-major: per-sample gradients were consistent with packfunc's loss, but not with
    the same seed's plain forward (up to 100 % of the gradient off; a probe)."""
    torch.manual_seed(1)
    model = _StackedLSTM().double().train()
    fn, p = pf.functional(model)
    X, y = torch.randn(3, 4, 4, dtype=torch.float64), torch.tensor([0, 2, 1])
    loss = nn.CrossEntropyLoss(reduction="sum")
    torch.manual_seed(123)
    found = pf.batch_grad(fn, p, X, y, loss=loss)
    torch.manual_seed(123)
    model.zero_grad()
    loss(model(X), y).backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(found[name].sum(0), param.grad)
