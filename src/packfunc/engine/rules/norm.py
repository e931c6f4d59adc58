"""Closed forms for the affine parameters of normalization layers.

``y = x̂ ⊙ w + b`` with ``x̂`` the normalized input: sample ``n``'s column
gradients are ``Σ_positions g ⊙ x̂`` for the weight and ``Σ_positions g`` for the
bias, summed over every dim the parameter is broadcast along. ``x̂`` comes from
the same function called without ``weight`` and ``bias`` — one normalization
of the recorded batch, no vjp. Anything else (a derived weight, a parameter in
another role) takes the local rule's vjp.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, cast

import torch.nn.functional as F
from torch import Tensor

from packfunc.engine.local import LocalInputs
from packfunc.engine.ops import SiteCall
from packfunc.engine.rules.local import LocalRule, as_local

_TRAILING = frozenset({F.layer_norm, F.rms_norm})
"""Norms whose parameters cover the trailing dims (``normalized_shape``); others dim 1."""


class AffineNorm(LocalRule):
    """Affine weight and bias of the normalization functions of :data:`NORM_RULES`."""

    closed_form = True

    def columns(self, x: Tensor, g: Tensor, call: SiteCall, param: Tensor) -> Tensor:
        """Column gradients ``[K, n, *param.shape]``: ``g`` (times ``x̂``) summed over positions."""
        found = _role(as_local(x), param)
        if found is None:
            return super().columns(x, g, call, param)
        role, bound = found
        local = as_local(x)
        product = g * _normalized(local.func, bound) if role == "weight" else g
        trailing = local.func in _TRAILING  # parameters over the last dims, else over dim 1
        dims = range(2, g.dim() - param.dim()) if trailing else range(3, g.dim())
        summed = product.sum(tuple(dims)) if len(dims) else product
        return summed.reshape(g.shape[0], g.shape[1], *param.shape)


def _role(local: LocalInputs, param: Tensor) -> tuple[str, dict[str, Any]] | None:
    """``("weight" | "bias", bound arguments)`` if ``param`` is used once, as one of them."""
    positions = [
        p
        for p, source in local.sources.items()
        if isinstance(source, int) and local.leaf_values[source] is param
    ]
    if len(positions) != 1:
        return None
    args, kwargs = local.arguments.rebuild(list(local.arguments.values))
    bound = inspect.signature(local.func).bind(*args, **kwargs)
    bound.apply_defaults()
    for role in ("weight", "bias"):
        if bound.arguments.get(role) is param:
            return role, dict(bound.arguments)
    return None


def _normalized(func: Callable[..., Any], bound: dict[str, Any]) -> Tensor:
    """``x̂``: the norm of the recorded input without its affine parameters."""
    arguments = {**bound, "weight": None}
    if "bias" in arguments:
        arguments["bias"] = None
    if func is F.instance_norm and arguments["use_input_stats"]:
        # with its own statistics, running averages would be updated a second time
        arguments["running_mean"] = arguments["running_var"] = None
    return cast(Tensor, func(**arguments))


NORM_RULES: dict[Callable[..., Any], LocalRule] = {
    func: AffineNorm()
    for func in (F.layer_norm, F.rms_norm, F.group_norm, F.batch_norm, F.instance_norm)
}
"""The closed-form rule of each normalization function."""
