"""Closed form for a parameter added to (or subtracted from) a batch: ``x ± α·w``.

A learned position embedding or a bias added by hand broadcasts ``w`` over the
samples: sample ``n``'s column gradient is its output cotangent summed over the
dims ``w`` is broadcast along, times the sign and scale ``w`` enters with. Any
other use (the parameter on both sides, a weight with a batch dim) takes the
local rule's vjp.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from packfunc.engine.local import LocalInputs
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
        scale = _scale(local, param)
        leading = g.dim() - 1 - param.dim()  # output dims beyond the parameter's, the sample's
        if scale is None or leading < 0 or (leading == 0 and param.shape[0] != 1):
            return super().columns(x, g, call, param)  # the parameter covers the samples
        padded = (1,) * leading + tuple(param.shape)
        summed = g.sum_to_size(g.shape[:2] + padded[1:]).reshape(*g.shape[:2], *param.shape)
        return summed if scale == 1 else summed * scale

    def column_sum(self, x: Tensor, g: Tensor, call: SiteCall, param: Tensor) -> Tensor:
        """``Σ_{k,n}`` of the column gradients (which have the parameter's size per sample)."""
        return self.columns(x, g, call, param).sum((0, 1))


def _scale(local: LocalInputs, param: Tensor) -> float | None:
    """The factor ``param`` enters the output with, if it is one operand of two, else ``None``."""
    arguments = local.arguments
    positional = len(arguments.values) - len(arguments.keys)
    if any(arguments.layout) or positional != 2 or set(arguments.keys) - {"alpha"}:
        return None  # (a list argument, another keyword)
    if len(local.sources) != 1:
        return None
    ((position, source),) = local.sources.items()
    if not isinstance(source, int) or local.leaf_values[source] is not param:
        return None
    alpha = dict(zip(arguments.keys, arguments.values[positional:])).get("alpha", 1)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        return None
    if position == 0:
        return 1.0
    return float(alpha) if local.func in _ADD else -float(alpha)


ADD_RULES: dict[Callable[..., Any], LocalRule] = {
    func: BroadcastAdd() for func in (*_ADD, *_SUBTRACT)
}
"""The closed-form rule of each addition and subtraction function."""
