"""Whole datasets: ``data=`` equals one batch holding every sample, against autograd oracles.

The dataset has 11 samples in uneven batches (4, 4, 3) of a ``DataLoader``; the
cross-entropy loss has class weights and targets that hit ``ignore_index``, so
the mean normalizer is neither a sample count nor additive per batch mean.
"""

from __future__ import annotations

import functools
import gc
import sys
import weakref
from functools import partial

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import packfunc as pf
import packfunc.evaluation
from packfunc.engine.batch_pass import BatchPass
from packfunc.losses import mean_normalizer
from tests.cases import (
    DATASET_LOSSES,
    Dense,
    Problem,
    assert_trees_close,
    autograd_batch_grad,
    dense_curvature,
    make_dataset,
    make_problem,
    moments,
)

REDUCTIONS = ["mean", "sum"]
SETTINGS = [(loss, reduction) for loss in DATASET_LOSSES for reduction in REDUCTIONS]


@functools.cache
def dataset(loss_name: str, reduction: str) -> Problem:
    return make_dataset(loss_name, reduction)


@functools.cache
def dense(loss_name: str, reduction: str) -> Dense:
    """GGN and Hessian of the whole dataset's loss (and per sample) by ``torch.func``."""
    problem = dataset(loss_name, reduction)
    model, loss, X, y = problem.model, problem.loss, problem.X, problem.y
    names = [name for name, _ in model.named_parameters()]
    shapes = [p.shape for _, p in model.named_parameters()]
    flat0 = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def output(flat: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        leaves = flat.split([s.numel() for s in shapes])
        params = {n: t.view(s) for n, t, s in zip(names, leaves, shapes)}
        return torch.func.functional_call(model, params, (inputs,))

    full = output(flat0, X).detach()
    jac = torch.func.jacrev(output)(flat0, X)  # [N, O, P]
    h_out = torch.func.hessian(lambda o: loss(o, y))(full)  # [N, O, N, O]
    samples = torch.arange(len(X))
    sample_ggn = torch.einsum("nop,noq,nqr->npr", jac, h_out[samples, :, samples], jac)

    def share(flat: torch.Tensor, i: int) -> torch.Tensor:
        rows = list(full.unbind(0))
        rows[i] = output(flat, X[i : i + 1])[0]
        return loss(torch.stack(rows), y)

    sample_hessian = torch.stack([torch.func.hessian(share)(flat0, i) for i in range(len(X))])
    hessian = torch.func.hessian(lambda flat: loss(output(flat, X), y))(flat0)
    return Dense(sample_ggn.sum(0), sample_ggn, hessian, sample_hessian, names, shapes)


def loader(problem: Problem, batch_size: int = 4) -> DataLoader:
    return DataLoader(TensorDataset(problem.X, problem.y), batch_size=batch_size)


def unflatten(vector: torch.Tensor, like: Dense) -> dict[str, torch.Tensor]:
    parts = vector.split([s.numel() for s in like.shapes], dim=-1)
    return {
        name: part.reshape(*vector.shape[:-1], *shape)
        for name, part, shape in zip(like.names, parts, like.shapes)
    }


def concatenated(results: list, dim: int = 0) -> dict[str, torch.Tensor]:
    return {name: torch.cat([r[name] for r in results], dim) for name in results[0]}


@pytest.mark.parametrize(("loss_name", "reduction"), SETTINGS)
def test_mean_normalizer_matches_torch(loss_name: str, reduction: str) -> None:
    """``loss(reduction='mean') · Z == loss(reduction='sum')``, batch by batch."""
    problem = dataset(loss_name, "mean")
    output = problem.model(problem.X)
    summed = type(problem.loss)(**{**_options(problem.loss), "reduction": "sum"})
    Z = mean_normalizer(problem.loss, problem.y)
    torch.testing.assert_close(problem.loss(output, problem.y) * Z, summed(output, problem.y))


def _options(loss: torch.nn.Module) -> dict:
    if isinstance(loss, torch.nn.CrossEntropyLoss):
        return {"weight": loss.weight, "ignore_index": loss.ignore_index}
    return {}


@pytest.mark.parametrize(("loss_name", "reduction"), SETTINGS)
def test_first_order_over_data_match_autograd(loss_name: str, reduction: str) -> None:
    problem = dataset(loss_name, reduction)
    model_fn, params = problem.functional()
    expected = moments(autograd_batch_grad(problem.model, problem.loss, problem.X, problem.y))
    names = ("grad", "sum_grad_squared", "variance")
    found = pf.compute(model_fn, params, data=loader(problem), loss=problem.loss, quantities=names)
    for name in names:
        assert_trees_close(found[name], expected[name], name)
    torch.testing.assert_close(
        found["loss"], problem.loss(problem.model(problem.X), problem.y).detach()
    )
    for name in ("sum_grad_squared", "variance"):
        single = getattr(pf, name)(model_fn, params, data=loader(problem), loss=problem.loss)
        assert_trees_close(single, expected[name], name)
    for name in ("batch_grad", "batch_l2_grad"):
        stream = pf.per_batch(
            getattr(pf, name), model_fn, params, data=loader(problem), loss=problem.loss
        )
        assert_trees_close(concatenated(list(stream)), expected[name], name)


@pytest.mark.parametrize(("loss_name", "reduction"), SETTINGS)
def test_second_order_over_data_match_dense(loss_name: str, reduction: str) -> None:
    problem, oracle = dataset(loss_name, reduction), dense(loss_name, reduction)
    model_fn, params = problem.functional()
    data = loader(problem)
    kw = {"loss": problem.loss}
    assert_trees_close(
        pf.diag_ggn(model_fn, params, data=data, **kw), unflatten(oracle.ggn.diagonal(), oracle)
    )
    assert_trees_close(
        pf.diag_hessian(model_fn, params, data=data, **kw),
        unflatten(oracle.hessian.diagonal(), oracle),
    )
    batch_ggn = concatenated(
        list(pf.per_batch(pf.batch_diag_ggn, model_fn, params, data=data, **kw))
    )
    assert_trees_close(batch_ggn, unflatten(oracle.sample_ggn.diagonal(dim1=1, dim2=2), oracle))
    batch_h = concatenated(
        list(pf.per_batch(pf.batch_diag_hessian, model_fn, params, data=data, **kw))
    )
    assert_trees_close(batch_h, unflatten(oracle.sample_hessian.diagonal(dim1=1, dim2=2), oracle))
    roots = concatenated(list(pf.per_batch(pf.sqrt_ggn, model_fn, params, data=data, **kw)), dim=1)
    V = oracle.flatten(roots, leading=2).transpose(0, 1)  # [N, K, P]
    torch.testing.assert_close(V.transpose(1, 2) @ V, oracle.sample_ggn)


@pytest.mark.parametrize(("loss_name", "reduction"), SETTINGS)
def test_products_over_data_match_dense(loss_name: str, reduction: str) -> None:
    problem, oracle = dataset(loss_name, reduction), dense(loss_name, reduction)
    model_fn, params = problem.functional()
    data, kw = loader(problem), {"loss": problem.loss}
    torch.manual_seed(1)
    v = {name: torch.randn_like(p) for name, p in params.items()}
    flat_v = oracle.flatten(v)
    for function, matrix in (
        (pf.ggn_vector_product, oracle.ggn),
        (pf.hessian_vector_product, oracle.hessian),
    ):
        found = function(model_fn, params, v=v, data=data, **kw)
        assert_trees_close(found, unflatten(matrix @ flat_v, oracle), function.__name__)
    mats = {name: torch.randn(2, *p.shape, dtype=p.dtype) for name, p in params.items()}
    offsets = [0, *torch.tensor([s.numel() for s in oracle.shapes]).cumsum(0).tolist()]
    for function, matrix in (
        (pf.ggn_block_products, oracle.ggn),
        (pf.hessian_block_products, oracle.hessian),
        (functools.partial(pf.pch_block_products, modify="none"), oracle.hessian),
    ):
        found = function(model_fn, params, mats=mats, data=data, **kw)
        for i, name in enumerate(oracle.names):
            block = matrix[offsets[i] : offsets[i + 1], offsets[i] : offsets[i + 1]]
            expected = (mats[name].flatten(1) @ block).reshape(mats[name].shape)
            torch.testing.assert_close(found[name], expected)
    clipped = pf.pch_block_products(model_fn, params, mats=mats, data=data, **kw)
    one_batch = pf.pch_block_products(model_fn, params, problem.X, problem.y, mats, **kw)
    assert_trees_close(clipped, one_batch)


@pytest.mark.parametrize(("loss_name", "reduction"), SETTINGS)
def test_kronecker_over_data_equal_one_batch(loss_name: str, reduction: str) -> None:
    """A factors add up (scaled like the loss), B factors average over all samples."""
    problem = dataset(loss_name, reduction)
    model_fn, params = problem.functional()
    kw = {"loss": problem.loss}
    found = pf.kflr(model_fn, params, data=loader(problem), **kw)
    assert_trees_close(found, pf.kflr(model_fn, params, problem.X, problem.y, **kw))


@pytest.mark.parametrize("approx", ["sum", "expand", "reduce"])
def test_kronecker_over_data_with_positions(approx: str) -> None:
    """Convolution factors (positions enter B) over uneven batches equal one batch's."""
    problem = make_problem("conv2d", "cross_entropy", "mean", n=7)
    model_fn, params = problem.functional()
    kw = {"loss": problem.loss, "kfac_approx": approx}
    found = pf.kflr(model_fn, params, data=loader(problem, batch_size=3), **kw)
    assert_trees_close(found, pf.kflr(model_fn, params, problem.X, problem.y, **kw))


@pytest.mark.parametrize("quantity", ["kflr", "kfac_empirical"])
def test_kronecker_over_data_of_a_weight_stored_in_out(quantity: str) -> None:
    """``x @ W`` has its factors ``[in×in, out×out]``: the combiner weighted the output
    factor by the batch sizes and summed the input one (each factor 0.65-1.13 off, their
    product 31 % with batches of 4 and 3; a probe). Both factors equal one batch's."""
    problem = make_problem("raw_parameter", "cross_entropy", "mean", n=7)
    model_fn, params = problem.functional()
    function = pf.kflr if quantity == "kflr" else partial(pf.kfac, fisher_type="empirical")
    kw = {"loss": problem.loss}
    found = function(model_fn, params, data=loader(problem, batch_size=4), **kw)
    assert_trees_close(found, function(model_fn, params, problem.X, problem.y, **kw))


def test_monte_carlo_over_data() -> None:
    """One-batch ``data`` reproduces ``X, y`` exactly (same generator state); over several
    batches the draws differ but come from the same distribution (mean → exact)."""
    problem, oracle = dataset("cross_entropy", "mean"), dense("cross_entropy", "mean")
    model_fn, params = problem.functional()
    kw = {"loss": problem.loss}
    for function, options in (
        (pf.diag_ggn, {"mc_samples": 3}),
        (pf.kfac, {"mc_samples": 3}),
    ):
        one = function(
            model_fn,
            params,
            problem.X,
            problem.y,
            generator=torch.Generator().manual_seed(0),
            **options,
            **kw,
        )
        streamed = function(
            model_fn,
            params,
            data=[(problem.X, problem.y)],
            generator=torch.Generator().manual_seed(0),
            **options,
            **kw,
        )
        assert_trees_close(streamed, one, function.__name__)
    sampled = pf.diag_ggn(
        model_fn,
        params,
        data=loader(problem),
        mc_samples=4000,
        generator=torch.Generator().manual_seed(0),
        **kw,
    )
    exact = unflatten(oracle.ggn.diagonal(), oracle)
    for name in exact:
        scale = exact[name].abs().max()
        torch.testing.assert_close(sampled[name], exact[name], atol=0.08 * scale, rtol=0)


def test_kfra_needs_one_batch() -> None:
    problem = dataset("cross_entropy", "mean")
    model_fn, params = problem.functional()
    one = pf.kfra(model_fn, params, data=[(problem.X, problem.y)], loss=problem.loss)
    assert_trees_close(one, pf.kfra(model_fn, params, problem.X, problem.y, loss=problem.loss))
    with pytest.raises(ValueError, match="not a sum over samples"):
        pf.kfra(model_fn, params, data=loader(problem), loss=problem.loss)


def test_dict_batches_need_batch_to_xy() -> None:
    problem = dataset("mse", "mean")
    model_fn, params = problem.functional()
    batches = [
        {"inputs": problem.X[:5], "labels": problem.y[:5]},
        {"inputs": problem.X[5:], "labels": problem.y[5:]},
    ]
    with pytest.raises(TypeError, match="batch_to_xy"):
        pf.diag_ggn(model_fn, params, data=batches, loss=problem.loss)
    found = pf.diag_ggn(
        model_fn,
        params,
        data=batches,
        loss=problem.loss,
        batch_to_xy=lambda b: (b["inputs"], b["labels"]),
    )
    assert_trees_close(
        found, pf.diag_ggn(model_fn, params, problem.X, problem.y, loss=problem.loss)
    )


def test_argument_errors() -> None:
    problem = dataset("cross_entropy", "mean")
    model_fn, params = problem.functional()
    data, kw = loader(problem), {"loss": problem.loss}
    with pytest.raises(TypeError, match="not both"):
        pf.diag_ggn(model_fn, params, problem.X, problem.y, data=data, **kw)
    with pytest.raises(TypeError, match="data="):
        pf.diag_ggn(model_fn, params, **kw)
    with pytest.raises(TypeError, match="iterable of"):
        pf.diag_ggn(model_fn, params, data=problem.X, **kw)
    with pytest.raises(TypeError, match="needs the argument 'v'"):
        pf.ggn_vector_product(model_fn, params, data=data, **kw)
    with pytest.raises(ValueError, match="subsampling"):
        list(pf.per_batch(pf.batch_grad, model_fn, params, data=data, subsampling=[0], **kw))
    with pytest.raises(ValueError, match="own functions"):
        pf.compute(model_fn, params, data=data, quantities=("grad", "batch_grad"), **kw)
    with pytest.raises(TypeError, match="re-iterable"):
        pf.per_batch(pf.batch_grad, model_fn, params, data=iter(data), **kw)
    with pytest.raises(TypeError, match="pf.per_batch"):
        pf.batch_grad(model_fn, params, data=data, **kw)
    with pytest.raises(TypeError, match="per-sample quantity"):
        pf.per_batch(pf.diag_ggn, model_fn, params, data=data, **kw)
    with pytest.raises(RuntimeError, match="init_process_group"):
        pf.diag_ggn(model_fn, params, data=data, process_group=object(), **kw)
    with pytest.raises(ValueError, match="no non-empty batch"):
        pf.diag_ggn(model_fn, params, data=[], **kw)


def test_empty_batches_add_nothing_to_aggregates() -> None:
    """An empty batch (Poisson sampling) in ``data=`` adds nothing to a sum over batches."""
    torch.manual_seed(0)
    model_fn, params = pf.functional(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)))
    X, y = torch.randn(6, 3), torch.randint(0, 2, (6,))
    loss = nn.CrossEntropyLoss(reduction="sum")
    data = [(X[:2], y[:2]), (X[:0], y[:0]), (X[2:], y[2:])]
    for quantity, options in (("clipped_grad", {"max_norm": 0.5}), ("diag_ggn", {})):
        found = getattr(pf, quantity)(model_fn, params, data=data, loss=loss, **options)
        expected = getattr(pf, quantity)(model_fn, params, X, y, loss=loss, **options)
        assert_trees_close(found, expected)


def test_one_shot_iterator_for_sums() -> None:
    """Aggregate quantities read ``data`` once: a generator of batches works."""
    problem = dataset("mse", "mean")
    model_fn, params = problem.functional()
    batches = ((problem.X[i : i + 3], problem.y[i : i + 3]) for i in range(0, 11, 3))
    found = pf.diag_ggn(model_fn, params, data=batches, loss=problem.loss)
    assert_trees_close(
        found, pf.diag_ggn(model_fn, params, problem.X, problem.y, loss=problem.loss)
    )


def test_progress_bar(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    problem = dataset("mse", "sum")
    model_fn, params = problem.functional()
    pf.diag_ggn(model_fn, params, data=loader(problem), loss=problem.loss)
    assert capsys.readouterr().err == ""  # quiet by default
    pf.diag_ggn(model_fn, params, data=loader(problem), loss=problem.loss, progress=True)
    assert "3/3" in capsys.readouterr().err
    one = pf.batch_grad(model_fn, params, problem.X, problem.y, loss=problem.loss, progress=True)
    assert_trees_close(
        one, pf.batch_grad(model_fn, params, problem.X, problem.y, loss=problem.loss)
    )
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    with pytest.raises(ImportError, match="pip install tqdm"):
        pf.diag_ggn(model_fn, params, data=loader(problem), loss=problem.loss, progress=True)


def test_one_batch_alive_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Over a 100-batch loader, each batch pass is released before the next one starts."""
    alive: weakref.WeakSet = weakref.WeakSet()
    most = [0]

    class Watched(BatchPass):
        def __init__(self, *args, **kwargs):
            alive.add(self)
            most[0] = max(most[0], len(alive))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(packfunc.evaluation, "BatchPass", Watched)
    problem = make_dataset("cross_entropy", "mean", n=200)  # 100 batches of 2
    model_fn, params = problem.functional()
    gc.collect()
    gc.disable()  # released by reference counting, not by a later garbage collection
    try:
        pf.compute(
            model_fn,
            params,
            data=loader(problem, batch_size=2),
            loss=problem.loss,
            quantities=("grad", "diag_ggn"),
        )
        for _ in pf.per_batch(
            pf.batch_grad, model_fn, params, data=loader(problem, 20), loss=problem.loss
        ):
            pass
    finally:
        gc.enable()
    assert most[0] == 1


def test_given_output_gradient_is_refused_over_data() -> None:
    """``GivenOutputGradient`` holds one batch's G: over data= every batch reused it, silently
    (a batch's per-sample gradients were the first batch's G times its inputs)."""
    torch.manual_seed(0)
    model_fn, params = pf.functional(nn.Linear(3, 2).double())
    X, G = torch.randn(4, 3).double(), torch.randn(4, 2).double()
    data, given = [(X[:2], G[:2]), (X[2:], G[2:])], pf.losses.GivenOutputGradient(G[:2])
    calls = (
        lambda: list(pf.per_batch(pf.batch_grad, model_fn, params, data=data, loss=given)),
        lambda: pf.sum_grad_squared(model_fn, params, data=data, loss=given),
        lambda: pf.compute(model_fn, params, data=data, loss=given, quantities=("grad",)),
    )
    for call in calls:
        with pytest.raises(ValueError, match=r"per batch, with each batch's X, y and G"):
            call()
    # per batch with X, y it gives the per-sample gradients Gₙ xₙᵀ (the autograd oracle)
    found = [
        pf.batch_grad(model_fn, params, X_b, G_b, loss=pf.losses.GivenOutputGradient(G_b))
        for X_b, G_b in data
    ]
    torch.testing.assert_close(
        concatenated(found)["weight"], G.unsqueeze(2) * X.unsqueeze(1), rtol=1e-12, atol=1e-12
    )


def test_every_target_ignored_over_data_is_zero() -> None:
    """Every target ``ignore_index`` over a dataset (``Z = 0``): ``1 / Z`` raised
    ZeroDivisionError; autograd's gradient and GGN are 0 (the loss is PyTorch's NaN)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 4)).double()
    model_fn, params = pf.functional(model)
    X, y = torch.randn(6, 3).double(), torch.full((6,), -100)
    loss, data = nn.CrossEntropyLoss(), [(X[:4], y[:4]), (X[4:], y[4:])]
    value = loss(model(X), y)
    grads = torch.autograd.grad(value, list(model.parameters()))
    oracle = dense_curvature(model, loss, X, y)
    expected = {name: g for name, g in zip(params, grads)}
    assert all(bool((g == 0).all()) for g in grads) and bool(value.isnan())
    found = pf.compute(model_fn, params, data=data, loss=loss, quantities=("grad", "diag_ggn"))
    assert_trees_close(found["grad"], expected)
    assert_trees_close(found["diag_ggn"], unflatten(oracle.ggn.diagonal(), oracle))
    assert_trees_close(
        pf.diag_hessian(model_fn, params, data=data, loss=loss),
        unflatten(oracle.hessian.diagonal(), oracle),
    )
    assert bool(found["loss"].isnan())
    assert_trees_close(pf.sum_grad_squared(model_fn, params, data=data, loss=loss), expected)
    stream = pf.per_batch(pf.batch_grad, model_fn, params, data=data, loss=loss)
    assert_trees_close(
        concatenated(list(stream)), autograd_batch_grad(model, loss, X, y), "batch_grad"
    )


def test_per_batch_over_no_batches_yields_nothing() -> None:
    """``per_batch`` over an empty dataset raised ZeroDivisionError (``Z = 0``); it yields one
    result per batch: none (as with ``reduction='sum'``)."""
    model_fn, params = pf.functional(nn.Linear(3, 2))
    for reduction in REDUCTIONS:
        loss = nn.CrossEntropyLoss(reduction=reduction)
        assert list(pf.per_batch(pf.batch_grad, model_fn, params, data=[], loss=loss)) == []


def test_unbatched_loader_and_list_targets_are_named() -> None:
    """``DataLoader(batch_size=None)`` yields single samples (0-d class targets gave
    "len() of a 0-d tensor", regression targets a shape error inside the model); list
    targets gave "'list' object has no attribute 'to'"."""
    torch.manual_seed(0)
    model_fn, params = pf.functional(nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 4)))
    X, y, y_real = torch.randn(6, 3), torch.randint(0, 4, (6,)), torch.randn(6, 4)
    for targets, loss in ((y, nn.CrossEntropyLoss()), (y_real, nn.MSELoss())):
        unbatched = DataLoader(TensorDataset(X, targets), batch_size=None)
        with pytest.raises(ValueError, match=r"without a batch dimension.*batch_size=\.\.\."):
            pf.diag_ggn(model_fn, params, data=unbatched, loss=loss)
        with pytest.raises(ValueError, match=r"without a batch dimension.*batch_size=\.\.\."):
            list(pf.per_batch(pf.batch_grad, model_fn, params, data=unbatched, loss=loss))
    with pytest.raises(TypeError, match="targets y must be a tensor; got list"):
        pf.diag_ggn(model_fn, params, data=[(X, y.tolist())], loss=nn.CrossEntropyLoss())
    with pytest.raises(TypeError, match="targets y must be a tensor; got list"):
        pf.diag_ggn(model_fn, params, X, y.tolist(), loss=nn.CrossEntropyLoss())


def test_per_batch_refuses_a_loader_whose_samples_change_between_passes():
    """``reduction='mean'`` reads the targets in a first pass for the dataset's normalizer:
    a sampler with replacement gave other samples in the second pass, whose results were
    scaled by the first pass's normalizer (0.44 off with ignore_index; a probe). The pass
    that computes checks its targets' normalizer at its end."""
    torch.manual_seed(0)
    fn, p = pf.functional(nn.Linear(3, 4).double())
    X, y = torch.randn(12, 3, dtype=torch.float64), torch.randint(0, 4, (12,))
    sampler = torch.utils.data.RandomSampler(
        range(12), replacement=True, generator=torch.Generator().manual_seed(0)
    )
    loader = DataLoader(TensorDataset(X, y), batch_size=5, sampler=sampler)
    loss = nn.CrossEntropyLoss(ignore_index=0)
    with pytest.raises(ValueError, match="other samples in this pass"):
        list(pf.per_batch(pf.batch_grad, fn, p, data=loader, loss=loss))
    fixed = DataLoader(TensorDataset(X, y), batch_size=5)  # the same samples: no refusal
    parts = pf.per_batch(pf.batch_grad, fn, p, data=fixed, loss=loss)
    found = torch.cat([g["weight"] for g in parts])
    torch.testing.assert_close(found, pf.batch_grad(fn, p, X, y, loss=loss)["weight"])


class _CountedLoader:
    """A re-iterable over batches that counts how often it is iterated."""

    def __init__(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.batches, self.iterations = batches, 0

    def __iter__(self):
        self.iterations += 1
        return iter(self.batches)


def test_per_batch_reads_data_twice_for_the_mean_and_once_for_the_sum():
    """The re-iterability check built a third iterator, which a shuffled DataLoader draws
    its order for (a seeded loader advanced by one epoch, its workers started); a probe."""
    torch.manual_seed(0)
    fn, p = pf.functional(nn.Linear(3, 4))
    data = _CountedLoader([(torch.randn(4, 3), torch.randint(0, 4, (4,))) for _ in range(2)])
    list(pf.per_batch(pf.batch_grad, fn, p, data=data, loss=nn.CrossEntropyLoss()))
    assert data.iterations == 2
    data.iterations = 0
    list(pf.per_batch(pf.batch_grad, fn, p, data=data, loss=nn.CrossEntropyLoss(reduction="sum")))
    assert data.iterations == 1


@pytest.mark.parametrize("call", ["grad", "ggn_vector_product"])
def test_batch_statistics_over_data_are_refused_and_the_model_left_as_it_was(call):
    """BatchNorm in training mode over data=: the gradient alone (``compute(quantities=
    ("grad",))``) and the products summed each batch's, normalized by its own statistics
    (0.70 off one batch's; a probe), and the running statistics moved once per batch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Linear(4, 3)).double()
    fn, p = pf.functional(model)
    X, y = torch.randn(12, 5, dtype=torch.float64), torch.randint(0, 3, (12,))
    loader = DataLoader(TensorDataset(X, y), batch_size=4)
    with pytest.raises(ValueError, match="its own statistics"):
        if call == "grad":
            pf.compute(fn, p, data=loader, quantities=("grad",))
        else:
            pf.ggn_vector_product(
                fn, p, v={k: torch.ones_like(t) for k, t in p.items()}, data=loader
            )
    assert int(model[1].num_batches_tracked) == 0
    model.eval()
    pf.compute(fn, p, data=loader, quantities=("grad",))  # running statistics: it runs


def test_a_boolean_mask_as_subsampling_is_refused():
    """A bool tensor read as indices 0 and 1 (torch would read it as a mask; a probe)."""
    fn, p = pf.functional(nn.Linear(3, 2))
    X, y = torch.randn(6, 3), torch.randint(0, 2, (6,))
    mask = torch.tensor([False, False, False, True, True, True])
    with pytest.raises(ValueError, match="not a boolean mask"):
        pf.batch_l2_grad(fn, p, X, y, subsampling=mask)


def test_batch_statistics_over_ranks_are_refused(monkeypatch):
    """Over ranks with ``X, y`` shards, each rank's BatchNorm normalizes by its own shard's
    statistics as well (the group is stood in for: the refusal comes before any exchange)."""
    monkeypatch.setattr(pf.data, "world_size", lambda group: 2)
    monkeypatch.setattr(pf.data, "check_group", lambda group: None)
    model = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Linear(4, 3))
    fn, p = pf.functional(model)
    X, y = torch.randn(6, 5), torch.randint(0, 3, (6,))
    with pytest.raises(ValueError, match="over data= or ranks"):
        pf.compute(fn, p, X, y, quantities=("grad",), process_group=object())


def test_batches_made_in_inference_mode_serve_every_quantity() -> None:
    """A dataset preprocessed under ``torch.inference_mode()``: the Kronecker factors and
    the products took its batches, the statistics and ``per_batch`` raised torch's error."""
    problem = dataset("cross_entropy", "mean")
    model_fn, params = problem.functional()
    with torch.inference_mode():
        X, y = problem.X.clone(), problem.y.clone()
    data = [(X[:5], y[:5]), (X[5:], y[5:])]
    normal = [(problem.X[:5], problem.y[:5]), (problem.X[5:], problem.y[5:])]
    kw = {"loss": problem.loss}
    assert_trees_close(
        pf.diag_ggn(model_fn, params, data=data, **kw),
        pf.diag_ggn(model_fn, params, data=normal, **kw),
    )
    found = list(pf.per_batch(pf.batch_grad, model_fn, params, data=data, **kw))
    expected = list(pf.per_batch(pf.batch_grad, model_fn, params, data=normal, **kw))
    for one, other in zip(found, expected, strict=True):
        assert_trees_close(one, other)


def test_a_model_used_over_data_is_not_kept_alive():
    """The model function over ``data=`` runs wrapped (a ``PackedSequence`` in a batch comes
    padded and is packed again); a cache of those wrappers kept every model alive."""
    import gc
    import weakref

    def use():
        model = nn.Sequential(nn.Linear(3, 2))
        model_fn, params = pf.functional(model)
        data = [(torch.randn(4, 3), torch.randint(0, 2, (4,)))]
        pf.sum_grad_squared(model_fn, params, data=data)
        return weakref.ref(model)

    model = use()
    gc.collect()
    assert model() is None
