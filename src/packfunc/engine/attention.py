"""Out-of-place, batch-first re-implementation of ``F.multi_head_attention_forward``.

``nn.MultiheadAttention`` (and through it ``nn.TransformerEncoderLayer``,
``nn.TransformerDecoderLayer``, ``nn.Transformer``) calls
``F.multi_head_attention_forward`` in ``(L, N, E)`` layout. A ``TorchFunctionMode`` sees that
call as one opaque op, so its projection weights would have to take the whole-model path.
:func:`run_attention` evaluates the same function from ``F.linear`` calls whose weights and
biases are the module's own parameter leaves, reshapes, softmax attention (or
``F.scaled_dot_product_attention``) and ``F.dropout``, all out of place. It works on
batch-first ``[N, L, E]`` tensors, so every ``F.linear`` keeps the sample index at dim 0, and
transposes only at the boundaries.

The projections, one per parameter leaf:

* packed ``in_proj_weight``: one ``F.linear`` with the whole packed weight over the distinct
  inputs among query, key and value, concatenated along the sequence (self-attention: the
  input itself), sliced afterwards into q, k and v; a slice of the weight would not be a leaf;
* separate ``q/k/v_proj_weight``: one ``F.linear`` each, and the packed ``in_proj_bias`` as the
  bias of an ``F.linear`` of an empty input (``[N, 0] -> [N, 3E]``, the bias broadcast to every
  sample), so it is tapped as a whole too;
* ``out_proj``: one ``F.linear``.

``bias_k``/``bias_v`` are expanded over samples and concatenated along the sequence (they take
the whole-model path). Calls it cannot reproduce exactly (``static_k``/``static_v``, nested
tensors, malformed arguments) are left to PyTorch: see :func:`supports_attention`.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["ATTENTION_OPS", "run_attention", "supports_attention"]

ATTENTION_OPS: frozenset[Callable[..., Any]] = frozenset({F.multi_head_attention_forward})
"""The functions :func:`run_attention` re-implements."""

_SIGNATURE = inspect.signature(F.multi_head_attention_forward)
_NAMES = tuple(_SIGNATURE.parameters)
_NAME_SET = frozenset(_NAMES)
_DEFAULTS = {
    name: p.default
    for name, p in _SIGNATURE.parameters.items()
    if p.default is not inspect.Parameter.empty
}
_PLAIN = all(p.kind is p.POSITIONAL_OR_KEYWORD for p in _SIGNATURE.parameters.values())
"""Whether every argument may be given by position or name (the fast binding's premise)."""


_DISPATCHING = (
    "query",
    "key",
    "value",
    "in_proj_weight",
    "in_proj_bias",
    "bias_k",
    "bias_v",
    "out_proj_weight",
    "out_proj_bias",
)
"""The arguments whose ``__torch_function__`` ``F.multi_head_attention_forward`` consults
(``q/k/v_proj_weight`` are not among them)."""


def dispatching_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The arguments of an attention call through which a tensor subclass sees the call.

    A call whose only parameters are separate ``q/k/v_proj_weight`` runs PyTorch's own
    implementation even with those weights a tensor subclass: only their ``F.linear`` calls,
    on ``[L, N, E]`` inputs, reach it.

    Args:
        args: Positional arguments of an ``F.multi_head_attention_forward`` call.
        kwargs: Its keyword arguments.

    Returns:
        The values of query, key, value, the packed projection, the bias_k/v and out_proj.

    Example:
        >>> x = torch.ones(2, 1, 4)
        >>> len(dispatching_arguments((x, x, x, 4, 2, None, None, None, None, False, 0.0,
        ...                            torch.ones(4, 4), None), {}))
        9
    """
    bound = _bind(args, kwargs)
    return tuple(bound[name] for name in _DISPATCHING)


def _bind(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Map a call's arguments onto ``F.multi_head_attention_forward``'s names, defaults filled.

    Zipped with the names where that is unambiguous (a call per attention layer and pass:
    ``inspect`` binding cost more than the checks); ``inspect`` binds, and raises, otherwise.
    """
    given = dict(zip(_NAMES, args))
    fits = len(args) <= len(_NAMES) and kwargs.keys() <= _NAME_SET
    if _PLAIN and fits and not given.keys() & kwargs.keys():
        bound = _DEFAULTS | given | kwargs
        if len(bound) == len(_NAMES):  # every name (and no other: checked above)
            return bound
    slow = _SIGNATURE.bind(*args, **kwargs)
    slow.apply_defaults()
    return dict(slow.arguments)


def _is_mask(mask: Any, *shapes: tuple[int, ...]) -> bool:
    """Whether ``mask`` is ``None`` or a bool or floating tensor of one of ``shapes``."""
    if mask is None:
        return True
    return (
        isinstance(mask, Tensor)
        and (mask.dtype == torch.bool or mask.is_floating_point())
        and tuple(mask.shape) in shapes
    )


def _reproducible(a: dict[str, Any]) -> bool:
    """Whether the bound call is one :func:`run_attention` evaluates exactly."""
    query, key, value = a["query"], a["key"], a["value"]
    if not all(isinstance(t, Tensor) and not t.is_nested for t in (query, key, value)):
        return False
    if query.dim() not in (2, 3) or key.dim() != query.dim() or value.dim() != query.dim():
        return False
    if a["static_k"] is not None or a["static_v"] is not None or a["out_proj_weight"] is None:
        return False
    length, embed_dim, heads = query.shape[0], query.shape[-1], a["num_heads"]
    source, batch = key.shape[0], (query.shape[1] if query.dim() == 3 else 1)
    if embed_dim != a["embed_dim_to_check"] or embed_dim % heads:
        return False
    if (a["bias_k"] is None) != (a["bias_v"] is None):
        return False
    if a["is_causal"] and a["attn_mask"] is None:
        return False
    if a["use_separate_proj_weight"]:
        weights = (a["q_proj_weight"], a["k_proj_weight"], a["v_proj_weight"])
        shapes_fit = key.shape[:-1] == value.shape[:-1] and all(w is not None for w in weights)
    else:
        shapes_fit = a["in_proj_weight"] is not None and key.shape == value.shape
        shapes_fit = shapes_fit and key.shape[-1] == embed_dim
    padding = (batch, source) if query.dim() == 3 else (source,)
    return (
        shapes_fit
        and key.shape[1:-1] == query.shape[1:-1]
        and _is_mask(a["key_padding_mask"], padding)
        and _is_mask(a["attn_mask"], (length, source), (batch * heads, length, source))
    )


def supports_attention(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether :func:`run_attention` reproduces this ``F.multi_head_attention_forward`` call.

    Not reproduced, and left to PyTorch: ``static_k``/``static_v``, nested tensors, and
    arguments PyTorch refuses (wrong shapes or mask types, ``is_causal`` without
    ``attn_mask`` ...), which then fail with PyTorch's own error.

    Args:
        args: Positional arguments of the call.
        kwargs: Its keyword arguments.

    Returns:
        ``True`` if :func:`run_attention` gives exactly what the call returns.

    Example:
        >>> mha = torch.nn.MultiheadAttention(4, 2)
        >>> x = torch.randn(3, 2, 4)
        >>> args = (x, x, x, 4, 2, mha.in_proj_weight, mha.in_proj_bias, None, None, False,
        ...         0.0, mha.out_proj.weight, mha.out_proj.bias)
        >>> supports_attention(args, {}), supports_attention(args, {"static_k": x})
        (True, False)
    """
    try:
        bound = _bind(args, kwargs)
    except TypeError:
        return False
    return _reproducible(bound)


def _batch_first(query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Move query, key and value to ``[N, L, E]``; inputs that are one tensor stay one tensor."""

    def move(t: Tensor) -> Tensor:
        return t.transpose(0, 1) if t.dim() == 3 else t.unsqueeze(0)

    moved: list[tuple[Tensor, Tensor]] = []  # (original, batch-first), one per distinct input
    for t in (query, key, value):
        if not any(t is original for original, _ in moved):
            moved.append((t, move(t)))
    q, k, v = (next(new for original, new in moved if original is t) for t in (query, key, value))
    return q, k, v


def _packed_projection(
    query: Tensor, key: Tensor, value: Tensor, weight: Tensor, bias: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v from one ``F.linear`` with the whole packed ``[3E, E]`` weight.

    The distinct inputs among query, key and value, by identity as torch's own projection
    tells them apart, are concatenated along the sequence, projected with the full weight
    and sliced: rows by input, columns by role. One tensor passed for several roles is one
    input (its tokens counted once in the layer's Kronecker factors). Inputs that are other
    tensors of equal values (``mha(norm_q(h), norm_kv(h), norm_kv(h))`` at initialization,
    a detached key, ``h + pos`` with ``pos`` zero) stay apart: each role's cotangent goes to
    its own tensor, and so to what made it. Taken as one by value, the key's and value's
    gradient went to the query's branch (a probe: 3.6× a learned position's gradient, a
    key/value norm's exactly zero).
    """
    distinct: list[Tensor] = []
    owner: list[int] = []  # which distinct input each role takes
    for t in (query, key, value):
        found = next((i for i, d in enumerate(distinct) if t is d), len(distinct))
        distinct += [t] if found == len(distinct) else []
        owner.append(found)
    x = distinct[0] if len(distinct) == 1 else torch.cat(distinct, dim=1)
    projected = F.linear(x, weight, bias)  # [N, sum of lengths, 3E]
    starts = [0]
    for d in distinct[:-1]:
        starts.append(starts[-1] + d.shape[1])
    embed_dim = query.shape[-1]

    def part(role: int) -> Tensor:
        start, length = starts[owner[role]], distinct[owner[role]].shape[1]
        return projected[:, start : start + length, role * embed_dim : (role + 1) * embed_dim]

    return part(0), part(1), part(2)


def _separate_projection(
    query: Tensor, key: Tensor, value: Tensor, a: dict[str, Any]
) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v from ``q/k/v_proj_weight`` (kdim/vdim may differ) and the packed bias.

    The bias ``[3E]`` is the bias of an ``F.linear`` of an empty input ``[N, 0]``: its output
    ``[N, 3E]`` is the bias for every sample, and the packed leaf is used whole.
    """
    q = F.linear(query, a["q_proj_weight"])
    k = F.linear(key, a["k_proj_weight"])
    v = F.linear(value, a["v_proj_weight"])
    bias = a["in_proj_bias"]
    if bias is None:
        return q, k, v
    empty = query.new_zeros(query.shape[0], 0)
    per_sample = F.linear(empty, query.new_zeros(bias.shape[0], 0), bias)  # [N, 3E]
    b_q, b_k, b_v = per_sample.unsqueeze(1).chunk(3, dim=-1)
    return q + b_q, k + b_k, v + b_v


def _float_mask(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A bool mask (``True``: masked out) as an additive float mask; float masks as they are."""
    if mask.is_floating_point():
        return mask
    return torch.zeros_like(mask, dtype=dtype).masked_fill(mask, float("-inf"))


def _masks(
    a: dict[str, Any], batch: int, heads: int, dtype: torch.dtype
) -> tuple[Tensor | None, Tensor | None, bool]:
    """``attn_mask`` as ``[1 | N, 1 | H, L, S]``, ``key_padding_mask`` as ``[N, 1, 1, S]``.

    Returns:
        Both masks (additive, float) and whether attention is causal by ``is_causal`` alone
        (PyTorch then ignores ``attn_mask``: without padding mask and attention weights).
    """
    attn_mask, padding = a["attn_mask"], a["key_padding_mask"]
    if padding is not None and attn_mask is not None and padding.dtype != attn_mask.dtype:
        warnings.warn(
            "Support for mismatched key_padding_mask and attn_mask is deprecated. "
            "Use same type for both instead.",
            stacklevel=4,
        )
    if padding is not None:
        padding = _float_mask(padding, dtype).reshape(batch, 1, 1, -1)
    causal_only = a["is_causal"] and padding is None and not a["need_weights"]
    if causal_only or attn_mask is None:
        return None, padding, causal_only
    attn_mask = _float_mask(attn_mask, dtype)
    if attn_mask.dim() == 2:
        return attn_mask[None, None], padding, False
    return attn_mask.reshape(batch, heads, *attn_mask.shape[1:]), padding, False


def _pad_source(mask: Tensor | None) -> Tensor | None:
    """Let one more source position (``bias_k``/``bias_v`` or zero attention) through a mask."""
    return None if mask is None else F.pad(mask, (0, 1))


def _attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    causal: bool,
    dropout_p: float,
    need_weights: bool,
) -> tuple[Tensor, Tensor | None]:
    """Softmax attention of ``[N, H, L, d]`` queries over ``[N, H, S, d]`` keys and values.

    Without attention weights and dropout: ``F.scaled_dot_product_attention``, as PyTorch.
    Otherwise explicit, with ``F.dropout`` on the weights (so a mode sees the randomness).
    """
    if not need_weights and dropout_p == 0.0:
        return F.scaled_dot_product_attention(q, k, v, mask, 0.0, causal), None
    scores = (q * math.sqrt(1.0 / q.shape[-1])) @ k.transpose(-2, -1)
    if causal:  # upper-left aligned, as scaled_dot_product_attention's is_causal
        allowed = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~allowed, float("-inf"))
    if mask is not None:
        scores = scores + mask
    weights = torch.softmax(scores, dim=-1)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    return weights @ v, weights if need_weights else None


def run_attention(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Tensor, Tensor | None]:
    """Evaluate ``F.multi_head_attention_forward`` out of place, from ``F.linear`` calls.

    Every ``F.linear`` input and output has the sample index at dim 0. Only for calls that
    :func:`supports_attention` accepts.

    Args:
        args: Positional arguments of an ``F.multi_head_attention_forward`` call, as
            intercepted by a ``TorchFunctionMode``.
        kwargs: Its keyword arguments.

    Returns:
        ``(attn_output, attn_weights)`` with PyTorch's shapes: ``[L, N, E]`` (``[L, E]``
        unbatched, contiguous) and, if ``need_weights``, ``[N, L, S]`` averaged over heads or
        ``[N, H, L, S]`` (no ``N`` unbatched), else ``None``.

    Raises:
        ValueError: For a call :func:`supports_attention` refuses.

    Example:
        >>> mha = torch.nn.MultiheadAttention(4, 2)
        >>> x = torch.randn(3, 2, 4)
        >>> args = (x, x, x, 4, 2, mha.in_proj_weight, mha.in_proj_bias, None, None, False,
        ...         0.0, mha.out_proj.weight, mha.out_proj.bias)
        >>> out, weights = run_attention(args, {})
        >>> expected, expected_weights = F.multi_head_attention_forward(*args)
        >>> torch.allclose(out, expected, atol=1e-6), weights.shape
        (True, torch.Size([2, 3, 3]))
    """
    a = _bind(args, kwargs)
    if not _reproducible(a):
        raise ValueError(
            "run_attention cannot reproduce this F.multi_head_attention_forward call "
            "(static_k/static_v, nested tensors or invalid arguments); call the function itself"
        )
    batched = a["query"].dim() == 3
    query, key, value = _batch_first(a["query"], a["key"], a["value"])
    batch, length, embed_dim = query.shape
    heads = a["num_heads"]

    if a["use_separate_proj_weight"]:
        q, k, v = _separate_projection(query, key, value, a)
    else:
        q, k, v = _packed_projection(query, key, value, a["in_proj_weight"], a["in_proj_bias"])

    attn_mask, padding, causal = _masks(a, batch, heads, q.dtype)
    extra_sources = []
    if a["bias_k"] is not None:  # [1, 1, E] leaves: one more key and value per sample
        extra_sources.append((a["bias_k"].expand(batch, 1, -1), a["bias_v"].expand(batch, 1, -1)))
    if a["add_zero_attn"]:
        extra_sources.append((k.new_zeros(batch, 1, embed_dim), v.new_zeros(batch, 1, embed_dim)))
    for extra_k, extra_v in extra_sources:
        k, v = torch.cat([k, extra_k], dim=1), torch.cat([v, extra_v], dim=1)
        attn_mask, padding = _pad_source(attn_mask), _pad_source(padding)
    mask = padding if attn_mask is None else attn_mask if padding is None else attn_mask + padding

    def heads_first(t: Tensor) -> Tensor:
        return torch.unflatten(t, -1, (heads, -1)).transpose(1, 2)  # [N, S, E] -> [N, H, S, E/H]

    dropout_p = float(a["dropout_p"]) if a["training"] else 0.0
    attended, weights = _attend(
        heads_first(q), heads_first(k), heads_first(v), mask, causal, dropout_p, a["need_weights"]
    )
    merged = attended.transpose(1, 2).reshape(batch, length, embed_dim)
    out = F.linear(merged, a["out_proj_weight"], a["out_proj_bias"])  # [N, L, E]
    out = out.transpose(0, 1).contiguous() if batched else out.squeeze(0)
    if weights is not None:
        weights = weights.mean(dim=1) if a["average_attn_weights"] else weights
        weights = weights if batched else weights.squeeze(0)
    return out, weights
