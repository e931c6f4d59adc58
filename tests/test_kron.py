"""Kronecker algebra against torch.linalg on the dense ``torch.kron(A, B)``."""

from __future__ import annotations

import copy
import math

import optree
import pytest
import torch
from torch import Tensor, nn

import packfunc as pf
from packfunc import kron

DAMPING = 0.3


def spd(size: int, generator: torch.Generator, rank: int | None = None) -> Tensor:
    """A random symmetric positive semi-definite float64 matrix (singular for ``rank < size``)."""
    root = torch.randn(size, rank or size + 2, generator=generator, dtype=torch.float64)
    return root @ root.T / root.shape[1]


@pytest.fixture
def curvature() -> dict:
    """Factor lists of two equal-shaped layers (batched eigh), a bias, a singular one, None."""
    g = torch.Generator().manual_seed(0)
    return {
        "a": [spd(3, g), spd(4, g)],
        "b": [spd(3, g), spd(4, g)],
        "bias": [spd(3, g)],
        "singular": [spd(2, g, rank=1), spd(5, g)],
        "frozen": None,
    }


@pytest.fixture
def vector() -> dict:
    g = torch.Generator().manual_seed(1)
    shapes = {"a": (3, 4), "b": (3, 2, 2), "bias": (3,), "singular": (2, 5), "frozen": (7,)}
    return {k: torch.randn(s, generator=g, dtype=torch.float64) for k, s in shapes.items()}


def dense_kron(entry: list[Tensor]) -> Tensor:
    return entry[0] if len(entry) == 1 else torch.kron(entry[0], entry[1])


def matrix_power(M: Tensor, exponent: float) -> Tensor:
    """Oracle: a symmetric matrix's power from ``torch.linalg.eigh`` of the dense matrix."""
    values, vectors = torch.linalg.eigh(M)
    return vectors @ torch.diag(values.pow(exponent)) @ vectors.T


def factor_oracle(M: Tensor, exponent: float) -> Tensor:
    """``torch.linalg.inv`` for the inverse, else :func:`matrix_power`."""
    return torch.linalg.inv(M) if exponent == -1 else matrix_power(M, exponent)


def test_dense_and_matvec_match_torch_kron(curvature, vector):
    dense = kron.dense(curvature)
    product = kron.matvec(curvature, vector)
    assert dense["frozen"] is None and product["frozen"] is None
    for key, entry in curvature.items():
        if entry is None:
            continue
        torch.testing.assert_close(dense[key], dense_kron(entry))
        expected = (dense_kron(entry) @ vector[key].reshape(-1)).reshape(vector[key].shape)
        torch.testing.assert_close(product[key], expected)


def test_eigh_reconstructs_each_entry(curvature):
    eigen = kron.eigh(curvature)
    assert eigen["frozen"] is None
    for key, entry in curvature.items():
        if entry is not None:
            assert isinstance(eigen[key], kron.Eigen)
            torch.testing.assert_close(kron.dense(eigen[key]), dense_kron(entry))
    assert kron.eigh(eigen)["a"] is eigen["a"]  # already decomposed: kept


@pytest.mark.parametrize("exponent", [-1.0, -0.5, 0.5])
def test_damped_powers_match_dense_eigh(curvature, vector, exponent):
    powered = kron.power(curvature, exponent, DAMPING)
    product = kron.matvec(powered, vector)
    for key, entry in curvature.items():
        if entry is None:
            continue
        M = dense_kron(entry) + DAMPING * torch.eye(dense_kron(entry).shape[0], dtype=torch.float64)
        expected = matrix_power(M, exponent)
        torch.testing.assert_close(kron.dense(powered[key]), expected)
        flat = expected @ vector[key].reshape(-1)
        torch.testing.assert_close(product[key], flat.reshape(vector[key].shape))


def test_inverse_is_the_dense_solve_and_inverse_sqrt_squares_to_it(curvature, vector):
    inverse = kron.matvec(kron.inverse(curvature, DAMPING), vector)
    root = kron.inverse_sqrt(curvature, DAMPING)
    twice = kron.matvec(root, kron.matvec(root, vector))
    for key, entry in curvature.items():
        if entry is None:
            continue
        M = dense_kron(entry) + DAMPING * torch.eye(dense_kron(entry).shape[0], dtype=torch.float64)
        expected = torch.linalg.solve(M, vector[key].reshape(-1)).reshape(vector[key].shape)
        torch.testing.assert_close(inverse[key], expected)
        torch.testing.assert_close(twice[key], expected)


def test_logdet_and_trace(curvature):
    for damping in (0.0, DAMPING):
        logdet = kron.logdet(curvature, damping)
        trace = kron.trace(curvature, damping)
        eigen_trace = kron.trace(kron.eigh(curvature), damping)
        for key, entry in curvature.items():
            if entry is None:
                assert logdet[key] is None and trace[key] is None
                continue
            M = dense_kron(entry) + damping * torch.eye(dense_kron(entry).shape[0]).double()
            torch.testing.assert_close(trace[key], torch.trace(M))
            torch.testing.assert_close(eigen_trace[key], torch.trace(M))
            if key != "singular" or damping > 0:
                torch.testing.assert_close(logdet[key], torch.linalg.slogdet(M)[1])
    # a singular entry's log-determinant is -inf, from its factors or its eigenbasis (the
    # factors' gave the logs of their rounding-sized eigenvalues summed, -1803 for a
    # rank-4 input factor of 20 rows, silently: found by a probe)
    assert kron.logdet(curvature)["singular"] == -math.inf
    assert kron.logdet(kron.eigh(curvature))["singular"] == -math.inf


def test_logdet_of_rank_deficient_kflr_factors_is_minus_infinity():
    """KFLR of a 20-input linear layer from 4 samples: its input factor has rank 4."""
    torch.manual_seed(0)
    model_fn, params = pf.functional(torch.nn.Linear(20, 3))
    X, y = torch.randn(4, 20), torch.randn(4, 3)
    factors = pf.kflr(model_fn, params, X, y, loss=torch.nn.MSELoss())
    assert kron.logdet(factors)["weight"] == -math.inf
    assert kron.logdet(kron.eigh(factors))["weight"] == -math.inf
    assert math.isfinite(kron.logdet(factors, damping=1e-3)["weight"])
    assert math.isfinite(kron.logdet(factors)["bias"])  # [A], 3×3 of rank 3


@pytest.mark.parametrize("exponent", [-1.0, -0.5])
def test_pi_damped_factor_powers(curvature, vector, exponent):
    damped = kron.factor_damped_power(curvature, DAMPING, exponent)
    product = kron.matvec(damped, vector)
    for key, entry in curvature.items():
        if entry is None:
            assert damped[key] is None
            continue
        if len(entry) == 1:
            eye = torch.eye(entry[0].shape[0], dtype=torch.float64)
            expected = factor_oracle(entry[0] + DAMPING * eye, exponent)
        else:
            A, B = entry
            pi = ((torch.trace(A) / A.shape[0]) / (torch.trace(B) / B.shape[0])).sqrt()
            eye_a = torch.eye(A.shape[0], dtype=torch.float64)
            eye_b = torch.eye(B.shape[0], dtype=torch.float64)
            expected = torch.kron(
                factor_oracle(A + pi * DAMPING**0.5 * eye_a, exponent),
                factor_oracle(B + DAMPING**0.5 / pi * eye_b, exponent),
            )
        torch.testing.assert_close(kron.dense(damped[key]), expected)
        flat = (expected @ vector[key].reshape(-1)).reshape(vector[key].shape)
        torch.testing.assert_close(product[key], flat)


@pytest.mark.parametrize("exponent", [-1.0, -0.5])
def test_pi_damped_powers_of_rank_deficient_float32_factors_are_finite(exponent):
    """A float32 factor of rank 4 (64 rows) has eigenvalues around -1e-5 from rounding: with a
    shift below that, Cholesky raised torch's bare "not positive-definite" (and eigh's
    clamped eigenvalues plus nothing gave inf); the rounding is clamped at zero first, as
    ``inverse`` does (a probe)."""
    torch.manual_seed(0)
    M, N = torch.randn(64, 4), torch.randn(10, 10)
    A, B = M @ M.T, N @ N.T * 1e4  # (a large B: π, so A's shift, small)
    found = kron.factor_damped_power({"w": [A, B]}, 1e-10, exponent)["w"]
    assert all(bool(torch.isfinite(f).all()) for f in found)
    # (the null space's values are rounding noise in float32: the same eigh's, clamped)
    values, vectors = torch.linalg.eigh(A)
    pi = ((A.trace() / 64) / (B.trace() / 10)).sqrt()
    expected = (vectors * (values.clamp_min(0) + pi * 1e-5).pow(exponent)) @ vectors.T
    torch.testing.assert_close(found[0], expected)


def test_eigen_entries_from_ekfac_work_everywhere():
    model_fn, params = pf.functional(torch.nn.Sequential(torch.nn.Linear(3, 4)).double())
    X, y = torch.randn(6, 3, dtype=torch.float64), torch.randint(0, 4, (6,))
    found = pf.ekfac(model_fn, params, X, y, mc_samples=None)
    v = {k: torch.randn_like(p) for k, p in params.items()}
    for key, solved in kron.matvec(kron.inverse(found, DAMPING), v).items():
        M = kron.dense(found[key])
        M = M + DAMPING * torch.eye(M.shape[0], dtype=M.dtype)
        torch.testing.assert_close(
            solved.reshape(-1), torch.linalg.solve(M, v[key].reshape(-1)), msg=key
        )
        torch.testing.assert_close(kron.logdet(found, DAMPING)[key], torch.linalg.slogdet(M)[1])


def test_results_are_pytrees_and_map_entries(curvature):
    leaves = optree.tree_leaves(kron.inverse(curvature, DAMPING))
    assert leaves and all(isinstance(t, Tensor) for t in leaves)
    sizes = kron.map_entries(lambda e: [f.shape[0] for f in e], curvature)
    assert sizes["a"] == [3, 4] and sizes["frozen"] is None


def test_bad_input_is_refused(curvature, vector):
    with pytest.raises(ValueError, match="damping > 0"):
        kron.inverse(curvature, 0.0)
    with pytest.raises(TypeError, match="inverse"):
        kron.factor_damped_power(kron.eigh(curvature), DAMPING)
    with pytest.raises(ValueError, match="does not match"):
        kron.matvec(curvature, {**vector, "a": torch.ones(5)})
    with pytest.raises(TypeError, match="entries"):
        kron.trace({"a": torch.eye(2)})


def test_equal_factors_are_decomposed_once(monkeypatch):
    """A bias shares its layer's output factor: one eigh row for equal matrices, same results."""
    A = torch.randn(4, 6, dtype=torch.float64)
    A = A @ A.T
    B = torch.randn(4, 4, dtype=torch.float64)
    B = B @ B.T
    stacked_sizes = []
    eigh = torch.linalg.eigh

    def counting(stack):
        stacked_sizes.append(stack.shape[0])
        return eigh(stack)

    monkeypatch.setattr(torch.linalg, "eigh", counting)
    found = pf.kron.batched_eigh([A, B, A.clone()])
    assert stacked_sizes == [2]
    for matrix, (values, vectors) in zip([A, B, A], found):
        torch.testing.assert_close((vectors * values) @ vectors.T, matrix)
    inverses = pf.kron.factor_damped_power({"w": [A, A.clone()], "b": [A]}, 1e-3)
    torch.testing.assert_close(
        inverses["b"][0] @ (A + 1e-3 * torch.eye(4, dtype=A.dtype)), torch.eye(4, dtype=A.dtype)
    )


def test_eigh_that_fails_in_float32_is_redone_in_float64(monkeypatch):
    """LAPACK's float32 eigh can return NaN on large rank-deficient factors: never pass it on."""
    A = torch.randn(5, 2)
    A = A @ A.T
    eigh = torch.linalg.eigh

    def failing_in_float32(stack):
        values, vectors = eigh(stack)
        if stack.dtype == torch.float32:
            return values * float("nan"), vectors
        return values, vectors

    monkeypatch.setattr(torch.linalg, "eigh", failing_in_float32)
    [(values, vectors)] = pf.kron.batched_eigh([A])
    assert values.dtype == torch.float32 and values.isfinite().all()
    torch.testing.assert_close((vectors * values) @ vectors.T, A, atol=1e-5, rtol=1e-5)


def _documented_layout(weight: Tensor, groups: int) -> Tensor:
    """A transposed convolution's weight in its factors' layout, as the module doc says."""
    return weight.unflatten(0, (groups, -1)).transpose(1, 2).flatten(0, 1)


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("dims", [1, 2])
def test_transposed_conv_factors_are_in_the_documented_layout(dims, groups):
    """EKFAC's ``λ`` is ``diag(Qᵀ G Q)`` of the weight's dense GGN block in the factors'
    layout. The doc said ``weight.transpose(0, 1)`` for any ``groups``: with two groups
    that layout was 0.86 (1d) and 0.73 (2d) off; each group transposed alone is exact."""
    torch.manual_seed(0)
    conv = (torch.nn.ConvTranspose1d, torch.nn.ConvTranspose2d)[dims - 1]
    layer = conv(4, 6, 2, groups=groups)
    X = torch.randn(3, 4, *[2] * dims, dtype=torch.float64)
    model = torch.nn.Sequential(layer, torch.nn.Tanh(), torch.nn.Flatten())
    model.append(torch.nn.Linear(6 * 3**dims, 3)).double()
    y = torch.randint(0, 3, (3,))
    model_fn, params = pf.functional(model)
    found = pf.ekfac(model_fn, params, X, y, mc_samples=None)["0.weight"]
    weight, rest = params["0.weight"], {k: p for k, p in params.items() if k != "0.weight"}

    def output(w: Tensor) -> Tensor:
        return model_fn({"0.weight": w, **rest}, X)

    J = torch.autograd.functional.jacobian(output, weight).flatten(2)  # [N, 3, P]
    probs = torch.softmax(output(weight), dim=1)  # CrossEntropyLoss' Hessian, mean of 3
    H = (torch.diag_embed(probs) - probs[:, :, None] * probs[:, None, :]) / 3
    ggn = torch.einsum("nip,nij,njq->pq", J, H, J)
    order = _documented_layout(torch.arange(weight.numel()).reshape(weight.shape), groups)
    order = order.reshape(-1)
    Q = torch.kron(*found.eigenvectors)
    expected = torch.diagonal(Q.T @ ggn[order][:, order] @ Q)
    torch.testing.assert_close(found.eigenvalues.reshape(-1), expected)
    text = " ".join((kron.__doc__ or "").split())
    assert "weight.unflatten(0, (groups, -1)).transpose(1, 2).flatten(0, 1)" in text


def test_half_precision_factors_decompose_in_float32_and_keep_their_dtype():
    """A bfloat16 model's factors: ``eigh``, ``cholesky`` and ``slogdet`` have no bfloat16
    kernels, and ``pf.ekfac`` and ``kron.inverse``/``eigh``/``logdet`` raised torch's dtype
    error. They decompose in float32 and come back bfloat16, close to a float32 model's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    X, y = torch.randn(5, 6), torch.tensor([0, 1, 2, 3, 0])
    wide = pf.kflr(*pf.functional(model), X, y)
    model_fn, params = pf.functional(model.to(torch.bfloat16))
    half = pf.kflr(model_fn, params, X.to(torch.bfloat16), y)
    for name in wide:
        inverse = pf.kron.inverse(half, 1e-1)[name]
        expected = pf.kron.inverse(wide, 1e-1)[name]
        assert inverse.eigenvalues.dtype == torch.bfloat16
        torch.testing.assert_close(
            inverse.eigenvalues.float(), expected.eigenvalues, rtol=0.05, atol=0.05
        )
    logdets = pf.kron.logdet(half, damping=1e-1)
    for name, expected in pf.kron.logdet(wide, damping=1e-1).items():
        torch.testing.assert_close(logdets[name].float(), expected, rtol=0.05, atol=0.05)
    eigen = pf.ekfac(model_fn, params, X.to(torch.bfloat16), y, mc_samples=None)
    assert eigen["2.weight"].eigenvalues.dtype == torch.bfloat16


def test_a_transposed_convolutions_own_weight_layout_is_refused_by_matvec():
    """Its factors belong to the kernel with its channels swapped; the weight as stored,
    ``[C_in, C_out, k…]``, has their size and was multiplied silently in another layout
    (found by a probe). Refused, naming the layout; the swapped one is the dense product."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.ConvTranspose2d(2, 3, 2), torch.nn.Flatten(), torch.nn.Linear(3 * 16, 2)
    ).double()
    X, y = torch.randn(4, 2, 3, 3, dtype=torch.float64), torch.randint(0, 2, (4,))
    factors = pf.kflr(*pf.functional(model), X, y)
    weight = torch.randn(2, 3, 2, 2, dtype=torch.float64)  # as stored: [C_in, C_out, k, k]
    with pytest.raises(ValueError, match=r"weight.transpose\(0, 1\)"):
        kron.matvec({"0.weight": factors["0.weight"]}, {"0.weight": weight})
    swapped = weight.transpose(0, 1)
    found = kron.matvec({"0.weight": factors["0.weight"]}, {"0.weight": swapped})["0.weight"]
    expected = dense_kron(factors["0.weight"]) @ swapped.reshape(-1)
    torch.testing.assert_close(found.reshape(-1), expected)


def test_logdet_of_full_rank_float32_curvature_is_finite_beside_any_other_entry():
    """float32 KFLR and EKFAC of a ReLU MLP's first layer (full rank, eigenvalues down to
    5e-5 of the largest): the threshold for rounding was applied to the products of a whole
    pytree's eigenvalues, so ``-inf`` came back for the EKFAC entry, and for the factors as
    soon as the pytree held any :class:`Eigen` entry (a probe). Each entry is now taken alone:
    its float64 value, while the head's (singular: the softmax's Hessians share the null
    vector of ones) stays ``-inf``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(30, 20), nn.ReLU(), nn.Linear(20, 10))
    X, y = torch.randn(400, 30) * torch.logspace(0, -1.5, 30), torch.randint(0, 10, (400,))
    model_fn, params = pf.functional(model)
    factors = pf.kflr(model_fn, params, X, y)
    eigen = pf.ekfac(model_fn, params, X, y, mc_samples=None)
    wide_fn, wide = pf.functional(copy.deepcopy(model).double())
    wide_eigen = pf.ekfac(wide_fn, wide, X.double(), y, mc_samples=None)
    expected = torch.linalg.slogdet(kron.dense(factors["0.weight"]).double())[1]
    for curvature in (factors, {**factors, "other": eigen["2.bias"]}):
        found = kron.logdet(curvature)
        torch.testing.assert_close(found["0.weight"].double(), expected, rtol=1e-4, atol=0)
        assert found["2.weight"] == -math.inf
    found = kron.logdet(eigen)
    wide_sum = wide_eigen["0.weight"].eigenvalues.log().sum()
    torch.testing.assert_close(found["0.weight"].double(), wide_sum, rtol=1e-4, atol=0)
    assert found["2.weight"] == -math.inf and kron.logdet(wide_eigen)["2.weight"] == -math.inf


def test_logdet_of_eigh_of_full_rank_float32_factors_is_the_factors_logdet():
    """kron.eigh's eigenvalues are products of its factors' (each zeroed within its own
    rounding), not EKFAC's fitted ones: the fitted ones' threshold, ``(numel·eps)^1.5`` of
    the largest, zeroed genuine products (1e-6 of the largest for two 64x64 factors of
    condition 1e3) and ``-inf`` came back for a full-rank curvature (found by a probe)."""
    generator = torch.Generator().manual_seed(0)

    def factor(size: int) -> torch.Tensor:
        basis = torch.linalg.qr(torch.randn(size, size, generator=generator))[0]
        return (basis * torch.logspace(0, -3, size)) @ basis.T

    factors = {"w": [factor(64), factor(64)], "b": [factor(64)]}
    expected = {
        "w": torch.linalg.slogdet(torch.kron(*(f.double() for f in factors["w"])))[1],
        "b": torch.linalg.slogdet(factors["b"][0].double())[1],
    }
    for found in (kron.logdet(factors), kron.logdet(kron.eigh(factors))):
        for name in factors:
            torch.testing.assert_close(found[name].double(), expected[name], rtol=1e-5, atol=0)


def test_factors_holding_nan_are_refused_naming_the_sample_not_lapack() -> None:
    """A NaN in a sample's input made every factor NaN; eigendecomposing them (ekfac,
    kron.eigh, an inverse Cholesky refused) ended in LAPACK's convergence error."""
    torch.manual_seed(0)
    model_fn, params = pf.functional(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)))
    X, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
    X[1, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf.*batch_l2_grad"):
        pf.ekfac(model_fn, params, X, y)
    with pytest.raises(ValueError, match="NaN or inf"):
        pf.kron.eigh({"w": [torch.full((2, 2), float("nan")), torch.eye(3)]})
    with pytest.raises(ValueError, match="NaN or inf"):
        pf.kron.inverse(pf.kfac(model_fn, params, X, y), damping=1e-3)


def test_equal_factors_of_other_functions_keep_their_own_gradients() -> None:
    """An identity-initialized layer's KFLR input factor equals the next layer's in value;
    the two shared one decomposition, so ``logdet``'s gradient of the second went into the
    first's graph (99 % of a weight's gradient lost; a probe). Each its own where a
    gradient reaches them; a Laplace evidence differentiates them so."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3, bias=False), nn.Linear(3, 2, bias=False)).double()
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(3))
    model_fn, params = pf.functional(model)
    params = {k: p.detach().requires_grad_() for k, p in params.items()}
    X, y = torch.randn(6, 3, dtype=torch.float64), torch.randint(0, 2, (6,))
    factors = pf.kflr(model_fn, params, X, y)
    assert torch.equal(factors["0.weight"][1], factors["1.weight"][1])
    together = sum(kron.logdet(factors, damping=0.1).values())
    (found,) = torch.autograd.grad(together, [params["0.weight"]])
    factors = pf.kflr(model_fn, params, X, y)
    apart = sum(kron.logdet({k: v}, damping=0.1)[k] for k, v in factors.items())
    (expected,) = torch.autograd.grad(apart, [params["0.weight"]])
    torch.testing.assert_close(found, expected)
