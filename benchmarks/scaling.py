"""Scaling study: time and peak memory per sample vs batch size, and time vs gloo ranks.

For each problem (MLP, CNN, LM and GPT-2 of ``problems.py``), quantity and batch size
(8 … 1024, ``--sizes`` for more), ``--processes`` fresh processes each run every
contender of ``peers.py`` that offers the quantity (packfunc, vmap(grad), opacus,
BackPACK, curvlinops): per contender one untimed call warms up and a second gives the
peak memory (``memory.peak_bytes``: on CPU the tensor storage alive at once, on CUDA
``max_memory_allocated`` above what was allocated before); then ``--repeats`` rounds
time the contenders in turn. A contender's time is the median over processes of each
process's median, its spread the fastest and slowest of those (one process's median
moves by up to 30 %: allocator state, huge pages, thread placement); a ratio within
the spreads is named a tie. Both are reported per sample.
The rank study times one whole-dataset quantity (``pf.diag_ggn(..., data=loader,
process_group=WORLD)``) on a fixed dataset split over 1 and 2 gloo ranks on this
machine (its cores shared between the ranks).

Writes ``<out>.md`` (tables), ``<out>.csv`` (one row per cell) and ``<out>.png``::

    python benchmarks/scaling.py              # the full study (tens of minutes)
    python benchmarks/scaling.py --quick --out /tmp/scaling   # smoke test
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import cast

import torch

from memory import peak_bytes
from peers import BUILDERS, Unavailable, Unsupported
from problems import Problem, cnn, hugging_face, lm, mlp
from timing import time_interleaved

FACTORIES: dict[str, Callable[[int], Problem]] = {
    "MLP": mlp,
    "CNN": cnn,
    "LM": lm,
    "GPT-2": lambda n: hugging_face("gpt2", n),
}
"""Problem name -> factory of a problem with batch size ``n``."""

CONTENDERS = ("packfunc", "vmap(grad)", "opacus", "BackPACK", "curvlinops")
BATCH_SIZES = (8, 16, 32, 64, 128, 256, 512, 1024)
QUICK_BATCH_SIZES = (8, 16)
QUANTITIES = ("batch_grad", "kfac")
MIB = 2**20


@dataclass
class Cell:
    """One contender on one problem, quantity and batch size (``None``: did not run).

    ``ms_low``/``ms_high``: the fastest and slowest of the processes' median times (their
    spread); ``ms_per_sample`` is the median over processes.
    """

    problem: str
    quantity: str
    n: int
    contender: str
    ms_per_sample: float | None = None
    mib_per_sample: float | None = None
    note: str = ""
    ms_low: float | None = None
    ms_high: float | None = None


def measure_cell(
    problem: str,
    quantity: str,
    n: int,
    contenders: list[str],
    device: str,
    repeats: int,
    threads: int,
) -> list[Cell]:
    """Time and peak memory of every contender on one cell, in this (fresh) process.

    Each contender is built and warmed up; its peak memory is measured alone; then they are
    timed in interleaved rounds (a slow spell of the machine hits every contender alike).

    Args:
        problem: A key of :data:`FACTORIES`.
        quantity: A quantity name of ``peers.py``.
        n: Batch size.
        contenders: Keys of ``peers.BUILDERS``.
        device: ``"cpu"`` or ``"cuda"``.
        repeats: Timed rounds (their median is reported; 0: memory only).
        threads: ``torch.set_num_threads``.

    Returns:
        One :class:`Cell` per contender.
    """
    torch.set_num_threads(threads)
    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    cells, closures = {}, {}
    for contender in contenders:
        cell = cells[contender] = Cell(problem, quantity, n, contender)
        try:
            closure = BUILDERS[contender](FACTORIES[problem](n).to(device), quantity)
            if closure is None:
                cell.note = "n/a"
                continue
            closure()  # warm-up: one-time allocations and lazy imports are not counted
            sync()
            cell.mib_per_sample = peak_bytes(closure, device) / MIB / n
            closures[contender] = closure
        except (Unavailable, Unsupported) as error:
            cell.note = f"{type(error).__name__}: {error}"[:80]
        except Exception as error:  # noqa: BLE001 - e.g. out of memory: the cell stays empty
            cell.note = f"{type(error).__name__}: {str(error).splitlines()[0]}"[:80]
    if repeats and closures:  # 0: memory only
        timed = time_interleaved(closures, repeats, warmup=1, sync=sync)
        for contender, (ms, _) in timed.items():
            cells[contender].ms_per_sample = ms / n
    return list(cells.values())


def combined(runs: list[Cell]) -> Cell:
    """One contender's cell over several processes: the median time and its spread.

    Args:
        runs: The contender's cells, one per process.

    Returns:
        The cell with the median of the processes' times, their fastest and slowest, and
        the median peak memory (the same in every process: tensor storage is counted exactly).

    Example:
        >>> runs = [Cell("MLP", "kfac", 8, "packfunc", ms, 1.0) for ms in (3.0, 1.0, 2.0)]
        >>> cell = combined(runs)
        >>> cell.ms_per_sample, cell.ms_low, cell.ms_high
        (2.0, 1.0, 3.0)
    """
    times = [run.ms_per_sample for run in runs if run.ms_per_sample is not None]
    memory = [run.mib_per_sample for run in runs if run.mib_per_sample is not None]
    first = runs[0]
    cell = Cell(first.problem, first.quantity, first.n, first.contender, note=first.note)
    if times:
        cell.ms_per_sample = statistics.median(times)
        cell.ms_low, cell.ms_high = min(times), max(times)
    if memory:
        cell.mib_per_sample = statistics.median(memory)
    return cell


def batch_size_study(
    problems: list[str],
    quantities: list[str],
    sizes: tuple[int, ...],
    contenders: list[str],
    device: str,
    repeats: int,
    threads: int,
    processes: int = 3,
    alone: bool = False,
) -> list[Cell]:
    """Every cell in ``processes`` fresh spawned processes, each timing every contender.

    With ``alone``, each process times one contender, the contenders' processes interleaved:
    at gigabytes of output per call one contender's freed memory moves the next one's time
    in a shared process.
    """
    cells = []
    for problem in problems:
        for quantity in quantities:
            offering = [c for c in contenders if _offers(c, problem, quantity, min(sizes))]
            for n in sizes:
                args = (problem, quantity, n, offering, device, repeats, threads)
                if alone:
                    runs = [
                        [_in_fresh_process((*args[:3], [c], *args[4:]))[0] for c in offering]
                        for _ in range(processes)
                    ]
                else:
                    runs = [_in_fresh_process(args) for _ in range(processes)]
                for i in range(len(offering)):
                    cell = combined([run[i] for run in runs])
                    print(_line(cell), flush=True)
                    cells.append(cell)
    return cells


def _offers(contender: str, problem: str, quantity: str, n: int) -> bool:
    """Whether the contender computes the quantity on the problem (built once, not run)."""
    try:
        return BUILDERS[contender](FACTORIES[problem](n), quantity) is not None
    except Exception as error:  # noqa: BLE001 - a refusal (or a peer's failure) is a result
        print(f"{problem} {quantity} {contender}: {type(error).__name__}: {error}"[:120])
        return False


def _in_fresh_process(args: tuple) -> list[Cell]:
    """:func:`measure_cell` in a new spawned process."""
    try:
        with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
            return pool.submit(measure_cell, *args).result()
    except BrokenProcessPool:  # killed, e.g. by the kernel for memory
        return [Cell(*args[:3], contender, note="process died (memory?)") for contender in args[3]]


def _line(cell: Cell) -> str:
    """One cell as a log line, in significant digits (a run cut short keeps only its log)."""
    head = f"{cell.problem} {cell.quantity} n={cell.n} {cell.contender}:"
    if cell.ms_per_sample is None or cell.mib_per_sample is None:
        return f"{head} {cell.note}"
    return (
        f"{head} {cell.ms_per_sample:.4g} ({cell.ms_low:.4g}-{cell.ms_high:.4g}) ms/sample, "
        f"{cell.mib_per_sample:.4g} MiB/sample"
    )


def verdict(found: dict[str, Cell]) -> str:
    """How packfunc stands against the best peers of a row, in time and in memory.

    Time against the fastest peer (a tie where the spreads of the processes' medians
    overlap), memory against the peer needing the least.

    Args:
        found: Contender -> cell of one (problem, quantity, N).

    Returns:
        E.g. ``"time 0.80× ahead · memory 1.00×"``; ``"—"`` without packfunc or a peer.

    Example:
        >>> cells = {"packfunc": Cell("MLP", "kfac", 8, "packfunc", 1.1, 2.0, "", 1.0, 1.3),
        ...          "curvlinops": Cell("MLP", "kfac", 8, "curvlinops", 1.0, 2.2, "", 0.9, 1.2)}
        >>> verdict(cells)
        'time 1.10× tie · memory 0.91×'
    """
    ours = found.get("packfunc")
    peers = [c for name, c in found.items() if name != "packfunc" and c.ms_per_sample]
    if ours is None or not ours.ms_per_sample or not ours.mib_per_sample or not peers:
        return "—"
    fastest = min(peers, key=lambda c: cast(float, c.ms_per_sample))
    ratio = ours.ms_per_sample / cast(float, fastest.ms_per_sample)
    if ratio <= 1.0:
        standing = "ahead"
    else:  # within the spreads of the processes' medians: a tie
        overlap = cast(float, ours.ms_low) <= cast(float, fastest.ms_high)
        standing = "tie" if overlap else "behind"
    least = min(c.mib_per_sample for c in peers if c.mib_per_sample)
    return f"time {ratio:.2f}× {standing} · memory {ours.mib_per_sample / least:.2f}×"


# ----------------------------------------------------------------------------- ranks


def _rank_worker(
    rank: int, ranks: int, init_file: str, out: str, samples: int, repeats: int, threads: int
) -> None:
    """Time ``pf.diag_ggn`` over this rank's shard of the MLP dataset (rank 0 writes)."""
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    import packfunc as pf

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=ranks)
    try:
        problem = mlp(samples)
        model_fn, params = pf.functional(problem.model())
        shard = TensorDataset(problem.X[rank::ranks], problem.y[rank::ranks])
        loader = DataLoader(shard, batch_size=64)
        times = []
        for _ in range(repeats + 1):  # the first call warms up
            dist.barrier()
            start = time.perf_counter()
            pf.diag_ggn(
                model_fn, params, data=loader, loss=problem.loss(), process_group=dist.group.WORLD
            )
            times.append(time.perf_counter() - start)
        if rank == 0:
            Path(out).write_text(f"{statistics.median(times[1:])}")
    finally:
        dist.destroy_process_group()


def rank_study(rank_counts: tuple[int, ...], samples: int, repeats: int, threads: int) -> dict:
    """Seconds for ``diag_ggn`` over ``samples`` MLP samples, per number of gloo ranks."""
    seconds = {}
    for ranks in rank_counts:
        with tempfile.TemporaryDirectory() as folder:
            out = os.path.join(folder, "seconds")
            per_rank = max(1, threads // ranks)
            args = (ranks, os.path.join(folder, "init"), out, samples, repeats, per_rank)
            torch.multiprocessing.spawn(_rank_worker, args=args, nprocs=ranks, join=True)
            seconds[ranks] = float(Path(out).read_text())
        print(f"diag_ggn over {samples} MLP samples, {ranks} gloo rank(s): {seconds[ranks]:.3f} s")
    return seconds


# ----------------------------------------------------------------------------- output


def markdown(cells: list[Cell], seconds: dict, conditions: str) -> str:
    """Tables: ``ms/sample · MiB/sample`` per contender, one row per (problem, quantity, n)."""
    contenders = list(dict.fromkeys(cell.contender for cell in cells))
    lines = [f"Conditions: {conditions}", ""]
    lines += ["| problem | quantity | N | " + " | ".join(contenders) + " | packfunc / best peer |"]
    lines += ["|" + "---|" * (4 + len(contenders))]
    rows: dict[tuple, dict[str, Cell]] = {}
    for cell in cells:
        rows.setdefault((cell.problem, cell.quantity, cell.n), {})[cell.contender] = cell
    for (problem, quantity, n), found in rows.items():
        entries = [_entry(found.get(name)) for name in contenders]
        lines.append(
            f"| {problem} | {quantity} | {n} | " + " | ".join(entries) + f" | {verdict(found)} |"
        )
    lines += [
        "",
        "Cells: ms per sample (the fastest–slowest process's median) · MiB peak memory per "
        "sample (— : not offered or failed). Last column: packfunc's time over the fastest "
        "peer's (a tie where the spreads overlap) and its memory over the least peer's.",
        "",
    ]
    if seconds:
        lines += ["| gloo ranks | diag_ggn over the dataset (s) |", "|---|---|"]
        lines += [f"| {ranks} | {value:.3f} |" for ranks, value in seconds.items()]
    return "\n".join(lines) + "\n"


def _entry(cell: Cell | None) -> str:
    if cell is None or cell.ms_per_sample is None or cell.mib_per_sample is None:
        return "—"
    spread = f"{cell.ms_low:.3g}–{cell.ms_high:.3g}"
    return f"{cell.ms_per_sample:.3g} ({spread}) · {cell.mib_per_sample:.3g}"


def plot(cells: list[Cell], seconds: dict, path: Path) -> None:
    """Per (problem, quantity): time and memory per sample vs N; and the rank study."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys((cell.problem, cell.quantity) for cell in cells))
    rows = len(groups) + bool(seconds)
    figure, axes = plt.subplots(rows, 2, figsize=(10, 3 * rows), squeeze=False)
    for row, (problem, quantity) in enumerate(groups):
        for column, (field, label) in enumerate(
            (("ms_per_sample", "ms / sample"), ("mib_per_sample", "peak MiB / sample"))
        ):
            ax = axes[row][column]
            for contender in dict.fromkeys(cell.contender for cell in cells):
                points = [
                    (cell.n, getattr(cell, field))
                    for cell in cells
                    if (cell.problem, cell.quantity, cell.contender)
                    == (problem, quantity, contender)
                    and getattr(cell, field)
                ]
                if points:
                    ax.plot(*zip(*points), marker="o", label=contender)
            ax.set(xscale="log", yscale="log", xlabel="batch size N", ylabel=label)
            ax.set_title(f"{problem}, {quantity}")
            ax.legend(fontsize="small")
    if seconds:
        ax = axes[-1][0]
        ax.bar([str(r) for r in seconds], list(seconds.values()))
        ax.set(xlabel="gloo ranks", ylabel="seconds", title="diag_ggn over a fixed MLP dataset")
        axes[-1][1].axis("off")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="batch sizes 8, 16; 2 repeats")
    parser.add_argument("--problems", default=",".join(FACTORIES), help=f"from {list(FACTORIES)}")
    parser.add_argument("--quantities", default=",".join(QUANTITIES))
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--sizes", default="", help="comma-separated batch sizes")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--processes", type=int, default=3, help="fresh processes per cell")
    parser.add_argument(
        "--alone", action="store_true", help="each contender in fresh processes of its own"
    )
    parser.add_argument("--ranks", default="1,2", help="gloo rank counts ('' to skip)")
    parser.add_argument("--rank-samples", type=int, default=2048)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", default=str(Path(__file__).with_name("scaling")))
    args = parser.parse_args(argv)
    problems = [name.strip() for name in args.problems.split(",") if name.strip()]
    unknown = set(problems) - set(FACTORIES)
    if unknown:
        raise SystemExit(f"unknown problems {sorted(unknown)}; choose from {list(FACTORIES)}")
    sizes = QUICK_BATCH_SIZES if args.quick else BATCH_SIZES
    if args.sizes:
        sizes = tuple(int(n) for n in args.sizes.split(","))
    repeats = 2 if args.quick else args.repeats
    cells = batch_size_study(
        problems,
        args.quantities.split(","),
        sizes,
        args.contenders.split(","),
        args.device,
        repeats,
        args.threads,
        1 if args.quick else args.processes,
        alone=args.alone,
    )
    rank_counts = tuple(int(r) for r in args.ranks.split(",") if r)
    samples = 256 if args.quick else args.rank_samples
    seconds = rank_study(rank_counts, samples, repeats, args.threads) if rank_counts else {}
    processes = 1 if args.quick else args.processes
    per = "contender (each alone)" if args.alone else "row"
    conditions = (
        f"{args.device}, {args.threads} threads, torch {torch.__version__}, in each of "
        f"{processes} fresh processes per {per} the median of {repeats} calls, "
        f"python {sys.version.split()[0]}"
    )
    out = Path(args.out)
    out.with_suffix(".md").write_text(markdown(cells, seconds, conditions))
    with out.with_suffix(".csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(asdict(cells[0])))
        writer.writeheader()
        writer.writerows(asdict(cell) for cell in cells)
    plot(cells, seconds, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.md')}, .csv and .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
