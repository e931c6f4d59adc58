"""``packfunc.compat.hessianfree`` and ``packfunc.compat.utils`` against dense references.

Every product is checked against (a) a dense matrix built with
``torch.autograd.functional`` from a flat parameter vector and (b) BackPACK's function
of the same name applied to the same autograd graph.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor, nn
from torch.autograd.functional import hessian, jacobian
from torch.func import functional_call

from packfunc.compat.hessianfree.ggnvp import ggn_vector_product, ggn_vector_product_from_plist
from packfunc.compat.hessianfree.hvp import hessian_vector_product
from packfunc.compat.hessianfree.lop import L_op, transposed_jacobian_vector_product
from packfunc.compat.hessianfree.rop import R_op, jacobian_vector_product
from packfunc.compat.utils.convert_parameters import (
    parameters_to_vector,
    vector_to_parameter_list,
)

TOL = {"rtol": 1e-9, "atol": 1e-11}
N, D_IN, D_HID, C = 5, 3, 4, 2

LOSSES = {
    "ce_mean": lambda: nn.CrossEntropyLoss(),
    "ce_sum": lambda: nn.CrossEntropyLoss(reduction="sum"),
    "mse": lambda: nn.MSELoss(),
}


def _backpack(module: str):
    """Import ``backpack.<module>`` (tests calling this use the ``backpack_oracle`` fixture)."""
    return importlib.import_module(f"backpack.{module}")


@dataclass
class Problem:
    model: nn.Module
    params: list[Tensor]
    X: Tensor
    y: Tensor
    lossfunc: nn.Module
    output: Tensor
    loss: Tensor

    # ---- dense references, from a flat parameter vector (independent of the shim) ----
    def unflatten(self, theta: Tensor) -> list[Tensor]:
        sizes = [p.numel() for p in self.params]
        return [t.reshape(p.shape) for t, p in zip(torch.split(theta, sizes), self.params)]

    def theta(self) -> Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    def out_of_theta(self, theta: Tensor) -> Tensor:
        names = [name for name, _ in self.model.named_parameters()]
        return functional_call(self.model, dict(zip(names, self.unflatten(theta))), (self.X,))

    def loss_of_theta(self, theta: Tensor) -> Tensor:
        return self.lossfunc(self.out_of_theta(theta), self.y)

    def jac(self) -> Tensor:
        """Jacobian of the flattened output w.r.t. theta, ``[N*C, P]``."""
        return jacobian(self.out_of_theta, self.theta()).reshape(N * C, -1)

    def loss_hessian_wrt_output(self) -> Tensor:
        out = self.output.detach().reshape(-1)
        return hessian(lambda o: self.lossfunc(o.reshape(N, C), self.y), out)

    def hess(self) -> Tensor:
        return hessian(self.loss_of_theta, self.theta())

    def ggn(self) -> Tensor:
        J = self.jac()
        return J.T @ self.loss_hessian_wrt_output() @ J

    def grad(self) -> Tensor:
        return jacobian(self.loss_of_theta, self.theta())


def make_problem(loss_name: str, seed: int = 0) -> Problem:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(D_IN, D_HID), nn.Tanh(), nn.Linear(D_HID, C)).double()
    X = torch.randn(N, D_IN, dtype=torch.float64)
    if loss_name.startswith("ce"):
        y = torch.randint(0, C, (N,))
    else:
        y = torch.randn(N, C, dtype=torch.float64)
    lossfunc = LOSSES[loss_name]()
    output = model(X)
    loss = lossfunc(output, y)
    return Problem(model, list(model.parameters()), X, y, lossfunc, output, loss)


def flat(tensors) -> Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def assert_tuple_like(result, like) -> None:
    """``result`` is a tuple of detached tensors shaped like ``like``."""
    assert isinstance(result, tuple)
    assert len(result) == len(like)
    for r, t in zip(result, like):
        assert r.shape == t.shape
        assert r.dtype == t.dtype
        assert not r.requires_grad


@pytest.fixture(params=sorted(LOSSES))
def problem(request) -> Problem:
    return make_problem(request.param)


def rand_like_params(problem: Problem, seed: int = 1) -> tuple[Tensor, list[Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    v_flat = torch.randn(problem.theta().numel(), dtype=torch.float64, generator=gen)
    return v_flat, problem.unflatten(v_flat)


# --------------------------------------------------------------------------- dense checks


@pytest.mark.parametrize("fn", [R_op, jacobian_vector_product])
def test_jvp_matches_dense_jacobian(problem: Problem, fn) -> None:
    v_flat, v = rand_like_params(problem)
    (jv,) = fn(problem.output, problem.params, v)
    assert jv.shape == problem.output.shape and not jv.requires_grad
    torch.testing.assert_close(jv.reshape(-1), problem.jac() @ v_flat, **TOL)


def test_jvp_tuple_outputs(problem: Problem) -> None:
    v_flat, v = rand_like_params(problem)
    jv_out, jv_loss = R_op((problem.output, problem.loss), tuple(problem.params), tuple(v))
    assert_tuple_like((jv_out, jv_loss), (problem.output, problem.loss))
    torch.testing.assert_close(jv_out.reshape(-1), problem.jac() @ v_flat, **TOL)
    torch.testing.assert_close(jv_loss, problem.grad() @ v_flat, **TOL)


def test_jvp_list_outputs(problem: Problem) -> None:
    # BackPACK only accepts a tuple here; lists are accepted too.
    v_flat, v = rand_like_params(problem)
    jv_out, jv_loss = R_op([problem.output, problem.loss], problem.params, v)
    torch.testing.assert_close(jv_loss, problem.grad() @ v_flat, **TOL)
    torch.testing.assert_close(jv_out.reshape(-1), problem.jac() @ v_flat, **TOL)


def test_jvp_single_tensor_input(problem: Problem) -> None:
    weight = problem.params[0]
    v_w = torch.randn_like(weight)
    v_flat = flat([v_w] + [torch.zeros_like(p) for p in problem.params[1:]])
    result = R_op(problem.output, weight, v_w)
    assert_tuple_like(result, (problem.output,))
    torch.testing.assert_close(result[0].reshape(-1), problem.jac() @ v_flat, **TOL)


@pytest.mark.parametrize("fn", [L_op, transposed_jacobian_vector_product])
def test_vjp_matches_dense_jacobian(problem: Problem, fn) -> None:
    w = torch.randn_like(problem.output)
    result = fn(problem.output, problem.params, w)
    assert_tuple_like(result, problem.params)
    torch.testing.assert_close(flat(result), problem.jac().T @ w.reshape(-1), **TOL)


def test_vjp_single_tensor_input_and_tuple_outputs(problem: Problem) -> None:
    bias = problem.params[-1]
    w_out, w_loss = torch.randn_like(problem.output), torch.tensor(0.7, dtype=torch.float64)
    result = L_op((problem.output, problem.loss), bias, (w_out, w_loss))
    assert_tuple_like(result, (bias,))
    full = problem.jac().T @ w_out.reshape(-1) + w_loss * problem.grad()
    torch.testing.assert_close(result[0], full[-bias.numel() :], **TOL)


def test_hvp_matches_dense_hessian(problem: Problem) -> None:
    v_flat, v = rand_like_params(problem)
    result = hessian_vector_product(problem.loss, problem.params, v)
    assert_tuple_like(result, problem.params)
    torch.testing.assert_close(flat(result), problem.hess() @ v_flat, **TOL)


def test_hvp_with_precomputed_gradient(problem: Problem) -> None:
    v_flat, v = rand_like_params(problem)
    grads = torch.autograd.grad(problem.loss, problem.params, create_graph=True)
    result = hessian_vector_product(problem.loss, problem.params, v, grad_params=list(grads))
    assert_tuple_like(result, problem.params)
    torch.testing.assert_close(flat(result), problem.hess() @ v_flat, **TOL)


def test_hvp_single_tensor(problem: Problem) -> None:
    weight = problem.params[0]
    k = weight.numel()
    v_w = torch.randn_like(weight)
    expected = problem.hess()[:k, :k] @ v_w.reshape(-1)
    result = hessian_vector_product(problem.loss, weight, v_w)
    assert_tuple_like(result, (weight,))
    torch.testing.assert_close(result[0].reshape(-1), expected, **TOL)
    # a single-tensor ``grad_params`` is one gradient, not a sequence of rows
    (g,) = torch.autograd.grad(problem.loss, weight, create_graph=True)
    again = hessian_vector_product(problem.loss, weight, v_w, grad_params=g)
    assert_tuple_like(again, (weight,))
    torch.testing.assert_close(again[0].reshape(-1), expected, **TOL)


def test_ggnvp_matches_dense_ggn(problem: Problem) -> None:
    v_flat, v = rand_like_params(problem)
    expected = problem.ggn() @ v_flat
    from_model = ggn_vector_product(problem.loss, problem.output, problem.model, v)
    from_plist = ggn_vector_product_from_plist(problem.loss, problem.output, problem.params, v)
    for result in (from_model, from_plist):
        assert_tuple_like(result, problem.params)
        torch.testing.assert_close(flat(result), expected, **TOL)


def test_ggnvp_block_of_plist(problem: Problem) -> None:
    sub = problem.params[2:]  # second layer only
    k = sum(p.numel() for p in problem.params[:2])
    v = [torch.randn_like(p) for p in sub]
    result = ggn_vector_product_from_plist(problem.loss, problem.output, sub, v)
    assert_tuple_like(result, sub)
    torch.testing.assert_close(flat(result), problem.ggn()[k:, k:] @ flat(v), **TOL)


def test_ggnvp_only_trainable_parameters() -> None:
    problem = make_problem("ce_mean")
    problem.model[0].bias.requires_grad_(False)
    output = problem.model(problem.X)
    loss = problem.lossfunc(output, problem.y)
    trainable = [p for p in problem.model.parameters() if p.requires_grad]
    v = [torch.randn_like(p) for p in trainable]
    result = ggn_vector_product(loss, output, problem.model, v)
    assert_tuple_like(result, trainable)
    ggn = problem.ggn()
    keep = torch.ones(ggn.shape[0], dtype=torch.bool)
    start = problem.params[0].numel()
    keep[start : start + problem.params[1].numel()] = False
    torch.testing.assert_close(flat(result), ggn[keep][:, keep] @ flat(v), **TOL)


def test_ggn_sum_is_n_times_mean() -> None:
    mean, total = make_problem("ce_mean"), make_problem("ce_sum")
    _, v = rand_like_params(mean)
    g_mean = ggn_vector_product(mean.loss, mean.output, mean.model, v)
    g_sum = ggn_vector_product(total.loss, total.output, total.model, v)
    torch.testing.assert_close(flat(g_sum), N * flat(g_mean), **TOL)


# ----------------------------------------------------------------------- edge semantics


def test_unused_inputs_and_outputs_give_zeros() -> None:
    a = torch.randn(3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(2, dtype=torch.float64, requires_grad=True)
    y = a.sin()
    other = b * 2  # depends on b only
    ones_a, ones_b = torch.ones_like(a), torch.ones_like(b)

    jv_y, jv_other = R_op((y, other), (a,), (ones_a,))
    torch.testing.assert_close(jv_y, a.detach().cos())
    torch.testing.assert_close(jv_other, torch.zeros(2, dtype=torch.float64))

    (jv,) = R_op(y, (a, b), (ones_a, ones_b))  # b unused: contributes nothing
    torch.testing.assert_close(jv, a.detach().cos())

    wa, wb = L_op(y, (a, b), ones_a)
    torch.testing.assert_close(wa, a.detach().cos())
    torch.testing.assert_close(wb, torch.zeros_like(b))

    ha, hb = hessian_vector_product((a**3).sum(), (a, b), (ones_a, ones_b))
    torch.testing.assert_close(ha, 6 * a.detach())
    torch.testing.assert_close(hb, torch.zeros_like(b))


def test_hvp_of_linear_function_is_zero() -> None:
    # BackPACK raises here (the gradient carries no graph); the Hessian is zero.
    a = torch.randn(3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(2, dtype=torch.float64, requires_grad=True)
    ha, hb = hessian_vector_product(
        (2 * a).sum() + (b**2).sum(), (a, b), (torch.ones_like(a), torch.ones_like(b))
    )
    torch.testing.assert_close(ha, torch.zeros_like(a))
    torch.testing.assert_close(hb, 2 * torch.ones_like(b))
    (only,) = hessian_vector_product((2 * a).sum(), a, torch.ones_like(a))
    torch.testing.assert_close(only, torch.zeros_like(a))


def test_hvp_rejects_gradient_without_graph() -> None:
    a = torch.randn(3, dtype=torch.float64, requires_grad=True)
    f = (a**3).sum()
    (g,) = torch.autograd.grad(f, a, retain_graph=True)  # no create_graph
    with pytest.raises(ValueError, match="create_graph=True"):
        hessian_vector_product(f, a, torch.ones_like(a), grad_params=g)


def test_detach_false_keeps_graph() -> None:
    x = torch.tensor([1.0, 2.0], dtype=torch.float64, requires_grad=True)
    v = torch.tensor([1.0, -1.0], dtype=torch.float64)

    (jv,) = R_op(x**3, x, v, detach=False)  # 3 x^2 v
    assert jv.requires_grad
    (d,) = torch.autograd.grad(jv.sum(), x)
    torch.testing.assert_close(d, 6 * x.detach() * v)

    (wj,) = L_op(x**3, x, v, detach=False)
    assert wj.requires_grad
    (d,) = torch.autograd.grad(wj.sum(), x)
    torch.testing.assert_close(d, 6 * x.detach() * v)

    # BackPACK ignores detach=False here (its result is always detached)
    (hv,) = hessian_vector_product((x**4).sum(), x, v, detach=False)  # 12 x^2 v
    assert hv.requires_grad
    (d,) = torch.autograd.grad(hv.sum(), x)
    torch.testing.assert_close(d, 24 * x.detach() * v)

    for fn in (R_op, L_op):
        assert not fn(x**3, x, v)[0].requires_grad


@pytest.mark.parametrize(
    "fn", [R_op, L_op, jacobian_vector_product, transposed_jacobian_vector_product]
)
def test_retain_graph(fn) -> None:
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    y = x.exp()
    fn(y, x, torch.ones_like(x))  # default: graph kept
    (again,) = fn(y, x, torch.ones_like(x), retain_graph=False)
    torch.testing.assert_close(again, x.detach().exp())
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        y.sum().backward()


# --------------------------------------------------------------------- BackPACK oracle


def _compare(ours, theirs) -> None:
    assert isinstance(ours, tuple) and isinstance(theirs, tuple)
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert a.shape == b.shape
        assert a.requires_grad == b.requires_grad
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("detach", [True, False])
@pytest.mark.parametrize("single", [False, True])
def test_rop_lop_match_backpack(
    problem: Problem, detach: bool, single: bool, backpack_oracle
) -> None:
    rop = _backpack("hessianfree.rop")
    lop = _backpack("hessianfree.lop")
    xs = problem.params[0] if single else tuple(problem.params)
    v = torch.randn_like(xs) if single else tuple(torch.randn_like(p) for p in xs)
    w = torch.randn_like(problem.output)
    out = problem.output
    _compare(R_op(out, xs, v, detach=detach), rop.R_op(out, xs, v, detach=detach))
    _compare(
        jacobian_vector_product(out, xs, v, detach=detach),
        rop.jacobian_vector_product(out, xs, v, detach=detach),
    )
    _compare(
        R_op((out, problem.loss), xs, v, detach=detach),
        rop.R_op((out, problem.loss), xs, v, detach=detach),
    )
    _compare(L_op(out, xs, w, detach=detach), lop.L_op(out, xs, w, detach=detach))
    _compare(
        transposed_jacobian_vector_product(out, xs, w, detach=detach),
        lop.transposed_jacobian_vector_product(out, xs, w, detach=detach),
    )
    ws = (w, torch.tensor(2.0, dtype=torch.float64))
    _compare(
        L_op((out, problem.loss), xs, ws, detach=detach),
        lop.L_op((out, problem.loss), xs, ws, detach=detach),
    )


def test_hvp_matches_backpack(problem: Problem, backpack_oracle) -> None:
    hvp = _backpack("hessianfree.hvp")
    _, v = rand_like_params(problem)
    _compare(
        hessian_vector_product(problem.loss, problem.params, v),
        hvp.hessian_vector_product(problem.loss, problem.params, v),
    )
    grads = torch.autograd.grad(problem.loss, problem.params, create_graph=True)
    _compare(
        hessian_vector_product(problem.loss, problem.params, v, grad_params=grads),
        hvp.hessian_vector_product(problem.loss, problem.params, v, grad_params=grads),
    )
    weight = problem.params[0]
    _compare(
        hessian_vector_product(problem.loss, weight, v[0]),
        hvp.hessian_vector_product(problem.loss, weight, v[0]),
    )


def test_ggnvp_matches_backpack(problem: Problem, backpack_oracle) -> None:
    ggnvp = _backpack("hessianfree.ggnvp")
    _, v = rand_like_params(problem)
    args = (problem.loss, problem.output)
    _compare(
        ggn_vector_product(*args, problem.model, v),
        ggnvp.ggn_vector_product(*args, problem.model, v),
    )
    sub, v_sub = problem.params[1:3], v[1:3]
    _compare(
        ggn_vector_product_from_plist(*args, sub, v_sub),
        ggnvp.ggn_vector_product_from_plist(*args, sub, v_sub),
    )


def test_unused_inputs_match_backpack(backpack_oracle) -> None:
    rop = _backpack("hessianfree.rop")
    lop = _backpack("hessianfree.lop")
    hvp = _backpack("hessianfree.hvp")
    a = torch.randn(3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(2, dtype=torch.float64, requires_grad=True)
    y, other = a.sin(), b * 2
    va, vb = torch.randn_like(a), torch.randn_like(b)
    _compare(R_op((y, other), (a,), (va,)), rop.R_op((y, other), (a,), (va,)))
    _compare(R_op(y, (a, b), (va, vb)), rop.R_op(y, (a, b), (va, vb)))
    _compare(L_op(y, (a, b), va), lop.L_op(y, (a, b), va))
    f = (a**3).sum()
    _compare(
        hessian_vector_product(f, (a, b), (va, vb)), hvp.hessian_vector_product(f, (a, b), (va, vb))
    )


# ------------------------------------------------------------------ parameter vectors


def test_vector_round_trip() -> None:
    problem = make_problem("mse")
    vec = parameters_to_vector(problem.params)
    pieces = vector_to_parameter_list(vec, problem.params)
    assert isinstance(pieces, list) and len(pieces) == len(problem.params)
    for piece, p in zip(pieces, problem.params):
        assert piece.shape == p.shape and not piece.requires_grad
        torch.testing.assert_close(piece, p.detach(), rtol=0, atol=0)
    torch.testing.assert_close(parameters_to_vector(pieces), vec.detach(), rtol=0, atol=0)


def test_vector_to_parameter_list_views_and_iterators() -> None:
    model = nn.Linear(3, 2)
    vec = torch.arange(8.0)
    weight, bias = vector_to_parameter_list(vec, model.parameters())  # a generator
    assert weight.shape == (2, 3) and bias.shape == (2,)
    vec[-1] = 100.0  # the pieces view ``vec``; the parameters are untouched
    assert bias[-1] == 100.0
    assert not torch.equal(model.bias.detach(), bias)
    assert vector_to_parameter_list(torch.zeros(0), []) == []


def test_parameters_to_vector_is_torchs() -> None:
    assert parameters_to_vector is torch.nn.utils.parameters_to_vector


def test_vector_to_parameter_list_errors() -> None:
    params = [torch.zeros(2, 3), torch.zeros(2)]
    with pytest.raises(TypeError, match="expected Tensor"):
        vector_to_parameter_list([0.0] * 8, params)
    for size in (7, 9):
        with pytest.raises(ValueError, match=rf"vec has {size} entries.*need 8"):
            vector_to_parameter_list(torch.zeros(size), params)


def test_vector_to_parameter_list_matches_backpack(backpack_oracle) -> None:
    convert = _backpack("utils.convert_parameters")
    problem = make_problem("ce_mean")
    vec = torch.randn(problem.theta().numel(), dtype=torch.float64, requires_grad=True)
    ours = vector_to_parameter_list(vec, problem.params)
    theirs = convert.vector_to_parameter_list(vec, problem.params)
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert a.shape == b.shape and a.requires_grad == b.requires_grad
        assert a.data_ptr() == b.data_ptr()
        torch.testing.assert_close(a, b, rtol=0, atol=0)
