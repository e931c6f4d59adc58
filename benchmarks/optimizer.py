"""Time one training step of packfunc's curvature optimizers beside SGD and Adam.

Usage (from the repository root)::

    python benchmarks/optimizer.py                    # both models, every optimizer
    python benchmarks/optimizer.py --models digits --repeats 3 --period 10

A step is what a training loop pays per batch: ``zero_grad``, forward, backward and
``step`` (packfunc's optimizers: ``step(batch=(X, y))``, which refreshes the curvature every
``--period`` steps and its inverse or eigenbasis every ``--inverse-periods`` steps: each
period listed gives each Kronecker optimizer a row, ``kfac@100`` for instance; 10 and 100
by default, the second being KFAC-PyTorch's ``TCov=10, TInv=100``). Each optimizer trains
its own copy of the model. A process warms every optimizer up (one round), then runs
``--repeats`` rounds in which each optimizer in turn takes ``10 · period`` steps, so that
all of them see the same machine; ``--processes`` fresh processes per model do this (a
process's allocator state and caches moved single-optimizer timings by up to 1.5×, and
enough to put SGD above Adam). A cell is the median time per step over all rounds of all
processes, with the spread of the rounds; the last column is its ratio to Adam's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

THREADS = 2
OPTIMIZERS = ("sgd", "adam", "diag_ggn", "kfac", "kfac_pi", "ekfac")
KRONECKER = ("kfac", "kfac_pi", "ekfac")
"""Optimizers with an inverse (or eigenbasis) period of their own."""
MODELS = ("digits", "mlp")


def model_and_batch(name: str, n: int = 128) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The model ``name`` and one random batch of ``n`` samples (10 classes).

    ``digits``: the demo's 64-128-10 tanh MLP (scikit-learn digits' size);
    ``mlp``: the benchmark MLP 784-256-256-10 with ReLU.

    Args:
        name: One of :data:`MODELS`.
        n: Batch size.

    Returns:
        ``(model, X, y)``.
    """
    torch.manual_seed(0)
    if name == "digits":
        model: nn.Module = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 10))
        features = 64
    else:
        model = nn.Sequential(
            nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
        )
        features = 784
    return model, torch.randn(n, features), torch.randint(0, 10, (n,))


def contenders(optimizers: list[str], inverse_periods: list[int]) -> list[str]:
    """One contender per optimizer, and per inverse period for the Kronecker ones.

    Example:
        >>> contenders(["adam", "kfac"], [10, 100])
        ['adam', 'kfac@10', 'kfac@100']
    """
    return [
        f"{name}@{inverse}" if name in KRONECKER else name
        for name in optimizers
        for inverse in (inverse_periods if name in KRONECKER else [0])
    ]


def make_step(
    contender: str, model: nn.Module, X: torch.Tensor, y: torch.Tensor, period: int
) -> Callable:
    """One training step of a contender (learning rates small: timing only).

    Args:
        contender: A name of :data:`OPTIMIZERS` (``kfac_pi``: KFAC with π-damped factor
            inverses), the Kronecker ones with ``@inverse_period`` (see :func:`contenders`).
        model: The model to train.
        X: Inputs.
        y: Targets.
        period: Steps between curvature refreshes (packfunc's optimizers).

    Returns:
        A closure running one step.
    """
    import packfunc as pf

    name, _, inverse = contender.partition("@")
    loss = nn.CrossEntropyLoss()
    if name in ("sgd", "adam"):
        optimizer = (torch.optim.SGD if name == "sgd" else torch.optim.Adam)(
            model.parameters(), lr=1e-4
        )

        def plain_step() -> None:
            optimizer.zero_grad()
            loss(model(X), y).backward()
            optimizer.step()

        return plain_step
    options: dict[str, Any] = {"loss": loss, "update_period": period}
    if name in KRONECKER:
        options["inverse_period"] = int(inverse)
    if name == "kfac_pi":
        options["pi_damping"] = True
    optimizer_class = {
        "diag_ggn": pf.optim.DiagGGN,
        "kfac": pf.optim.KFAC,
        "kfac_pi": pf.optim.KFAC,
        "ekfac": pf.optim.EKFAC,
    }[name]
    curvature = optimizer_class(
        model, lr=1e-4, damping=1e-2, generator=torch.Generator().manual_seed(0), **options
    )

    def curvature_step() -> None:
        curvature.zero_grad()
        loss(model(X), y).backward()
        curvature.step(batch=(X, y))

    return curvature_step


def measure(
    model_name: str, optimizers: list[str], period: int, repeats: int
) -> dict[str, list[float]]:
    """Per optimizer, ``repeats`` rounds of ``10 · period`` steps (ms per step), interleaved.

    Args:
        model_name: One of :data:`MODELS`.
        optimizers: Contenders (see :func:`contenders`).
        period: Curvature refresh period.
        repeats: Timed rounds.

    Returns:
        ``{optimizer: [ms per step of each round]}``.
    """
    torch.set_num_threads(THREADS)
    steps = {}
    for name in optimizers:
        model, X, y = model_and_batch(model_name)
        steps[name] = make_step(name, model, X, y, period)
    rounds: dict[str, list[float]] = {name: [] for name in optimizers}
    for timed in [False] + [True] * repeats:
        for name, step in steps.items():
            start = time.perf_counter()
            for _ in range(10 * period):
                step()
            if timed:
                rounds[name].append(1e3 * (time.perf_counter() - start) / (10 * period))
    return rounds


def in_fresh_process(
    model_name: str, optimizers: list[str], period: int, repeats: int
) -> dict[str, list[float]]:
    """:func:`measure` in a new Python process (its JSON result)."""
    command = [
        sys.executable,
        __file__,
        "--child",
        json.dumps([model_name, optimizers, period, repeats]),
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    answer: dict[str, list[float]] = json.loads(done.stdout.strip().splitlines()[-1])
    return answer


def summarize(rounds: list[float]) -> dict[str, float]:
    """Median and spread of per-round times.

    Example:
        >>> summarize([3.0, 1.0, 2.0])
        {'median': 2.0, 'min': 1.0, 'max': 3.0}
    """
    return {"median": statistics.median(rounds), "min": min(rounds), "max": max(rounds)}


def table(results: dict[tuple[str, str], dict], period: int) -> list[str]:
    """Markdown rows: model, optimizer, inverse period, ms/step (median, spread), ratio to Adam."""
    lines = [
        f"| model | optimizer (curvature every {period} steps) | inverse every | ms/step | "
        "spread | × Adam |",
        "|---|---|--:|--:|--:|--:|",
    ]
    for (model_name, contender), r in results.items():
        adam = results.get((model_name, "adam"))
        ratio = f"{r['median'] / adam['median']:.2f}" if adam else "–"
        name, _, inverse = contender.partition("@")
        lines.append(
            f"| {model_name} | {name} | {inverse or '–'} | {r['median']:.2f} | "
            f"{r['min']:.2f}–{r['max']:.2f} | {ratio} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, time every (model, optimizer) in fresh processes, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    parser.add_argument("--period", type=int, default=10, help="curvature refresh period")
    parser.add_argument(
        "--inverse-periods", default="10,100", help="inverse/eigenbasis periods (Kronecker rows)"
    )
    parser.add_argument("--repeats", type=int, default=5, help="rounds per process")
    parser.add_argument("--processes", type=int, default=3, help="fresh processes per model")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        model_name, optimizers, period, repeats = json.loads(args.child)
        print(json.dumps(measure(model_name, optimizers, period, repeats)))
        return 0
    optimizers = contenders(
        args.optimizers.split(","), [int(p) for p in args.inverse_periods.split(",")]
    )
    results = {}
    for model_name in args.models.split(","):
        pooled: dict[str, list[float]] = {name: [] for name in optimizers}
        for _ in range(args.processes):
            for name, rounds in in_fresh_process(
                model_name, optimizers, args.period, args.repeats
            ).items():
                pooled[name] += rounds
        results.update({(model_name, name): summarize(pooled[name]) for name in optimizers})
    print(
        f"CPU, {THREADS} threads, float32, batch 128; {args.processes} fresh processes per "
        f"model, each running every optimizer in turn for {args.repeats} rounds of "
        f"{10 * args.period} steps: median (spread) of all rounds"
    )
    print("\n".join(table(results, args.period)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
