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

import hashlib
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
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
            return cast(Tensor, all_reduce(tensor.contiguous(), group=group))
    # contiguous: all_reduce adds memory in storage order, and another rank's tensor (an
    # empty shard's zeros) may be laid out otherwise
    total = tensor.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(total, group=group)
    return total


_LOSS_OPTIONS = frozenset(
    {"reduction", "ignore_index", "label_smoothing", "delta", "beta", "log_input", "full", "eps"}
)
"""A loss's attributes that set its value (a custom loss's others, a device string, are not)."""


def describe_call(*parts: Any) -> tuple[str, list[Tensor]]:
    """A description of a call that equal calls share, and the tensors whose values it leaves out.

    Dicts are described in sorted order, numbers by value (``1`` as ``1.0``, ``-0.0`` as
    ``0.0``), tensors by shape and dtype (their values go to :func:`agree_on_call`'s
    checksum), a loss module by its type, its options and its tensors, other objects by
    their type (a generator's repr has its address: one per rank).

    Args:
        parts: The call's name, options, loss, parameters (pytrees).

    Returns:
        ``(description, tensors)``.

    Example:
        >>> text, tensors = describe_call("diag_ggn", {"w": torch.ones(2, 3)}, torch.nn.MSELoss())
        >>> text, len(tensors)
        ("'diag_ggn' {'w': ((2, 3), torch.float32)} MSELoss{'reduction': 'mean'}", 1)
    """
    tensors: list[Tensor] = []

    def described(value: Any) -> str:
        if isinstance(value, torch.nn.Module):
            options = {k: v for k, v in vars(value).items() if k in _LOSS_OPTIONS}
            own = dict(value.named_buffers()) | dict(value.named_parameters())
            return f"{type(value).__name__}{described(options | own)}"
        if isinstance(value, Mapping):
            keys = sorted(((described(k), v) for k, v in value.items()), key=lambda kv: kv[0])
            return "{" + ", ".join(f"{k}: {described(v)}" for k, v in keys) + "}"
        if isinstance(value, list | tuple):
            return f"[{', '.join(described(v) for v in value)}]"
        if isinstance(value, Tensor):
            tensors.append(value)
            return repr((tuple(value.shape), value.dtype))
        if isinstance(value, bool | str | Enum) or value is None:
            return repr(value)
        if isinstance(value, int | float):
            return repr(float(value) + 0.0)
        return type(value).__name__

    return " ".join(described(part) for part in parts), tensors


def agree_on_call(
    signature: str,
    values: list[Tensor],
    failure: Exception | None,
    group: ProcessGroup | None,
    device: torch.device,
) -> None:
    """Every rank of ``group`` learns, before the sums, that all made one call and none raised.

    A rank that raised alone (a NaN in its shard) left the others waiting in a collective
    it never reached: they hung, or, where the caller caught the error and went on, paired
    that collective with its next call's (silently wrong sums). A rank that made another
    call (other shapes, options or loss, or parameters of other values: a rank that missed
    an update) aborted the process or summed different things. One ``all_gather`` of a
    flag, a digest of ``signature`` and a checksum of ``values`` lets every rank leave alike.

    Args:
        signature: This rank's description of the call (:func:`describe_call`).
        values: The call's tensors: parameters, option and loss tensors (their float64
            sums, weighted by position, are compared).
        failure: What this rank's own part raised, or ``None``.
        group: A process group (``None``: a single process, ``failure`` raised if any).
        device: Where the collective runs (CPU for gloo, the GPU for NCCL).

    Raises:
        Exception: ``failure``, on its rank; ``RuntimeError`` on the others where a rank
            raised; ``ValueError`` on every rank where the calls differ.

    Example:
        >>> agree_on_call("diag_ggn", [torch.ones(2)], None, None, torch.device("cpu"))
    """
    if group is None:
        if failure is not None:
            raise failure
        return
    digest = int.from_bytes(hashlib.sha256(signature.encode()).digest()[:7], "big")
    flags = torch.tensor([int(failure is not None), digest], dtype=torch.int64, device=device)
    sums = [_real(v).sum(dtype=torch.float64).to(device) * (i + 1) for i, v in enumerate(values)]
    checksum = torch.stack(sums).sum() if sums else torch.zeros((), dtype=torch.float64)
    mine = torch.cat([flags, checksum.to(device).view(torch.int64).reshape(1)])
    gathered = [torch.empty_like(mine) for _ in range(world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    if failure is not None:
        raise failure
    failed = [rank for rank, found in enumerate(gathered) if int(found[0])]
    if failed:
        raise RuntimeError(
            f"rank {failed[0]} of process_group= raised in this call (its error is reported "
            "there); every rank leaves the call, so that the next collectives pair up. Fix "
            "that rank's shard or call."
        )
    if len({int(found[1]) for found in gathered}) > 1:
        raise ValueError(
            "the ranks of process_group= made different calls (the quantity, its options, "
            "the loss, or the parameters' names, shapes or dtypes differ); every rank must "
            f"make the same call on its own shard. This rank's: {signature[:300]}"
        )
    if len({int(found[2]) for found in gathered}) > 1:
        raise ValueError(
            "the ranks of process_group= passed parameters (or option or loss tensors: v=, "
            "max_norm=, class weights) of different values (a rank that missed an update, or an "
            "unsynchronized initialization); every rank must pass the same ones (broadcast "
            "parameters from one rank, as DistributedDataParallel does)."
        )


def _real(tensor: Tensor) -> Tensor:
    """A detached tensor, a complex one as its real and imaginary parts."""
    tensor = tensor.detach()
    return torch.view_as_real(tensor) if tensor.is_complex() else tensor


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
    "agree_on_call",
    "describe_call",
    "check_group",
    "is_first_rank",
    "sum_counts_over_ranks",
    "sum_over_ranks",
    "world_size",
    "zeros_like_others",
]
