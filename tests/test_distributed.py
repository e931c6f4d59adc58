"""Two gloo ranks with one shard each give every rank the single-process result.

One ``torch.multiprocessing.spawn`` (start-up costs seconds) runs every check:
each rank computes its shard's results with ``process_group=WORLD`` and saves
them; the tests compare both ranks' files with one process over all samples.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import packfunc as pf
from tests.cases import DATASET_LOSSES, assert_trees_close, make_dataset

SETTINGS = [(loss, reduction) for loss in DATASET_LOSSES for reduction in ("mean", "sum")]
SHARDS = (slice(0, 5), slice(5, 11))  # uneven shards, each in uneven batches of 3
AGGREGATES = ("compute", "diag_ggn", "diag_hessian", "kflr", "ggn_vector_product", "hessian_blocks")


def results(loss_name: str, reduction: str, shard: slice | None, group) -> dict:
    """Every quantity of the dataset (``shard=None``) or of one rank's shard over ``group``."""
    problem = make_dataset(loss_name, reduction)
    model_fn, params = problem.functional()
    X, y = (problem.X, problem.y) if shard is None else (problem.X[shard], problem.y[shard])
    if shard is None:
        source = {"X": X, "y": y}
    else:
        source = {"data": DataLoader(TensorDataset(X, y), batch_size=3), "process_group": group}
    kw = {"loss": problem.loss, **source}
    v = {name: torch.ones_like(p) for name, p in params.items()}
    mats = {name: torch.ones(2, *p.shape, dtype=p.dtype) for name, p in params.items()}
    found = {
        "compute": pf.compute(
            model_fn, params, quantities=("grad", "sum_grad_squared", "variance"), **kw
        ),
        "diag_ggn": pf.diag_ggn(model_fn, params, **kw),
        "diag_hessian": pf.diag_hessian(model_fn, params, **kw),
        "kflr": pf.kflr(model_fn, params, **kw),
        "ggn_vector_product": pf.ggn_vector_product(model_fn, params, v=v, **kw),
        "hessian_blocks": pf.hessian_block_products(model_fn, params, mats=mats, **kw),
    }
    if reduction == "sum":  # clipping needs each sample's own loss
        found["clipped_grad"] = pf.clipped_grad(model_fn, params, max_norm=0.05, **kw)
    if shard is None:
        found["batch_grad"] = pf.batch_grad(model_fn, params, **kw)
        found["sqrt_ggn"] = pf.sqrt_ggn(model_fn, params, **kw)
    else:
        found["batch_grad"] = _rows(pf.per_batch(pf.batch_grad, model_fn, params, **kw), 0)
        found["sqrt_ggn"] = _rows(pf.per_batch(pf.sqrt_ggn, model_fn, params, **kw), 1)
        # a shard passed as X, y (no data=) combines the same way
        found["diag_ggn_xy"] = pf.diag_ggn(
            model_fn, params, X, y, loss=problem.loss, process_group=group
        )
        found["batch_grad_xy"] = pf.batch_grad(
            model_fn, params, X, y, loss=problem.loss, process_group=group
        )
    return found


def one_rank_empty(loss_name: str, reduction: str, rank: int, group) -> dict:
    """Rank 0 holds every sample, rank 1 none (a Poisson draw of no sample): summed
    quantities as one process over all; Kronecker factors refused on both ranks alike."""
    problem = make_dataset(loss_name, reduction)
    model_fn, params = problem.functional()
    X, y = (problem.X, problem.y) if rank == 0 else (problem.X[:0], problem.y[:0])
    kw = {"loss": problem.loss, "process_group": group}
    loader = DataLoader(TensorDataset(X, y), batch_size=3)
    found = {
        "compute": pf.compute(
            model_fn, params, quantities=("grad", "sum_grad_squared", "variance"), data=loader, **kw
        ),
        "diag_ggn": pf.diag_ggn(model_fn, params, X, y, **kw),
    }
    if reduction == "sum":
        found["clipped_grad"] = pf.clipped_grad(model_fn, params, X, y, max_norm=0.05, **kw)
    try:
        pf.kflr(model_fn, params, data=loader, **kw)
    except ValueError as error:
        found["kflr refused"] = "no non-empty batch" in str(error)
    return found


def disagreements(rank: int, group) -> dict:
    """Ranks that raise alone, make different calls or pass other parameters: every rank
    leaves the call alike (the others hung, or paired its collectives with the next call's)."""
    problem = make_dataset("cross_entropy", "sum")
    model_fn, params = problem.functional()
    X, y = problem.X[rank::2], problem.y[rank::2]
    kw = {"loss": problem.loss, "process_group": group}
    found: dict = {}
    outcomes = {
        "one rank raises": lambda: pf.clipped_grad(
            model_fn,
            params,
            X if rank else X.clone().index_fill_(0, torch.tensor([0]), math.nan),
            y,
            max_norm=0.05,
            **kw,
        ),
        "other max_norm": lambda: pf.clipped_grad(
            model_fn, params, X, y, max_norm=0.05 * (1 + rank), **kw
        ),
        "other values": lambda: pf.diag_ggn(
            model_fn, {k: v + rank for k, v in params.items()}, X, y, **kw
        ),
    }
    weights = torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64)
    ignored = problem.loss.ignore_index
    mean_loss = torch.nn.CrossEntropyLoss(weight=weights, ignore_index=ignored)
    batches = [(X[:2], y[:2]), (X[2:] if rank == 0 else X[2:, :1], y[2:])]  # rank 1's breaks
    outcomes |= {
        "other class weights": lambda: pf.diag_ggn(
            model_fn,
            params,
            X,
            y,
            loss=torch.nn.CrossEntropyLoss(weight=weights * (1 + rank), ignore_index=ignored),
            process_group=group,
        ),
        "a stream raises": lambda: list(
            pf.per_batch(
                pf.batch_grad, model_fn, params, data=batches, loss=mean_loss, process_group=group
            )
        ),
    }
    for name, call in outcomes.items():
        try:
            call()
            found[name] = "ran"
        except Exception as error:  # noqa: BLE001 (the outcome is the test's)
            found[name] = f"{type(error).__name__}: {error}"
    # equal calls spelled otherwise: keyword order, 1 or 1.0, the params' order, chunk_size
    spelled = dict(reversed(params.items())) if rank else params
    options = {"max_norm": 1, "chunk_size": 2} if rank else {"chunk_size": None, "max_norm": 1.0}
    found["spelled otherwise"] = pf.clipped_grad(model_fn, spelled, X, y, **kw, **options)
    found["after them"] = pf.diag_ggn(model_fn, params, X, y, **kw)  # the collectives pair up
    # an embedding's block products are laid out non-contiguously; all-reduced against an
    # empty rank's contiguous zeros they were read in another order there
    torch.manual_seed(0)
    tokens = nn.Sequential(nn.Embedding(7, 4), nn.Linear(4, 3)).double()
    tokens_fn, tokens_params = pf.functional(tokens)
    X_t, y_t = torch.randint(0, 7, (6, 5)), torch.randint(0, 3, (6, 5))
    mats = {k: torch.ones(2, *p.shape, dtype=p.dtype) for k, p in tokens_params.items()}
    found["blocks"] = pf.ggn_block_products(
        lambda p, x: tokens_fn(p, x).transpose(1, 2),
        tokens_params,
        X_t[: 6 * (1 - rank)],
        y_t[: 6 * (1 - rank)],
        mats=mats,
        loss=nn.CrossEntropyLoss(),
        process_group=group,
    )
    return found


def private_steps(rank: int | None, group) -> dict:
    """DP-SGD's private gradient over ranks (``rank=None``: one process over every sample,
    with rank 0's generator): each rank's generator differs, the noise is drawn once."""
    problem = make_dataset("cross_entropy", "sum")
    model_fn, params = problem.functional()
    found = {}
    for case, shards in (
        ("uneven", (slice(0, 4), slice(4, 11))),
        ("one empty", (slice(0, 11), slice(0, 0))),
    ):
        shard = slice(0, 11) if rank is None else shards[rank]
        generator = torch.Generator().manual_seed(100 + (rank or 0))
        private = pf.privacy.private_gradient(
            model_fn,
            max_norm=0.05,
            noise_multiplier=1.0,
            expected_batch_size=11.0,
            loss=problem.loss,
            generator=generator,
            process_group=group,
        )
        batch = (problem.X[shard], problem.y[shard])
        found[case] = private.update(None, private.init(params), params, batch)[0]
    return found


def _rows(stream, dim: int) -> dict:
    parts = list(stream)
    return {name: torch.cat([p[name] for p in parts], dim) for name in parts[0]}


def _worker(rank: int, init_file: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        found = {setting: results(*setting, SHARDS[rank], dist.group.WORLD) for setting in SETTINGS}
        found["one rank empty"] = {
            setting: one_rank_empty(*setting, rank, dist.group.WORLD) for setting in SETTINGS
        }
        found["disagreements"] = disagreements(rank, dist.group.WORLD)
        found["private"] = private_steps(rank, dist.group.WORLD)
        torch.save(found, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Both ranks' results (one spawn for the module)."""
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    folder = tmp_path_factory.mktemp("gloo")
    torch.multiprocessing.spawn(
        _worker, args=(str(folder / "init"), str(folder)), nprocs=2, join=True
    )
    return [torch.load(folder / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.parametrize("setting", SETTINGS, ids=["-".join(s) for s in SETTINGS])
def test_ranks_give_the_single_process_result(ranks: list[dict], setting: tuple) -> None:
    expected = results(*setting, None, None)
    for rank, found in enumerate(ranks):
        for name in AGGREGATES:
            assert_trees_close(found[setting][name], expected[name], f"rank{rank} {name}")
        assert_trees_close(found[setting]["diag_ggn_xy"], expected["diag_ggn"], "X, y shard")
        if "clipped_grad" in expected:  # every rank: the clipped sum over all shards
            assert_trees_close(found[setting]["clipped_grad"], expected["clipped_grad"], "clipped")
    for name, dim in (("batch_grad", 0), ("sqrt_ggn", 1), ("batch_grad_xy", 0)):
        rows = {
            key: torch.cat([ranks[r][setting][name][key] for r in range(2)], dim)
            for key in expected[name.removesuffix("_xy")]
        }
        assert_trees_close(rows, expected[name.removesuffix("_xy")], name)


@pytest.mark.parametrize("setting", SETTINGS, ids=["-".join(s) for s in SETTINGS])
def test_a_rank_without_samples_adds_nothing(ranks: list[dict], setting: tuple) -> None:
    """Issue 22: a rank whose Poisson draw held no sample made every rank raise (a DP-SGD step
    over ranks could not take it); its summed quantities are now zeros laid out as the other
    ranks', and every rank gets the one-process result. Kronecker factors, whose layout is
    read from a batch, are still refused, on both ranks alike (no rank waits)."""
    expected = results(*setting, None, None)
    for rank, found in enumerate(ranks):
        uneven = found["one rank empty"][setting]
        for name in ("compute", "diag_ggn", "clipped_grad"):
            if name in expected:
                assert_trees_close(uneven[name], expected[name], f"rank{rank} {name}")
        assert uneven["kflr refused"], f"rank{rank}"


def test_ranks_that_disagree_leave_the_call_alike(ranks: list[dict]) -> None:
    """A probe: a NaN sample on rank 0 raised there only, rank 1 waited in the all-reduce
    (a hang; where the caller caught the error, the next call's sums were paired with this
    one's); different max_norm or parameter values were summed silently. Every rank now
    raises, and the next call's sums are right."""
    first, second = (found["disagreements"] for found in ranks)
    assert first["one rank raises"].startswith("FloatingPointError")
    assert first["one rank raises"] != second["one rank raises"]
    assert second["one rank raises"].startswith("RuntimeError: rank 0 of process_group= raised")
    assert first["a stream raises"].startswith("RuntimeError: rank 1 of process_group=")
    assert "shapes cannot be multiplied" in second["a stream raises"]
    for found in (first, second):
        assert "made different calls" in found["other max_norm"]
        assert "of different values" in found["other values"]
        assert "of different values" in found["other class weights"]
    problem = make_dataset("cross_entropy", "sum")
    model_fn, params = problem.functional()
    expected = pf.diag_ggn(model_fn, params, problem.X, problem.y, loss=problem.loss)
    for found in (first, second):
        assert_trees_close(found["after them"], expected, "the call after")
    clipped = pf.clipped_grad(
        model_fn, params, problem.X, problem.y, loss=problem.loss, max_norm=1.0
    )
    for found in (first, second):
        assert_trees_close(found["spelled otherwise"], clipped, "equal calls spelled otherwise")
    torch.manual_seed(0)
    tokens = nn.Sequential(nn.Embedding(7, 4), nn.Linear(4, 3)).double()
    tokens_fn, tokens_params = pf.functional(tokens)
    X_t, y_t = torch.randint(0, 7, (6, 5)), torch.randint(0, 3, (6, 5))
    mats = {k: torch.ones(2, *p.shape, dtype=p.dtype) for k, p in tokens_params.items()}
    blocks = pf.ggn_block_products(
        lambda p, x: tokens_fn(p, x).transpose(1, 2),
        tokens_params,
        X_t,
        y_t,
        mats=mats,
        loss=nn.CrossEntropyLoss(),
    )
    for found in (first, second):
        assert_trees_close(found["blocks"], blocks, "block products, one rank empty")


def test_private_gradients_over_ranks_are_one_process_s_with_the_noise_drawn_once(
    ranks: list[dict],
) -> None:
    """A probe: with each rank's own generator the ranks' noisy gradients differed (the
    replicas drifted apart), and nothing said how to size noise over ranks. The noise is
    drawn on the first rank and sent to the others; a rank with an empty batch still takes
    part."""
    expected = private_steps(None, None)
    for rank, found in enumerate(ranks):
        for case in expected:
            assert_trees_close(found["private"][case], expected[case], f"rank{rank} {case}")
