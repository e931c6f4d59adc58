"""Time laplace-torch's ``Laplace(...).fit(loader)`` with each curvature backend.

Usage (from the repository root)::

    python benchmarks/laplace_fit.py                 # every model, structure and backend
    python benchmarks/laplace_fit.py --quick         # small data, 3 fits per cell
    python benchmarks/laplace_fit.py --models "small MLP" --structures diag,full

A cell is ``(model, hessian structure, backend)``: ``Laplace(model, "classification",
subset_of_weights="all", hessian_structure=S, backend=B)`` is built and fitted on a loader
(512 samples in batches of 128) once as a warm-up, then ``--repeats`` times; the cell's
figure is the median wall-clock time of construction + ``fit`` (and its min–max spread).
Every cell runs in a fresh Python process, so no backend inherits another's caches or
memory. Rows pair backends of one kind (GGN or empirical Fisher, EF); the ratio is
packfunc's median over the fastest other backend's. Untimed, each row also checks that
packfunc's Hessian ``la.H`` equals the BackPACK backend's where both run (a mismatch
makes the exit status 1). Backends whose library is missing (ASDL: the PyPI package
``asdl`` is another project; install it from GitHub) show ``—``; those that refuse a
structure show ``error``, with the reason below the table.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
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


def time_cell(
    model: str,
    structure: str,
    key: str,
    samples: int,
    batch_size: int,
    repeats: int,
    threads: int = THREADS,
) -> dict[str, object]:
    """One warm-up fit, then ``repeats`` timed fits (construction + ``fit``), in this process.

    Returns:
        ``{"ms": [times]}``, or ``{"error": reason}`` (``"unavailable"`` set when the
        backend's library is missing).
    """
    torch.set_num_threads(threads)
    try:
        backend = backend_class(key)
    except ImportError as error:
        return {"error": str(error), "unavailable": True}
    net, loader = problem(model, samples, batch_size)
    try:
        fit(net, loader, structure, backend)
    except Exception as error:  # a backend refusing a model or structure
        return {"error": f"{type(error).__name__}: {first_line(error)}"}
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        la = fit(net, loader, structure, backend)
        times.append(1e3 * (time.perf_counter() - start))
        del la
    return {"ms": times}


def first_line(error: BaseException, limit: int = 110) -> str:
    """The first line of an error message, cut to ``limit`` characters.

    Example:
        >>> first_line(ValueError("one line" + chr(10) + "and more"))
        'one line'
    """
    text = (str(error).strip().splitlines() or [""])[0]
    return text if len(text) <= limit else text[: limit - 1] + "…"


def run_cell_in_fresh_process(
    model: str,
    structure: str,
    key: str,
    samples: int,
    batch_size: int,
    repeats: int,
    threads: int = THREADS,
    timeout_s: float | None = None,
) -> dict[str, object]:
    """:func:`time_cell` in a new Python process; its JSON answer.

    A cell still running after ``timeout_s`` seconds is stopped and reported as an error.
    """
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--cell",
        json.dumps([model, structure, key, samples, batch_size, repeats, threads]),
    ]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, check=False, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out: over {timeout_s:.0f} s for the warm-up and timed fits"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"process failed ({done.returncode}): {tail}"}
    answer: dict[str, object] = json.loads(lines[-1])
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
        help="stop a cell (one backend's warm-up and timed fits) after this (default 600)",
    )
    parser.add_argument("--cell", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.cell is not None:  # the child process of one cell
        warnings.simplefilter("ignore")
        print(json.dumps(time_cell(*json.loads(args.cell))))
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
                cells = {}
                for key in keys:
                    if BACKENDS[key].kind != kind:
                        continue
                    print(f"timing {model} {structure} {key} ...", file=sys.stderr, flush=True)
                    cell = run_cell_in_fresh_process(
                        model,
                        structure,
                        key,
                        samples,
                        batch_size,
                        repeats,
                        args.threads,
                        args.cell_timeout,
                    )
                    cells[BACKENDS[key].column] = cell
                if not cells:
                    continue
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    check = check_against_backpack(model, structure, kind, samples, batch_size)
                rows.append(Row(model, structure, kind, cells, check))
    print(
        f"torch {torch.__version__}, {args.threads} threads, CPU ({cpu_model()}); "
        f"{versions()}; float32; "
        f"{samples} samples in batches of {batch_size}; each cell in a fresh process: "
        f"median (min–max) of {repeats} timed fits (Laplace(...) + fit) after 1 warm-up fit; "
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
