"""Time laplace-torch's ``Laplace(...).fit(loader)`` with each curvature backend.

Usage (from the repository root)::

    python benchmarks/laplace_fit.py                 # every model, structure and backend
    python benchmarks/laplace_fit.py --quick         # small data, 3 fits per cell
    python benchmarks/laplace_fit.py --models "small MLP" --structures diag,full

A cell is ``(model, hessian structure, backend)``: ``Laplace(model, "classification",
subset_of_weights="all", hessian_structure=S, backend=B)`` is built and fitted on a loader
(512 samples in batches of 128); the cell's figure is the median wall-clock time of
construction + ``fit`` (and its min–max spread) over ``--repeats`` timed fits. A row pairs
the backends of one kind (GGN or empirical Fisher, EF) and runs in one fresh Python process
(no row inherits another's caches or memory): each backend gets its own copy of the seeded
model (BackPACK's hooks stay on its own), is fitted once as a warm-up, and then the
backends' timed fits are interleaved, round by round, so that they all see the same machine
(on a shared VM, separate processes moved a cell by 1.5×). The ratio is packfunc's median
over the fastest other backend's. Untimed, each row also checks that packfunc's Hessian
``la.H`` equals the BackPACK backend's where both run (a mismatch makes the exit status 1).
Backends whose library is missing (ASDL: the PyPI package ``asdl`` is another project;
install it from GitHub) show ``—``; those that refuse a structure, or whose warm-up fit is
too slow for ``--cell-timeout``, show ``error``, with the reason below the table.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from timing import cpu_model

THREADS = 2
SEED = 0


@dataclass(frozen=True)
class Backend:
    """A laplace-torch curvature backend: its display column, kind and import path."""

    column: str
    kind: str
    module: str
    name: str


BACKENDS = {
    "BackPackGGN": Backend("BackPACK", "GGN", "laplace.curvature", "BackPackGGN"),
    "CurvlinopsGGN": Backend("curvlinops", "GGN", "laplace.curvature", "CurvlinopsGGN"),
    "AsdlGGN": Backend("ASDL", "GGN", "laplace.curvature.asdl", "AsdlGGN"),
    "PackfuncGGN": Backend("packfunc", "GGN", "packfunc.integrations.laplace", "PackfuncGGN"),
    "BackPackEF": Backend("BackPACK", "EF", "laplace.curvature", "BackPackEF"),
    "CurvlinopsEF": Backend("curvlinops", "EF", "laplace.curvature", "CurvlinopsEF"),
    "AsdlEF": Backend("ASDL", "EF", "laplace.curvature.asdl", "AsdlEF"),
    "PackfuncEF": Backend("packfunc", "EF", "packfunc.integrations.laplace", "PackfuncEF"),
}
"""Backend key (laplace's class name) -> how to find it."""

SUBJECT = "packfunc"
COLUMNS = ["BackPACK", "curvlinops", "ASDL", SUBJECT]
"""The table's backend columns, in order."""


def mlp() -> nn.Module:
    """The benchmark MLP of ``run.py``: 784-256-256-10, ReLU (269,322 parameters)."""
    return nn.Sequential(
        nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
    )


def small_mlp() -> nn.Module:
    """A 64-32-10 tanh MLP (2,410 parameters): small enough for ``full``."""
    return nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))


def small_cnn() -> nn.Module:
    """Two conv + ReLU + max-pool stages (8, 16 channels) and a linear head on 3×16×16."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * 4 * 4, 10),
    )


@dataclass(frozen=True)
class Model:
    """A benchmark model, the shape of one input and the structures it is fitted with."""

    make: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    structures: tuple[str, ...]


MODELS = {
    "MLP": Model(mlp, (784,), ("diag", "kron")),
    "small MLP": Model(small_mlp, (64,), ("diag", "kron", "full")),
    "CNN": Model(small_cnn, (3, 16, 16), ("diag", "kron")),
}
"""Model name -> model; ``full`` only where its ``P × P`` matrix is small."""


def problem(model: str, samples: int, batch_size: int) -> tuple[nn.Module, DataLoader]:
    """The seeded model and a loader of random inputs with 10 random classes.

    Args:
        model: A key of :data:`MODELS`.
        samples: Data-set size.
        batch_size: The loader's batch size.

    Returns:
        ``(model, loader)``.

    Example:
        >>> net, loader = problem("small MLP", 8, 4)
        >>> [tuple(x.shape) for x, _ in loader]
        [(4, 64), (4, 64)]
    """
    spec = MODELS[model]
    torch.manual_seed(SEED)
    net = spec.make()
    X = torch.randn(samples, *spec.input_shape)
    y = torch.randint(0, 10, (samples,))
    return net, DataLoader(TensorDataset(X, y), batch_size=batch_size)


def backend_class(key: str) -> type:
    """Laplace's (or packfunc's) backend class ``key``.

    Raises:
        ImportError: if its library is not installed (ASDL: ``asdl`` from GitHub).
    """
    backend = BACKENDS[key]
    if backend.column == "ASDL" and importlib.util.find_spec("asdl.fisher") is None:
        raise ImportError("ASDL (`asdl`, github.com/kazukiosawa/asdl) is not installed")
    found = getattr(importlib.import_module(backend.module), backend.name, None)
    if found is None:
        raise ImportError(f"{backend.module} has no {backend.name}")
    return found


def fit(model: nn.Module, loader: DataLoader, structure: str, backend: type) -> object:
    """``Laplace(model, "classification", ...)`` with all weights, fitted on ``loader``."""
    from laplace import Laplace

    la = Laplace(
        model,
        "classification",
        subset_of_weights="all",
        hessian_structure=structure,
        backend=backend,
    )
    la.fit(loader)
    return la


def hessian_tensors(la: object) -> list[Tensor]:
    """The tensors of a fitted Laplace's ``H``: the diagonal, the matrix or the Kronecker factors.

    For ``kron``, the factors before laplace's eigendecomposition (``H_facs``).

    Example:
        >>> import types
        >>> [t.shape for t in hessian_tensors(types.SimpleNamespace(H=torch.ones(3)))]
        [torch.Size([3])]
    """
    H = getattr(la, "H_facs", None) or la.H  # type: ignore[attr-defined]
    if isinstance(H, Tensor):
        return [H]
    return [factor for block in H.kfacs for factor in block]


def relative_difference(values: list[Tensor], reference: list[Tensor]) -> float:
    """The largest ``max |a - b| / max |b|`` over paired tensors (``inf`` if shapes differ).

    Example:
        >>> round(relative_difference([torch.tensor([1.0, 2.1])], [torch.tensor([1.0, 2.0])]), 6)
        0.05
    """
    if len(values) != len(reference):
        return float("inf")
    worst = 0.0
    for value, ref in zip(values, reference):
        if value.shape != ref.shape:
            return float("inf")
        scale = ref.abs().max().item() or 1.0
        worst = max(worst, (value.double() - ref.double()).abs().max().item() / scale)
    return worst


def time_row(
    model: str,
    structure: str,
    keys: list[str],
    samples: int,
    batch_size: int,
    repeats: int,
    threads: int = THREADS,
    cell_timeout: float = 600.0,
) -> dict[str, dict[str, object]]:
    """Warm up each backend, then interleave ``repeats`` rounds of one timed fit each.

    Args:
        model: A key of :data:`MODELS`.
        structure: ``"diag"``, ``"kron"`` or ``"full"``.
        keys: Backends (keys of :data:`BACKENDS`) of the row.
        samples: Data-set size.
        batch_size: The loader's batch size.
        repeats: Timed fits per backend.
        threads: Torch threads.
        cell_timeout: Seconds a backend's warm-up and timed fits may take together: a
            warm-up fit over ``cell_timeout / (repeats + 1)`` drops the backend.

    Returns:
        Display column -> ``{"ms": [times]}``, or ``{"error": reason}`` (with
        ``"unavailable"`` set when the backend's library is missing).
    """
    torch.set_num_threads(threads)
    cells: dict[str, dict[str, object]] = {}
    ready: dict[str, tuple[type, nn.Module, DataLoader]] = {}
    for key in keys:
        column = BACKENDS[key].column
        try:
            backend = backend_class(key)
        except ImportError as error:
            cells[column] = {"error": str(error), "unavailable": True}
            continue
        net, loader = problem(model, samples, batch_size)
        budget = cell_timeout / (repeats + 1)
        try:
            with alarm_after(budget):
                fit(net, loader, structure, backend)
        except TimeoutError:
            cells[column] = {"error": f"too slow: one fit takes over {budget:.0f} s"}
            continue
        except Exception as error:  # a backend refusing a model or structure
            cells[column] = {"error": f"{type(error).__name__}: {first_line(error)}"}
            continue
        ready[column] = (backend, net, loader)
        cells[column] = {"ms": []}
    for _ in range(repeats):
        for column, (backend, net, loader) in ready.items():
            start = time.perf_counter()
            la = fit(net, loader, structure, backend)
            cells[column]["ms"].append(1e3 * (time.perf_counter() - start))  # type: ignore[union-attr]
            del la
    return cells


@contextlib.contextmanager
def alarm_after(seconds: float) -> Iterator[None]:
    """Raise ``TimeoutError`` in the block after ``seconds`` (``SIGALRM``; no-op without it).

    Example:
        >>> with alarm_after(5):
        ...     pass
    """
    if not hasattr(signal, "SIGALRM"):
        yield
        return

    def stop(signum: int, frame: object) -> None:
        raise TimeoutError

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def first_line(error: BaseException, limit: int = 110) -> str:
    """The first line of an error message, cut to ``limit`` characters.

    Example:
        >>> first_line(ValueError("one line" + chr(10) + "and more"))
        'one line'
    """
    text = (str(error).strip().splitlines() or [""])[0]
    return text if len(text) <= limit else text[: limit - 1] + "…"


def run_row_in_fresh_process(
    model: str,
    structure: str,
    keys: list[str],
    samples: int,
    batch_size: int,
    repeats: int,
    threads: int = THREADS,
    cell_timeout: float = 600.0,
) -> dict[str, dict[str, object]]:
    """:func:`time_row` in a new Python process; its JSON answer.

    A process that fails, or runs past every backend's ``cell_timeout`` together (a timed
    fit that hangs: only warm-ups are interrupted in the process), reports the failure in
    every one of the row's cells.
    """
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--row",
        json.dumps([model, structure, keys, samples, batch_size, repeats, threads, cell_timeout]),
    ]
    limit = cell_timeout * len(keys)
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=limit)
    except subprocess.TimeoutExpired:
        stopped: dict[str, object] = {"error": f"timed out: the row took over {limit:g} s"}
        return {BACKENDS[key].column: stopped for key in keys}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        failed: dict[str, object] = {"error": f"process failed ({done.returncode}): {tail}"}
        return {BACKENDS[key].column: failed for key in keys}
    answer: dict[str, dict[str, object]] = json.loads(lines[-1])
    return answer


def check_against_backpack(
    model: str, structure: str, kind: str, samples: int, batch_size: int
) -> float | None:
    """``max |H_packfunc - H_BackPACK| / max |H_BackPACK|`` for one row, or ``None``.

    ``None`` where either backend does not fit this structure.
    """
    try:
        fitted = []
        for key in (f"BackPack{kind}", f"Packfunc{kind}"):
            net, loader = problem(model, samples, batch_size)
            fitted.append(hessian_tensors(fit(net, loader, structure, backend_class(key))))
    except (ImportError, NotImplementedError, ValueError, RuntimeError):
        return None
    return relative_difference(fitted[1], fitted[0])


@dataclass
class Row:
    """One table row: a model, a structure, a backend kind and its cells."""

    model: str
    structure: str
    kind: str
    cells: dict[str, dict[str, object]]
    check: float | None = None


def summary(cell: dict[str, object]) -> str:
    """``"median (min–max)"`` in ms, ``"error"`` or ``"—"`` (library missing).

    Example:
        >>> summary({"ms": [3.0, 1.0, 2.0]})
        '2.0 (1.0–3.0)'
    """
    if "ms" in cell:
        times = cell["ms"]
        assert isinstance(times, list)
        return f"{statistics.median(times):.1f} ({min(times):.1f}–{max(times):.1f})"
    return "—" if cell.get("unavailable") else "error"


def median_ms(cell: dict[str, object]) -> float | None:
    """A cell's median in ms, or ``None`` where it has no times."""
    times = cell.get("ms")
    return statistics.median(times) if isinstance(times, list) and times else None


def table(rows: list[Row], tolerance: float) -> list[str]:
    """The markdown table: one line per row, the ratio to the fastest other backend."""
    header = ["model", "structure", "kind"] + [f"{c} ms" for c in COLUMNS]
    header += ["fastest peer", f"ratio ({SUBJECT} / fastest)", "H = BackPACK's"]
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join(["---"] * 3 + ["--:"] * len(COLUMNS) + ["---", "--:", ":-:"]) + "|",
    ]
    for row in rows:
        cells = [row.model, row.structure, row.kind]
        cells += [summary(row.cells[c]) if c in row.cells else "n/a" for c in COLUMNS]
        peers = {
            c: m
            for c, cell in row.cells.items()
            if c != SUBJECT and (m := median_ms(cell)) is not None
        }
        best = min(peers, key=peers.__getitem__) if peers else None
        subject = median_ms(row.cells.get(SUBJECT, {}))
        cells.append(best or "—")
        cells.append(f"{subject / peers[best]:.2f}×" if best and subject else "—")
        if row.check is None:
            cells.append("—")
        else:
            mark = "✓" if row.check <= tolerance else "✗ MISMATCH"
            cells.append(f"{mark} ({row.check:.1e})")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 samples, 3 timed fits")
    parser.add_argument("--models", default="", help=f"comma-separated, from {list(MODELS)}")
    parser.add_argument("--structures", default="", help="comma-separated: diag,kron,full")
    parser.add_argument("--backends", default="", help=f"comma-separated, from {list(BACKENDS)}")
    parser.add_argument("--repeats", type=int, default=None, help="timed fits (default 7)")
    parser.add_argument("--samples", type=int, default=None, help="data-set size (default 512)")
    parser.add_argument("--batch-size", type=int, default=None, help="(default 128)")
    parser.add_argument(
        "--threads", type=int, default=THREADS, help=f"torch threads (default {THREADS})"
    )
    parser.add_argument(
        "--cell-timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="a backend's budget for its warm-up and timed fits: one whose warm-up fit takes "
        "over SECONDS / (repeats + 1) is dropped (default 600)",
    )
    parser.add_argument("--row", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.row is not None:  # the child process of one row
        warnings.simplefilter("ignore")
        print(json.dumps(time_row(*json.loads(args.row))))
        return 0
    samples = args.samples or (64 if args.quick else 512)
    batch_size = args.batch_size or (32 if args.quick else 128)
    repeats = args.repeats or (3 if args.quick else 7)
    models = chosen(args.models, list(MODELS), "model")
    structures = chosen(args.structures, ["diag", "kron", "full"], "structure")
    keys = chosen(args.backends, list(BACKENDS), "backend")
    tolerance = 1e-4
    torch.set_num_threads(args.threads)  # for the untimed checks

    start, load = time.perf_counter(), os.getloadavg()
    rows = []
    for model in models:
        for structure in MODELS[model].structures:
            if structure not in structures:
                continue
            for kind in ("GGN", "EF"):
                row_keys = [key for key in keys if BACKENDS[key].kind == kind]
                if not row_keys:
                    continue
                print(f"timing {model} {structure} {kind} ...", file=sys.stderr, flush=True)
                cells = run_row_in_fresh_process(
                    model,
                    structure,
                    row_keys,
                    samples,
                    batch_size,
                    repeats,
                    args.threads,
                    args.cell_timeout,
                )
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    check = check_against_backpack(model, structure, kind, samples, batch_size)
                rows.append(Row(model, structure, kind, cells, check))
    print(
        f"torch {torch.__version__}, {args.threads} threads, CPU ({cpu_model()}); "
        f"{versions()}; float32; "
        f"{samples} samples in batches of {batch_size}; each row in a fresh process, its "
        f"backends' fits interleaved: median (min–max) of {repeats} timed fits "
        f"(Laplace(...) + fit) after 1 warm-up fit; "
        f"load average at start {load[0]:.1f}, at end {os.getloadavg()[0]:.1f}"
    )
    print()
    print("\n".join(table(rows, tolerance)))
    print()
    mismatches = []
    for row in rows:
        for column, cell in row.cells.items():
            if "error" in cell:
                print(f"- {row.model} {row.structure} {row.kind}: {column}: {cell['error']}")
        if row.check is not None and row.check > tolerance:
            mismatches.append(
                f"!! MISMATCH {row.model} {row.structure} {row.kind}: packfunc's H differs from "
                f"BackPACK's by {row.check:.2e} of its largest entry"
            )
    for line in mismatches:
        print(line)
    print(f"\n(total {time.perf_counter() - start:.0f} s)")
    return 1 if mismatches else 0


def chosen(text: str, known: list[str], what: str) -> list[str]:
    """The comma-separated names in ``text`` (all of ``known`` for ``""``), checked.

    Example:
        >>> chosen("diag", ["diag", "kron"], "structure")
        ['diag']
    """
    if not text:
        return known
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in known]
    if unknown:
        raise SystemExit(f"unknown {what}(s) {unknown}; choose from: {', '.join(known)}")
    return names


def versions() -> str:
    """Installed versions of laplace-torch and the backends' libraries."""
    from importlib import metadata

    found = []
    for name in ("laplace-torch", "backpack-for-pytorch", "curvlinops-for-pytorch", "packfunc"):
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            found.append(f"{name} not installed")
    return ", ".join(found)


if __name__ == "__main__":
    sys.exit(main())
