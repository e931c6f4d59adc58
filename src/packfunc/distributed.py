"""Several processes: sums over the shards of ``torch.distributed`` ranks.

A whole-dataset quantity is a sum over samples (rescaled once at the end), so
ranks that each hold a shard combine their partial sums with one all-reduce.
``process_group=None`` means a single process: nothing is communicated, even when
``torch.distributed`` is initialized (a rank computing a diagnostic of its own
batch must not wait for the others). Pass ``torch.distributed.group.WORLD`` for
the default group. The code is device-agnostic: gloo reduces CPU tensors, NCCL
CUDA tensors.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import optree
import torch
import torch.distributed as dist
from torch import Tensor

if TYPE_CHECKING or dist.is_available():
    from torch.distributed import ProcessGroup
else:  # a build without torch.distributed: no group can be passed
    ProcessGroup = object


def check_group(group: ProcessGroup | None) -> None:
    """Check that a process group can be used.

    Args:
        group: The ``process_group=`` argument; ``None`` is a single process.

    Raises:
        RuntimeError: if a group is given but ``torch.distributed`` is not initialized.

    Example:
        >>> check_group(None)
    """
    if group is not None and not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "process_group= needs torch.distributed: call torch.distributed.init_process_group"
            "(...) on every rank first, or pass process_group=None for a single process."
        )


def world_size(group: ProcessGroup | None) -> int:
    """Number of ranks in ``group`` (1 for a single process).

    Args:
        group: A process group or ``None``.

    Returns:
        The group size.

    Example:
        >>> world_size(None)
        1
    """
    return 1 if group is None else dist.get_world_size(group)


def is_first_rank(group: ProcessGroup | None) -> bool:
    """Whether this process is rank 0 of ``group`` (always for a single process).

    Args:
        group: A process group or ``None``.

    Returns:
        ``True`` on the group's first rank.

    Example:
        >>> is_first_rank(None)
        True
    """
    return group is None or dist.get_rank(group) == 0


def sum_over_ranks(tree: Any, group: ProcessGroup | None) -> Any:
    """Sum every tensor of a pytree over the ranks of ``group`` (one all-reduce per tensor).

    The reduction is out of place; a tensor that requires grad goes through the
    differentiable ``torch.distributed.nn.functional.all_reduce``. ``None`` leaves stay
    ``None``. Every rank must pass a pytree of the same structure and shapes.

    Args:
        tree: A pytree of tensors.
        group: A process group, or ``None`` (returns ``tree`` unchanged).

    Returns:
        The pytree of sums over ranks.

    Example:
        >>> sum_over_ranks({"a": torch.ones(2)}, None)["a"]
        tensor([1., 1.])
    """
    if group is None:
        return tree
    return optree.tree_map(lambda t: _summed(t, group), tree)


def _summed(tensor: Tensor, group: ProcessGroup) -> Tensor:
    """``tensor`` summed over the ranks of ``group``, out of place."""
    if tensor.requires_grad:
        from torch.distributed.nn.functional import all_reduce

        with warnings.catch_warnings():  # deprecated in torch 2.13, with no public successor
            warnings.simplefilter("ignore", FutureWarning)
            return cast(Tensor, all_reduce(tensor, group=group))
    total = tensor.clone()
    dist.all_reduce(total, group=group)
    return total


@dataclass(frozen=True)
class _Layout:
    """A tensor's shape and dtype, sent to ranks that have none (see :func:`zeros_like_others`)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def zeros_like_others(tree: Any | None, group: ProcessGroup | None, device: torch.device) -> Any:
    """The rank's ``tree``, or zeros laid out as another rank's where it has none.

    A rank whose shard has no sample (Poisson sampling drew none) adds zeros to the sums
    over ranks; it learns their shapes and dtypes from a rank that has them (one
    ``all_gather_object``). Every rank of ``group`` calls it, with ``None`` where it has
    nothing.

    Args:
        tree: A pytree of tensors, or ``None``.
        group: A process group (``None``: a single process, ``tree`` returned).
        device: Where the zeros go.

    Returns:
        ``tree``, or the zeros; ``None`` if no rank has a tree.

    Example:
        >>> zeros_like_others({"a": torch.ones(2)}, None, torch.device("cpu"))["a"]
        tensor([1., 1.])
    """
    if group is None:
        return tree
    layout = None
    if tree is not None:
        layout = optree.tree_map(lambda t: _Layout(tuple(t.shape), t.dtype), tree)
    gathered: list[Any] = [None] * world_size(group)
    dist.all_gather_object(gathered, layout, group=group)
    if tree is not None:
        return tree
    found = next((other for other in gathered if other is not None), None)
    if found is None:
        return None
    return optree.tree_map(
        lambda leaf: torch.zeros(leaf.shape, dtype=leaf.dtype, device=device),
        found,
        is_leaf=lambda value: isinstance(value, _Layout),
    )


def sum_counts_over_ranks(
    counts: list[float], group: ProcessGroup | None, device: torch.device
) -> list[float]:
    """Sum a few numbers (sample counts, normalizers) over ranks, as float64.

    Args:
        counts: This rank's numbers.
        group: A process group, or ``None``.
        device: Where the reduction runs (CPU for gloo, the GPU for NCCL).

    Returns:
        The sums, in order.

    Example:
        >>> sum_counts_over_ranks([3.0, 1.5], None, torch.device("cpu"))
        [3.0, 1.5]
    """
    if group is None:
        return counts
    buffer: Tensor = torch.tensor(counts, dtype=torch.float64, device=device)
    dist.all_reduce(buffer, group=group)
    return buffer.tolist()


__all__ = [
    "ProcessGroup",
    "check_group",
    "is_first_rank",
    "sum_counts_over_ranks",
    "sum_over_ranks",
    "world_size",
    "zeros_like_others",
]
