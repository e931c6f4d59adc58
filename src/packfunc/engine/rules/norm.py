"""Closed forms for the affine parameters of normalization layers.

``y = x̂ ⊙ w + b`` with ``x̂`` the normalized input: sample ``n``'s column
gradients are ``Σ_positions g ⊙ x̂`` for the weight and ``Σ_positions g`` for the
bias, summed over every dim the parameter is broadcast along. ``x̂`` comes from
the same function called without ``weight`` and ``bias`` — one normalization
of the recorded batch, no vjp. A norm over channels (batch, group and instance
norm) normalizes each sample's channel by one mean and scale, so its weight's
sums ``(Σ g ⊙ x − μ Σ g) / σ`` come from one fused reduction of ``g`` and ``x``
(PyTorch's batch-norm backward, each sample's channel a channel of its own)
without ``x̂``. Anything else (a derived weight, a parameter in another role)
takes the local rule's vjp.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from packfunc.engine.local import LocalInputs, without_running_updates
from packfunc.engine.memory import is_plain
from packfunc.engine.ops import SiteCall
from packfunc.engine.rules.local import LocalRule, as_local

_TRAILING = frozenset({F.layer_norm, F.rms_norm})
"""Norms whose parameters cover the trailing dims (``normalized_shape``); others dim 1."""

_FUSED_DTYPES = frozenset({torch.float32, torch.float64})
"""Dtypes in which a channel norm's weight columns take :func:`_fused_weight_columns`."""


class AffineNorm(LocalRule):
    """Affine weight and bias of the normalization functions of :data:`NORM_RULES`."""

    closed_form = True

    def takes_closed_form(self, x: Any, call: SiteCall, param: Tensor, rank: int) -> bool:
        """Whether ``param`` is the call's weight or bias itself (not a tensor derived from it)."""
        return _role(as_local(x), param) is not None

    def columns(self, x: Tensor, g: Tensor, call: SiteCall, param: Tensor) -> Tensor:
        """Column gradients ``[K, n, *param.shape]``: ``g`` (times ``x̂``) summed over positions."""
        local = as_local(x)
        role = _role(local, param)
        if role is None:
            return super().columns(x, g, call, param)
        if role == "weight":
            fused = _fused_weight_columns(local, g)
            if fused is not None:
                return fused
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


def _fused_weight_columns(local: LocalInputs, g: Tensor) -> Tensor | None:
    """A channel norm's weight columns ``[K, n, C]`` without forming ``x̂``, where that applies.

    ``Σ_positions g ⊙ (x − μ) / σ`` per sample and channel is the weight gradient of a
    batch norm over ``[1, n·C, positions]`` with the sample's own ``μ`` and ``1/σ`` as
    saved statistics: one pass over ``g`` and ``x``, where forming ``x̂`` and the product
    writes and reads two more tensors of ``x``'s size.

    Args:
        local: The recorded call of :data:`NORM_RULES`.
        g: Its output cotangents ``[K, n, C, ...]``.

    Returns:
        The weight's column gradients; ``None`` for a norm over trailing dims, a
        dtype outside :data:`_FUSED_DTYPES`, or tensors in autograd or a transform.
    """
    if local.func in _TRAILING:
        return None
    settings = _settings(local)
    x = settings["input"]
    if x.dtype not in _FUSED_DTYPES or g.dtype != x.dtype or not is_plain(x, g):
        return None
    n, channels = x.shape[0], x.shape[1]
    rows = x.reshape(1, n * channels, -1)
    mean, inverse_std = (t.reshape(-1) for t in _channel_statistics(local.func, settings))
    sums = [
        _weight_gradient(column.reshape(rows.shape), rows, mean, inverse_std)
        for column in g.unbind(0)
    ]
    return torch.stack(sums).view(g.shape[0], n, channels)


def _weight_gradient(g: Tensor, x: Tensor, mean: Tensor, inverse_std: Tensor) -> Tensor:
    """``Σ_positions g ⊙ (x − mean) · inverse_std`` per channel of ``x [1, C, positions]``.

    The weight passed is ones (its value does not enter this gradient): CUDA's kernel
    allocates the weight's gradient like the weight and refuses a missing one. Every tensor
    goes in contiguous: the kernel reads memory as laid out contiguously (one channel's
    running statistics expanded over the samples have stride 0: it read past them, and
    unwritten memory came out as sample 0's gradient).
    """
    ones = x.new_ones(x.shape[1])
    found = torch.ops.aten.native_batch_norm_backward(
        g.contiguous(),
        x.contiguous(),
        ones,
        None,
        None,
        mean.contiguous(),
        inverse_std.contiguous(),
        True,
        0.0,
        [False, True, False],
    )
    return cast(Tensor, found[1])


def _channel_statistics(
    func: Callable[..., Any], settings: dict[str | None, Any]
) -> tuple[Tensor, Tensor]:
    """The mean and inverse standard deviation of each sample's channels, ``[n, C]`` each.

    The input's own over each sample's groups (group norm), channels (instance norm) or
    the batch (batch norm in training), from PyTorch's group-norm kernel (``var_mean`` is
    15 times slower on CPU); else the running statistics the call used (``settings``: the
    call's arguments by name, see :func:`_settings`).
    """
    x: Tensor = settings["input"]
    n, channels, eps = x.shape[0], x.shape[1], settings["eps"]
    if func is F.group_norm:
        groups = settings["num_groups"]
        mean, inverse_std = _group_statistics(x, groups, eps)
        per_group = channels // groups
        return mean.repeat_interleave(per_group, 1), inverse_std.repeat_interleave(per_group, 1)
    if func is F.instance_norm and settings["use_input_stats"]:
        return _group_statistics(x, channels, eps)
    if func is F.batch_norm and settings["training"]:
        mean, inverse_std = _group_statistics(
            x.transpose(0, 1).reshape(1, channels, -1), channels, eps
        )
        return mean.expand(n, channels), inverse_std.expand(n, channels)
    var, mean = (settings[k].to(x.dtype) for k in ("running_var", "running_mean"))
    return mean.expand(n, channels), (var + eps).rsqrt().expand(n, channels)


def _group_statistics(x: Tensor, groups: int, eps: float) -> tuple[Tensor, Tensor]:
    """Mean and ``1/√(var + eps)`` of each sample's groups of channels, ``[n, groups]``."""
    n, channels = x.shape[0], x.shape[1]
    positions = x[0, 0].numel()
    found = torch.ops.aten.native_group_norm(
        x.contiguous(), None, None, n, channels, positions, groups, eps
    )
    return cast(Tensor, found[1]), cast(Tensor, found[2])


def _settings(
    local: LocalInputs, names: tuple[str | None, ...] | None = None
) -> dict[str | None, Any]:
    """The recorded call's arguments by name, the function's defaults for those not given.

    ``names``: the arguments' names, where the caller has them already.
    """
    arguments = local.arguments
    if names is None:
        names = _argument_names(local.func, arguments.layout, arguments.keys)
    return {**_defaults(local.func), **dict(zip(names, arguments.values))}


@functools.cache
def _defaults(func: Callable[..., Any]) -> dict[str | None, Any]:
    """``func``'s keyword defaults by name."""
    parameters = inspect.signature(func).parameters.values()
    return {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}


def _normalized(local: LocalInputs) -> Tensor:
    """``x̂``: the norm of the recorded input without its affine parameters."""
    arguments = local.arguments
    names = _argument_names(local.func, arguments.layout, arguments.keys)
    dropped = {"weight", "bias"}
    values = [None if name in dropped else v for name, v in zip(names, arguments.values)]
    # with its own statistics, running averages would be updated a second time
    args, kwargs = without_running_updates(local.func, *arguments.rebuild(values))
    return cast(Tensor, local.func(*args, **kwargs))


NORM_RULES: dict[Callable[..., Any], LocalRule] = {
    func: AffineNorm()
    for func in (F.layer_norm, F.rms_norm, F.group_norm, F.batch_norm, F.instance_norm)
}
"""The closed-form rule of each normalization function."""
