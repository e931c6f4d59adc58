"""Wall-clock timing and result comparison helpers."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor


def time_interleaved(
    closures: dict[str, Callable[[], Any]],
    repeats: int,
    warmup: int,
    budget_s: float | None = None,
    min_repeats: int = 5,
) -> dict[str, tuple[float, int]]:
    """Median wall-clock time of each closure in milliseconds, and the repeats used.

    After ``warmup`` untimed rounds, the closures are timed in rounds (one call
    each, rotating the order), so a change in machine load hits all of them
    alike. Long-lived objects are frozen out of the garbage collector first, so
    the ``gc.collect()`` before each call is cheap. With ``budget_s``, the number
    of rounds is cut so that the timed rounds take about ``budget_s`` seconds,
    but never below ``min_repeats``.
    """
    names = list(closures)
    if not names:
        return {}
    gc.collect()
    gc.freeze()
    round_s = 0.0
    for _ in range(warmup):
        start = time.perf_counter()
        for name in names:
            closures[name]()
        round_s = time.perf_counter() - start
    if budget_s is not None and round_s > 0:
        repeats = max(min(repeats, int(budget_s / round_s)), min(min_repeats, repeats))
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            gc.collect()
            start = time.perf_counter()
            result = closures[name]()
            times[name].append(time.perf_counter() - start)
            del result
    gc.unfreeze()
    return {name: (1e3 * statistics.median(ts), len(ts)) for name, ts in times.items()}


def agrees(
    result: dict[str, Tensor],
    reference: dict[str, Tensor],
    rtol: float = 1e-4,
    atol: float = 1e-6,
    shapes_only: bool = False,
) -> bool:
    """Whether two ``{param name: tensor or list of tensors}`` results match.

    ``atol`` is relative to each reference tensor's scale.
    """
    if result.keys() != reference.keys():
        return False
    pairs = []
    for name, ref in reference.items():
        value = result[name]
        if isinstance(ref, (list, tuple)):
            if not isinstance(value, (list, tuple)) or len(value) != len(ref):
                return False
            pairs += list(zip(value, ref))
        else:
            pairs.append((value, ref))
    for value, ref in pairs:
        if value.shape != ref.shape:
            return False
        if shapes_only:
            continue
        scale = ref.abs().max().item() if ref.numel() else 0.0
        if not torch.allclose(value, ref, rtol=rtol, atol=atol * max(scale, 1e-30)):
            return False
    return True


def cpu_model() -> str:
    """The CPU model name from ``/proc/cpuinfo`` (``'unknown'`` elsewhere)."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"
