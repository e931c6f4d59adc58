"""pf.optim: the transformations against dense solves and against a written-out reference of
the schedule; the torch optimizers against the transformations and torch.optim's protocol."""

from __future__ import annotations

import copy
import io
import runpy
from pathlib import Path

import optree
import pytest
import torch
from torch import Tensor, nn

import packfunc as pf
from packfunc.optim import (
    MissingBatchError,
    apply_updates,
    chain,
    scale,
    scale_by_diag_ggn,
    scale_by_ekfac,
    scale_by_kfac,
)
from tests.cases import make_problem
from tests.test_ekfac import dense_ggn

LR, DAMPING = 0.5, 0.1
SCALE_BY = {"kfac": scale_by_kfac, "ekfac": scale_by_ekfac, "diag_ggn": scale_by_diag_ggn}
OPTIMIZER = {"kfac": pf.optim.KFAC, "ekfac": pf.optim.EKFAC, "diag_ggn": pf.optim.DiagGGN}


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
    """The first preconditioned gradient (no learning rate) of ``scale_by_<method>``."""
    model_fn, params = problem.functional()
    t = SCALE_BY[method](model_fn, problem.loss, damping=DAMPING, **options)
    grads = gradient(model_fn, params, problem.loss, problem.X, problem.y)
    updates, _ = t.update(grads, t.init(params), params, (problem.X, problem.y))
    return updates, grads, params


def test_kfac_update_is_the_dense_damped_solve(problem):
    updates, grads, params = first_update(problem, "kfac", mc_samples=None)
    model_fn = problem.functional()[0]
    factors = pf.kflr(model_fn, params, problem.X, problem.y, loss=problem.loss)
    for key, g in grads.items():
        M = factors[key][0] if len(factors[key]) == 1 else torch.kron(*factors[key])
        expected = torch.linalg.solve(damped(M), g.reshape(-1))
        torch.testing.assert_close(updates[key].reshape(-1), expected, msg=key)


def test_pi_damped_kfac_update_is_the_product_of_damped_factor_inverses(problem):
    updates, grads, params = first_update(problem, "kfac", mc_samples=None, pi_damping=True)
    factors = pf.kflr(problem.functional()[0], params, problem.X, problem.y, loss=problem.loss)
    for key, g in grads.items():
        torch.testing.assert_close(
            updates[key].reshape(-1), pi_damped_inverse(factors[key]) @ g.reshape(-1)
        )


def test_ekfac_update_uses_the_dense_ggn_diagonal_in_the_kflr_basis(problem):
    updates, grads, params = first_update(problem, "ekfac", mc_samples=None)
    factors = pf.kflr(problem.functional()[0], params, problem.X, problem.y, loss=problem.loss)
    for key, block in ggn_blocks(problem).items():
        Qs = [torch.linalg.eigh(f)[1] for f in factors[key]]
        Q = Qs[0] if len(Qs) == 1 else torch.kron(*Qs)
        values = (Q.T @ block @ Q).diagonal()
        M = Q @ torch.diag(values) @ Q.T
        expected = torch.linalg.solve(damped(M), grads[key].reshape(-1))
        torch.testing.assert_close(updates[key].reshape(-1), expected, msg=key)


def test_diag_ggn_update_divides_by_the_damped_dense_diagonal(problem):
    updates, grads, _ = first_update(problem, "diag_ggn", mc_samples=None)
    for key, block in ggn_blocks(problem).items():
        expected = grads[key].reshape(-1) / (block.diagonal() + DAMPING)
        torch.testing.assert_close(updates[key].reshape(-1), expected, msg=key)


# The values of the preconditioner before the split into transformations and optimizers,
# written out: its schedule and moving averages, each refresh from packfunc's curvature
# functions, each inverse a dense matrix.


def pi_damped_inverse(entry: list[Tensor]) -> Tensor:
    """``(A + π√d I)⁻¹ ⊗ (B + √d/π I)⁻¹`` (a bias: ``(A + d I)⁻¹``), dense."""
    if len(entry) == 1:
        return torch.linalg.inv(damped(entry[0]))
    A, B = entry
    pi = ((A.trace() / A.shape[0]) / (B.trace() / B.shape[0])).sqrt()
    eye_a = torch.eye(A.shape[0], dtype=A.dtype)
    eye_b = torch.eye(B.shape[0], dtype=B.dtype)
    return torch.kron(
        torch.linalg.inv(A + pi * DAMPING**0.5 * eye_a),
        torch.linalg.inv(B + DAMPING**0.5 / pi * eye_b),
    )


def reference_updates(
    method, model_fn, loss, params, batches, *, ema, update_period, inverse_period, **options
) -> list[dict[str, Tensor]]:
    """Every step's ``-LR · (C + DAMPING·I)⁻¹ g`` of ``preconditioner(method=...)`` as it was.

    Refreshes on step 0, on multiples of ``inverse_period`` (KFAC: invert; EKFAC: new
    basis from the averaged factors, fresh eigenvalues) and on multiples of
    ``update_period`` (average in the batch's curvature; EKFAC: its eigenvalues re-fitted
    in the basis; DiagGGN: invert too). Exact curvatures except ``mc_samples`` with the
    generator seeded 0 for KFAC and the diagonal.
    """
    mc_samples, pi_damping = options.get("mc_samples"), options.get("pi_damping", False)
    generator = torch.Generator().manual_seed(0) if mc_samples else None
    samples = {"mc_samples": mc_samples, "generator": generator} if mc_samples else {}

    def average(old, new):
        if old is None:
            return new
        return optree.tree_map(lambda o, n: ema * o + (1 - ema) * n, old, new)

    curvature = factors = basis = inverse = None
    found = []
    for step, (X, y) in enumerate(batches):
        full = step % inverse_period == 0
        if full or step % update_period == 0:
            if method == "diag_ggn":
                diagonal = pf.diag_ggn(model_fn, params, X, y, loss=loss, **samples)
                curvature = average(curvature, diagonal)
                inverse = {
                    k: torch.diag(1 / (d.reshape(-1) + DAMPING)) for k, d in curvature.items()
                }
            elif method == "kfac":
                curvature = average(
                    curvature,
                    pf.kfac(model_fn, params, X, y, loss=loss, **samples)
                    if mc_samples
                    else pf.kflr(model_fn, params, X, y, loss=loss),
                )
                if full:
                    inverse = {
                        k: pi_damped_inverse(e)
                        if pi_damping
                        else torch.linalg.inv(damped(pf.kron.dense(e)))
                        for k, e in curvature.items()
                    }
            else:
                if full:
                    factors = average(factors, pf.kflr(model_fn, params, X, y, loss=loss))
                    basis = pf.kron.eigh(factors)
                fitted = pf.ekfac(
                    model_fn, params, X, y, loss=loss, mc_samples=None, eigenvectors=basis
                )
                if not full:
                    fitted = {
                        k: pf.kron.Eigen(
                            e.eigenvectors, average(curvature[k].eigenvalues, e.eigenvalues)
                        )
                        for k, e in fitted.items()
                    }
                curvature = fitted
                inverse = {
                    k: torch.linalg.inv(damped(pf.kron.dense(e))) for k, e in curvature.items()
                }
        grads = gradient(model_fn, params, loss, X, y)
        updates = {k: -LR * (inverse[k] @ g.reshape(-1)).reshape(g.shape) for k, g in grads.items()}
        found.append(updates)
        params = {k: params[k] + updates[k] for k in params}
    return found


SCHEDULES = [
    ("kfac", {"mc_samples": None}),
    ("kfac", {"mc_samples": None, "update_period": 2, "inverse_period": 3}),
    ("kfac", {"mc_samples": None, "pi_damping": True}),
    ("kfac", {"mc_samples": 2, "pi_damping": True, "update_period": 2}),
    ("ekfac", {"mc_samples": None}),
    ("ekfac", {"mc_samples": None, "update_period": 2, "inverse_period": 3}),
    ("diag_ggn", {"mc_samples": None}),
    ("diag_ggn", {"mc_samples": 1, "update_period": 2}),
]


def schedule_options(method: str, options: dict) -> dict:
    """The options with defaults for the schedule (``diag_ggn`` has no ``inverse_period``)."""
    found = {"ema": 0.7, "update_period": 1, "inverse_period": 2, **options}
    if method == "diag_ggn":
        found["inverse_period"] = found["update_period"]
    return found


def batches_of(case: str, size: int = 20) -> tuple:
    """Six steps over three batches, each larger than any factor: the eigenvalues differ,
    so the eigenbases (EKFAC's) are unique up to signs, the same whichever way computed."""
    problem = make_problem(case, n=3 * size)
    model_fn, params = problem.functional()
    batches = [(problem.X[i : i + size], problem.y[i : i + size]) for i in (0, size, 2 * size)]
    return problem, model_fn, {k: p.clone() for k, p in params.items()}, batches * 2


@pytest.mark.parametrize("case", ["mlp", "conv1d"])
@pytest.mark.parametrize(("method", "options"), SCHEDULES)
def test_chain_with_scale_gives_the_values_of_the_old_preconditioner(case, method, options):
    problem, model_fn, params, batches = batches_of(case)
    options = schedule_options(method, options)
    expected = reference_updates(method, model_fn, problem.loss, params, batches, **options)
    if method == "diag_ggn":
        del options["inverse_period"]
    generator = torch.Generator().manual_seed(0) if options["mc_samples"] else None
    t = chain(
        SCALE_BY[method](model_fn, problem.loss, damping=DAMPING, generator=generator, **options),
        scale(-LR),
    )
    state = t.init(params)
    for step, (X, y) in enumerate(batches):
        grads = gradient(model_fn, params, problem.loss, X, y)
        updates, state = t.update(grads, state, params, (X, y))
        params = apply_updates(params, updates)
        for key, u in updates.items():
            torch.testing.assert_close(u, expected[step][key], msg=f"step {step}: {key}")
    assert int(state[0].step) == len(batches)


def test_state_is_a_pytree_and_inputs_are_not_modified(problem):
    model_fn, params = problem.functional()
    t = chain(scale_by_ekfac(model_fn, problem.loss, damping=DAMPING), scale(-LR))
    grads = gradient(model_fn, params, problem.loss, problem.X, problem.y)
    before = copy.deepcopy((grads, params))
    _, state = t.update(grads, t.init(params), params, (problem.X, problem.y))
    assert isinstance(state, tuple) and isinstance(state[0], pf.optim.CurvatureState)
    assert isinstance(state[0].curvature, pf.optim.EkfacCurvature)
    assert all(isinstance(t, Tensor) for t in optree.tree_leaves(state))
    optree.tree_map(torch.testing.assert_close, (grads, params), before)


def test_the_preconditioners_hold_no_learning_rate_and_scale_chains(problem):
    """scale_by_* is (C + λI)⁻¹ g itself; chain(…, scale(s)) is s times it, any s."""
    model_fn, params = problem.functional()
    grads = gradient(model_fn, params, problem.loss, problem.X, problem.y)
    batch = (problem.X, problem.y)
    t = scale_by_kfac(model_fn, problem.loss, damping=DAMPING, mc_samples=None)
    plain, _ = t.update(grads, t.init(params), params, batch)
    for s in (-0.1, 3.0):
        c = chain(t, scale(s), scale(2.0))
        scaled, _ = c.update(grads, c.init(params), params, batch)
        for key, u in plain.items():
            torch.testing.assert_close(scaled[key], 2 * s * u)


def test_steps_without_a_refresh_need_no_batch_and_refreshes_refuse_without_one(problem):
    model_fn, params = problem.functional()
    grads = gradient(model_fn, params, problem.loss, problem.X, problem.y)
    t = chain(
        scale_by_diag_ggn(model_fn, problem.loss, damping=DAMPING, update_period=2), scale(-LR)
    )
    state = t.init(params)
    with pytest.raises(MissingBatchError, match="step 0 refreshes"):
        t.update(grads, state, params)
    first, state = t.update(grads, state, params, (problem.X, problem.y))
    second, state = t.update(grads, state)  # step 1 reuses step 0's curvature
    optree.tree_map(torch.testing.assert_close, second, first)
    with pytest.raises(MissingBatchError, match="step 2 refreshes"):
        t.update(grads, state, params)


def test_chain_refuses_a_state_of_another_chain():
    t = chain(scale(1.0), scale(2.0))
    with pytest.raises(ValueError, match="2 transformations"):
        t.update({"w": torch.ones(1)}, (pf.optim.EmptyState(),))


def test_transformations_refuse_bad_hyperparameters():
    model_fn = pf.functional(nn.Linear(3, 2))[0]
    with pytest.raises(ValueError, match="damping"):
        scale_by_kfac(model_fn, damping=0.0)
    with pytest.raises(ValueError, match="ema"):
        scale_by_ekfac(model_fn, ema=1.0)
    with pytest.raises(ValueError, match="inverse_period"):
        scale_by_kfac(model_fn, inverse_period=0)
    with pytest.raises(ValueError, match="update_period"):
        scale_by_diag_ggn(model_fn, update_period=1.5)  # type: ignore[arg-type]


# The torch.optim optimizers.


def digits_like(n: int = 64) -> tuple[Tensor, Tensor]:
    """A small separable classification problem (4 classes, 10 features)."""
    g = torch.Generator().manual_seed(0)
    centers = 2 * torch.randn(4, 10, generator=g)
    y = torch.arange(n) % 4
    return centers[y] + torch.randn(n, 10, generator=g), y


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 8), nn.Tanh(), nn.Linear(8, 4)).double()


@pytest.mark.parametrize(("method", "options"), SCHEDULES)
def test_optimizer_trajectory_is_the_old_one(method, options):
    """step(batch=…) after backward moves the parameters as the old step(X, y) did."""
    model = small_model()
    model_fn, params = pf.functional(copy.deepcopy(model))
    X, y = digits_like()
    X = X.double()
    batches = [(X[i : i + 16], y[i : i + 16]) for i in range(0, 64, 16)] + [(X[:16], y[:16])]
    loss = nn.CrossEntropyLoss()
    options = schedule_options(method, options)
    expected = reference_updates(method, model_fn, loss, params, batches, **options)
    if method == "diag_ggn":
        del options["inverse_period"]
    generator = torch.Generator().manual_seed(0) if options["mc_samples"] else None
    opt = OPTIMIZER[method](
        model, lr=LR, damping=DAMPING, loss=loss, generator=generator, **options
    )
    for step, (Xb, yb) in enumerate(batches):
        before = {k: p.detach().clone() for k, p in model.named_parameters()}
        opt.zero_grad()
        loss(model(Xb), yb).backward()
        opt.step(batch=(Xb, yb))
        for key, p in model.named_parameters():
            torch.testing.assert_close(p.detach() - before[key], expected[step][key], msg=key)


@pytest.mark.parametrize("method", ["kfac", "ekfac", "diag_ggn"])
def test_optimizer_decreases_the_loss(method):
    model, (X, y), loss = small_model().float(), digits_like(), nn.CrossEntropyLoss()
    opt = OPTIMIZER[method](model, lr=0.5, damping=DAMPING, loss=loss, mc_samples=None)
    losses = []
    for _ in range(6):
        opt.zero_grad()
        value = loss(model(X), y)
        value.backward()
        losses.append(value.item())
        opt.step(batch=(X, y))
    assert losses[-1] < 0.5 * losses[0]


AUTOCAST_OPTIMIZERS = [
    ("kfac", {}),
    ("kfac", {"pi_damping": True}),
    ("ekfac", {}),
    ("diag_ggn", {}),
]


@pytest.mark.parametrize(("method", "options"), AUTOCAST_OPTIMIZERS)
def test_optimizers_stepped_under_autocast_keep_float32_state_and_plain_values(method, options):
    """Three steps under bfloat16 autocast (full refreshes and, for EKFAC, an eigenvalue
    re-fit in the stored basis), then one without: the state stays float32 — EKFAC's step 1
    failed on a bfloat16 basis, KFAC's plain step on bfloat16 inverses — and the moves are
    a plain run's up to the bfloat16 forwards. Only the model's forwards autocast: the first
    step's factors are ``pf.kflr``'s under autocast, not float32's."""
    X, y = digits_like(16)
    X, loss = X.float(), nn.CrossEntropyLoss()
    schedule = {"ema": 0.7, "update_period": 1, "mc_samples": None, **options}
    if method != "diag_ggn":
        schedule["inverse_period"] = 2
    moves = {}
    for autocast in (True, False):
        model = small_model().float()
        start = {k: p.detach().clone() for k, p in model.named_parameters()}
        opt = OPTIMIZER[method](model, lr=LR, damping=DAMPING, loss=loss, **schedule)
        for step in range(4):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast and step < 3):
                opt.zero_grad()
                loss(model(X), y).backward()
                opt.step(batch=(X, y))
                if autocast and step == 0 and method == "kfac" and not options:
                    model_fn, params = pf.functional(small_model().float())
                    expected = pf.kflr(model_fn, params, X, y, loss=loss)
                    found = opt.transformation_state.curvature
                    optree.tree_map(torch.testing.assert_close, found, expected)
                    with torch.autocast("cpu", enabled=False):
                        full = pf.kflr(model_fn, params, X, y, loss=loss)
                    assert not torch.equal(found["2.weight"][1], full["2.weight"][1])
            floating = optree.tree_leaves(opt.transformation_state)
            assert {t.dtype for t in floating if t.is_floating_point()} == {torch.float32}
        moves[autocast] = {k: p.detach() - start[k] for k, p in model.named_parameters()}
    for key, plain in moves[False].items():
        error = (moves[True][key] - plain).norm() / plain.norm()
        assert error <= 3e-2, (key, float(error))


def test_step_with_a_closure_returns_its_loss_and_uses_its_gradients():
    """Under no_grad too: the closure runs with gradients enabled, before the step."""
    X, y = digits_like(16)
    loss = nn.CrossEntropyLoss()
    model, twin = small_model().float(), small_model().float()
    opt = pf.optim.EKFAC(model, lr=LR, damping=DAMPING, loss=loss, mc_samples=None)
    twin_opt = pf.optim.EKFAC(twin, lr=LR, damping=DAMPING, loss=loss, mc_samples=None)

    def closure() -> Tensor:
        opt.zero_grad()
        value = loss(model(X), y)
        value.backward()
        return value

    for _ in range(2):
        expected = loss(model(X), y).item()
        with torch.no_grad():
            returned = opt.step(closure, batch=(X, y))
        assert returned.item() == pytest.approx(expected)
        twin_opt.zero_grad()
        loss(twin(X), y).backward()
        assert twin_opt.step(batch=(X, y)) is None
        for p, q in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(p, q)


def test_the_learning_rate_is_read_at_every_step_so_schedulers_work():
    """StepLR halves lr every 2 steps; the updates are −lr_k (C + λI)⁻¹ g_k, inverse reused."""
    X, y = digits_like(32)
    loss = nn.CrossEntropyLoss()
    model = small_model().float()
    opt = pf.optim.KFAC(
        model, lr=LR, damping=DAMPING, loss=loss, mc_samples=None, inverse_period=10
    )
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    model_fn, params = pf.functional(copy.deepcopy(model))
    params = {k: p.clone() for k, p in params.items()}
    t = scale_by_kfac(model_fn, loss, damping=DAMPING, mc_samples=None, inverse_period=10)
    state = t.init(params)
    for step in range(5):
        opt.zero_grad()
        loss(model(X), y).backward()
        opt.step(batch=(X, y))
        scheduler.step()
        updates, state = t.update(gradient(model_fn, params, loss, X, y), state, params, (X, y))
        lr = LR * 0.5 ** (step // 2)
        params = apply_updates(params, optree.tree_map(lambda u, lr=lr: -lr * u, updates))
        for key, p in model.named_parameters():
            torch.testing.assert_close(p.detach(), params[key], msg=f"step {step}: {key}")
    assert opt.param_groups[0]["lr"] == pytest.approx(LR * 0.5**2)


def test_step_refuses_without_a_batch_when_it_refreshes_the_curvature():
    X, y = digits_like(16)
    model = small_model().float()
    opt = pf.optim.KFAC(model, update_period=2, inverse_period=4)
    nn.functional.cross_entropy(model(X), y).backward()
    with pytest.raises(MissingBatchError, match=r"step 0 of KFAC .*opt.step\(batch=\(X, y\)\)"):
        opt.step()
    opt.step(batch=(X, y))
    opt.step()  # step 1 refreshes nothing
    with pytest.raises(MissingBatchError, match="step 2"):
        opt.step()


def test_optimizers_refuse_bad_input():
    model = nn.Linear(3, 2)
    with pytest.raises(ValueError, match="damping"):
        pf.optim.KFAC(model, damping=0.0)
    with pytest.raises(ValueError, match="inverse_period"):
        pf.optim.EKFAC(model, inverse_period=0)
    with pytest.raises(ValueError, match="lr"):
        pf.optim.DiagGGN(model, lr=-1.0)
    with pytest.raises(TypeError, match="pi_damping"):
        pf.optim.EKFAC(model, pi_damping=True)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="backward"):
        pf.optim.KFAC(model).step(batch=(torch.randn(4, 3), torch.tensor([0, 1, 0, 1])))
    opt = pf.optim.KFAC(model)
    opt.add_param_group({"params": [nn.Parameter(torch.ones(1))]})
    with pytest.raises(ValueError, match="one parameter group"):
        opt.step(batch=(torch.randn(4, 3), torch.tensor([0, 1, 0, 1])))


def test_state_dict_round_trips_the_curvature_and_the_learning_rate():
    X, y = digits_like(32)
    loss = nn.CrossEntropyLoss()
    model = small_model().float()
    opt = pf.optim.EKFAC(
        model, lr=LR, damping=DAMPING, loss=loss, mc_samples=None, inverse_period=3
    )

    def train(model, opt, steps):
        for _ in range(steps):
            opt.zero_grad()
            loss(model(X), y).backward()
            opt.step(batch=(X, y))

    train(model, opt, 2)
    opt.param_groups[0]["lr"] = 0.25
    saved = io.BytesIO()
    torch.save(opt.state_dict(), saved)
    twin = copy.deepcopy(model)
    twin_opt = pf.optim.EKFAC(
        twin, lr=LR, damping=DAMPING, loss=loss, mc_samples=None, inverse_period=3
    )
    saved.seek(0)
    twin_opt.load_state_dict(torch.load(saved, weights_only=False))
    assert twin_opt.param_groups[0]["lr"] == 0.25
    assert int(twin_opt.transformation_state.step) == 2
    train(model, opt, 3)
    train(twin, twin_opt, 3)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q)


@pytest.mark.parametrize("optimizer", ["KFAC", "EKFAC"])
def test_a_resumed_monte_carlo_run_samples_as_an_uninterrupted_one(optimizer):
    """With Monte-Carlo curvature and a generator, ``state_dict`` left the generator's state
    out: a resumed run drew other samples (2.2e-3 off after 6 KFAC steps; a probe). It is
    saved and restored now; a checkpoint with one refuses an optimizer without one."""
    X, y = digits_like(16)
    loss = nn.CrossEntropyLoss()

    def made(model):
        generator = torch.Generator().manual_seed(0)
        cls = getattr(pf.optim, optimizer)
        return cls(model, lr=LR, damping=DAMPING, loss=loss, inverse_period=1, generator=generator)

    def train(model, opt, steps):
        for _ in range(steps):
            opt.zero_grad()
            loss(model(X), y).backward()
            opt.step(batch=(X, y))

    model = small_model().float()
    twin = copy.deepcopy(model)
    opt = made(model)
    train(model, opt, 6)
    twin_opt = made(twin)
    train(twin, twin_opt, 3)
    saved = io.BytesIO()
    torch.save(twin_opt.state_dict(), saved)
    saved.seek(0)
    resumed = made(twin)
    resumed.load_state_dict(torch.load(saved, weights_only=False))
    train(twin, resumed, 3)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q)
    saved.seek(0)
    without = getattr(pf.optim, optimizer)(twin, lr=LR, damping=DAMPING, loss=loss)
    with pytest.raises(ValueError, match="generator"):
        without.load_state_dict(torch.load(saved, weights_only=False))


def test_any_transformation_makes_an_optimizer():
    model = small_model().float()
    model_fn, _ = pf.functional(model)
    opt = pf.optim.CurvatureOptimizer(model, chain(scale(2.0)), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    X, y = digits_like(8)
    loss = opt.step(lambda: nn.functional.cross_entropy(model(X), y).backward())
    assert loss is None
    for p, b in zip(model.parameters(), before):
        torch.testing.assert_close(p.detach(), b - 0.2 * p.grad)


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
    for optimizer in (pf.optim.KFAC, pf.optim.EKFAC):
        with pytest.raises(ValueError, match="transposed"):
            optimizer(model).step(batch=(X, y))
    pf.optim.DiagGGN(model).step(batch=(X, y))


# Linear weights stored [in, out] (x @ W, GPT-2's Conv1D): factors [in×in, out×out].


class InOutLinear(nn.Module):
    """``x @ W`` with the weight of ``linear`` (no bias) stored ``[in, out]``."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.W = nn.Parameter(linear.weight.detach().T.contiguous())

    def forward(self, x: Tensor) -> Tensor:
        return x @ self.W


class AddmmConv1D(nn.Module):
    """GPT-2's ``Conv1D``, ``addmm(b, x.view(-1, in), W)``, with ``linear``'s values."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight = nn.Parameter(linear.weight.detach().T.contiguous())
        self.bias = nn.Parameter(linear.bias.detach().clone())

    def forward(self, x: Tensor) -> Tensor:
        flat = torch.addmm(self.bias, x.view(-1, x.shape[-1]), self.weight)
        return flat.view(*x.shape[:-1], self.weight.shape[-1])


class Transposed(nn.Module):
    """Logits ``[N, T, C]`` as ``[N, C, T]`` for the cross-entropy over positions."""

    def forward(self, x: Tensor) -> Tensor:
        return x.transpose(1, 2)


def linear_and_in_out_twins(kind: str) -> tuple[nn.Module, nn.Module, Tensor, Tensor]:
    """A model of ``nn.Linear`` layers, its twin whose first layer stores the weight
    ``[in, out]`` (``x @ W``, or ``conv1d`` on sequences of 3 positions), and a batch."""
    torch.manual_seed(0)
    first = nn.Linear(4, 5, bias=kind == "conv1d")
    twin = InOutLinear(first) if kind == "x @ W" else AddmmConv1D(first)
    rest: list[nn.Module] = [nn.Tanh(), nn.Linear(5, 3)]
    if kind == "conv1d":
        rest.append(Transposed())
        X, y = torch.randn(6, 3, 4), torch.randint(0, 3, (6, 3))
    else:
        X, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    linear = nn.Sequential(first, *rest).double()
    return linear, nn.Sequential(twin, *copy.deepcopy(rest)).double(), X.double(), y


def as_linear(name: str, value: Tensor) -> Tensor:
    """A parameter of the ``[in, out]`` twin in its ``nn.Linear`` layout."""
    return value.T if name in ("0.W", "0.weight") else value


@pytest.mark.parametrize("kind", ["x @ W", "conv1d"])
def test_kfac_update_of_an_in_out_weight_is_the_dense_damped_solve(kind):
    """Hand computation: ``(A ⊗ B + d I)⁻¹ vec g`` with ``pf.kflr``'s ``[in×in, out×out]``."""
    _, model, X, y = linear_and_in_out_twins(kind)
    loss = nn.CrossEntropyLoss()
    model_fn, params = pf.functional(model)
    t = scale_by_kfac(model_fn, loss, damping=DAMPING, mc_samples=None)
    grads = gradient(model_fn, params, loss, X, y)
    updates, _ = t.update(grads, t.init(params), params, (X, y))
    factors = pf.kflr(model_fn, params, X, y, loss=loss)
    assert [f.shape for f in factors["0.W" if kind == "x @ W" else "0.weight"]] == [(4, 4), (5, 5)]
    for key, g in grads.items():
        M = factors[key][0] if len(factors[key]) == 1 else torch.kron(*factors[key])
        expected = torch.linalg.solve(damped(M), g.reshape(-1)).view(g.shape)
        torch.testing.assert_close(updates[key], expected, msg=key)
        by_kron = pf.kron.matvec(pf.kron.inverse(factors, DAMPING), grads)[key]
        torch.testing.assert_close(by_kron, expected, msg=key)


@pytest.mark.parametrize("kind", ["x @ W", "conv1d"])
@pytest.mark.parametrize("method", ["kfac", "ekfac"])
def test_kronecker_optimizers_step_an_in_out_weight_as_its_linear_layer(method, kind):
    """Oracle: the same steps of the twin made of ``nn.Linear`` layers (weights ``[out, in]``),
    whose updates are the dense solves above: every move equal, up to the transposition."""
    linear, in_out, X, y = linear_and_in_out_twins(kind)
    loss = nn.CrossEntropyLoss()
    moves = []
    for model in (linear, in_out):
        opt = OPTIMIZER[method](model, lr=LR, damping=DAMPING, loss=loss, mc_samples=None)
        before = {k: p.detach().clone() for k, p in model.named_parameters()}
        for _ in range(2):
            opt.zero_grad()
            loss(model(X), y).backward()
            opt.step(batch=(X, y))
        moves.append({k: p.detach() - before[k] for k, p in model.named_parameters()})
    theirs, ours = moves
    assert len(ours) == len(theirs)
    for (key, move), expected in zip(ours.items(), theirs.values()):
        torch.testing.assert_close(as_linear(key, move), expected, msg=key)


def test_only_transposed_convolutions_are_refused_not_the_in_out_weights_beside_them():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.ConvTranspose1d(2, 2, 3), nn.Flatten(), InOutLinear(nn.Linear(10, 3))
    ).double()
    X, y = torch.randn(4, 2, 3, dtype=torch.float64), torch.tensor([0, 1, 2, 0])
    nn.functional.cross_entropy(model(X), y).backward()
    for optimizer in (pf.optim.KFAC, pf.optim.EKFAC):
        with pytest.raises(
            ValueError, match=r"transposed convolutions yet \(\['0.bias', '0.weight'\]\)"
        ):
            optimizer(model).step(batch=(X, y))


# Frozen parameters (requires_grad=False) are left out, as torch.optim's optimizers do.


def head_curvature_by_hand(model: nn.Module, X: Tensor, y: Tensor) -> tuple[dict, Tensor, Tensor]:
    """The dense GGN blocks of the head ``model[2]`` (mean cross-entropy) and its KFLR
    factors ``A = Σ_n H_n``, ``B = hᵀ h / N`` on the frozen body's features ``h``."""
    with torch.no_grad():
        h = model[1](model[0](X))
        p = model[2](h).softmax(-1)
    H = (torch.diag_embed(p) - p[:, :, None] * p[:, None, :]) / len(y)  # per-sample ∇²_f loss
    weight = sum(torch.kron(H_n, torch.outer(h_n, h_n)) for H_n, h_n in zip(H, h))
    return {"2.weight": weight, "2.bias": H.sum(0)}, H.sum(0), h.T @ h / len(y)


def head_updates_by_hand(method: str, model: nn.Module, X: Tensor, y: Tensor) -> dict:
    """The first preconditioned gradient of the head's parameters, densely."""
    blocks, A, B = head_curvature_by_hand(model, X, y)
    loss = nn.functional.cross_entropy(model(X), y)
    head = dict(model[2].named_parameters())
    grads = dict(zip(head, torch.autograd.grad(loss, list(head.values()))))
    found = {}
    for name, g in grads.items():
        block, kfac = blocks[f"2.{name}"], torch.kron(A, B) if name == "weight" else A
        if method == "diag_ggn":
            found[f"2.{name}"] = g / (block.diagonal().view(g.shape) + DAMPING)
            continue
        if method == "ekfac":
            Qs = [torch.linalg.eigh(f)[1] for f in ((A, B) if name == "weight" else (A,))]
            Q = Qs[0] if len(Qs) == 1 else torch.kron(*Qs)
            kfac = Q @ torch.diag((Q.T @ block @ Q).diagonal()) @ Q.T
        found[f"2.{name}"] = torch.linalg.solve(damped(kfac), g.reshape(-1)).view(g.shape)
    return found


@pytest.mark.parametrize("method", ["kfac", "ekfac", "diag_ggn"])
def test_optimizers_leave_out_parameters_that_do_not_require_grad(method):
    """Fine-tuning the head: the frozen layer (even with a stale ``.grad``) stays where it is,
    the head moves by ``-lr`` times its damped curvature's solve, computed by hand."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 3)).double()
    X, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    loss = nn.CrossEntropyLoss()
    loss(model(X), y).backward()  # earlier training left gradients
    model[0].requires_grad_(False)  # then the first layer is frozen
    frozen = [p.detach().clone() for p in model[0].parameters()]
    before = {k: p.detach().clone() for k, p in model[2].named_parameters()}
    expected = head_updates_by_hand(method, model, X, y)
    opt = OPTIMIZER[method](model, lr=LR, damping=DAMPING, loss=loss, mc_samples=None)
    opt.zero_grad()
    loss(model(X), y).backward()
    opt.step(batch=(X, y))
    for p, value in zip(model[0].parameters(), frozen):
        assert torch.equal(p.detach(), value)
    for name, p in model[2].named_parameters():
        move = p.detach() - before[name]
        torch.testing.assert_close(move, -LR * expected[f"2.{name}"], msg=name)
    curvature = opt.transformation_state.curvature
    assert sorted(curvature.factors if method == "ekfac" else curvature) == ["2.bias", "2.weight"]


def test_freezing_after_the_optimizer_was_made_and_a_model_without_trainables_are_named():
    model = small_model()
    X, y = digits_like(8)
    opt = pf.optim.KFAC(model, loss=nn.CrossEntropyLoss())
    model[0].requires_grad_(False)
    nn.functional.cross_entropy(model(X.double()), y).backward()
    with pytest.raises(ValueError, match=r"\['0.weight', '0.bias'\] no longer require grad"):
        opt.step(batch=(X.double(), y))
    with pytest.raises(ValueError, match="no parameter that requires grad"):
        pf.optim.DiagGGN(model.requires_grad_(False))


@pytest.mark.parametrize("optimizer", ["KFAC", "EKFAC"])
def test_a_parameter_without_factors_is_refused_in_the_optimizers_words(optimizer):
    """A hand-written LoRA ``x @ A.T @ B.T``: its matrices have no Kronecker factors, and the
    refusal told the user to pass ``on_unsupported='skip'``, which the optimizers do not take."""

    class LoRA(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.A, self.B = nn.Parameter(torch.randn(2, 4)), nn.Parameter(torch.randn(3, 2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.A.T @ self.B.T

    torch.manual_seed(0)
    model = LoRA()
    X, y = torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1])
    opt = getattr(pf.optim, optimizer)(model, lr=0.1, damping=1e-2)
    nn.CrossEntropyLoss()(model(X), y).backward()
    with pytest.raises(ValueError, match="no Kronecker factors.*another optimizer") as error:
        opt.step(batch=(X, y))
    assert "on_unsupported" not in str(error.value)


def test_a_distributed_data_parallel_model_is_refused_naming_the_way_over_ranks() -> None:
    """The curvature optimizers precondition with this rank's own batch's curvature and
    DPOptimizer clips this rank's samples only: under DDP the replicas drifted apart (0.17
    after three steps on two ranks; a probe). Both refuse a DDP wrapper, naming the fix."""
    wrapped = nn.parallel.DistributedDataParallel.__new__(nn.parallel.DistributedDataParallel)
    with pytest.raises(ValueError, match="process_group"):
        pf.optim.KFAC(wrapped, lr=0.1)
    with pytest.raises(ValueError, match="model.module with process_group="):
        pf.privacy.DPOptimizer(
            wrapped,
            torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1),
            max_norm=1.0,
            noise_multiplier=1.0,
            expected_batch_size=4,
        )
