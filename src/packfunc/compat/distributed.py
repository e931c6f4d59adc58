"""The shim under ``DistributedDataParallel``: combine the ranks' aggregate BackPACK fields.

``DistributedDataParallel(extend(model))`` needs nothing special: on each rank
the extensions see that rank's batch, so ``grad_batch``, ``diag_ggn_exact``,
``kfac`` ... are those of the local batch (as without DDP), while ``.grad`` is
DDP's average over ranks. After the backward pass,
:func:`all_reduce_extensions` turns the aggregate fields into those of the global
batch (every rank's samples together), on every rank.
"""

from __future__ import annotations

from typing import Literal, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from packfunc.compat._stored_io import input_factor_first, samples_of, store_result
from packfunc.compat.extensions.backprop_extension import BackpropExtension
from packfunc.distributed import ProcessGroup, sum_over_ranks
from packfunc.specs import Combine, Family


def all_reduce_extensions(
    model: nn.Module,
    *extensions: BackpropExtension,
    process_group: ProcessGroup | None = None,
    reduction: Literal["mean", "sum"] = "mean",
) -> None:
    """Make the aggregate fields of ``extensions`` those of the global batch, on every rank.

    Call it on every rank after the backward pass, with the extensions given to
    ``backpack(...)``. With ``reduction='mean'`` each rank's loss is a mean over its
    own batch and, as for DDP's ``.grad``, the ranks' batches are assumed equally
    large (equal normalizers): fields linear in the loss (``diag_ggn_*``,
    ``diag_h``, the first Kronecker factor) become averages over ranks, exactly
    like DDP's ``.grad``, and ``sum_grad_squared`` (quadratic) the sum over ranks
    divided by the number of ranks squared. With ``reduction='sum'`` both are
    summed. Kronecker input factors (averages over samples) are averaged over
    ranks, with either reduction: unequal batches are refused there. Per-sample fields
    (``grad_batch`` ...) and curvature-product functions stay per rank. For unequal
    batches or class-weighted means use the functional API with ``process_group=``, which
    normalizes globally.

    Args:
        model: The extended model (or the module inside ``DistributedDataParallel``).
        *extensions: The extensions whose fields to combine.
        process_group: The group (default: the default group).
        reduction: The extended loss's reduction.

    Raises:
        RuntimeError: if ``torch.distributed`` is not initialized.
        ValueError: for Kronecker factors of unequal batches; for ``Variance`` and ``KFRA``
            (not sums over samples; compute ``variance`` from ``SumGradSquared`` and
            ``.grad``, use ``KFLR``/``KFAC``), or a bad ``reduction``.

    Example:
        >>> from packfunc.compat.extensions import DiagGGNExact
        >>> all_reduce_extensions(torch.nn.Linear(2, 2), DiagGGNExact())  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        RuntimeError: all_reduce_extensions needs torch.distributed: ...
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "all_reduce_extensions needs torch.distributed: call "
            "torch.distributed.init_process_group(...) on every rank first."
        )
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum'; got {reduction!r}.")
    group = process_group if process_group is not None else cast(ProcessGroup, dist.group.WORLD)
    ranks = dist.get_world_size(group)
    parameters = [p for p in model.parameters() if p.requires_grad]
    for extension in extensions:
        spec = extension.job().quantity
        if spec.family is Family.PRODUCTS or spec.combine is Combine.PER_SAMPLE:
            continue
        if spec.combine not in (Combine.SUM, Combine.KRONECKER):
            raise ValueError(
                f"{type(extension).__name__} is not a sum over samples, so ranks cannot be "
                "combined; for Variance extend with SumGradSquared and combine it with .grad, "
                "for KFRA use KFLR or KFAC."
            )
        if spec.combine is Combine.KRONECKER:
            _refuse_unequal_batches(extension, parameters, group)
        power = spec.loss_power
        scale = 1 / ranks**power if reduction == "mean" else 1.0
        for p in parameters:
            value = getattr(p, extension.savefield, None)
            if value is not None:
                first = input_factor_first(p, extension.savefield)
                combined = _combined(value, scale, ranks, group, input_first=first)
                store_result(p, extension.savefield, combined, input_factor_first=first)


def _refuse_unequal_batches(
    extension: BackpropExtension, parameters: list[nn.Parameter], group: ProcessGroup
) -> None:
    """Refuse Kronecker factors of ranks whose batches differ in size, on every rank.

    Each rank's input factors average its own samples; averaging them over ranks weighs
    every rank alike, which is the global average only where the batches are equally large
    (unequal ones: a factor 17 % off, a probe).

    Raises:
        ValueError: where the ranks' batch sizes differ.
    """
    noted = (samples_of(p, extension.savefield) for p in parameters)
    mine = next((n for n in noted if n is not None), -1)
    local = torch.tensor([mine], dtype=torch.int64, device=_device(parameters))
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    sizes = [int(found) for found in gathered]
    if len(set(sizes)) > 1:
        raise ValueError(
            f"{type(extension).__name__}'s input factors average each rank's own samples, and "
            f"the ranks' batches differ in size ({sizes}; -1: none noted): averaged over ranks "
            "they would not be the global batch's. Give every rank an equally large batch, or "
            "use the functional API with process_group= (pf.kflr(..., process_group=...)), "
            "which weighs each sample once."
        )


def _device(parameters: list[nn.Parameter]) -> torch.device:
    """Where the collective runs: the parameters' device (CPU for gloo, the GPU for NCCL)."""
    return parameters[0].device if parameters else torch.device("cpu")


def _combined(
    value: Tensor | list[Tensor],
    scale: float,
    ranks: int,
    group: ProcessGroup,
    *,
    input_first: bool = False,
) -> Tensor | list[Tensor]:
    """One field summed over ranks: ``scale ×`` a tensor, or ``[scale × G, A / ranks]``.

    The output factor ``G`` is a sum over samples (scaled as the loss), the input factor
    ``A`` a mean; a weight stored ``[in, out]`` has them the other way round
    (``input_first``, :func:`~packfunc.compat._stored_io.input_factor_first`).
    """
    summed = sum_over_ranks(value, group)
    if isinstance(summed, Tensor):
        return summed * scale
    if input_first:
        return [summed[0] / ranks, summed[1] * scale]
    return [summed[0] * scale, *(factor / ranks for factor in summed[1:])]


__all__ = ["all_reduce_extensions"]
