"""Activation checkpointing inside packfunc's passes: the checkpointed function runs plainly.

``torch.utils.checkpoint.checkpoint`` saves memory by running a function again during
the backward pass. packfunc's passes run models inside its own modes, which decompose
and rewrite calls, while a recomputation would run outside them and save other tensors
(``CheckpointError: different metadata``) — and the reentrant variant keeps no graph
that ``autograd.grad`` or ``torch.func`` can use. Inside :func:`plain_checkpoints`
(entered by every :class:`~packfunc.engine.modes.FunctionalMode` and the batch pass on
tapped leaves) both variants call the function directly: the same values, the memory of
a model without checkpointing, one forward and so one draw of any random op.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch.utils.checkpoint as checkpoint_module

_LOCK = threading.Lock()
_DEPTH = [0]
_ORIGINALS: dict[str, Any] = {}


class _PlainCheckpointFunction:
    """Stands in for ``CheckpointFunction`` (the reentrant variant): no checkpoint."""

    @staticmethod
    def apply(function: Callable[..., Any], preserve_rng_state: bool, *args: Any) -> Any:
        return function(*args)


def _plain_generator(*args: Any, **kwargs: Any) -> Iterator[None]:
    """Stands in for the non-reentrant variant's context: nothing before or after."""
    yield


_STAND_INS = {
    "CheckpointFunction": _PlainCheckpointFunction,
    "_checkpoint_without_reentrant_generator": _plain_generator,
}


@contextlib.contextmanager
def plain_checkpoints() -> Iterator[None]:
    """Within the block, ``torch.utils.checkpoint.checkpoint`` calls its function directly.

    Nested and concurrent uses share one switch, restored when the last one ends.

    Example:
        >>> import torch
        >>> w = torch.ones(2, requires_grad=True)
        >>> with plain_checkpoints():
        ...     out = checkpoint_module.checkpoint(torch.sin, w, use_reentrant=True)
        >>> out.grad_fn.name()
        'SinBackward0'
    """
    with _LOCK:
        if _DEPTH[0] == 0:
            for name, stand_in in _STAND_INS.items():
                _ORIGINALS[name] = getattr(checkpoint_module, name)
                setattr(checkpoint_module, name, stand_in)
        _DEPTH[0] += 1
    try:
        yield
    finally:
        with _LOCK:
            _DEPTH[0] -= 1
            if _DEPTH[0] == 0:
                for name, original in _ORIGINALS.items():
                    setattr(checkpoint_module, name, original)


__all__ = ["plain_checkpoints"]
