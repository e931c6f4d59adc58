"""Time packfunc beside its peers on CPU and print a markdown table.

Usage (from the repository root)::

    python benchmarks/run.py              # up to 20 repeats per cell (5 at least)
    python benchmarks/run.py --quick      # 5 repeats
    python benchmarks/run.py --only cnn   # rows whose "problem quantity" contains "cnn"
    python benchmarks/run.py --problems LM,ResNet-GN --quick
    python benchmarks/run.py --device cuda

Rows are ``problem x quantity``; each cell is the median wall-clock time of
the full forward + backward (+ reduction) that produces the quantity from
``X, y``; a row's contenders are timed in interleaved rounds, and slow rows
get fewer rounds (``--budget`` seconds per row, at least 5) so that the full
run stays within a few minutes. Beside the times, packfunc's peak memory of one call
and the least any peer needs (``memory.py``: tensor storage alive at once on CPU, CUDA's
peak allocation on GPU). The last column checks (untimed, once per row) that packfunc's
result matches the row's reference (BackPACK where it runs, else ``vmap(grad)``,
the brute-force Hessian diagonal or curvlinops; see ``REFERENCES`` in
``peers.py``); a mismatch is printed as a ``MISMATCH`` line and makes the exit
status 1. Extend via ``QUANTITIES`` here and the builders in ``peers.py``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata

import torch
from torch import Tensor

from memory import peak_bytes
from peers import (
    BUILDERS,
    EKFAC_QUANTITIES,
    NOT_PEERS,
    PLAIN,
    REFERENCES,
    SHAPES_ONLY,
    SHIM,
    SUBJECT,
    UNCHECKED,
    Closure,
    Result,
    build_all,
)
from problems import PROBLEMS, Problem
from timing import agrees, cpu_model, discrepancy, eigen_products, time_interleaved

THREADS = 2

Sync = Callable[[], None]
"""Waits for queued device work (``torch.cuda.synchronize``; a no-op on CPU)."""

FIRST_ORDER = ["grad", "batch_grad", "batch_l2_grad", "sum_grad_squared", "variance"]
GGN = ["diag_ggn", "diag_ggn_mc", "batch_diag_ggn", "batch_diag_ggn_mc"]
KRONECKER = ["kfac", "kflr"]
EKFAC = list(EKFAC_QUANTITIES)
MODERN = ["batch_grad", "batch_l2_grad", "diag_ggn_mc", "kfac"]
QUANTITIES = {
    "MLP": FIRST_ORDER + GGN + KRONECKER + ["kfra"] + EKFAC,
    "CNN": FIRST_ORDER + GGN + KRONECKER + EKFAC,
    "tanh MLP": ["diag_hessian"],
    "LM": MODERN + ["ekfac"],
    "ResNet-GN": MODERN,
    "ResNet-BN": MODERN,
    "LSTM": ["kfac"],
    "ResNet-BN 5k": ["diag_hessian"],
    "GPT-2": ["grad", "batch_grad", "batch_l2_grad", "diag_ggn_mc"],
    "LLaMA": ["grad", *MODERN],
    "BERT (mask)": ["grad", *MODERN],
}
"""Quantities per problem, in table order; ``grad`` is the plain-backward reference row,
``*_mc`` rows, ``kfac`` and ``ekfac`` draw one Monte-Carlo sample (their check compares
shapes only); ``ekfac_exact`` uses the exact square-root columns (KFLR basis, curvlinops'
``fisher_type="type-2"``)."""

LABELS = {
    "grad": "grad (ref: loss.backward)",
    "kfac": "kfac (Linear/Conv2d)",
    "ekfac": "ekfac (MC, Linear/Conv2d)",
    "ekfac_exact": "ekfac_exact (type-2)",
}
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
    return quantity.endswith("_mc") or quantity in ("kfac", "ekfac")


@dataclass
class Row:
    """One table row: a problem, a quantity and the contenders that compute it."""

    problem: str
    quantity: str
    contenders: dict[str, Closure]
    notes: dict[str, str] = field(default_factory=dict)
    """Why a registered contender has no closure (``n/a``, not installed, refused)."""
    max_repeats: int | None = None
    """A cap on the timed repeats (expensive problems)."""
    expand: bool = False
    """Kronecker rows in curvlinops' ``"expand"`` convention: input factors compared by value."""

    @property
    def key(self) -> str:
        """The text ``--only`` is matched against."""
        return f"{self.problem} {self.quantity}"


@dataclass
class Outcome:
    """Timings and the check for one row."""

    ms: dict[str, float] = field(default_factory=dict)
    mib: dict[str, float] = field(default_factory=dict)
    """Peak memory of one call (``memory.peak_bytes``), in MiB."""
    repeats: int = 0
    errors: dict[str, str] = field(default_factory=dict)
    matches: bool | None = None
    reference: str | None = None
    mismatch: str = ""
    """How packfunc's result differs from the reference (empty when it matches)."""
    peer_mismatches: list[str] = field(default_factory=list)


def registry(
    problems: list[Problem], quantities: dict[str, list[str]], only: str = ""
) -> list[Row]:
    """The rows whose ``"problem quantity"`` contains ``only`` (case-insensitive), built."""
    rows = []
    for problem in problems:
        for quantity in quantities[problem.name]:
            if only.lower() not in f"{problem.name} {quantity}".lower():
                continue
            closures, notes = build_all(problem, quantity)
            expand = problem.kfac_approx == "expand"
            rows.append(Row(problem.name, quantity, closures, notes, problem.max_repeats, expand))
    return rows


def input_factors(factors: dict[str, list[Tensor]]) -> dict[str, Tensor]:
    """The input (``B``, second) factor of each weight's ``[A, B]`` Kronecker factors."""
    return {name: pair[1] for name, pair in factors.items() if len(pair) == 2}


def compare(row: Row, name: str, result: Result, reference_name: str, reference: Result) -> str:
    """How contender ``name``'s result differs from the reference's; ``""`` if it agrees.

    Monte-Carlo rows and results in curvlinops' conventions are compared by shape;
    Kronecker rows in the ``"expand"`` convention also compare their (deterministic)
    input factors with curvlinops' by value; exact EKFAC rows compare each weight's
    ``(⊗ Q) diag(λ) (⊗ Q)ᵀ`` (applied to random probes, :func:`eigen_products`) and each
    entry's ``Σ λ`` by value.
    """
    pair = {name, reference_name}
    shapes_only = stochastic(row.quantity) or bool(pair & SHAPES_ONLY)
    if not agrees(result, reference, shapes_only=shapes_only):
        return discrepancy(result, reference)
    if row.expand and row.quantity in KRONECKER and pair & SHAPES_ONLY:
        inputs, expected = input_factors(result), input_factors(reference)
        if not agrees(inputs, expected):
            return "input factors: " + discrepancy(inputs, expected)
    if row.quantity == "ekfac_exact":
        weights = [name for name, entry in result.items() if len(entry) == 3]
        products = eigen_products({name: result[name] for name in weights})
        expected = eigen_products({name: reference[name] for name in weights})
        if not agrees(products, expected, rtol=EKFAC_RTOL, atol=EKFAC_RTOL):
            return "EKFAC products: " + discrepancy(products, expected)
        traces, expected = eigenvalue_sums(result), eigenvalue_sums(reference)
        if not agrees(traces, expected, rtol=EKFAC_RTOL):
            return "EKFAC traces: " + discrepancy(traces, expected)
    return ""


def eigenvalue_sums(result: Result) -> dict[str, Tensor]:
    """Each EKFAC entry's ``Σ λ``: the trace of its GGN block, whatever the basis.

    Biases are compared this way: packfunc (like BackPACK) takes a convolution bias's
    factor from its position-summed gradients, curvlinops from the layer's per-position
    output-gradient covariance, so their bases differ.
    """
    return {name: entry[0].double().sum() for name, entry in result.items()}


EKFAC_RTOL = 1e-3
"""Tolerance of exact EKFAC products (float32 eigenvectors of different ``eigh`` calls)."""


def check(row: Row, sync: Sync) -> Outcome:
    """Run every contender of ``row`` once (untimed) and compare it with the reference.

    Returns:
        The outcome without timings: errors, the reference, packfunc's match.
    """
    outcome = Outcome()
    results: dict[str, Result] = {}
    for name, closure in row.contenders.items():
        try:
            results[name] = closure()
        except Exception as error:  # a contender failing must not stop the table
            outcome.errors[name] = f"{type(error).__name__}: {error}"
    sync()
    outcome.reference = next((name for name in REFERENCES if name in results), None)
    if outcome.reference is not None:
        for name, result in results.items():
            if name == outcome.reference or name in UNCHECKED:
                continue
            difference = compare(row, name, result, outcome.reference, results[outcome.reference])
            if name == SUBJECT:
                outcome.matches, outcome.mismatch = not difference, difference
            elif difference:
                outcome.peer_mismatches.append(f"{name}: {difference}")
    return outcome


def measure(
    row: Row,
    repeats: int,
    warmup: int,
    budget_s: float | None,
    sync: Sync,
    device: torch.device | None = None,
) -> Outcome:
    """Check ``row`` once (untimed, the first warm-up), time it, then take peak memories.

    Each contender's peak memory comes from one more call (``memory.peak_bytes``).
    """
    outcome = check(row, sync)
    if row.max_repeats is not None:
        repeats, warmup = min(repeats, row.max_repeats), 1
    working = {name: fn for name, fn in row.contenders.items() if name not in outcome.errors}
    timed = time_interleaved(working, repeats, max(warmup - 1, 0), budget_s, sync=sync)
    outcome.ms = {name: ms for name, (ms, _) in timed.items()}
    outcome.repeats = max((n for _, n in timed.values()), default=0)
    where = device or torch.device("cpu")
    outcome.mib = {name: peak_bytes(fn, where) / 2**20 for name, fn in working.items()}
    return outcome


def table(rows: list[Row], outcomes: list[Outcome]) -> list[str]:
    names = list(BUILDERS)
    header = (
        ["problem", "quantity"]
        + [f"{name} ms" for name in names]
        + [
            "best peer",
            f"ratio ({SUBJECT} / best peer)",
            f"{SHIM} / BackPACK",
            f"{SUBJECT} MiB",
            "least-memory peer",
            f"memory ratio ({SUBJECT} / least)",
            f"{SUBJECT} = reference",
        ]
    )
    lines = [
        "| " + " | ".join(header) + " |",
        "|"
        + "|".join(
            ["---"] * 2 + ["--:"] * (len(names)) + ["---", "--:", "--:", "--:", "---", "--:", ":-:"]
        )
        + "|",
    ]
    for row, outcome in zip(rows, outcomes):
        cells = [row.problem, LABELS.get(row.quantity, row.quantity)]
        for name in names:
            if name in outcome.ms:
                cells.append(f"{outcome.ms[name]:.2f}")
            else:
                cells.append("error" if name in outcome.errors else "—")
        peers = {name: ms for name, ms in outcome.ms.items() if name not in NOT_PEERS}
        best = min(peers, key=peers.__getitem__) if peers else None
        cells.append(best or "—")
        if best is not None and SUBJECT in outcome.ms:
            cells.append(f"{outcome.ms[SUBJECT] / peers[best]:.2f}×")
        else:
            cells.append("—")
        if SHIM in outcome.ms and "BackPACK" in outcome.ms:
            cells.append(f"{outcome.ms[SHIM] / outcome.ms['BackPACK']:.2f}×")
        else:
            cells.append("—")
        cells.extend(_memory_cells(outcome))
        mark = {True: "✓", False: "✗ MISMATCH", None: "—"}[outcome.matches]
        cells.append(f"{mark} ({outcome.reference})" if outcome.matches is not None else mark)
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _memory_cells(outcome: Outcome) -> list[str]:
    """Packfunc's peak MiB, the peer that needs the least, and the ratio of the two."""
    mine = outcome.mib.get(SUBJECT)
    peers = {name: mib for name, mib in outcome.mib.items() if name not in NOT_PEERS}
    least = min(peers, key=peers.__getitem__) if peers else None
    if mine is None or least is None:
        return [f"{mine:.2f}" if mine is not None else "—", least or "—", "—"]
    ratio = mine / peers[least] if peers[least] > 0 else float("inf")
    return [f"{mine:.2f}", f"{least} {peers[least]:.2f}", f"{ratio:.2f}×"]


def versions() -> str:
    found = []
    for name, distribution in DISTRIBUTIONS.items():
        try:
            found.append(f"{name} {metadata.version(distribution)}")
        except metadata.PackageNotFoundError:
            found.append(f"{name} not installed")
    return ", ".join(found)


def select(problems: str) -> list[Problem]:
    """The problems named in a comma-separated list (case-insensitive); all for ``""``."""
    made = [make() for make in PROBLEMS]
    if not problems:
        return made
    wanted = {name.strip().lower() for name in problems.split(",") if name.strip()}
    unknown = wanted - {problem.name.lower() for problem in made}
    if unknown:
        known = ", ".join(problem.name for problem in made)
        raise SystemExit(f"unknown problem(s) {sorted(unknown)}; choose from: {known}")
    return [problem for problem in made if problem.name.lower() in wanted]


def synchronizer(device: torch.device) -> Sync:
    """``torch.cuda.synchronize`` for a CUDA device, else a no-op."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def hardware(device: torch.device) -> str:
    """The device the run is timed on, in words."""
    if device.type == "cuda":
        return f"GPU: {torch.cuda.get_device_name(device)}"
    return f"CPU: {cpu_model()}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 repeats instead of 20")
    parser.add_argument(
        "--only",
        default="",
        metavar="SUBSTRING",
        help="only rows whose 'problem quantity' contains this (case-insensitive)",
    )
    parser.add_argument(
        "--problems",
        default="",
        metavar="NAMES",
        help="comma-separated problem names, e.g. 'LM,ResNet-GN' (default: all)",
    )
    parser.add_argument("--repeats", type=int, default=None, help="override the repeat count")
    parser.add_argument(
        "--budget",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="timed seconds per row before repeats are cut (default 10)",
    )
    parser.add_argument("--device", default="cpu", help="'cpu' (default) or 'cuda'")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")
    repeats = args.repeats or (5 if args.quick else 20)
    warmup = 2
    budget_s = None if args.quick or args.repeats else args.budget
    sync = synchronizer(device)

    torch.set_num_threads(THREADS)
    caught: dict[str, int] = {}
    start, load = time.perf_counter(), os.getloadavg()
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        problems = [problem.to(device) for problem in select(args.problems)]
        rows = registry(problems, QUANTITIES, args.only)
        if not rows:
            print(f"no row matches --only {args.only!r}", file=sys.stderr)
            return 2
        outcomes = []
        for row in rows:
            print(f"timing {row.key} ...", file=sys.stderr, flush=True)
            outcomes.append(measure(row, repeats, warmup, budget_s, sync, device))
    for record in records:
        message = str(record.message).split(". ")[0]
        text = f"{record.category.__name__}: {message} ({record.filename}:{record.lineno})"
        caught[text] = caught.get(text, 0) + 1

    counts = sorted({outcome.repeats for outcome in outcomes})
    span = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}–{counts[-1]}"
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {hardware(device)}; "
        f"{versions()}; float32, CrossEntropyLoss(mean); median of {span} interleaved "
        f"repeats after {warmup} warm-up runs; load average at start {load[0]:.1f}, "
        f"at end {os.getloadavg()[0]:.1f}"
    )
    print()
    print("\n".join(table(rows, outcomes)))
    print()
    if any(row.quantity == "grad" for row in rows):
        print(
            f"Reference rows ({LABELS['grad']}): BackPACK and {PLAIN} columns = plain "
            "`loss.backward()` on an unextended model; vmap(grad) = `torch.func.grad` of the "
            f"mean loss; {SUBJECT} = `compute(quantities=('grad',))`."
        )
    if any(row.expand and row.quantity in KRONECKER for row in rows):
        print(
            "Kronecker rows checked against curvlinops (same 'expand' convention): the "
            "deterministic input factors B by value, the Monte-Carlo gradient factors A by shape."
        )
    if any(row.quantity in EKFAC for row in rows):
        print(
            "EKFAC rows (curvlinops' EKFACLinearOperator: factors, eigh, eigenvalue correction; "
            "'expand' convention): ekfac_exact weights checked by value as (⊗Q) diag(λ) (⊗Q)ᵀ on "
            "random probes, biases by Σλ (convolution biases: packfunc's factor is BackPACK's, "
            "from the position-summed gradients; curvlinops' is the layer's per-position one), "
            "the Monte-Carlo ekfac by shape."
        )
    mismatches = []
    for row, outcome in zip(rows, outcomes):
        if outcome.matches is False:
            mismatches.append(
                f"!! MISMATCH {row.key}: {SUBJECT} disagrees with {outcome.reference}: "
                f"{outcome.mismatch}"
            )
        if outcome.matches is None and SUBJECT in row.contenders:
            print(f"- {row.key}: {SUBJECT} unchecked (no reference ran)")
        if outcome.repeats < repeats:
            print(f"- {row.key}: {outcome.repeats} repeats (time budget or problem cap)")
        for name, error in outcome.errors.items():
            print(f"- {row.key}: {name} failed: {error}")
        for text in outcome.peer_mismatches:
            print(f"- {row.key}: disagrees with {outcome.reference}: {text}")
        for name, note in row.notes.items():
            if note != "n/a":
                print(f"- {row.key}: {name} {note}")
    for text, count in caught.items():
        print(f"- warning ×{count}: {text}")
    for line in mismatches:
        print(line)
        print(line, file=sys.stderr)
    print(f"\n(total {time.perf_counter() - start:.0f} s)")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
