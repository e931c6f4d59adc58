"""packfunc as a native laplace-torch backend: ``Laplace(..., backend=PackfuncGGN/PackfuncEF)``.

On sequential models every fit (all weights, last layer, subnetwork; diag, kron, full;
classification and regression) must equal the one with laplace-torch's BackPACK backend to
float64 round-off. On a residual net with LayerNorm, which the BackPACK backend refuses, the
curvature is checked against a dense autograd GGN (``_dense_ggn``) and the
marginal likelihood against laplace's curvlinops backend where that one works.

"""

from __future__ import annotations

import copy
import subprocess
import sys
import types
from typing import Any

import pytest
import torch
from torch import nn
from torch.autograd.functional import hessian, jacobian
from torch.utils.data import DataLoader, TensorDataset

import packfunc as pf
from tests.cases import TransformerBlock

pytest.importorskip("laplace")
from laplace import Laplace  # noqa: E402
from laplace.curvature.curvature import CurvatureInterface  # noqa: E402

from packfunc.integrations.laplace import PackfuncEF, PackfuncGGN  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:Full backward hook is firing",
    "ignore:Extension saving to",  # BackPACK meeting modules it has no rule for
    "ignore:By default `link_approx` is `probit`",
    "ignore::DeprecationWarning",
)

N = 20


class ResidualNorm(nn.Module):
    """A residual block with LayerNorm between two Linear layers (BackPACK has no rule)."""

    def __init__(self, outputs: int = 3):
        super().__init__()
        self.inp = nn.Linear(4, 5)
        self.norm = nn.LayerNorm(5)
        self.inner = nn.Linear(5, 5)
        self.head = nn.Linear(5, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = h + torch.tanh(self.inner(self.norm(h)))
        return self.head(h)


def _data(likelihood: str) -> tuple[torch.Tensor, torch.Tensor]:
    X = torch.randn(N, 4, dtype=torch.float64)
    if likelihood == "classification":
        return X, torch.randint(0, 3, (N,))
    return X, torch.randn(N, 2, dtype=torch.float64)


def _problem(likelihood: str, residual: bool = False) -> tuple[nn.Module, DataLoader]:
    torch.manual_seed(0)
    outputs = 3 if likelihood == "classification" else 2
    if residual:
        model: nn.Module = ResidualNorm(outputs)
    else:
        model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, outputs))
    X, y = _data(likelihood)
    return model.double(), DataLoader(TensorDataset(X, y), batch_size=N // 2)


def _fit(model: nn.Module, loader: DataLoader, likelihood: str, backend: type, **options: Any):
    la = Laplace(copy.deepcopy(model), likelihood, backend=backend, **options)
    la.fit(loader)
    return la


def _precision(la: Any) -> torch.Tensor:
    precision = la.posterior_precision
    return precision.to_matrix() if hasattr(precision, "to_matrix") else precision


def _assert_same_fit(ours: Any, theirs: Any, X: torch.Tensor) -> None:
    torch.testing.assert_close(_precision(ours), _precision(theirs), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(
        ours.log_marginal_likelihood(), theirs.log_marginal_likelihood(), rtol=1e-10, atol=0
    )
    predicted, expected = ours(X, pred_type="glm"), theirs(X, pred_type="glm")
    for a, b in zip(*(p if isinstance(p, tuple) else (p,) for p in (predicted, expected))):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


FITS = [
    (structure, curvature)
    for structure in ("diag", "kron", "full")
    for curvature in ("ggn", "ef")
    if (structure, curvature) != ("kron", "ef")  # BackPACK's backend has no Kronecker EF
]


@pytest.mark.parametrize("likelihood", ["classification", "regression"])
@pytest.mark.parametrize("subset", ["all", "last_layer"])
@pytest.mark.parametrize(("structure", "curvature"), FITS)
def test_fit_equals_the_backpack_backend(
    backpack_oracle: types.ModuleType, likelihood: str, subset: str, structure: str, curvature: str
):
    from laplace.curvature import BackPackEF, BackPackGGN

    ours, theirs = (PackfuncGGN, BackPackGGN) if curvature == "ggn" else (PackfuncEF, BackPackEF)
    model, loader = _problem(likelihood)
    options = {"subset_of_weights": subset, "hessian_structure": structure}
    fitted = [_fit(model, loader, likelihood, backend, **options) for backend in (ours, theirs)]
    _assert_same_fit(*fitted, loader.dataset.tensors[0][:4])


@pytest.mark.parametrize("structure", ["diag", "full"])
@pytest.mark.parametrize("curvature", ["ggn", "ef"])
def test_subnetwork_fit_equals_the_backpack_backend(
    backpack_oracle: types.ModuleType, structure: str, curvature: str
):
    from laplace.curvature import BackPackEF, BackPackGGN

    ours, theirs = (PackfuncGGN, BackPackGGN) if curvature == "ggn" else (PackfuncEF, BackPackEF)
    model, loader = _problem("classification")
    options = {
        "subset_of_weights": "subnetwork",
        "subnetwork_indices": torch.LongTensor([0, 3, 7, 20, 25, 31, 40, 42]),
        "hessian_structure": structure,
    }
    fitted = [_fit(model, loader, "classification", b, **options) for b in (ours, theirs)]
    assert fitted[0].H.shape[0] == 8
    _assert_same_fit(*fitted, loader.dataset.tensors[0][:4])


def test_optimized_prior_precision_equals_the_backpack_backends(backpack_oracle):
    from laplace.curvature import BackPackGGN

    model, loader = _problem("classification")
    priors = []
    for backend in (PackfuncGGN, BackPackGGN):
        la = _fit(model, loader, "classification", backend, hessian_structure="kron")
        la.optimize_prior_precision(method="marglik", n_steps=10)
        priors.append(la.prior_precision)
    torch.testing.assert_close(*priors, rtol=1e-8, atol=0)


@pytest.mark.parametrize("likelihood", ["classification", "regression"])
def test_jacobians_and_gradients_equal_autograd(likelihood: str):
    """Oracle: laplace's own torch.func ``jacrev`` and per-sample ``grad`` implementations."""
    model, loader = _problem(likelihood)
    X, y = loader.dataset.tensors
    backend = PackfuncGGN(model, likelihood)
    X = X.clone().requires_grad_()
    ours, theirs = (
        jacobians(backend, X, enable_backprop=True)
        for jacobians in (PackfuncGGN.jacobians, CurvatureInterface.jacobians)
    )
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    pulled = [torch.autograd.grad((J**2).sum() + f.sum(), X)[0] for J, f in (ours, theirs)]
    torch.testing.assert_close(*pulled, rtol=1e-10, atol=1e-12)
    detached, _ = backend.jacobians(X)
    assert not detached.requires_grad
    for a, b in zip(backend.gradients(X, y), CurvatureInterface.gradients(backend, X, y)):
        torch.testing.assert_close(a, b.detach(), rtol=1e-12, atol=1e-12)


def test_monte_carlo_fisher_approaches_the_ggn():
    model, loader = _problem("classification")
    torch.manual_seed(1)
    sampled = _fit(
        model,
        loader,
        "classification",
        PackfuncGGN,
        subset_of_weights="all",
        hessian_structure="diag",
        backend_kwargs={"stochastic": True, "num_samples": 2000},
    )
    exact = _fit(
        model,
        loader,
        "classification",
        PackfuncGGN,
        subset_of_weights="all",
        hessian_structure="diag",
    )
    assert (sampled.H - exact.H).abs().max() < 0.05 * exact.H.abs().max()


# ------------------------------------------------------------------ a model BackPACK refuses


def _dense_ggn(model: nn.Module, loader: DataLoader) -> torch.Tensor:
    """``Jᵀ (∇²_f L) J`` over all parameters: an autograd Jacobian (one backward per output
    entry) and the dense Hessian of ``CrossEntropyLoss(reduction="sum")`` w.r.t. the outputs."""
    X, y = loader.dataset.tensors
    named = dict(model.named_parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in named.values()])

    def outputs(vector: torch.Tensor) -> torch.Tensor:
        pieces = vector.split([p.numel() for p in named.values()])
        values = {k: v.view(p.shape) for (k, p), v in zip(named.items(), pieces)}
        return torch.func.functional_call(model, values, (X,)).reshape(-1)

    jac = jacobian(outputs, flat, vectorize=False)  # [N·C, P]
    logits = outputs(flat).detach().reshape(len(y), -1)
    loss_hessian = hessian(lambda f: nn.CrossEntropyLoss(reduction="sum")(f, y), logits)
    return jac.T @ loss_hessian.reshape(jac.shape[0], -1) @ jac


@pytest.mark.parametrize("structure", ["diag", "kron", "full"])
def test_backpack_backend_refuses_the_residual_net(backpack_oracle, structure: str):
    from laplace.curvature import BackPackGGN

    model, loader = _problem("classification", residual=True)
    with pytest.raises((NotImplementedError, AttributeError)):
        _fit(
            model,
            loader,
            "classification",
            BackPackGGN,
            subset_of_weights="all",
            hessian_structure=structure,
        )


@pytest.mark.parametrize("structure", ["diag", "full"])
def test_residual_net_curvature_equals_dense_ggn(structure: str):
    from laplace.curvature import CurvlinopsGGN

    model, loader = _problem("classification", residual=True)
    options = {"subset_of_weights": "all", "hessian_structure": structure}
    ours = _fit(model, loader, "classification", PackfuncGGN, **options)
    dense = _dense_ggn(model, loader)
    expected = dense.diagonal() if structure == "diag" else dense
    torch.testing.assert_close(ours.H, expected, rtol=1e-10, atol=1e-12)
    # laplace's curvlinops backend multiplies by a float32 identity: agreement to ~1e-7
    theirs = _fit(model, loader, "classification", CurvlinopsGGN, **options)
    torch.testing.assert_close(
        ours.log_marginal_likelihood(), theirs.log_marginal_likelihood(), rtol=1e-6, atol=0
    )


@pytest.mark.slow  # the dense oracle of an attention block
def test_attention_block_curvature_equals_dense_ggn():
    torch.manual_seed(0)
    model = TransformerBlock().double()
    X, y = torch.randn(6, 5, 8, dtype=torch.float64), torch.randint(0, 3, (6,))
    loader = DataLoader(TensorDataset(X, y), batch_size=3)
    dense = _dense_ggn(model, loader)
    for structure, expected in (("diag", dense.diagonal()), ("full", dense)):
        la = _fit(
            model,
            loader,
            "classification",
            PackfuncGGN,
            subset_of_weights="all",
            hessian_structure=structure,
        )
        torch.testing.assert_close(la.H, expected, rtol=1e-10, atol=1e-12)
    kron = _fit(
        model,
        loader,
        "classification",
        PackfuncGGN,
        subset_of_weights="all",
        hessian_structure="kron",
    )
    attention = dict(zip([n for n, _ in model.named_parameters()], kron.H_facs.kfacs))
    assert [f.shape for f in attention["attn.in_proj_weight"]] == [(24, 24), (8, 8)]


def test_residual_net_kronecker_factors_follow_their_definition():
    """Weights: ``A`` = the exact GGN block of the layer's bias, ``B`` = mean of input
    outer products; one-dimensional parameters (LayerNorm, biases): their exact block."""
    model, loader = _problem("classification", residual=True)
    loader = DataLoader(loader.dataset, batch_size=N)  # one batch: no rescaling between batches
    la = _fit(
        model,
        loader,
        "classification",
        PackfuncGGN,
        subset_of_weights="all",
        hessian_structure="kron",
    )
    dense = _dense_ggn(model, loader)
    inputs: dict[str, torch.Tensor] = {}
    hooks = [
        module.register_forward_hook(lambda m, args, out, name=name: inputs.update({name: args[0]}))
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
    ]
    model(loader.dataset.tensors[0])
    for hook in hooks:
        hook.remove()
    names = [name for name, _ in model.named_parameters()]
    sizes = [p.numel() for _, p in model.named_parameters()]
    starts = dict(zip(names, torch.tensor([0, *sizes]).cumsum(0).tolist()))
    blocks = {
        name: dense[starts[name] : starts[name] + size, starts[name] : starts[name] + size]
        for name, size in zip(names, sizes)
    }
    for name, factors in zip(names, la.H_facs.kfacs):
        layer, kind = name.rsplit(".", 1)
        if len(factors) == 1:
            torch.testing.assert_close(factors[0], blocks[name], rtol=1e-10, atol=1e-12)
        else:
            x = inputs[layer]
            torch.testing.assert_close(factors[0], blocks[f"{layer}.bias"], rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(factors[1], x.T @ x / N, rtol=1e-10, atol=1e-12)
    assert {len(f) for f in la.H_facs.kfacs} == {1, 2}


def test_frozen_parameters_are_left_out():
    model, loader = _problem("classification", residual=True)
    model.inp.requires_grad_(False)
    ours = _fit(
        model,
        loader,
        "classification",
        PackfuncGGN,
        subset_of_weights="all",
        hessian_structure="full",
    )
    trainable = torch.cat(
        [torch.full((p.numel(),), p.requires_grad) for p in model.parameters()]
    ).nonzero()[:, 0]
    expected = _dense_ggn(model, loader)[trainable][:, trainable]
    torch.testing.assert_close(ours.H, expected, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------------------- refusals


def test_kron_refuses_multidimensional_parameters_without_factors():
    model = nn.Sequential(nn.Embedding(7, 4), nn.Flatten(), nn.Linear(8, 3)).double()
    X, y = torch.randint(0, 7, (6, 2)), torch.randint(0, 3, (6,))
    backend = PackfuncGGN(model, "classification")
    with pytest.raises(ValueError, match="hessian_structure='diag' or 'full'"):
        backend.kron(X, y, N=6)


def test_kron_of_a_subnetwork_is_refused():
    model, loader = _problem("classification")
    X, y = loader.dataset.tensors
    for backend in (PackfuncGGN, PackfuncEF):
        subnet = backend(model, "classification", subnetwork_indices=torch.LongTensor([0, 1]))
        with pytest.raises(ValueError, match="hessian_structure='full' or 'diag'"):
            subnet.kron(X, y, N=N)


@pytest.mark.parametrize("likelihood", ["classification", "regression"])
def test_kronecker_empirical_fisher_equals_the_curvlinops_and_asdl_backends(likelihood: str):
    """BackPACK's backend has no Kronecker EF; laplace's curvlinops (and ASDL) backends do."""
    from laplace.curvature import CurvlinopsEF

    backends = [CurvlinopsEF]
    try:
        from laplace.curvature import AsdlEF

        backends.append(AsdlEF)
    except ImportError:  # ASDL is optional
        pass
    model, loader = _problem(likelihood)
    X, _ = loader.dataset.tensors
    ours = _fit(model, loader, likelihood, PackfuncEF, hessian_structure="kron")
    for backend in backends:
        _assert_same_fit(
            ours, _fit(model, loader, likelihood, backend, hessian_structure="kron"), X
        )


def test_laplace_is_imported_only_by_the_integration_and_named_when_missing():
    code = (
        "import sys, packfunc\n"
        "print('laplace' in sys.modules)\n"
        "sys.modules['laplace'] = None\n"
        "import packfunc.integrations.laplace\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "False"
    assert "ImportError" in result.stderr and "pip install laplace-torch" in result.stderr


def test_discovery_runs_once_per_fit_not_once_per_batch(monkeypatch):
    """One model function per module, so packfunc's cached discovery plan serves every batch
    (discovered on the first batch's first sample, checked against its last sample's)."""
    from packfunc.engine import discovery

    calls = []
    discover = discovery.discover
    monkeypatch.setattr(discovery, "discover", lambda *args: calls.append(1) or discover(*args))
    model, loader = _problem("classification")
    _fit(model, loader, "classification", PackfuncGGN, hessian_structure="diag")
    assert len(loader) == 2 and len(calls) == 2


# ------------------------------------------------ weights stored [in, out], uneven batches


class InOutLinear(nn.Module):
    """``x @ W + b`` with the weight stored ``[in, out]``: factors ``[in×in, out×out]``."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.W = nn.Parameter(linear.weight.detach().T.contiguous())
        self.b = nn.Parameter(linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.W + self.b


class AddmmConv1D(nn.Module):
    """GPT-2's ``Conv1D``: ``addmm(b, x.view(-1, in), W)`` with ``W`` stored ``[in, out]``."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight = nn.Parameter(linear.weight.detach().T.contiguous())
        self.bias = nn.Parameter(linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = torch.addmm(self.bias, x.view(-1, x.shape[-1]), self.weight)
        return flat.view(*x.shape[:-1], self.weight.shape[-1])


def _layered(kind: str) -> tuple[nn.Module, torch.Tensor]:
    """A classifier whose layers are ``kind`` (``linear``, ``x @ W``, ``conv1d``, ``conv``)
    and its inputs (sequences of 2 positions for ``conv1d``, 3×3 images for ``conv``)."""
    torch.manual_seed(0)
    first, last = nn.Linear(4, 5), nn.Linear(5, 3)
    if kind == "conv":
        conv = nn.Sequential(nn.Conv2d(2, 3, 2), nn.Tanh(), nn.Flatten(), nn.Linear(12, 3))
        return conv.double(), torch.randn(N, 2, 3, 3, dtype=torch.float64)
    if kind == "conv1d":
        head = nn.Sequential(nn.Flatten(), nn.Linear(10, 3))
        model = nn.Sequential(AddmmConv1D(first), nn.Tanh(), head)
        return model.double(), torch.randn(N, 2, 4, dtype=torch.float64)
    layers = (first, last) if kind == "linear" else (InOutLinear(first), InOutLinear(last))
    model = nn.Sequential(layers[0], nn.Tanh(), layers[1])
    return model.double(), torch.randn(N, 4, dtype=torch.float64)


@pytest.mark.parametrize("kind", ["linear", "x @ W", "conv1d", "conv"])
def test_kron_fit_does_not_depend_on_how_the_data_is_split_into_batches(kind: str):
    """Batches of 8, 8 and 4 give the fit of one batch of 20: of each weight's two factors
    the batch mean is rescaled (``[in×in, out×out]`` for ``x @ W`` and GPT-2's Conv1D)."""
    model, X = _layered(kind)
    y = torch.randint(0, 3, (N,))
    fits = [
        _fit(
            model,
            DataLoader(TensorDataset(X, y), batch_size=size),
            "classification",
            PackfuncGGN,
            subset_of_weights="all",
            hessian_structure="kron",
        )
        for size in (N, 8)
    ]
    _assert_same_fit(*fits, X[:4])


@pytest.mark.parametrize("kind", ["linear", "x @ W", "conv1d"])
def test_kron_fits_accumulated_with_override_false_equal_one_fit_of_the_union(kind: str):
    """``fit(first); fit(second, override=False)`` reweighs the second factor of each pair as
    the data set's mean. For ``[in, out]`` weights that was the output (sum) factor: the
    precision 2 % off the union's fit, the log marginal likelihood 0.18 (a probe)."""
    model, X = _layered(kind)
    y = torch.randint(0, 3, (N,))
    options = {"subset_of_weights": "all", "hessian_structure": "kron"}
    union = _fit(model, DataLoader(TensorDataset(X, y), batch_size=N), "classification",
                 PackfuncGGN, **options)  # fmt: skip
    accumulated = _fit(model, DataLoader(TensorDataset(X[:8], y[:8]), batch_size=8),
                       "classification", PackfuncGGN, **options)  # fmt: skip
    accumulated.fit(DataLoader(TensorDataset(X[8:], y[8:]), batch_size=12), override=False)
    _assert_same_fit(accumulated, union, X[:4])


def test_kron_fit_of_in_out_weights_equals_the_backpack_fit_of_their_linear_layers(
    backpack_oracle: types.ModuleType,
):
    """Oracle: laplace's BackPACK backend on the same layers as ``nn.Linear`` (weights
    ``[out, in]``), batches of 8, 8 and 4; the precisions agree up to that transposition."""
    from laplace.curvature import BackPackGGN

    linear, X = _layered("linear")
    in_out, _ = _layered("x @ W")
    y = torch.randint(0, 3, (N,))
    loader = DataLoader(TensorDataset(X, y), batch_size=8)
    options = {"subset_of_weights": "all", "hessian_structure": "kron"}
    ours = _fit(in_out, loader, "classification", PackfuncGGN, **options)
    theirs = _fit(linear, loader, "classification", BackPackGGN, **options)
    torch.testing.assert_close(
        ours.log_marginal_likelihood(), theirs.log_marginal_likelihood(), rtol=1e-10, atol=0
    )
    torch.testing.assert_close(ours(X[:4], pred_type="glm"), theirs(X[:4], pred_type="glm"))
    order, start = [], 0  # ours[i] is theirs[order[i]]: W [in, out] against weight [out, in]
    for p in linear.parameters():
        positions = torch.arange(p.numel()).view(p.shape)
        order.append(start + (positions.T if p.dim() == 2 else positions).reshape(-1))
        start += p.numel()
    index = torch.cat(order)
    expected = _precision(theirs)[index][:, index]
    torch.testing.assert_close(_precision(ours), expected, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------ random models


def test_jacobians_refuse_a_model_that_draws_random_numbers():
    """``f`` and the Jacobians come from two runs of the model: with dropout in training
    mode, from two masks (laplace's own ``jacobians`` has one). Refused, naming the fix,
    with the random stream left where it was; in eval mode both equal laplace's own."""
    from packfunc import RandomModelError

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Dropout(0.5), nn.Linear(5, 3)).double()
    X = torch.randn(4, 4, dtype=torch.float64)
    backend = PackfuncGGN(model, "classification")
    state = torch.get_rng_state()
    with pytest.raises(RandomModelError, match=r"model\.eval\(\)"):
        backend.jacobians(X)
    assert torch.equal(torch.get_rng_state(), state)
    model.eval()
    for ours, theirs in zip(backend.jacobians(X), CurvatureInterface.jacobians(backend, X)):
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)


def test_reading_the_weight_layouts_leaves_no_unchecked_plan_for_the_next_batch():
    """A plan discovered only to read the layouts (on the first sample of one batch) is
    not cached: the next batch's pass would take its rows as checked against another."""
    from packfunc.integrations.laplace import in_out_weights

    model, X = _layered("x @ W")
    model_fn, params = pf.functional(model)
    assert in_out_weights(model_fn, params, X[:2]) == {"0.W", "2.W"}
    y = torch.randint(0, 3, (2,))
    pf.diag_ggn(model_fn, params, X[2:4], y, loss=nn.CrossEntropyLoss(reduction="sum"))
