"""Lists a block collects in this thread: what code deep in a call notes for the caller.

A value found deep inside the engine (a failed check under ``vmap``, the samples a norm's
closed form had to form) reaches the code that opened the block without passing through
every function between them. The list is per thread: a backward pass's hooks run in the
thread that calls them, within the block opened around them there.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def collecting(state: threading.local, name: str, *, outward: bool = False) -> Iterator[list[Any]]:
    """A fresh list at ``state.<name>`` within the block, the enclosing block's after it.

    Args:
        state: The thread-local namespace of the module that notes into it.
        name: The attribute noted into (:func:`note` with the same ``state`` and ``name``).
        outward: On leaving, the enclosing block's list (if any) gets the entries too.

    Yields:
        The list.

    Example:
        >>> state = threading.local()
        >>> with collecting(state, "seen") as seen:
        ...     note(state, "seen", 3)
        >>> seen, note(state, "seen", 4)  # (outside any block: dropped)
        ([3], None)
    """
    outer: list[Any] | None = getattr(state, name, None)
    found: list[Any] = []
    setattr(state, name, found)
    try:
        yield found
    finally:
        setattr(state, name, outer)
        if outward and outer is not None:
            outer.extend(found)


def note(state: threading.local, name: str, value: Any) -> None:
    """Append ``value`` to the list of the innermost :func:`collecting` block, if one is open.

    Example:
        >>> note(threading.local(), "seen", 1)  # (no block: nothing happens)
    """
    found: list[Any] | None = getattr(state, name, None)
    if found is not None:
        found.append(value)
