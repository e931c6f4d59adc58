"""Extended models that return several tensors: a tuple, a dict, a Hugging Face ``ModelOutput``.

The shim computes from the gradient of the one output the loss takes. A model returning
``(logits, features)`` (``features`` computed on the way to ``logits``), or a ``ModelOutput``
with ``logits``, ``hidden_states`` and ``past_key_values``, gives each tensor to the caller as
an alias (``view_as``) whose autograd node is new: its hook sees only the gradient the loss
sends to that output directly, not the share that flows back through a later output. When
the backward pass has gone through every alias it reaches, exactly one must have a gradient;
the extensions then run for that output, as for a model returning it alone (its model
function selects it). A loss of several outputs, or of one without a row per sample (a
loss computed inside the model), is refused by name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from packfunc.compat import context
from packfunc.compat.layout import RECORD_KEY, node_metadata
from packfunc.compat.records import ForwardRecord

__all__ = ["OutputGroup", "aliased_output", "select_element", "output_nodes"]

OnBackward = Callable[[ForwardRecord, tuple[Tensor, ...]], None]
"""Runs the active extensions for a record, given its output's gradient."""


@dataclass(eq=False)
class OutputGroup:
    """The tensors of one forward pass's output that require grad, and their aliases' nodes.

    Attributes:
        names: Each tensor's path in the output (``"[0]"``, ``".logits"``).
        records: Each tensor's record, ``None`` for one without a row per sample.
        nodes: Each alias's autograd node.
        on_backward: What runs the extensions for the record the loss takes.
        gradients: Per graph task, the gradients its backward pass brought to the aliases.
    """

    names: list[str]
    records: list[ForwardRecord | None]
    nodes: list[Any]
    on_backward: OnBackward
    gradients: dict[int, dict[int, Tensor]] = field(default_factory=dict)


def aliased_output(
    output: Any, n: int, make_record: Callable[[Tensor, Any], ForwardRecord], on: OnBackward
) -> tuple[Any, list[ForwardRecord]]:
    """The output with each tensor that requires grad replaced by an alias that is hooked.

    Args:
        output: A model's output: a pytree (tuple, list, dict, ``ModelOutput``) of tensors.
        n: The batch size: a tensor whose dim 0 is ``n`` has a row per sample.
        make_record: ``make_record(tensor, element)``: the record of one output tensor,
            ``element`` being what :func:`select_element` takes.
        on: Runs the extensions for a record (see :data:`OnBackward`).

    Returns:
        ``(output, records)``: the output with aliases (the same values, of the same
        container types), and the records of its tensors with a row per sample (none: the
        output is returned unchanged).

    Example:
        >>> h = torch.randn(3, 2, requires_grad=True) * 1.0
        >>> out, records = aliased_output((h, h.sum()), 3, lambda t, e: "h", lambda r, g: None)
        >>> out[0] is h, torch.equal(out[0], h), records
        (False, True, ['h'])
    """
    flat, spec = pytree.tree_flatten_with_path(output)
    tensors = [
        (i, path, value)
        for i, (path, value) in enumerate(flat)
        if isinstance(value, Tensor) and value.requires_grad
    ]
    # a parameter returned as it is has no row per sample either (a learned noise scale)
    batched = [
        value.grad_fn is not None and value.dim() > 0 and value.shape[0] == n
        for _, _, value in tensors
    ]
    if not any(batched):
        return output, []
    leaves = [value for _, value in flat]
    records: list[ForwardRecord | None] = []
    nodes = []
    for (i, _, value), rows in zip(tensors, batched, strict=True):
        record = make_record(value, (spec, i)) if rows else None
        leaves[i] = value.view_as(value)
        if record is not None:  # an extended loss on this output finds it (second order)
            node_metadata(leaves[i].grad_fn)[RECORD_KEY] = record
        records.append(record)
        nodes.append(leaves[i].grad_fn)
    names = [pytree.keystr(path) for _, path, _ in tensors]
    group = OutputGroup(names, records, nodes, on)
    for k, node in enumerate(nodes):
        node.register_prehook(partial(_on_alias_backward, group, k))
    return pytree.tree_unflatten(leaves, spec), [r for r in records if r is not None]


def select_element(output: Any, element: tuple[Any, int]) -> Tensor:
    """The tensor at flat position ``i`` of an output of structure ``spec``.

    Args:
        output: A model output.
        element: ``(spec, i)``.

    Returns:
        That tensor.

    Raises:
        ValueError: if the output has another structure than the recorded one.

    Example:
        >>> out = {"a": torch.zeros(1), "b": torch.ones(1)}
        >>> select_element(out, (pytree.tree_flatten(out)[1], 1))
        tensor([1.])
    """
    spec, i = element
    flat, found = pytree.tree_flatten(output)
    if found != spec:
        raise ValueError(
            "the extended model returned an output of another structure than in the forward "
            "pass being differentiated; packfunc.compat selects the loss's output by position."
        )
    return flat[i]


def _on_alias_backward(group: OutputGroup, k: int, grad_outputs: tuple[Tensor | None, ...]) -> None:
    """Note alias ``k``'s gradient; after the last alias this backward pass reaches, run."""
    if context.in_own_pass():  # packfunc's own pass through the user's graph
        return
    task = torch._C._current_graph_task_id()
    seen = group.gradients.setdefault(task, {})
    if grad_outputs[0] is not None:
        seen[k] = grad_outputs[0]
    pending = [
        j
        for j, node in enumerate(group.nodes)
        if j != k and j not in seen and torch._C._will_engine_execute_node(node)
    ]
    if pending:
        return
    del group.gradients[task]
    reached = sorted(seen)
    ctx = context.active()
    if not reached or ctx is None or not ctx.extensions:  # a plain backward pass: the
        for j in reached:  # records drop what they stored (any loss goes, as without extend)
            record = group.records[j]
            if record is not None:
                group.on_backward(record, (seen[j],))
        return
    if len(reached) > 1:
        names = ", ".join(group.names[j] for j in reached)
        raise ValueError(
            f"the loss of this backward pass takes several outputs of the extended model "
            f"({names}): packfunc.compat computes per-sample quantities of a loss of one "
            "output. Backpropagate one loss per output, or return them as one tensor."
        )
    (j,) = reached
    group.on_backward(_record(group, j), (seen[j],))


def _record(group: OutputGroup, j: int) -> ForwardRecord:
    """The record of output ``j``; refused for an output without a row per sample."""
    found = group.records[j]
    if found is None:
        raise ValueError(
            f"the loss of this backward pass takes the output {group.names[j]} of the extended "
            "model, which has no row per sample: a loss computed inside the model (a Hugging "
            "Face model's .loss when given labels), or a parameter returned as it is (a learned "
            "noise scale). Apply the loss to the per-sample output (the logits) outside the "
            "model, and keep parameters the loss takes outside the extended model."
        )
    return found


def output_nodes(output: Any) -> list[Any]:
    """The autograd nodes of the tensors of an output (of a forward that was not recorded).

    Args:
        output: A model output: a tensor or a pytree of them.

    Returns:
        The node of each of its tensors that has one.

    Example:
        >>> len(output_nodes((torch.ones(1, requires_grad=True) * 2, 3)))
        1
    """
    return [
        value.grad_fn
        for value in pytree.tree_leaves(output)
        if isinstance(value, Tensor) and value.grad_fn is not None
    ]
