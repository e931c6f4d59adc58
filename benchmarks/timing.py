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
    sync: Callable[[], None] = lambda: None,
) -> dict[str, tuple[float, int]]:
    """Median wall-clock time of each closure in milliseconds, and the repeats used.

    After ``warmup`` untimed rounds, the closures are timed in rounds (one call
    each, rotating the order), so a change in machine load hits all of them
    alike. Long-lived objects are frozen out of the garbage collector first, so
    the ``gc.collect()`` before each call is cheap. With ``budget_s``, the number
    of rounds is cut so that the timed rounds take about ``budget_s`` seconds,
    but never below ``min_repeats``. ``sync`` waits for queued device work
    (``torch.cuda.synchronize``) before a clock is read.
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
        sync()
        round_s = time.perf_counter() - start
    if budget_s is not None and round_s > 0:
        repeats = max(min(repeats, int(budget_s / round_s)), min(min_repeats, repeats))
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            gc.collect()
            sync()
            start = time.perf_counter()
            result = closures[name]()
            sync()
            times[name].append(time.perf_counter() - start)
            del result
    gc.unfreeze()
    return {name: (1e3 * statistics.median(ts), len(ts)) for name, ts in times.items()}


def _pairs(result: dict[str, Any], reference: dict[str, Any]) -> list[tuple[str, Tensor, Tensor]]:
    """``(name, value, reference)`` for every tensor two results share (lists: per factor)."""
    pairs = []
    for name, ref in reference.items():
        value = result.get(name)
        if isinstance(ref, (list, tuple)) and isinstance(value, (list, tuple)):
            pairs += [(f"{name}[{i}]", v, r) for i, (v, r) in enumerate(zip(value, ref))]
        elif isinstance(ref, Tensor) and isinstance(value, Tensor):
            pairs.append((name, value, ref))
    return pairs


def discrepancy(result: dict[str, Any], reference: dict[str, Any]) -> str:
    """Describe how ``result`` differs from ``reference``: keys, shapes, worst relative error.

    Args:
        result: ``{param name: tensor or list of tensors}``.
        reference: The same layout, the expected values.

    Returns:
        One line, e.g. ``"missing ['b']; 0.weight: max |diff| 0.5 (0.25 of max |ref|)"``.

    Example:
        >>> discrepancy({"w": torch.ones(2)}, {"w": torch.zeros(2), "b": torch.ones(1)})
        "missing ['b']; w: max |diff| 1 (1 of max |ref|)"
    """
    parts = []
    missing = [name for name in reference if name not in result]
    extra = [name for name in result if name not in reference]
    if missing:
        parts.append(f"missing {missing[:3]}" + (" …" if len(missing) > 3 else ""))
    if extra:
        parts.append(f"unexpected {extra[:3]}" + (" …" if len(extra) > 3 else ""))
    worst: tuple[float, str] | None = None
    for name, value, ref in _pairs(result, reference):
        if value.shape != ref.shape:
            parts.append(f"{name}: shape {tuple(value.shape)} != {tuple(ref.shape)}")
            continue
        diff = (value.double() - ref.double()).abs().max().item() if ref.numel() else 0.0
        scale = ref.abs().max().item() if ref.numel() else 0.0
        relative = diff / scale if scale > 0 else diff
        text = f"{name}: max |diff| {diff:.3g} ({relative:.3g} of max |ref|)"
        if worst is None or relative > worst[0]:
            worst = (relative, text)
    if worst is not None and worst[0] > 0:
        parts.append(worst[1])
    return "; ".join(parts) or "no difference found"


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


def eigen_products(result: dict[str, Any], seed: int = 0) -> dict[str, Tensor]:
    """Each entry's ``(⊗ Q) diag(vec λ) (⊗ Q)ᵀ`` applied to a seeded random probe, in float64.

    Independent of the eigenvectors' signs and order (and of the basis inside an
    eigenspace of equal ``λ``), so two EKFAC implementations can be compared by value.

    Args:
        result: ``{name: [λ, Q_A, Q_B]}`` or ``{name: [λ, Q_A]}`` (an EKFAC row's layout).
        seed: Seed of the probes (one per entry, shaped like ``λ``).

    Returns:
        ``{name: product}``, each shaped like its ``λ``.

    Example:
        >>> swapped = torch.tensor([[0.0, -1.0], [1.0, 0.0]])  # reordered, one sign flipped
        >>> a = eigen_products({"b": [torch.tensor([2.0, 3.0]), torch.eye(2)]})["b"]
        >>> b = eigen_products({"b": [torch.tensor([3.0, 2.0]), swapped]})["b"]
        >>> torch.equal(a, b)
        True
    """
    generator = torch.Generator().manual_seed(seed)
    products = {}
    for name, (values, *vectors) in result.items():
        probe = torch.randn(values.shape, generator=generator, dtype=torch.float64)
        rotated = _mode_products(probe, [q.double().cpu().T for q in vectors])
        scaled = rotated * values.double().cpu()
        products[name] = _mode_products(scaled, [q.double().cpu() for q in vectors])
    return products


def _mode_products(tensor: Tensor, matrices: list[Tensor]) -> Tensor:
    """``tensor`` with matrix ``i`` applied along dimension ``i`` (``M_0 T M_1ᵀ`` for 2d)."""
    for dim, matrix in enumerate(matrices):
        tensor = torch.tensordot(matrix, tensor.movedim(dim, 0), dims=1).movedim(0, dim)
    return tensor


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
