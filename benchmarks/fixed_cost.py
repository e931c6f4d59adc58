"""The fixed cost of one call: models so small that their arithmetic costs next to nothing.

Small calls (the MLP's KFAC at N=8, a DP step of the 7 ms LM, any host-bound call on a GPU)
are where packfunc trails its peers, and a full benchmark's rows move 10–25 % between runs,
more than a change to that cost. Here each contender's time is its fixed cost alone —
Python, argument checks and the dispatch of every torch op — measured in one process, in
interleaved rounds, to about 2 % (quartiles printed). Beside the times, the Python function
calls and torch ops of one packfunc call, which do not depend on the machine at all.

Rows: the MLP of ``problems.mlp`` at width 4 (KFAC against curvlinops, per-sample gradients
against ``vmap(grad)`` and opacus), and one DP-SGD step of ``problems.lm`` at width 8, 4
tokens, 2 samples (plain training, packfunc's ``clipped_grad``, the hooks by hand of
``dp_step.py``).

Run: ``python benchmarks/fixed_cost.py [--rounds 500]``.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))

import dp_step  # noqa: E402
import problems  # noqa: E402
from peers import BUILDERS, Unavailable, Unsupported  # noqa: E402

Call = Callable[[], object]


def tiny_mlp() -> problems.Problem:
    """``problems.mlp``'s layers at width 4 on 8 inputs of 8 features, 3 classes."""
    torch.manual_seed(problems.SEED)
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 3))
    X, y = torch.randn(8, 8), torch.randint(0, 3, (8,))
    return problems.Problem("tiny MLP", model, X, y, kfac_approx="expand")


def quantity_calls(quantity: str, contenders: tuple[str, ...]) -> dict[str, Call]:
    """One closure per contender of ``peers.py`` that computes ``quantity`` on the tiny MLP."""
    found: dict[str, Call] = {}
    for contender in contenders:
        try:
            closure = BUILDERS[contender](tiny_mlp(), quantity)
        except (Unavailable, Unsupported):
            continue
        if closure is not None:
            found[contender] = closure
    return found


def dp_calls() -> dict[str, Call]:
    """One DP-SGD step per contender of ``dp_step.py`` on the tiny LM."""
    found: dict[str, Call] = {}
    for contender in ("plain", "packfunc", "hooks by hand"):
        problem = problems.lm(n=2, length=4, vocab=16, width=8)
        found[contender] = dp_step.BUILDERS[contender](problem.model(), problem.X, problem.y)
    return found


def timed(calls: dict[str, Call], rounds: int) -> dict[str, tuple[float, float, float]]:
    """Each call's median and quartiles in microseconds, over ``rounds`` interleaved rounds."""
    for _ in range(10):
        for call in calls.values():
            call()
    gc.collect()
    gc.freeze()
    times: dict[str, list[float]] = {name: [] for name in calls}
    try:
        for _ in range(rounds):
            for name, call in calls.items():
                start = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - start)
    finally:
        gc.unfreeze()
    found = {}
    for name, ts in times.items():
        low, middle, high = statistics.quantiles(ts, n=4)
        found[name] = (1e6 * middle, 1e6 * low, 1e6 * high)
    return found


def counts(call: Call) -> tuple[int, int]:
    """The Python function calls and the torch ops of one call (after a warm-up)."""
    call()
    profiler = cProfile.Profile()
    profiler.enable()
    call()
    profiler.disable()
    python_calls = pstats.Stats(profiler).total_calls  # type: ignore[attr-defined]
    with profile(activities=[ProfilerActivity.CPU]) as ops:
        call()
    return python_calls, len(ops.events())


def main() -> None:
    """Print one markdown table: each row's contenders, their fixed cost and packfunc's counts."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=500)
    args = parser.parse_args()
    torch.set_num_threads(2)
    rows = {
        "MLP kfac": quantity_calls("kfac", ("packfunc", "curvlinops")),
        "MLP batch_grad": quantity_calls("batch_grad", ("packfunc", "vmap(grad)", "opacus")),
        "LM DP step": dp_calls(),
    }
    print("| row | contender | µs (quartiles) | × fastest other | Python calls | torch ops |")
    print("|---|---|--:|--:|--:|--:|")
    for row, calls in rows.items():
        found = timed(calls, args.rounds)
        others = [found[name][0] for name in found if name != "packfunc"]
        best = min(others) if others else float("nan")
        for name, (middle, low, high) in found.items():
            python_calls, ops = counts(calls[name])
            print(
                f"| {row} | {name} | {middle:.0f} ({low:.0f}–{high:.0f}) | {middle / best:.2f} "
                f"| {python_calls} | {ops} |"
            )


if __name__ == "__main__":
    main()
