"""Mixed precision: the forward under the caller's ``torch.autocast``, statistics in full precision.

A public function called inside ``torch.autocast`` runs with autocast off
(:func:`forward_precision_only`); only the model's forward passes — every one runs in a
:class:`~packfunc.engine.modes.FunctionalMode` or the batch pass on tapped leaves, which enter
:func:`forward_autocast` — run under the caller's autocast again, so activations and
output cotangents have the low-precision dtypes of mixed-precision training. The
recorded inputs and cotangents are then brought to the parameters' dtype
(:func:`to_dtype_of`) before any statistic is formed: sums over samples, squares and
Kronecker factors accumulate in float32 and come back in the parameters' dtype.
Second derivatives through the model re-run it in full precision (:func:`full_precision`).
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch import Tensor

F = TypeVar("F", bound=Callable[..., Any])

_DEVICE_TYPES = ("cpu", "cuda")
_STATE = threading.local()


def _captured() -> list[list[tuple[str, torch.dtype]]]:
    """The caller's autocast settings, innermost public call first (empty: none)."""
    stack = getattr(_STATE, "stack", None)
    if stack is None:
        stack = _STATE.stack = []
    return stack


def forward_precision_only(function: F) -> F:
    """Run ``function`` with autocast off, remembering the caller's for the forward passes.

    Args:
        function: A public function.

    Returns:
        The same function; inside ``torch.autocast`` only its model forwards autocast.

    Example:
        >>> @forward_precision_only
        ... def product(a, b):
        ...     return (a @ b).dtype
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     product(torch.ones(2, 2), torch.ones(2, 2))
        torch.float32
    """

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        settings = autocast_enabled()
        if not settings:
            return function(*args, **kwargs)
        with serving_autocast(settings):
            return function(*args, **kwargs)

    return run  # type: ignore[return-value]


def autocast_enabled() -> tuple[tuple[str, torch.dtype], ...]:
    """The ``torch.autocast`` in force now: ``(device type, dtype)`` of each enabled one.

    Example:
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     autocast_enabled()
        (('cpu', torch.bfloat16),)
    """
    return tuple(
        (device, torch.get_autocast_dtype(device))
        for device in _DEVICE_TYPES
        if torch.is_autocast_enabled(device)
    )


@contextlib.contextmanager
def serving_autocast(settings: tuple[tuple[str, torch.dtype], ...]) -> Iterator[None]:
    """Within the block autocast is off, and packfunc's model forwards run under ``settings``.

    :func:`forward_precision_only` serves a public call with the caller's autocast; the
    shim serves a backward pass with the autocast its recorded forward ran under (which
    need not be the one in force at the backward).

    Args:
        settings: ``(device type, dtype)`` pairs, as :func:`autocast_enabled` gives them
            (empty: the forwards run without autocast).

    Example:
        >>> with serving_autocast((("cpu", torch.bfloat16),)):
        ...     torch.is_autocast_enabled("cpu"), autocast_in_force()
        (False, (('cpu', torch.bfloat16),))
    """
    with contextlib.ExitStack() as stack:
        for device, _ in autocast_enabled():
            stack.enter_context(torch.autocast(device, enabled=False))
        _captured().append(list(settings))
        try:
            yield
        finally:
            _captured().pop()


def autocast_in_force() -> tuple[tuple[str, torch.dtype], ...]:
    """The autocast model forwards run under now: the served call's, else the caller's own.

    A plan records its layers' output dtypes: one made under autocast does not hold
    without it (nor the other way round).

    Example:
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     autocast_in_force()
        (('cpu', torch.bfloat16),)
    """
    stack = _captured()
    if stack:
        return tuple(stack[-1])
    return autocast_enabled()


@contextlib.contextmanager
def forward_autocast() -> Iterator[None]:
    """Within the block, the autocast of the public call being served (if any) is on again.

    Example:
        >>> with forward_autocast():
        ...     torch.is_autocast_enabled("cpu")
        False
    """
    stack = _captured()
    if not stack:  # (no autocast served: nothing to enter)
        yield
        return
    with contextlib.ExitStack() as entered:
        for device, dtype in stack[-1]:
            entered.enter_context(torch.autocast(device, dtype=dtype))
        yield


@contextlib.contextmanager
def full_precision() -> Iterator[None]:
    """Within the block, model forwards run without the caller's autocast.

    For second derivatives through the model (Hessian diagonals, curvature products):
    their backward-of-backward cannot mix the dtypes autocast leaves in the graph, so
    these re-runs are in the parameters' precision.

    Example:
        >>> with full_precision(), forward_autocast():
        ...     torch.is_autocast_enabled("cpu")
        False
    """
    stack = _captured()
    stack.append([])
    try:
        yield
    finally:
        stack.pop()


def to_dtype_of(tensor: Tensor, reference: Tensor) -> Tensor:
    """A floating ``tensor`` in ``reference``'s dtype where the two differ (any direction).

    Under autocast that is an upcast (a bfloat16 recording to a float32 parameter); a
    parameter of lower precision than the loss gets its own dtype back.

    Args:
        tensor: A recorded input or cotangent (bfloat16/float16 under autocast).
        reference: The parameter (or the tensor whose dtype the result must have).

    Returns:
        ``tensor`` itself, or a copy in ``reference.dtype``.

    Example:
        >>> to_dtype_of(torch.ones(2, dtype=torch.bfloat16), torch.ones(1)).dtype
        torch.float32
    """
    if tensor.dtype == reference.dtype or not tensor.is_floating_point():
        return tensor
    return tensor.to(reference.dtype)


def for_squares(tensor: Tensor) -> Tensor:
    """``tensor`` in float32 where it is float16, whose squares below 6·10⁻⁸ flush to zero.

    A mean's per-sample gradients are ``1/N`` of a sample's: at a few thousand samples
    their squares underflow float16 while their sums over samples do not (bfloat16 has
    float32's range).

    Example:
        >>> for_squares(torch.full((1,), 1e-5, dtype=torch.float16)).square().item() > 0
        True
    """
    return tensor.float() if tensor.dtype == torch.float16 else tensor


def widest(leaves: list[Tensor]) -> Tensor:
    """The leaf of the most precise floating dtype (the first of those): the loss's dtype.

    With parameters of several dtypes, a float64 leaf's quantities would otherwise be
    taken from a loss formed in float32 (the first leaf's).

    Example:
        >>> widest([torch.ones(1), torch.ones(1, dtype=torch.float64)]).dtype
        torch.float64
    """
    floating = [leaf for leaf in leaves if leaf.is_floating_point()] or leaves
    return max(
        floating, key=lambda leaf: torch.finfo(leaf.dtype).bits if leaf.is_floating_point() else 0
    )


def narrowest(*dtypes: torch.dtype) -> torch.dtype:
    """The floating dtype of fewest bits among ``dtypes`` (the first of those tied).

    Example:
        >>> narrowest(torch.float32, torch.bfloat16, torch.float16)
        torch.bfloat16
    """
    return min(dtypes, key=lambda d: torch.finfo(d).bits)


def in_loss_dtype(output: Tensor, leaves: list[Tensor]) -> Tensor:
    """The model's real output in the dtype the loss is formed in: the widest leaf's.

    Complex parameters' real counterpart for a real output (``complex64``: ``float32``): a
    loss of a real output is real. Other outputs (integers, complex) stay as they are.

    Args:
        output: The model's output.
        leaves: The parameter leaves.

    Returns:
        ``output``, or a copy in that dtype.

    Example:
        >>> in_loss_dtype(torch.ones(2), [torch.ones(1, dtype=torch.complex128)]).dtype
        torch.float64
    """
    if not output.is_floating_point():
        return output
    dtype = widest(leaves).dtype
    dtype = _REAL_PART.get(dtype, dtype)
    return output if output.dtype == dtype else output.to(dtype)


_REAL_PART = {
    torch.complex32: torch.float16,
    torch.complex64: torch.float32,
    torch.complex128: torch.float64,
}
"""Each complex dtype's real counterpart."""


ROUNDING_TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-3}
"""Largest difference, relative to the largest entry, between two computations of one value
that :func:`difference_beyond_rounding` puts down to rounding; half precision: 0.1, and
float32 on a GPU that may compute it in TF32 (:func:`reduced_float32`): 5e-2. A layer that
mixes samples weakly (``h - 0.04·h.mean(0)``) differs by more than 1e-3."""


def reduced_float32(device: torch.device) -> bool:
    """Whether float32 products on ``device`` may run in a lower precision (TF32 on CUDA).

    Example:
        >>> reduced_float32(torch.device("cpu"))
        False
    """
    if device.type != "cuda":
        return False
    backends = torch.backends
    return bool(
        backends.cuda.matmul.allow_tf32
        or backends.cudnn.allow_tf32
        or torch.get_float32_matmul_precision() != "highest"
    )


def difference_beyond_rounding(
    found: Tensor, expected: Tensor, scale: float | None = None
) -> str | None:
    """How ``found`` differs from ``expected`` beyond rounding, or ``None``.

    Entries equal in both (infinities and NaNs too: a masked position of a padded sample)
    differ by nothing; a NaN or infinity in one only differs infinitely. The tolerance is
    :data:`ROUNDING_TOLERANCE` of the lower precision's, relative to ``scale``.

    Args:
        found: One computation.
        expected: Another, of the same value.
        scale: The magnitude of the terms the values were computed from (a sum's largest
            term); default: ``expected``'s largest finite entry.

    Returns:
        ``"differs by up to ... (its largest entry: ...)"``, a shape difference, or ``None``.

    Example:
        >>> difference_beyond_rounding(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5]))
        'differs by up to 0.5 (its largest entry: 2.5)'
    """
    if found.shape != expected.shape:
        return f"has shape {tuple(found.shape)}, the other {tuple(expected.shape)}"
    if found.is_complex() or expected.is_complex():  # (real and imaginary parts, each)
        return difference_beyond_rounding(_as_real(found), _as_real(expected), scale)
    if not expected.numel():
        return None
    found_difference, largest = _difference_and_largest(found, expected)
    difference = float(found_difference)
    scale = float(largest) if scale is None else scale
    tiny = torch.finfo(narrowest(found.dtype, expected.dtype)).tiny
    if difference <= _tolerance(found, expected) * max(scale, tiny):
        return None
    return f"differs by up to {difference:.3g} (its largest entry: {scale:.3g})"


def differs_beyond_rounding(found: Tensor, expected: Tensor) -> Tensor:
    """Whether ``found`` differs from ``expected`` beyond rounding, as a boolean tensor.

    :func:`difference_beyond_rounding` without reading a value, so that it runs under
    ``torch.func.vmap`` (each vmapped instance decides on its own).

    Args:
        found: One computation.
        expected: Another, of the same value.

    Returns:
        A 0-dim boolean tensor (batched under ``vmap``).

    Example:
        >>> differs_beyond_rounding(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5]))
        tensor(True)
    """
    if found.shape != expected.shape:
        return torch.ones((), dtype=torch.bool, device=found.device)
    if found.is_complex() or expected.is_complex():
        return differs_beyond_rounding(_as_real(found), _as_real(expected))
    if not expected.numel():
        return torch.zeros((), dtype=torch.bool, device=found.device)
    difference, largest = _difference_and_largest(found, expected)
    tiny = torch.finfo(narrowest(found.dtype, expected.dtype)).tiny
    return difference > _tolerance(found, expected) * largest.clamp(min=tiny)


def _difference_and_largest(found: Tensor, expected: Tensor) -> tuple[Tensor, Tensor]:
    """The largest difference (entries equal in both: none) and ``expected``'s largest entry.

    Both 0-dim float64 tensors; NaNs and infinities in one only differ infinitely.
    """
    a, b = found.detach().double(), expected.detach().double()
    same = (a == b) | (a.isnan() & b.isnan())
    difference = (a - b).abs().nan_to_num(nan=math.inf).masked_fill(same, 0.0).amax()
    largest = b.abs().masked_fill(~b.isfinite(), 0.0).amax()
    return difference, largest


def _tolerance(found: Tensor, expected: Tensor) -> float:
    """:data:`ROUNDING_TOLERANCE` of the narrower dtype of the two, on their device."""
    dtype = narrowest(found.dtype, expected.dtype)
    if dtype == torch.float32 and reduced_float32(found.device):
        return 5e-2
    return ROUNDING_TOLERANCE.get(dtype, 0.1)


def _as_real(t: Tensor) -> Tensor:
    """``t``'s real and imaginary parts in a last dim of two (a real ``t``'s: zero)."""
    if t.is_complex():
        return torch.view_as_real(t.detach().resolve_conj())
    return torch.stack([t.detach(), torch.zeros_like(t.detach())], -1)


__all__ = [
    "ROUNDING_TOLERANCE",
    "autocast_enabled",
    "difference_beyond_rounding",
    "differs_beyond_rounding",
    "forward_autocast",
    "forward_precision_only",
    "reduced_float32",
    "serving_autocast",
    "full_precision",
    "to_dtype_of",
]
