"""Closed forms for the affine parameters of normalization layers.

``y = x̂ ⊙ w + b`` with ``x̂`` the normalized input: sample ``n``'s column
gradients are ``Σ_positions g ⊙ x̂`` for the weight and ``Σ_positions g`` for the
bias, summed over every dim the parameter is broadcast along. ``x̂`` comes from
the same function called without ``weight`` and ``bias`` — one normalization
of the recorded batch, no vjp. Anything else (a derived weight, a parameter in
another role) takes the local rule's vjp.
"""

from __future__ import annotations

import functools
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
        local = as_local(x)
        role = _role(local, param)
        if role is None:
            return super().columns(x, g, call, param)
        product = g * _normalized(local) if role == "weight" else g
        trailing = local.func in _TRAILING  # parameters over the last dims, else over dim 1
        dims = range(2, g.dim() - param.dim()) if trailing else range(3, g.dim())
        summed = product.sum(tuple(dims)) if len(dims) else product
        return summed.reshape(g.shape[0], g.shape[1], *param.shape)


def _role(local: LocalInputs, param: Tensor) -> str | None:
    """``"weight"`` or ``"bias"`` if ``param`` is used once, as one of them."""
    positions = [
        p
        for p, source in local.sources.items()
        if isinstance(source, int) and local.leaf_values[source] is param
    ]
    if len(positions) != 1:
        return None
    name = _argument_names(local.func, local.arguments.layout, local.arguments.keys)[positions[0]]
    return name if name in ("weight", "bias") else None


@functools.cache
def _argument_names(
    func: Callable[..., Any], layout: tuple[tuple[type, int] | None, ...], keys: tuple[str, ...]
) -> tuple[str | None, ...]:
    """The parameter name of each flattened argument of a call laid out as ``layout``.

    Items of a list argument get ``None``. Cached: a norm layer's calls keep their layout
    (binding the signature on every call cost more than the norm's closed form).
    """
    parameters = list(inspect.signature(func).parameters)
    entries = parameters[: len(layout) - len(keys)] + list(keys)
    names: list[str | None] = []
    for entry, name in zip(layout, entries):
        names.extend([name] if entry is None else [None] * entry[1])
    return tuple(names)


def _normalized(local: LocalInputs) -> Tensor:
    """``x̂``: the norm of the recorded input without its affine parameters."""
    arguments = local.arguments
    names = _argument_names(local.func, arguments.layout, arguments.keys)
    dropped = {"weight", "bias"}
    if local.func is F.instance_norm and dict(zip(names, arguments.values)).get(
        "use_input_stats", True
    ):
        # with its own statistics, running averages would be updated a second time
        dropped |= {"running_mean", "running_var"}
    values = [None if name in dropped else v for name, v in zip(names, arguments.values)]
    args, kwargs = arguments.rebuild(values)
    return cast(Tensor, local.func(*args, **kwargs))


NORM_RULES: dict[Callable[..., Any], LocalRule] = {
    func: AffineNorm()
    for func in (F.layer_norm, F.rms_norm, F.group_norm, F.batch_norm, F.instance_norm)
}
"""The closed-form rule of each normalization function."""
