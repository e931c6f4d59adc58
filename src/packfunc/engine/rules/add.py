"""Closed form for a parameter added to (or subtracted from) a batch: ``x ± α·w``.

A learned position embedding or a bias added by hand broadcasts ``w`` over the
samples: sample ``n``'s column gradient is its output cotangent summed over the
dims ``w`` is broadcast along, times the sign and scale ``w`` enters with. An
operand computed from ``w`` alone (a derivation: Hugging Face's position embedding
``wpe(arange(T))``, a slice ``pos[:T]``) gets that sum pulled back through its
derivation, one vjp ``vmap``-ed over the columns. Any other use (the parameter on
both sides, a weight with a batch dim) takes the local rule's vjp.
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


class BroadcastAdd(LocalRule):
    """A parameter that is one operand of an addition or subtraction with a batched tensor."""

    closed_form = True

    def columns(self, x: Tensor, g: Tensor, call: SiteCall, param: Tensor) -> Tensor:
        """Column gradients ``[K, n, *param.shape]``: ``g`` summed over ``w``'s broadcast dims.

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
        found = _operand(local, param)
        if found is None:
            return super().columns(x, g, call, param)
        scale, source = found
        leaf = local.leaf_of(param)
        if isinstance(source, int):
            summed = _summed_to(g, param)
            if summed is None:  # the parameter covers the samples
                return super().columns(x, g, call, param)
            return summed if scale == 1 else summed * scale
        operand, pullback = vjp(lambda w: source.compute({leaf: w}), param)
        summed = _summed_to(g, operand)
        if summed is None:
            return super().columns(x, g, call, param)
        pulled = vmap(lambda s: pullback(s)[0])(summed.flatten(0, 1) * scale)
        return cast(Tensor, pulled).view(*g.shape[:2], *param.shape)

    def column_sum(self, x: Tensor, g: Tensor, call: SiteCall, param: Tensor) -> Tensor:
        """``Σ_{k,n}`` of the column gradients (which have the parameter's size per sample)."""
        return self.columns(x, g, call, param).sum((0, 1))


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


def _operand(local: LocalInputs, param: Tensor) -> tuple[float, Source] | None:
    """The factor and source of ``param``'s operand, if that is one of two, else ``None``.

    The source is the leaf itself, or a derivation of it alone that copies no rows along
    the batch (whose samples would each see a row of their own).
    """
    arguments = local.arguments
    positional = len(arguments.values) - len(arguments.keys)
    if any(arguments.layout) or positional != 2 or set(arguments.keys) - {"alpha"}:
        return None  # (a list argument, another keyword)
    if len(local.sources) != 1 or local.narrow:
        return None
    ((position, source),) = local.sources.items()
    leaf = local.leaf_of(param)
    if isinstance(source, Derivation) and source.leaves != {leaf}:
        return None
    if isinstance(source, int) and source != leaf:
        return None
    alpha = dict(zip(arguments.keys, arguments.values[positional:])).get("alpha", 1)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        return None
    if position == 0:
        return 1.0, source
    return (float(alpha) if local.func in _ADD else -float(alpha)), source


ADD_RULES: dict[Callable[..., Any], LocalRule] = {
    func: BroadcastAdd() for func in (*_ADD, *_SUBTRACT)
}
"""The closed-form rule of each addition and subtraction function."""
