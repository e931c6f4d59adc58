"""Record, per tapped op call, its input and the cotangent of its output.

Two passes over ``model_fn``, both inside a ``TorchFunctionMode``:

1. :func:`discover` runs the model on the first sample only. It lists every
   call of a tapped op (``F.linear``, convolutions, ``F.embedding``) whose
   weight or bias is a parameter leaf, and marks as *uncovered* every leaf that is also
   used any other way (a raw ``nn.Parameter`` in a matmul, a LayerNorm weight,
   a weight used transposed ...). Uncovered leaves go to the generic path.
2. :func:`record` runs the model on the whole batch inside ``torch.func.vjp``
   with a zero *probe* added to the output of each tapped call. Pulling the
   loss gradient ``∂L/∂f`` back through that vjp yields every cotangent at once:
   ``g_k[n] = ∂L/∂z_k[n]`` is sample ``n``'s share, because the loss is a sum of
   per-sample terms and each row ``n`` of ``z_k`` depends on sample ``n`` only.
   The pullback is kept: any other output cotangent (e.g. the columns of a loss
   Hessian's square root) can be pulled back through the same forward pass.

Running discovery on one sample also checks that dim 0 is the sample dimension
at every tapped call: its size must be 1 there and ``N`` in the batch pass.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import optree
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.func import vmap
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

from packfunc.engine.autodiff import vjp, vjp_with_aux
from packfunc.engine.memory import is_plain
from packfunc.engine.ops import ROLES, SIGNATURES, OpSignature, TapCall, make_call
from packfunc.engine.recurrent import RECURRENT_OPS, run_recurrent
from packfunc.losses import check_loss_inputs

_METADATA_METHODS = frozenset(
    {
        Tensor.size,
        Tensor.dim,
        Tensor.numel,
        Tensor.__len__,
        Tensor.is_floating_point,
        Tensor.is_complex,
        Tensor.element_size,
        Tensor.stride,
        Tensor.is_contiguous,
        Tensor.get_device,
        Tensor.data_ptr,
        Tensor.nelement,
        Tensor.ndimension,
    }
)
_METADATA_ATTRIBUTES = frozenset(
    {
        "shape",
        "dtype",
        "device",
        "ndim",
        "is_nested",
        "requires_grad",
        "layout",
        "is_cuda",
        "is_cpu",
        "is_sparse",
        "is_quantized",
        "is_meta",
        "is_mkldnn",
        "names",
        "is_leaf",
        "grad_fn",
        "itemsize",
        "nbytes",
    }
)


def is_metadata_query(func: Callable) -> bool:
    """Whether ``func`` only reads a tensor's metadata (shape, dtype, ...)."""
    if func in _METADATA_METHODS:
        return True
    descriptor = getattr(func, "__self__", None)
    return (
        getattr(descriptor, "__objclass__", None) is torch._C.TensorBase
        and getattr(descriptor, "__name__", None) in _METADATA_ATTRIBUTES
    )


class LeafIndex:
    """Find parameter leaves by identity among the arguments of a call.

    A tensor object that appears at two places of the parameter pytree cannot be
    attributed to one place; such leaves are reported in ``duplicated``.
    """

    def __init__(self, leaves: list[Tensor]):
        self._positions: dict[int, list[int]] = {}
        for i, leaf in enumerate(leaves):
            self._positions.setdefault(id(leaf), []).append(i)
        self.duplicated = {i for pos in self._positions.values() if len(pos) > 1 for i in pos}

    def __call__(self, value: Any) -> int | None:
        """Return the leaf index of ``value`` if it is a (unique) parameter leaf."""
        positions = self._positions.get(id(value)) if isinstance(value, Tensor) else None
        return positions[0] if positions and len(positions) == 1 else None

    def used_in(self, *values: Any) -> set[int]:
        """Return the leaf indices of every parameter found in the given pytrees.

        Args:
            *values: Arguments of a call (nested lists, tuples, dicts of tensors).

        Returns:
            Indices of the leaves among them (duplicated leaves included).
        """
        found: set[int] = set()
        leaves: list[Any] = optree.tree_leaves(values, none_is_leaf=True)  # type: ignore[arg-type]
        for value in leaves:
            if isinstance(value, Tensor):
                found.update(self._positions.get(id(value), ()))
        return found


class FunctionalMode(TorchFunctionMode):
    """Make a model safe for per-sample computations.

    Recurrent ops are replaced by an out-of-place decomposition (vmap-able,
    built from ``F.linear``) and BatchNorm in training mode, which mixes the
    samples of a batch, is refused — or, with ``batch_statistics=True`` (for
    whole-batch quantities), normalizes with the batch's statistics and leaves
    the running statistics untouched. Subclasses handle tapped ops.

    Args:
        batch_statistics: Whether BatchNorm in training mode may run.
    """

    leaf_of: LeafIndex | None = None

    def __init__(self, batch_statistics: bool = False):
        super().__init__()
        self.batch_statistics = batch_statistics

    def __torch_function__(
        self, func: Callable, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in RECURRENT_OPS:
            with self:
                return run_recurrent(func, args, kwargs)
        if func is F.batch_norm:
            args, kwargs = _batch_norm_arguments(args, kwargs, self.batch_statistics)
        if self.batch_statistics and _counts_batches(func, args):
            return args[0]  # running statistics stay as they are, and so does their counter
        sig = SIGNATURES.get(func)
        if sig is not None and self.leaf_of is not None:
            bound = sig.bind(args, kwargs)
            if any(self.leaf_of(bound.get(role)) is not None for role in ROLES):
                return self._tapped(func, sig, bound, partial(_call_replacing, func, args, kwargs))
        return self._other(func, args, kwargs)

    def _tapped(
        self, func: Callable, sig: OpSignature, bound: dict[str, Any], run: Callable[..., Tensor]
    ) -> Tensor:
        return run()

    def _other(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        return func(*args, **kwargs)


def _batch_norm_arguments(args: tuple, kwargs: dict, batch_statistics: bool) -> tuple[tuple, dict]:
    """``F.batch_norm``'s arguments; in training mode refused, or without running statistics.

    Without running statistics, training-mode BatchNorm normalizes with the batch's
    mean and variance and updates nothing: a pure function of its input.
    """
    names = ("input", "running_mean", "running_var", "weight", "bias", "training")
    bound = dict(zip(names, args)) | kwargs
    if not bound.get("training", False):
        return args, kwargs
    if not batch_statistics:
        raise ValueError(
            "BatchNorm in training mode normalizes with batch statistics, which mixes samples: "
            "per-sample quantities are not defined. Call model.eval() (or use GroupNorm/"
            "LayerNorm) before computing them."
        )
    return (), bound | {"running_mean": None, "running_var": None}


def _counts_batches(func: Callable, args: tuple) -> bool:
    """Whether the call increments an integer counter such as ``num_batches_tracked``.

    ``nn.BatchNorm*`` in training mode counts batches in place (for its running
    averages); a pure function must not, and inside a ``torch.func`` transform it
    cannot mutate a captured tensor.
    """
    return (
        func is Tensor.add_
        and isinstance(args[0], Tensor)
        and args[0].dim() == 0
        and args[0].dtype == torch.long
    )


def functional_mode(batch_statistics: bool = False) -> TorchFunctionMode:
    """Return the mode that runs models for the generic, vmap-based path.

    Args:
        batch_statistics: Let BatchNorm in training mode normalize with batch statistics
            (for whole-batch quantities) instead of refusing it; running statistics are
            never updated.

    Returns:
        A ``TorchFunctionMode`` that decomposes recurrent ops and refuses BatchNorm
        in training mode (unless ``batch_statistics``).

    Example:
        >>> with functional_mode():
        ...     y = torch.nn.GRU(2, 3)(torch.zeros(4, 1, 2))
    """
    return FunctionalMode(batch_statistics)


def twice_differentiable() -> contextlib.AbstractContextManager:
    """Select kernels that support higher-order derivatives.

    Fused attention kernels (e.g. CPU flash attention) have neither forward-mode
    nor double-backward formulas; inside this context ``scaled_dot_product_attention``
    uses its math implementation, which has both.

    Returns:
        A context manager.

    Example:
        >>> with twice_differentiable():
        ...     out = F.scaled_dot_product_attention(*torch.ones(3, 1, 2, 4))
    """
    return sdpa_kernel([SDPBackend.MATH])


@dataclass
class Site:
    """A tapped call seen during discovery, with its per-sample output shape."""

    call: TapCall
    tail: torch.Size
    dtype: torch.dtype
    device: torch.device


@dataclass
class TapPlan:
    """What discovery learned about the model.

    Attributes:
        sites: Every tapped call, in call order.
        uncovered: Leaves also used outside tapped ops (or ambiguously).
    """

    sites: list[Site] = field(default_factory=list)
    uncovered: set[int] = field(default_factory=set)

    def covered(self) -> set[int]:
        """Return the leaves whose every use is a tapped call."""
        return {leaf for site in self.sites for _, leaf in site.call.leaves} - self.uncovered

    def active(self) -> list[int]:
        """Return the indices of sites that have at least one covered leaf."""
        covered = self.covered()
        return [
            k
            for k, site in enumerate(self.sites)
            if any(leaf in covered for _, leaf in site.call.leaves)
        ]


_DROPOUT_FUNCTIONS = frozenset(
    {
        F.dropout,
        F.dropout1d,
        F.dropout2d,
        F.dropout3d,
        F.alpha_dropout,
        F.feature_alpha_dropout,
    }
)
_DROPOUT_BUILTINS = frozenset(
    {
        torch.dropout,
        torch.alpha_dropout,
        torch.feature_dropout,
        torch.feature_alpha_dropout,
    }
)


def dropout_rate(func: Callable, args: tuple, kwargs: dict) -> float:
    """Return the drop probability of a call that drops activations at random, else 0.

    Dropout functions in training mode, ``torch.dropout`` and its variants, attention
    with ``dropout_p > 0`` (``F.scaled_dot_product_attention``, and
    ``F.multi_head_attention_forward`` in training mode).

    Args:
        func: The function called.
        args: Its positional arguments.
        kwargs: Its keyword arguments.

    Returns:
        The probability ``p`` (``0.0`` when the call is deterministic).

    Example:
        >>> dropout_rate(F.dropout, (torch.ones(2), 0.3), {}), dropout_rate(F.relu, (), {})
        (0.3, 0.0)
    """
    if func in _DROPOUT_FUNCTIONS or func is F.multi_head_attention_forward:
        bound = inspect.signature(func).bind(*args, **kwargs)
        bound.apply_defaults()
        p = bound.arguments["p" if func in _DROPOUT_FUNCTIONS else "dropout_p"]
        return float(p) if bound.arguments["training"] else 0.0
    if func in _DROPOUT_BUILTINS:
        named = dict(zip(("input", "p", "train"), args)) | kwargs
        return float(named["p"]) if named.get("train") else 0.0
    if func is F.scaled_dot_product_attention:
        return float(kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0))
    return 0.0


class _DiscoveryMode(FunctionalMode):
    leaf_of: LeafIndex

    def __init__(self, leaf_of: LeafIndex):
        super().__init__()
        self.leaf_of = leaf_of
        self.plan = TapPlan(uncovered=set(leaf_of.duplicated))
        self.dropout = 0.0

    def _tapped(
        self, func: Callable, sig: OpSignature, bound: dict[str, Any], run: Callable[..., Tensor]
    ) -> Tensor:
        _refuse_coupled_embedding(sig, bound)
        out = run()
        call = make_call(sig, bound, self.leaf_of)
        others = {k: v for k, v in bound.items() if k not in dict(call.leaves)}
        self.plan.uncovered |= self.leaf_of.used_in(others)
        x = bound["input"]
        if not (isinstance(x, Tensor) and x.dim() and x.shape[0] == 1 and out.shape[0] == 1):
            self.plan.uncovered |= {leaf for _, leaf in call.leaves}
        self.plan.sites.append(Site(call, out.shape[1:], out.dtype, out.device))
        return out

    def _other(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        if not is_metadata_query(func):
            self.plan.uncovered |= self.leaf_of.used_in(args, kwargs)
            self.dropout = max(self.dropout, dropout_rate(func, args, kwargs))
        return func(*args, **kwargs)


def _call_replacing(
    func: Callable, args: tuple, kwargs: dict, old: Any = None, new: Any = None
) -> Tensor:
    """``func(*args, **kwargs)``, with the argument that is ``old`` (by identity) set to ``new``."""
    if old is None:
        return func(*args, **kwargs)
    args = tuple(new if a is old else a for a in args)
    kwargs = {key: new if v is old else v for key, v in kwargs.items()}
    return func(*args, **kwargs)


def _refuse_coupled_embedding(sig: OpSignature, bound: dict[str, Any]) -> None:
    if sig.family != "embedding":
        return
    if bound["max_norm"] is not None:
        raise ValueError(
            "Embedding(max_norm=...) renormalizes the weight in place during the forward pass, "
            "which a pure function cannot do; drop max_norm or renormalize the weight yourself."
        )
    if bound["scale_grad_by_freq"]:
        raise ValueError(
            "Embedding(scale_grad_by_freq=True) scales gradients by word counts over the whole "
            "batch, which couples samples; per-sample gradients are not defined. Set it to False."
        )


def discover(model_fn: Callable, params: Any, leaves: list[Tensor], X_first: Any) -> TapPlan:
    """Run the model on one sample and plan which leaves the tapped path covers.

    Args:
        model_fn: ``model_fn(params, X)``.
        params: The parameter pytree.
        leaves: Its flattened leaves (same objects as in ``params``).
        X_first: The inputs restricted to the first sample (batch size 1).

    Returns:
        The :class:`TapPlan`.

    Example:
        >>> fn, p = packfunc.functional(torch.nn.Linear(3, 2))
        >>> len(discover(fn, p, list(p.values()), torch.zeros(1, 3)).sites)
        1
    """
    mode = _DiscoveryMode(LeafIndex(leaves))
    with torch.no_grad(), mode:
        out = model_fn(params, X_first)
    if not (isinstance(out, Tensor) and out.dim() and out.shape[0] == 1):
        shape = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
        raise ValueError(
            f"model_fn returned {shape} for a batch of one sample; it must return a tensor "
            "whose leading dimension is the batch dimension."
        )
    if mode.dropout:
        warnings.warn(
            f"model_fn applies dropout (p={mode.dropout:g}) in training mode: every call draws "
            "new random masks, so two calls give different results and curvature is that of "
            "one random subnetwork. Call model.eval() first (or set the dropout p=0), unless "
            "the randomness is intended.",
            UserWarning,
            stacklevel=2,
        )
    return mode.plan


class _RecordMode(FunctionalMode):
    """Adds probes to tapped outputs (``torch.func``), or marks them for autograd."""

    leaf_of: LeafIndex

    def __init__(
        self, leaf_of: LeafIndex, plan: TapPlan, probes: dict[int, Tensor], mark: bool = False
    ):
        super().__init__()
        self.leaf_of, self.plan, self.probes, self.mark = leaf_of, plan, probes, mark
        self.inputs: dict[int, Tensor] = {}
        self.outputs: dict[int, GradientEdge] = {}
        self.failed: set[int] = set()
        self.count = 0

    def _tapped(
        self, func: Callable, sig: OpSignature, bound: dict[str, Any], run: Callable[..., Tensor]
    ) -> Tensor:
        k, self.count = self.count, self.count + 1
        call = make_call(sig, bound, self.leaf_of)
        if k >= len(self.plan.sites) or self.plan.sites[k].call.leaves != call.leaves:
            raise RuntimeError(
                "model_fn called its layers in a different order for one sample than for the "
                "batch; packfunc needs the same sequence of layer calls for any batch size."
            )
        probe = self.probes.get(k)
        if probe is None:
            return run()
        if self.mark and not any(isinstance(v, Tensor) and v.requires_grad for v in bound.values()):
            # the output would be a leaf, which an in-place op after the call (ReLU(inplace=True))
            # may not modify: compute it from a fresh leaf alias of a parameter instead
            weight = bound[call.leaves[0][0]]
            out = run(weight, weight.detach().requires_grad_())
        else:
            out = run()
        if out.shape != probe.shape or bound["input"].shape[0] != probe.shape[0]:
            self.failed.add(k)
            return out
        self.inputs[k] = bound["input"]
        if self.mark:  # autograd: the output itself is differentiated
            self.outputs[k] = get_gradient_edge(out)  # still right if out is changed in place
            return out
        return out + probe


def zero_probes(plan: TapPlan, sites: list[int], n: int) -> dict[int, Tensor]:
    """Zero probes for the outputs of the given sites of a batch of ``n`` samples.

    Args:
        plan: The result of :func:`discover`.
        sites: Indices of the sites to probe.
        n: Batch size.

    Returns:
        One stride-0 zero tensor ``[n, *tail]`` per site.

    Example:
        >>> fn, p = packfunc.functional(torch.nn.Linear(3, 2))
        >>> plan = discover(fn, p, list(p.values()), torch.zeros(1, 3))
        >>> zero_probes(plan, [0], 5)[0].shape
        torch.Size([5, 2])
    """
    return {
        k: torch.zeros((), dtype=plan.sites[k].dtype, device=plan.sites[k].device).expand(
            n, *plan.sites[k].tail
        )
        for k in sites
    }


def probed_forward(
    model_fn: Callable,
    params: Any,
    leaves: list[Tensor],
    plan: TapPlan,
    X: Any,
    failed: set[int] | None = None,
) -> Callable[[dict[int, Tensor]], tuple[Tensor, dict[int, Tensor]]]:
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
        >>> fn, p = packfunc.functional(torch.nn.Linear(3, 2))
        >>> plan = discover(fn, p, list(p.values()), torch.zeros(1, 3))
        >>> out, inputs = probed_forward(fn, p, list(p.values()), plan, torch.ones(4, 3))(
        ...     zero_probes(plan, [0], 4))
        >>> out.shape, inputs[0].shape
        (torch.Size([4, 2]), torch.Size([4, 3]))
    """
    leaf_of = LeafIndex(leaves)

    def forward(probes: dict[int, Tensor]) -> tuple[Tensor, dict[int, Tensor]]:
        mode = _RecordMode(leaf_of, plan, probes)
        with mode:
            output = model_fn(params, X)
        if failed is not None:
            failed.update(mode.failed)
        return output, mode.inputs

    return forward


@dataclass
class TapRecord:
    """Everything the batch pass produced.

    Attributes:
        loss: The reduced loss.
        output: The model output ``[N, ...]``.
        output_cotangent: ``∂L/∂output``; row ``n`` is sample ``n``'s share.
        inputs: Input of each recorded tapped call, by site index.
        failed: Active sites whose shapes differed from discovery (their leaves must
            take the generic path).
        pullback: Maps an output cotangent ``[N, ...]`` to the cotangents of the
            recorded calls' outputs.
        pullback_columns: The same for a stack of output cotangents ``[K, N, ...]``.
    """

    loss: Tensor
    output: Tensor
    output_cotangent: Tensor
    inputs: dict[int, Tensor]
    failed: set[int]
    pullback: Callable[[Tensor], dict[int, Tensor]]
    pullback_columns: Callable[[Tensor], dict[int, Tensor]]


def record(
    model_fn: Callable,
    params: Any,
    leaves: list[Tensor],
    plan: TapPlan,
    X: Any,
    y: Tensor,
    loss: nn.Module,
    n: int,
) -> TapRecord:
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
        The :class:`TapRecord`.

    Example:
        >>> fn, p = packfunc.functional(torch.nn.Linear(3, 2))
        >>> X, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
        >>> plan = discover(fn, p, list(p.values()), X[:1])
        >>> rec = record(fn, p, list(p.values()), plan, X, y, torch.nn.CrossEntropyLoss(), 4)
        >>> rec.pullback(rec.output_cotangent)[0].shape
        torch.Size([4, 2])
    """
    if is_plain(*leaves, *(t for t in optree.tree_leaves(X) if isinstance(t, Tensor))):
        return _record_with_autograd(model_fn, params, leaves, plan, X, y, loss, n)
    failed: set[int] = set()
    forward = probed_forward(model_fn, params, leaves, plan, X, failed)

    def output_of_probes(probes: dict[int, Tensor]) -> tuple[Tensor, dict[int, Tensor]]:
        output, inputs = forward(probes)
        check_loss_inputs(loss, output, y, n)
        return output, inputs

    probes = zero_probes(plan, plan.active(), n)
    output, probe_pullback, inputs = vjp_with_aux(output_of_probes, probes)
    value, loss_pullback = vjp(lambda out: loss(out, y), output)
    (output_cotangent,) = loss_pullback(torch.ones_like(value))

    def pullback(cotangent: Tensor) -> dict[int, Tensor]:
        (found,) = probe_pullback(cotangent)
        return {k: g for k, g in found.items() if k in inputs}

    return TapRecord(value, output, output_cotangent, inputs, failed, pullback, vmap(pullback))


def _record_with_autograd(
    model_fn: Callable,
    params: Any,
    leaves: list[Tensor],
    plan: TapPlan,
    X: Any,
    y: Tensor,
    loss: nn.Module,
    n: int,
) -> TapRecord:
    """:func:`record` with plain autograd: tapped outputs are marked as requiring grad."""
    mode = _RecordMode(LeafIndex(leaves), plan, zero_probes(plan, plan.active(), n), mark=True)
    with torch.enable_grad():
        with mode:
            output = model_fn(params, X)
        check_loss_inputs(loss, output, y, n)
        if not output.requires_grad:  # no tapped call upstream
            output.requires_grad_()
    shapes = {k: (n, *plan.sites[k].tail) for k in mode.outputs}
    return _autograd_record(output, mode.inputs, mode.outputs, shapes, mode.failed, loss, y)


def _autograd_record(
    output: Tensor,
    inputs: dict[int, Tensor],
    outputs: dict[int, GradientEdge],
    shapes: dict[int, tuple[int, ...]],
    failed: set[int],
    loss: nn.Module,
    y: Any,
    differentiable: bool = False,
) -> TapRecord:
    """A :class:`TapRecord` whose pullbacks run backward through an existing autograd graph.

    The recorded calls' outputs are given as gradient edges (their autograd nodes),
    so an in-place op applied to an output later (``ReLU(inplace=True)``) does not
    change what is differentiated. With ``differentiable``, every result keeps its
    own graph (``backward(create_graph=True)``).
    """
    with torch.enable_grad():
        value = loss(output, y)
        (output_cotangent,) = torch.autograd.grad(
            value, output, retain_graph=True, create_graph=differentiable
        )
    sites, edges = list(outputs), list(outputs.values())

    def gradients(cotangent: Tensor, batched: bool) -> dict[int, Tensor]:
        if not edges:
            return {}
        found = torch.autograd.grad(
            output,
            edges,
            cotangent,
            retain_graph=True,
            create_graph=differentiable,
            allow_unused=True,
            is_grads_batched=batched,
        )
        return {
            k: g if g is not None else cotangent.new_zeros((*cotangent.shape[:batched], *shapes[k]))
            for k, g in zip(sites, found)
        }

    if differentiable:
        return TapRecord(
            value,
            output,
            output_cotangent,
            dict(inputs),
            failed,
            lambda c: gradients(c, False),
            lambda c: gradients(c, True),
        )
    values = {k: x.detach() for k, x in inputs.items()}  # values only: nothing to track
    return TapRecord(
        value.detach(),
        output.detach(),
        output_cotangent,
        values,
        failed,
        lambda c: gradients(c, False),
        lambda c: gradients(c, True),
    )


class ForwardRecorder(TorchFunctionMode):
    """Watch someone else's forward pass and keep every tapped call's input and output.

    Unlike the modes above it changes nothing: recurrent ops stay fused and
    BatchNorm in training mode runs; seeing either only marks the recording as
    unusable (the batch pass then runs packfunc's own forward instead). Outputs
    are kept as gradient edges, so later in-place ops on them do not matter;
    an input changed in place after its call makes the recording unusable.

    Args:
        parameters: The model's parameters, in ``named_parameters`` order.

    Example:
        >>> layer = torch.nn.Linear(3, 2)
        >>> with ForwardRecorder(list(layer.parameters())) as recorder:
        ...     out = layer(torch.ones(4, 3))
        >>> len(recorder.calls)
        1
    """

    def __init__(self, parameters: list[Tensor]):
        super().__init__()
        self.leaf_of = LeafIndex(parameters)
        self.calls: list[WatchedCall] = []
        self.usable = True

    def __torch_function__(
        self, func: Callable, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        sig = SIGNATURES.get(func)
        if sig is not None:
            bound = sig.bind(args, kwargs)
            if any(self.leaf_of(bound.get(role)) is not None for role in ROLES):
                self.calls.append(
                    WatchedCall.of(make_call(sig, bound, self.leaf_of), bound["input"], out)
                )
        elif func in RECURRENT_OPS:
            self.usable = False  # packfunc's own pass decomposes them: the calls differ
        return out

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

    def record(
        self,
        plan: TapPlan,
        output: Tensor,
        loss: nn.Module,
        y: Any,
        n: int,
        adapt: Callable[[Tensor], Tensor] | None = None,
        differentiable: bool = False,
    ) -> TapRecord | None:
        """The batch pass's record, from the watched forward; ``None`` if it does not fit.

        Args:
            plan: The result of :func:`discover` for the same model.
            output: The watched forward's output (still part of its autograd graph).
            loss: The loss module.
            y: The targets.
            n: The batch size.
            adapt: Maps the output to the loss input (a shape change), if they differ.
            differentiable: Keep the results' graphs (``create_graph=True``).

        Returns:
            A :class:`TapRecord` pulling back through the watched graph, or ``None``
            when the watched calls differ from the plan's.
        """
        calls = [call.call.leaves for call in self.calls]
        if (
            not self.usable
            or calls != [site.call.leaves for site in plan.sites]
            or any(call.input._version != call.input_version for call in self.calls)
        ):
            return None
        with torch.enable_grad():
            final = output if adapt is None else adapt(output)
        check_loss_inputs(loss, final, y, n)
        inputs, edges, shapes, failed = {}, {}, {}, set()
        for k in plan.active():
            call = self.calls[k]
            out = output if call.output is None else call.output
            edge = get_gradient_edge(output) if call.output is None else call.edge
            if edge is None or out.shape != (n, *plan.sites[k].tail) or call.input.shape[0] != n:
                failed.add(k)
            else:
                inputs[k], shapes[k], edges[k] = call.input, tuple(out.shape), edge
        return _autograd_record(final, inputs, edges, shapes, failed, loss, y, differentiable)


@dataclass
class WatchedCall:
    """One tapped call of a watched forward pass.

    Attributes:
        call: The call's op and parameter roles.
        input: Its input tensor.
        input_version: The input's version counter right after the call.
        output: Its output tensor (``None`` once released).
        output_version: The output's version counter right after the call.
        edge: The output's gradient edge (``None`` once released, or if it needs no grad).
    """

    call: TapCall
    input: Tensor
    input_version: int
    output: Tensor | None
    output_version: int
    edge: GradientEdge | None

    @classmethod
    def of(cls, call: TapCall, x: Tensor, out: Tensor) -> WatchedCall:
        """Record a call right after it ran."""
        edge = get_gradient_edge(out) if out.requires_grad else None
        return cls(call, x, x._version, out, out._version, edge)
