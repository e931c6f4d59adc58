"""Checks of values under ``torch.func.vmap``, where no value can raise: they poison the results.

A check that compares values (the rows check of :func:`~packfunc.engine.discovery.
check_rows_alone`) cannot branch on them inside ``vmap``: each vmapped instance has its
own. There it hands :func:`poison_where` a boolean tensor instead, and the public call that
ran it (:func:`~packfunc.functionalize.public_entry`, through :func:`poisoning_results`)
returns NaN in every floating-point entry of its result for the instances where the check
failed — as the clipping factors do for an overflowed norm — never a wrong number.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator
from typing import Any

import optree
import torch
from torch import Tensor

from packfunc.engine.thread_lists import collecting

_STATE = threading.local()


@contextlib.contextmanager
def poisoning_results() -> Iterator[list[Tensor]]:
    """Collect the failed-check flags of one public call (those of calls it makes too).

    Yields:
        The list of flags :func:`poison_where` appends to; the caller passes it to
        :func:`poisoned` with the call's result. On leaving, an enclosing public call
        receives them as well.

    Example:
        >>> with poisoning_results() as flags:
        ...     poison_where(torch.tensor(False))
        >>> poisoned({"w": torch.ones(2)}, flags)["w"]
        tensor([1., 1.])
    """
    with collecting(_STATE, "flags", outward=True) as flags:
        yield flags


def poison_where(failed: Tensor) -> None:
    """Make the current public call's result NaN where ``failed`` holds.

    Args:
        failed: A 0-dim boolean tensor (batched under ``vmap``).

    Raises:
        RuntimeError: outside a public call (:func:`poisoning_results`): nothing would
            read the flag.

    Example:
        >>> with poisoning_results() as flags:
        ...     poison_where(torch.tensor(True))
        >>> poisoned([torch.ones(1), torch.arange(2)], flags)
        [tensor([nan]), tensor([0, 1])]
    """
    flags: list[Tensor] | None = getattr(_STATE, "flags", None)
    if flags is None:
        raise RuntimeError(
            "a check of values under torch.func.vmap ran outside a public packfunc call: "
            "call packfunc's functions (not its engine) under vmap."
        )
    flags.append(failed)


def poisoned(result: Any, flags: list[Tensor]) -> Any:
    """``result`` with its floating-point and complex tensors NaN where any flag holds.

    Args:
        result: A public call's result (a pytree; other leaves stay as they are).
        flags: Boolean tensors from :func:`poison_where`.

    Returns:
        ``result`` itself without flags, else a pytree like it.

    Example:
        >>> poisoned({"w": torch.ones(2)}, [torch.tensor(True)])["w"]
        tensor([nan, nan])
    """
    if not flags:
        return result
    failed = flags[0]
    for flag in flags[1:]:
        failed = failed | flag
    return optree.tree_map(lambda leaf: _nan_where(failed, leaf), result)


def _nan_where(failed: Tensor, leaf: Any) -> Any:
    """A tensor leaf's entries NaN where ``failed`` holds (integer and boolean ones stay)."""
    if not isinstance(leaf, Tensor) or not (leaf.is_floating_point() or leaf.is_complex()):
        return leaf
    nan = complex(math.nan, math.nan) if leaf.is_complex() else math.nan
    return torch.where(failed.to(leaf.device), torch.full_like(leaf, nan), leaf)


__all__ = ["poison_where", "poisoned", "poisoning_results"]
