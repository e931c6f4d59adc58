"""Discovery: run the model on one sample and classify every call that consumes parameters.

Inside a :class:`~packfunc.engine.modes.ParameterMode`, every call whose
arguments include a parameter leaf (by identity) or a tensor made of parameters
only is one :class:`Use`, in call order:

* tapped (:attr:`UseKind.TAPPED`): a linear-like op of ``engine/ops.py`` with leaves
  as weight or bias — its rules have closed forms;
* local (:attr:`UseKind.LOCAL`): any other op that meets the samples with the sample index at
  dim 0 (a norm layer, ``x + pos``, ``logits / t``, ``x @ W``) — differentiated
  on its own (``engine/rules/local.py``, ``engine/rules/norm.py``);
* derived (:attr:`UseKind.DERIVED`): an op on parameters only (``pos[:T]``, ``W.t()``,
  ``cls.expand(N, 1, D)``), recomputed from the parameters where it is used;
* other (:attr:`UseKind.OTHER`): anything else; its parameters take the whole-model path.

Tapped and local calls are the plan's *sites*: the batch pass records their
inputs and output cotangents. Running on one sample also checks that dim 0 is
the sample dimension at every site: its size must be 1 here and ``N`` in the
batch pass. A tensor *carries samples* if it depends on the inputs, or if it is
any other tensor with a leading dim of one (it may be batch-shaped, like an
RNN's zero initial state); the batch pass tells for sure.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import enum
import functools
import types
import weakref
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, cast

import numpy as np
import optree
import torch
import torch.nn.functional as F
from torch import Tensor
from torch._C._functorch import (
    get_unwrapped,
    is_functorch_wrapped_tensor,
    maybe_current_level,
    maybe_get_level,
)
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from packfunc.engine.attention import ATTENTION_OPS, dispatching_arguments, run_attention
from packfunc.engine.autodiff import custom_forward_running
from packfunc.engine.batch_dims import (
    Dims,
    batch_dims_after,
    broadcasts_the_batch,
    contracted_dims,
    reduced_dims,
)
from packfunc.engine.local import CallArguments, LocalInputs, Source
from packfunc.engine.model_state import (
    MODULE_INTERNALS,
    held_entries,
    held_modules,
    kept_model_state,
)
from packfunc.engine.modes import (
    REWRITTEN_OPS,
    LeafIndex,
    ParameterMode,
    is_metadata_query,
    leaves_of,
    nothing_retained,
    retains_nothing,
    tensor_outputs,
)
from packfunc.engine.ops import (
    CONVERSIONS,
    LINEAR_CALLS,
    ROLES,
    SIGNATURES,
    SIZED_BY_ARGUMENTS,
    LayerKind,
    OpSignature,
    SiteCall,
    bag_option,
    is_integer_index,
    make_call,
    masked_write_value,
    moved_dims,
    refuse_frequency_scaling,
    writes_rows,
)
from packfunc.engine.precision import (
    autocast_in_force,
    difference_beyond_rounding,
    differs_beyond_rounding,
    forward_autocast,
)
from packfunc.engine.randomness import DEFAULT_GENERATOR_DRAW, private_generators, random_call
from packfunc.engine.vmap_checks import poison_where
from packfunc.functionalize import (
    check_no_cached_parametrizations,
    closed_over,
    flatten_params,
    input_name,
    is_own_model_function,
    leading_sizes,
    module_of,
    object_attributes,
    read_names,
    select_samples,
)
from packfunc.losses import PICK_THE_OUTPUT
from packfunc.types import Inputs, ModelFn

Recorded = Tensor | LocalInputs
"""What the batch pass keeps of a site: a tapped op's input, or a local call's arguments."""


@dataclass
class Site:
    """A call seen during discovery whose parameters a rule differentiates on their own.

    Attributes:
        call: The tapped op (its signature) or the local call (its function), and its leaves.
        tail: The per-sample shape of its output.
        dtype: The output's dtype.
        device: The output's device.
        shapes: For a local site, the shape of each flat argument (``None``: not a tensor),
            to tell the batch pass which arguments carry samples.
    """

    call: SiteCall
    tail: torch.Size
    dtype: torch.dtype
    device: torch.device
    shapes: tuple[torch.Size | None, ...] = ()


class UseKind(Enum):
    """How discovery classified a call that consumes parameters (see :class:`Use`)."""

    TAPPED = "tapped"
    """A tapped op of :data:`~packfunc.engine.ops.SIGNATURES`: its rules have closed forms."""

    LOCAL = "local"
    """Any other op that meets the samples: differentiated on its own (the op's own vjp)."""

    DERIVED = "derived"
    """An op on parameters only: recomputed from the parameters where its output is used."""

    OTHER = "other"
    """Anything else: its parameters take the whole-model path."""


@dataclass(frozen=True)
class Use:
    """One call that consumes parameters (directly or through a derivation), in call order.

    Attributes:
        func: The function called.
        kind: How discovery classified it.
        site: The site index of a tapped or local call.
    """

    func: Callable[..., Any]
    kind: UseKind
    site: int | None = None


@dataclass
class Plan:
    """What discovery learned about the model.

    Attributes:
        sites: Every tapped or local call, in call order.
        uncovered: Leaves that only the whole-model path can differentiate.
        uses: Every call that consumes parameters, in call order.
        reasons: Why each uncovered leaf is uncovered.
        random: The first call seen that draws random numbers (dropout in training mode),
            described, or ``None``: the whole-model path and other re-runs refuse such
            models (see :mod:`packfunc.engine.randomness`).
    """

    sites: list[Site] = field(default_factory=list)
    uncovered: set[int] = field(default_factory=set)
    uses: list[Use] = field(default_factory=list)
    reasons: dict[int, str] = field(default_factory=dict)
    random: str | None = None
    updated_buffer: str | None = None
    """A buffer the forward changes (a running statistic), by name: a re-run would differ."""
    updated_input: bool = False
    """Whether the forward changes its input in place: a re-run would see another input."""
    rewritten_ops: set[Callable[..., Any]] = field(default_factory=set)
    """The functions of the calls on parameters that were decomposed or changed (an RNN,
    attention; see :data:`~packfunc.engine.modes.REWRITTEN_OPS`), and ``F.batch_norm`` if
    any BatchNorm was called, with parameters or not (the mode hands its backward a
    contiguous gradient, refuses training mode and keeps the running statistics)."""
    first_output: Tensor | None = None
    """The model's output for the sample discovery ran on alone, until a batch pass compared
    it with that sample's row (:func:`check_rows_alone`)."""
    first_inputs: dict[int, Tensor | dict[int, Tensor]] = field(default_factory=dict)
    """Each site's input for the sample discovery ran on alone, by site (a local site's
    arguments that carry samples, by flat position), until a batch pass compared it with
    that sample's row of the site's input (a model that moves the batch's rows for more
    than one sample only: :func:`check_rows_alone`)."""
    sample: int = 0
    """The sample of the batch discovery ran on (the first, unless the batch's calls
    followed another sample's path: see :func:`cached_discover`)."""
    one_sample_only: bool = False
    """Kept for batches of one sample alone: its rows were never checked (a batch of one,
    whose row is trivially its own), so a larger batch discovers again and checks them."""
    refusal: str | None = None
    """The rows check's refusal of this plan, repeated for every later batch (under
    ``vmap`` too, where values decide nothing)."""
    mixes: str | None = None
    """A reduction over the batch whose result reaches the output (``alpha * h.mean(0)``),
    described: its rows may mix samples where its values let them (``alpha`` no longer
    zero), so every batch pass checks its rows again (the plan is not kept)."""

    @property
    def rewritten(self) -> bool:
        """Whether a call that consumed parameters was decomposed or changed."""
        return bool(self.rewritten_ops)

    def note_random(self, what: str | None) -> None:
        """Make the plan random: ``what`` drew random numbers (the first one seen is kept).

        A kept plan becomes random where a later forward draws what discovery's did not
        (dropout switched on since): whatever would run the model again then refuses.

        Args:
            what: The call that drew, described, or ``None`` (nothing drew).

        Example:
            >>> plan = Plan()
            >>> plan.note_random(None); plan.note_random("dropout"); plan.note_random("rand")
            >>> plan.random
            'dropout'
        """
        if self.random is None:
            self.random = what

    @property
    def leaf_calls_only(self) -> bool:
        """Whether every use of a parameter is a tapped, local or deriving call.

        No call that consumed them was rewritten but attention and linear layers with their
        weight stored ``[in, out]``, and none takes the whole-model path: the batch pass can
        then follow the calls that receive the leaves and the tensors derived from them alone
        (see :class:`~packfunc.engine.batch_record._TappedLeaf`).
        """
        rewritten = self.rewritten_ops - ATTENTION_OPS - LINEAR_CALLS
        return not (rewritten or self.uncovered) and all(
            use.kind is not UseKind.OTHER for use in self.uses
        )

    def covered(self) -> set[int]:
        """Return the leaves whose every use is a tapped or local call."""
        return {leaf for site in self.sites for _, leaf in site.call.leaves} - self.uncovered

    def active(self) -> list[int]:
        """Return the indices of sites that have at least one covered leaf."""
        covered = self.covered()
        return [
            k
            for k, site in enumerate(self.sites)
            if any(leaf in covered for _, leaf in site.call.leaves)
        ]

    def uncover(self, leaves: set[int], reason: str) -> None:
        """Send ``leaves`` to the whole-model path, remembering the first reason for each."""
        self.uncovered |= leaves
        for leaf in leaves:
            self.reasons.setdefault(leaf, reason)


class _DiscoveryMode(ParameterMode):
    """Classifies every call that consumes parameters (see :class:`Use`) on one sample.

    A tensor *carries samples* if it depends on the inputs, or if it is any other
    tensor with a leading dim of one (it may be batch-shaped, like an RNN's zero
    initial state; the batch pass tells for sure).
    """

    def __init__(
        self,
        leaf_of: LeafIndex,
        X: Any,
        buffers: list[Tensor],
        operators: _OperatorsInSight | None = None,
    ):
        super().__init__(leaf_of)
        self.operators = operators  # tells the calls of code the batch pass does not see
        self.plan = Plan(uncovered=set(leaf_of.duplicated))
        self.plan.reasons = dict.fromkeys(leaf_of.duplicated, "the same tensor is two parameters")
        self.samples: weakref.WeakValueDictionary[int, Tensor] = weakref.WeakValueDictionary(
            {id(t): t for t in optree.tree_leaves(X) if isinstance(t, Tensor)}
        )
        self.fixed = FixedTensors(buffers)
        spans = enumerate(memory_span(leaf) for leaf in leaf_of.leaves)
        self.leaf_spans = [(leaf, span) for leaf, span in spans if span is not None]
        # the memory of tensors that carry samples (see _follow_aliases)
        self.sample_memory: set[int] = set()
        # tensors whose rows may be other samples' (see _note_moved_rows): the call that moved
        self.moved: weakref.WeakValueDictionary[int, Tensor] = weakref.WeakValueDictionary()
        self.moved_by: str | None = None
        # tensors computed from a reduction over the batch (see _note_mixed_rows)
        self.mixed: weakref.WeakValueDictionary[int, Tensor] = weakref.WeakValueDictionary()
        self.mixed_by: str | None = None
        # tensors computed from a broadcast of the batch over another dim (_note_batch_dims)
        self.stretched: weakref.WeakValueDictionary[int, Tensor] = weakref.WeakValueDictionary()
        self.stretched_by: str | None = None
        # the model's own generators (torch.bernoulli(p, generator=g)), as they were before
        self.generators: dict[int, tuple[torch.Generator, Tensor]] = {}
        # torch.arange(N) and its views: an index that leaves every row where it is
        self.sample_index: weakref.WeakValueDictionary[int, Tensor] = weakref.WeakValueDictionary()
        # the dims of tensors that carry samples known to carry the batch (the inputs' dim 0)
        self.batch_dims: dict[int, tuple[weakref.ref[Tensor], Dims]] = {
            id(t): (weakref.ref(t), frozenset({0})) for t in self.samples.values() if t.dim()
        }
        self._note_memory(list(self.samples.values()))
        self.level = maybe_current_level()  # the caller's torch.func transforms, if any

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        if self.operators is not None and self.operators.calling:
            return self._out_of_sight(func, args, kwargs or {})
        changed = changed_in_place(func, args, kwargs or {})
        if changed is not None and self._lies_in_a_parameter(changed):
            raise ValueError(
                f"the model changes a parameter in place in its forward pass "
                f"({_written_by(func)}), so every forward would see other values: "
                "packfunc's forward of one sample and its batch pass would each change it, where "
                "your training step changes it once. Change it outside the forward (after the "
                "optimizer's step, as weight clipping does) or use it out of place "
                "(w.clamp(...) instead of w.clamp_(...))."
            )
        if func is F.embedding_bag:
            frequencies = bag_option(args, kwargs or {}, "scale_grad_by_freq")
            refuse_frequency_scaling("EmbeddingBag", frequencies)
        if maybe_current_level() != self.level and self._touches_parameters(
            *self._at_callers_level((args, kwargs or {}))
        ):
            raise ValueError(
                f"the model uses a parameter inside a torch.func transform of its own forward "
                f"(torch.vmap, torch.func.grad, jacrev ...: {getattr(func, '__name__', func)}), "
                "whose calls packfunc cannot follow: it would take the parameter as unused and "
                "its per-sample quantities as zero. Write that part with batched ops (f applied "
                "to the whole batch instead of torch.vmap(f)), or compute these quantities "
                "without packfunc."
            )
        self._note_custom_backward(func, args, kwargs or {})
        self.plan.note_random(random_call(func, args, kwargs or {}))
        generator = (kwargs or {}).get("generator")
        if isinstance(generator, torch.Generator) and id(generator) not in self.generators:
            self.generators[id(generator)] = (generator, generator.get_state())
        # (any BatchNorm: the mode hands its backward a contiguous gradient, parameters or not)
        if func in REWRITTEN_OPS and (
            func is F.batch_norm or self._touches_parameters(args, kwargs or {})
        ):
            self.plan.rewritten_ops.add(func)
            if func in ATTENTION_OPS and not self._touches_parameters(
                dispatching_arguments(args, kwargs or {}), {}
            ):  # tapped leaves would see its projections' calls alone, on [L, N, E] rows
                self.plan.rewritten_ops.add(run_attention)
        out = super().__torch_function__(func, types, args, kwargs)
        if changed is not None:
            self._note_written(changed, args, kwargs or {})
        return out

    def _note_custom_backward(
        self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """Send parameters whose gradient is not their ops' derivative to the whole model.

        A custom ``autograd.Function``'s forward (its backward is what autograd takes: a
        weight quantizer's rounding, a straight-through estimator) and a gradient hook on a
        tensor made of parameters (``w.register_hook(...)`` in the forward): followed through
        the ops, their per-sample quantities would read the ops' derivative alone.
        """
        if not self._touches_parameters(args, kwargs):
            return
        if func is Tensor.register_hook:
            reason = "its value has a gradient hook in the forward (register_hook)"
        else:
            name = custom_forward_running()
            if name is None:
                return
            reason = f"used inside the custom autograd.Function {name}"
        values = CallArguments.of(args, kwargs).values
        sources = self._sources(values)
        leaves = leaves_of(sources) if sources else set(range(len(self.leaf_of.leaves)))
        self.plan.uncover(leaves, reason)

    def _at_callers_level(self, arguments: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The arguments as the caller's transforms see them: wrappers of the forward's own off.

        Inside a ``torch.func.grad`` of the forward's own the parameters arrive wrapped
        (``functional_call(layer, dict(layer.named_parameters()), ...)`` in a MAML step).
        """
        callers = -1 if self.level is None else self.level

        def unwrapped(value: Any) -> Any:
            while (
                isinstance(value, Tensor)
                and is_functorch_wrapped_tensor(value)
                and maybe_get_level(value) > callers
            ):
                value = get_unwrapped(value)
            return value

        return cast(
            tuple[tuple[Any, ...], dict[str, Any]],
            optree.tree_map(unwrapped, arguments, none_is_leaf=True),
        )

    def _note_written(self, changed: Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A tensor written in place with samples (``buf[idx] = h``) carries them from then on.

        So does the tensor it is a view of; neither is fixed any more (a buffer, or zeros
        made before the write, would otherwise pass for a tensor of parameters alone).
        """
        if not self._any_marked(CallArguments.of(args, kwargs).values):
            return
        written = [tensor for tensor in (changed, changed._base) if tensor is not None]
        for tensor in written:
            self.fixed.forget(tensor)
        self._mark_samples(written)

    def _out_of_sight(
        self,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        out: Any = None,
        why: str = "in code packfunc cannot follow (a TorchScript function)",
    ) -> Any:
        """An operator called by code that reaches no function mode (a TorchScript function).

        The batch pass will not see the call: its outputs carry samples if an input does,
        and parameters it uses take the whole-model path (no use is planned for it).
        ``out``: the call's output where it has run already; ``why``: the reason given.
        """
        out = func(*args, **kwargs) if out is None else out
        values = CallArguments.of(args, kwargs).values
        if self._any_marked(values):
            self._mark_samples(out)
        used = self.leaf_of.used_in(values)
        if used:
            self.plan.uncover(used, f"used by {getattr(func, '__name__', repr(func))} {why}")
        return out

    def _packed_recurrent(
        self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        out = super()._packed_recurrent(func, args, kwargs)
        why = "on a PackedSequence (packed rows have no sample dim)"
        return self._out_of_sight(func, args, kwargs, out, why)

    def _lies_in_a_parameter(self, tensor: Tensor) -> bool:
        """Whether ``tensor`` is a parameter, a view of one, or shares its memory (``w.data``)."""
        if self.leaf_of.used_in(tensor, tensor._base):
            return True
        span = memory_span(tensor)
        return span is not None and _overlaps(span, [at for _, at in self.leaf_spans])

    def _carries_samples(self, value: Any, sources: dict[int, Source], position: int) -> bool:
        if not isinstance(value, Tensor) or position in sources or value in self.fixed:
            return False
        return self.samples.get(id(value)) is value or value.shape[:1] == (1,)

    def _dispatch(
        self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        if is_metadata_query(func):
            return func(*args, **kwargs)
        arguments = CallArguments.of(args, kwargs)
        values = arguments.values
        self._follow_aliases(values)
        sources = self._sources(values) if self._touches_parameters(args, kwargs) else {}
        if sources is None:  # a leaf that is two parameters: ambiguous
            out = func(*args, **kwargs)
            self.plan.uncover(self.leaf_of.used_in(values), "the same tensor is two parameters")
            self.plan.uses.append(Use(func, UseKind.OTHER))
            self._mark_samples(out)
            return out
        carriers = [p for p, v in enumerate(values) if self._carries_samples(v, sources, p)]
        if not sources:
            out = func(*args, **kwargs)
            if self._any_marked(values[p] for p in carriers):
                self._mark_samples(out)
                self._note_moved_rows(func, args, kwargs, out)
            else:
                self.fixed.note(func, values, out)
            self._note_sample_index(func, args, out)
            return out
        sig = SIGNATURES.get(func)
        if sig is not None and carriers and self._tapped_call(sig, args, kwargs, sources):
            return self._discover_tapped(func, sig, sig.bind(args, kwargs), args, kwargs)
        out = func(*args, **kwargs)
        # (flatten of a 1-D tensor, contiguous of a contiguous one, dropout in evaluation
        # mode: their input itself)
        in_place = not _as_it_is(func, args, kwargs) and (
            any(out is v for v in values) or changed_in_place(func, args, kwargs) is not None
        )  # (x[i] = v returns None: its write is in place all the same)
        random = random_call(func, args, kwargs)
        if not carriers and not in_place and not random:
            self._derive(func, arguments, sources, out)
            self.plan.uses.append(Use(func, UseKind.DERIVED))
            return out
        moved = bool(carriers) and self._moved_rows_among(values)
        if carriers:
            self._mark_samples(out)
            self._note_moved_rows(func, args, kwargs, out)
        per_sample = all(values[p].shape[:1] == (1,) for p in carriers)
        keeps_samples = isinstance(out, Tensor) and out.shape[:1] == (1,) and per_sample
        if in_place or random or not keeps_samples or moved:
            name = getattr(func, "__name__", repr(func))
            reason = (
                f"changed in place by {name}"
                if in_place
                else f"used by {random}, which a per-sample re-run would draw again"
                if random
                else f"used by {name}, whose tensors do not keep the sample index at dim 0"
                if not keeps_samples
                else self._moved_reason(name)
            )
            self.plan.uncover(leaves_of(sources), reason)
            self.plan.uses.append(Use(func, UseKind.OTHER))
            return out
        shapes = tuple(v.shape if isinstance(v, Tensor) else None for v in values)
        call = SiteCall.local(func, sorted(leaves_of(sources)))
        self.plan.first_inputs[len(self.plan.sites)] = {p: values[p] for p in carriers}
        self.plan.uses.append(Use(func, UseKind.LOCAL, len(self.plan.sites)))
        self.plan.sites.append(Site(call, out.shape[1:], out.dtype, out.device, shapes))
        return out

    def _tapped_call(
        self,
        sig: OpSignature,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        sources: dict[int, Source],
    ) -> bool:
        """Whether a linear-like op takes parameter leaves as weight or bias, and nowhere else.

        A linear layer's bias must have one entry per output feature: one that torch
        broadcasts (shape ``(1,)`` or ``()``) is a sum over the outputs, which the closed
        forms do not take (the call is op-local then).
        """
        bound = sig.bind(args, kwargs)
        roles = {id(bound.get(role)) for role in ROLES if self.leaf_of(bound.get(role)) is not None}
        flat = CallArguments.of(args, kwargs).values
        return (
            bool(roles)
            and all(
                isinstance(source, int) and id(flat[p]) in roles for p, source in sources.items()
            )
            and _bias_per_output(sig, bound)
        )

    def _discover_tapped(
        self,
        func: Callable[..., Any],
        sig: OpSignature,
        bound: dict[str, Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Tensor:
        sig.check_arguments(bound)
        out: Tensor = func(*args, **kwargs)
        self._mark_samples(out)
        call = make_call(sig, bound, self.leaf_of)
        x = bound["input"]
        moved = self._moved_rows_among([x])
        self._note_moved_rows(func, args, kwargs, out)
        if not (isinstance(x, Tensor) and x.dim() and x.shape[0] == 1 and out.shape[0] == 1):
            name = getattr(func, "__name__", repr(func))
            reason = f"used by {name} on tensors whose first dimension is not the sample"
            self.plan.uncover({leaf for _, leaf in call.leaves}, reason)
        elif moved:
            name = getattr(func, "__name__", repr(func))
            self.plan.uncover({leaf for _, leaf in call.leaves}, self._moved_reason(name))
        else:
            self.plan.first_inputs[len(self.plan.sites)] = x
        self.plan.uses.append(Use(func, UseKind.TAPPED, len(self.plan.sites)))
        self.plan.sites.append(Site(call, out.shape[1:], out.dtype, out.device))
        return out

    def _mark_samples(self, out: Any) -> None:
        """Record that the outputs of a call depend on the samples."""
        tensors = [tensor for _, tensor in tensor_outputs(out)]
        for tensor in tensors:
            self.samples[id(tensor)] = tensor
        self._note_memory(tensors)

    def _any_marked(self, values: Iterable[Any]) -> bool:
        """Whether any of ``values`` is a tensor marked as carrying samples."""
        return any(isinstance(v, Tensor) and self.samples.get(id(v)) is v for v in values)

    def _moved_rows_among(self, values: Iterable[Any]) -> bool:
        """Whether any of ``values`` may hold other samples' rows (see :meth:`_note_moved_rows`)."""
        return _held_in(self.moved, values)

    def _note_moved_rows(
        self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], out: Any
    ) -> None:
        """Mark what a call makes of rows moved along the batch dim (:func:`moved_dims`).

        A call on such rows passes them on; a call that indexes, sorts, flips or scatters
        samples along a dim that carries them (:meth:`_moves_the_batch`), or sums over it
        (``P @ h``), makes them (its output, and the tensor it writes). One sample cannot
        tell where the batch's rows go (``h[h[:, 0].argsort()]`` is the identity here): a
        layer on them takes the whole-model path, which runs each sample alone. Notes the
        output's batch dims too (:meth:`_note_batch_dims`).
        """
        values = CallArguments.of(args, kwargs).values
        carriers = [v for v in values if isinstance(v, Tensor) and self.samples.get(id(v)) is v]
        passed_on = self._moved_rows_among(values)
        moving = bool(carriers) and self._moves_samples(func, args, kwargs, carriers)
        self._note_mixed_rows(func, args, kwargs, out, values, carriers)
        self._note_batch_dims(func, args, kwargs, out, values, carriers)
        if not passed_on and not moving:
            return
        if not passed_on and self.moved_by is None:
            self.moved_by = getattr(func, "__name__", repr(func))
        written = changed_in_place(func, args, kwargs)
        tensors = [t for _, t in tensor_outputs(out)] + ([written] if written is not None else [])
        for tensor in tensors:
            self.moved[id(tensor)] = tensor

    def _note_mixed_rows(
        self,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        out: Any,
        values: Sequence[Any],
        carriers: list[Tensor],
    ) -> None:
        """Mark the outputs of a reduction or a product over the batch, and of calls on them.

        A floating-point reduction over a dim that carries the batch (``h.mean(0)``,
        ``h.sum()``, a softmax over it) or a product summing over it (``M @ h``) mixes
        samples where its result reaches the output, unless its values cancel it (a gate
        ``alpha`` still zero): the output check of one batch cannot tell the next, and
        :attr:`Plan.mixes` keeps it checking.
        """
        if not _held_in(self.mixed, values):
            reduced = reduced_dims(func, args, kwargs)
            first = args[0] if args and reduced is not None else None
            summed = contracted_dims(func, args, kwargs)
            if isinstance(first, Tensor) and first.dim():
                summed += [(first, d % first.dim()) for d in reduced or range(first.dim())]
            if not any(
                t.is_floating_point() and any(t is c for c in carriers) and self._is_batch_dim(t, d)
                for t, d in summed
            ):
                return
            if self.mixed_by is None:
                self.mixed_by = f"{getattr(func, '__name__', repr(func))} over the batch dim"
        for _, tensor in tensor_outputs(out):
            self.mixed[id(tensor)] = tensor

    def _moves_samples(
        self,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        carriers: list[Tensor],
    ) -> bool:
        """Whether a call on samples moves them along the batch (see :meth:`_note_moved_rows`).

        A call that reads rows moves them where the tensor it reads carries samples (not a
        fixed table indexed by them: ``table[ids]``); one that writes rows, where anything
        it writes does.
        """
        first = args[0] if args else kwargs.get("input")
        if not isinstance(first, Tensor):
            first = None
        carried = first is not None and any(first is t for t in carriers)
        masked, value = masked_write_value(func, args, kwargs)
        if masked and not any(value is t for t in carriers):  # h[~mask] = 0: a masked_fill
            return False
        writes = writes_rows(func)
        if first is not None and (carried or writes):
            # a fresh tensor written by index (zeros(N, T).scatter_(1, ids, 1)) is laid out
            # as the index that carries the samples
            laid_out = first
            if writes and self._batch_dims_of(first) is None:
                index = self._index_of_a_write(args, kwargs, carriers)
                laid_out = first if index is None else index
            for dim, index in moved_dims(func, args, kwargs):
                if self._moves_the_batch(first, dim, index, laid_out):
                    return True
        if func is F.embedding:  # rows of a weight that carries samples, picked by index
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            return any(weight is t for t in carriers)
        return any(
            self._is_batch_dim(tensor, dim)
            for tensor, dim in contracted_dims(func, args, kwargs)
            if any(tensor is t for t in carriers)
        )

    def _index_of_a_write(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], carriers: list[Tensor]
    ) -> Tensor | None:
        """The index of a ``scatter`` into a tensor of unknown layout, where it is known."""
        index = args[2] if len(args) > 2 else kwargs.get("index")
        if not (isinstance(index, Tensor) and any(index is t for t in carriers)):
            return None
        known = self._batch_dims_of(index) is not None
        return index if known and index.dim() == args[0].dim() else None

    def _moves_the_batch(
        self, tensor: Tensor, dim: int, index: Any, laid_out: Tensor | None = None
    ) -> bool:
        """Whether a move along ``dim`` of ``tensor`` may move its samples (see :func:`moved_dims`).

        Along a dim known to carry the batch (:meth:`_note_batch_dims`), any pick does.
        Where the batch dims are not known: along dim 0 any pick but an integer does, along
        another dim of one element (this sample's, after a transpose: ``[T, 1, d]`` here
        is ``[T, N, d]`` on the batch) any but an integer or a slice (``mask[:, :, :T]``).
        Rows picked by :meth:`_note_sample_index`'s indices stay where they are.
        """
        if index is not None and self.sample_index.get(id(index)) is index:
            return False
        known = self._batch_dims_of(tensor if laid_out is None else laid_out)
        if known is not None:
            return dim in known
        if is_integer_index(index):
            return False
        if dim == 0:
            return True
        return tensor.shape[dim] == 1 and not isinstance(index, slice)

    def _is_batch_dim(self, tensor: Tensor, dim: int) -> bool:
        """Whether ``dim`` of ``tensor`` carries the batch (dim 0 where its dims are unknown)."""
        known = self._batch_dims_of(tensor)
        return dim in known if known is not None else dim == 0

    def _batch_dims_of(self, tensor: Tensor) -> Dims | None:
        """The known batch dims of a tensor that carries samples, else ``None``."""
        entry = self.batch_dims.get(id(tensor))
        return entry[1] if entry is not None and entry[0]() is tensor else None

    def _note_batch_dims(
        self,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        out: Any,
        values: Sequence[Any],
        carriers: list[Tensor],
    ) -> None:
        """Note which dims of a call's outputs carry the batch (:func:`batch_dims_after`).

        Outputs of a call that stretches the batch dim over another
        (:func:`~packfunc.engine.batch_dims.broadcasts_the_batch`), and of calls on them, are
        noted in :attr:`stretched`: discovery refuses an output among them.
        """
        known = [(t, self._batch_dims_of(t)) for t in carriers]
        outputs = [tensor for _, tensor in tensor_outputs(out)]
        passed_on = _held_in(self.stretched, values)
        stretching = any(broadcasts_the_batch(func, tensor, known) for tensor in outputs)
        if stretching and self.stretched_by is None:
            self.stretched_by = getattr(func, "__name__", repr(func))
        if passed_on or stretching:
            for tensor in outputs:
                self.stretched[id(tensor)] = tensor
        for tensor in outputs:
            dims = batch_dims_after(func, args, kwargs, tensor, known)
            if dims is None:
                self.batch_dims.pop(id(tensor), None)
            else:
                self.batch_dims[id(tensor)] = (weakref.ref(tensor), dims)

    def _note_sample_index(self, func: Callable[..., Any], args: tuple[Any, ...], out: Any) -> None:
        """Note ``torch.arange(N)`` (here ``[0]``) and its views: indices of the samples in order.

        Hugging Face's masks (``padding_mask[batch_idx, kv_idx]``) and its sequence heads
        (``logits[torch.arange(N), lengths]``) pick each sample's own row by them.
        """
        if not isinstance(out, Tensor) or out.is_floating_point():
            return
        if func is torch.arange:  # torch.arange(N) alone: from 0, by 1
            steps = [value for value in args if not isinstance(value, torch.dtype)]
            if out.shape == (1,) and int(out[0]) == 0 and len(steps) == 1:
                self.sample_index[id(out)] = out
            return
        source = args[0] if args else None
        if not (isinstance(source, Tensor) and self.sample_index.get(id(source)) is source):
            return
        basic = func is not Tensor.__getitem__ or all(
            entry is None or entry is Ellipsis or isinstance(entry, slice)
            for entry in (args[1] if isinstance(args[1], tuple) else (args[1],))
        )
        if func in _KEEPS_SAMPLE_ORDER and basic and out.dim() and out.shape[0] == 1:
            self.sample_index[id(out)] = out

    def _moved_reason(self, name: str) -> str:
        """Why a layer on moved rows takes the whole-model path."""
        return (
            f"used by {name} on the batch's rows moved along its dim by {self.moved_by} (a sort, "
            "an index or a scatter of the samples): a row of the batch need not be its "
            "sample's, so each sample runs alone"
        )

    def _note_memory(self, tensors: list[Tensor]) -> None:
        """Remember where tensors that carry samples lie in memory."""
        for tensor in tensors:
            span = memory_span(tensor)
            if span is not None:
                self.sample_memory.add(span[0])

    def _follow_aliases(self, values: tuple[Any, ...]) -> None:
        """Tensors made out of this mode's sight that alias a parameter or samples.

        ``w.as_subclass(T)`` reaches no mode: its output would pass for a constant, and
        ``w`` for unused. A tensor this mode never saw made (not a parameter, derivation,
        sample or fixed tensor) is checked against their memory: on samples' memory it
        carries samples; on a parameter's, that parameter takes the whole-model path.
        """
        for value in values:
            if not isinstance(value, Tensor) or self.leaf_of.contains(value):
                continue
            known = self.derived.get(id(value))
            if (known is not None and known[0] is value) or value in self.fixed:
                continue
            if self.samples.get(id(value)) is value:
                continue
            span = memory_span(value)
            if span is None:
                continue
            if span[0] in self.sample_memory:
                self._mark_samples(value)
                continue
            aliased = {leaf for leaf, at in self.leaf_spans if _overlaps(span, [at])}
            if aliased:
                self.plan.uncover(
                    aliased,
                    "used through a tensor made out of packfunc's sight that shares its memory "
                    "(Tensor.as_subclass?)",
                )


_KEEPS_SAMPLE_ORDER = frozenset(
    {
        Tensor.view,
        Tensor.reshape,
        torch.reshape,
        Tensor.unsqueeze,
        torch.unsqueeze,
        Tensor.expand,
        Tensor.expand_as,
        Tensor.__getitem__,
        Tensor.to,
        Tensor.long,
        Tensor.int,
        Tensor.contiguous,
        Tensor.clone,
    }
)
"""Calls whose output of :meth:`_DiscoveryMode._note_sample_index`'s indices still is one."""


def keeps_fixed(
    func: Callable[..., Any],
    values: tuple[Any, ...],
    out: Any,
    is_fixed: Callable[[Any], bool],
    batch_sizes: tuple[int, ...] = (1,),
) -> bool:
    """Whether a call on fixed tensors only (or on none) certainly gives a fixed output.

    A tensor is *fixed* if it cannot carry samples: a buffer, or computed from buffers
    and constants only (``torch.arange(T).unsqueeze(0)``: position ids shared by the
    batch). Discovery runs one sample, so any dim of size one may be the batch
    (``torch.zeros(x.size(0), d)``): a call that sizes its output from Python ints (a
    factory, ``expand``, ``view``) gives a fixed tensor only without such dims. Other
    calls on fixed tensors (indexing, ``unsqueeze``, arithmetic, ``permute``) take their
    shape from those tensors, which hold no batch dim: their output is fixed.

    Args:
        func: The function called.
        values: Its flattened arguments.
        out: Its output.
        is_fixed: Whether a tensor is fixed.
        batch_sizes: Sizes a batch dim may have here (discovery: one sample).

    Returns:
        Whether every tensor ``out`` holds is fixed.

    Example:
        >>> keeps_fixed(torch.arange, (3,), torch.arange(3), lambda t: False)
        True
        >>> keeps_fixed(torch.zeros, (1, 3), torch.zeros(1, 3), lambda t: False)
        False
    """
    tensors = [v for v in values if isinstance(v, Tensor)]
    if not isinstance(out, Tensor) or not all(is_fixed(t) for t in tensors):
        return False
    if tensors and (func not in SIZED_BY_ARGUMENTS or _plain_view(func, values)):
        return True
    return not set(batch_sizes) & set(out.shape)


class FixedTensors:
    """Tensors that certainly do not carry samples: buffers and what calls on them make.

    Args:
        buffers: The model's buffers.
        batch_sizes: Sizes a batch dim may have in the pass (discovery: one sample).

    Example:
        >>> fixed = FixedTensors([])
        >>> ids = torch.arange(3)
        >>> fixed.note(torch.arange, (3,), ids)
        >>> ids in fixed, torch.zeros(3) in fixed
        (True, False)
    """

    def __init__(self, buffers: Iterable[Tensor], batch_sizes: tuple[int, ...] = (1,)):
        self._of: weakref.WeakValueDictionary[int, Tensor] = weakref.WeakValueDictionary(
            {id(t): t for t in buffers}
        )
        self.batch_sizes = batch_sizes

    def __contains__(self, value: Any) -> bool:
        return isinstance(value, Tensor) and self._of.get(id(value)) is value

    def forget(self, tensor: Tensor) -> None:
        """Take ``tensor`` out (samples were written into it).

        Args:
            tensor: A tensor, fixed or not.
        """
        self._of.pop(id(tensor), None)

    def note(self, func: Callable[..., Any], values: tuple[Any, ...], out: Any) -> None:
        """Add the outputs of a call that :func:`keeps_fixed` says are fixed.

        Args:
            func: The function called.
            values: Its flattened arguments.
            out: Its output.
        """
        if keeps_fixed(func, values, out, self.__contains__, self.batch_sizes):
            for _, tensor in tensor_outputs(out):
                self._of[id(tensor)] = tensor


def _plain_view(func: Callable[..., Any], values: tuple[Any, ...]) -> bool:
    """Whether a call is a ``view``/``reshape`` to explicit sizes (no ``-1``).

    It keeps the number of elements, so a batch size among the sizes would fail for any
    other batch; only ``-1`` could absorb one.
    """
    sizes = [v for v in values if isinstance(v, int)]
    return func in (Tensor.view, Tensor.reshape, torch.reshape) and -1 not in sizes


def discover(model_fn: ModelFn, params: Any, leaves: list[Tensor], X_first: Any) -> Plan:
    """Run the model on one sample and plan which leaves the tapped path covers.

    Args:
        model_fn: ``model_fn(params, X)``.
        params: The parameter pytree.
        leaves: Its flattened leaves (same objects as in ``params``).
        X_first: The inputs restricted to the first sample (batch size 1).

    Returns:
        The :class:`Plan`.

    Example:
        >>> fn, p = packfunc.functional(torch.nn.Linear(3, 2))
        >>> len(discover(fn, p, list(p.values()), torch.zeros(1, 3)).sites)
        1
    """
    check_no_cached_parametrizations(model_fn)
    module = module_of(model_fn)
    buffers = list(module.buffers()) if module is not None else []
    # a private copy: a model that changes its input in place changes this one, not the batch
    sample = _copied(X_first)
    operators = _OperatorsInSight()
    mode = _DiscoveryMode(LeafIndex(leaves), sample, buffers, operators)
    with private_generators(leaves) as drew, kept_model_state(module) as changed:
        try:
            with torch.no_grad(), operators, mode:
                out = model_fn(params, sample)
        finally:  # the model's own generators draw for the batch, not for discovery
            for generator, state in mode.generators.values():
                generator.set_state(state)
        if drew():
            mode.plan.note_random(DEFAULT_GENERATOR_DRAW)
    if operators.backward:
        raise ValueError(_BACKWARD_IN_THE_FORWARD)
    mode.plan.rewritten_ops |= mode.rows.rewritten  # (the tapped path sees no flat rows' source)
    mode.plan.updated_buffer = changed[0] if changed else None
    mode.plan.updated_input = not _equal_trees(sample, X_first)  # (the batch is untouched)
    if not isinstance(out, Tensor):  # a tuple, a dict, a ModelOutput
        raise ValueError(
            f"model_fn returned a {type(out).__name__}; it must return one tensor, the output "
            f"with the batch first. {PICK_THE_OUTPUT}"
        )
    if not (out.dim() and out.shape[0] == 1):
        hint = _python_values_hint(X_first)
        raise ValueError(
            f"model_fn returned {tuple(out.shape)} for a batch of one sample; it must return "
            "a tensor whose leading dimension is the batch dimension, and take the samples "
            "along dim 0 of its inputs (a sequence-first [T, N, ...] input has them along dim "
            "1: pass it batch-first; in the shim model_fn is the extended model's forward)."
            f"{hint}"
        )
    if mode.samples.get(id(out)) is not out:
        raise ValueError(_SAMPLES_OUT_OF_SIGHT)
    if mode.stretched.get(id(out)) is out:
        raise ValueError(_BATCH_STRETCHED.format(call=mode.stretched_by))
    if mode.mixed.get(id(out)) is out:
        mode.plan.mixes = mode.mixed_by
    mode.plan.first_output = out
    return mode.plan


def _held_in(table: weakref.WeakValueDictionary[int, Tensor], values: Iterable[Any]) -> bool:
    """Whether any of ``values`` is a tensor ``table`` holds (by identity, not a reused id).

    Example:
        >>> t = torch.ones(1)
        >>> table = weakref.WeakValueDictionary({id(t): t})
        >>> _held_in(table, [t, 2]), _held_in(table, [torch.ones(1)])
        (True, False)
    """
    return any(isinstance(v, Tensor) and table.get(id(v)) is v for v in values)


_SAMPLES_OUT_OF_SIGHT = (
    "the model's output does not depend on its input along any path packfunc can follow: "
    "the samples reached it only through code packfunc does not see (a round trip through "
    "numpy, Python lists or numbers, Tensor.as_subclass, torch.vmap inside the model, "
    "torch._C.DisableTorchFunction), and their per-sample quantities would be wrong. Write "
    "that part with torch operations on the tensors themselves."
)
"""Discovery's refusal of a model whose output it did not see depend on the samples."""


_BATCH_STRETCHED = (
    "the model broadcasts a tensor with one row per sample against a longer dim of another "
    "({call}): with the batch, its samples would line up with that dim (positions [T] given "
    "in X and added to tokens [N, T, d]), an error where N differs from it and wrong "
    "per-sample values where it is equal. Every tensor of X is split along dim 0 by "
    "samples: close over an input the batch shares in model_fn, or give it a dim of one "
    "per sample (positions[None].expand(N, T)); for a per-sample scalar, add its dims "
    "(s[:, None])."
)
"""Discovery's refusal of a model that lines the batch up with another dim."""


_BACKWARD_IN_THE_FORWARD = (
    "model_fn differentiates inside its forward (torch.autograd.grad or .backward(), e.g. "
    "forces as -dE/dx of an energy, an input gradient): the parameters' uses in that inner "
    "backward pass are out of packfunc's sight, and its per-sample quantities and curvature "
    "would be wrong. packfunc does not support such models; compute these quantities with "
    "per-sample autograd (torch.autograd.grad on each sample's loss, create_graph=True "
    "inside)."
)
"""Discovery's refusal of a forward that runs a backward pass of its own."""


class _OperatorsInSight(TorchDispatchMode):
    """Calls every operator from Python, so that a function mode sees code that bypasses it.

    A TorchScript function's operators reach no ``TorchFunctionMode``: to discovery its
    outputs would look like tensors made before the forward, not carrying the samples,
    and its parameters unused. Called from here, they reach the function mode too, where
    ``calling`` tells them apart: a function mode handling a call of its own does not see
    the operators that call runs.

    Example:
        >>> with _OperatorsInSight() as operators:
        ...     y = torch.ones(2) + 1
        >>> operators.calling
        False
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.calling = False
        # whether an operator ran in a backward pass inside the forward: another than the one
        # discovery may run in (the shim's, inside the user's backward pass)
        self.task, self.backward = torch._C._current_graph_task_id(), False

    supports_higher_order_operators = True  # (to refuse them by name, below)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        if isinstance(func, torch._ops.HigherOrderOperator):
            raise ValueError(_HIGHER_ORDER.format(name=func.name()))
        if torch._C._current_graph_task_id() != self.task:
            self.backward = True
        calling, self.calling = self.calling, True
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.calling = calling


_HIGHER_ORDER = (
    "the model calls torch's higher-order operator {name} (torch.cond, while_loop, scan, "
    "map, flex_attention: a function of functions), which packfunc's passes cannot follow "
    "(torch's modes see it as one operator, not the calls inside it). Write the branch or "
    "loop in Python (an if on a Python value, a for loop), or use another attention "
    "implementation (attn_implementation='sdpa' or 'eager')."
)


def _bias_per_output(sig: OpSignature, bound: dict[str, Any]) -> bool:
    """Whether a linear layer's bias (if any) has exactly one entry per output feature.

    Example:
        >>> from packfunc.engine.ops import SIGNATURES
        >>> w = torch.ones(3, 2)
        >>> [_bias_per_output(SIGNATURES[F.linear], {"weight": w, "bias": b})
        ...  for b in (None, torch.ones(3), torch.ones(1), torch.ones(()))]
        [True, True, False, False]
    """
    bias, weight = bound.get("bias"), bound.get("weight")
    if sig.kind is not LayerKind.LINEAR or not isinstance(bias, Tensor):
        return True
    if not isinstance(weight, Tensor) or weight.dim() != 2:
        return False
    outputs = weight.shape[-1] if sig.transposed else weight.shape[0]
    return tuple(bias.shape) == (outputs,)


AS_IT_IS = CONVERSIONS | {torch.flatten, Tensor.flatten}
"""Calls that may return their input itself without writing it (no in-place change)."""

_DROPOUTS = frozenset({F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout})
"""Dropouts: ``(input, p, training, inplace)``; in evaluation mode they return the input."""


def _as_it_is(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a call that returns its input itself has written nothing (see :data:`AS_IT_IS`).

    Example:
        >>> _as_it_is(F.dropout, (torch.ones(2),), {"training": False})
        True
    """
    if func in AS_IT_IS:
        return True
    if func in _DROPOUTS:
        training = args[2] if len(args) > 2 else kwargs.get("training", True)
        return not training
    return False


def changed_in_place(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Tensor | None:
    """The tensor whose values a call writes: ``out=``, ``self`` of ``x.op_()``, a bag's max_norm.

    Args:
        func: The function called.
        args: Its positional arguments.
        kwargs: Its keyword arguments.

    Returns:
        The tensor written, or ``None`` for a call that writes none of its arguments (or
        only changes flags: ``requires_grad_``).

    Example:
        >>> w = torch.ones(2)
        >>> changed_in_place(torch.Tensor.mul_, (w, 2.0), {}) is w
        True
        >>> changed_in_place(torch.Tensor.mul, (w, 2.0), {}) is None
        True
    """
    out = kwargs.get("out")
    if isinstance(out, Tensor):
        return out
    if func is F.embedding_bag and bag_option(args, kwargs, "max_norm") is not None:
        return args[1] if len(args) > 1 else kwargs.get("weight")  # renormalized in place
    if _sets_data(func):  # w.data = ...
        return args[0] if args and isinstance(args[0], Tensor) else None
    name = getattr(func, "__name__", "")
    writes = (name.endswith("_") and not name.endswith("__")) or name.startswith("__i")
    writes = (writes or name == "__setitem__") and name not in _FLAGS_ONLY
    return args[0] if writes and args and isinstance(args[0], Tensor) else None


_FLAGS_ONLY = frozenset({"requires_grad_", "share_memory_", "retain_grad", "detach_"})
"""In-place methods that change no values."""


def _sets_data(func: Callable[..., Any]) -> bool:
    """Whether ``func`` is the setter of ``Tensor.data`` (``w.data = v`` replaces its values)."""
    descriptor = getattr(func, "__self__", None)
    return descriptor is torch._C.TensorBase.data and func.__name__ == "__set__"


def _written_by(func: Callable[..., Any]) -> str:
    """How a message names a call that writes a tensor: ``mul_``, ``__setitem__``, ``data =``."""
    return "data =" if _sets_data(func) else getattr(func, "__name__", str(func))


def memory_span(tensor: Tensor) -> tuple[int, int, int] | None:
    """Where ``tensor``'s elements lie: its memory's address, and the bytes it spans there.

    Views of a tensor and its ``.data`` lie in the same memory, within its span.

    Args:
        tensor: Any tensor.

    Returns:
        ``(address, first byte, end byte)``; ``None`` for a tensor without memory of its
        own (``torch.func`` wrappers, meta tensors) or without elements.

    Example:
        >>> w = torch.ones(2, 2)
        >>> memory_span(w.data) == memory_span(w)
        True
        >>> memory_span(w[1])[1:]  # its second row: bytes 8 to 16
        (8, 16)
    """
    if tensor.numel() == 0:
        return None
    try:
        address = tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    start = int(tensor.storage_offset()) * tensor.element_size()
    return address, start, start + int(last + 1) * tensor.element_size()


def _overlaps(span: tuple[int, int, int], spans: list[tuple[int, int, int]]) -> bool:
    """Whether a memory span shares bytes with any of ``spans``."""
    address, start, end = span
    return any(a == address and s < end and start < e for a, s, e in spans)


def _copied(tree: Any) -> Any:
    """``tree`` with every tensor cloned."""
    return optree.tree_map(lambda t: t.clone() if isinstance(t, Tensor) else t, tree)


def _python_values_hint(X: Any) -> str:
    """Where ``X`` holds Python lists or tuples (per sample?), why the output lost its batch.

    packfunc does not split such values into samples: the one sample discovery ran
    (``X[0:1]``) saw the whole batch's.

    Example:
        >>> _python_values_hint({"x": torch.ones(2), "scale": [1.0, 2.0]})[:36]
        " X holds Python values at X['scale']"
    """

    def tensorless(value: Any) -> bool:
        return isinstance(value, (list, tuple)) and not any(
            isinstance(leaf, Tensor) for leaf in optree.tree_leaves(cast(Any, value))
        )

    paths, leaves, _ = optree.tree_flatten_with_path(X, is_leaf=tensorless)
    names = [input_name(path) for path, leaf in zip(paths, leaves) if tensorless(leaf)]
    if not names:
        return ""
    return (
        f" X holds Python values at {', '.join(names)}, which packfunc does not split into "
        "samples: the one sample it ran (X[0:1]) saw the whole batch's. Make each an input "
        "tensor with the batch first (torch.tensor(...)), or close over values the samples "
        "share in model_fn."
    )


def _equal_trees(a: Any, b: Any) -> bool:
    """Whether two pytrees of one structure hold equal tensors (NaNs equal to NaNs).

    Under ``torch.func.vmap``, whose values decide nothing, tensors count as equal (such a
    plan is not kept: a call outside ``vmap`` discovers again and compares).
    """
    return all(
        not isinstance(x, Tensor)
        or is_functorch_wrapped_tensor(x)
        or torch.equal(x, y)
        or (x.is_floating_point() and torch.allclose(x, y, rtol=0, atol=0, equal_nan=True))
        for x, y in zip(optree.tree_leaves(a), optree.tree_leaves(b), strict=True)
    )


class RowsNotAloneError(ValueError):
    """A batch row is not that sample's output alone (see :func:`check_rows_alone`)."""


def check_rows_alone(
    plan: Plan,
    batch_output: Tensor,
    last_alone: Callable[[], Plan | None] | None = None,
    recorded: dict[int, Recorded] | None = None,
) -> bool:
    """Refuse a batch whose first (or last) row is not that sample's output alone.

    Per-sample quantities take sample ``n``'s output as a function of sample ``n`` alone,
    with dim 0 of every input its batch dimension. An input shared by the batch whose
    length happens to equal the batch size (positions ``[T]`` with ``T = N``) passes
    every shape check, and a layer that mixes samples gives no error of its own: both
    would give wrong values silently. Discovery ran the first sample alone; its output
    must be the batch's first row, to rounding; and the last sample's output alone
    (``last_alone()``, a discovery of it) the last row (a shared mask whose first row
    happens to be the global one passes the first comparison). Once passed, the plan
    drops discovery's output (a cached plan is not checked again); a refused plan keeps
    it, so that every later pass with it is refused too. Skipped for a model that draws
    random numbers or changes a buffer or its input (a run differs from the next). Under
    ``vmap``, whose values cannot decide, the comparisons make the public call's results
    NaN where they fail (:func:`~packfunc.engine.vmap_checks.poison_where`); there, and
    with one sample, whose row is trivially its own, the plan is not checked: the caller
    must not keep it (see the return).

    The rows of each ``recorded`` site's input (a local site's arguments with a row per
    sample) are compared the same way: a model
    that moves the batch's rows only for more than one sample (``if len(x) > 1:
    x = x.flip(0)``, a sort by length, undone before the output) gives its layers in
    between the samples in another order than their rows, which discovery's one sample
    cannot show. Such a site is taken out of ``recorded`` and its leaves take the
    whole-model path (which runs each sample alone), in this pass and with the plan.
    Only the first and last rows are compared: a move that keeps both in place escapes.

    Args:
        plan: A plan fresh from :func:`discover` (its ``first_output`` set), or cached.
        batch_output: The batch pass's output of the whole batch.
        last_alone: Discovers the model on the last sample alone
            (:func:`last_sample_plan`; its ``None``: not compared).
        recorded: The batch pass's recorded site inputs (:attr:`BatchRecord.inputs`).

    Returns:
        Whether the plan may be kept: ``False`` where the check could not run (``vmap``,
        a batch of one sample).

    Raises:
        ValueError: if a row differs beyond rounding, naming both likely causes.

    Example:
        >>> layer = torch.nn.Linear(3, 2)
        >>> fn, p = packfunc.functional(layer)
        >>> X = torch.randn(4, 3)
        >>> plan = discover(fn, p, list(p.values()), X[:1])
        >>> last = lambda: discover(fn, p, list(p.values()), X[3:])
        >>> check_rows_alone(plan, layer(X), last), plan.first_output
        (True, None)
    """
    if plan.refusal is not None:
        raise RowsNotAloneError(plan.refusal)
    first = plan.first_output
    if first is None:
        return True
    if plan.random is not None or plan.updated_buffer is not None or plan.updated_input:
        _checked(plan)  # (the shim's forward may change the input before discovery)
        return True
    if not (first.is_floating_point() and batch_output.is_floating_point()):
        _checked(plan)
        return True
    rows, index = batch_output.detach(), plan.sample
    which = "the first sample" if index == 0 else f"sample {index}"
    if len(rows) < 2:  # one sample: its row is itself alone; nothing is checked, nor kept
        return False
    try:
        what = (  # (a plan refused on an earlier, larger batch stays refused)
            "differed from its row of an earlier batch"
            if index >= len(rows)
            else difference_beyond_rounding(first, rows[index : index + 1])
        )
        last_plan = last_alone() if what is None and last_alone is not None else None
        last = last_plan.first_output if last_plan is not None else None
        if last is not None:
            what, which = difference_beyond_rounding(last, rows[-1:]), "the last sample"
        if what is None and recorded is not None:
            _take_moved_sites(plan, recorded, last_plan)
    except RuntimeError:  # values under vmap decide nothing: the results become NaN instead
        if is_functorch_wrapped_tensor(first) or is_functorch_wrapped_tensor(rows):
            poison_where(_rows_differ(plan, rows, last_alone, recorded or {}))
            return False
        raise
    if what is None:
        _checked(plan)
        return True
    plan.refusal = (
        f"the model's output for {which} alone {what}: its row of the batch must "
        "depend on that sample alone. Either an input is not batched along dim 0 (an input "
        "shared by the batch whose length equals the batch size, e.g. positions [T] with "
        "T = N: expand it to [N, ...] or close over it in model_fn), or a layer mixes "
        "samples (batch statistics), which per-sample quantities cannot follow, or the "
        "forward depends on Python state it updates (a call counter), which makes each of "
        "packfunc's runs of it another function, or it branches on torch.is_grad_enabled() "
        "or a tensor's requires_grad (packfunc's runs of one sample take no gradients)."
    )
    raise RowsNotAloneError(plan.refusal)


def _checked(plan: Plan) -> None:
    """Drop what a plan kept of its one sample for the rows check (it has passed)."""
    plan.first_output = None
    plan.first_inputs = {}


_ROWS_MOVED = (
    "its input's rows are not the samples' in order for a batch of several samples, but "
    "are for one sample alone (the model moves the batch's rows, e.g. sorts by length or "
    "flips, for more than one sample only)"
)
"""Why a site found by :func:`_take_moved_sites` takes the whole-model path."""


def _compared_site_rows(
    plan: Plan, recorded: dict[int, Recorded], last: Plan | None
) -> Iterator[tuple[int, Tensor, Tensor]]:
    """Each recorded site's input alone (first and last sample) with its batch row.

    A tapped site's input, and a local site's arguments with a row per sample. The last
    sample's are compared where its discovery found the same calls.
    """
    same_calls = last is not None and [s.call for s in last.sites] == [s.call for s in plan.sites]
    for k, x in recorded.items():
        alone = last.first_inputs.get(k) if last is not None and same_calls else None
        for batch, first, other in _site_tensors(x, plan.first_inputs.get(k), alone):
            if first.shape[:1] != (1,) or batch.shape[1:] != first.shape[1:]:
                continue
            if plan.sample < len(batch):
                yield k, first, batch[plan.sample : plan.sample + 1]
            if other is not None and other.shape == first.shape:
                yield k, other, batch[-1:]


def _site_tensors(
    recorded: Recorded,
    first: Tensor | dict[int, Tensor] | None,
    last: Tensor | dict[int, Tensor] | None,
) -> list[tuple[Tensor, Tensor, Tensor | None]]:
    """A site's batch tensors with the first and the last sample's (``None``: not known)."""
    if isinstance(recorded, Tensor):
        if not isinstance(first, Tensor):
            return []
        return [(recorded, first, last if isinstance(last, Tensor) else None)]
    if not isinstance(first, dict):
        return []
    values = recorded.arguments.values
    return [
        (values[p], first[p], last.get(p) if isinstance(last, dict) else None)
        for p in recorded.batched
        if p in first and isinstance(values[p], Tensor)
    ]


def _take_moved_sites(plan: Plan, recorded: dict[int, Recorded], last: Plan | None) -> None:
    """Send the sites whose input rows were moved to the whole-model path (see below).

    A site whose first or last input row differs from that sample's input alone is taken
    out of ``recorded``, and its leaves are uncovered in ``plan``.
    """
    moved = {
        k
        for k, alone, row in _compared_site_rows(plan, recorded, last)
        if (
            difference_beyond_rounding(alone, row) is not None
            if alone.is_floating_point()
            else not torch.equal(alone, row)  # (an embedding's indices)
        )
    }
    for k in moved:
        recorded.pop(k)
        plan.uncover({leaf for _, leaf in plan.sites[k].call.leaves}, _ROWS_MOVED)


def _rows_differ(
    plan: Plan,
    rows: Tensor,
    last_alone: Callable[[], Plan | None] | None,
    recorded: dict[int, Recorded],
) -> Tensor:
    """:func:`check_rows_alone`'s comparisons as a boolean tensor, for ``vmap``'s values.

    Sample ``index``'s output alone against its row, and the last sample's (where
    ``last_alone`` runs it) against the last row, and the recorded sites' input rows
    likewise; each vmapped instance decides alone.
    """
    first, index = cast(Tensor, plan.first_output), plan.sample
    if index >= len(rows):  # (a plan found on a larger batch: the row is not there)
        return torch.ones((), dtype=torch.bool, device=rows.device)
    failed = differs_beyond_rounding(first, rows[index : index + 1])
    try:
        last = last_alone() if last_alone is not None else None
    except RuntimeError:  # a fused layer without a batching rule (LSTM) runs alone unvmapped
        last = None  # only: the first sample's comparison decides alone
    if last is not None and last.first_output is not None:
        failed = failed | differs_beyond_rounding(last.first_output, rows[-1:])
    for _, alone, row in _compared_site_rows(plan, recorded, last):
        differs = differs_beyond_rounding(alone, row) if alone.is_floating_point() else alone != row
        failed = failed | differs.any()
    return failed


def in_out_weights(model_fn: ModelFn, params: dict[str, Tensor], inputs: Inputs) -> set[str]:
    """Names of the parameters of linear layers whose weight is stored ``[in, out]``.

    Those are the weights of ``x @ W`` and GPT-2's ``Conv1D``; their Kronecker factors
    come as ``[in×in, out×out]`` (see ``docs/conventions.md``). Read from packfunc's
    discovery plan, cached for ``model_fn`` by the batch pass that made the factors (call
    this right after it). A plan discovered here instead is not left in the cache: its
    rows were not checked against a batch, which the next batch pass would take as done.

    Args:
        model_fn: The model function the factors were computed with.
        params: Its parameters.
        inputs: The batch of inputs.

    Returns:
        The parameter names (the biases of such layers included).

    Example:
        >>> model_fn, params = packfunc.functional(torch.nn.Linear(3, 2))
        >>> in_out_weights(model_fn, params, torch.randn(4, 3))
        set()
        >>> in_out_weights(lambda p, x: x @ p["W"], {"W": torch.randn(3, 2)}, torch.randn(4, 3))
        {'W'}
    """
    leaves, _, names = flatten_params(params)
    plan, cached = cached_discover(model_fn, params, leaves, inputs)
    if not cached:
        forget_plan(model_fn)
    return in_out_weights_of(plan, names)


def in_out_weights_of(plan: Plan, names: list[str]) -> set[str]:
    """:func:`in_out_weights` read from a plan, its leaves named by ``names``.

    Example:
        >>> p = {"W": torch.randn(3, 2)}
        >>> plan = discover(lambda p, x: x @ p["W"], p, list(p.values()), torch.randn(1, 3))
        >>> in_out_weights_of(plan, ["W"])
        {'W'}
    """
    sites = [site for site in plan.sites if site.call.stores_weight_in_out]
    return {names[leaf] for site in sites for _, leaf in site.call.leaves}


def last_sample_plan(
    model_fn: ModelFn, params: Any, leaves: list[Tensor], X: Any, n: int
) -> Plan | None:
    """Discovery's plan of the last of ``n`` samples alone (see :func:`check_rows_alone`).

    Its ``first_output`` is the last sample's output and its ``first_inputs`` its sites'
    inputs. Where discovery refuses that sample, its output alone is run as the
    model itself (:func:`last_sample_output`), without the sites' inputs.

    Args:
        model_fn: ``model_fn(params, X)``.
        params: Its parameters.
        leaves: Their flattened leaves.
        X: The batch.
        n: The batch size.

    Returns:
        The plan; ``None`` where the run changed its input (nothing can be compared).

    Example:
        >>> fn, p = packfunc.functional(torch.nn.Linear(3, 2))
        >>> last_sample_plan(fn, p, list(p.values()), torch.randn(4, 3), 4).first_output.shape
        torch.Size([1, 2])
    """
    row = select_samples(X, slice(n - 1, n))
    try:
        plan = discover(model_fn, params, leaves, row)
    except ValueError:
        out = last_sample_output(model_fn, params, X, n)
        return Plan(first_output=out) if out is not None else None
    return None if plan.updated_input else plan


def last_sample_output(model_fn: ModelFn, params: Any, X: Any, n: int) -> Tensor | None:
    """The model's output for the last of ``n`` samples alone, run as discovery runs the first.

    On a copy of that sample (a model changing its input in place leaves the batch as its
    own forward did), without gradients, under the caller's autocast, its buffers put
    back afterwards; as
    the model itself (the modes' rewrites compute the same function, and a recurrent layer
    runs fused), but inside a torch function mode as every pass of packfunc's: code that
    takes another path without one (``nn.TransformerEncoder``'s nested-tensor fast path in
    eval mode, whose padded positions come out zero) takes discovery's and the batch's.

    Args:
        model_fn: ``model_fn(params, X)``.
        params: Its parameters.
        X: The batch.
        n: The batch size.

    Returns:
        The output, batch size one; ``None`` where the run changed its input (the model
        updates its input in place, which the batch's forward did already: a second run
        of it is another function, and nothing can be compared).

    Example:
        >>> fn, p = packfunc.functional(torch.nn.Linear(3, 2))
        >>> last_sample_output(fn, p, torch.randn(4, 3), 4).shape
        torch.Size([1, 2])
    """
    row = select_samples(X, slice(n - 1, n))
    copied = _copied(row)
    with torch.no_grad(), kept_model_state(module_of(model_fn)), forward_autocast(), _AsIs():
        out: Tensor = model_fn(params, copied)
    return out if _equal_trees(copied, row) else None


class _AsIs(TorchFunctionMode):
    """A torch function mode that runs every call as it is (see :func:`last_sample_output`).

    But a gradient retained where no graph is (:func:`~packfunc.engine.modes.retains_nothing`).
    """

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        if retains_nothing(func, args):
            return nothing_retained(func)
        return func(*args, **(kwargs or {}))


_PLANS: weakref.WeakKeyDictionary[ModelFn, tuple[Hashable, Plan]] = weakref.WeakKeyDictionary()
"""Per model function, the signature of its latest discovery and the plan found."""


def cached_discover(
    model_fn: ModelFn, params: Any, leaves: list[Tensor], X: Any, sample: int = 0
) -> tuple[Plan, bool]:
    """The plan of the last discovery for ``model_fn`` with the same signature, else a new one.

    The signature is what a plan depends on besides the code: the parameters'
    structure, shapes, dtypes and devices, the inputs' structure and per-sample
    shapes, every submodule's type and plain attributes (the training flag), the plain
    values a hand-written ``model_fn`` reads, and the autocast in force (the plan holds
    its layers' output dtypes). The batch pass checks every call against the plan and raises
    :class:`~packfunc.engine.batch_record.PlanMismatch` if the code took another path;
    callers then discover again. Training loops call the same ``model_fn`` on
    batches of one shape: they skip discovery's forward of one sample.

    Args:
        model_fn: ``model_fn(params, X)``.
        params: The parameter pytree.
        leaves: Its flattened leaves.
        X: The batch of inputs.
        sample: The sample a new plan is discovered on (another than the first where the
            batch's calls did not follow the first sample's: a padding mask that code
            skips for a sample without padding).

    Returns:
        ``(plan, cached)``: whether the plan came from an earlier call.

    Example:
        >>> fn, p = packfunc.functional(torch.nn.Linear(3, 2))
        >>> [cached_discover(fn, p, list(p.values()), torch.ones(4, 3))[1] for _ in range(2)]
        [False, True]
    """
    check_no_cached_parametrizations(model_fn)
    key = _signature(model_fn, params, leaves, X)
    try:
        entry = _PLANS.get(model_fn)
    except TypeError:  # not weakly referenceable (e.g. a functools.partial): no cache
        entry = None
    if entry is not None and entry[0] == key and _serves(entry[1], X):
        return entry[1], True
    plan = discover(model_fn, params, leaves, select_samples(X, slice(sample, sample + 1)))
    plan.sample = sample
    with contextlib.suppress(TypeError):
        _PLANS[model_fn] = (key, plan)
    return plan, False


def _serves(plan: Plan, X: Any) -> bool:
    """Whether a cached plan may serve the batch ``X`` (one of one sample only, if unchecked)."""
    return not plan.one_sample_only or leading_sizes(X) <= {1}


def forget_plan(model_fn: ModelFn) -> None:
    """Drop the cached plan of ``model_fn`` (its code took another path).

    Args:
        model_fn: A model function passed to :func:`cached_discover`.
    """
    with contextlib.suppress(TypeError):
        _PLANS.pop(model_fn, None)


def _signature(model_fn: ModelFn, params: Any, leaves: list[Tensor], X: Any) -> Hashable:
    """What a plan depends on besides ``model_fn``'s code (see :func:`cached_discover`)."""
    inputs, input_spec = optree.tree_flatten(X)
    module = module_of(model_fn)
    held: dict[int, Hashable] = {}  # configuration objects' settings, each taken once
    return (
        optree.tree_structure(params),
        tuple((leaf.shape, leaf.dtype, leaf.device) for leaf in leaves),
        _duplicated(leaves),
        input_spec,
        tuple(
            (x.shape[1:], x.dtype, x.device) if isinstance(x, Tensor) else _hashable(x)
            for x in inputs
        ),
        _tree_settings(module, held),
        _closed_over_settings(model_fn),
        autocast_in_force(),
        _global_hooks(),
    )


def _tree_settings(module: Any, held: dict[int, Hashable]) -> Hashable:
    """The module tree as a plan depends on it: each module's children by name, and settings.

    In pre-order; a module met again (registered at two paths) is its first place's index,
    an empty slot ``None``: two trees differ here wherever they differ (a parameterless
    softmax moved from one container to another between calls makes a new plan, whose
    first batch is checked).

    Args:
        module: The model, or ``None`` (no module: a hand-written ``model_fn``).
        held: Configuration objects' settings taken so far (see :func:`_settings`).

    Returns:
        A hashable description.

    Example:
        >>> shared = torch.nn.ReLU()
        >>> tree = _tree_settings(torch.nn.Sequential(shared, shared), {})
        >>> tree[0][0], tree[2]
        (('0', '1'), 1)
    """
    found: list[Hashable] = []
    first: dict[int, int] = {}  # id -> its index in found
    stack = [module] if module is not None else []
    while stack:
        current = stack.pop()
        if current is None or id(current) in first:
            found.append(None if current is None else first[id(current)])
            continue
        first[id(current)] = len(found)
        children, kept = current._modules, cast(list[torch.nn.Module], [])
        found.append((tuple(children), _settings(current, held, kept)))
        # the modules kept in plain attributes (a list of activations) come as children last
        stack.extend(reversed([*children.values(), *kept]))
    return tuple(found)


class _Same:
    """A value in a plan's key by identity, held so that its ``id`` is not reused.

    A hook removed and another registered in its place may get the freed ``id``: a key of
    bare ids took the new hook (one that mixes samples) for the old.

    Args:
        value: Any object (a hook, a function held as an attribute).

    Example:
        >>> f = lambda x: x
        >>> _Same(f) == _Same(f), _Same(f) == _Same(lambda x: x)
        (True, False)
    """

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.value is self.value

    def __hash__(self) -> int:
        return id(self.value)


def _global_hooks() -> Hashable:
    """The forward hooks registered for every module (``register_module_forward_hook``)."""
    hooks = torch.nn.modules.module
    return tuple(
        tuple(map(_Same, registered.values()))
        for registered in (
            getattr(hooks, "_global_forward_hooks", {}),
            getattr(hooks, "_global_forward_pre_hooks", {}),
        )
    )


_PLAIN = (bool, int, float, str, type(None))
_PLAIN_TYPES = frozenset(_PLAIN)
_SETTING_TYPES = (*_PLAIN, enum.Enum, np.generic)


def _is_setting(value: Any) -> bool:
    """A plain value (an enum's, a numpy scalar too), or a tuple or frozenset of them.

    ``stride=(1, 1)``, ``torch.Size([3])``, ``np.bool_(True)``.
    """
    kind = type(value)
    if kind in _PLAIN_TYPES:
        return True
    if isinstance(value, (tuple, frozenset)):
        return all(_is_setting(entry) for entry in value)
    return isinstance(value, _SETTING_TYPES)


def _settings(
    module: Any, held: dict[int, Hashable], kept: list[torch.nn.Module] | None = None
) -> Hashable:
    """A module's type, plain attributes (``training``, ``batch_first``, ``eps``...) and hooks.

    A change of any since discovery may make another function, even one that mixes samples
    (attention with ``batch_first`` switched), which the plan's first check of rows would
    not see again. So may one of a dict or short list of plain options, a function held as
    an attribute (``self.act``, by identity), a configuration object the module holds
    (Hugging Face's ``config``, a dataclass, with slots too, a namespace), whose plain
    attributes count too (each object once, in ``held``), or a forward hook registered
    since (by identity); class attributes do not. ``nn.Module``'s own dicts of parameters,
    children and hooks are skipped by name: the signature is taken on every call. With
    ``kept``, the modules a module's attributes hold outside its children (in a list, tuple or
    dict, :func:`~packfunc.engine.model_state.held_modules`) are appended to it, and their
    containers' layout and plain entries count as settings.
    """
    found = []
    attributes = _attributes(module)
    for key, value in attributes.items():
        if key in MODULE_INTERNALS:
            continue
        if type(value) in _PLAIN_TYPES:  # (the common case, without a call)
            found.append((key, value))
            continue
        setting = _setting(value, held)
        if setting is _NOT_A_SETTING and kept is not None and (modules := held_modules(value)):
            kept += modules  # (run as children: walked by the caller)
            setting = _held_layout(value, held)
        if setting is not _NOT_A_SETTING:
            found.append((key, setting))
    for name in _FORWARD_HOOKS:
        hooks = attributes.get(name)
        if hooks:
            found.append((name, tuple(map(_Same, hooks.values()))))
    return type(module), tuple(found)


_FORWARD_HOOKS = ("_forward_hooks", "_forward_pre_hooks")
_NOT_A_SETTING = object()
_LISTED = 16
"""The most entries of a list attribute read as options (a longer one is data)."""
_FUNCTIONS = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, functools.partial)


def _attributes(value: Any) -> dict[str, Any]:
    """An object's own attributes: its ``__dict__``, or a slotted dataclass's fields."""
    attributes = getattr(value, "__dict__", None)
    if attributes is not None:
        return cast(dict[str, Any], attributes)
    if dataclasses.is_dataclass(value):
        return {f.name: getattr(value, f.name, None) for f in dataclasses.fields(value)}
    return {}


def _setting(value: Any, held: dict[int, Hashable]) -> Any:
    """What of ``value`` a plan depends on, or :data:`_NOT_A_SETTING`.

    A plain value itself; a dict or short list of them as a tuple; a function by identity; a
    configuration object by its settings (each object once, in ``held``).
    """
    if _is_setting(value):
        return value
    kind = type(value)
    if kind is dict and _is_setting((*value.keys(), *value.values())):
        return tuple(value.items())  # options in a dict
    if kind is list and len(value) <= _LISTED and _is_setting(tuple(value)):
        return ("list", tuple(value))
    if isinstance(value, _FUNCTIONS):
        return ("function", _Same(value))
    if _is_configuration(value):
        if id(value) not in held:
            held[id(value)] = None  # (an object that holds itself)
            held[id(value)] = _settings(value, held)
        return held[id(value)]
    return _NOT_A_SETTING


def _held_layout(value: Any, held: dict[int, Hashable]) -> Hashable:
    """A container holding modules as a plan depends on it: its type, entries and modules.

    Where the modules are, and the plain entries beside them (``{"dim": 1, "act": ...}``).

    Example:
        >>> _held_layout({"dim": 1, "act": torch.nn.ReLU()}, {})
        (<class 'dict'>, (('dim', 1), ('act', 'module')))
    """
    entries = held_entries(value)
    keys = list(value) if isinstance(value, dict) else range(len(entries))
    layout: list[tuple[Hashable, Hashable]] = []
    for key, entry in zip(keys, entries, strict=True):
        if isinstance(entry, torch.nn.Module):
            layout.append((key, "module"))
        elif held_modules(entry):
            layout.append((key, _held_layout(entry, held)))
        else:
            setting = _setting(entry, held)
            layout.append((key, None if setting is _NOT_A_SETTING else setting))
    return type(value), tuple(layout)


def _is_configuration(value: Any) -> bool:
    """A configuration object: a dataclass, a namespace, or a Hugging Face ``config``."""
    return _is_configuration_type(cast(Hashable, type(value)))


@functools.lru_cache(maxsize=1024)
def _is_configuration_type(kind: Any) -> bool:
    """Whether instances of the type ``kind`` are configuration objects (a class is not)."""
    if issubclass(kind, type):
        return False
    if issubclass(kind, (types.SimpleNamespace, argparse.Namespace)):
        return True
    return dataclasses.is_dataclass(kind) or any(
        base.__name__ == "PretrainedConfig" for base in kind.__mro__
    )


def _closed_over_settings(model_fn: ModelFn) -> Hashable:
    """The plain values a hand-written ``model_fn`` reads (closure cells, globals it names).

    :func:`~packfunc.functionalize.functional`'s read nothing but their module, whose
    settings the signature has.
    """
    if is_own_model_function(model_fn):
        return ()
    held: dict[int, Hashable] = {}
    used = read_names(model_fn)
    settings = (_read_setting(value, held, used) for _, value in closed_over(model_fn))
    return tuple(None if setting is _NOT_A_SETTING else setting for setting in settings)


def _read_setting(value: Any, held: dict[int, Hashable], used: frozenset[str]) -> Any:
    """:func:`_setting` of a value a function reads, or an object's plain attributes.

    An object holding the model (a trainer whose method is the model function) counts by
    the plain attributes the function's code names (``self.dim``).
    """
    setting = _setting(value, held)
    attributes = object_attributes(value) if setting is _NOT_A_SETTING else None
    if attributes is None:
        return setting
    named = ((key, _setting(v, held)) for key, v in attributes.items() if key in used)
    return tuple((key, s) for key, s in named if s is not _NOT_A_SETTING)


def _duplicated(leaves: list[Tensor]) -> frozenset[int]:
    """Indices of leaves that are one tensor at several places of the pytree (usually none)."""
    if len({id(leaf) for leaf in leaves}) == len(leaves):
        return frozenset()
    return frozenset(LeafIndex(leaves).duplicated)


def _hashable(value: Any) -> Hashable:
    """``value`` itself if hashable, else its identity."""
    try:
        hash(value)
    except TypeError:
        return ("id", id(value))
    return cast(Hashable, value)
