"""Two gloo ranks with one shard each give every rank the single-process result.

One ``torch.multiprocessing.spawn`` (start-up costs seconds) runs every check:
each rank computes its shard's results with ``process_group=WORLD`` and saves
them; the tests compare both ranks' files with one process over all samples.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
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
