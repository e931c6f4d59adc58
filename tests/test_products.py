"""Curvature products against dense reverse-mode autograd and BackPACK: every loss, BatchNorm."""

from __future__ import annotations

import copy
from collections import OrderedDict

import numpy as np
import pytest
import torch
from torch import Tensor, nn
from torch.autograd.functional import hessian, jacobian

import packfunc as pf
from tests.cases import dense_curvature, make_problem, run_backward_with


def _flat(tree: dict[str, Tensor], leading: int = 0) -> Tensor:
    return torch.cat([t.reshape(*t.shape[:leading], -1) for t in tree.values()], -1)


def _blocks(matrix: Tensor, params: dict[str, Tensor]) -> dict[str, Tensor]:
    """The diagonal blocks of a dense ``[P, P]`` matrix, by parameter name."""
    found, start = {}, 0
    for name, p in params.items():
        found[name] = matrix[start : start + p.numel(), start : start + p.numel()]
        start += p.numel()
    return found


def _assert_products(model_fn, params, X, y, loss, ggn: Tensor, hess: Tensor) -> None:
    """Vector and block products equal the dense GGN and Hessian (and their blocks)."""
    torch.manual_seed(1)
    v = {k: torch.randn_like(p) for k, p in params.items()}
    mats = {k: torch.randn(3, *p.shape, dtype=p.dtype) for k, p in params.items()}
    gv = pf.ggn_vector_product(model_fn, params, X, y, v, loss=loss)
    hv = pf.hessian_vector_product(model_fn, params, X, y, v, loss=loss)
    torch.testing.assert_close(_flat(gv), ggn @ _flat(v), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(_flat(hv), hess @ _flat(v), rtol=1e-9, atol=1e-12)
    ggn_blocks = pf.ggn_block_products(model_fn, params, X, y, mats, loss=loss)
    hess_blocks = pf.hessian_block_products(model_fn, params, X, y, mats, loss=loss)
    for name, block in _blocks(ggn, params).items():
        torch.testing.assert_close(ggn_blocks[name].flatten(1), mats[name].flatten(1) @ block)
    for name, block in _blocks(hess, params).items():
        torch.testing.assert_close(hess_blocks[name].flatten(1), mats[name].flatten(1) @ block)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("loss_name", ["cross_entropy", "mse", "bce_with_logits"])
def test_products_for_every_loss_and_reduction(loss_name, reduction):
    """MSELoss(reduction='mean') used to fail ("ZeroTensors are immutable")."""
    problem = make_problem("mlp", loss_name, reduction, n=4)
    dense = problem.dense()
    _assert_products(
        *problem.functional(), problem.X, problem.y, problem.loss, dense.ggn, dense.hessian
    )


def test_hessian_vector_product_for_a_loss_without_forward_mode_derivatives():
    problem = make_problem("mlp", "mse", "mean", n=4)
    model, X, y = problem.model, problem.X, problem.y
    loss = nn.HuberLoss(delta=0.5)  # torch has no forward-mode rule for huber_loss_backward
    dense = dense_curvature(model, loss, X, y)
    model_fn, params = pf.functional(model)
    v = {k: torch.randn_like(p) for k, p in params.items()}
    hv = pf.hessian_vector_product(model_fn, params, X, y, v, loss=loss)
    torch.testing.assert_close(_flat(hv), dense.hessian @ _flat(v))


BATCHNORM_MODELS = {
    "mlp": (
        lambda: nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 3)),
        (3,),
    ),
    "cnn": (
        lambda: nn.Sequential(
            nn.Conv2d(2, 3, 2), nn.BatchNorm2d(3), nn.Sigmoid(), nn.Flatten(), nn.Linear(12, 3)
        ),
        (2, 3, 3),
    ),
}


def _batchnorm_problem(name: str, n: int = 5):
    torch.manual_seed(0)
    build, shape = BATCHNORM_MODELS[name]
    model = build().double().train()
    with torch.no_grad():  # running statistics away from their initial values
        model(torch.randn(8, *shape, dtype=torch.float64))
    X = torch.randn(n, *shape, dtype=torch.float64)
    return model, nn.CrossEntropyLoss(), X, torch.randint(0, 3, (n,))


def _dense_whole_batch(
    model: nn.Module, loss: nn.Module, X: Tensor, y: Tensor
) -> tuple[Tensor, Tensor]:
    """GGN ``Jᵀ (∇²_f L) J`` and Hessian of the loss of the whole batch, reverse mode.

    Samples are coupled, so ``J`` is the Jacobian of the whole batch's output. A copy
    of the model absorbs the running-statistics updates. (``torch.func.hessian``,
    forward-over-reverse, returns an asymmetric, wrong Hessian for training-mode
    BatchNorm in torch 2.13; finite differences agree with reverse-over-reverse.)
    """
    model = copy.deepcopy(model)
    params = dict(model.named_parameters())
    shapes = {k: p.shape for k, p in params.items()}
    flat0 = _flat({k: p.detach() for k, p in params.items()})

    def output(flat: Tensor) -> Tensor:
        pieces = flat.split([s.numel() for s in shapes.values()])
        tree = {k: t.view(s) for (k, s), t in zip(shapes.items(), pieces)}
        return torch.func.functional_call(model, tree, (X,))

    out = output(flat0).detach()
    jac = jacobian(output, flat0).reshape(out.numel(), -1)
    loss_hessian = hessian(lambda o: loss(o, y), out).reshape(out.numel(), out.numel())
    return jac.T @ loss_hessian @ jac, hessian(lambda flat: loss(output(flat), y), flat0)


@pytest.mark.parametrize("name", list(BATCHNORM_MODELS))
def test_products_with_batchnorm_in_training_mode_use_batch_statistics(name):
    model, loss, X, y = _batchnorm_problem(name)
    before = copy.deepcopy(model.state_dict())
    ggn, hess = _dense_whole_batch(model, loss, X, y)
    _assert_products(*pf.functional(model), X, y, loss, ggn, hess)
    for key, value in model.state_dict().items():  # running statistics and counter untouched
        assert torch.equal(value, before[key]), key


@pytest.mark.parametrize("name", list(BATCHNORM_MODELS))
def test_a_fresh_batchnorm_with_a_cumulative_average_runs_as_with_momentum(name):
    """``momentum=None`` divides by the batch counter, which packfunc does not advance: a
    fresh BatchNorm (counter 0) raised ZeroDivisionError in every call. Its products are
    those of ``momentum=0.1`` (batch statistics either way); per-sample quantities get the
    BatchNorm refusal; the counter stays 0."""
    torch.manual_seed(0)
    build, shape = BATCHNORM_MODELS[name]
    model = build().double().train()
    cumulative = copy.deepcopy(model)
    for module in cumulative.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.momentum = None
    X, y = torch.randn(5, *shape, dtype=torch.float64), torch.randint(0, 3, (5,))
    model_fn, params = pf.functional(model)
    v = {k: torch.randn_like(p) for k, p in params.items()}
    for product in (pf.ggn_vector_product, pf.hessian_vector_product):
        expected = product(model_fn, params, X, y, v)
        found = product(*pf.functional(cumulative), X, y, v)
        for key in expected:
            torch.testing.assert_close(found[key], expected[key])
    with pytest.raises(ValueError, match="BatchNorm in training mode"):
        pf.batch_grad(*pf.functional(cumulative), X, y)
    counters = [b for k, b in cumulative.state_dict().items() if k.endswith("batches_tracked")]
    assert counters and all(int(c) == 0 for c in counters)


def test_block_products_with_batchnorm_in_training_mode_equal_backpack(backpack_oracle):
    """BackPACK 1.7.1's GGNMP and HMP support BatchNorm1d (not 2d)."""
    backpack, extensions = backpack_oracle, backpack_oracle.extensions
    model, loss, X, y = _batchnorm_problem("mlp")
    theirs = run_backward_with(backpack, [extensions.GGNMP(), extensions.HMP()], model, loss, X, y)
    model_fn, params = pf.functional(model)
    mats = {k: torch.randn(3, *p.shape, dtype=torch.float64) for k, p in params.items()}
    ggn = pf.ggn_block_products(model_fn, params, X, y, mats, loss=loss)
    hess = pf.hessian_block_products(model_fn, params, X, y, mats, loss=loss)
    for param_name, p in theirs.named_parameters():
        torch.testing.assert_close(ggn[param_name], p.ggnmp(mats[param_name]))
        torch.testing.assert_close(hess[param_name], p.hmp(mats[param_name]))


@pytest.mark.parametrize("quantity", [pf.batch_grad, pf.diag_ggn, pf.diag_hessian, pf.kflr])
def test_per_sample_quantities_still_refuse_batchnorm_in_training_mode(quantity):
    model, loss, X, y = _batchnorm_problem("mlp")
    with pytest.raises(ValueError, match=r"model\.eval\(\)"):
        quantity(*pf.functional(model), X, y, loss=loss)


@pytest.mark.parametrize(
    "product", [pf.hessian_block_products, pf.ggn_block_products, pf.pch_block_products]
)
def test_block_products_refuse_stacks_of_another_layout_naming_it(product):
    """Found by a probe: columns laid out ``[p.numel(), V]`` (or any shape but ``[V, *p]``)
    reached a pullback and raised torch's "Mismatch in shape: grad_output[0] ...". The
    stack's expected layout is named now, with the reshape that gives it."""
    fn, params = pf.functional(nn.Linear(4, 3))
    X, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    wrong = {k: torch.ones(t.numel(), 1) for k, t in params.items()}
    with pytest.raises(ValueError, match=r"mats\['bias'\] has shape \[3, 1\].*\[V, 3\]"):
        product(fn, params, X, y, wrong)
    right = {k: torch.ones(2, *t.shape) for k, t in params.items()}
    assert product(fn, params, X, y, right)["weight"].shape == (2, 3, 4)


@pytest.mark.parametrize(
    "product", [pf.hessian_block_products, pf.ggn_block_products, pf.pch_block_products]
)
def test_block_products_refuse_a_stack_that_is_not_a_tensor(product):
    """A NumPy array where a tensor belongs raised an AttributeError (no 'dim'); the leaf
    is named with the type it takes."""
    fn, params = pf.functional(nn.Linear(4, 3))
    X, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    mats = {"weight": torch.ones(2, 3, 4), "bias": np.ones((2, 3))}
    with pytest.raises(TypeError, match=r"mats\['bias'\] is of type ndarray.*\[V, \*p\.shape\]"):
        product(fn, params, X, y, mats)


def test_block_products_name_the_leaves_mats_lacks_and_refuse_integer_vectors():
    """A missing leaf or a list in place of one was told "one leaf per parameter leaf"
    without which; integer vectors reached torch's "Expected tangent to be floating point"
    (GGN) or ran (Hessian). Found by a probe."""
    fn, params = pf.functional(nn.Sequential(nn.Linear(3, 2)))
    X, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
    for product in (pf.ggn_block_products, pf.hessian_block_products):
        with pytest.raises(ValueError, match=r"missing \['0.bias'\], not parameters \[\]"):
            product(fn, params, X, y, {"0.weight": torch.ones(1, 2, 3)})
        listed = {"0.weight": torch.ones(1, 2, 3), "0.bias": [torch.ones(1, 2)]}
        with pytest.raises(ValueError, match=r"not parameters \['0.bias.0'\]"):
            product(fn, params, X, y, listed)
        integer = {"0.weight": torch.ones(1, 2, 3, dtype=torch.long), "0.bias": None}
        with pytest.raises(TypeError, match="dtype torch.int64.*floating-point"):
            product(fn, params, X, y, integer)


def _standardized_in_no_grad(p, X):
    """A parameter statistic under ``torch.no_grad()`` (a constant to autograd)."""
    hidden = torch.tanh(X @ p["a"])
    with torch.no_grad():
        scale = p["b"].sum()
    return hidden @ p["b"] * scale


@pytest.mark.parametrize("product", ["ggn_vector_product", "ggn_block_products"])
def test_ggn_products_refuse_a_parameter_statistic_under_no_grad(product):
    """Forward mode (``J t``) does not see ``no_grad``: the products differentiated the
    constant (0.026 off the dense ``JᵀHJ``, not even symmetric; a probe). ``.detach()``
    stops both modes: the product then equals the dense one."""
    torch.manual_seed(0)
    params = {
        "a": torch.randn(4, 5, dtype=torch.float64),
        "b": torch.randn(5, 3, dtype=torch.float64),
    }
    X, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    v = {k: torch.randn_like(t) for k, t in params.items()}
    mats = {k: t[None] for k, t in v.items()}
    call = (
        (lambda fn: pf.ggn_vector_product(fn, params, X, y, v))
        if product == "ggn_vector_product"
        else (lambda fn: pf.ggn_block_products(fn, params, X, y, mats))
    )
    with pytest.raises(ValueError, match="under torch.no_grad"):
        call(_standardized_in_no_grad)

    def detached(p, X):
        return torch.tanh(X @ p["a"]) @ p["b"] * p["b"].sum().detach()

    found = pf.ggn_vector_product(detached, params, X, y, v)
    flat = torch.cat([t.reshape(-1) for t in params.values()])
    sizes = [t.numel() for t in params.values()]

    def output(w):
        first, second = w.split(sizes)
        return detached({"a": first.view(4, 5), "b": second.view(5, 3)}, X)

    J = torch.autograd.functional.jacobian(output, flat).reshape(18, -1)
    out = output(flat)
    H = torch.autograd.functional.hessian(lambda o: nn.functional.cross_entropy(o, y), out)
    G = J.T @ H.reshape(18, 18) @ J
    expected = G @ torch.cat([t.reshape(-1) for t in v.values()])
    torch.testing.assert_close(torch.cat([found[k].reshape(-1) for k in params]), expected)


class _BranchesOnRequiresGrad(nn.Module):
    """Doubles its hidden layer where that tensor requires a gradient (every training step)."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden, self.out = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.hidden(x))
        return self.out(h * 2 if h.requires_grad else h)


def test_a_forward_branching_on_requires_grad_is_refused_by_the_ggn_products():
    """``J v`` in forward mode saw ``requires_grad`` false and took the other branch than
    the reverse-mode ``Jᵀ``: the product was 0.4 off the GGN's, silently (a probe)."""
    torch.manual_seed(0)
    model = _BranchesOnRequiresGrad().double()
    fn, p = pf.functional(model)
    X, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    v = {k: torch.randn_like(t) for k, t in p.items()}
    with pytest.raises(ValueError, match="requires_grad"):
        pf.ggn_vector_product(fn, p, X, y, v=v)
    with pytest.raises(ValueError, match="requires_grad"):
        pf.ggn_block_products(fn, p, X, y, {k: t[None] for k, t in v.items()})
    pf.hessian_vector_product(fn, p, X, y, v=v)  # reverse mode only: it runs


@pytest.mark.parametrize("product", ["ggn_vector_product", "hessian_vector_product"])
def test_a_vector_in_another_key_order_or_shaped_otherwise(product):
    """``v`` with ``params``' keys in another order (sorted) is the same vector; one with a
    key missing or a leaf transposed is refused by name (torch.func's pytree errors before)."""
    torch.manual_seed(0)
    model_fn, params = pf.functional(
        torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    )
    X, y = torch.randn(4, 3), torch.randint(0, 3, (4,))
    v = {k: torch.randn_like(t) for k, t in params.items()}
    function = getattr(pf, product)
    expected = function(model_fn, params, X, y, v=v)
    found = function(model_fn, params, X, y, v={k: v[k] for k in sorted(v)})
    assert list(found) == list(params)
    for name in params:
        torch.testing.assert_close(found[name], expected[name])
    with pytest.raises(ValueError, match=r"missing \['0.bias'"):
        function(model_fn, params, X, y, v={"0.weight": v["0.weight"]})
    with pytest.raises(ValueError, match="at 0.weight it has"):
        function(model_fn, params, X, y, v=v | {"0.weight": v["0.weight"].T})


def test_products_and_estimators_take_ordered_dict_parameters():
    """``OrderedDict(model.named_parameters())``: ``v`` (even ``params`` itself) was rebuilt
    as a plain dict and refused as "not shaped like params" by the products and the
    estimators (a probe); they equal the plain dict's results."""
    torch.manual_seed(0)
    model_fn, plain = pf.functional(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)))
    ordered = OrderedDict(plain)
    X, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
    v = {k: torch.randn_like(p) for k, p in plain.items()}
    for product in (pf.ggn_vector_product, pf.hessian_vector_product):
        expected = product(model_fn, plain, X, y, v)
        found = product(model_fn, ordered, X, y, OrderedDict(reversed(list(v.items()))))
        for key in plain:
            torch.testing.assert_close(found[key], expected[key])
    in_sorted_order = OrderedDict(sorted(plain.items()))  # (probes are drawn in leaf order)
    trace = pf.hutchinson_trace(
        model_fn, in_sorted_order, X, y, num_samples=4, generator=torch.Generator().manual_seed(0)
    )
    expected_trace = pf.hutchinson_trace(
        model_fn, plain, X, y, num_samples=4, generator=torch.Generator().manual_seed(0)
    )
    torch.testing.assert_close(trace, expected_trace)


class _Distances(nn.Module):
    """RBF features ``exp(-‖h - c‖²)`` of learned centres by ``torch.cdist``: torch has no
    forward-mode formula of it and no derivative of its backward."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(4, 3), nn.Linear(4, 3)
        self.centres = nn.Parameter(torch.randn(4, 3))

    def forward(self, x: Tensor) -> Tensor:
        return self.out(torch.exp(-(torch.cdist(torch.tanh(self.inp(x)), self.centres) ** 2)))


def test_an_op_without_the_derivative_a_product_needs_is_refused_naming_the_other_product() -> None:
    """torch's own errors ("Trying to use forward AD with _cdist_forward", "the derivative
    for '_cdist_backward' is not implemented") said nothing of what works instead (a probe)."""
    torch.manual_seed(0)
    model_fn, params = pf.functional(_Distances().double())
    X, y = torch.randn(3, 4, dtype=torch.float64), torch.tensor([0, 2, 1])
    v = {k: torch.randn_like(p) for k, p in params.items()}
    with pytest.raises(NotImplementedError, match="forward mode.*hessian_vector_product"):
        pf.ggn_vector_product(model_fn, params, X, y, v)
    with pytest.raises(NotImplementedError, match="twice.*ggn_vector_product"):
        pf.hessian_vector_product(model_fn, params, X, y, v)
    assert pf.diag_ggn(model_fn, params, X, y)["centres"].shape == (4, 3)  # what works
