"""EKFAC: eigenvalues against the dense (sampled) GGN in the Kronecker eigenbasis."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from torch.autograd.functional import hessian, jacobian

import packfunc as pf
from packfunc.eigen_kfac import ekfac_and_factors
from packfunc.engine import memory
from packfunc.losses import hessian_factors
from tests.cases import Case, make_problem

SEQUENCE = Case(  # a linear layer over 3 positions per sample: column gradients in chunks
    "sequence_linear",
    lambda: nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Flatten(), nn.Linear(12, 2)),
    lambda n: torch.randn(n, 3, 3),
)

CASES = [
    SEQUENCE,
    "mlp",
    "conv1d",
    "conv2d",
    "convtranspose1d",
    "convtranspose2d",
    "shared_layer",
    "spatial_output",
]


def kronecker_order(model: nn.Module, name: str, shape: torch.Size) -> Tensor:
    """Indices putting ``param.flatten()`` into the Kronecker layout of its factors.

    A transposed convolution's weight ``[C_in, C_out/G, k…]`` is laid out per group as
    ``[C_out/G, C_in/G, k…]`` (``weight.transpose(0, 1)`` for one group); others as they are.
    """
    index = torch.arange(shape.numel()).reshape(shape)
    module = model.get_submodule(name.rpartition(".")[0])
    if isinstance(module, nn.modules.conv._ConvTransposeNd) and name.endswith("weight"):
        groups = module.groups
        index = index.reshape(groups, shape[0] // groups, *shape[1:]).transpose(1, 2)
    return index.reshape(-1)


def blocks(dense_matrix: Tensor, model: nn.Module) -> dict[str, Tensor]:
    """Each parameter's diagonal block of a dense matrix, in its Kronecker layout."""
    found, start = {}, 0
    for name, p in model.named_parameters():
        order = kronecker_order(model, name, p.shape) + start
        found[name] = dense_matrix[order][:, order]
        start += p.numel()
    return found


def diagonal_in_basis(block: Tensor, eigen: pf.kron.Eigen) -> Tensor:
    """``diag(Qᵀ M Q)`` with ``Q = Q_A ⊗ Q_B``, shaped like the eigenvalues."""
    Q = eigen.eigenvectors[0]
    if len(eigen.eigenvectors) == 2:
        Q = torch.kron(Q, eigen.eigenvectors[1])
    return (Q.T @ block @ Q).diagonal().reshape(eigen.eigenvalues.shape)


@pytest.mark.parametrize(
    ("name", "reduction"),
    [(name, "mean") for name in CASES] + [("conv2d", "sum")],
    ids=lambda v: getattr(v, "name", v),
)
def test_exact_eigenvalues_are_the_ggn_diagonal_in_the_kflr_eigenbasis(name, reduction):
    problem = make_problem(name, reduction=reduction)
    model_fn, params = problem.functional()
    found = pf.ekfac(model_fn, params, problem.X, problem.y, loss=problem.loss, mc_samples=None)
    factors = pf.kflr(model_fn, params, problem.X, problem.y, loss=problem.loss)
    for key, block in blocks(dense_ggn(problem), problem.model).items():
        eigen = found[key]
        expected = diagonal_in_basis(block, eigen)
        torch.testing.assert_close(eigen.eigenvalues, expected, msg=key)
        for Q, factor in zip(eigen.eigenvectors, factors[key]):  # the KFLR factors' eigenbasis
            rotated = Q.T @ factor @ Q
            torch.testing.assert_close(rotated, torch.diag(rotated.diagonal()), msg=key)


def test_mse_loss_and_chunked_columns_and_samples(monkeypatch):
    """One column and one sample at a time (tiny memory budget) changes nothing."""
    problem = make_problem("conv1d", loss_name="mse", reduction="sum", n=4)
    model_fn, params = problem.functional()
    monkeypatch.setattr(memory, "DEFAULT_BUDGET", 1)
    found = pf.ekfac(model_fn, params, problem.X, problem.y, loss=problem.loss, mc_samples=None)
    for key, block in blocks(dense_ggn(problem), problem.model).items():
        torch.testing.assert_close(found[key].eigenvalues, diagonal_in_basis(block, found[key]))


def output_jacobian(problem) -> tuple[Tensor, Tensor]:
    """The batch output and its dense Jacobian w.r.t. all parameters, ``[N, O, P]``."""
    flat = torch.cat([p.detach().reshape(-1) for p in problem.model.parameters()])
    names = [name for name, _ in problem.model.named_parameters()]
    shapes = [p.shape for p in problem.model.parameters()]

    def output(vector: Tensor) -> Tensor:
        parts = vector.split([s.numel() for s in shapes])
        tree = {n: t.view(s) for n, t, s in zip(names, parts, shapes)}
        return torch.func.functional_call(problem.model, tree, (problem.X,))

    with torch.no_grad():
        out = output(flat)
    return out, jacobian(output, flat, vectorize=True).reshape(out.shape[0], -1, flat.numel())


def dense_ggn(problem) -> Tensor:
    """``Σ_n J_nᵀ (∂²L/∂f_n²) J_n`` from autograd's dense Jacobian and loss Hessian."""
    out, J = output_jacobian(problem)
    n = out.shape[0]
    H = hessian(lambda o: problem.loss(o, problem.y), out).reshape(n, J.shape[1], n, -1)
    return sum(J[i].T @ H[i, :, i] @ J[i] for i in range(n))


def sampled_second_moment(problem, mc_samples: int, seed: int) -> Tensor:
    """``Σ_{k,n} vec G_kn vec G_knᵀ`` from a dense Jacobian and the sampled square-root columns."""
    out, J = output_jacobian(problem)
    generator = torch.Generator().manual_seed(seed)
    roots = hessian_factors(
        problem.loss, out, problem.y, mc_samples=mc_samples, generator=generator
    )
    columns = torch.einsum("kno,nop->knp", roots.all().flatten(2), J).reshape(-1, J.shape[-1])
    return columns.T @ columns


@pytest.mark.parametrize("name", ["mlp", "conv2d"])
def test_monte_carlo_eigenvalues_fit_the_same_samples_as_the_kfac_basis(name):
    problem = make_problem(name, n=4)
    model_fn, params = problem.functional()
    X, y, loss = problem.X, problem.y, problem.loss
    found = pf.ekfac(
        model_fn, params, X, y, loss=loss, mc_samples=3, generator=torch.Generator().manual_seed(5)
    )
    factors = pf.kfac(
        model_fn, params, X, y, loss=loss, mc_samples=3, generator=torch.Generator().manual_seed(5)
    )
    moment = sampled_second_moment(problem, mc_samples=3, seed=5)
    for key, block in blocks(moment, problem.model).items():
        eigen = found[key]
        torch.testing.assert_close(eigen.eigenvalues, diagonal_in_basis(block, eigen), msg=key)
        for Q, factor in zip(eigen.eigenvectors, factors[key]):
            rotated = Q.T @ factor @ Q
            torch.testing.assert_close(rotated, torch.diag(rotated.diagonal()), msg=key)


def test_given_identity_bases_give_the_ggn_diagonal():
    problem = make_problem("conv2d")
    model_fn, params = problem.functional()
    identity = {
        key: pf.kron.Eigen(
            [torch.eye(p.shape[0], dtype=p.dtype)]
            + ([torch.eye(p[0].numel(), dtype=p.dtype)] if p.dim() > 1 else []),
            torch.zeros(()),
        )
        for key, p in params.items()
    }
    found = pf.ekfac(
        model_fn,
        params,
        problem.X,
        problem.y,
        loss=problem.loss,
        mc_samples=None,
        eigenvectors=identity,
    )
    diagonal = dense_ggn(problem).diagonal()
    start = 0
    for key, p in params.items():
        expected = diagonal[start : start + p.numel()].reshape(found[key].eigenvalues.shape)
        torch.testing.assert_close(found[key].eigenvalues, expected, msg=key)
        start += p.numel()


def test_result_is_a_pytree_usable_by_the_algebra():
    problem = make_problem("mlp")
    model_fn, params = problem.functional()
    found = pf.ekfac(model_fn, params, problem.X, problem.y, loss=problem.loss, mc_samples=None)
    assert all(isinstance(t, Tensor) for t in __import__("optree").tree_leaves(found))
    dense = pf.kron.dense(found)
    for key, block in blocks(dense_ggn(problem), problem.model).items():  # same diagonal
        Q = pf.kron.dense(pf.kron.Eigen(found[key].eigenvectors, torch.ones_like(found[key][1])))
        torch.testing.assert_close(Q, torch.eye(Q.shape[0], dtype=Q.dtype))
        torch.testing.assert_close(dense[key].trace(), block.trace())


def test_unsupported_parameters_raise_or_are_skipped():
    problem = make_problem("custom_module")  # a raw scale: no Kronecker rule
    model_fn, params = problem.functional()
    args = (model_fn, params, problem.X, problem.y)
    with pytest.raises(ValueError, match="on_unsupported='skip'"):
        pf.ekfac(*args, loss=problem.loss)
    found = pf.ekfac(*args, loss=problem.loss, on_unsupported="skip")
    assert any(v is None for v in found.values())
    assert any(isinstance(v, pf.kron.Eigen) for v in found.values())


def test_bad_arguments_are_refused():
    problem = make_problem("mlp")
    model_fn, params = problem.functional()
    args = (model_fn, params, problem.X, problem.y)
    with pytest.raises(ValueError, match="kfac_approx"):
        pf.ekfac(*args, kfac_approx="mean")
    wrong = {key: pf.kron.Eigen([torch.eye(2)], torch.ones(2)) for key in params}
    with pytest.raises(ValueError, match="do not match"):
        pf.ekfac(*args, eigenvectors=wrong)
    with pytest.raises(ValueError, match="Eigen"):
        pf.ekfac(*args, eigenvectors={key: torch.eye(2) for key in params})


def test_ekfac_and_factors_fit_the_eigenvalues_in_the_combined_basis():
    """The basis comes from combine(factors); the eigenvalues are fitted as with eigenvectors=."""
    problem = make_problem("mlp", n=5)
    model_fn, params = problem.functional()
    other = pf.kflr(model_fn, params, problem.X[:3], problem.y[:3], loss=problem.loss)

    def combine(new):
        return {k: [0.5 * a + 0.5 * b for a, b in zip(other[k], new[k])] for k in new}

    factors, fitted = ekfac_and_factors(
        model_fn, params, problem.X, problem.y, combine, loss=problem.loss, mc_samples=None
    )
    batch = pf.kflr(model_fn, params, problem.X, problem.y, loss=problem.loss)
    expected_factors = combine(batch)
    expected = pf.ekfac(
        model_fn,
        params,
        problem.X,
        problem.y,
        loss=problem.loss,
        mc_samples=None,
        eigenvectors=pf.kron.eigh(expected_factors),
    )
    for key in params:
        for a, b in zip(factors[key], expected_factors[key]):
            torch.testing.assert_close(a, b)
        torch.testing.assert_close(fitted[key].eigenvalues, expected[key].eigenvalues)


def test_given_eigenvectors_in_the_other_order_are_refused():
    """``eigenvectors=`` of a linear weight ``[out, in]`` as ``[Q_in, Q_out]``: the total
    size matches, so a sequence input's gradients were reshaped (not transposed) into them
    and eigenvalues of another matrix came back (a probe); refused naming the layout."""
    torch.manual_seed(0)
    model_fn, params = pf.functional(torch.nn.Linear(3, 4))
    X, y = torch.randn(5, 2, 3), torch.randint(0, 4, (5, 2))
    loss = torch.nn.CrossEntropyLoss()
    model = lambda p, x: model_fn(p, x).movedim(-1, 1)  # noqa: E731 - classes second
    good = pf.ekfac(model, params, X, y, loss=loss, mc_samples=None)
    swapped = {
        "weight": pf.kron.Eigen(good["weight"].eigenvectors[::-1], good["weight"].eigenvalues.T),
        "bias": good["bias"],
    }
    again = pf.ekfac(model, params, X, y, loss=loss, mc_samples=None, eigenvectors=good)
    torch.testing.assert_close(again["weight"].eigenvalues, good["weight"].eigenvalues)
    with pytest.raises(ValueError, match=r"have sizes \[3, 4\], but its Kronecker factors"):
        pf.ekfac(model, params, X, y, loss=loss, mc_samples=None, eigenvectors=swapped)
