"""The batch pass: one forward of the whole batch, and pullbacks of any output cotangents.

The model runs once on the batch inside a :class:`~packfunc.engine.modes.ParameterMode`
that matches every call consuming parameters with discovery's plan, in order,
and records each site's input (tapped ops) or arguments (local calls). The
sites' outputs are differentiated: outside ``torch.func`` transforms plain
autograd differentiates them directly; otherwise a zero *probe* is added to each
inside ``torch.func.vjp``. Pulling the loss gradient ``∂L/∂f`` back yields every
site's output cotangent at once: ``g_k[n] = ∂L/∂z_k[n]`` is sample ``n``'s share,
because the loss is a sum of per-sample terms and each row ``n`` of ``z_k``
depends on sample ``n`` only. The pullback is kept: any other output cotangent
(e.g. the columns of a loss Hessian's square root) is pulled back through the
same forward pass.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property, partial
from typing import Any

import optree
import torch
from torch import Tensor, nn
from torch._functorch.autograd_function import custom_function_call
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge
from torch.func import vmap

from packfunc.engine.attention import ATTENTION_OPS, run_attention, supports_attention
from packfunc.engine.autodiff import vjp, vjp_with_aux
from packfunc.engine.checkpointing import plain_checkpoints
from packfunc.engine.discovery import Plan, Recorded, Use, UseKind
from packfunc.engine.local import CallArguments, Derivation, LocalInputs, Source
from packfunc.engine.memory import is_plain
from packfunc.engine.model_state import restart_users_forward
from packfunc.engine.modes import (
    LeafIndex,
    ParameterMode,
    call_replacing,
    is_metadata_query,
    leaves_of,
    twice_differentiable,
)
from packfunc.engine.ops import (
    LINEAR_CALLS,
    SIGNATURES,
    RowsInMemory,
    linear_in_out,
    tapped_leaves,
)
from packfunc.engine.precision import forward_autocast, in_loss_dtype
from packfunc.engine.randomness import GeneratorMark
from packfunc.functionalize import run_model
from packfunc.losses import check_loss_inputs
from packfunc.types import ModelFn

SiteConsumer = Callable[[int, Tensor], Tensor | None]
"""Receives a site's index and output cotangent ``[N, ...]``; returns what to keep of it
(``None``: nothing)."""


class PlanMismatch(RuntimeError):
    """The batch pass called parameter-consuming ops other than discovery saw."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(
            message
            or "model_fn called its layers in a different order or number for one sample than "
            "for the batch (a Python loop over the samples, a branch on the batch size, or a "
            "branch on values: a mixture of experts that runs only the experts a batch "
            "routes to, 'if mask.any():'); packfunc needs the same sequence of layer calls "
            "for any batch: write the per-sample loop as one batched call, and run every "
            "expert (on its tokens, possibly none)."
        )


_CUSTOM_FUNCTION = (
    "model_fn passes a parameter to the custom torch.autograd.Function {name}: under torch.func "
    "transforms (the second derivatives of a Hessian quantity, or torch.func.vmap/grad around "
    "the packfunc call) its calls are hidden behind its own backward, so packfunc cannot "
    "follow them. Called outside transforms, its first-order quantities and GGN take the "
    "whole-model path; for a Hessian quantity use a GGN one (diag_ggn, batch_diag_ggn), or "
    "write the function with differentiable torch ops."
)


class _RecordMode(ParameterMode):
    """Adds probes to site outputs (``torch.func``), or marks them for autograd.

    Calls that consume parameters are matched, in order, with discovery's
    :attr:`Plan.uses`: each is handled as discovery classified it. ``shapes`` are the
    outputs' expected shapes of the sites to record; ``probes`` the tensors added to
    them, or ``None``: their outputs are marked for autograd instead.
    """

    def __init__(
        self,
        leaf_of: LeafIndex,
        plan: Plan,
        shapes: dict[int, torch.Size],
        probes: dict[int, Tensor] | None = None,
        originals: list[Tensor] | None = None,
    ):
        super().__init__(leaf_of)
        self.plan, self.shapes, self.probes = plan, shapes, probes
        # the leaves a local call's record names: the parameters themselves where the
        # calls receive aliases of them (see _TappedLeaf)
        self.originals = originals
        self.inputs: dict[int, Recorded] = {}
        self.outputs: dict[int, GradientEdge] = {}
        self.failed: set[int] = set()
        self.rooted: set[int] = set()  # sites whose output was computed from a fresh leaf
        self.grad_at_start = torch.is_grad_enabled()
        self.versions: dict[int, list[tuple[Tensor, int]]] = {}  # recorded inputs' versions

    def _constant(self) -> bool:
        """A derivation the model makes under ``torch.no_grad()`` inside a differentiated pass."""
        return self.grad_at_start and not torch.is_grad_enabled()

    @property
    def mark(self) -> bool:
        """Whether site outputs are marked for autograd (no probes are added)."""
        return self.probes is None

    def _dispatch(
        self,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        touches: bool = False,
    ) -> Any:
        """Handle one call as the plan's next use, or run it as it is.

        ``touches``: the call is known to receive a parameter (a :class:`_TappedLeaf`); the
        plan's next use then needs no other test (a metadata query is never a use), unless
        it is a custom ``autograd.Function`` (refused as ever).
        """
        u, uses = self.uses_seen, self.plan.uses
        expected = u < len(uses) and uses[u].func == func
        if not (expected and touches) or func is custom_function_call:
            if is_metadata_query(func) or not (touches or self._touches_parameters(args, kwargs)):
                return func(*args, **kwargs)
            if func is custom_function_call:
                name = getattr(args[0], "__name__", args[0])
                raise ValueError(_CUSTOM_FUNCTION.format(name=name))
            if not expected:
                raise PlanMismatch()
        self.uses_seen = u + 1
        use = uses[u]
        if use.kind is UseKind.TAPPED:
            sig = SIGNATURES[func]
            bound = sig.bind(args, kwargs)
            run = partial(call_replacing, func, args, kwargs)
            return self._record_tapped(use, tapped_leaves(bound, self.leaf_of), bound, run)
        arguments = CallArguments.of(args, kwargs)
        sources = self._sources(arguments.values) or {}
        if use.kind is UseKind.DERIVED:
            out = func(*args, **kwargs)
            if self.originals is not None:  # tapped leaves: the calls that use it come here too
                out = _as_tapped(out)
            self._derive(func, arguments, sources, out)
            return out
        if use.kind is UseKind.LOCAL and use.site in self.shapes:
            return self._record_local(use.site, func, arguments, sources)
        return func(*args, **kwargs)

    def next_leading_dims(self) -> tuple[int, ...] | None:
        """All but the last dim of the output the plan's next use records (``None``: none)."""
        u = self.uses_seen
        site = self.plan.uses[u].site if u < len(self.plan.uses) else None
        shape = self.shapes.get(site) if site is not None else None
        return tuple(shape[:-1]) if shape is not None else None

    def finish(self) -> None:
        """Check, after the forward, that every call discovery saw was made.

        Raises:
            PlanMismatch: if one was not.
            ValueError: if a recorded input was changed in place after its call used it.
        """
        if self.uses_seen != len(self.plan.uses):
            raise PlanMismatch()
        for k, noted in self.versions.items():
            if k in self.inputs and any(t._version != version for t, version in noted):
                raise ValueError(
                    f"an input of the model's {self.plan.sites[k].call.name} was changed in "
                    "place after that call used it (h = layer(x); x.mul_(2)): its per-sample "
                    "quantities would be computed from the changed values (plain autograd "
                    "raises 'modified by an inplace operation' there). Write the change out "
                    "of place (x = x * 2)."
                )

    def _note_versions(self, k: int, values: Sequence[Any]) -> None:
        """Note the version counters of site ``k``'s recorded tensors (see :meth:`finish`)."""
        noted = []
        for value in values:
            if isinstance(value, Tensor) and not value.is_inference():
                try:
                    noted.append((value, value._version))
                except RuntimeError:  # (a functorch wrapper keeps no version of its own)
                    continue
        self.versions[k] = noted

    def _record_tapped(
        self,
        use: Use,
        leaves: tuple[tuple[str, int], ...],
        bound: dict[str, Any],
        run: Callable[..., Tensor],
    ) -> Tensor:
        k = use.site
        assert k is not None
        call = self.plan.sites[k].call
        if call.leaves != leaves or not call.has_options_of(bound):
            raise PlanMismatch()
        shape = self.shapes.get(k)
        if shape is None:
            return run()
        if self.mark and not any(isinstance(v, Tensor) and v.requires_grad for v in bound.values()):
            # the output would be a leaf, which an in-place op after the call (ReLU(inplace=True))
            # may not modify: compute it from a fresh leaf alias of a parameter instead
            weight = bound[leaves[0][0]]
            out = run(weight, weight.detach().requires_grad_())
            self.rooted.add(k)
        else:
            out = run()
        if out.shape != shape or bound["input"].shape[0] != shape[0]:
            _refuse_other_layer_shape(out, shape, bound["input"].shape[0])
            self.failed.add(k)
            return out
        self.inputs[k] = bound["input"]
        self._note_versions(k, [bound["input"]])
        return self._probed(k, out)

    def _record_local(
        self, k: int, func: Callable[..., Any], arguments: CallArguments, sources: dict[int, Source]
    ) -> object:
        shape = self.shapes[k]
        values = list(arguments.values)
        if self.mark and not any(isinstance(v, Tensor) and v.requires_grad for v in values):
            first = min(sources)  # see _record_tapped: never let the output be a leaf
            values[first] = values[first].detach().requires_grad_()
            self.rooted.add(k)
        args, kwargs = arguments.rebuild(values)
        out = func(*args, **kwargs)
        shapes = self.plan.sites[k].shapes
        layout = sample_layout(shapes, arguments.values, sources, shape[0])
        if isinstance(out, Tensor) and out.shape != shape:
            _refuse_other_layer_shape(out, shape, out.shape[0] if out.dim() else 0)
        if layout is None or not isinstance(out, Tensor) or out.shape != shape:
            self.failed.add(k)
            return out
        batched, narrow = layout
        leaves = {leaf: self._original(leaf) for leaf in leaves_of(sources)}
        values = list(arguments.values)  # the record names the parameters, not their aliases
        for position, source in sources.items():
            if isinstance(source, int):
                values[position] = leaves[source]
            elif isinstance(values[position], _TappedLeaf):  # a derived tensor's alias
                values[position] = values[position].as_subclass(Tensor)
        arguments = arguments.with_values(values)
        self.inputs[k] = LocalInputs(func, arguments, sources, batched, narrow, leaves)
        self._note_versions(k, arguments.values)
        return self._probed(k, out)

    def _original(self, leaf: int) -> Tensor:
        """Leaf ``leaf`` as the caller passed it."""
        return self.leaf_of.leaf(leaf) if self.originals is None else self.originals[leaf]

    def _probed(self, k: int, out: Tensor) -> Tensor:
        if self.probes is None:  # autograd: the output itself is differentiated
            if out.grad_fn is None:  # no graph here (inside a custom autograd.Function's
                self.failed.add(k)  # forward, or no_grad): the leaves take the whole model
                self.inputs.pop(k, None)
                return out
            target = graph_owner(out)
            if target is None:  # a view laid out otherwise: the leaves take the whole model
                self.failed.add(k)
                self.inputs.pop(k, None)
                return out
            self.outputs[k] = get_gradient_edge(target)  # still right if out is changed in place
            return out
        if self._constant():  # no gradient reaches it (as a missing graph above): whole model
            self.failed.add(k)
            self.inputs.pop(k, None)
            return out
        return out + self.probes[k]


def graph_owner(out: Tensor) -> Tensor | None:
    """The tensor whose gradient edge stands for ``out``'s: ``out``, or the base it views.

    An in-place op on a view (``ReLU(inplace=True)`` after ``F.linear`` on ``[N, T, d]``,
    whose output views the flat product) moves the view onto a new node, and the view's
    old edge receives nothing: its gradient read as zero. The base's edge stays in the
    graph; a view that is its base reshaped takes the base's gradient, reshaped. Another
    view gives ``None``.

    Example:
        >>> base = torch.ones(6, 2, requires_grad=True) * 1
        >>> graph_owner(base.view(3, 2, 2)) is base, graph_owner(base.T) is None
        (True, True)
    """
    base = out._base
    if base is None:
        return out
    if (
        out.is_contiguous()
        and base.is_contiguous()
        and out.numel() == base.numel()
        and out.storage_offset() == base.storage_offset()
    ):
        return base
    return None


_RESHAPES = frozenset({"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0"})
"""Backward nodes of a view that is its base reshaped (:func:`graph_owner`'s views)."""

_LAYOUTS = _RESHAPES | {"PermuteBackward0", "TransposeBackward0", "TransposeBackward1"}
"""Backward nodes of ops that only lay a tensor out otherwise."""


def _unchanged_head(output: Tensor, outputs: dict[int, GradientEdge]) -> dict[int, GradientEdge]:
    """The head's own edge, where the output is its view laid out otherwise and unchanged.

    A linear layer over positions records the edge of the flat product its output views
    (:func:`graph_owner`: an in-place op on the view would leave the view's edge out of
    the graph). Where the model output reaches that view through layout ops alone (an LM's
    ``logits.permute(0, 2, 1)``), the view was not changed, and its own edge takes the
    output's cotangent as it is laid out: through the base's, autograd copied it (a
    logits-sized tensor more at the peak).

    Args:
        output: The model output.
        outputs: The sites' recorded edges.

    Returns:
        ``{site: edge}`` for that head, or empty.

    Example:
        >>> base = torch.ones(6, 2, requires_grad=True) * 1
        >>> head = base.view(2, 3, 2)
        >>> found = _unchanged_head(head.permute(0, 2, 1), {0: get_gradient_edge(base)})
        >>> found[0].node is head.grad_fn
        True
        >>> _unchanged_head(head.relu_().permute(0, 2, 1), {0: get_gradient_edge(base)})
        {}
    """
    sites: dict[tuple[Node | None, int], int] = {
        (e.node, e.output_nr): k for k, e in outputs.items()
    }
    node = output.grad_fn
    while node is not None and type(node).__name__ in _LAYOUTS and len(node.next_functions) == 1:
        below, index = node.next_functions[0]
        k = sites.get((below, index))
        if k is None:
            node = below
            continue
        # (the output itself a reshape of the head's: the head's edge stays, as a call whose
        # output is the model output's is taken as the head, with its cotangent as it is)
        if type(node).__name__ in _RESHAPES and node is not output.grad_fn:
            return {k: GradientEdge(node, 0)}
        return {}
    return {}


_ROW_PER_SAMPLE = (
    "model_fn uses its parameters differently for different batch sizes: a tensor made of "
    "parameters has one row per sample in the batch, but not for the first sample alone "
    "(which packfunc ran to learn the model). Sample n's gradient would then depend on its "
    "position in the batch, which packfunc cannot compute. Likely causes: (1) the model "
    "slices a parameter by the batch size (p[:N]): copy it over the batch with expand/repeat "
    "instead; (2) the model branches on the data and takes another path for the first sample "
    "alone than for the batch: Hugging Face models build no attention mask where a sample "
    "has no padding, so put a padded sample first (one padded in each of its masks: an "
    "encoder-decoder's encoder and decoder masks, if the batch pads both); (3) sample data "
    "reached the tensor through code packfunc does not see (a round trip through numpy or "
    "Python lists, Tensor.as_subclass, torch.vmap inside the model): write that part with "
    "torch operations on the tensors themselves."
)


class RowPerSampleMismatch(PlanMismatch, ValueError):
    """A tensor made of parameters has a row per sample in the batch, not for one sample.

    Discovery may have followed another path than the batch (Hugging Face's mask code skips
    an all-ones mask: T5's position bias meets the mask only where a sample is padded), so
    callers discover again on other samples, as for any :class:`PlanMismatch`; where none
    fits, this is the refusal (a ``ValueError``).
    """

    def __init__(self) -> None:
        RuntimeError.__init__(self, _ROW_PER_SAMPLE)


def sample_layout(
    shapes: tuple[torch.Size | None, ...],
    values: tuple[Any, ...],
    sources: dict[int, Source],
    n: int,
) -> tuple[tuple[int, ...], frozenset[int]] | None:
    """Which arguments of a local call carry one row per sample, compared with discovery.

    An argument whose leading dim was one for one sample and is ``n`` now is batched;
    one whose shape did not change is the same for every sample. A derivation copied
    along the batch (``cls.expand(N, 1, D)``), or one whose rows are all the same (that copy
    through a layer), gives each sample its first row.

    Returns:
        ``(batched positions, narrowed derivations)``, or ``None`` if some argument
        changed shape any other way (its samples cannot be told apart).

    Raises:
        RowPerSampleMismatch: if a tensor made of parameters has one (different) row per
            sample.
    """
    batched, narrow = [], set()
    for position, (before, value) in enumerate(zip(shapes, values)):
        if before is None or not isinstance(value, Tensor) or value.shape == before:
            continue
        if before[:1] != (1,) or value.shape != (n, *before[1:]):
            return None
        source = sources.get(position)
        if source is None:
            batched.append(position)
        elif isinstance(source, Derivation) and (
            source.broadcast or (source.copied and _rows_alike(value))
        ):
            narrow.add(position)
        else:
            raise RowPerSampleMismatch()
    return tuple(batched), frozenset(narrow)


def _rows_alike(value: Tensor) -> bool:
    """Whether every row (along dim 0) of a tensor made of parameters equals the first.

    A parameter copied over the batch and then transformed row by row (a learned initial
    state ``h0.expand(N, H)`` through a layer) has the same row for every sample: each
    sample's share is its first. Equal to rounding: a kernel may round rows differently.
    """
    first = value[:1].expand_as(value)
    if torch.equal(value, first):
        return True
    if not value.is_floating_point():
        return False
    scale = float(first.detach().abs().max())
    tolerance = 16 * torch.finfo(value.dtype).eps * max(scale, torch.finfo(value.dtype).tiny)
    return bool(((value - first).abs() <= tolerance).all())


def zero_probes(plan: Plan, sites: list[int], n: int) -> dict[int, Tensor]:
    """Zero probes for the outputs of the given sites of a batch of ``n`` samples.

    Args:
        plan: The result of :func:`discover`.
        sites: Indices of the sites to probe.
        n: Batch size.

    Returns:
        One stride-0 zero tensor ``[n, *tail]`` per site.

    Example:
        >>> from packfunc.engine.discovery import discover
        >>> fn, p = packfunc.functional(torch.nn.Linear(3, 2))
        >>> plan = discover(fn, p, list(p.values()), torch.zeros(1, 3))
        >>> zero_probes(plan, [0], 5)[0].shape
        torch.Size([5, 2])
    """
    zeros: dict[tuple[torch.dtype, torch.device], Tensor] = {}  # one scalar per dtype and device
    probes = {}
    for k in sites:
        site = plan.sites[k]
        zero = zeros.get((site.dtype, site.device))
        if zero is None:
            zero = zeros[(site.dtype, site.device)] = torch.zeros(
                (), dtype=site.dtype, device=site.device
            )
        probes[k] = zero.expand(n, *site.tail)
    return probes


def probed_forward(
    model_fn: ModelFn,
    params: Any,
    leaves: list[Tensor],
    plan: Plan,
    X: Any,
    failed: set[int] | None = None,
) -> Callable[[dict[int, Tensor]], tuple[Tensor, dict[int, Recorded]]]:
    """Return ``probes -> (output, inputs)``: the model with probes added to tapped outputs.

    Args:
        model_fn: ``model_fn(params, X)``.
        params: The parameter pytree.
        leaves: Its flattened leaves.
        plan: The result of :func:`discover`.
        X: The batch of inputs.
        failed: Collects sites whose output shape differed from the probe's.

    Returns:
        A function of a dict of probes (site index -> tensor shaped like the
        site's output) returning the model output and each probed call's input.

    Example:
        >>> from packfunc.engine.discovery import discover
        >>> fn, p = packfunc.functional(torch.nn.Linear(3, 2))
        >>> plan = discover(fn, p, list(p.values()), torch.zeros(1, 3))
        >>> out, inputs = probed_forward(fn, p, list(p.values()), plan, torch.ones(4, 3))(
        ...     zero_probes(plan, [0], 4))
        >>> out.shape, inputs[0].shape
        (torch.Size([4, 2]), torch.Size([4, 3]))
    """
    leaf_of = LeafIndex(leaves)

    def forward(probes: dict[int, Tensor]) -> tuple[Tensor, dict[int, Recorded]]:
        mode = _RecordMode(leaf_of, plan, {k: p.shape for k, p in probes.items()}, probes)
        with mode:
            output = run_model(model_fn, params, X)
        mode.finish()
        if failed is not None:
            failed.update(mode.failed)
        return _in_parameter_dtype(output, leaves), mode.inputs

    return forward


@dataclass
class BatchRecord:
    """Everything the batch pass produced.

    The reduced loss and ``∂L/∂output`` are computed on first use: KFAC and KFLR
    pull back other cotangents only and never pay for them.

    Attributes:
        output: The model output ``[N, ...]``.
        inputs: Input of each recorded tapped call, by site index.
        failed: Active sites whose shapes differed from discovery (their leaves must
            take the whole-model path).
        pullback: Maps an output cotangent ``[N, ...]`` to the cotangents of the
            recorded calls' outputs.
        pullback_columns: The same for a stack of output cotangents ``[K, N, ...]``.
        loss_gradient: Returns ``(reduced loss, ∂L/∂output)``; called at most once.
        last_pullback: :attr:`pullback` for the last time, each site's cotangent passed
            through a :data:`SiteConsumer` (``None``: kept as it is) which decides what is
            kept: where plain autograd records, the graph is freed as the pullback goes (as
            in a plain backward pass), and most sites' cotangents reach the consumer
            during it, so that what it drops is never held beside the others.
        loss_alone: Returns the reduced loss without ``∂L/∂output`` (which can then not
            be taken); called at most once, instead of :attr:`loss_gradient`.
        drop_output: Lets the record's hold on the output go without taking the loss.
    """

    output: Tensor
    inputs: dict[int, Recorded]
    failed: set[int]
    pullback: Callable[[Tensor], dict[int, Tensor]]
    pullback_columns: Callable[[Tensor], dict[int, Tensor]]
    loss_gradient: Callable[[], tuple[Tensor, Tensor]]
    last_pullback: Callable[[Tensor, SiteConsumer | None], dict[int, Tensor]]
    loss_alone: Callable[[], Tensor]
    drop_output: Callable[[], None] = lambda: None
    _loss_without_gradient: Tensor | None = field(default=None, init=False, repr=False)
    _loss_dropped: bool = field(default=False, init=False, repr=False)

    @cached_property
    def _loss_and_cotangent(self) -> tuple[Tensor, Tensor]:
        return self.loss_gradient()

    @property
    def loss(self) -> Tensor:
        """The reduced loss."""
        if self._loss_dropped:
            raise RuntimeError(
                "the loss was not taken before the output was released without it "
                "(release_output(loss=False))."
            )
        if self._loss_without_gradient is not None:
            return self._loss_without_gradient
        return self._loss_and_cotangent[0]

    @property
    def output_cotangent(self) -> Tensor:
        """``∂L/∂output``; row ``n`` is sample ``n``'s share."""
        if self._loss_without_gradient is not None or self._loss_dropped:
            raise RuntimeError(
                "∂L/∂output was not taken before the output was released without it "
                "(release_output(gradient=False)); take it first."
            )
        return self._loss_and_cotangent[1]

    def release_output(self, *, gradient: bool = True, loss: bool = True) -> None:
        """Let the output's memory go (nothing reads it again).

        With ``gradient`` it goes as the loss gradient is taken. Without (no pullback of
        ``∂L/∂output`` follows), the loss alone is taken now, unless the gradient already
        was, so that the output goes before the next pullback instead of after it; or,
        without ``loss`` (nothing reads :attr:`loss`), the output goes untouched.
        :attr:`output` keeps its shape and dtype on the meta device: a read of its
        values fails instead of seeing freed memory.
        """
        if not self.output.is_meta:  # (a meta tensor's empty_like runs in Python: 30 µs)
            self.output = torch.empty_like(self.output, device="meta")
        if gradient or "_loss_and_cotangent" in self.__dict__:
            return
        if loss:
            self._loss_without_gradient = self.loss_alone()
        else:
            self.drop_output()
            self._loss_dropped = True


def record(
    model_fn: ModelFn,
    params: Any,
    leaves: list[Tensor],
    plan: Plan,
    X: Any,
    y: Tensor,
    loss: nn.Module,
    n: int,
) -> BatchRecord:
    """Run the batch pass: one forward, one vector-Jacobian product of the loss.

    Outside ``torch.func`` transforms, with nothing requiring gradients, plain
    autograd differentiates the tapped outputs directly (about 30 % less
    overhead on small models); otherwise ``torch.func.vjp`` differentiates zero
    probes added to them, which composes with ``vmap`` and ``grad``.

    Args:
        model_fn: ``model_fn(params, X)``.
        params: The parameter pytree.
        leaves: Its flattened leaves.
        plan: The result of :func:`discover`.
        X: The batch of inputs.
        y: The batch of targets.
        loss: The loss module.
        n: The batch size.

    Returns:
        The :class:`BatchRecord`.

    Example:
        >>> from packfunc.engine.discovery import discover
        >>> fn, p = packfunc.functional(torch.nn.Linear(3, 2))
        >>> X, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
        >>> plan = discover(fn, p, list(p.values()), X[:1])
        >>> rec = record(fn, p, list(p.values()), plan, X, y, torch.nn.CrossEntropyLoss(), 4)
        >>> rec.pullback(rec.output_cotangent)[0].shape
        torch.Size([4, 2])
    """
    inputs = [t for t in (*optree.tree_leaves(X), y) if isinstance(t, Tensor)]
    if is_plain(*leaves, *inputs):
        return _record_with_autograd(model_fn, params, leaves, plan, X, y, loss, n)
    failed: set[int] = set()
    forward = probed_forward(model_fn, params, leaves, plan, X, failed)

    def output_of_probes(probes: dict[int, Tensor]) -> tuple[Tensor, dict[int, Recorded]]:
        output, inputs = forward(probes)
        check_loss_inputs(loss, output, y, n)
        return output, inputs

    probes = zero_probes(plan, plan.active(), n)
    # (under torch.func or with leaves that take gradients, the results may be differentiated
    # again: attention's fused kernels have no derivative of their backward)
    with twice_differentiable():
        output, probe_pullback, inputs = vjp_with_aux(output_of_probes, probes)
        value, loss_pullback = vjp(lambda out: loss(out, y), output)
        (output_cotangent,) = loss_pullback(torch.ones_like(value))

    def pullback(cotangent: Tensor) -> dict[int, Tensor]:
        (found,) = probe_pullback(cotangent)
        return {k: g for k, g in found.items() if k in inputs}

    return BatchRecord(
        output,
        inputs,
        failed,
        pullback,
        vmap(pullback),
        lambda: (value, output_cotangent),
        lambda c, consume: _consumed(pullback(c), consume),  # torch.func keeps its graph
        lambda: value,
    )


def _refuse_other_layer_shape(out: Tensor, shape: tuple[int, ...], rows: int) -> None:
    """Stop a pass whose layer has the plan's rows but another shape: the plan is stale.

    Its samples are where the plan has them, but the layer's other dims are not (a pooling
    kernel or a convolution's padding changed since the plan was made): the layer's rule
    would take a shape it was not planned for, so the pass starts over from discovery.
    Rows that are not the batch's (a mixture of experts' tokens) take the whole-model path.

    A dim that has one entry for one sample and ``rows`` for the batch grows with the
    batch: each row depends on the other samples (a contrastive similarity ``x @ z.T``),
    and the refusal says so.

    Raises:
        PlanMismatch: if ``out`` has the plan's rows but another shape.
    """
    if not (out.dim() and out.shape[0] == shape[0] == rows):
        return
    grows = [
        d
        for d in range(1, min(out.dim(), len(shape)))
        if rows > 1 and shape[d] == 1 and out.shape[d] == rows
    ]
    if not grows or out.dim() != len(shape):
        raise PlanMismatch()
    raise PlanMismatch(
        f"a layer's output has shape {tuple(out.shape)} for a batch of {rows}, where one "
        f"sample gives {(1, *shape[1:])}: its dim {grows[0]} grows with the batch size, so "
        "each row depends on the other samples (a contrastive similarity x @ z.T of "
        "[N, N], attention across the batch). Per-sample quantities need row n of the "
        "output to depend on sample n alone: give packfunc the per-sample part of the "
        "model (e.g. the embeddings) with a per-sample loss, or compute these quantities "
        "without packfunc."
    )


def _consumed(found: dict[int, Tensor], consume: SiteConsumer | None) -> dict[int, Tensor]:
    """What ``consume`` keeps of each site's cotangent (all of them without one)."""
    if consume is None:
        return found
    kept = {k: consume(k, g) for k, g in found.items()}
    return {k: g for k, g in kept.items() if g is not None}


class _TappedLeaf(Tensor):
    """A parameter leaf in a batch pass whose plan calls the leaves only (``leaf_calls_only``).

    Only the calls that receive it reach Python, where a ``TorchFunctionMode`` sees every
    call of the model; :class:`_RecordMode` matches them with the plan as it does in its
    mode (a call the plan does not have raises :class:`PlanMismatch`). Attention runs
    decomposed, as in the mode: its calls that receive the leaves come back here. A linear
    layer with its weight stored ``[in, out]`` on flat rows (GPT-2's ``Conv1D``) runs as the
    mode runs it, its rows' source read off their memory (:class:`RowsInMemory`). Its calls
    return plain tensors.
    """

    @classmethod
    def __torch_function__(
        cls, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        recorders = _recorders()
        if recorders and func in ATTENTION_OPS and supports_attention(args, kwargs):
            return run_attention(args, kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            if not recorders:  # kept by the model beyond its pass: a plain tensor
                return func(*args, **kwargs)
            recorder = recorders[-1]
            if func in LINEAR_CALLS:
                rows = RowsInMemory(recorder.next_leading_dims())
                layer = rows.layer(func, args, kwargs, recorder._is_parameter)
                if layer is not None:  # as the mode: a linear layer on the rows' source
                    out = recorder._dispatch(linear_in_out, layer, {}, touches=True)
                    return out.reshape(-1, out.shape[-1]) if func is torch.addmm else out
            return recorder._dispatch(func, args, kwargs, touches=True)


def _as_tapped(out: Any) -> Any:
    """A deriving call's tensor outputs as :class:`_TappedLeaf` aliases (calls on them come back).

    Example:
        >>> type(_as_tapped((torch.ones(1), 2))[0]).__name__
        '_TappedLeaf'
    """
    if isinstance(out, Tensor):
        return out.as_subclass(_TappedLeaf)
    # another container's uses do not come back: the pass stops at the plan's next use and
    # runs in the mode that sees every call
    if type(out) in (list, tuple):
        return type(out)(t.as_subclass(_TappedLeaf) if isinstance(t, Tensor) else t for t in out)
    return out


_THREAD = threading.local()
"""Per thread (as PyTorch's mode stack is), the records of the batch passes running with
:class:`_TappedLeaf` leaves."""


def _recorders() -> list[_RecordMode]:
    """The calling thread's stack of records of batch passes on tapped leaves (innermost last)."""
    stack: list[_RecordMode] | None = getattr(_THREAD, "recorders", None)
    if stack is None:
        stack = _THREAD.recorders = []
    return stack


@contextlib.contextmanager
def _routing_tapped_leaves(recorder: _RecordMode) -> Iterator[None]:
    """Send this thread's calls that receive :class:`_TappedLeaf` leaves to ``recorder``."""
    stack = _recorders()
    stack.append(recorder)
    try:
        yield
    finally:
        stack.pop()


def _in_parameter_dtype(output: Tensor, leaves: list[Tensor]) -> Tensor:
    """The model output in the parameters' dtype (see ``engine/precision.py``).

    A forward under autocast gives bfloat16; the loss and its curvature are formed in float32.
    """
    return in_loss_dtype(output, leaves) if leaves and isinstance(output, Tensor) else output


def _record_with_autograd(
    model_fn: ModelFn,
    params: Any,
    leaves: list[Tensor],
    plan: Plan,
    X: Any,
    y: Tensor,
    loss: nn.Module,
    n: int,
) -> BatchRecord:
    """:func:`record` with plain autograd: tapped outputs are marked as requiring grad.

    A plan that calls the leaves only is followed through :class:`_TappedLeaf` leaves (the calls
    of the model that consume no parameter run without Python in between), any other plan,
    or a model that reaches its parameters another way than through ``params``, in a mode
    that sees every call.
    """
    shapes = {k: torch.Size((n, *plan.sites[k].tail)) for k in plan.active()}
    with torch.enable_grad():
        found = _tapped_leaves_forward(model_fn, params, leaves, plan, X, shapes)
        if found is None:
            mode = _RecordMode(LeafIndex(leaves), plan, shapes)
            with mode:
                output = model_fn(params, X)
            mode.finish()
        else:
            mode, output = found
        output = _in_parameter_dtype(output, leaves)
        check_loss_inputs(loss, output, y, n)
        if not output.requires_grad:  # no tapped call upstream
            output.requires_grad_()
    streamed = set(mode.outputs) - mode.rooted
    return autograd_record(
        output, mode.inputs, mode.outputs, shapes, mode.failed, loss, y, streamed=streamed
    )


def _tapped_leaves_forward(
    model_fn: ModelFn,
    params: Any,
    leaves: list[Tensor],
    plan: Plan,
    X: Any,
    shapes: dict[int, torch.Size],
) -> tuple[_RecordMode, Tensor] | None:
    """The forward with :class:`_TappedLeaf` aliases of the leaves, and its record.

    Returns:
        ``(record, output)``; ``None`` for a plan that is not ``leaf_calls_only``, or if the
        calls that received the aliases were not the plan's (the mode then decides, from the
        random numbers the stopped pass began with).
    """
    if not plan.leaf_calls_only:
        return None
    rewind = GeneratorMark(leaves).rewind
    aliases: list[Tensor] = [leaf.as_subclass(_TappedLeaf) for leaf in leaves]
    alias_of = {id(leaf): alias for leaf, alias in zip(leaves, aliases)}
    mode = _RecordMode(LeafIndex(aliases), plan, shapes, originals=leaves)
    try:
        with _routing_tapped_leaves(mode), plain_checkpoints(), forward_autocast():
            output = model_fn(optree.tree_map(lambda t: alias_of[id(t)], params), X)
        mode.finish()
    except PlanMismatch:  # e.g. a model that reaches its parameters not through params
        rewind()  # it may have drawn part of its random numbers
        restart_users_forward()  # and set attributes: the mode's pass is the forward
        return None
    return mode, output


def autograd_record(
    output: Tensor,
    inputs: dict[int, Recorded],
    outputs: dict[int, GradientEdge],
    shapes: Mapping[int, tuple[int, ...]],
    failed: set[int],
    loss: nn.Module,
    y: Any,
    differentiable: bool = False,
    streamed: set[int] | None = None,
) -> BatchRecord:
    """A :class:`BatchRecord` whose pullbacks run backward through an existing autograd graph.

    The recorded calls' outputs are given as gradient edges (their autograd nodes),
    so an in-place op applied to an output later (``ReLU(inplace=True)``) does not
    change what is differentiated. With ``differentiable``, every result keeps its
    own graph (``backward(create_graph=True)``). ``streamed`` sites' nodes run in any
    pullback that reaches the other sites (each lies between the output and one of
    them): the last pullback hands their cotangents to its consumer from a hook on
    the node as they are formed, instead of capturing them until the end.
    """
    # the pullbacks start at the output's node, so that the output's memory can go
    root = get_gradient_edge(output) if output.grad_fn is not None else output
    held = [output]

    def loss_gradient() -> tuple[Tensor, Tensor]:
        out = held[0] if differentiable else held.pop()  # called once (BatchRecord caches)
        with torch.enable_grad():
            value = loss(out, y)
        # differentiated at its node: the output's memory goes here if the record let it go
        at: Tensor | GradientEdge = out
        if not differentiable and out.grad_fn is not None:
            at = get_gradient_edge(out)
            del out
        (output_cotangent,) = torch.autograd.grad(
            value, at, retain_graph=True, create_graph=differentiable
        )
        return (value, output_cotangent) if differentiable else (value.detach(), output_cotangent)

    def loss_alone() -> Tensor:
        if differentiable:  # the output stays with the graph that the loss keeps
            return loss_gradient()[0]
        out = held.pop()
        with torch.no_grad():
            value: Tensor = loss(out, y)
        return value

    outputs = outputs | _unchanged_head(output, outputs)
    # a call whose output is the model output (a head) gets the cotangent itself
    node, index = output.grad_fn, output.output_nr
    direct = [
        k
        for k, e in outputs.items()
        if node is not None and e.node is node and e.output_nr == index
    ]
    sites = [k for k in outputs if k not in direct]
    edges = [outputs[k] for k in sites]

    def pulled_back(cotangent: Tensor, batched: bool, retain: bool) -> dict[int, Tensor]:
        pulled = torch.autograd.grad(
            root,
            edges,
            cotangent,
            retain_graph=retain or differentiable,
            create_graph=differentiable,
            allow_unused=True,
            is_grads_batched=batched,
        )
        found = dict.fromkeys(direct, cotangent)
        for k, g in zip(sites, pulled):
            shape = (*cotangent.shape[:batched], *shapes[k])
            # an output laid out as flat rows (an addmm recorded as a linear layer) is reshaped
            found[k] = g.reshape(shape) if g is not None else cotangent.new_zeros(shape)
        return found

    # (not recursive: a closure that calls itself is a reference cycle, which would keep
    # the graph's nodes, with any tensors they still save, until the garbage collector runs)
    def gradients(cotangent: Tensor, batched: bool, retain: bool = True) -> dict[int, Tensor]:
        if not edges:
            return dict.fromkeys(direct, cotangent)
        try:
            return pulled_back(cotangent, batched, retain)
        except RuntimeError as error:
            if not (batched and "random operations inside of vmap" in str(error)):
                raise
        # a checkpoint recomputing dropout in the backward: one column at a time (the
        # recomputation restores the forward's random state, so its masks are the same)
        columns = [pulled_back(column, False, True) for column in cotangent.unbind(0)]
        return {k: torch.stack([column[k] for column in columns]) for k in columns[0]}

    def last_gradients(cotangent: Tensor, consume: SiteConsumer | None) -> dict[int, Tensor]:
        if consume is None or differentiable or not sites:
            return _consumed(gradients(cotangent, False, retain=False), consume)
        # the lowest sites are captured, the others' nodes run on the way to them; a site not
        # streamed (its output made from a fresh leaf) has none below. A streamed site need
        # not lie above one of those: a branch fed by a tensor that requires grad from outside
        # the record (a closed-over frozen layer) meets the rest only at the output
        rooted = [k for k in sites if k not in (streamed or ())]
        captured = lowest_sites({k: outputs[k].node for k in sites}, known=rooted)
        nodes = {outputs[k].node for k in captured}
        # a node a capture ends at may not run: its sites are captured as well
        hooked = [k for k in sites if k not in captured and outputs[k].node not in nodes]
        captured += [k for k in sites if k not in captured and k not in hooked]
        found: dict[int, Tensor] = {}
        delivered: set[int] = set()

        def take(k: int, g: Tensor | None) -> None:
            delivered.add(k)
            g = g.reshape(shapes[k]) if g is not None else cotangent.new_zeros(shapes[k])
            kept = consume(k, g)
            if kept is not None:
                found[k] = kept

        for k in direct:
            take(k, cotangent)
        handles = [
            outputs[k].node.register_prehook(partial(_deliver, take, k, outputs[k].output_nr))
            for k in hooked
        ]
        try:
            pulled = torch.autograd.grad(
                root, [outputs[k] for k in captured], cotangent, allow_unused=True
            )
        finally:
            for handle in handles:
                handle.remove()
        for k, g in zip(captured, pulled):
            take(k, g)
        for k in hooked:
            if k not in delivered:  # no gradient reached it
                take(k, None)
        return found

    if differentiable:
        recorded, result = dict(inputs), output
    else:  # values only: nothing to track
        recorded, result = {k: x.detach() for k, x in inputs.items()}, output.detach()
    return BatchRecord(
        result,
        recorded,
        failed,
        lambda c: gradients(c, False),
        lambda c: gradients(c, True),
        loss_gradient,
        last_gradients,
        loss_alone,
        # (a differentiable record's output stays with the graph its loss would keep)
        (lambda: None) if differentiable else held.clear,
    )


def lowest_sites(nodes: dict[int, Node], known: Collection[int] = ()) -> list[int]:
    """The sites below which no other site's node lies in the autograd graph.

    A backward pass that reaches them runs every other site's node on its way (each lies
    above one of them).

    Args:
        nodes: Site -> the autograd node of its output.
        known: Sites known to have no site below (not searched).

    Returns:
        The lowest sites, in the order given.

    Example:
        >>> x = torch.ones(2, requires_grad=True)
        >>> a = x * 2
        >>> b = a.exp()
        >>> lowest_sites({0: a.grad_fn, 1: b.grad_fn})
        [0]
    """
    site_nodes = set(nodes.values())
    clear: set[Node] = set()  # nodes with no site's node at or below them
    return [
        k for k, node in nodes.items() if k in known or not _site_below(node, site_nodes, clear)
    ]


def _site_below(start: Node, site_nodes: set[Node], clear: set[Node]) -> bool:
    """Whether another site's node lies below ``start``: a search that stops at the first.

    A search that finds none adds what it saw to ``clear``, which later searches skip: each
    site's search ends at the nearest site below it, and the graph below the lowest is
    walked once.
    """
    seen: set[Node] = set()
    stack = [start]
    while stack:
        for child, _ in stack.pop().next_functions:
            if child is None or child in seen or child in clear:
                continue
            if child in site_nodes:
                return True
            seen.add(child)
            stack.append(child)
    clear |= seen
    return False


def _deliver(
    take: Callable[[int, Tensor | None], None],
    k: int,
    index: int,
    grad_outputs: tuple[Tensor | None, ...],
) -> None:
    """A node pre-hook: hand the node's output cotangent ``index`` to ``take`` as site ``k``."""
    take(k, grad_outputs[index])
