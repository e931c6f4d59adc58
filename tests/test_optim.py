"""The curvature preconditioner against dense solves; the Optimizer wrapper against it."""

from __future__ import annotations

import copy
import runpy
from pathlib import Path

import optree
import pytest
import torch
from torch import Tensor, nn

import packfunc as pf
from packfunc.optim import apply_updates, preconditioner
from tests.cases import make_problem
from tests.test_ekfac import dense_ggn

LR, DAMPING = 0.5, 0.1


def gradient(model_fn, params, loss, X, y) -> dict[str, Tensor]:
    return torch.func.grad(lambda p: loss(model_fn(p, X), y))(params)


def damped(M: Tensor) -> Tensor:
    return M + DAMPING * torch.eye(M.shape[0], dtype=M.dtype)


def ggn_blocks(problem) -> dict[str, Tensor]:
    """Each parameter's block of the dense GGN (row-major order)."""
    found, start, ggn = {}, 0, dense_ggn(problem)
    for name, p in problem.model.named_parameters():
        found[name] = ggn[start : start + p.numel(), start : start + p.numel()]
        start += p.numel()
    return found


@pytest.fixture
def problem():
    return make_problem("mlp", n=5)


def first_update(problem, method: str, **options) -> tuple[dict, dict, dict]:
    model_fn, params = problem.functional()
    pre = preconditioner(
        model_fn, problem.loss, method=method, learning_rate=LR, damping=DAMPING, **options
    )
    grads = gradient(model_fn, params, problem.loss, problem.X, problem.y)
    updates, _ = pre.update(grads, pre.init(params), params, (problem.X, problem.y))
    return updates, grads, params


def test_kfac_update_is_the_dense_damped_solve(problem):
    updates, grads, params = first_update(problem, "kfac", mc_samples=None)
    model_fn = problem.functional()[0]
    factors = pf.kflr(model_fn, params, problem.X, problem.y, loss=problem.loss)
    for key, g in grads.items():
        M = factors[key][0] if len(factors[key]) == 1 else torch.kron(*factors[key])
        expected = -LR * torch.linalg.solve(damped(M), g.reshape(-1))
        torch.testing.assert_close(updates[key].reshape(-1), expected, msg=key)


def test_pi_damped_kfac_update_is_the_product_of_damped_factor_inverses(problem):
    updates, grads, params = first_update(problem, "kfac", mc_samples=None, pi_damping=True)
    factors = pf.kflr(problem.functional()[0], params, problem.X, problem.y, loss=problem.loss)
    for key, g in grads.items():
        if len(factors[key]) == 1:
            inverse = torch.linalg.inv(damped(factors[key][0]))
        else:
            A, B = factors[key]
            pi = ((A.trace() / A.shape[0]) / (B.trace() / B.shape[0])).sqrt()
            eye_a, eye_b = torch.eye(A.shape[0]).double(), torch.eye(B.shape[0]).double()
            inverse = torch.kron(
                torch.linalg.inv(A + pi * DAMPING**0.5 * eye_a),
                torch.linalg.inv(B + DAMPING**0.5 / pi * eye_b),
            )
        torch.testing.assert_close(updates[key].reshape(-1), -LR * inverse @ g.reshape(-1))


def test_ekfac_update_uses_the_dense_ggn_diagonal_in_the_kflr_basis(problem):
    updates, grads, params = first_update(problem, "ekfac", mc_samples=None)
    factors = pf.kflr(problem.functional()[0], params, problem.X, problem.y, loss=problem.loss)
    for key, block in ggn_blocks(problem).items():
        Qs = [torch.linalg.eigh(f)[1] for f in factors[key]]
        Q = Qs[0] if len(Qs) == 1 else torch.kron(*Qs)
        values = (Q.T @ block @ Q).diagonal()
        M = Q @ torch.diag(values) @ Q.T
        expected = -LR * torch.linalg.solve(damped(M), grads[key].reshape(-1))
        torch.testing.assert_close(updates[key].reshape(-1), expected, msg=key)


def test_diag_ggn_update_divides_by_the_damped_dense_diagonal(problem):
    updates, grads, _ = first_update(problem, "diag_ggn", mc_samples=None)
    for key, block in ggn_blocks(problem).items():
        expected = -LR * grads[key].reshape(-1) / (block.diagonal() + DAMPING)
        torch.testing.assert_close(updates[key].reshape(-1), expected, msg=key)


def test_moving_average_and_inverse_period(problem):
    """Step 1 refreshes the average but reuses step 0's inverse; step 2 inverts the average."""
    model_fn, params = problem.functional()
    loss, ema = problem.loss, 0.7
    pre = preconditioner(
        model_fn,
        loss,
        learning_rate=LR,
        damping=DAMPING,
        ema=ema,
        inverse_period=2,
        mc_samples=None,
    )
    state = pre.init(params)
    batches = [(problem.X[i : i + 3], problem.y[i : i + 3]) for i in range(3)]
    factors, steps = [], []
    for X, y in batches:
        grads = gradient(model_fn, params, loss, X, y)
        factors.append(pf.kflr(model_fn, params, X, y, loss=loss))
        updates, state = pre.update(grads, state, params, (X, y))
        steps.append((grads, updates))
        params = apply_updates(params, updates)
    average = optree.tree_map(lambda a, b: ema * a + (1 - ema) * b, factors[0], factors[1])
    average = optree.tree_map(lambda a, b: ema * a + (1 - ema) * b, average, factors[2])
    for used, (grads, updates) in zip([factors[0], factors[0], average], steps):
        for key, g in grads.items():
            M = used[key][0] if len(used[key]) == 1 else torch.kron(*used[key])
            expected = -LR * torch.linalg.solve(damped(M), g.reshape(-1))
            torch.testing.assert_close(updates[key].reshape(-1), expected, msg=key)
    assert int(state.step) == 3


def test_state_is_a_pytree_and_inputs_are_not_modified(problem):
    model_fn, params = problem.functional()
    pre = preconditioner(model_fn, problem.loss, method="ekfac", damping=DAMPING)
    grads = gradient(model_fn, params, problem.loss, problem.X, problem.y)
    before = copy.deepcopy((grads, params))
    _, state = pre.update(grads, pre.init(params), params, (problem.X, problem.y))
    assert all(isinstance(t, Tensor) for t in optree.tree_leaves(state))
    optree.tree_map(torch.testing.assert_close, (grads, params), before)


def digits_like(n: int = 64) -> tuple[Tensor, Tensor]:
    """A small separable classification problem (4 classes, 10 features)."""
    g = torch.Generator().manual_seed(0)
    centers = 2 * torch.randn(4, 10, generator=g)
    y = torch.arange(n) % 4
    return centers[y] + torch.randn(n, 10, generator=g), y


@pytest.mark.parametrize("optimizer", [pf.optim.KFAC, pf.optim.EKFAC, pf.optim.DiagGGN])
def test_optimizer_decreases_the_loss_and_follows_the_functional_path(optimizer):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 8), nn.Tanh(), nn.Linear(8, 4))
    twin = copy.deepcopy(model)
    X, y = digits_like()
    loss = nn.CrossEntropyLoss()
    options = {"mc_samples": None, "inverse_period": 2}
    opt = optimizer(model, lr=0.5, damping=DAMPING, loss=loss, **options)
    model_fn, params = pf.functional(twin)
    params = {k: p.clone() for k, p in params.items()}
    pre = preconditioner(
        model_fn,
        loss,
        method=opt.method,
        learning_rate=0.5,
        damping=DAMPING,
        **options,
    )
    state = pre.init(params)
    losses = []
    for _ in range(6):
        opt.zero_grad()
        value = loss(model(X), y)
        value.backward()
        losses.append(value.item())
        opt.step(X, y)
        grads = gradient(model_fn, params, loss, X, y)
        updates, state = pre.update(grads, state, params, (X, y))
        params = apply_updates(params, updates)
        for key, p in model.named_parameters():
            torch.testing.assert_close(p.detach(), params[key], msg=key)
    assert losses[-1] < 0.5 * losses[0]


def test_optimizer_and_preconditioner_refuse_bad_input():
    model = nn.Linear(3, 2)
    with pytest.raises(ValueError, match="method"):
        pf.optim.CurvatureOptimizer(model, method="adam")
    with pytest.raises(ValueError, match="damping"):
        pf.optim.KFAC(model, damping=0.0)
    with pytest.raises(ValueError, match="inverse_period"):
        pf.optim.KFAC(model, inverse_period=0)
    with pytest.raises(ValueError, match="pi_damping"):
        pf.optim.EKFAC(model, pi_damping=True)
    with pytest.raises(ValueError, match="backward"):
        pf.optim.KFAC(model).step(torch.randn(4, 3), torch.tensor([0, 1, 0, 1]))


def test_digits_example_runs_and_kfac_learns():
    pytest.importorskip("sklearn")
    script = Path(__file__).resolve().parents[1] / "examples" / "kfac_digits.py"
    main = runpy.run_path(str(script))["main"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small eigh/matmuls: extra threads only oversubscribe busy cores
    try:
        found = main(["--steps", "12", "--batch-size", "64", "--optimizers", "kfac", "ekfac"])
    finally:
        torch.set_num_threads(threads)
    for model in ("mlp", "cnn"):
        for name in ("kfac", "ekfac"):
            assert found[model][name]["loss"] < 1.2  # chance: ln 10 = 2.3


def test_transposed_convolutions_are_refused_by_the_kronecker_methods():
    model = nn.Sequential(nn.ConvTranspose1d(2, 2, 3), nn.Flatten(), nn.Linear(10, 3))
    X, y = torch.randn(4, 2, 3), torch.tensor([0, 1, 2, 0])
    nn.functional.cross_entropy(model(X), y).backward()
    with pytest.raises(ValueError, match="transposed"):
        pf.optim.KFAC(model).step(X, y)
    pf.optim.DiagGGN(model).step(X, y)
