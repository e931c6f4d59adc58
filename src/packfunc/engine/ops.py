"""The op table: every torch function packfunc classifies, and the ops it taps.

The tables say what a function does to a tensor (re-lays it out, acts elementwise,
is piecewise linear, ...); the recursions over chains of ops (``engine/kfra.py``,
``engine/pch.py``, ``engine/hessian_recursion.py``), discovery and the modes read
them. A *tapped* op (:data:`SIGNATURES`) is linear in its weight: ``z = op(x, W) + b``.
Knowing its input ``x`` and the cotangent ``g`` of its output per sample is enough to
get every per-sample gradient of ``W`` and ``b`` in closed form (see ``rules/``); its
:class:`OpSignature` says how to read its arguments and what kind of layer it is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch._C._functorch import is_functorch_wrapped_tensor


class LayerKind(Enum):
    """The kind of layer a tapped op is; the rules (``engine/rules/``) are registered by it."""

    LINEAR = "linear"
    """``F.linear`` and :func:`linear_in_out`: ``z = x Wᵀ + b`` over the last dim."""

    CONVOLUTION = "convolution"
    """``torch.convNd`` and ``torch.conv_transposeNd`` (1d, 2d, 3d)."""

    EMBEDDING = "embedding"
    """``F.embedding``: row ``idx`` of the weight for every index ``idx``."""


def linear_in_out(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``input @ weight + bias``: a linear layer whose weight is stored ``[in, out]``.

    Hugging Face's ``Conv1D`` (GPT-2) computes ``torch.addmm(b, x.view(-1, d), W)`` on the
    rows of ``x``; packfunc's modes run such calls as this op on ``x`` itself, whose
    leading dim is the sample, with the same arithmetic (one ``addmm``).

    Args:
        input: ``[N, ..., in]``.
        weight: ``[in, out]``.
        bias: ``[out]`` or ``None``.

    Returns:
        ``[N, ..., out]``.

    Example:
        >>> linear_in_out(torch.ones(2, 3, 4), torch.ones(4, 5), torch.zeros(5)).shape
        torch.Size([2, 3, 5])
    """
    rows = input.reshape(-1, input.shape[-1])
    out = rows @ weight if bias is None else torch.addmm(bias, rows, weight)
    return out.view(*input.shape[:-1], weight.shape[-1])


RESHAPES = frozenset({Tensor.view, Tensor.reshape, torch.reshape, Tensor.flatten, torch.flatten})
"""Ops that keep the row-major order of a tensor's entries and only change its shape.

A chain's curvature ``H`` passes them unchanged; a mode remembers those that lay the
rows of a tensor out flat (``x.view(-1, d)``, see :class:`FlatRows`)."""

ROW_WISE = frozenset({F.linear, F.layer_norm})
"""Calls that act on each row (last dim) alone: on flat rows ``[N·T, d]`` a mode runs them on
the rows' source ``[N, T, d]`` (OPT's feed-forward block flattens its tokens)."""

ELEMENTWISE = frozenset(
    {
        F.relu,
        torch.relu,
        Tensor.relu,
        F.gelu,
        F.silu,
        torch.tanh,
        Tensor.tanh,
        torch.sigmoid,
        Tensor.sigmoid,
        F.dropout,
        torch.add,
        torch.mul,
        Tensor.__add__,
        Tensor.__radd__,
        Tensor.__mul__,
        Tensor.__rmul__,
        Tensor.__sub__,
        Tensor.__truediv__,
    }
)
"""Calls that keep each entry's row: flat rows in, the same rows out (:meth:`FlatRows.carry`)."""

MATMULS = frozenset({torch.matmul, Tensor.matmul, Tensor.__matmul__})
"""``x @ W``: a linear layer where ``W`` is a matrix parameter."""

LINEAR_CALLS = MATMULS | {torch.addmm}
"""Calls that may be a linear layer with its weight stored ``[in, out]`` (see :class:`FlatRows`)."""


ELEMENTWISE = frozenset(
    {
        torch.relu,
        F.relu,
        torch.tanh,
        torch.sigmoid,
        F.elu,
        F.leaky_relu,
        F.gelu,
        F.silu,
        F.softplus,
        F.selu,
        F.celu,
        F.hardtanh,
        F.relu6,
        F.logsigmoid,
        F.hardswish,
        F.mish,
        torch.exp,
        Tensor.relu,
        Tensor.tanh,
        Tensor.sigmoid,
        F.dropout,
    }
)
"""Ops known to act elementwise: their Jacobian is diagonal."""

PIECEWISE_LINEAR = frozenset(
    {
        F.max_pool1d,
        F.max_pool2d,
        F.max_pool3d,
        F.adaptive_max_pool1d,
        F.adaptive_max_pool2d,
        F.adaptive_max_pool3d,
        F.avg_pool1d,
        F.avg_pool2d,
        F.avg_pool3d,
        F.adaptive_avg_pool1d,
        F.adaptive_avg_pool2d,
        F.adaptive_avg_pool3d,
        F.pad,
        F.dropout,
    }
)
"""Ops whose second derivative vanishes almost everywhere: no curvature of their own."""

SAMPLE_INDEPENDENT = frozenset(
    {
        F.avg_pool1d,
        F.avg_pool2d,
        F.avg_pool3d,
        F.adaptive_avg_pool1d,
        F.adaptive_avg_pool2d,
        F.adaptive_avg_pool3d,
        F.pad,
    }
)
"""Affine ops whose Jacobian is the same at every sample: one sandwich serves the batch."""

BROADCASTS = frozenset({Tensor.expand, Tensor.expand_as, torch.broadcast_to, Tensor.repeat})
"""Ops that copy a tensor along a dim of size one (e.g. a class token over the batch)."""

CONVERSIONS = frozenset(
    {
        Tensor.to,
        Tensor.type,
        Tensor.type_as,
        Tensor.contiguous,
        Tensor.cpu,
        Tensor.cuda,
        Tensor.float,
        Tensor.double,
        Tensor.half,
        Tensor.bfloat16,
    }
)
"""Calls that return their input itself when it already has the dtype, device or layout."""

SIZED_BY_ARGUMENTS = frozenset(
    {
        Tensor.expand,
        Tensor.repeat,
        Tensor.view,
        Tensor.reshape,
        torch.reshape,
        Tensor.new_zeros,
        Tensor.new_ones,
        Tensor.new_full,
        Tensor.new_empty,
        Tensor.new_tensor,
        Tensor.tile,
        torch.tile,
        torch.broadcast_to,
        Tensor.unflatten,
        torch.unflatten,
        torch.cat,
        torch.concat,
        torch.stack,
        Tensor.repeat_interleave,
        torch.repeat_interleave,
    }
)
"""Calls whose output shape may come from Python ints, such as the batch size (``cat`` and
``stack`` of a list as long as the batch)."""


class FlatRows:
    """Recognizes linear layers whose weight is stored ``[in, out]``: ``x @ W`` and ``addmm``.

    A hand-written ``x @ W`` (``W`` a matrix parameter, ``x`` at least 2-D) is
    :func:`linear_in_out` of ``x`` without bias. Hugging Face's ``Conv1D`` computes
    ``torch.addmm(b, x.view(-1, d), W)``: a mode remembers each reshape's output that lays
    out the rows of ``x`` (``[N·…, d]``: each sample's rows together, in order), and such an
    ``addmm`` is then :func:`linear_in_out` of ``x``.

    Example:
        >>> rows, x = FlatRows(), torch.ones(2, 3, 4)
        >>> flat = x.view(-1, 4)
        >>> rows.remember(torch.Tensor.view, (x, -1, 4), flat)
        >>> w, b = torch.ones(4, 5), torch.zeros(5)
        >>> rows.layer(torch.addmm, (b, flat, w), {}, lambda v: v is w)[0] is x
        True
        >>> rows.layer(torch.matmul, (x, w), {}, lambda v: v is w)[2] is None
        True
    """

    def __init__(self) -> None:
        self.of: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.rewritten: set[Callable[..., Any]] = set()  # row-wise calls run on a source

    def remember(self, func: Callable[..., Any], args: tuple[Any, ...], out: Any) -> None:
        """Note ``out`` if a reshape made it of the rows of its input ``x`` (``x.dim() >= 2``).

        Args:
            func: The function called.
            args: Its positional arguments (``x`` first).
            out: Its output.
        """
        if func not in RESHAPES or not args:
            return
        x = args[0]
        if not (isinstance(x, torch.Tensor) and isinstance(out, torch.Tensor) and x.dim() >= 2):
            return
        if out.shape == (x.shape[:-1].numel(), x.shape[-1]):
            self.of[id(out)] = (out, x)

    def layer(
        self,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        is_parameter: Callable[[Any], bool],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """The arguments ``(x, weight, bias)`` of :func:`linear_in_out` a call amounts to.

        Args:
            func: The function called (one of :data:`LINEAR_CALLS` to be a layer).
            args: Its positional arguments.
            kwargs: Its keyword arguments.
            is_parameter: Whether a value is a parameter.

        Returns:
            The layer's arguments, or ``None``: another call, ``x @ W`` whose ``W`` is no
            matrix parameter, or an ``addmm`` (of remembered rows, or of its matrix as it
            is, as ``x @ W`` takes it) not a plain product
            (``beta = alpha = 1``), with no parameter as weight or bias, or no vector bias.
        """
        if func in MATMULS:
            return _matmul_layer(args, kwargs, is_parameter)
        if func is not torch.addmm:
            return None
        bound = dict(zip(("input", "mat1", "mat2", "beta", "alpha"), args)) | kwargs
        rows, weight, bias = bound.get("mat1"), bound.get("mat2"), bound.get("input")
        if not isinstance(rows, torch.Tensor):
            return None
        source = self.source(rows)  # else addmm(b, x, W) of a batch [N, in] as it is
        x = rows if source is None else source
        if bound.get("beta", 1) != 1 or bound.get("alpha", 1) != 1:
            return None
        if not (is_parameter(weight) or is_parameter(bias)):
            return None
        if not (isinstance(bias, torch.Tensor) and bias.dim() == 1):
            return None
        assert isinstance(weight, torch.Tensor)
        return x, weight, bias

    def source(self, rows: torch.Tensor) -> torch.Tensor | None:
        """The remembered tensor whose rows ``rows`` lays out flat, or ``None``."""
        found = self.of.get(id(rows))
        return found[1] if found is not None and found[0] is rows else None

    def row_wise_source(
        self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> torch.Tensor | None:
        """The source of the flat rows a :data:`ROW_WISE` call takes, where it acts on rows alone.

        ``F.layer_norm`` does over a normalized shape of the last dim alone.

        Example:
            >>> rows, x = FlatRows(), torch.ones(2, 3, 4)
            >>> flat = x.view(-1, 4)
            >>> rows.remember(torch.Tensor.view, (x, -1, 4), flat)
            >>> rows.row_wise_source(F.layer_norm, (flat, (4,)), {}) is x
            True
        """
        if func not in ROW_WISE or not args or not isinstance(args[0], torch.Tensor):
            return None
        if func is F.layer_norm:
            shape = args[1] if len(args) > 1 else kwargs.get("normalized_shape")
            if not isinstance(shape, (list, tuple, torch.Size)) or len(shape) != 1:
                return None
        return self.source(args[0])

    def carry(self, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """Note ``out`` as flat rows if an :data:`ELEMENTWISE` call kept remembered rows.

        Every tensor argument must be flat rows of one source shape, or broadcast along the
        rows (a scalar, a vector of the last dim): then each entry of ``out`` lies in the row
        of its inputs' entries.

        Example:
            >>> rows, x = FlatRows(), torch.ones(2, 3, 4)
            >>> flat = x.view(-1, 4)
            >>> rows.remember(torch.Tensor.view, (x, -1, 4), flat)
            >>> out = torch.relu(flat)
            >>> rows.carry((flat,), {}, out)
            >>> rows.source(out).shape
            torch.Size([2, 3, 4])
        """
        if not isinstance(out, torch.Tensor) or out.dim() != 2 or kwargs.get("out") is not None:
            return
        shape = None
        for value in (*args, *kwargs.values()):
            if not isinstance(value, torch.Tensor) or value.dim() <= 1:
                continue
            source = self.source(value)
            if source is None or value.shape != out.shape:
                return
            if shape is not None and source.shape != shape:
                return
            shape = source.shape
        if shape is not None:
            self.of[id(out)] = (out, out.view(*shape[:-1], out.shape[-1]))


class RowsInMemory(FlatRows):
    """:class:`FlatRows` for calls seen without the reshape before them (tapped leaves).

    The rows' source is read off their memory: ``rows [R, d]`` a contiguous view that
    starts where its base starts and covers all of it, a base whose leading dim (the
    samples) is the source's and the outermost in memory (each sample a block of its own,
    as in ``attention.transpose(1, 2)`` laid out ``[N, T, H, d]``). Each sample's rows then
    lie together, in order, and
    ``rows.view(*leading, d)`` is the source with the leading dims the plan recorded for
    the call (``leading``; ``None``: the samples and one dim of positions). The plan says
    whether the call was such a layer; a call that differs from it stops the pass.

    Example:
        >>> x = torch.ones(2, 3, 4)
        >>> RowsInMemory((2, 3)).source(x.view(-1, 4)).shape, RowsInMemory(None).source(x[0])
        (torch.Size([2, 3, 4]), None)
    """

    def __init__(self, leading: tuple[int, ...] | None) -> None:
        super().__init__()
        self.leading = leading

    def source(self, rows: torch.Tensor) -> torch.Tensor | None:
        """``rows`` viewed as the tensor whose rows they lay out flat, if their memory says so."""
        base = rows._base
        if base is None or base.dim() < 2 or rows.dim() != 2:
            return None
        if is_functorch_wrapped_tensor(rows) or is_functorch_wrapped_tensor(base):
            return None
        if not (rows.is_contiguous() and base.numel() == rows.numel() and _samples_outermost(base)):
            return None
        if rows.data_ptr() != base.data_ptr():
            return None
        leading = self.leading or (base.shape[0], -1)
        if leading[0] != base.shape[0]:
            return None
        try:
            return rows.view(*leading, rows.shape[-1])
        except RuntimeError:  # another count of rows than the plan's
            return None


def _samples_outermost(t: torch.Tensor) -> bool:
    """Whether ``t`` fills its memory without gaps or overlaps, dim 0 the outermost.

    Example:
        >>> x = torch.ones(2, 3, 4)
        >>> _samples_outermost(x.transpose(1, 2)), _samples_outermost(x.transpose(0, 1))
        (True, False)
    """
    size = 1
    for stride, length in sorted((st, n) for st, n in zip(t.stride(), t.shape) if n != 1):
        if stride != size:
            return False
        size *= length
    return t.shape[0] == 1 or t.stride(0) * t.shape[0] == size


def _matmul_layer(
    args: tuple[Any, ...], kwargs: dict[str, Any], is_parameter: Callable[[Any], bool]
) -> tuple[torch.Tensor, torch.Tensor, None] | None:
    """``(x, W, None)`` of ``x @ W`` with ``W`` a matrix parameter and ``x`` at least 2-D."""
    if kwargs or len(args) != 2:
        return None
    x, weight = args
    if not (isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor)):
        return None
    if not is_parameter(weight) or weight.dim() != 2 or x.dim() < 2:
        return None
    return x, weight, None


@dataclass(frozen=True)
class OpSignature:
    """A tapped op: its kind of layer, its positional arguments with defaults, its name.

    Attributes:
        kind: The kind of layer (the rules are registered by it).
        display_name: How :func:`packfunc.explain` names the op.
        names: Positional argument names.
        defaults: Defaults of the last ``len(defaults)`` names.
        transposed: A transposed convolution, or a linear weight stored ``[in, out]``.
        check: Raises for arguments whose per-sample gradients are not defined or that a
            pure function cannot honour (``None``: any arguments are fine).
    """

    kind: LayerKind
    display_name: str
    names: tuple[str, ...]
    defaults: tuple[Any, ...]
    transposed: bool = False
    check: Callable[[dict[str, Any]], None] | None = None

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """Map a call's positional and keyword arguments to argument names.

        Args:
            args: Positional arguments of the call.
            kwargs: Keyword arguments of the call.

        Returns:
            A dict from every argument name to its value (defaults filled in).

        Example:
            >>> SIGNATURES[F.linear].bind((1, 2), {})["bias"] is None
            True
        """
        required = len(self.names) - len(self.defaults)
        bound = dict(zip(self.names[required:], self.defaults))
        bound.update(zip(self.names, args))
        bound.update(kwargs)
        return bound

    def check_arguments(self, bound: dict[str, Any]) -> None:
        """Refuse a call whose arguments packfunc cannot differentiate per sample.

        Args:
            bound: The call's bound arguments (see :meth:`bind`).

        Raises:
            ValueError: naming the argument and what to do instead.
        """
        if self.check is not None:
            self.check(bound)

    @property
    def is_convolution(self) -> bool:
        """Whether the op is a convolution or a transposed one.

        ``vmap``'s batching rules for its backward copy the activations: the batch pass
        pulls a few cotangent columns back one at a time instead (``engine/batch_pass.py``).

        Example:
            >>> SIGNATURES[torch.conv2d].is_convolution, SIGNATURES[F.linear].is_convolution
            (True, False)
        """
        return self.kind is LayerKind.CONVOLUTION

    @property
    def channels_first(self) -> bool:
        """Whether the output's channels are dim 1 (``[N, C, *S]``) rather than the last.

        Example:
            >>> SIGNATURES[torch.conv1d].channels_first, SIGNATURES[F.embedding].channels_first
            (True, False)
        """
        return self.kind is LayerKind.CONVOLUTION

    @property
    def input_jacobian_is_weight(self) -> bool:
        """Whether the Jacobian w.r.t. the input is the weight ``[out, in]`` at every position.

        ``F.linear``: ``z = x Wᵀ + b`` along the last dim, the weight stored ``[out, in]``.

        Example:
            >>> [SIGNATURES[f].input_jacobian_is_weight for f in (F.linear, linear_in_out)]
            [True, False]
        """
        return self.kind is LayerKind.LINEAR and not self.transposed


def refuse_coupled_embedding(bound: dict[str, Any]) -> None:
    """Refuse ``max_norm`` (renormalizes in place) and ``scale_grad_by_freq`` (couples samples).

    Args:
        bound: An ``F.embedding`` call's bound arguments.

    Raises:
        ValueError: where either is set.

    Example:
        >>> refuse_coupled_embedding({"max_norm": None, "scale_grad_by_freq": False})
    """
    refuse_renormalizing("Embedding", bound["max_norm"])
    refuse_frequency_scaling("Embedding", bound["scale_grad_by_freq"])


def refuse_renormalizing(layer: str, max_norm: float | None) -> None:
    """Refuse ``max_norm`` of an embedding layer: it renormalizes the weight in place.

    Args:
        layer: ``"Embedding"`` or ``"EmbeddingBag"``, for the message.
        max_norm: The call's option.

    Raises:
        ValueError: where it is set.

    Example:
        >>> refuse_renormalizing("EmbeddingBag", None)
    """
    if max_norm is not None:
        raise ValueError(
            f"{layer}(max_norm=...) renormalizes the weight in place during the forward pass, "
            "which a pure function cannot do; drop max_norm or renormalize the weight yourself."
        )


def refuse_frequency_scaling(layer: str, scale_grad_by_freq: bool) -> None:
    """Refuse ``scale_grad_by_freq=True`` of an embedding layer: it couples samples.

    Args:
        layer: ``"Embedding"`` or ``"EmbeddingBag"``, for the message.
        scale_grad_by_freq: The call's option.

    Raises:
        ValueError: where it is set.

    Example:
        >>> refuse_frequency_scaling("EmbeddingBag", False)
    """
    if scale_grad_by_freq:
        raise ValueError(
            f"{layer}(scale_grad_by_freq=True) scales gradients by word counts over the whole "
            "batch, which couples samples; per-sample gradients are not defined. Set it to False."
        )


def bag_option(args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> Any:
    """An option of a call ``F.embedding_bag(input, weight, offsets, max_norm, ...)``.

    Example:
        >>> bag_option((torch.ones(2), torch.ones(3, 2), None, 1.0), {}, "max_norm")
        1.0
    """
    index = _BAG_OPTIONS.index(name)
    return args[index] if len(args) > index else kwargs.get(name, _BAG_DEFAULTS.get(name))


_BAG_OPTIONS = ("input", "weight", "offsets", "max_norm", "norm_type", "scale_grad_by_freq")
"""``F.embedding_bag``'s first arguments, in order."""

_BAG_DEFAULTS = {"scale_grad_by_freq": False}
"""Those defaults that are not ``None``."""


_LINEAR = ("input", "weight", "bias")
_CONV = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_CONV_T = ("input", "weight", "bias", "stride", "padding", "output_padding", "groups", "dilation")
_EMBEDDING = (
    "input",
    "weight",
    "padding_idx",
    "max_norm",
    "norm_type",
    "scale_grad_by_freq",
    "sparse",
)

SIGNATURES: dict[Callable[..., Any], OpSignature] = {
    F.linear: OpSignature(LayerKind.LINEAR, "F.linear", _LINEAR, (None,)),
    linear_in_out: OpSignature(LayerKind.LINEAR, "x @ W", _LINEAR, (None,), transposed=True),
    **{
        conv: OpSignature(LayerKind.CONVOLUTION, "convolution", _CONV, (None, 1, 0, 1, 1))
        for conv in (torch.conv1d, torch.conv2d, torch.conv3d)
    },
    **{
        conv: OpSignature(
            LayerKind.CONVOLUTION, "convolution", _CONV_T, (None, 1, 0, 0, 1, 1), transposed=True
        )
        for conv in (torch.conv_transpose1d, torch.conv_transpose2d, torch.conv_transpose3d)
    },
    F.embedding: OpSignature(
        LayerKind.EMBEDDING,
        "F.embedding",
        _EMBEDDING,
        (None, None, 2.0, False, False),
        check=refuse_coupled_embedding,
    ),
}
"""Every tapped function, keyed by the object ``__torch_function__`` receives."""

ROLES = ("weight", "bias")
"""The arguments of a tapped op that can be parameters handled by a rule."""

LOCAL_ROLE = "local"
"""The role of every parameter of a local call (:meth:`SiteCall.local`)."""


@dataclass(frozen=True)
class SiteCall:
    """The call of a site: a tapped op, or a local call (any other op consuming parameters).

    Discovery classifies calls (see :mod:`packfunc.engine.discovery`): a tapped op takes
    parameter leaves as weight or bias and has closed forms; a local call is any other op
    that meets the samples, differentiated on its own (``engine/rules/local.py``).

    Attributes:
        op: The tapped op's signature, or ``None`` for a local call.
        leaves: Leaf index per role that is a parameter: ``"weight"``, ``"bias"`` of a
            tapped op; :data:`LOCAL_ROLE` for every leaf of a local call.
        options: A tapped op's remaining arguments (stride, padding, ...), by name; a
            local call's function as ``"func"``.
    """

    op: OpSignature | None
    leaves: tuple[tuple[str, int], ...]
    options: tuple[tuple[str, Any], ...]

    @classmethod
    def local(cls, func: Callable[..., Any], leaves: Iterable[int]) -> SiteCall:
        """The call of a local site: ``func`` consumes the given leaves.

        Example:
            >>> SiteCall.local(torch.mul, [2]).leaves
            (('local', 2),)
        """
        return cls(None, tuple((LOCAL_ROLE, leaf) for leaf in leaves), (("func", func),))

    @property
    def is_local(self) -> bool:
        """Whether this is a local call (no tapped op)."""
        return self.op is None

    @property
    def transposed(self) -> bool:
        """Whether a convolution is transposed, or a linear weight is stored ``[in, out]``.

        See :func:`linear_in_out`; a local call is not.
        """
        return self.op is not None and self.op.transposed

    @property
    def is_transposed_convolution(self) -> bool:
        """Whether the call is a transposed convolution (``conv_transposeNd``).

        Example:
            >>> [SiteCall(SIGNATURES[op], (), ()).is_transposed_convolution
            ...  for op in (F.conv_transpose1d, linear_in_out, F.linear)]
            [True, False, False]
        """
        return self.transposed and self.op is not None and self.op.is_convolution

    @property
    def stores_weight_in_out(self) -> bool:
        """Whether the call is a linear layer whose weight is stored ``[in, out]`` (``x @ W``).

        Example:
            >>> [SiteCall(SIGNATURES[op], (), ()).stores_weight_in_out
            ...  for op in (F.conv_transpose1d, linear_in_out, F.linear)]
            [False, True, False]
        """
        return self.transposed and self.op is not None and not self.op.is_convolution

    @property
    def name(self) -> str:
        """A readable name of the op: the tapped op's display name, or the local function's.

        Example:
            >>> SiteCall(SIGNATURES[linear_in_out], (), ()).name, SiteCall.local(torch.mul, []).name
            ('x @ W', 'mul')
        """
        if self.op is not None:
            return self.op.display_name
        func = self.option("func")
        return str(getattr(func, "__name__", repr(func)))

    def option(self, name: str) -> Any:
        """Return the op argument ``name`` of this call.

        Args:
            name: An argument name such as ``"stride"``.

        Returns:
            Its value in this call.

        Example:
            >>> SiteCall(SIGNATURES[torch.conv1d], (), (("stride", 2),)).option("stride")
            2
        """
        return dict(self.options)[name]

    def has_options_of(self, bound: dict[str, Any]) -> bool:
        """Whether a call's bound arguments have this call's options (tensors aside).

        A cached plan's closed forms read the options (a convolution's padding and
        dilation): a later call with other options and the same output shape must not
        take them. Tensor options (a BatchNorm's running statistics) are the model's
        buffers, swapped from call to call; they are not compared.

        Args:
            bound: The later call's bound arguments (see :meth:`OpSignature.bind`).

        Returns:
            Whether every non-tensor option is equal.

        Example:
            >>> call = SiteCall(SIGNATURES[torch.conv1d], (), (("stride", 2),))
            >>> call.has_options_of({"stride": 2}), call.has_options_of({"stride": 1})
            (True, False)
        """
        return all(
            isinstance(value, Tensor) or _same_option(bound.get(name), value)
            for name, value in self.options
        )


def _same_option(a: Any, b: Any) -> bool:
    """``a == b`` for option values (ints, tuples, strings, floats), ``False`` if undecidable.

    Example:
        >>> _same_option((1, 1), (1, 1)), _same_option(1, (1,)), _same_option("same", 1)
        (True, False, False)
    """
    try:
        return type(a) is type(b) and bool(a == b)
    except (TypeError, RuntimeError, ValueError):
        return False


def make_call(
    sig: OpSignature, bound: dict[str, Any], leaf_of: Callable[[Any], int | None]
) -> SiteCall:
    """Describe a tapped call by its signature, parameter leaves and options.

    Args:
        sig: The op's signature.
        bound: Its bound arguments (see :meth:`OpSignature.bind`).
        leaf_of: Maps a value to its parameter leaf index, or ``None``.

    Returns:
        The :class:`SiteCall`.

    Example:
        >>> sig = SIGNATURES[F.linear]
        >>> make_call(sig, sig.bind((0, 1), {}), lambda v: v).leaves
        (('weight', 1),)
    """
    options = tuple((k, v) for k, v in bound.items() if k not in ("input", *ROLES))
    return SiteCall(sig, tapped_leaves(bound, leaf_of), options)


def tapped_leaves(
    bound: dict[str, Any], leaf_of: Callable[[Any], int | None]
) -> tuple[tuple[str, int], ...]:
    """The parameter leaf of each role (weight, bias) of a tapped call that has one.

    Args:
        bound: The call's bound arguments (see :meth:`OpSignature.bind`).
        leaf_of: Maps a value to its parameter leaf index, or ``None``.

    Returns:
        ``((role, leaf), ...)``, as in :attr:`SiteCall.leaves`.

    Example:
        >>> tapped_leaves({"weight": 3, "bias": None}, lambda v: v)
        (('weight', 3),)
    """
    return tuple((role, leaf) for role in ROLES if (leaf := leaf_of(bound.get(role))) is not None)


def out_of_place_name(func: Callable[..., Any]) -> str:
    """A function's name without the trailing ``_`` of an in-place method (``flip_``).

    Example:
        >>> out_of_place_name(Tensor.index_add_), out_of_place_name(Tensor.__setitem__)
        ('index_add', '__setitem__')
    """
    name: str = getattr(func, "__name__", "")
    return name[:-1] if name.endswith("_") and not name.endswith("__") else name


def moved_dims(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[tuple[int, Any]]:
    """The dims of its first argument along which a call moves, picks or writes elements.

    The batch pass takes row ``n`` of a layer's input as sample ``n``'s: a model that runs a
    layer on its batch reordered (``h[h[:, 0].argsort()]``, ``h.flip(0)``, a mixture of
    experts' ``index_select`` of its tokens and ``index_add`` back; along dim 1 of a
    sequence-first ``[T, N, d]`` tensor) would have each row's results given to another
    sample, although every output row is its own sample's. Which of these dims carries the
    batch is the caller's to tell.

    Args:
        func: The function called (a ``torch`` function or a ``Tensor`` method).
        args: Its positional arguments (``self`` first).
        kwargs: Its keyword arguments.

    Returns:
        ``(dim, index)`` for each dim the call indexes, sorts, flips, rolls, gathers or
        scatters along: ``index`` is what picks there (a tensor, list, array or slice of
        ``h[...]``, the index of ``index_select``/``gather``), ``None`` where nothing does.

    Example:
        >>> h, i = torch.ones(4, 3), torch.tensor([1, 0])
        >>> moved_dims(Tensor.__getitem__, (h, i), {})[0][0]
        0
        >>> moved_dims(Tensor.__getitem__, (h, (slice(None), i)), {})[0][0]
        1
        >>> moved_dims(torch.flip, (h, [1]), {})
        [(1, None)]
    """
    name = out_of_place_name(func)
    first = args[0] if args else kwargs.get("input")
    if not isinstance(first, Tensor) or first.dim() == 0:
        return []
    every_dim: list[tuple[int, Any]] = [(dim, None) for dim in range(first.dim())]
    if name in ("__getitem__", "__setitem__"):
        return _indexed_dims(args[1], first.dim()) if len(args) > 1 else []
    if name == "index_put":
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return [(dim, index) for dim, index in enumerate(indices) if index is not None]
    if name in _ALWAYS_MOVES_ROWS:
        return [(0, None)] if name in ("flipud", "msort", "__reversed__") else every_dim
    if name == "fliplr":
        return [(1, None)]
    if name == "hsplit":
        return [(1 if first.dim() > 1 else 0, None)]
    where = _ROW_DIM_ARGUMENT.get(name)
    if where is None:
        return []
    position, keyword, default = where
    dims = args[position] if len(args) > position else kwargs.get(keyword, default)
    if dims is None:  # flattened (roll, take_along_dim without a dim)
        return every_dim
    index = None
    if name in ("index_select", "gather", "select"):
        index = args[2] if len(args) > 2 else kwargs.get("index")
    dims = [dims] if isinstance(dims, int) else list(dims)
    return [(dim % first.dim(), index) for dim in dims]


def writes_rows(func: Callable[..., Any]) -> bool:
    """Whether a call writes its other arguments' entries into its first by position.

    ``buf[idx] = h``, ``index_add``, ``index_copy``, ``scatter`` and kin move the rows they
    write wherever the tensor written into comes from; a reading call (``h[idx]``) moves
    the rows of its first argument only.

    Example:
        >>> writes_rows(Tensor.index_add), writes_rows(Tensor.__getitem__)
        (True, False)
    """
    return out_of_place_name(func) in _WRITES_ROWS


_WRITES_ROWS = frozenset(
    {
        "__setitem__",
        "index_put",
        "index_copy",
        "index_add",
        "index_reduce",
        "index_fill",
        "scatter",
        "scatter_add",
        "scatter_reduce",
        "masked_scatter",
    }
)


def _indexed_dims(index: Any, dims: int) -> list[tuple[int, Any]]:
    """The dims an index of ``x[index]`` picks positions along, with its entry there.

    ``None`` adds a dim, an ``Ellipsis`` stands for the dims no entry names, an integer
    picks one position, a boolean mask takes as many dims as it has (see :func:`_selects`).
    """
    entries = list(index) if isinstance(index, tuple) else [index]
    taken = [_dims_taken(entry) for entry in entries]
    picked: list[tuple[int, Any]] = []
    dim = 0
    for entry, count in zip(entries, taken, strict=True):
        if entry is Ellipsis:
            dim = dims - sum(taken) + dim  # the dims no entry names, skipped
            continue
        if _selects(entry) or is_integer_index(entry):
            picked.extend((dim + k, entry) for k in range(count))
        dim += count
    return picked


def _dims_taken(entry: Any) -> int:
    """How many dims of the indexed tensor one entry of ``x[...]`` takes."""
    if entry is None or entry is Ellipsis:
        return 0
    if isinstance(entry, Tensor) and entry.dtype == torch.bool:
        return max(entry.dim(), 1)
    return 1


def masked_write_value(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[bool, Any]:
    """Whether a call writes by one boolean mask (``h[mask] = v``), and the value ``v``.

    Such a write puts ``v`` at the positions ``mask`` picks, each where it is: with a
    value that carries no samples it is ``masked_fill`` (no entry moves to another row).

    Args:
        func: The function called.
        args: Its positional arguments (``self`` first).
        kwargs: Its keyword arguments.

    Returns:
        ``(True, v)`` for ``__setitem__``/``index_put`` with one boolean index tensor,
        else ``(False, None)``.

    Example:
        >>> h, mask = torch.ones(2, 3), torch.tensor([[True, False, True], [False] * 3])
        >>> masked_write_value(Tensor.__setitem__, (h, mask, 0.0), {})
        (True, 0.0)
    """
    name = out_of_place_name(func)
    if name == "__setitem__" and len(args) > 2:
        index, value = args[1], args[2]
    elif name == "index_put" and len(args) > 2:
        indices, value = args[1], args[2]
        index = indices[0] if isinstance(indices, (tuple, list)) and len(indices) == 1 else None
    else:
        return False, None
    if isinstance(index, tuple) and len(index) == 1:
        index = index[0]
    masked = isinstance(index, Tensor) and index.dtype in (torch.bool, torch.uint8)
    return (True, value) if masked else (False, None)


def is_integer_index(entry: Any) -> bool:
    """Whether an index entry is one integer (a Python int or a 0-d integer tensor).

    Example:
        >>> is_integer_index(-1), is_integer_index(torch.tensor(2)), is_integer_index([2])
        (True, True, False)
    """
    if isinstance(entry, Tensor):
        return entry.dim() == 0 and not entry.is_floating_point() and entry.dtype != torch.bool
    return isinstance(entry, int) and not isinstance(entry, bool)


def _selects(entry: Any) -> bool:
    """Whether one index entry picks positions: by value, or a slice of a part.

    A tensor, a list or a numpy array picks by value; ``x[1:]`` is the identity on one sample
    and other rows on the batch.
    """
    if isinstance(entry, slice):
        return entry != slice(None)
    return isinstance(entry, (Tensor, list, np.ndarray)) and not (
        isinstance(entry, Tensor) and entry.dim() == 0 and entry.dtype != torch.bool
    )


_ALWAYS_MOVES_ROWS = frozenset({"take", "flipud", "msort", "masked_scatter", "__reversed__"})
"""Calls that move elements whatever their options: along dim 0 (``flipud``, ``msort``) or
the tensor flattened."""

_ROW_DIM_ARGUMENT: dict[str, tuple[int, str, Any]] = {
    "index_select": (1, "dim", None),
    "gather": (1, "dim", None),
    "index_copy": (1, "dim", None),
    "index_add": (1, "dim", None),
    "index_reduce": (1, "dim", None),
    "scatter": (1, "dim", None),
    "scatter_add": (1, "dim", None),
    "scatter_reduce": (1, "dim", None),
    "sort": (1, "dim", -1),
    "argsort": (1, "dim", -1),
    "topk": (2, "dim", -1),
    "kthvalue": (2, "dim", -1),
    "take_along_dim": (2, "dim", None),
    "flip": (1, "dims", None),
    "roll": (2, "dims", None),
    "unbind": (1, "dim", 0),
    "split": (2, "dim", 0),
    "chunk": (2, "dim", 0),
    "tensor_split": (2, "dim", 0),
    "narrow": (1, "dim", None),
    "select": (1, "dim", None),
    "rot90": (2, "dims", (0, 1)),
    "vsplit": (2, "dim", 0),
    "dsplit": (2, "dim", 2),
}
"""Calls that move elements along the dims one argument names: its position after ``self``,
its keyword and its default (``None``: the tensor flattened, so dim 0 too)."""
