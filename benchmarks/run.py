"""Time packfunc beside its peers on CPU and print a markdown table.

Usage (from the repository root)::

    python benchmarks/run.py              # up to 20 repeats per cell (5 at least)
    python benchmarks/run.py --quick      # 5 repeats
    python benchmarks/run.py --only cnn   # rows whose "problem quantity" contains "cnn"

Rows are ``problem x quantity``; each cell is the median wall-clock time of
the full forward + backward (+ reduction) that produces the quantity from
``X, y``; a row's contenders are timed in interleaved rounds, and slow rows
get fewer rounds (``--budget`` seconds per row, at least 5) so that the full
run stays within a few minutes. The last column checks (untimed, once per row) that packfunc's
result matches BackPACK's. Extend via ``QUANTITIES`` here and the builders
in ``peers.py``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from importlib import metadata

import torch

from peers import BUILDERS, REFERENCE, SHIM, SUBJECT, UNCHECKED, Closure, Result, build_all
from problems import PROBLEMS, Problem
from timing import agrees, cpu_model, time_interleaved

THREADS = 2

FIRST_ORDER = ["grad", "batch_grad", "batch_l2_grad", "sum_grad_squared", "variance"]
GGN = ["diag_ggn", "diag_ggn_mc", "batch_diag_ggn", "batch_diag_ggn_mc"]
KRONECKER = ["kfac", "kflr"]
QUANTITIES = {
    "MLP": FIRST_ORDER + GGN + KRONECKER + ["kfra"],
    "CNN": FIRST_ORDER + GGN + KRONECKER,
    "tanh MLP": ["diag_hessian"],
}
"""Quantities per problem, in table order; ``grad`` is the plain-backward reference row,
``*_mc`` rows and ``kfac`` draw one Monte-Carlo sample (their check compares shapes only)."""

LABELS = {"grad": "grad (ref: loss.backward)"}
"""Display names for quantities whose key is not self-explanatory."""

DISTRIBUTIONS = {
    "packfunc": "packfunc",
    "BackPACK": "backpack-for-pytorch",
    "opacus": "opacus",
    "curvlinops": "curvlinops-for-pytorch",
}
"""Contender -> installed distribution, for the version line."""


def stochastic(quantity: str) -> bool:
    """Monte-Carlo quantities: their check compares shapes only."""
    return quantity.endswith("_mc") or quantity == "kfac"


@dataclass
class Row:
    """One table row: a problem, a quantity and the contenders that compute it."""

    problem: str
    quantity: str
    contenders: dict[str, Closure]
    notes: dict[str, str] = field(default_factory=dict)
    """Why a registered contender has no closure (``n/a``, not installed)."""

    @property
    def key(self) -> str:
        """The text ``--only`` is matched against."""
        return f"{self.problem} {self.quantity}"


@dataclass
class Outcome:
    """Timings and the check for one row."""

    ms: dict[str, float] = field(default_factory=dict)
    repeats: int = 0
    errors: dict[str, str] = field(default_factory=dict)
    matches: bool | None = None
    peer_mismatches: list[str] = field(default_factory=list)


def registry(problems: list[Problem], quantities: dict[str, list[str]]) -> list[Row]:
    rows = []
    for problem in problems:
        for quantity in quantities[problem.name]:
            closures, notes = build_all(problem, quantity)
            rows.append(Row(problem.name, quantity, closures, notes))
    return rows


def measure(row: Row, repeats: int, warmup: int, budget_s: float | None) -> Outcome:
    """Check once (untimed, also the first warm-up), then time the contenders of ``row``."""
    outcome = Outcome()
    results: dict[str, Result] = {}
    for name, closure in row.contenders.items():
        try:
            results[name] = closure()
        except Exception as error:  # a contender failing must not stop the table
            outcome.errors[name] = f"{type(error).__name__}: {error}"
    reference = results.get(REFERENCE)
    if reference is not None:
        for name, result in results.items():
            if name == REFERENCE or name in UNCHECKED:
                continue
            ok = agrees(result, reference, shapes_only=stochastic(row.quantity))
            if name == SUBJECT:
                outcome.matches = ok
            elif not ok:
                outcome.peer_mismatches.append(name)
    del results, reference
    working = {name: fn for name, fn in row.contenders.items() if name not in outcome.errors}
    timed = time_interleaved(working, repeats, max(warmup - 1, 0), budget_s)
    outcome.ms = {name: ms for name, (ms, _) in timed.items()}
    outcome.repeats = max((n for _, n in timed.values()), default=0)
    return outcome


def table(rows: list[Row], outcomes: list[Outcome]) -> list[str]:
    names = list(BUILDERS)
    header = (
        ["problem", "quantity"]
        + [f"{name} ms" for name in names]
        + [
            "best peer",
            f"ratio ({SUBJECT} / best peer)",
            f"{SHIM} / {REFERENCE}",
            f"{SUBJECT} = {REFERENCE}",
        ]
    )
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join(["---"] * 2 + ["--:"] * (len(names)) + ["---", "--:", "--:", ":-:"]) + "|",
    ]
    for row, outcome in zip(rows, outcomes):
        cells = [row.problem, LABELS.get(row.quantity, row.quantity)]
        for name in names:
            if name in outcome.ms:
                cells.append(f"{outcome.ms[name]:.2f}")
            else:
                cells.append("error" if name in outcome.errors else "—")
        peers = {name: ms for name, ms in outcome.ms.items() if name not in (SUBJECT, SHIM)}
        best = min(peers, key=peers.__getitem__) if peers else None
        cells.append(best or "—")
        if best is not None and SUBJECT in outcome.ms:
            cells.append(f"{outcome.ms[SUBJECT] / peers[best]:.2f}×")
        else:
            cells.append("—")
        if SHIM in outcome.ms and REFERENCE in outcome.ms:
            cells.append(f"{outcome.ms[SHIM] / outcome.ms[REFERENCE]:.2f}×")
        else:
            cells.append("—")
        cells.append({True: "✓", False: "✗", None: "—"}[outcome.matches])
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def versions() -> str:
    found = []
    for name, distribution in DISTRIBUTIONS.items():
        try:
            found.append(f"{name} {metadata.version(distribution)}")
        except metadata.PackageNotFoundError:
            found.append(f"{name} not installed")
    return ", ".join(found)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 repeats instead of 20")
    parser.add_argument(
        "--only",
        default="",
        metavar="SUBSTRING",
        help="only rows whose 'problem quantity' contains this (case-insensitive)",
    )
    parser.add_argument("--repeats", type=int, default=None, help="override the repeat count")
    parser.add_argument(
        "--budget",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="timed seconds per row before repeats are cut (default 10)",
    )
    args = parser.parse_args(argv)
    repeats = args.repeats or (5 if args.quick else 20)
    warmup = 2
    budget_s = None if args.quick or args.repeats else args.budget

    torch.set_num_threads(THREADS)
    caught: dict[str, int] = {}
    start, load = time.perf_counter(), os.getloadavg()
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        rows = [
            row
            for row in registry([make() for make in PROBLEMS], QUANTITIES)
            if args.only.lower() in row.key.lower()
        ]
        if not rows:
            print(f"no row matches --only {args.only!r}", file=sys.stderr)
            return 2
        outcomes = []
        for row in rows:
            print(f"timing {row.key} ...", file=sys.stderr, flush=True)
            outcomes.append(measure(row, repeats, warmup, budget_s))
    for record in records:
        message = str(record.message).split(". ")[0]
        text = f"{record.category.__name__}: {message} ({record.filename}:{record.lineno})"
        caught[text] = caught.get(text, 0) + 1

    counts = sorted({outcome.repeats for outcome in outcomes})
    span = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}–{counts[-1]}"
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU: {cpu_model()}; "
        f"{versions()}; float32, CrossEntropyLoss(mean); median of {span} interleaved "
        f"repeats after {warmup} warm-up runs; load average at start {load[0]:.1f}, "
        f"at end {os.getloadavg()[0]:.1f}"
    )
    print()
    print("\n".join(table(rows, outcomes)))
    print()
    if any(row.quantity == "grad" for row in rows):
        print(
            f"Reference rows ({LABELS['grad']}): {REFERENCE} column = plain "
            "`loss.backward()` on an unextended model; vmap(grad) = `torch.func.grad` of the "
            f"mean loss; {SUBJECT} = `compute(quantities=('grad',))`."
        )
    for row, outcome in zip(rows, outcomes):
        if outcome.repeats < repeats:
            print(f"- {row.key}: {outcome.repeats} repeats (time budget)")
        for name, error in outcome.errors.items():
            print(f"- {row.key}: {name} failed: {error}")
        for name in outcome.peer_mismatches:
            print(f"- {row.key}: {name} disagrees with {REFERENCE}")
        for name, note in row.notes.items():
            if note != "n/a":
                print(f"- {row.key}: {name} {note}")
    for text, count in caught.items():
        print(f"- warning ×{count}: {text}")
    print(f"\n(total {time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
