"""Follow shape-only ops between a recorded model output and the tensor a loss receives.

BackPACK code often applies the loss to a reshaped output, e.g. laplace-torch's
``lossfunc(f.view(-1, f.size(-1)), y.view(-1))``. Such a tensor is the model
output with its elements rearranged. :func:`find_layout` walks the tensor's
autograd nodes back to the recorded output (through views, reshapes, permutes,
transposes, (un)squeezes and clones only) and works out the rearrangement
applied to every sample alike, so the same loss can be written in packfunc's
canonical per-sample form: ``[N, ...]`` with one block of rows per sample.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor

RECORD_KEY = "packfunc_record"
"""Key of the recorded forward pass in the metadata of its output's autograd node."""

_REORDERS = re.compile(r"(Permute|Transpose|T)Backward\d*")
"""Shape-only ops that change the order of the elements."""
_BACKWARD_HOOK = "BackwardHookFunctionBackward"
"""The node of the identity a module with a full backward hook wraps its output (and a loss
with one, its input) in: no rearrangement, and not run (it would call the user's hook)."""
_SHAPE_ONLY = re.compile(
    r"(View|UnsafeView|ReshapeAlias|Permute|Transpose|T|Squeeze|Unsqueeze|Clone|Alias)"
    r"Backward\d*"
)


@dataclass(frozen=True)
class SampleLayout:
    """Where the elements of a rearranged model output come from, per sample.

    The rearranged tensor has ``N·P`` rows of shape ``row_shape``; sample ``n`` owns
    ``P`` of them. In canonical order (rows grouped by sample) its flattened
    per-sample block is ``output.reshape(N, -1)[:, gather]``.

    Attributes:
        gather: Index into one sample's flattened output (``None``: in order).
        positions: Rows per sample, ``P``.
        row_shape: Shape of one row.
        row_order: Rows in canonical order (``None``: already in that order).
    """

    gather: Tensor | None
    positions: int
    row_shape: tuple[int, ...]
    row_order: Tensor | None

    def output(self, out: Tensor, class_dim: bool = False) -> Tensor:
        """Rearrange a model output ``[n, ...]`` into canonical form.

        Args:
            out: A model output for ``n`` samples.
            class_dim: Move the class dimension (the rows' first) before the positions,
                as ``[n, C, P, ...]`` for class losses.

        Returns:
            ``[n, *row_shape]`` if ``P == 1``, else ``[n, P, *row_shape]`` (or
            ``[n, C, P, ...]`` with ``class_dim``).

        Example:
            >>> layout = SampleLayout(None, 1, (3,), None)
            >>> layout.output(torch.zeros(2, 3)).shape
            torch.Size([2, 3])
        """
        n = out.shape[0]
        flat = out.reshape(n, -1)
        if self.gather is not None:
            flat = flat[:, self.gather]
        return self._blocks(flat.view(n, -1), class_dim)

    def target(self, y: Tensor, class_dim: bool = False) -> Tensor:
        """Rearrange targets given per row of the rearranged output into canonical form.

        Args:
            y: Targets ``[N·P, ...]``, row for row.
            class_dim: As in :meth:`output` (class-probability targets).

        Returns:
            Targets in the layout of :meth:`output`.

        Example:
            >>> SampleLayout(None, 2, (3,), None).target(torch.arange(4)).shape
            torch.Size([2, 2])
        """
        if self.row_order is not None:
            y = y[self.row_order]
        return self._blocks(
            y.reshape(y.shape[0] // self.positions, -1), class_dim, row_shape=tuple(y.shape[1:])
        )

    def _blocks(
        self, flat: Tensor, class_dim: bool, row_shape: tuple[int, ...] | None = None
    ) -> Tensor:
        n, shape = flat.shape[0], self.row_shape if row_shape is None else row_shape
        if self.positions == 1:
            return flat.view(n, *shape)
        blocks = flat.view(n, self.positions, *shape)
        return blocks.movedim(2, 1) if class_dim and len(shape) else blocks


def node_metadata(node: Any) -> dict[str, Any]:
    """The metadata dict of an autograd node (where a recorded pass is kept).

    Args:
        node: An autograd node (a tensor's ``grad_fn``).

    Returns:
        Its ``metadata`` dict.

    Example:
        >>> node_metadata((torch.zeros(1, requires_grad=True) * 2).grad_fn)
        {}
    """
    return cast(dict[str, Any], node.metadata)


def find_layout(tensor: Tensor) -> tuple[Any, SampleLayout] | None:
    """Find the recorded forward pass whose output ``tensor`` rearranges, and how.

    Args:
        tensor: A tensor computed from a recorded output by shape-only ops (or the
            output itself).

    Returns:
        ``(record, layout)``, or ``None`` if no recorded output is reached through
        shape-only ops.

    Raises:
        ValueError: if the rearrangement mixes samples within a row, or gives samples
            different numbers of rows or different orders.

    Example:
        >>> find_layout(torch.zeros(2, 3, requires_grad=True) * 2) is None
        True
    """
    node, chain = tensor.grad_fn, []
    while node is not None and RECORD_KEY not in node_metadata(node):
        name = type(node).__name__
        if name != _BACKWARD_HOOK:  # (the identity of a module's full backward hook)
            if not _SHAPE_ONLY.fullmatch(name):
                return None
            chain.append(node)
        node = _single_input(node)
    if node is None:
        return None
    record = node_metadata(node)[RECORD_KEY]
    output_shape = record.output_shape
    if not chain:
        return record, SampleLayout(None, 1, tuple(output_shape[1:]), None)
    if not any(_REORDERS.fullmatch(type(node).__name__) for node in chain):
        return record, _layout_in_order(tuple(tensor.shape), output_shape)
    return record, _layout(chain, tuple(tensor.shape), output_shape)


def _layout_in_order(shape: tuple[int, ...], output_shape: torch.Size) -> SampleLayout:
    """The layout of a reshape that keeps the element order (views, squeezes, clones).

    Every element stays in place, so rows own samples in order; no element numbers
    need pulling back (the output may be large: ``[N, T, vocabulary]``).
    """
    n, per_sample = output_shape[0], int(output_shape[1:].numel())
    rows = shape[0] if shape else 1
    row_numel = int(torch.Size(shape[1:]).numel())
    positions = rows // n
    if positions * n != rows or positions * row_numel != per_sample:
        raise ValueError(
            "the loss input's rows straddle samples; apply the loss to the model output "
            "with the samples along dim 0."
        )
    return SampleLayout(None, positions, tuple(shape[1:]), None)


def _single_input(node: Any) -> Any:
    inputs = [fn for fn, _ in node.next_functions if fn is not None]
    return inputs[0] if len(inputs) == 1 else None


def _layout(chain: list[Any], shape: tuple[int, ...], output_shape: torch.Size) -> SampleLayout:
    """The per-sample layout of the chain's result, from its backward functions.

    The backward of a rearrangement moves every element back to where it came
    from: pulling the element numbers of the result back gives, at each output
    element, the result element it went to.
    """
    numel = int(torch.Size(shape).numel())
    went_to = torch.arange(numel, dtype=torch.float64).view(shape)
    for node in chain:
        went_to = node(went_to)
    source = torch.argsort(went_to.reshape(-1).long())  # result element -> output element
    n, per_sample = output_shape[0], int(output_shape[1:].numel())
    rows = shape[0] if shape else 1
    owner = (source // per_sample).view(rows, -1)
    if not bool((owner == owner[:, :1]).all()):
        raise ValueError(
            "the loss input mixes samples within one row; apply the loss to the "
            "model output with the samples along dim 0."
        )
    row_sample = owner[:, 0]
    positions = rows // n
    if positions * n != rows or not bool(
        (torch.bincount(row_sample, minlength=n) == positions).all()
    ):
        raise ValueError(
            "the loss input gives the samples different numbers of rows; "
            "packfunc needs the same rearrangement for every sample."
        )
    row_order = torch.argsort(row_sample, stable=True)
    blocks = source.view(rows, -1)[row_order].view(n, -1)
    offsets = torch.arange(n).unsqueeze(1) * per_sample
    gather = blocks[0]
    if not bool((blocks - offsets == gather).all()):
        raise ValueError(
            "the loss input rearranges the samples differently; packfunc needs "
            "the same rearrangement for every sample."
        )
    in_order = bool((gather == torch.arange(per_sample)).all())
    rows_in_order = bool((row_order == torch.arange(rows)).all())
    return SampleLayout(
        None if in_order else gather,
        positions,
        tuple(shape[1:]),
        None if rows_in_order else row_order,
    )
