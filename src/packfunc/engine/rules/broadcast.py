"""Closed forms for a parameter broadcast against a batch: ``x ± α·w`` and ``x ⊙ w``.

A learned position embedding or a bias added by hand broadcasts ``w`` over the
samples: sample ``n``'s column gradient is its output cotangent summed over the
dims ``w`` is broadcast along, times the sign and scale ``w`` enters with. A scale
multiplied with the samples (the weight of an RMSNorm written by hand, as in Hugging
Face's LLaMA: ``weight * hidden``) gets the cotangent times the other operand, summed
the same way. An operand computed from ``w`` alone (a derivation: Hugging Face's
position embedding ``wpe(arange(T))``, a slice ``pos[:T]``) gets that sum pulled back
through its derivation, one vjp ``vmap``-ed over the columns. Any other use (the
parameter on both sides, a weight with a batch dim) takes the local rule's vjp.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch import Tensor
from torch.func import vmap

from packfunc.engine.autodiff import vjp
from packfunc.engine.local import Derivation, LocalInputs, Source
from packfunc.engine.ops import SiteCall
from packfunc.engine.rules.local import LocalRule, as_local

_ADD = (torch.add, Tensor.add, Tensor.__add__)
_SUBTRACT = (torch.sub, Tensor.sub, Tensor.__sub__)
_MULTIPLY = (torch.mul, torch.multiply, Tensor.mul, Tensor.multiply, Tensor.__mul__)


class _Broadcast(LocalRule):
    """A parameter that is one operand of two of an elementwise op with a batched tensor."""

    closed_form = True
    keywords: frozenset[str] = frozenset()
    """Keyword arguments the op may take besides its two operands."""

    def columns(self, x: Tensor, g: Tensor, call: SiteCall, param: Tensor) -> Tensor:
        """Column gradients ``[K, n, *param.shape]``: the operand's cotangent, summed.

        Summed over the dims the operand is broadcast along, and pulled back through its
        derivation if it is one.

        Args:
            x: The recorded call (:class:`~packfunc.engine.local.LocalInputs`).
            g: Its output cotangents ``[K, n, ...]``.
            call: The site's call.
            param: The parameter.

        Returns:
            The column gradients.

        Example:
            >>> from packfunc.engine.local import CallArguments
            >>> x, w = torch.ones(2, 4, 3), torch.ones(3)
            >>> arguments = CallArguments.of((x, w), {"alpha": 2})
            >>> local = LocalInputs(torch.sub, arguments, {1: 0}, (0,), frozenset(), {0: w})
            >>> BroadcastAdd().columns(local, torch.ones(1, 2, 4, 3), None, w)[0, 0]
            tensor([-8., -8., -8.])
        """
        local = as_local(x)
        found = _operand(local, param, self.keywords)
        shares = None if found is None else self.operand_cotangent(local, g, found[0])
        if found is None or shares is None:
            return super().columns(x, g, call, param)
        source, leaf = found[1], local.leaf_of(param)
        if isinstance(source, int):
            summed = _summed_to(shares, param)
            return super().columns(x, g, call, param) if summed is None else summed
        operand, pullback = vjp(lambda w: source.compute({leaf: w}), param)
        summed = _summed_to(shares, operand)
        if summed is None:  # the operand covers the samples
            return super().columns(x, g, call, param)
        pulled = vmap(lambda s: pullback(s)[0])(summed.flatten(0, 1))
        return cast(Tensor, pulled).view(*g.shape[:2], *param.shape)

    def column_sum(self, x: Tensor, g: Tensor, call: SiteCall, param: Tensor) -> Tensor:
        """``Σ_{k,n}`` of the column gradients (which have the parameter's size per sample)."""
        return self.columns(x, g, call, param).sum((0, 1))

    def operand_cotangent(self, local: LocalInputs, g: Tensor, position: int) -> Tensor | None:
        """The cotangents ``[K, n, ...]`` of the operand at ``position``, not summed to its shape.

        ``None`` where this rule has no closed form for the call.
        """
        raise NotImplementedError


class BroadcastAdd(_Broadcast):
    """A parameter that is one operand of an addition or subtraction with a batched tensor."""

    keywords = frozenset({"alpha"})

    def operand_cotangent(self, local: LocalInputs, g: Tensor, position: int) -> Tensor | None:
        """``g`` times the sign and scale the operand enters with."""
        arguments = local.arguments
        alpha = dict(zip(arguments.keys, arguments.values[2:])).get("alpha", 1)
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
            return None
        scale = 1.0 if position == 0 else float(alpha) * (1 if local.func in _ADD else -1)
        return g if scale == 1 else g * scale


class BroadcastMul(_Broadcast):
    """A parameter that is one factor of a product with a batched tensor (an RMSNorm's weight)."""

    def operand_cotangent(self, local: LocalInputs, g: Tensor, position: int) -> Tensor | None:
        """``g`` times the other factor, where that has one row per sample and the output's dims.

        Example:
            >>> from packfunc.engine.local import CallArguments
            >>> x, w = torch.arange(6.0).view(2, 3), torch.ones(3)
            >>> local = LocalInputs(torch.mul, CallArguments.of((w, x), {}), {0: 0}, (1,),
            ...                     frozenset(), {0: w})
            >>> BroadcastMul().operand_cotangent(local, torch.ones(1, 2, 3), 0)
            tensor([[[0., 1., 2.],
                     [3., 4., 5.]]])
        """
        other = 1 - position
        factor = local.arguments.values[other]
        if other not in local.per_sample() or not isinstance(factor, Tensor):
            return None
        if factor.dim() != g.dim() - 1:  # its first dim would not be the samples' in the output
            return None
        return g * factor


def _summed_to(g: Tensor, operand: Tensor) -> Tensor | None:
    """``g [K, n, ...]`` summed over the dims ``operand`` is broadcast along: ``[K, n, *operand]``.

    ``None`` where the operand has a dim of the samples' own (its rows are not shared).

    Example:
        >>> _summed_to(torch.ones(1, 2, 3, 4), torch.ones(4)).shape
        torch.Size([1, 2, 4])
    """
    leading = g.dim() - 1 - operand.dim()  # output dims beyond the operand's, the sample's
    if leading < 0 or (leading == 0 and operand.shape[0] != 1):
        return None
    padded = (1,) * leading + tuple(operand.shape)
    return g.sum_to_size(g.shape[:2] + padded[1:]).reshape(*g.shape[:2], *operand.shape)


def _operand(
    local: LocalInputs, param: Tensor, keywords: frozenset[str]
) -> tuple[int, Source] | None:
    """The position and source of ``param``'s operand, if that is one of two, else ``None``.

    The source is the leaf itself, or a derivation of it alone that copies no rows along
    the batch (whose samples would each see a row of their own).
    """
    arguments = local.arguments
    positional = len(arguments.values) - len(arguments.keys)
    if any(arguments.layout) or positional != 2 or set(arguments.keys) - keywords:
        return None  # (a list argument, another keyword)
    if len(local.sources) != 1 or local.narrow:
        return None
    ((position, source),) = local.sources.items()
    leaf = local.leaf_of(param)
    if isinstance(source, Derivation) and source.leaves != {leaf}:
        return None
    if isinstance(source, int) and source != leaf:
        return None
    return position, source


BROADCAST_RULES: dict[Callable[..., Any], LocalRule] = {
    **{func: BroadcastAdd() for func in (*_ADD, *_SUBTRACT)},
    **{func: BroadcastMul() for func in _MULTIPLY},
}
"""The closed-form rule of each addition, subtraction and multiplication function."""
