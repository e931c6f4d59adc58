"""The ``TorchFunctionMode`` packfunc runs models in, and how it follows parameters.

:class:`FunctionalMode` makes a model safe for per-sample computations: recurrent
ops and attention are replaced by out-of-place, batch-first decompositions
(``engine/recurrent.py``, ``engine/attention.py``) and BatchNorm in training mode
is refused. Discovery and the batch pass subclass it (:class:`ParameterMode`)
to follow parameters: leaves by identity (:class:`LeafIndex`), and tensors
computed from parameters only (derivations, ``engine/local.py``).
"""

from __future__ import annotations

import contextlib
import inspect
from collections import OrderedDict
from collections.abc import Callable
from functools import partial
from typing import Any, cast

import optree
import torch
import torch.nn.functional as F
from torch import Tensor
from torch._C._functorch import is_functorch_wrapped_tensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from packfunc.engine.attention import ATTENTION_OPS, run_attention, supports_attention
from packfunc.engine.autodiff import PACKED_UNDER_VMAP, under_vmap
from packfunc.engine.checkpointing import plain_checkpoints
from packfunc.engine.decompositions import DECOMPOSED_OPS, ONLY_UNDER_TRANSFORMS
from packfunc.engine.local import (
    CallArguments,
    Derivation,
    Source,
    copies_along_batch,
    copy_dims,
    derive,
    without_running_updates,
)
from packfunc.engine.ops import (
    ELEMENTWISE,
    LINEAR_CALLS,
    RESHAPES,
    ROLES,
    SIGNATURES,
    FlatRows,
    OpSignature,
    linear_in_out,
)
from packfunc.engine.precision import forward_autocast
from packfunc.engine.recurrent import (
    CUDNN_WEIGHT_LAYOUT,
    PACK_PADDED_SEQUENCE,
    RECURRENT_OPS,
    is_packed,
    run_recurrent,
)

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
        "_version",
        "grad_fn",
        "itemsize",
        "nbytes",
    }
)


def is_metadata_query(func: Callable[..., Any]) -> bool:
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
        self.leaves = leaves
        self._positions: dict[int, list[int]] = {}
        for i, leaf in enumerate(leaves):
            self._positions.setdefault(id(leaf), []).append(i)
        self.duplicated = {i for pos in self._positions.values() if len(pos) > 1 for i in pos}

    def __call__(self, value: Any) -> int | None:
        """Return the leaf index of ``value`` if it is a (unique) parameter leaf."""
        positions = self._positions.get(id(value)) if isinstance(value, Tensor) else None
        return positions[0] if positions and len(positions) == 1 else None

    def leaf(self, index: int) -> Tensor:
        """The leaf at ``index`` of the flattened pytree."""
        return self.leaves[index]

    def contains(self, value: Any) -> bool:
        """Whether ``value`` is (by identity) one of the leaves, duplicated ones included."""
        return id(value) in self._positions

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


def _lengths_vary(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a ``pack_padded_sequence`` call under ``vmap`` maps over its lengths.

    Mapped over samples, each instance has lengths of its own (a packed length of its own);
    mapped over vectors (a product's), the lengths are the batch's, and packing decomposes.
    """
    lengths = args[1] if len(args) > 1 else kwargs.get("lengths")
    while isinstance(lengths, Tensor) and is_functorch_wrapped_tensor(lengths):
        if torch._C._functorch.is_batchedtensor(lengths):
            return True
        lengths = torch._C._functorch.get_unwrapped(lengths)  # (a transform's level below)
    return False


REWRITTEN_OPS = (
    RECURRENT_OPS
    | ATTENTION_OPS
    | LINEAR_CALLS
    | (set(DECOMPOSED_OPS) - ONLY_UNDER_TRANSFORMS)
    | {F.batch_norm}
)
"""Calls :class:`FunctionalMode` replaces by a decomposition, or refuses, or changes."""


def retains_nothing(func: Callable[..., Any], args: tuple[Any, ...]) -> bool:
    """Whether a call is ``t.retain_grad()`` or ``t.register_hook(...)`` where no graph is.

    A forward that retains a hidden gradient (``self.hidden.retain_grad()``) or hooks one
    (``h.register_hook(self.saved.append)``, as Grad-CAM does) run in one of packfunc's
    passes that take no gradient there (discovery's, a transform's): none is retained or
    hooked (no gradient reaches it there), where torch would raise. A hook on a tensor that
    takes a gradient in the pass is registered (``torch.func.grad`` runs it).

    Example:
        >>> retains_nothing(Tensor.retain_grad, (torch.ones(1),))
        True
    """
    if func is Tensor.register_hook:
        return not args[0].requires_grad
    return func is Tensor.retain_grad and (
        not args[0].requires_grad or is_functorch_wrapped_tensor(args[0])
    )


def nothing_retained(func: Callable[..., Any]) -> Any:
    """What a call :func:`retains_nothing` returns: a hook's handle (to nothing), or ``None``.

    Example:
        >>> nothing_retained(Tensor.register_hook).remove()
    """
    return RemovableHandle(OrderedDict()) if func is Tensor.register_hook else None


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
        self.rows = FlatRows()
        self._entered: list[contextlib.ExitStack] = []
        self._uncounted: dict[int, tuple[Tensor, int]] = {}  # counter -> increments skipped

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is CUDNN_WEIGHT_LAYOUT:  # its result is unused; see CUDNN_WEIGHT_LAYOUT
            return None
        if func is Tensor.data_ptr and is_functorch_wrapped_tensor(args[0]):
            # no storage of its own (PyTorch raises): 0, so that nn.RNNBase.flatten_parameters
            # on CUDA sees the weights as aliased and stops before CUDNN_WEIGHT_LAYOUT
            return 0
        if retains_nothing(func, args):
            return nothing_retained(func)
        if func is Tensor.requires_grad_ and is_functorch_wrapped_tensor(args[0]):
            # a flag torch.func transforms track by themselves (and forbid setting): Hugging
            # Face's gradient_checkpointing_enable() sets it on the embeddings' output
            return args[0]
        if func is PACK_PADDED_SEQUENCE and under_vmap() and _lengths_vary(args, kwargs):
            raise RuntimeError(PACKED_UNDER_VMAP)
        if func in RECURRENT_OPS and is_packed(args, kwargs):
            return self._packed_recurrent(func, args, kwargs)
        if func in RECURRENT_OPS and self._decomposes_recurrent(args, kwargs):
            with self:
                return run_recurrent(func, args, kwargs)
        if func in ATTENTION_OPS and supports_attention(args, kwargs):
            with self:
                return run_attention(args, kwargs)
        if func in DECOMPOSED_OPS:
            with self:
                decomposed = DECOMPOSED_OPS[func](*args, **kwargs)
            if decomposed is not NotImplemented:
                return decomposed
        if func in LINEAR_CALLS:
            layer = self.rows.layer(func, args, kwargs, self._is_parameter)
            if layer is not None:  # a linear layer with its weight stored [in, out]
                out = self._dispatch(linear_in_out, layer, {})
                return self._flat_rows(out) if func is torch.addmm else out
        source = self.rows.row_wise_source(func, args, kwargs)
        if source is not None and any(map(self._is_parameter, (*args[1:], *kwargs.values()))):
            # a row-wise layer on flat rows: run on their source, whose dim 0 is the sample
            out = self._dispatch(func, (source, *args[1:]), kwargs)
            self.rows.rewritten.add(func)
            flat = self._flat_rows(out)
            self.rows.of[id(flat)] = (flat, out)
            return flat
        if func is F.batch_norm:  # (of parameters alone: weight standardization, no samples)
            alone = self._made_of_parameters(args[0] if args else kwargs.get("input"))
            args, kwargs = _batch_norm_arguments(args, kwargs, self.batch_statistics or alone)
        elif func is F.instance_norm and self.batch_statistics:  # (as BatchNorm: untouched)
            args, kwargs = without_running_updates(func, args, kwargs)
        if _counts_batches(func, args):
            # running statistics stay as they are, and so does their counter (also when
            # BatchNorm in training mode is refused right after: a refusal changes nothing);
            # it reads as counted (momentum=None divides by it: 1 / 0 for a fresh BatchNorm)
            counter = args[0]
            _, skipped = self._uncounted.get(id(counter), (counter, 0))
            step = args[1] if len(args) > 1 else kwargs.get("other", 1)
            self._uncounted[id(counter)] = (counter, skipped + int(step))
            return counter
        if func in COUNTER_READS and id(args[0]) in self._uncounted:
            counter, skipped = self._uncounted[id(args[0])]
            if counter is args[0]:
                return func(counter + skipped)
        out = self._dispatch(func, args, kwargs)
        if func is F.batch_norm:
            _contiguous_gradient(out)
        if func in RESHAPES:
            self.rows.remember(func, args, out)
        elif func in ELEMENTWISE:
            self.rows.carry(args, kwargs, out)
        return out

    def _flat_rows(self, out: Tensor) -> Tensor:
        """``out [N, …, d]`` as flat rows ``[N·…, d]``, made by a call of the mode's.

        Discovery then notes that they carry samples: made out of its sight, they would pass
        for a constant.
        """
        return cast(Tensor, self._dispatch(Tensor.reshape, (out, -1, out.shape[-1]), {}))

    def __enter__(self) -> FunctionalMode:
        """Enter the mode, with checkpoints plain and the caller's autocast on.

        See :mod:`packfunc.engine.checkpointing` and :mod:`packfunc.engine.precision`.
        """
        entered = contextlib.ExitStack()
        entered.enter_context(plain_checkpoints())
        entered.enter_context(forward_autocast())
        self._entered.append(entered)
        # TorchFunctionMode.__enter__ returns the mode itself
        return cast(FunctionalMode, super().__enter__())  # type: ignore[no-untyped-call]

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)  # type: ignore[no-untyped-call]
        self._entered.pop().__exit__(*exc)

    def _decomposes_recurrent(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether a recurrent op runs decomposed (always: ``vmap`` cannot batch the fused op)."""
        return True

    def _packed_recurrent(
        self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """A recurrent op on packed data, decomposed out of this mode's sight.

        The packed rows have no sample dim, and a sample steps as often as its length (the
        batch as often as its longest): the calls of the decomposition are no layer calls
        of the plan. Discovery sends the weights to the whole-model path. Outside
        ``torch.func`` transforms the fused kernel runs (its values are the user's forward's).
        """
        leaves: list[Any] = optree.tree_leaves((args, kwargs))  # type: ignore[arg-type]
        if not any(isinstance(t, Tensor) and is_functorch_wrapped_tensor(t) for t in leaves):
            return func(*args, **kwargs)
        return run_recurrent(func, args, kwargs)

    def _is_parameter(self, value: Any) -> bool:
        return self.leaf_of is not None and self.leaf_of(value) is not None

    def _made_of_parameters(self, value: Any) -> bool:
        """Whether ``value`` is a parameter or made of parameters alone (no sample in it)."""
        return False

    def _dispatch(
        self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Run a call that is neither decomposed nor refused: tapped ops go to :meth:`_tapped`."""
        sig = SIGNATURES.get(func)
        if sig is not None and self.leaf_of is not None:
            bound = sig.bind(args, kwargs)
            if any(self.leaf_of(bound.get(role)) is not None for role in ROLES):
                return self._tapped(func, sig, bound, partial(call_replacing, func, args, kwargs))
        return self._other(func, args, kwargs)

    def _tapped(
        self,
        func: Callable[..., Any],
        sig: OpSignature,
        bound: dict[str, Any],
        run: Callable[..., Tensor],
    ) -> Tensor:
        return run()

    def _other(
        self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        return func(*args, **kwargs)


def _batch_norm_arguments(
    args: tuple[Any, ...], kwargs: dict[str, Any], batch_statistics: bool
) -> tuple[tuple[Any, ...], dict[str, Any]]:
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
            "LayerNorm) before computing them; a BatchNorm built with "
            "track_running_stats=False uses batch statistics in evaluation mode too (build it "
            "with running statistics)."
        )
    return (), bound | {"running_mean": None, "running_var": None}


COUNTER_READS = frozenset({Tensor.__float__, Tensor.__int__, Tensor.item})
"""How Python reads a counter's value (``float(self.num_batches_tracked)``)."""


def _counts_batches(func: Callable[..., Any], args: tuple[Any, ...]) -> bool:
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


def _contiguous_gradient(out: Any) -> None:
    """Hand a batch norm's backward a contiguous gradient of its output.

    torch 2.13's CPU kernel reads a one-sample gradient laid out otherwise (a transposed
    cotangent: channels-last strides) wrongly: packfunc's passes, whose cotangents take
    other layouts than your backward's, got wrong weight and bias gradients and wrong
    cotangents for the layers before it (off by 0.03 of 0.003).
    """
    if isinstance(out, Tensor) and out.requires_grad and not is_functorch_wrapped_tensor(out):
        out.register_hook(lambda gradient: gradient.contiguous())


def functional_mode(batch_statistics: bool = False) -> TorchFunctionMode:
    """Return the mode that runs models for the whole-model, vmap-based path.

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


def twice_differentiable() -> contextlib.AbstractContextManager[None]:
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


def dropout_rate(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> float:
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


def call_replacing(
    func: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    old: Any = None,
    new: Any = None,
) -> Tensor:
    """``func(*args, **kwargs)``, with the argument that is ``old`` (by identity) set to ``new``."""
    if old is None:
        return cast(Tensor, func(*args, **kwargs))
    args = tuple(new if a is old else a for a in args)
    kwargs = {key: new if v is old else v for key, v in kwargs.items()}
    return cast(Tensor, func(*args, **kwargs))


class ParameterMode(FunctionalMode):
    """Follows parameters through a forward pass: leaves, and tensors derived from them only."""

    leaf_of: LeafIndex

    def __init__(self, leaf_of: LeafIndex):
        super().__init__()
        self.leaf_of = leaf_of
        self.derived: Derived = {}  # id -> (tensor kept alive, how)
        self.uses_seen = 0

    def _sources(self, values: tuple[Any, ...]) -> dict[int, Source] | None:
        """Flat position -> leaf or derivation of every parameter argument (``None``: ambiguous)."""
        return parameter_sources(values, self.leaf_of, self.derived)

    def _decomposes_recurrent(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Only when its weights are requested: a frozen RNN runs fused, at a plain RNN's cost.

        (The batch pass differentiates it with autograd or ``torch.func.vjp``, which both
        handle the fused op; only ``vmap`` over samples needs the decomposition.)
        """
        return self._touches_parameters(args, kwargs)

    def _made_of_parameters(self, value: Any) -> bool:
        found = self.derived.get(id(value))
        return self.leaf_of(value) is not None or (found is not None and found[0] is value)

    def _touches_parameters(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """A cheap test whether any argument (or list item) is a parameter or derived from one."""
        for value in (*args, *kwargs.values()):
            items = value if isinstance(value, (list, tuple)) else (value,)
            for item in items:
                if isinstance(item, Tensor) and (
                    self.leaf_of.contains(item) or id(item) in self.derived
                ):
                    return True
        return False

    def _derive(
        self,
        func: Callable[..., Any],
        arguments: CallArguments,
        sources: dict[int, Source],
        out: Any,
    ) -> None:
        """Remember the outputs of a call on parameters only as derivations."""
        outputs = tensor_outputs(out)
        remember_derivations(self.derived, func, arguments, sources, outputs, self._constant())

    def _constant(self) -> bool:
        """Whether a derivation made now is a constant to differentiation (see subclasses)."""
        return False


Derived = dict[int, tuple[Tensor, Derivation]]
"""Tensors made of parameters only, by ``id``: the tensor (kept alive) and how it is made."""


def parameter_sources(
    values: tuple[Any, ...], leaf_of: LeafIndex, derived: Derived
) -> dict[int, Source] | None:
    """Flat position -> leaf or derivation of every parameter argument of a call.

    Args:
        values: The call's flattened arguments.
        leaf_of: The parameter leaves.
        derived: The derivations seen so far.

    Returns:
        The sources, or ``None`` if an argument is a tensor that stands at two places of
        the parameter pytree (it cannot be attributed to one leaf).
    """
    sources: dict[int, Source] = {}
    for position, value in enumerate(values):
        if not isinstance(value, Tensor):
            continue
        leaf = leaf_of(value)
        if leaf is not None:
            sources[position] = leaf
        elif leaf_of.contains(value):
            return None  # one tensor at two places of the pytree
        else:
            found = derived.get(id(value))
            if found is not None and found[0] is value:
                sources[position] = found[1]
    return sources


def tensor_outputs(out: Any) -> list[tuple[int | None, Tensor]]:
    """A call's tensor outputs with their position (``None``: the output is one tensor)."""
    if isinstance(out, Tensor):
        return [(None, out)]
    if not isinstance(out, (list, tuple)):
        return []  # e.g. param.item(): a Python number, detached like in autograd
    return [(i, t) for i, t in enumerate(out) if isinstance(t, Tensor)]


def remember_derivations(
    derived: Derived,
    func: Callable[..., Any],
    arguments: CallArguments,
    sources: dict[int, Source],
    outputs: list[tuple[int | None, Tensor]],
    constant: bool = False,
) -> None:
    """Record the outputs of a call on parameters only as derivations.

    Args:
        derived: Where derivations are kept (updated).
        func: The op.
        arguments: Its flattened arguments.
        sources: Its parameter arguments (see :func:`parameter_sources`).
        outputs: Its tensor outputs (see :func:`tensor_outputs`).
        constant: Whether the model made them under ``torch.no_grad()``.
    """
    first = outputs[0][1] if outputs else None
    broadcast = copies_along_batch(func, arguments, first)
    for index, tensor in outputs:
        copies = copy_dims(func, arguments, sources, tensor)
        derivation = derive(func, arguments, sources, index, broadcast, constant, copies)
        derived[id(tensor)] = (tensor, derivation)


def leaves_of(sources: dict[int, Source]) -> set[int]:
    """Every leaf the parameter arguments depend on."""
    return {
        leaf
        for source in sources.values()
        for leaf in ((source,) if isinstance(source, int) else source.leaves)
    }
