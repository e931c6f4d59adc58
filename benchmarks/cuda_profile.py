"""Where a call's time and peak memory go on a GPU: host against GPU time, the peak's blocks.

For each cell (problem, quantity, N) and contender this prints one line: the median and
fastest of the timed calls, the kernels one call launches and the time the GPU spends in
them (``torch.profiler``), and the peak memory (as ``scaling.py`` measures it). A call whose
GPU time is a small part of its wall time is bound by the host (Python, dispatch, launches),
where fewer, larger operations help and arithmetic does not. At ``N <= 8`` it also lists the
largest blocks alive at the peak with the packfunc or peer lines that made them (CUDA's
allocation history). On a CPU it prints the times and peaks alone::

    python benchmarks/cuda_profile.py                       # the launch-bound cells
    python benchmarks/cuda_profile.py --cells CNN:kfac:8,MLP:batch_grad:128
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from memory import peak_bytes
from peers import BUILDERS
from scaling import FACTORIES

CELLS = (
    "CNN:kfac:8,CNN:kfac:128,MLP:kfac:8,MLP:batch_grad:8,CNN:batch_grad:8,LM:kfac:8,LM:kfac:128,"
    "MLP:batch_grad:4096,MLP:kfac:4096"
)
"""The cells behind on an H100 (2026-11-27) or at the 1.15× line, as ``problem:quantity:N``;
at N=4096 the H200 (533ea42) had the MLP's ``batch_grad`` 1.15× ``vmap(grad)`` (its outer
products one broadcast multiplication per layer, ``vmap``'s a batched product) and its KFAC
1.19× curvlinops."""

CONTENDERS = {
    "kfac": ("packfunc", "curvlinops", "plain fwd+bwd"),
    "batch_grad": ("packfunc", "vmap(grad)", "opacus", "BackPACK", "plain fwd+bwd"),
}
"""The contenders profiled per quantity (the plain step is the scale)."""


def synchronize(device: str) -> None:
    """Wait for the device's queued work (nothing on a CPU)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def wall_ms(call: Callable[[], Any], device: str, repeats: int = 30) -> tuple[float, float]:
    """The median and the fastest of ``repeats`` calls in milliseconds, after three warm-ups.

    Example:
        >>> median, fastest = wall_ms(lambda: torch.ones(8).sum(), "cpu", repeats=3)
        >>> 0 <= fastest <= median
        True
    """
    for _ in range(3):
        call()
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3, min(times) * 1e3


def kernels_and_gpu_ms(call: Callable[[], Any], top: int = 3) -> tuple[int, float, str]:
    """The kernels one call launches, the milliseconds the GPU spends in them, the longest.

    The last is the ``top`` kernels by GPU time, as ``name ms`` (names cut to 40 characters).
    """
    from torch.autograd import DeviceType  # type: ignore[attr-defined]
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        call()
        torch.cuda.synchronize()
    found = [e for e in profiler.events() if e.device_type == DeviceType.CUDA]
    longest = sorted(found, key=lambda e: -getattr(e, "device_time", 0.0))[:top]
    names = "; ".join(f"{e.name[:40]} {getattr(e, 'device_time', 0.0) / 1e3:.3f}" for e in longest)
    return len(found), sum(getattr(e, "device_time", 0.0) for e in found) / 1e3, names


def alive_at_peak(call: Callable[[], Any], top: int = 6) -> list[str]:
    """The largest CUDA blocks alive at one call's peak, each with the lines that made it.

    Replays the allocator's history of the call (blocks allocated before it are left out).
    """
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=500_000, stacks="python")
    call()
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    live: dict[int, dict[str, Any]] = {}
    total = peak = 0
    at_peak: dict[int, dict[str, Any]] = {}
    for event in snapshot["device_traces"][0]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
            total += event["size"]
        elif event["action"] == "free_requested" and event["addr"] in live:
            total -= live.pop(event["addr"])["size"]
        if total > peak:
            peak, at_peak = total, dict(live)
    lines = [f"    peak {peak / 2**20:.2f} MiB in {len(at_peak)} blocks"]
    for event in sorted(at_peak.values(), key=lambda e: -e["size"])[:top]:
        frames = [
            f"{frame['filename'].rsplit('/', 1)[-1]}:{frame['line']}:{frame['name']}"
            for frame in event.get("frames", [])
            if any(part in frame["filename"] for part in ("packfunc", "benchmarks", "curvlinops"))
        ]
        lines.append(f"    {event['size'] / 2**20:8.3f} MiB  {' < '.join(frames[:4])}")
    return lines


def profile_cell(problem: str, quantity: str, n: int, device: str) -> list[str]:
    """One line per contender of the cell (and, at ``n <= 8`` on CUDA, what its peak holds)."""
    lines = []
    built = FACTORIES[problem](n).to(device)
    for contender in CONTENDERS[quantity]:
        head = f"{problem} {quantity} N={n} {contender}"
        try:
            call = BUILDERS[contender](built, quantity)
            if call is None:
                continue
            call()
            synchronize(device)
            peak = peak_bytes(call, device) / 2**20
            median, fastest = wall_ms(call, device)
        except Exception as error:  # noqa: BLE001 - a refusal is a result
            lines.append(f"{head}: {type(error).__name__}: {error}"[:200])
            continue
        line = f"{head}: {median:.3f} ms (fastest {fastest:.3f}), peak {peak:.2f} MiB"
        if device.startswith("cuda"):
            count, gpu_ms, longest = kernels_and_gpu_ms(call)
            line += f", {count} kernels, GPU busy {gpu_ms:.3f} ms (longest: {longest})"
        lines.append(line)
        if device.startswith("cuda") and n <= 8:
            lines.extend(alive_at_peak(call))
    return lines


def main(argv: list[str] | None = None) -> int:
    """Profile the cells named on the command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", default=CELLS, help="problem:quantity:N, comma-separated")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    for cell in args.cells.split(","):
        problem, quantity, n = cell.split(":")
        for line in profile_cell(problem, quantity, int(n), args.device):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
