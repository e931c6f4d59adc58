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
    """Positional argument names of a tapped op, with defaults and its family."""

    family: str
    names: tuple[str, ...]
    defaults: tuple[Any, ...]
    transposed: bool = False

    def bind(self, args: tuple, kwargs: dict) -> dict[str, Any]:
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

SIGNATURES: dict[Callable, OpSignature] = {
    F.linear: OpSignature("linear", ("input", "weight", "bias"), (None,)),
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
        transposed: Whether a convolution is transposed.
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
