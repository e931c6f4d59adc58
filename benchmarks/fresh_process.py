"""Time one contender of one row alone, in this process (run it once per contender).

``run.py`` interleaves a row's contenders in one process; allocator state can move a cell
by up to 1.5×, so rows are re-checked with each contender in a fresh process::

    python benchmarks/fresh_process.py "GPT-2" batch_grad packfunc
    python benchmarks/fresh_process.py "GPT-2" batch_grad "vmap(grad)"

Prints the median, minimum and maximum of ``--repeats`` calls after two warm-up calls.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

from peers import build_all
from problems import PROBLEMS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("problem", help="a problem name of problems.PROBLEMS, e.g. 'GPT-2'")
    parser.add_argument("quantity", help="a row's quantity, e.g. batch_grad")
    parser.add_argument("contender", help="e.g. packfunc, 'vmap(grad)', 'plain fwd+bwd'")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(2)
    built = (make() for make in PROBLEMS)  # built until the one named
    problem = next((p for p in built if p.name == args.problem), None)
    if problem is None:
        raise SystemExit(f"{args.problem}: not a problem of problems.PROBLEMS")
    closures, notes = build_all(problem, args.quantity)
    if args.contender not in closures:
        raise SystemExit(f"{args.contender}: {notes.get(args.contender, 'not a contender')}")
    run = closures[args.contender]
    run()
    run()
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1e3)
    print(
        f"{args.problem} {args.quantity} {args.contender}: median {statistics.median(times):.1f}"
        f" ms (min {min(times):.1f}, max {max(times):.1f})"
    )


if __name__ == "__main__":
    main()
