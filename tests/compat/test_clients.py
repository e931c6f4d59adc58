"""Libraries written for BackPACK, run unchanged on the shim through ``alias_backpack``.

laplace-torch's ``BackPackGGN``/``BackPackEF`` backends must give the same Laplace
fits as on the real BackPACK; cockpit's quantities (including those that need
``backward(create_graph=True)``) the same values as on the real BackPACK and as
autograd. Each library is imported twice in this process, once against each
BackPACK: :class:`_Clients` keeps one import's ``sys.modules`` entries and puts
them back while a test uses them.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.func import functional_call, hessian, jacrev, vmap
from torch.utils.data import DataLoader, TensorDataset

from packfunc.compat import alias_backpack

pytest.importorskip("backpack")
pytest.importorskip("laplace")
pytest.importorskip("cockpit")

pytestmark = pytest.mark.filterwarnings(
    "ignore:Full backward hook is firing",
    "ignore:pkg_resources is deprecated",
    "ignore:Using backward\\(\\) with create_graph=True",
    "ignore::DeprecationWarning",
)

ROOTS = ("backpack", "laplace", "cockpit")
N = 20


def _client_modules() -> dict[str, ModuleType]:
    return {name: m for name, m in sys.modules.items() if name.split(".")[0] in ROOTS}


@contextmanager
def _in_sys_modules(modules: dict[str, ModuleType]) -> Iterator[None]:
    """Replace the clients' ``sys.modules`` entries by ``modules``; restore them afterwards."""
    saved = _client_modules()
    for name in saved:
        del sys.modules[name]
    sys.modules.update(modules)
    try:
        yield
    finally:
        for name in _client_modules():
            del sys.modules[name]
        sys.modules.update(saved)


class _Clients:
    """laplace and cockpit imported against the shim (``aliased``) or the real BackPACK."""

    def __init__(self, aliased: bool):
        self.aliased = aliased
        with _in_sys_modules({}), self._alias():
            for root in ROOTS[1:]:
                importlib.import_module(root)
            self.modules = _client_modules()

    def _alias(self) -> Any:
        return alias_backpack() if self.aliased else nullcontext()

    @contextmanager
    def active(self) -> Iterator[None]:
        """Make ``import laplace``/``cockpit``/``backpack`` give this import's modules."""
        with _in_sys_modules(self.modules), self._alias():
            yield

    def __getitem__(self, name: str) -> ModuleType:
        return self.modules[name]


@pytest.fixture(scope="module")
def shim() -> _Clients:
    return _Clients(aliased=True)


@pytest.fixture(scope="module")
def real() -> _Clients:
    return _Clients(aliased=False)


def test_alias_gives_the_shim_to_the_clients(shim: _Clients, real: _Clients):
    import packfunc.compat as compat
    from packfunc.compat.context import CTX

    ours = shim["laplace.curvature.backpack"]
    assert ours.extend is compat.extend and ours.backpack is compat.backpack
    assert ours.CTX is CTX and ours.memory_cleanup is compat.memory_cleanup
    assert shim["cockpit.context"].backpack is compat.backpack
    assert real["laplace.curvature.backpack"].extend.__module__ == "backpack"
    assert "packfunc" not in getattr(sys.modules.get("backpack"), "__name__", "")


def _as_float64(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().double()
    return torch.as_tensor(np.asarray(value, dtype=np.float64))


def _assert_close(
    ours: Any, theirs: Any, rtol: float = 1e-7, atol: float = 1e-9, path: str = "result"
) -> None:
    """Compare nested results (tensors, arrays, numbers, tuples, lists, dicts)."""
    if isinstance(theirs, dict):
        assert ours.keys() == theirs.keys(), path
        for key in theirs:
            _assert_close(ours[key], theirs[key], rtol, atol, f"{path}[{key!r}]")
    elif isinstance(theirs, (tuple, list)):
        assert len(ours) == len(theirs), path
        for i, (a, b) in enumerate(zip(ours, theirs)):
            _assert_close(a, b, rtol, atol, f"{path}[{i}]")
    else:
        torch.testing.assert_close(
            _as_float64(ours),
            _as_float64(theirs),
            rtol=rtol,
            atol=atol,
            msg=lambda m: f"{path}: {m}",
        )


# laplace-torch ------------------------------------------------------------------------------


def _problem(likelihood: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    outputs = 3 if likelihood == "classification" else 2
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, outputs)).double()
    X = torch.randn(N, 4, dtype=torch.float64)
    y = (
        torch.randint(0, 3, (N,))
        if likelihood == "classification"
        else torch.randn(N, 2, dtype=torch.float64)
    )
    return model, X, y


def _fit(
    clients: _Clients, likelihood: str, subset: str, structure: str, backend: str
) -> dict[str, Any]:
    """Fit a Laplace approximation; return its precision, evidence and GLM predictive."""
    model, X, y = _problem(likelihood)
    with clients.active():
        la = clients["laplace"].Laplace(
            model,
            likelihood,
            subset_of_weights=subset,
            hessian_structure=structure,
            backend=getattr(clients["laplace.curvature"], backend),
        )
        la.fit(DataLoader(TensorDataset(X, y), batch_size=N // 2))
        precision = la.posterior_precision
        if not isinstance(precision, torch.Tensor):  # Kronecker-factored
            precision = precision.to_matrix()
        prior = torch.tensor(0.7, dtype=torch.float64)
        evidence = (
            la.log_marginal_likelihood(prior)
            if likelihood == "classification"
            else la.log_marginal_likelihood(prior, torch.tensor(1.3, dtype=torch.float64))
        )
        return {
            "precision": precision,
            "evidence": evidence,
            "predictive": la(X[:5], pred_type="glm"),
        }


FITS = [
    (likelihood, subset, structure, backend)
    for likelihood in ("classification", "regression")
    for subset in ("all", "last_layer")
    for structure in ("diag", "kron", "full")
    for backend in ("BackPackGGN", "BackPackEF")
    if not (structure == "kron" and backend == "BackPackEF")
]  # laplace: unavailable


@pytest.mark.parametrize(
    ("likelihood", "subset", "structure", "backend"), FITS, ids=["-".join(fit) for fit in FITS]
)
def test_laplace_fit_matches_backpack(
    shim: _Clients, real: _Clients, likelihood: str, subset: str, structure: str, backend: str
):
    ours = _fit(shim, likelihood, subset, structure, backend)
    theirs = _fit(real, likelihood, subset, structure, backend)
    _assert_close(ours, theirs)


def _jacobian_oracle(model: nn.Module, X: torch.Tensor) -> torch.Tensor:
    """``[N, C, P]`` Jacobians of the outputs w.r.t. all parameters, by ``torch.func``."""
    params = dict(model.named_parameters())

    def output(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return functional_call(model, p, (x[None],))[0]

    per_leaf = vmap(jacrev(output), in_dims=(None, 0))(params, X)
    return torch.cat([per_leaf[name].flatten(2) for name in params], dim=2)


def test_laplace_jacobians_are_differentiable(shim: _Clients):
    model, X, _ = _problem("classification")
    X.requires_grad_(True)
    model.output_size = 3
    W = torch.randn(N, 3, sum(p.numel() for p in model.parameters()), dtype=torch.float64)
    with shim.active():
        backend = shim["laplace.curvature"].BackPackGGN(model, "classification")
        Js, f = backend.jacobians(X, enable_backprop=True)
    expected = _jacobian_oracle(model, X)
    torch.testing.assert_close(Js, expected)
    torch.testing.assert_close(f, model(X))
    inputs = [X, *model.parameters()]  # the last bias's Jacobian is constant: no graph
    grads = torch.autograd.grad((Js * W).sum(), inputs, materialize_grads=True)
    expected_grads = torch.autograd.grad((expected * W).sum(), inputs, materialize_grads=True)
    for ours, theirs in zip(grads, expected_grads):
        torch.testing.assert_close(ours, theirs)


# cockpit ------------------------------------------------------------------------------------

QUANTITIES = (
    "Loss",
    "GradNorm",
    "HessMaxEV",
    "HessTrace",
    "TICDiag",
    "TICTrace",
    "NormTest",
    "InnerTest",
    "OrthoTest",
    "MeanGSNR",
    "GradHist1d",
    "Alpha",
)
STEPS = 2


def _cockpit_model() -> tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(1)  # float32: cockpit's HessMaxEV works in float32
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    batches = [(torch.randn(8, 4), torch.randint(0, 3, (8,))) for _ in range(STEPS)]
    return model, batches


def _first_step(step: int) -> bool:
    return step == 0


def _track(clients: _Clients) -> dict[int, dict[str, Any]]:
    """Two SGD steps with every quantity tracked; cockpit's output."""
    model, batches = _cockpit_model()
    with clients.active():
        bp, cockpit = clients["backpack"], clients["cockpit"]
        model, lossfunc = bp.extend(model), bp.extend(nn.CrossEntropyLoss())
        # tracked at step 0; Alpha also needs the step after it
        quantities = [
            getattr(clients["cockpit.quantities"], name)(track_schedule=_first_step)
            for name in QUANTITIES
        ]
        cp = cockpit.Cockpit(list(model.parameters()), quantities=quantities)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step, (X, y) in enumerate(batches):
            optimizer.zero_grad()
            outputs = model(X)
            loss = lossfunc(outputs, y)
            info = {
                "batch_size": len(X),
                "loss": loss,
                "optimizer": optimizer,
                "individual_losses": nn.functional.cross_entropy(outputs, y, reduction="none"),
            }
            with cp(step, info=info):
                loss.backward(create_graph=cp.create_graph(step))
            optimizer.step()
        return {step: dict(out) for step, out in cp.get_output().items()}


def test_cockpit_matches_backpack(shim: _Clients, real: _Clients):
    ours, theirs = _track(shim), _track(real)
    assert set(ours[0]) == set(QUANTITIES)
    _assert_close(ours, theirs, rtol=1e-4, atol=1e-6)


def test_cockpit_curvature_matches_autograd(shim: _Clients):
    ours = _track(shim)[0]
    model, ((X, y), _) = _cockpit_model()
    params = dict(model.named_parameters())

    def loss(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return nn.functional.cross_entropy(functional_call(model, p, (X,)), y)

    H = hessian(loss)(params)
    blocks = [H[name][name].reshape(p.numel(), p.numel()) for name, p in params.items()]
    full = torch.cat(
        [
            torch.cat([H[a][b].reshape(params[a].numel(), params[b].numel()) for b in params], 1)
            for a in params
        ],
        0,
    )
    grad = torch.func.grad(loss)(params)
    _assert_close(ours["HessTrace"], [block.trace() for block in blocks], rtol=1e-4, atol=1e-6)
    # scipy's eigsh on cockpit's float32 Hessian-vector products: about 1e-3 relative
    _assert_close(ours["HessMaxEV"], torch.linalg.eigvalsh(full)[-1], rtol=1e-2)
    _assert_close(ours["GradNorm"], [g.norm() for g in grad.values()], rtol=1e-4, atol=1e-6)


def test_batch_grad_with_create_graph_matches_autograd(shim: _Clients):
    """cockpit's ``backward(create_graph=True)`` with BatchGrad: values and their graph."""
    model, ((X, y), _) = _cockpit_model()
    params = dict(model.named_parameters())

    def sample_loss(p: dict[str, torch.Tensor], x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        # sample n's term of the mean-reduced loss
        return nn.functional.cross_entropy(functional_call(model, p, (x[None],)), t[None]) / len(X)

    expected = vmap(torch.func.grad(sample_loss), in_dims=(None, 0, 0))(params, X, y)
    with shim.active():
        bp = shim["backpack"]
        model, lossfunc = bp.extend(model), bp.extend(nn.CrossEntropyLoss())
        loss = lossfunc(model(X), y)
        with bp.backpack(shim["backpack.extensions"].BatchGrad()):
            loss.backward(create_graph=True)
    for name, p in params.items():
        torch.testing.assert_close(p.grad_batch, expected[name])
        assert p.grad_batch.requires_grad, name
    W = {name: torch.randn_like(g) for name, g in expected.items()}
    ours = torch.autograd.grad(
        sum((p.grad_batch * W[n]).sum() for n, p in params.items()), list(params.values())
    )
    theirs = torch.autograd.grad(
        sum((expected[n] * W[n]).sum() for n in params), list(params.values())
    )
    for name, a, b in zip(params, ours, theirs):
        torch.testing.assert_close(a, b, msg=name)
