"""The linear-like ops that packfunc taps, and how to read their arguments.

A tapped op is linear in its weight: ``z = op(x, W) + b``. Knowing its input
``x`` and the cotangent ``g`` of its output per sample is enough to get every
per-sample gradient of ``W`` and ``b`` in closed form (see ``rules/``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class OpSignature:
    """Positional argument names of a tapped op, with defaults and its family.

    ``transposed``: a transposed convolution, or a linear weight stored ``[in, out]``.
    """

    family: str
    names: tuple[str, ...]
    defaults: tuple[Any, ...]
    transposed: bool = False

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


RESHAPES = frozenset(
    {torch.Tensor.view, torch.Tensor.reshape, torch.reshape, torch.Tensor.flatten, torch.flatten}
)
"""Calls that may lay the rows of a tensor out flat (``x.view(-1, d)``)."""


MATMULS = frozenset({torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__})
"""``x @ W``: a linear layer where ``W`` is a matrix parameter."""

LINEAR_CALLS = MATMULS | {torch.addmm}
"""Calls that may be a linear layer with its weight stored ``[in, out]`` (see :class:`FlatRows`)."""


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

    def remember(self, func: Callable[..., Any], args: tuple[Any, ...], out: Any) -> None:
        """Note ``out`` if a reshape made it of the rows of its input ``x`` (``x.dim() > 2``).

        Args:
            func: The function called.
            args: Its positional arguments (``x`` first).
            out: Its output.
        """
        if func not in RESHAPES or not args:
            return
        x = args[0]
        if not (isinstance(x, torch.Tensor) and isinstance(out, torch.Tensor) and x.dim() > 2):
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
            matrix parameter, or an ``addmm`` not on remembered rows, not a plain product
            (``beta = alpha = 1``), with no parameter as weight or bias, or no vector bias.
        """
        if func in MATMULS:
            return _matmul_layer(args, kwargs, is_parameter)
        if func is not torch.addmm:
            return None
        bound = dict(zip(("input", "mat1", "mat2", "beta", "alpha"), args)) | kwargs
        rows, weight, bias = bound.get("mat1"), bound.get("mat2"), bound.get("input")
        found = self.of.get(id(rows)) if isinstance(rows, torch.Tensor) else None
        if found is None or found[0] is not rows:
            return None
        if bound.get("beta", 1) != 1 or bound.get("alpha", 1) != 1:
            return None
        if not (is_parameter(weight) or is_parameter(bias)):
            return None
        if not (isinstance(bias, torch.Tensor) and bias.dim() == 1):
            return None
        assert isinstance(weight, torch.Tensor)
        return found[1], weight, bias


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
    F.linear: OpSignature("linear", ("input", "weight", "bias"), (None,)),
    linear_in_out: OpSignature("linear", ("input", "weight", "bias"), (None,), transposed=True),
    **{
        conv: OpSignature("conv", _CONV, (None, 1, 0, 1, 1))
        for conv in (torch.conv1d, torch.conv2d, torch.conv3d)
    },
    **{
        conv: OpSignature("conv", _CONV_T, (None, 1, 0, 0, 1, 1), transposed=True)
        for conv in (torch.conv_transpose1d, torch.conv_transpose2d, torch.conv_transpose3d)
    },
    F.embedding: OpSignature("embedding", _EMBEDDING, (None, None, 2.0, False, False)),
}
"""Every tapped function, keyed by the object ``__torch_function__`` receives."""

ROLES = ("weight", "bias")
"""The arguments of a tapped op that can be parameters handled by a rule."""


@dataclass(frozen=True)
class TapCall:
    """One call of a tapped op whose weight or bias is a parameter leaf.

    Attributes:
        family: ``"linear"``, ``"conv"`` or ``"embedding"``.
        leaves: Leaf index per role (``"weight"``, ``"bias"``) that is a parameter.
        options: The op's remaining arguments (stride, padding, ...), by name.
        transposed: Whether a convolution is transposed, or a linear weight is stored
            ``[in, out]`` (:func:`linear_in_out`).
    """

    family: str
    leaves: tuple[tuple[str, int], ...]
    options: tuple[tuple[str, Any], ...]
    transposed: bool = False

    def option(self, name: str) -> Any:
        """Return the op argument ``name`` of this call.

        Args:
            name: An argument name such as ``"stride"``.

        Returns:
            Its value in this call.

        Example:
            >>> TapCall("conv", (), (("stride", 2),)).option("stride")
            2
        """
        return dict(self.options)[name]


def make_call(
    sig: OpSignature, bound: dict[str, Any], leaf_of: Callable[[Any], int | None]
) -> TapCall:
    """Describe a tapped call by family, parameter leaves and options.

    Args:
        sig: The op's signature.
        bound: Its bound arguments (see :meth:`OpSignature.bind`).
        leaf_of: Maps a value to its parameter leaf index, or ``None``.

    Returns:
        The :class:`TapCall`.

    Example:
        >>> sig = SIGNATURES[F.linear]
        >>> make_call(sig, sig.bind((0, 1), {}), lambda v: v).leaves
        (('weight', 1),)
    """
    options = tuple((k, v) for k, v in bound.items() if k not in ("input", *ROLES))
    return TapCall(sig.family, tapped_leaves(bound, leaf_of), options, sig.transposed)


def tapped_leaves(
    bound: dict[str, Any], leaf_of: Callable[[Any], int | None]
) -> tuple[tuple[str, int], ...]:
    """The parameter leaf of each role (weight, bias) of a tapped call that has one.

    Args:
        bound: The call's bound arguments (see :meth:`OpSignature.bind`).
        leaf_of: Maps a value to its parameter leaf index, or ``None``.

    Returns:
        ``((role, leaf), ...)``, as in :attr:`TapCall.leaves`.

    Example:
        >>> tapped_leaves({"weight": 3, "bias": None}, lambda v: v)
        (('weight', 3),)
    """
    return tuple((role, leaf) for role in ROLES if (leaf := leaf_of(bound.get(role))) is not None)
