"""The decompositions the modes run in place of ops whose batching rules are wrong."""

from __future__ import annotations

import pytest
import torch
from tests.cases import assert_trees_close, autograd_batch_grad

import packfunc as pf
from packfunc.engine import decompositions
from packfunc.engine.decompositions import linalg_solve, run_decomposed


@pytest.mark.parametrize("left", [True, False])
@pytest.mark.parametrize(
    ("a_shape", "b_shape"),
    [
        ((3, 3), (5, 3, 1)),  # one matrix, a batch of right-hand sides
        ((3, 3), (1, 3, 3)),  # one sample's right-hand side (a batch of one)
        ((4, 1, 3, 3), (2, 3, 3)),  # both broadcast
        ((2, 3, 3), (2, 3)),  # vectors, torch's rule: A's shape without its last dim
        ((3, 3), (3,)),  # one vector: nothing broadcasts
        ((1, 3, 3), (5, 3, 1)),  # a batch of one matrix (expanded for any batch size)
    ],
)
def test_solve_expanded_to_the_common_batch_shape_is_torchs(a_shape, b_shape, left):
    torch.manual_seed(0)
    A = torch.randn(*a_shape, dtype=torch.float64) + 3 * torch.eye(3, dtype=torch.float64)
    B = torch.randn(*b_shape, dtype=torch.float64)
    if not left:  # X A = B: rows; torch refuses vectors there
        if b_shape[-1] != 3 or len(b_shape) < len(a_shape):
            return
        B = B.mT
    options = {"left": left}
    found = run_decomposed(torch.linalg.solve, (A, B), options)
    torch.testing.assert_close(found, torch.linalg.solve(A, B, **options), rtol=0, atol=1e-14)
    result, info = run_decomposed(torch.linalg.solve_ex, (A, B), options)
    expected = torch.linalg.solve_ex(A, B, **options)
    torch.testing.assert_close(result, expected.result, rtol=0, atol=1e-14)
    assert torch.equal(info, expected.info)


def test_solve_leaves_out_and_its_own_inner_solve_to_torch():
    A, B = 2 * torch.eye(3), torch.ones(4, 3, 2)
    with decompositions._solving():  # the solve a decomposition runs
        assert linalg_solve(A, B) is NotImplemented
    out = torch.empty(4, 3, 2)
    assert linalg_solve(A, B, out=out) is NotImplemented
    torch.testing.assert_close(run_decomposed(torch.linalg.solve, (A, B), {"out": out}), B / 2)


def test_the_pullback_of_solve_over_cotangents_is_exact_decomposed():
    """torch's rule for ``solve(A [3, 3], B [1, 3, 1])``'s backward under vmap over
    cotangents was 0.13 off a loop over them, silently."""
    torch.manual_seed(0)
    A = torch.randn(3, 3, dtype=torch.float64) + 3 * torch.eye(3, dtype=torch.float64)
    B, cotangents = torch.randn(1, 3, 1, dtype=torch.float64), torch.randn(2, 1, 3, 1).double()
    _, pullback = torch.func.vjp(lambda a: linalg_solve(a, B), A)
    batched = torch.func.vmap(lambda c: pullback(c)[0])(cotangents)
    looped = torch.stack(
        [
            torch.autograd.grad(torch.linalg.solve(A.requires_grad_(), B), A, c)[0]
            for c in cotangents
        ]
    )
    torch.testing.assert_close(batched, looped)


@pytest.mark.parametrize("n", [1, 3])
def test_a_batch_of_one_matrix_is_solved_the_same_way_for_any_batch_size(n):
    """``solve(A [1, 3, 3], x [N, 3, 1])``: expanded only where it broadcast (N > 1), the
    decomposition called other ops for one sample than for the batch (a refusal at N > 1)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(_SolveBatchOfOne(), torch.nn.Linear(3, 2)).double()
    X, y = torch.randn(n, 3, dtype=torch.float64), torch.randint(0, 2, (n,))
    model_fn, params = pf.functional(model)
    found = pf.batch_grad(model_fn, params, X, y)
    assert_trees_close(found, autograd_batch_grad(model, torch.nn.CrossEntropyLoss(), X, y))


class _SolveBatchOfOne(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.A = torch.nn.Parameter(2 * torch.eye(3)[None] + torch.randn(1, 3, 3) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.linalg.solve(self.A, x[..., None])[..., 0])


@pytest.mark.parametrize(
    ("p", "mode", "rows"),
    [
        (2.0, None, 4),  # differences: few rows
        (2.0, None, 30),  # torch's product form: more than 25 rows
        (2.0, "use_mm_for_euclid_dist", 4),
        (2.0, "donot_use_mm_for_euclid_dist", 30),
        (1.0, None, 4),
        (3.0, None, 30),
    ],
)
def test_cdist_decomposed_is_torchs_with_its_gradients(p, mode, rows):
    """Values and gradients equal torch's cdist (a zero distance included: gradient zero)."""
    torch.manual_seed(0)
    x1 = torch.randn(2, 5, 3, dtype=torch.float64, requires_grad=True)
    x2 = torch.randn(rows, 3, dtype=torch.float64)
    x2[0] = x1[0, 0].detach()  # a zero distance
    x2.requires_grad_()
    weights = torch.randn(2, 5, rows, dtype=torch.float64)
    found = decompositions.cdist(x1, x2, p, mode)
    expected = torch.cdist(x1, x2, p, compute_mode=mode or "use_mm_for_euclid_dist_if_necessary")
    torch.testing.assert_close(found, expected)
    grads = torch.autograd.grad((found * weights).sum(), (x1, x2))
    torch.testing.assert_close(grads, torch.autograd.grad((expected * weights).sum(), (x1, x2)))


def test_cdist_leaves_other_orders_to_torch():
    x1, x2 = torch.randn(2, 3), torch.randn(4, 3)
    assert decompositions.cdist(x1, x2, 0.5) is NotImplemented
    assert decompositions.cdist(x1, x2, float("inf")) is NotImplemented
    torch.testing.assert_close(
        run_decomposed(torch.cdist, (x1, x2, float("inf")), {}), torch.cdist(x1, x2, float("inf"))
    )


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("quantity", ["diag_ggn", "diag_hessian"])
def test_cdist_of_a_parameter_is_exact_for_any_batch_size(n, quantity):
    """torch's batching rule of cdist's backward made the GGN quantities wrong at N = 1 (then
    refused by the op-local check), and cdist's backward has no derivative (no Hessians)."""
    torch.manual_seed(0)
    model = _Distances(centres=4).double()
    X, y = torch.randn(n, 3, dtype=torch.float64), torch.randint(0, 2, (n,))
    model_fn, params = pf.functional(model)
    found = getattr(pf, quantity)(model_fn, params, X, y)["centres"]
    loss = torch.nn.CrossEntropyLoss()

    def of_centres(c: torch.Tensor, distances=torch.cdist) -> torch.Tensor:
        head = params["head.weight"], params["head.bias"]
        return torch.nn.functional.linear(torch.exp(-distances(X, c)), *head)

    # dense oracles by loops of autograd: torch's own vmap rule of cdist's backward is wrong
    centres = params["centres"].detach()
    if quantity == "diag_hessian":  # cdist has no second derivative: the formula itself

        def euclidean(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
            return (x[:, None] - c[None]).square().sum(-1).sqrt()

        expected = torch.autograd.functional.hessian(
            lambda c: loss(of_centres(c, euclidean), y), centres
        )
        expected = expected.reshape(12, 12).diagonal()
    else:
        J = torch.autograd.functional.jacobian(of_centres, centres).reshape(-1, 12)
        out = of_centres(centres)
        H = torch.autograd.functional.hessian(lambda o: loss(o.reshape(out.shape), y), out)
        expected = (J.T @ H.reshape(J.shape[0], J.shape[0]) @ J).diagonal()
    torch.testing.assert_close(found.reshape(-1), expected)


class _Distances(torch.nn.Module):
    """An RBF layer: ``exp(-‖x - c_j‖)`` for learned centres, then a linear head."""

    def __init__(self, centres: int) -> None:
        super().__init__()
        self.centres = torch.nn.Parameter(torch.randn(centres, 3))
        self.head = torch.nn.Linear(centres, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.exp(-torch.cdist(x, self.centres)))
