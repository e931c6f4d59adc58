"""The decompositions the modes run in place of ops whose batching rules are wrong."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from tests.cases import assert_trees_close, autograd_batch_grad
from torch.nn.utils import parametrizations

import packfunc as pf
from packfunc.engine import decompositions
from packfunc.engine.decompositions import linalg_solve, run_decomposed, weight_norm


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


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [0, 1, 2, -1, -2, -3])
def test_weight_norm_decomposed_is_torchs(dim, dtype):
    """``dim=-1`` is the norm of the whole tensor (not of the last dim), as torch's."""
    torch.manual_seed(0)
    v = torch.randn(4, 3, 2).to(dtype)
    g = (1.5 * torch.norm_except_dim(v.double(), 2, dim)).to(dtype)
    found = run_decomposed(torch._weight_norm, (v, g, dim), {})
    expected = torch._weight_norm(v, g, dim)
    assert found.dtype == expected.dtype
    torch.testing.assert_close(found, expected, rtol=1e-6, atol=1e-14)
    flat = g.reshape(-1) if dim in (0, 2) else g  # the fused kernel reads g flat
    torch.testing.assert_close(weight_norm(v, flat, dim), torch._weight_norm(v, flat, dim))


def test_weight_norm_leaves_calls_torch_refuses_to_torch():
    v = torch.randn(4, 3, dtype=torch.float64)
    assert weight_norm(v, torch.rand(4, 1), 0) is NotImplemented  # mixed dtypes
    assert weight_norm(v, torch.rand(5, dtype=torch.float64), 0) is NotImplemented
    assert weight_norm(v, torch.rand(1, dtype=torch.float64), 2) is NotImplemented
    with pytest.raises(IndexError):
        run_decomposed(torch._weight_norm, (v, torch.rand(1, dtype=torch.float64), 2), {})
    with pytest.raises(TypeError, match="must be int"):
        run_decomposed(torch._weight_norm, (v, torch.rand(1, dtype=torch.float64), None), {})
    keywords = {"v": v, "g": torch.rand(3, dtype=torch.float64), "dim": 1}
    torch.testing.assert_close(
        run_decomposed(torch._weight_norm, (), keywords), torch._weight_norm(**keywords)
    )


def _weight_normed(kind: str, style: str, dim: int | None) -> tuple[torch.nn.Module, torch.Tensor]:
    """A weight-normed Linear or Conv2d, then tanh and a Linear; and its inputs (3 samples)."""
    first = torch.nn.Linear(3, 4) if kind == "linear" else torch.nn.Conv2d(2, 4, 2)
    with warnings.catch_warnings():  # the old weight_norm is deprecated
        warnings.simplefilter("ignore", FutureWarning)
        if style == "parametrization":
            parametrizations.weight_norm(first, dim=dim)
        else:
            torch.nn.utils.weight_norm(first, dim=dim)
    model = torch.nn.Sequential(first, torch.nn.Tanh(), torch.nn.Flatten(), torch.nn.Linear(4, 3))
    X = torch.randn(3, 3) if kind == "linear" else torch.randn(3, 2, 2, 2)
    return model.double(), X.double()


def _by_hand(kind: str, names: tuple[str, str], dim: int | None, p: dict, X: torch.Tensor):
    """The model of :func:`_weight_normed` written out: weight ``g · v / ‖v‖``."""
    g, v = p[names[0]], p[names[1]]
    over = [d for d in range(v.dim()) if d != dim]
    w = g * v / v.pow(2).sum(dim=over, keepdim=True).sqrt()
    h = F.linear(X, w, p["0.bias"]) if kind == "linear" else F.conv2d(X, w, p["0.bias"])
    return F.linear(torch.tanh(h).flatten(1), p["3.weight"], p["3.bias"])


@pytest.mark.parametrize("dim", [0, None])
@pytest.mark.parametrize("style", ["parametrization", "old"])
@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_weight_norm_second_order_is_the_dense_hessians(kind, style, dim):
    """torch's fused ``_weight_norm`` has a wrong double backward (``diag_hessian`` of ``v``
    0.46 off) and no forward-mode rule (``ggn_vector_product`` raised); decomposed, every
    quantity is the one of the model written out, by dense autograd Hessians."""
    torch.manual_seed(0)
    model, X = _weight_normed(kind, style, dim)
    y, loss = torch.randint(0, 3, (3,)), torch.nn.CrossEntropyLoss()
    model_fn, params = pf.functional(model)
    new = style == "parametrization"
    names = ("0.parametrizations.weight.original0", "0.parametrizations.weight.original1")
    names = names if new else ("0.weight_g", "0.weight_v")
    keys, shapes = list(params), [p.shape for p in params.values()]
    sizes = [p.numel() for p in params.values()]

    def unflat(t):
        return {k: s.reshape(shape) for k, s, shape in zip(keys, t.split(sizes), shapes)}

    def out(t):
        return _by_hand(kind, names, dim, unflat(t), X)

    theta = torch.cat([p.detach().reshape(-1) for p in params.values()])
    H = torch.autograd.functional.hessian(lambda t: loss(out(t), y), theta)
    J = torch.autograd.functional.jacobian(out, theta).reshape(9, -1)
    output = out(theta).detach()
    H_out = torch.autograd.functional.hessian(lambda o: loss(o, y), output).reshape(9, 9)
    G = J.T @ H_out @ J
    t = torch.randn_like(theta)
    per_sample = torch.autograd.functional.jacobian(
        lambda t: F.cross_entropy(out(t), y, reduction="none") / 3, theta
    )
    found = {
        "diag_hessian": pf.diag_hessian(model_fn, params, X, y, loss=loss),
        "hvp": pf.hessian_vector_product(model_fn, params, X, y, unflat(t), loss=loss),
        "ggnvp": pf.ggn_vector_product(model_fn, params, X, y, unflat(t), loss=loss),
        "diag_ggn": pf.diag_ggn(model_fn, params, X, y, loss=loss),
    }
    expected = {
        "diag_hessian": unflat(H.diagonal()),
        "hvp": unflat(H @ t),
        "ggnvp": unflat(G @ t),
        "diag_ggn": unflat(G.diagonal()),
    }
    assert_trees_close(found, expected)
    batch = pf.batch_grad(model_fn, params, X, y, loss=loss)
    torch.testing.assert_close(torch.cat([batch[k].reshape(3, -1) for k in keys], 1), per_sample)


def test_kfac_refuses_weight_normed_layers_by_name():
    """A normed weight is no parameter of the layer: no Kronecker factors, said by name."""
    model, X = _weight_normed("conv", "parametrization", 0)
    model_fn, params = pf.functional(model)
    with pytest.raises(ValueError, match="original1: used by conv2d"):
        pf.kfac(model_fn, params, X, torch.randint(0, 3, (3,)))


@pytest.mark.parametrize("style", ["parametrization", "old"])
def test_weight_norm_gradient_through_first_order_results_is_the_double_backwards(style):
    """A gradient through ``batch_l2_grad`` differentiates the batch pass twice: through
    torch's fused ``_weight_norm`` every entry of ``v``'s was off (by up to 23 times)."""
    torch.manual_seed(0)
    model, X = _weight_normed("linear", style, 0)
    y, loss = torch.randint(0, 3, (3,)), torch.nn.CrossEntropyLoss(reduction="sum")
    model_fn, params = pf.functional(model)
    names = ("0.parametrizations.weight.original0", "0.parametrizations.weight.original1")
    names = names if style == "parametrization" else ("0.weight_g", "0.weight_v")

    def squared_norms(p: dict) -> torch.Tensor:
        """``Σ_n ‖∇ℓ_n‖²`` of the model written out, by an autograd loop over samples."""
        total = torch.zeros((), dtype=torch.float64)
        for n in range(3):
            value = loss(_by_hand("linear", names, 0, p, X[n : n + 1]), y[n : n + 1])
            found = torch.autograd.grad(value, list(p.values()), create_graph=True)
            total = total + sum(g.square().sum() for g in found)
        return total

    live = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
    expected = dict(zip(live, torch.autograd.grad(squared_norms(live), list(live.values()))))

    def summed_l2(p: dict) -> torch.Tensor:
        found = pf.batch_l2_grad(model_fn, p, X, y, loss=loss)
        return sum(v.sum() for v in found.values())

    assert_trees_close(torch.func.grad(summed_l2)(params), expected)


def _bag_options():
    """Every reduction, with and without a padding index, weights and each input layout."""
    for mode in ("sum", "mean", "max"):
        for padding_idx in (None, 2, -1):
            for layout in ("fixed", "offsets", "last offset"):
                for weighted in (False, True) if mode == "sum" else (False,):
                    yield mode, padding_idx, layout, weighted


@pytest.mark.parametrize("mode, padding_idx, layout, weighted", list(_bag_options()))
def test_embedding_bag_decomposed_is_torchs_with_its_gradient(mode, padding_idx, layout, weighted):
    """Values and weight gradients of the gather-and-reduce form equal torch's kernel; its
    forward-mode derivative (which torch's kernel lacks) equals central differences."""
    torch.manual_seed(0)
    table = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    if layout == "fixed":
        index, offsets = torch.randint(0, 7, (4, 3)), None
        index[1] = 2  # a bag of padding only: zeros
    else:
        index = torch.tensor([2, 5, 2, 2, 0, 6, 1, 2, 4])
        offsets = torch.tensor([0, 2, 2, 5] + ([9] if layout == "last offset" else []))
    weights = torch.rand(index.shape, dtype=torch.float64) if weighted else None
    options = dict(mode=mode, per_sample_weights=weights, padding_idx=padding_idx)
    options["include_last_offset"] = layout == "last offset"

    def torchs(w):
        return F.embedding_bag(index, w, offsets, **options)

    def decomposed(w):
        return decompositions.bag_reduction(
            index, w, offsets, mode, weights, layout == "last offset", padding_idx
        )

    cotangent = torch.randn_like(torchs(table))
    expected = torch.autograd.grad((torchs(table) * cotangent).sum(), table)[0]
    found = torch.autograd.grad((decomposed(table) * cotangent).sum(), table)[0]
    torch.testing.assert_close(decomposed(table), torchs(table))
    torch.testing.assert_close(found, expected)
    tangent, eps = torch.randn_like(table), 1e-6
    with torch.no_grad():
        central = (torchs(table + eps * tangent) - torchs(table - eps * tangent)) / (2 * eps)
    forward = torch.func.jvp(decomposed, (table.detach(),), (tangent,))[1]
    torch.testing.assert_close(forward, central)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_embedding_bag_products_and_hessians_are_the_dense_ones(mode):
    """torch's ``embedding_bag`` has no forward-mode formula and no second derivative: GGN
    and Hessian products raised torch's errors and the Hessian diagonals were refused. They
    are the dense float64 GGN's and Hessian's of the same model, written with ``nn.Embedding``."""
    torch.manual_seed(0)
    bag = torch.nn.EmbeddingBag(7, 3, mode=mode, padding_idx=2).double()
    head = torch.nn.Linear(3, 2).double()
    X, y = torch.randint(0, 7, (4, 5)), torch.tensor([0, 1, 0, 1])
    X[1] = 2  # a bag of padding only
    model_fn, params = pf.functional(torch.nn.Sequential(bag, torch.nn.Tanh(), head))

    def written_out(table):
        rows, kept = F.embedding(X, table), (X != 2)[..., None]
        if mode == "max":
            pooled = torch.where(kept, rows, -torch.inf).amax(1).clamp(min=-1e300)
            pooled = torch.where(kept.any(1), pooled, 0.0)
        else:
            pooled = (rows * kept).sum(1)
            pooled = pooled / kept.sum(1).clamp(min=1) if mode == "mean" else pooled
        return head(torch.tanh(pooled))

    table = params["0.weight"].detach()
    loss = torch.nn.CrossEntropyLoss()
    H = torch.autograd.functional.hessian(lambda t: loss(written_out(t), y), table).reshape(21, 21)
    J = torch.autograd.functional.jacobian(written_out, table).reshape(8, 21)
    output = written_out(table).detach()
    H_out = torch.autograd.functional.hessian(lambda o: loss(o, y), output).reshape(8, 8)
    G = J.T @ H_out @ J
    v = {k: torch.randn_like(p) for k, p in params.items()}
    only_table = {k: p if k == "0.weight" else torch.zeros_like(p) for k, p in v.items()}
    ggnvp = pf.ggn_vector_product(model_fn, params, X, y, only_table)["0.weight"]
    hvp = pf.hessian_vector_product(model_fn, params, X, y, only_table)["0.weight"]
    mats = {k: p[None] if k == "0.weight" else None for k, p in v.items()}
    blocks = pf.ggn_block_products(model_fn, params, X, y, mats)
    vector = v["0.weight"].reshape(-1)
    torch.testing.assert_close(ggnvp.reshape(-1), G @ vector)
    torch.testing.assert_close(blocks["0.weight"][0].reshape(-1), G @ vector)
    torch.testing.assert_close(hvp.reshape(-1), H @ vector)
    diagonal = pf.diag_hessian(model_fn, params, X, y)["0.weight"]
    torch.testing.assert_close(diagonal.reshape(-1), H.diagonal())


def test_hardsigmoid_decomposed_is_torchs_and_its_hessians_are_the_dense_ones():
    """torch's ``hardsigmoid_backward`` has no derivative: a Hessian through a
    squeeze-and-excitation gate (MobileNetV3) raised torch's error. Under transforms it runs
    as ``where``: torch's values and gradient (zero at ±3, as torch), and dense Hessians."""
    x = torch.tensor([-4.0, -3.0, -1.0, 0.0, 2.5, 3.0, 5.0], dtype=torch.float64)
    found = torch.func.grad(lambda t: decompositions.hardsigmoid(t).square().sum())(x)
    live = x.clone().requires_grad_()
    expected = torch.autograd.grad(F.hardsigmoid(live).square().sum(), live)[0]
    torch.testing.assert_close(found, expected)
    torch.manual_seed(0)
    gate, head = torch.nn.Linear(3, 3).double(), torch.nn.Linear(3, 2).double()
    model_fn, params = pf.functional(torch.nn.ModuleDict({"gate": gate, "head": head}))

    def forward(p, X):
        return torch.func.functional_call(
            head,
            {"weight": p["head.weight"], "bias": p["head.bias"]},
            (X * F.hardsigmoid(F.linear(X, p["gate.weight"], p["gate.bias"])),),
        )

    X, y = torch.randn(4, 3, dtype=torch.float64) * 3, torch.tensor([0, 1, 1, 0])

    def written_out(w):  # the definition: x/6 + 1/2 strictly inside (-3, 3), else 0 or 1
        z = F.linear(X, w, params["gate.bias"])
        gated = torch.where((z > -3) & (z < 3), z / 6 + 0.5, (z >= 3).to(z.dtype))
        torch.testing.assert_close(gated, F.hardsigmoid(z))
        return F.cross_entropy(head(X * gated), y)

    H = torch.autograd.functional.hessian(written_out, params["gate.weight"]).reshape(9, 9)
    diagonal = pf.diag_hessian(forward, params, X, y)["gate.weight"]
    torch.testing.assert_close(diagonal.reshape(-1), H.diagonal())
