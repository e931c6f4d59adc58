"""Peak memory of one call, measured the same way for every contender.

On CPU, every tensor storage an aten op returns during the call (but a view's, which is
an argument's: the transpose of a weight made before the call is not the call's memory)
is counted from that op until the storage is freed (a finalizer on its Python object,
which lives exactly as long as the storage): the peak of that sum is the most tensor
memory the call held at once, its outputs included, its inputs and the model not. No
allocator sits in between (glibc keeps freed memory, so resident-set growth depends on
what ran before), so contenders can be measured one after the other in one process. The
count sees ops under ``vmap`` and in autograd's backward pass; scratch memory inside one
kernel is not a tensor and is not counted. On CUDA it is ``torch.cuda.max_memory_allocated``
above the memory allocated before the call.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class _StorageCounter(TorchDispatchMode):
    """Sums the bytes of the storages ops return while they are alive; keeps the peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.counted: set[int] = set()

    def __torch_dispatch__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if _is_view(func):  # an argument's storage: a view of a parameter is not the call's
            return out
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
                self._count(tensor.untyped_storage())
        self.peak = max(self.peak, self.live)
        return out

    def _count(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key not in self.counted:
            self.counted.add(key)
            self.live += storage.nbytes()
            weakref.finalize(storage, self._freed, key, storage.nbytes())

    def _freed(self, key: int, nbytes: int) -> None:
        self.counted.discard(key)
        self.live -= nbytes


def _is_view(func: Any) -> bool:
    """Whether an aten op returns views of its arguments.

    In-place and ``out=`` results are counted: their storage may come from outside aten
    (``torch.frombuffer``), and is counted once however often it is written.
    """
    schema = getattr(func, "_schema", None)
    return schema is not None and any(
        r.alias_info is not None and not r.alias_info.is_write for r in schema.returns
    )


def peak_bytes(fn: Callable[[], Any], device: torch.device | str = "cpu") -> int:
    """The most memory ``fn()`` holds at once, in bytes (see the module docstring).

    Args:
        fn: The call to measure (its result is dropped).
        device: Where ``fn`` computes.

    Returns:
        Peak bytes of tensor storage created by the call, or CUDA memory above the start.

    Example:
        >>> peak_bytes(lambda: torch.ones(1024) + 1)  # two 4 KiB tensors alive at once
        8192
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - start
    with _StorageCounter() as counter:
        fn()
    return counter.peak
