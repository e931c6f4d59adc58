"""The decompositions the modes run in place of ops whose batching rules are wrong."""

from __future__ import annotations

import pytest
import torch

from packfunc.engine.decompositions import linalg_solve, run_decomposed


@pytest.mark.parametrize("left", [True, False])
@pytest.mark.parametrize(
    ("a_shape", "b_shape"),
    [
        ((3, 3), (5, 3, 1)),  # one matrix, a batch of right-hand sides
        ((3, 3), (1, 3, 3)),  # one sample's right-hand side (a batch of one)
        ((4, 1, 3, 3), (2, 3, 3)),  # both broadcast
        ((2, 3, 3), (2, 3)),  # vectors, torch's rule: A's shape without its last dim
        ((3, 3), (3,)),  # one vector: nothing broadcasts, the op runs
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


def test_solve_leaves_what_it_does_not_expand_to_torch():
    A, B = 2 * torch.eye(3), torch.ones(4, 3, 2)
    assert linalg_solve(A, torch.ones(3, 1)) is NotImplemented  # nothing broadcasts
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
