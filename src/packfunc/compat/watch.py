"""The shim's forward watcher: packfunc's batch pass, kept from the user's own forward.

An extended model's forward runs inside :class:`ForwardRecorder`, which changes
nothing and keeps, for every call that consumes parameters, its arguments and
its output's gradient edge. At backward time the calls are matched, in order,
with discovery's plan (:attr:`~packfunc.engine.discovery.Plan.uses`): tapped
calls give their input, local calls their arguments, derivations are rebuilt —
and the user's graph is pulled back instead of running the model again. Any
mismatch (a fused op packfunc's pass decomposes, an input changed in place, a
call the plan classified differently) makes :meth:`ForwardRecorder.record`
return ``None``, and packfunc's own pass runs.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import optree
import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.overrides import TorchFunctionMode

from packfunc.compat.site_cotangents import SiteCotangents, UsersCotangents
from packfunc.engine.api import (
    ATTENTION_OPS,
    LINEAR_CALLS,
    RECURRENT_OPS,
    RESHAPES,
    SIGNATURES,
    BatchRecord,
    CallArguments,
    Derived,
    FixedTensors,
    FlatRows,
    LeafIndex,
    LocalInputs,
    Plan,
    Recorded,
    Source,
    Use,
    UseKind,
    autograd_record,
    graph_owner,
    is_metadata_query,
    leaves_of,
    linear_in_out,
    make_call,
    parameter_sources,
    random_call,
    remember_derivations,
    sample_layout,
    tensor_outputs,
)
from packfunc.losses import check_loss_inputs


@dataclass
class WatchedCall:
    """One call of a watched forward pass that consumed parameters (or tensors made of them).

    Attributes:
        func: The function called.
        arguments: Its flattened arguments.
        versions: Version counter of each tensor argument right after the call.
        output: Its output (``None`` once released, or if not a tensor).
        output_version: The output's version counter right after the call.
        edge: The output's gradient edge (``None`` once released, or if it needs no grad).
        outputs: Every tensor it returned, for derivations (by position; ``None``: one tensor).
        carries_samples: Whether an argument carried samples (else parameters only).
        shape: The shape of the call's output as packfunc's pass has it, where the output
            is that laid out as flat rows (an ``addmm`` watched as
            :func:`~packfunc.engine.ops.linear_in_out`); ``None``: the output's own.
        without_grad: Whether it ran under ``torch.no_grad()`` (a derivation of it is then
            a constant to differentiation).
    """

    func: Callable
    arguments: CallArguments
    versions: tuple[int | None, ...]
    output: Tensor | None
    output_version: int
    edge: GradientEdge | None
    outputs: list[tuple[int | None, Tensor]]
    carries_samples: bool
    shape: tuple[int, ...] | None = None
    without_grad: bool = False

    def unchanged(self) -> bool:
        """Whether no tensor argument was changed in place since the call."""
        return all(
            version is None or value._version == version
            for value, version in zip(self.arguments.values, self.versions)
        )


class ForwardRecorder(TorchFunctionMode):
    """Watch someone else's forward pass and keep every call that consumes parameters.

    Unlike packfunc's own modes it changes nothing: recurrent and attention ops
    stay fused and BatchNorm in training mode runs; the recording is simply
    unusable when packfunc's pass would run them differently.

    Args:
        parameters: The model's parameters, in packfunc's leaf order.
        inputs: The forward's inputs (their dependents carry samples).
        buffers: The model's buffers (they carry no samples; see discovery's fixed tensors).

    Example:
        >>> layer = torch.nn.Linear(3, 2)
        >>> with ForwardRecorder(list(layer.parameters()), torch.ones(4, 3)) as recorder:
        ...     out = layer(torch.ones(4, 3))
        >>> len(recorder.calls)
        1
    """

    def __init__(self, parameters: list[Tensor], inputs: Any, buffers: tuple[Tensor, ...] = ()):
        super().__init__()
        self.leaf_of = LeafIndex(parameters)
        self.calls: list[WatchedCall] = []
        self.usable = True
        tensors = [t for t in optree.tree_leaves(inputs) if isinstance(t, Tensor)]
        self.n = tensors[0].shape[0] if tensors and tensors[0].dim() else None
        self.samples: weakref.WeakValueDictionary[int, Tensor] = weakref.WeakValueDictionary(
            {id(t): t for t in tensors}
        )
        self.made_of_parameters: dict[int, Tensor] = {}
        self.fixed = FixedTensors(buffers, (1, self.n or 1))
        self.rows = FlatRows()
        self.random: str | None = None  # the first call that drew random numbers

    def __torch_function__(
        self, func: Callable, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if is_metadata_query(func):
            return out
        if self.random is None:
            self.random = random_call(func, args, kwargs)
        if func in RESHAPES:
            self.rows.remember(func, args, out)
        layer = None
        if func in LINEAR_CALLS:
            layer = self.rows.layer(func, args, kwargs, self.leaf_of.contains)
        shape = None
        if layer is not None:  # as packfunc's pass runs it: a linear layer on x itself
            shape = (*layer[0].shape[:-1], layer[1].shape[-1]) if func is torch.addmm else None
            func, args, kwargs = linear_in_out, layer, {}
        arguments = CallArguments.of(args, kwargs)
        values = arguments.values
        touches = any(
            isinstance(v, Tensor)
            and (self.leaf_of.contains(v) or self.made_of_parameters.get(id(v)) is v)
            for v in values
        )
        samples = any(self._carries_samples(v) for v in values)
        if samples:
            self._mark(out, self.samples)
        elif not touches:
            self.fixed.note(func, values, out)
        if not touches:
            return out
        if func in RECURRENT_OPS or func in ATTENTION_OPS:
            self.usable = False  # packfunc's own pass decomposes them: the calls differ
        if samples and not torch.is_grad_enabled():
            # no graph to pull back through (a reentrant checkpoint's forward, whose backward
            # also refuses autograd.grad): packfunc's own pass runs checkpoints plainly
            self.usable = False
        if not samples and not any(out is v for v in values):
            self._mark(out, self.made_of_parameters)
        self.calls.append(_watched(func, arguments, out, samples, shape))
        return out

    def _carries_samples(self, value: Any) -> bool:
        """Depends on the inputs, or may be batch-shaped (see discovery's rule)."""
        if not isinstance(value, Tensor) or self.leaf_of.contains(value):
            return False
        if self.made_of_parameters.get(id(value)) is value or value in self.fixed:
            return False
        return self.samples.get(id(value)) is value or value.shape[:1] in ((1,), (self.n,))

    @staticmethod
    def _mark(out: Any, into: Any) -> None:
        for _, tensor in tensor_outputs(out):
            into[id(tensor)] = tensor

    def release(self, output: Tensor) -> None:
        """Drop references to the pass's final output (a hook on its graph may hold us).

        The call that produced ``output`` keeps no edge: :meth:`record` takes the
        output's own. If ``output`` was changed in place after that call, the
        recording is unusable.

        Args:
            output: The watched forward's output; :meth:`record` receives it again.
        """
        for call in self.calls:
            if call.output is output:
                self.usable &= output._version == call.output_version
                call.output = call.edge = None
                call.outputs = []

    def record(
        self,
        plan: Plan,
        leaves: list[Tensor],
        output: Tensor,
        loss: nn.Module,
        y: Any,
        n: int,
        adapt: Callable[[Tensor], Tensor] | None = None,
        differentiable: bool = False,
        cotangents: SiteCotangents | UsersCotangents | None = None,
    ) -> BatchRecord | None:
        """The batch pass's record, from the watched forward; ``None`` if it does not fit.

        Args:
            plan: The result of discovery for the same model.
            leaves: packfunc's parameter leaves (what local calls are differentiated by).
            output: The watched forward's output (still part of its autograd graph).
            loss: The loss module.
            y: The targets.
            n: The batch size.
            adapt: Maps the output to the loss input (a shape change), if they differ.
            differentiable: Keep the results' graphs (``create_graph=True``).
            cotangents: Notes each site's cotangent in the record's pullbacks, to compare
                with the user's backward pass, or takes them from it.

        Returns:
            A :class:`~packfunc.engine.batch_record.BatchRecord` pulling back through the watched
            graph, or ``None`` when the watched calls differ from the plan's.
        """
        if not self.usable or len(self.calls) != len(plan.uses):
            return None
        matched = _match(self.calls, plan, self.leaf_of, leaves, output, n)
        if matched is None:
            return None
        inputs, edges, shapes, failed = matched
        with torch.enable_grad():
            final = output if adapt is None else adapt(output)
        check_loss_inputs(loss, final, y, n)
        found = autograd_record(final, inputs, edges, shapes, failed, loss, y, differentiable)
        return found if cotangents is None else cotangents.watching(found, edges, shapes)


_Matched = tuple[dict[int, Recorded], dict[int, GradientEdge], dict[int, tuple[int, ...]], set[int]]


def _match(
    calls: list[WatchedCall],
    plan: Plan,
    leaf_of: LeafIndex,
    leaves: list[Tensor],
    output: Tensor,
    n: int,
) -> _Matched | None:
    """Pair the watched calls with the plan's uses; the record's pieces, or ``None``."""
    derived: Derived = {}
    inputs: dict[int, Recorded] = {}
    edges: dict[int, GradientEdge] = {}
    shapes: dict[int, tuple[int, ...]] = {}
    failed: set[int] = set()
    active = set(plan.active())
    for call, use in zip(calls, plan.uses):
        if call.func != use.func or call.carries_samples != (use.kind is not UseKind.DERIVED):
            return None
        if not call.unchanged():
            return None
        sources = parameter_sources(call.arguments.values, leaf_of, derived) or {}
        if use.kind is UseKind.DERIVED:
            remember_derivations(
                derived, call.func, call.arguments, sources, call.outputs, call.without_grad
            )
            continue
        if use.site is None or use.site not in active:
            continue
        k = use.site
        out = output if call.output is None else call.output
        edge = get_gradient_edge(output) if call.output is None else call.edge
        expected = (n, *plan.sites[k].tail)
        shape = call.shape or tuple(out.shape)
        try:
            recorded = _recorded(call, use, plan, sources, leaf_of, leaves, n)
        except _OtherLeaves:
            return None
        if shape[:1] == expected[:1] and shape != expected:
            return None  # the plan's rows, another layer shape: a stale plan (see batch_record)
        if edge is None or shape != expected or recorded is None:
            failed.add(k)
        else:
            inputs[k], shapes[k], edges[k] = recorded, shape, edge
    return inputs, edges, shapes, failed


class _OtherLeaves(Exception):
    """A watched layer call took other parameters or options than the plan's call there.

    The forward took another path than the plan's (or a convolution's padding changed).
    """


def _recorded(
    call: WatchedCall,
    use: Use,
    plan: Plan,
    sources: dict[int, Source],
    leaf_of: LeafIndex,
    leaves: list[Tensor],
    n: int,
) -> Recorded | None:
    """What the batch pass keeps of a tapped or local call (``None``: its layout is off).

    Raises:
        _OtherLeaves: if a layer call took other parameters or options than the plan's
            call (the forward took another path than the plan's: the plan does not fit).
    """
    args, kwargs = call.arguments.rebuild(list(call.arguments.values))
    if use.kind is UseKind.TAPPED:
        sig = SIGNATURES.get(call.func)
        if sig is None:
            return None
        bound = sig.bind(args, kwargs)
        site_call = make_call(sig, bound, leaf_of)
        x = bound["input"]
        k = use.site
        assert k is not None
        planned = plan.sites[k].call
        if site_call.leaves != planned.leaves or not planned.has_options_of(bound):
            raise _OtherLeaves
        return x if x.shape[:1] == (n,) else None
    assert use.site is not None
    layout = sample_layout(plan.sites[use.site].shapes, call.arguments.values, sources, n)
    if layout is None:
        return None
    batched, narrow = layout
    values = {leaf: leaves[leaf] for leaf in leaves_of(sources)}
    return LocalInputs(call.func, call.arguments, sources, batched, narrow, values)


def _watched(
    func: Callable,
    arguments: CallArguments,
    out: Any,
    samples: bool,
    shape: tuple[int, ...] | None = None,
) -> WatchedCall:
    """Describe a call right after it ran."""
    versions = tuple(
        v._version if isinstance(v, Tensor) and not v.is_inference() else None
        for v in arguments.values
    )  # (an inference tensor keeps no version: it cannot be changed in place outside)
    outputs = tensor_outputs(out)
    tensor = out if isinstance(out, Tensor) else None
    edge = _gradient_edge(tensor)
    version = tensor._version if tensor is not None else 0
    return WatchedCall(
        func,
        arguments,
        versions,
        tensor,
        version,
        edge,
        outputs,
        samples,
        shape,
        without_grad=not torch.is_grad_enabled(),
    )


def _gradient_edge(tensor: Tensor | None) -> GradientEdge | None:
    """Where autograd would pull a tensor back to; ``None`` where there is no such node.

    A view of a parameter made under ``no_grad`` (spectral norm's power iteration) requires
    grad but has no node: nothing pulls back through it.
    """
    if tensor is None or not tensor.requires_grad:
        return None
    owner = graph_owner(tensor)  # (a view changed in place later moves onto a new node)
    if owner is None:
        return None
    try:
        return get_gradient_edge(owner)
    except AssertionError:  # torch's "Expected gradient function to be set"
        return None
