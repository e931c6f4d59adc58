"""Where the batch lies in discovery's tensors: the dims that carry the samples.

Discovery runs one sample, so the batch dim has one element there, as may any other dim: a
sequence-first ``[T, N, d]`` tensor is ``[T, 1, d]``, and a move of its rows along dim 1 is
the identity on one sample but gives each of the batch's rows to another sample. The dims
that carry the batch are followed from the inputs (dim 0) through the calls that move dims
(transposes, permutes, ``unsqueeze``, ``stack``, basic indexing, ``einsum``) and the calls
that keep them; where a call's effect on them is unknown, discovery takes dim 0 and every dim
of one element for the batch's (``_DiscoveryMode._moves_the_batch``).
"""

from __future__ import annotations

import string
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from packfunc.engine.ops import is_integer_index, out_of_place_name

Dims = frozenset[int]
"""The dims of a tensor that carry the batch (one, unless broadcasting merged two)."""

_SWAPS = frozenset({"transpose", "swapaxes", "swapdims"})
_MOVES = frozenset({"movedim", "moveaxis"})
_RESHAPES = frozenset(
    {"view", "reshape", "flatten", "unflatten", "view_as", "reshape_as", "ravel", "as_strided"}
)
"""Calls that lay the entries out anew (see :func:`_reshaped`)."""

_MOVE_DIMS = _SWAPS | _MOVES | _RESHAPES | {"t", "permute", "__get__", "rot90"}
_UNTRACKED = frozenset(
    {
        "new_zeros",
        "new_ones",
        "new_full",
        "new_empty",
        "new_tensor",
        "tensordot",
        "kron",
        "outer",
        "ger",
        "diag_embed",
        "diagonal",
        "unfold",
        "fold",
        "repeat_interleave",
        "select",
    }
)
"""Calls whose output's dims are not the input's in place (``h.new_zeros(1, N, d)``)."""
_APPENDS_DIMS = frozenset({"embedding", "one_hot"})
_BROADCASTS = frozenset(
    {
        "add",
        "sub",
        "mul",
        "div",
        "true_divide",
        "pow",
        "where",
        "maximum",
        "minimum",
        "masked_fill",
        "expand",
        "expand_as",
        "broadcast_to",
        "matmul",
        "__add__",
        "__radd__",
        "__sub__",
        "__rsub__",
        "__mul__",
        "__rmul__",
        "__truediv__",
        "__rtruediv__",
        "__matmul__",
        "__rmatmul__",
        "__pow__",
        "__eq__",
        "__ne__",
        "__lt__",
        "__le__",
        "__gt__",
        "__ge__",
        "__and__",
        "__or__",
    }
)
"""Calls that line their inputs' dims up from the right (broadcasting)."""
_REDUCTIONS = frozenset(
    {
        "sum",
        "mean",
        "nansum",
        "nanmean",
        "prod",
        "amax",
        "amin",
        "max",
        "min",
        "argmax",
        "argmin",
        "norm",
        "std",
        "var",
        "logsumexp",
        "all",
        "any",
        "count_nonzero",
        "median",
    }
)
"""Calls that reduce the dims their ``dim`` names (all, without one)."""
"""Calls whose output has the input's number of dims but may have them elsewhere (``__get__``
is another property's than ``x.T``, ``x.mT``)."""


def batch_dims_after(
    func: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    out: Tensor,
    carriers: Sequence[tuple[Tensor, Dims | None]],
) -> Dims | None:
    """The dims of a call's output that carry the batch, from those of its inputs.

    Args:
        func: The function called.
        args: Its positional arguments (``self`` first).
        kwargs: Its keyword arguments.
        out: One tensor output of the call.
        carriers: The call's arguments that carry samples, with their known batch dims.

    Returns:
        The output's batch dims, or ``None`` where the call does not tell.

    Example:
        >>> h = torch.ones(1, 5, 3)
        >>> batch_dims_after(Tensor.transpose, (h, 0, 1), {}, h.transpose(0, 1),
        ...                  [(h, frozenset({0}))])
        frozenset({1})
    """
    if not carriers or any(dims is None for _, dims in carriers):
        return None
    name = out_of_place_name(func)
    if name == "__get__":  # a property: x.T, x.mT
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    first = args[0] if args else kwargs.get("input")
    of_first = next((dims for tensor, dims in carriers if tensor is first), None)
    if isinstance(first, Tensor) and of_first is not None:
        told, moved = _moved_by(name, args, kwargs, first, out, of_first)
        if told:
            return moved
    if name == "stack":
        return _stacked(args, kwargs, carriers)
    if name == "einsum":
        return _einsum_output_dims(args, carriers)
    if name in _MOVE_DIMS or name in _UNTRACKED:
        return None
    if name in _APPENDS_DIMS:  # embedding(ids): the ids' dims lead the output's
        return of_first
    if name in _REDUCTIONS and isinstance(first, Tensor) and of_first is not None:
        return _reduced(args, kwargs, first, of_first) if len(carriers) == 1 else None
    highest = max(tensor.dim() for tensor, _ in carriers)
    if highest > out.dim() or (highest < out.dim() and name not in _BROADCASTS):
        return None
    # each carrier's dims aligned from the right, as broadcasting lines them up
    aligned = {frozenset(d + out.dim() - t.dim() for d in dims or ()) for t, dims in carriers}
    return aligned.pop() if len(aligned) == 1 else None


_ELEMENTWISE_BROADCASTS = _BROADCASTS - {
    "expand",
    "expand_as",
    "broadcast_to",
    "matmul",
    "__matmul__",
    "__rmatmul__",
}
"""Calls that broadcast their inputs elementwise (no dims of their own)."""


def broadcasts_the_batch(
    func: Callable[..., Any], out: Tensor, carriers: Sequence[tuple[Tensor, Dims | None]]
) -> bool:
    """Whether broadcasting lines a sample's batch dim up with a longer dim of the output.

    Discovery's one sample has a batch dim of one element; an elementwise call that stretches
    it over another dim of the output (``pos(positions)`` of ``[N, d]`` added to ``[N, T, d]``
    lines ``N`` up with ``T``) makes the batch's rows meet positions: with ``N = T`` no error
    says so, and values equal at initialization (a position table of zeros) pass the output
    check. A batch whose size is that dim's gives wrong per-sample values, any other an error.

    Args:
        func: The function called.
        out: One tensor output of the call.
        carriers: The call's arguments that carry samples, with their known batch dims.

    Returns:
        ``True`` where some carrier's batch dim of one element lies on a longer output dim
        (only a carrier whose batch dim is known to be one: several are a guess).

    Example:
        >>> tokens, positions = torch.ones(1, 4, 2), torch.ones(1, 2)
        >>> broadcasts_the_batch(torch.add, tokens + positions,
        ...                      [(tokens, frozenset({0})), (positions, frozenset({0}))])
        True
    """
    if out_of_place_name(func) not in _ELEMENTWISE_BROADCASTS:
        return False
    for tensor, dims in carriers:
        if dims is None or len(dims) != 1:  # (several: not known which, see the module)
            continue
        (d,) = dims
        aligned = d + out.dim() - tensor.dim()
        if 0 <= aligned < out.dim() and tensor.shape[d] == 1 and out.shape[aligned] > 1:
            return True
    return False


def _moved_by(
    name: str, args: tuple[Any, ...], kwargs: dict[str, Any], first: Tensor, out: Tensor, dims: Dims
) -> tuple[bool, Dims | None]:
    """Whether a call moves its first argument's dims, and the batch dims after it."""
    ndim = first.dim()
    if name in _SWAPS:
        a, b = (_dim_argument(args, kwargs, i, key, ndim) for i, key in ((1, "dim0"), (2, "dim1")))
        if a is None or b is None:
            return True, None
        return True, _swapped(dims, a, b)
    if name in ("t", "T", "H"):  # (T of more than two dims reverses them all)
        return True, frozenset(ndim - 1 - d for d in dims)
    if name in ("mT", "mH", "adjoint"):
        return True, _swapped(dims, ndim - 2, ndim - 1)
    if name == "permute":
        order = args[1:] if len(args) > 2 or not args[1:] else args[1]
        order = kwargs.get("dims", order)
        order = [d % ndim for d in (order if isinstance(order, Sequence) else [order])]
        return True, (frozenset(order.index(d) for d in dims) if len(order) == ndim else None)
    if name in _MOVES:
        return True, _after_movedim(args, kwargs, ndim, dims)
    if name == "unsqueeze":
        dim = _dim_argument(args, kwargs, 1, "dim", out.dim())
        return True, (None if dim is None else frozenset(d + (d >= dim) for d in dims))
    if name == "squeeze":
        return True, _squeezed(args, kwargs, first, dims)
    if name == "__getitem__" and len(args) > 1:
        return True, _indexed(args[1], ndim, dims)
    if name in _RESHAPES:
        return True, _reshaped(first, out, dims)
    if name == "rot90":
        turns = args[1] if len(args) > 1 else kwargs.get("k", 1)
        pair = args[2] if len(args) > 2 else kwargs.get("dims", (0, 1))
        a, b = (d % ndim for d in pair)
        return True, (_swapped(dims, a, b) if turns % 2 else dims)
    return False, None


def _reshaped(first: Tensor, out: Tensor, dims: Dims) -> Dims | None:
    """The batch dims after a reshape: where the dims before the batch's are kept.

    The batch dim ``b`` stays where the output has the input's sizes before it and one
    element at ``b``; dims of one element right after it may be the batch too (one sample
    cannot tell ``h.reshape(1, -1, d)`` from ``h.reshape(N, 1, d)``).
    """
    if len(dims) != 1:
        return None
    (b,) = dims
    if out.dim() <= b or out.shape[:b] != first.shape[:b] or out.shape[b] != 1:
        return None
    end = b + 1
    while end < out.dim() and out.shape[end] == 1 and out.dim() > first.dim():
        end += 1
    return frozenset(range(b, end))


def _reduced(
    args: tuple[Any, ...], kwargs: dict[str, Any], first: Tensor, dims: Dims
) -> Dims | None:
    """The batch dims after a reduction along ``dim`` (``None`` where it reduces a batch dim)."""
    gone = _reduced_dims(args, kwargs, first)
    if gone & dims:
        return None
    keepdim = args[2] if len(args) > 2 and isinstance(args[2], bool) else kwargs.get("keepdim")
    return dims if keepdim else _without(dims, gone)


def _reduced_dims(args: tuple[Any, ...], kwargs: dict[str, Any], first: Tensor) -> frozenset[int]:
    """The dims a reduction (``sum``, ``mean``, ``amax`` ...) of ``first`` reduces.

    Example:
        >>> sorted(_reduced_dims((torch.ones(2, 3, 4), (0, -1)), {}, torch.ones(2, 3, 4)))
        [0, 2]
    """
    chosen = args[1] if len(args) > 1 and not isinstance(args[1], torch.dtype) else None
    chosen = kwargs.get("dim", chosen)
    if chosen is None:
        return frozenset(range(first.dim()))
    listed = [chosen] if isinstance(chosen, int) else list(chosen)
    return frozenset(d % max(first.dim(), 1) for d in listed)


def _dim_argument(
    args: tuple[Any, ...], kwargs: dict[str, Any], position: int, key: str, ndim: int
) -> int | None:
    """A dim argument, made non-negative; ``None`` where it is missing or not an integer."""
    value = args[position] if len(args) > position else kwargs.get(key)
    return value % ndim if isinstance(value, int) and ndim else None


def _after_movedim(args: tuple[Any, ...], kwargs: dict[str, Any], ndim: int, dims: Dims) -> Dims:
    """The batch dims after ``movedim(source, destination)``."""
    source = args[1] if len(args) > 1 else kwargs["source"]
    destination = args[2] if len(args) > 2 else kwargs["destination"]
    sources = [s % ndim for s in ([source] if isinstance(source, int) else source)]
    targets = [t % ndim for t in ([destination] if isinstance(destination, int) else destination)]
    order: list[int | None] = [None] * ndim
    for s, t in zip(sources, targets, strict=True):
        order[t] = s
    rest = iter(d for d in range(ndim) if d not in sources)
    filled = [next(rest) if d is None else d for d in order]
    return frozenset(filled.index(d) for d in dims)


def _squeezed(
    args: tuple[Any, ...], kwargs: dict[str, Any], first: Tensor, dims: Dims
) -> Dims | None:
    """The batch dims after ``squeeze``: unknown where a batch dim (of one element) goes."""
    chosen = args[1] if len(args) > 1 else kwargs.get("dim")
    if chosen is None:
        gone = {d for d, size in enumerate(first.shape) if size == 1}
    else:
        listed = [chosen] if isinstance(chosen, int) else list(chosen)
        gone = {d % first.dim() for d in listed if first.shape[d] == 1}
    return None if gone & dims else _without(dims, gone)


def _swapped(dims: Dims, a: int, b: int) -> Dims:
    """The batch dims after dims ``a`` and ``b`` swap places."""
    return frozenset(b if d == a else a if d == b else d for d in dims)


def _without(dims: Dims, gone: set[int] | frozenset[int]) -> Dims:
    """The batch dims after the dims ``gone`` (none of them a batch dim) are removed."""
    return frozenset(d - sum(g < d for g in gone) for d in dims)


def _indexed(index: Any, ndim: int, dims: Dims) -> Dims | None:
    """The batch dims after basic indexing ``x[index]``.

    ``None`` for an advanced index, or an integer taking a batch dim.
    """
    entries = list(index) if isinstance(index, tuple) else [index]
    if not all(_is_basic(entry) for entry in entries):
        return None
    named = sum(entry is not None and entry is not Ellipsis for entry in entries)
    found: set[int] = set()
    source = target = 0
    for entry in entries:
        if entry is None:
            target += 1
        elif entry is Ellipsis:
            skipped = ndim - named
            found |= {target + d - source for d in dims if source <= d < source + skipped}
            source, target = source + skipped, target + skipped
        elif isinstance(entry, slice):
            found |= {target for d in dims if d == source}
            source, target = source + 1, target + 1
        else:  # an integer
            if source in dims:
                return None
            source += 1
    found |= {target + d - source for d in dims if d >= source}
    return frozenset(found)


def _is_basic(entry: Any) -> bool:
    """Whether an index entry is basic: ``None``, ``...``, a slice or an integer."""
    return entry is None or entry is Ellipsis or isinstance(entry, slice) or is_integer_index(entry)


def _stacked(
    args: tuple[Any, ...], kwargs: dict[str, Any], carriers: Sequence[tuple[Tensor, Dims | None]]
) -> Dims | None:
    """The batch dims after ``torch.stack(tensors, dim)``: each input's, shifted past ``dim``."""
    shared = {dims for _, dims in carriers}
    tensors = args[0] if args else kwargs.get("tensors")
    if len(shared) != 1 or not tensors:
        return None
    (dims,) = shared
    assert dims is not None
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    dim %= tensors[0].dim() + 1
    return frozenset(d + (d >= dim) for d in dims)


def _einsum_output_dims(
    args: tuple[Any, ...], carriers: Sequence[tuple[Tensor, Dims | None]]
) -> Dims | None:
    """The batch dims of ``torch.einsum(equation, *operands)``'s output, by the letters."""
    letters = _einsum_letters(args)
    if letters is None:
        return None
    inputs, output = letters
    found: set[int] = set()
    for operand, subscripts in zip(_einsum_operands(args), inputs, strict=False):
        dims = next((d for tensor, d in carriers if tensor is operand), None)
        for d in dims or ():
            if subscripts[d] in output:
                found.add(output.index(subscripts[d]))
    return frozenset(found) or None


def contracted_dims(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[tuple[Tensor, int]]:
    """The dims a product sums over, per operand (``P @ h`` sums over ``h``'s rows).

    Args:
        func: The function called.
        args: Its positional arguments.
        kwargs: Its keyword arguments.

    Returns:
        ``(operand, dim)`` for each contracted dim of ``matmul``/``mm``/``bmm``/``einsum``.

    Example:
        >>> P, h = torch.ones(4, 4), torch.ones(4, 3)
        >>> [(t is h, d) for t, d in contracted_dims(torch.matmul, (P, h), {})]
        [(False, 1), (True, 0)]
    """
    name = getattr(func, "__name__", "").removeprefix("linalg_")
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)]
    if name in ("matmul", "mm", "bmm", "__matmul__", "__rmatmul__", "mv", "inner", "linear"):
        operands = tensors[:2] if name != "__rmatmul__" else tensors[1::-1]
        if len(operands) < 2 or not all(t.dim() for t in operands):
            return []
        a, b = operands
        if name == "inner":
            return [(a, a.dim() - 1), (b, b.dim() - 1)]
        if name == "linear":  # x Wᵀ: W's dim 1
            return [(a, a.dim() - 1), (b, b.dim() - 1)]
        return [(a, a.dim() - 1), (b, max(b.dim() - 2, 0))]
    if name in ("addmm", "baddbmm", "addbmm", "addmv") and len(tensors) >= 3:
        _, a, b = tensors[:3]
        summed = [(a, 0), (b, 0)] if name == "addbmm" else []
        return [*summed, (a, a.dim() - 1), (b, max(b.dim() - 2, 0))]
    if name == "multi_dot" and args and isinstance(args[0], (list, tuple)):
        chain = [t for t in args[0] if isinstance(t, Tensor)]
        return [pair for a, b in zip(chain, chain[1:]) for pair in ((a, a.dim() - 1), (b, 0))]
    if name == "tensordot" and len(tensors) >= 2:
        return _tensordot_dims(
            tensors[0], tensors[1], args[2] if len(args) > 2 else kwargs.get("dims", 2)
        )
    if name == "einsum":
        letters = _einsum_letters(args)
        if letters is None:
            return []
        inputs, output = letters
        return [
            (operand, d)
            for operand, subscripts in zip(_einsum_operands(args), inputs, strict=False)
            for d, letter in enumerate(subscripts)
            if letter not in output
        ]
    return []


def _tensordot_dims(a: Tensor, b: Tensor, dims: Any) -> list[tuple[Tensor, int]]:
    """The dims ``torch.tensordot(a, b, dims)`` sums over."""
    if isinstance(dims, int):
        return [(a, a.dim() - dims + k) for k in range(dims)] + [(b, k) for k in range(dims)]
    first, second = ([d] if isinstance(d, int) else list(d) for d in dims)
    return [(a, d % a.dim()) for d in first] + [(b, d % b.dim()) for d in second]


def _einsum_operands(args: tuple[Any, ...]) -> list[Any]:
    """``torch.einsum``'s operands, given one by one or as a list."""
    rest = list(args[1:])
    return list(rest[0]) if len(rest) == 1 and isinstance(rest[0], (list, tuple)) else rest


def _einsum_letters(args: tuple[Any, ...]) -> tuple[list[str], str] | None:
    """Each operand's subscripts and the output's of an einsum, ``...`` spelled out.

    An ellipsis stands for as many dims as its operand has beyond its letters, lined up
    from the right across operands (as broadcasting does); capital letters name them.
    """
    equation = args[0] if args else None
    operands = _einsum_operands(args)
    if not isinstance(equation, str):
        return None
    equation = equation.replace(" ", "")
    left, arrow, output = equation.partition("->")
    inputs = left.split(",")
    if len(inputs) != len(operands):
        return None
    spelled, widest = [], 0
    for part, operand in zip(inputs, operands, strict=True):
        if "..." in part:
            count = getattr(operand, "ndim", 0) - (len(part) - 3)
            if count < 0:
                return None
            widest = max(widest, count)
            part = part.replace("...", _ELLIPSIS_LETTERS[len(_ELLIPSIS_LETTERS) - count :])
        spelled.append(part)
    if not arrow:  # implicit output: the ellipsis', then the letters seen once, in order
        joined = "".join(inputs).replace("...", "")
        once = "".join(sorted(c for c in set(joined) if joined.count(c) == 1))
        output = _ELLIPSIS_LETTERS[len(_ELLIPSIS_LETTERS) - widest :] + once
    else:
        output = output.replace("...", _ELLIPSIS_LETTERS[len(_ELLIPSIS_LETTERS) - widest :])
    if not all(set(part) <= set(string.ascii_letters) for part in (*spelled, output)):
        return None
    return spelled, output


_ELLIPSIS_LETTERS = string.ascii_uppercase
"""Letters for the dims of an ellipsis, the last ones for the rightmost dims."""


_REDUCTIONS = frozenset(
    {
        "sum",
        "nansum",
        "mean",
        "nanmean",
        "prod",
        "var",
        "std",
        "var_mean",
        "std_mean",
        "amax",
        "amin",
        "max",
        "min",
        "logsumexp",
        "median",
        "nanmedian",
        "softmax",
        "log_softmax",
        "cumsum",
        "cumprod",
        "logcumsumexp",
        "norm",
        "vector_norm",
    }
)
"""Calls that combine the entries along their dims (see :func:`reduced_dims`)."""
_DIM_AFTER_ORDER = frozenset({"norm", "vector_norm"})
"""Reductions whose ``dim`` comes after an order ``p`` (``torch.norm(x, p, dim)``)."""


def reduced_dims(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[int, ...] | None:
    """The dims a reduction of its first argument combines (``()``: all of them).

    Args:
        func: The function called.
        args: Its positional arguments.
        kwargs: Its keyword arguments.

    Returns:
        The dims, ``()`` for a reduction over every dim, ``None`` for a call that is not a
        reduction (``torch.max(a, b)`` is elementwise).

    Example:
        >>> h = torch.ones(2, 3)
        >>> reduced_dims(torch.mean, (h, 0), {}), reduced_dims(torch.sum, (h,), {})
        ((0,), ())
        >>> reduced_dims(torch.max, (h, h), {}) is None, reduced_dims(Tensor.sum, (h,), {"axis": 1})
        (True, (1,))
    """
    name = out_of_place_name(func).removeprefix("linalg_")
    if name not in _REDUCTIONS or not args or not isinstance(args[0], Tensor):
        return None
    position = 2 if name in _DIM_AFTER_ORDER else 1
    dim = kwargs.get("dim", kwargs.get("axis", args[position] if len(args) > position else None))
    if isinstance(dim, Tensor):  # torch.max(a, b): elementwise
        return None
    if dim is None or isinstance(dim, bool):  # (torch.std(x, True): unbiased, every dim)
        return ()
    if isinstance(dim, int):
        return (dim,)
    if isinstance(dim, list | tuple) and all(isinstance(d, int) for d in dim):
        return tuple(dim)
    return None
