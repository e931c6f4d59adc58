"""Extended models that return several tensors: a tuple, a dict, a Hugging Face ``ModelOutput``.

The shim computes from the gradient of the one output the loss takes. A model returning
``(logits, features)`` (``features`` computed on the way to ``logits``), or a ``ModelOutput``
with ``logits``, ``hidden_states`` and ``past_key_values``, gives each tensor to the caller as
an alias (``view_as``) whose autograd node is new: its hook sees only the gradient the loss
sends to that output directly, not the share that flows back through a later output. When
the backward pass has gone through every alias it reaches, exactly one must have a gradient;
the extensions then run for that output, as for a model returning it alone (its model
function selects it). A loss of several outputs, or of one without a row per sample (a
loss computed inside the model), is refused by name. An output object the pytree does not
know (a dataclass, a ``SimpleNamespace``, a class of the user's) is looked into through its
attributes, and given to the caller as a shallow copy holding the aliases.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, cast

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn

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
        on_refusal: What a refusal of this output's backward pass drops (results, stored
            inputs and outputs), given a record of the output.
        gradients: Per graph task, the gradients its backward pass brought to the aliases.
    """

    names: list[str]
    records: list[ForwardRecord | None]
    nodes: list[Any]
    on_backward: OnBackward
    on_refusal: Callable[[ForwardRecord], None]
    gradients: dict[int, dict[int, Tensor]] = field(default_factory=dict)


Rebuild = Callable[[list[Any]], Any]
"""Makes an output of the flattened one's structure from new leaves (see :func:`flat_output`)."""

_DEPTH = 4
"""How deep :func:`flat_output` looks into objects inside objects."""


def flat_output(output: Any, depth: int = 0) -> tuple[list[tuple[str, Any]], Any, Rebuild]:
    """The leaves of a model's output with their paths, its structure, and its rebuild.

    A pytree (tuple, list, dict, ``ModelOutput``) is flattened as ``torch.utils._pytree``
    does; a leaf that is an object holding tensors in its attributes (a dataclass, a
    ``SimpleNamespace``) is flattened through them, and rebuilt as a shallow copy.

    Args:
        output: A model's output.
        depth: How many objects deep this output lies (internal).

    Returns:
        ``(leaves, structure, rebuild)``: each leaf as ``(path, value)``; a structure that
        compares equal for outputs of the same layout; ``rebuild(values)`` the output with
        the leaves replaced by ``values`` (the original is left as it is).

    Example:
        >>> import types
        >>> leaves, _, rebuild = flat_output(types.SimpleNamespace(logits=torch.zeros(1)))
        >>> [path for path, _ in leaves], rebuild([torch.ones(1)]).logits
        (['.logits'], tensor([1.]))
    """
    flat, spec = pytree.tree_flatten_with_path(output)
    leaves: list[tuple[str, Any]] = []
    structure: list[Any] = []
    parts: list[tuple[int, Rebuild | None, Any]] = []  # (leaf count, rebuild, original)
    for path, value in flat:
        name = pytree.keystr(path)
        attributes = _tensor_attributes(value) if depth < _DEPTH else None
        if attributes is None:
            leaves.append((name, value))
            structure.append(None)
            parts.append((1, None, value))
            continue
        inner, inner_structure, inner_rebuild = flat_output(attributes, depth + 1)
        leaves += [(f"{name}.{path[2:-2]}{rest}", v) for path, rest, v in _split(inner)]
        structure.append((type(value), inner_structure))
        parts.append((len(inner), inner_rebuild, value))

    def rebuild(values: list[Any]) -> Any:
        built, at = [], 0
        for count, inner_rebuild, original in parts:
            chunk = values[at : at + count]
            at += count
            built.append(
                chunk[0] if inner_rebuild is None else _copy_with(original, inner_rebuild(chunk))
            )
        return pytree.tree_unflatten(built, spec)

    return leaves, (spec, tuple(structure)), rebuild


def _split(leaves: list[tuple[str, Any]]) -> list[tuple[str, str, Any]]:
    """Each leaf of an attribute dict's flattening as ``(['name'], rest of its path, value)``."""
    split = []
    for path, value in leaves:
        end = path.index("]") + 1
        split.append((path[:end], path[end:], value))
    return split


def _tensor_attributes(value: Any) -> dict[str, Any] | None:
    """The attributes of an object the pytree does not know, where some hold a tensor."""
    if isinstance(value, Tensor | nn.Module | type) or not hasattr(value, "__dict__"):
        return None
    if dataclasses.is_dataclass(value):
        attributes = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    else:
        attributes = dict(vars(value))
    holds = any(isinstance(leaf, Tensor) for leaf in pytree.tree_leaves(attributes))
    return attributes if holds else None


def _copy_with(original: Any, attributes: dict[str, Any]) -> Any:
    """A shallow copy of ``original`` with ``attributes`` set (a frozen dataclass's too)."""
    copied = copy.copy(original)
    for name, value in attributes.items():
        object.__setattr__(copied, name, value)
    return copied


def aliased_output(
    output: Any,
    n: int,
    make_record: Callable[[Tensor, Any], ForwardRecord],
    on: OnBackward,
    on_refusal: Callable[[ForwardRecord], None] = lambda record: None,
) -> tuple[Any, list[ForwardRecord]]:
    """The output with each tensor that requires grad replaced by an alias that is hooked.

    Args:
        output: A model's output: a pytree (tuple, list, dict, ``ModelOutput``) of tensors.
        n: The batch size: a tensor whose dim 0 is ``n`` has a row per sample.
        make_record: ``make_record(tensor, element)``: the record of one output tensor,
            ``element`` being what :func:`select_element` takes.
        on: Runs the extensions for a record (see :data:`OnBackward`).
        on_refusal: Cleans up after a refused backward pass, given a record of the output.

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
    flat, structure, rebuild = flat_output(output)
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
        record = make_record(value, (structure, i)) if rows else None
        leaves[i] = value.view_as(value)
        if record is not None:  # an extended loss on this output finds it (second order)
            node_metadata(leaves[i].grad_fn)[RECORD_KEY] = record
        records.append(record)
        nodes.append(leaves[i].grad_fn)
    names = [path for _, path, _ in tensors]
    group = OutputGroup(names, records, nodes, on, on_refusal)
    for k, node in enumerate(nodes):
        node.register_prehook(partial(_on_alias_backward, group, k))
    return rebuild(leaves), [r for r in records if r is not None]


def select_element(output: Any, element: tuple[Any, int]) -> Tensor:
    """The tensor at flat position ``i`` of an output of structure ``structure``.

    Args:
        output: A model output.
        element: ``(structure, i)``, as :func:`flat_output` gives them.

    Returns:
        That tensor.

    Raises:
        ValueError: if the output has another structure than the recorded one.

    Example:
        >>> out = {"a": torch.zeros(1), "b": torch.ones(1)}
        >>> select_element(out, (flat_output(out)[1], 1))
        tensor([1.])
    """
    structure, i = element
    flat, found, _ = flat_output(output)
    if found != structure:
        raise ValueError(
            "the extended model returned an output of another structure than in the forward "
            "pass being differentiated; packfunc.compat selects the loss's output by position."
        )
    return cast(Tensor, flat[i][1])


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
        _refused(group)
        raise ValueError(
            f"the loss of this backward pass takes several outputs of the extended model "
            f"({names}): packfunc.compat computes per-sample quantities of a loss of one "
            "output. Backpropagate one loss per output, or return them as one tensor."
        )
    (j,) = reached
    group.on_backward(_record(group, j), (seen[j],))


def _refused(group: OutputGroup) -> None:
    """Let the group's refusal drop what its forward pass left (see :class:`OutputGroup`)."""
    record = next((r for r in group.records if r is not None), None)
    if record is not None:
        group.on_refusal(record)


def _record(group: OutputGroup, j: int) -> ForwardRecord:
    """The record of output ``j``; refused for an output without a row per sample."""
    found = group.records[j]
    if found is None:
        _refused(group)
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
        for _, value in flat_output(output)[0]
        if isinstance(value, Tensor) and value.grad_fn is not None
    ]
