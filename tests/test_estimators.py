"""Trace and diagonal estimators against the dense GGN and Hessian of tiny float64 models.

Each estimate is compared with the exact value within five standard errors, the standard
error following from the estimator's variance computed on the dense matrix (Rademacher
probes: ``2 (‖A‖_F² − Σ A_ii²)`` for the trace, ``Σ_{j≠i} A_ij²`` for diagonal entry ``i``;
normal probes: ``2 ‖A‖_F²`` and ``2 A_ii² + Σ_{j≠i} A_ij²``).
"""

from __future__ import annotations

import pytest
import torch

import packfunc as pf
from tests.cases import assert_trees_close, make_problem

SAMPLES = 2000
CURVATURES = {"ggn": pf.diag_ggn, "hessian": pf.diag_hessian}


def _seeded(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _dense(curvature: str, n: int = 4) -> torch.Tensor:
    dense = make_problem("residual", n=n).dense()
    return dense.ggn if curvature == "ggn" else dense.hessian


def _trace_variance(matrix: torch.Tensor, distribution: str) -> torch.Tensor:
    frobenius = matrix.square().sum()
    if distribution == "normal":
        return 2 * frobenius
    return 2 * (frobenius - matrix.diagonal().square().sum())


def _diagonal_variance(matrix: torch.Tensor, distribution: str) -> torch.Tensor:
    off_diagonal = matrix.square().sum(1) - matrix.diagonal().square()
    if distribution == "normal":
        return off_diagonal + 2 * matrix.diagonal().square()
    return off_diagonal


@pytest.mark.parametrize("distribution", ["rademacher", "normal"])
@pytest.mark.parametrize("curvature", ["ggn", "hessian"])
def test_hutchinson_trace_within_five_standard_errors(curvature: str, distribution: str):
    problem = make_problem("residual", n=4)
    model_fn, params = problem.functional()
    matrix = _dense(curvature)
    estimate = pf.hutchinson_trace(
        model_fn,
        params,
        problem.X,
        problem.y,
        loss=problem.loss,
        curvature=curvature,
        num_samples=SAMPLES,
        distribution=distribution,
        generator=_seeded(),
        chunk_size=500,
    )
    standard_error = (_trace_variance(matrix, distribution) / SAMPLES).sqrt()
    assert estimate.shape == ()
    assert (estimate - matrix.trace()).abs() <= 5 * standard_error


@pytest.mark.parametrize("distribution", ["rademacher", "normal"])
@pytest.mark.parametrize("curvature", ["ggn", "hessian"])
def test_hutchinson_diagonal_within_five_standard_errors(curvature: str, distribution: str):
    problem = make_problem("residual", n=4)
    model_fn, params = problem.functional()
    dense = problem.dense()
    matrix = _dense(curvature)
    exact = CURVATURES[curvature](model_fn, params, problem.X, problem.y, loss=problem.loss)
    torch.testing.assert_close(dense.flatten(exact), matrix.diagonal())  # two oracles agree
    estimate = pf.hutchinson_diagonal(
        model_fn,
        params,
        problem.X,
        problem.y,
        loss=problem.loss,
        curvature=curvature,
        num_samples=SAMPLES,
        distribution=distribution,
        generator=_seeded(),
        chunk_size=500,
    )
    assert {k: v.shape for k, v in estimate.items()} == {k: v.shape for k, v in params.items()}
    standard_error = (_diagonal_variance(matrix, distribution) / SAMPLES).sqrt()
    error = (dense.flatten(estimate) - matrix.diagonal()).abs()
    assert (error <= 5 * standard_error + 1e-12).all()


def test_hutchpp_is_exact_on_a_low_rank_ggn_where_hutchinson_is_not():
    # 4 samples, 2 classes: the cross-entropy GGN has rank 4 <= num_matvecs // 3
    problem = make_problem("residual", n=4)
    model_fn, params = problem.functional()
    exact = _dense("ggn").trace()
    arguments = (model_fn, params, problem.X, problem.y)
    hutchpp = pf.hutchpp_trace(*arguments, loss=problem.loss, num_matvecs=15, generator=_seeded())
    hutchinson = pf.hutchinson_trace(
        *arguments, loss=problem.loss, num_samples=15, generator=_seeded()
    )
    torch.testing.assert_close(hutchpp, exact, rtol=1e-10, atol=1e-12)
    assert (hutchinson - exact).abs() > 1e3 * (hutchpp - exact).abs()


def test_hutchpp_is_unbiased_on_a_full_rank_hessian():
    problem = make_problem("residual", n=4)
    model_fn, params = problem.functional()
    exact = _dense("hessian").trace()
    generator = _seeded()
    estimates = torch.stack(
        [
            pf.hutchpp_trace(
                model_fn,
                params,
                problem.X,
                problem.y,
                loss=problem.loss,
                curvature="hessian",
                num_matvecs=6,
                generator=generator,
            )
            for _ in range(50)
        ]
    )
    standard_error = estimates.std() / len(estimates) ** 0.5
    assert (estimates.mean() - exact).abs() <= 5 * standard_error


@pytest.mark.parametrize("estimator", [pf.hutchinson_trace, pf.hutchinson_diagonal])
def test_same_generator_same_estimate_whatever_the_chunk_size(estimator):
    problem = make_problem("mlp", n=3)
    model_fn, params = problem.functional()
    arguments = (model_fn, params, problem.X, problem.y)
    first = estimator(*arguments, num_samples=10, generator=_seeded(3), chunk_size=3)
    again = estimator(*arguments, num_samples=10, generator=_seeded(3), chunk_size=10)
    other = estimator(*arguments, num_samples=10, generator=_seeded(4))
    assert_trees_close(again, first)
    with pytest.raises(AssertionError):
        assert_trees_close(other, first)


def test_hutchpp_same_generator_same_estimate():
    problem = make_problem("mlp", n=3)
    model_fn, params = problem.functional()
    arguments = (model_fn, params, problem.X, problem.y)
    first = pf.hutchpp_trace(*arguments, curvature="hessian", generator=_seeded(1))
    again = pf.hutchpp_trace(*arguments, curvature="hessian", generator=_seeded(1))
    assert torch.equal(first, again)


@pytest.mark.parametrize(
    ("estimator", "options", "message"),
    [
        (pf.hutchinson_trace, {"num_samples": 0}, "num_samples must be an int of at least 1"),
        (pf.hutchinson_diagonal, {"num_samples": 2.5}, "num_samples must be an int"),
        (pf.hutchpp_trace, {"num_matvecs": 2}, "num_matvecs must be an int of at least 3"),
        (pf.hutchinson_trace, {"curvature": "fisher"}, "curvature must be one of"),
        (pf.hutchpp_trace, {"distribution": "uniform"}, "distribution must be 'rademacher'"),
        (pf.hutchinson_diagonal, {"chunk_size": 0}, "chunk_size must be an int"),
    ],
)
def test_bad_arguments_are_refused(estimator, options, message):
    problem = make_problem("mlp", n=3)
    model_fn, params = problem.functional()
    with pytest.raises(ValueError, match=message):
        estimator(model_fn, params, problem.X, problem.y, **options)


def test_mixed_dtypes_are_refused_with_the_fix():
    problem = make_problem("mlp", n=3)
    model_fn, params = problem.functional()
    params = {k: p.float() if k.endswith("bias") else p for k, p in params.items()}
    with pytest.raises(ValueError, match="one device with one dtype"):
        pf.hutchinson_trace(model_fn, params, problem.X, problem.y)


@pytest.mark.parametrize("estimator", ["hutchinson_trace", "hutchinson_diagonal", "hutchpp_trace"])
def test_a_model_with_dropout_is_refused_as_the_products_refuse_it(estimator):
    """The products refuse a random model naming the fix; the estimators, which vmap them,
    raised torch's "vmap: called random operation" instead (a probe)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Dropout(0.5), torch.nn.Linear(4, 3))
    model_fn, params = pf.functional(model)
    X, y = torch.randn(7, 3), torch.randint(0, 3, (7,))
    with pytest.raises(pf.RandomModelError, match=r"model\.eval\(\)"):
        getattr(pf, estimator)(model_fn, params, X, y)
