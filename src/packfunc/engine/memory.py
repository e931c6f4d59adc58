"""Memory: chunk sizes, and the allocation of per-sample outputs.

Writing a fresh ``[N, *param]`` tensor is dominated by page faults on CPU (e.g. 100 MB:
~26 ms of faults for ~3 ms of arithmetic). Transparent huge pages cut the faults by up to
512x, but faulting them in stalls on the kernel's compaction when memory is fragmented:
measured in fresh processes (MLP ``batch_grad``), a 138 MB output took 0.17–0.52 ms per
sample and a 1.1 GB one 0.08–0.75 against 0.35 in small pages, so outputs use
``torch.empty``, as every peer does.
"""

from __future__ import annotations

import torch
from torch import Tensor

DEFAULT_BUDGET = 2**25
"""Elements of per-sample gradients held at once when chunking automatically."""

OUTPUT_CHUNK_BUDGET = 2**22
"""Elements of per-sample gradients formed at once when they are written into an output
(each chunk is a temporary beside the output: small chunks keep the peak at the output's
size)."""


ACCELERATOR_CHUNK_FLOOR = 2**20
"""Elements a chunk of unfolded inputs may hold on an accelerator even where the
input-sized rule would split finer: there each chunk's copies and products are launches
whose cost does not shrink with the chunk (an H100's convolution KFAC at N=8 split into 16
one-sample chunks took 1.49× curvlinops' time, all of it host time)."""


def unfold_chunk_length(
    n: int, input_numel: int, unfolded_per_sample: int, device: torch.device
) -> int:
    """Return how many samples' inputs to unfold at once.

    No more samples than make up the input's own size (the backward pass's activations
    are still alive when the factors are formed), or on an accelerator up to
    :data:`ACCELERATOR_CHUNK_FLOOR` elements, whichever allows more.

    Args:
        n: Number of samples.
        input_numel: Elements of the whole batch's input.
        unfolded_per_sample: Elements of one sample's unfolded input.
        device: Where the input lives.

    Returns:
        A chunk length in ``[1, max(n, 1)]``.

    Example:
        >>> unfold_chunk_length(8, 8 * 4096, 36864, torch.device("cpu"))
        1
        >>> unfold_chunk_length(8, 8 * 4096, 36864, torch.device("cuda"))
        8
    """
    held = input_numel if device.type == "cpu" else max(input_numel, ACCELERATOR_CHUNK_FLOOR)
    return chunk_length(n, unfolded_per_sample, None, budget=held)


def chunk_length(
    n: int, numel_per_sample: int, chunk_size: int | None, budget: int | None = None
) -> int:
    """Return how many samples to process at once.

    Args:
        n: Number of samples.
        numel_per_sample: Elements one sample's intermediate needs.
        chunk_size: The user's ``chunk_size=`` (``None``: automatic).
        budget: Elements held at once when chunking automatically (``None``:
            :data:`DEFAULT_BUDGET`).

    Returns:
        A chunk length in ``[1, max(n, 1)]``.

    Raises:
        ValueError: if ``chunk_size`` is not a positive integer.

    Example:
        >>> chunk_length(128, 2**20, None)
        32
    """
    if chunk_size is not None:
        if not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive integer or None; got {chunk_size!r}.")
        return min(chunk_size, max(n, 1))
    held = DEFAULT_BUDGET if budget is None else budget
    return max(1, min(max(n, 1), held // max(numel_per_sample, 1)))


def chunks(n: int, length: int) -> list[slice]:
    """Split ``range(n)`` into consecutive slices of at most ``length``.

    Args:
        n: Number of items.
        length: Maximum slice length.

    Returns:
        The slices, in order.

    Example:
        >>> chunks(5, 2)
        [slice(0, 2, None), slice(2, 4, None), slice(4, 5, None)]
    """
    return [slice(start, min(start + length, n)) for start in range(0, n, length)]


def split_index(index: slice | Tensor, length: int) -> list[slice | Tensor]:
    """Split a sample index (a contiguous slice or an index tensor) into chunks.

    Slices stay slices, so selecting a chunk is a view, not a copy.

    Args:
        index: ``slice(start, stop)`` or a 1-D index tensor.
        length: Maximum chunk length.

    Returns:
        The chunks, in order.

    Example:
        >>> split_index(slice(2, 7), 3)
        [slice(2, 5, None), slice(5, 7, None)]
    """
    if isinstance(index, Tensor):
        return list(torch.split(index, length))
    return [
        slice(s.start + index.start, s.stop + index.start)
        for s in chunks(index.stop - index.start, length)
    ]


def index_length(index: slice | Tensor) -> int:
    """Return how many samples a slice or index tensor selects.

    Args:
        index: ``slice(start, stop)`` or a 1-D index tensor.

    Returns:
        The number of samples.

    Example:
        >>> index_length(slice(2, 7))
        5
    """
    return index.shape[0] if isinstance(index, Tensor) else index.stop - index.start


def is_plain(*tensors: Tensor) -> bool:
    """Whether results computed from ``tensors`` may be written into preallocated memory.

    True when no tensor takes part in autograd or a ``torch.func`` transform.

    Args:
        *tensors: Inputs of a computation.

    Returns:
        Whether ``out=`` and in-place writes are safe.

    Example:
        >>> is_plain(torch.zeros(2))
        True
    """
    grad_on = torch.is_grad_enabled()
    return not any(
        torch._C._functorch.is_functorch_wrapped_tensor(t) or (grad_on and t.requires_grad)
        for t in tensors
    )


def new_output(shape: tuple[int, ...], like: Tensor) -> Tensor:
    """Allocate an uninitialized output with ``like``'s dtype and device.

    Args:
        shape: Shape of the output.
        like: A tensor giving dtype and device.

    Returns:
        An uninitialized tensor of that shape.

    Example:
        >>> new_output((2, 3), torch.zeros(1)).shape
        torch.Size([2, 3])
    """
    return torch.empty(shape, dtype=like.dtype, device=like.device)
