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
