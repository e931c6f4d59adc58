"""Out-of-place re-implementation of PyTorch's fused recurrent kernels.

``nn.RNN``, ``nn.GRU`` and ``nn.LSTM`` call the fused ops ``torch.rnn_tanh``, ``torch.rnn_relu``,
``torch.gru`` and ``torch.lstm`` (``torch._VF.*``). ``torch.func.vmap`` cannot batch them and
they hide every use of a weight inside C++. :func:`run_recurrent` evaluates the same computation
from ``F.linear`` (one call over the whole sequence for the input weights of a layer-direction,
one call per time step for the hidden weights, one per step for LSTM projections), elementwise
ops, ``torch.stack``/``torch.cat`` and ``F.dropout``, all out of place.

Every ``F.linear`` input and output keeps the sample (batch) index at dim 0: the scan works on
batch-first ``[N, T, ...]`` tensors and only transposes at the boundaries.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "CELL_OPS",
    "CUDNN_WEIGHT_LAYOUT",
    "PACK_PADDED_SEQUENCE",
    "RECURRENT_OPS",
    "is_packed",
    "run_cell",
    "run_recurrent",
]

RECURRENT_OPS: frozenset[Callable[..., Any]] = frozenset(
    {torch.lstm, torch.gru, torch.rnn_tanh, torch.rnn_relu}
)

PACK_PADDED_SEQUENCE: Callable[..., Any] = torch._pack_padded_sequence
"""The op of ``torch.nn.utils.rnn.pack_padded_sequence`` (and ``pack_sequence``).

A recurrent op on its packed data runs fused, differentiated by autograd: the packed data
has no sample dim, and under ``vmap`` (a sample at a time) its length would depend on the
sample's. Models that pack run their samples one by one where packfunc maps over them."""

CUDNN_WEIGHT_LAYOUT: Callable[..., Any] = torch._cudnn_rnn_flatten_weight
"""cuDNN's re-layout of an RNN's weights into one buffer (``nn.RNNBase.flatten_parameters``).

On CUDA every forward whose weights were swapped in (as ``functional_call`` does) calls it,
and it re-points the weights' storage into a new buffer. The modes skip it: the decomposed
RNN does not use that layout, the user's parameters keep their storage, and a forward makes
the same calls whether or not the weights were swapped since the last one."""

# Names of the padded-input overload, e.g. ``lstm(input, hx, params, has_biases, ...)``.
_ARG_NAMES: tuple[str, ...] = ("input", "hx", "params", "has_biases", "num_layers")
_ARG_NAMES += ("dropout", "train", "bidirectional", "batch_first")

# Names of the packed overload: ``lstm(data, batch_sizes, hx, params, ...)``, no batch_first.
_PACKED_ARG_NAMES = ("data", "batch_sizes", *_ARG_NAMES[1:-1])

State = tuple[Tensor, ...]  # (h,) for RNN/GRU, (h, c) for LSTM; each [N, H]


class _Weights(NamedTuple):
    """Parameters of one layer-direction, in PyTorch's flat-weight order."""

    w_ih: Tensor
    w_hh: Tensor
    b_ih: Tensor | None
    b_hh: Tensor | None
    w_hr: Tensor | None  # LSTM projection (proj_size > 0) only


Cell = Callable[[Tensor, State, _Weights], State]


def _rnn_cell(x_gates: Tensor, state: State, w: _Weights, act: Callable[[Tensor], Tensor]) -> State:
    """Elman step ``h' = act(W_ih x + b_ih + W_hh h + b_hh)``; ``x_gates`` is precomputed."""
    (h,) = state
    return (act(x_gates + F.linear(h, w.w_hh, w.b_hh)),)


def _gru_cell(x_gates: Tensor, state: State, w: _Weights) -> State:
    """GRU step with gate order r, z, n and ``n = tanh(x_n + r * (W_hn h + b_hn))``."""
    (h,) = state
    x_r, x_z, x_n = x_gates.chunk(3, dim=-1)
    h_r, h_z, h_n = F.linear(h, w.w_hh, w.b_hh).chunk(3, dim=-1)
    r = torch.sigmoid(x_r + h_r)
    z = torch.sigmoid(x_z + h_z)
    n = torch.tanh(x_n + r * h_n)
    return (n + z * (h - n),)


def _lstm_cell(x_gates: Tensor, state: State, w: _Weights) -> State:
    """LSTM step with gate order i, f, g, o and optional projection ``h = W_hr h``."""
    h, c = state
    i, f, g, o = (x_gates + F.linear(h, w.w_hh, w.b_hh)).chunk(4, dim=-1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    h = torch.sigmoid(o) * torch.tanh(c)
    if w.w_hr is not None:
        h = F.linear(h, w.w_hr)
    return h, c


_CELLS: dict[Any, Cell] = {
    torch.rnn_tanh: partial(_rnn_cell, act=torch.tanh),
    torch.rnn_relu: partial(_rnn_cell, act=torch.relu),
    torch.gru: _gru_cell,
    torch.lstm: _lstm_cell,
}


CELL_OPS: dict[Any, Cell] = {
    torch.rnn_tanh_cell: _CELLS[torch.rnn_tanh],
    torch.rnn_relu_cell: _CELLS[torch.rnn_relu],
    torch.gru_cell: _gru_cell,
    torch.lstm_cell: _lstm_cell,
}
"""The one-step ops of ``nn.RNNCell``, ``nn.GRUCell`` and ``nn.LSTMCell`` (``torch._VF.*_cell``),
by the step that computes them out of place."""


def run_cell(
    func: Any,
    input: Tensor,
    hx: Tensor | Sequence[Tensor],
    w_ih: Tensor,
    w_hh: Tensor,
    b_ih: Tensor | None = None,
    b_hh: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Evaluate one of :data:`CELL_OPS` out of place; the same outputs as ``func``'s.

    The fused cells add their gates in place, which ``vmap`` cannot batch when one operand
    carries samples and the other does not (a zero initial state); their weights are used
    inside C++. Here every weight is an ``F.linear`` call.

    Args:
        func: ``torch.lstm_cell``, ``torch.gru_cell``, ``torch.rnn_tanh_cell`` or
            ``torch.rnn_relu_cell``.
        input: ``[N, in]``.
        hx: The state: ``h`` (``[N, H]``), or ``(h, c)`` for ``torch.lstm_cell``.
        w_ih: Input weights ``[G·H, in]`` (``G`` gates).
        w_hh: Hidden weights ``[G·H, H]``.
        b_ih: Input bias, or ``None``.
        b_hh: Hidden bias, or ``None``.

    Returns:
        The new ``h``, or ``(h, c)`` for ``torch.lstm_cell``.

    Example:
        >>> cell = torch.nn.GRUCell(3, 4)
        >>> x, h = torch.randn(2, 3), torch.randn(2, 4)
        >>> weights = (cell.weight_ih, cell.weight_hh, cell.bias_ih, cell.bias_hh)
        >>> torch.allclose(run_cell(torch.gru_cell, x, h, *weights), cell(x, h), atol=1e-6)
        True
    """
    state = tuple(hx) if func is torch.lstm_cell else (hx,)
    weights = _Weights(w_ih, w_hh, b_ih, b_hh, None)
    found = CELL_OPS[func](F.linear(input, w_ih, b_ih), cast(State, state), weights)
    return (found[0], found[1]) if func is torch.lstm_cell else found[0]


def _scan(cell: Cell, x: Tensor, state: State, w: _Weights, reverse: bool) -> tuple[Tensor, State]:
    """Run one layer-direction over a batch-first sequence ``x`` of shape ``[N, T, in]``.

    Returns the outputs ``[N, T, H_out]`` (in original time order) and the final state.
    """
    x_gates = F.linear(x, w.w_ih, w.b_ih).unbind(1)  # one input projection for all steps
    outputs = []
    for x_t in reversed(x_gates) if reverse else x_gates:
        state = cell(x_t, state, w)
        outputs.append(state[0])
    if reverse:
        outputs.reverse()
    return torch.stack(outputs, dim=1), state


def _split_weights(params: Sequence[Tensor], has_biases: bool, groups: int) -> list[_Weights]:
    """Split PyTorch's flat weight list into one :class:`_Weights` per layer-direction."""
    per, rest = divmod(len(params), groups)
    base = 4 if has_biases else 2
    if rest or per not in (base, base + 1):
        raise ValueError(
            f"cannot split {len(params)} flat weights into {groups} layer-directions "
            f"(has_biases={has_biases})"
        )
    weights = []
    for k in range(0, len(params), per):
        group = list(params[k : k + per])
        b_ih, b_hh = group[2:4] if has_biases else (None, None)
        w_hr = group[base] if per > base else None
        weights.append(_Weights(group[0], group[1], b_ih, b_hh, w_hr))
    return weights


def is_packed(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a recurrent op call is the packed overload ``(data, batch_sizes, ...)``."""
    return "batch_sizes" in kwargs or (len(args) > 3 and isinstance(args[3], (list, tuple)))


def _bind(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Map positional and keyword arguments onto the names of the overload called."""
    names = _PACKED_ARG_NAMES if is_packed(args, kwargs) else _ARG_NAMES
    bound = dict(zip(names, args, strict=False))
    bound.update(kwargs)
    missing = [name for name in names if name not in bound]
    if missing:
        raise TypeError(f"recurrent op is missing arguments {missing}")
    return bound


def _scan_packed(
    cell: Cell, data: Tensor, sizes: list[int], state: State, w: _Weights, reverse: bool
) -> tuple[Tensor, State]:
    """Run one layer-direction over packed ``data`` ``[S, in]`` (time-major, ``sizes[t]`` rows).

    Step ``t`` updates the states of the first ``sizes[t]`` samples (those still running;
    packing sorts them by length); the others keep theirs. Backwards, a sample's state
    starts from its initial one at its last step.

    Returns the outputs ``[S, H_out]`` (in the data's order) and the final state.
    """
    x_gates = F.linear(data, w.w_ih, w.b_ih).split(sizes)
    initial, active = state, sizes[-1] if reverse else sizes[0]
    state = tuple(s[:active] for s in initial)
    outputs: list[Tensor] = []
    for t in reversed(range(len(sizes))) if reverse else range(len(sizes)):
        size = sizes[t]
        if size > active:  # (backwards only: samples whose last step this is join)
            state = tuple(torch.cat([s, s0[active:size]]) for s, s0 in zip(state, initial))
        stepped = cell(x_gates[t], tuple(s[:size] for s in state), w)
        if size < len(state[0]):  # (forwards: the samples that ended keep their state)
            stepped = tuple(torch.cat([a, s[size:]]) for a, s in zip(stepped, state))
        state, active = stepped, max(active, size)
        outputs.append(state[0][:size])
    if reverse:
        outputs.reverse()
    return torch.cat(outputs), state


def run_recurrent(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Tensor, ...]:
    """Evaluate a recurrent op out of place; same outputs as ``func(*args, **kwargs)``.

    Args:
        func: One of :data:`RECURRENT_OPS` (``torch.lstm``, ``torch.gru``, ``torch.rnn_tanh``,
            ``torch.rnn_relu``), as intercepted by a ``TorchFunctionMode``.
        args: Positional arguments ``(input, hx, flat_weights, has_biases, num_layers, dropout,
            training, bidirectional, batch_first)``; for ``torch.lstm``, ``hx`` is ``(h0, c0)``.
            The packed overload (``nn.LSTM`` on a ``PackedSequence``) takes ``(data,
            batch_sizes, hx, flat_weights, has_biases, num_layers, dropout, training,
            bidirectional)``.
        kwargs: Keyword arguments of the same call (may supply any of the above by name).

    Returns:
        ``(output, h_n, c_n)`` for ``torch.lstm``, ``(output, h_n)`` otherwise, with PyTorch's
        shapes: ``output`` is ``[T, N, D * H_out]`` (``[N, T, ...]`` if ``batch_first``; the
        packed rows ``[S, D * H_out]`` for packed data) and the states are
        ``[num_layers * D, N, H]``.

    Raises:
        ValueError: If ``func`` is not a recurrent op or the flat weights do not fit.

    Example:
        >>> gru = torch.nn.GRU(3, 4, batch_first=True)
        >>> x, h0 = torch.randn(2, 5, 3), torch.zeros(1, 2, 4)
        >>> args = (x, h0, gru._flat_weights, True, 1, 0.0, False, False, True)
        >>> out, h_n = run_recurrent(torch.gru, args, {})
        >>> torch.allclose(out, torch.gru(*args)[0], atol=1e-6)
        True
    """
    if func not in _CELLS:
        raise ValueError(f"{func} is not one of the recurrent ops {sorted(map(str, _CELLS))}")
    a = _bind(tuple(args), dict(kwargs))
    if "data" in a:
        return _run_packed(func, a)
    num_layers, batch_first = int(a["num_layers"]), bool(a["batch_first"])
    num_dirs = 2 if a["bidirectional"] else 1
    initial = tuple(a["hx"]) if func is torch.lstm else (a["hx"],)  # each [L * D, N, H]
    weights = _split_weights(a["params"], bool(a["has_biases"]), num_layers * num_dirs)
    p, training = float(a["dropout"]), bool(a["train"])

    x = a["input"] if batch_first else a["input"].transpose(0, 1)  # [N, T, in]
    finals: list[State] = []
    for layer in range(num_layers):
        if layer > 0 and p > 0 and training:  # dropout on every layer output but the last
            # (drawn time-major, as torch's own kernels draw it: the same masks)
            x = F.dropout(x.transpose(0, 1).contiguous(), p=p, training=training).transpose(0, 1)
        outputs = []
        for direction in range(num_dirs):
            k = layer * num_dirs + direction
            state = tuple(s[k] for s in initial)
            out, state = _scan(_CELLS[func], x, state, weights[k], reverse=direction == 1)
            outputs.append(out)
            finals.append(state)
        x = outputs[0] if num_dirs == 1 else torch.cat(outputs, dim=-1)

    output = x if batch_first else x.transpose(0, 1).contiguous()
    return (output, *(torch.stack(parts) for parts in zip(*finals, strict=True)))


def _run_packed(func: Any, a: dict[str, Any]) -> tuple[Tensor, ...]:
    """:func:`run_recurrent` of the packed overload ``(data, batch_sizes, hx, ...)``.

    Returns ``(data, h_n[, c_n])``: the packed outputs ``[S, D * H_out]`` and the final
    states ``[num_layers * D, N, H]``, in the packed (length-sorted) sample order.
    """
    num_layers, num_dirs = int(a["num_layers"]), 2 if a["bidirectional"] else 1
    sizes = [int(size) for size in a["batch_sizes"].tolist()]
    initial = tuple(a["hx"]) if func is torch.lstm else (a["hx"],)
    weights = _split_weights(a["params"], bool(a["has_biases"]), num_layers * num_dirs)
    p, training = float(a["dropout"]), bool(a["train"])
    x: Tensor = a["data"]
    finals: list[State] = []
    for layer in range(num_layers):
        if layer > 0 and p > 0 and training:
            x = F.dropout(x, p=p, training=training)
        outputs = []
        for direction in range(num_dirs):
            k = layer * num_dirs + direction
            state = tuple(s[k] for s in initial)
            out, state = _scan_packed(
                _CELLS[func], x, sizes, state, weights[k], reverse=direction == 1
            )
            outputs.append(out)
            finals.append(state)
        x = outputs[0] if num_dirs == 1 else torch.cat(outputs, dim=-1)
    return (x, *(torch.stack(parts) for parts in zip(*finals, strict=True)))
