"""Ops whose batching rules in torch give wrong derivatives: run as ops whose rules are exact.

The Hessian paths differentiate the model twice under ``vmap`` over samples and then
over tangents. For ``torch.prelu`` torch's batching rules of its backward mix the two
levels (an error, or wrong values where the two sizes are equal). Its decomposition into
``where`` and ``mul`` has exact rules. ``torch.linalg.solve`` (and ``solve_ex``) of a matrix
broadcast against a right-hand side with batch dims (a parameter ``A [n, n]`` and one sample's
``[1, n, k]``) has a backward whose rule is wrong under a single ``vmap`` over
cotangents (silently) or over samples (an error); with both operands expanded to their
common batch shape first it is exact. The fused recurrent cells (``nn.LSTMCell`` and the
others' ``torch.lstm_cell``...) add their gates in place, which ``vmap`` cannot batch against
an unbatched zero state; they run as ``F.linear`` calls and elementwise ops
(:func:`~packfunc.engine.recurrent.run_cell`), whose weights are then layers of their own.
``torch._weight_norm`` (``nn.utils.parametrizations.weight_norm`` and the old
``nn.utils.weight_norm``) runs a fused kernel for ``dim`` 0 or last whose double backward is
wrong (plain autograd and ``torch.func``: half off in a Hessian) and which has no forward-mode
rule; it runs as ``v * (g / ‖v‖)``. ``F.embedding`` with a ``padding_idx`` under ``torch.func``
transforms counts the padding row in its forward-mode derivative (its reverse mode does not:
a GGN product was neither the GGN's nor symmetric); it runs on a weight whose padding row is
a constant. Its ``max_norm``, which renormalizes the weight in place, is refused before it
does (``F.embedding_bag``'s too). ``F.embedding_bag`` has neither a forward-mode rule nor a
second derivative; under transforms it runs as rows gathered from the table and reduced per
bag, which have both. ``F.hardsigmoid``'s backward has no derivative: it runs as ``where``.
The modes and the op-local rule run these in the ops' place; the values are the ops' own.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
from torch import Tensor
from torch._C._functorch import is_functorch_wrapped_tensor

from packfunc.engine.ops import bag_option, refuse_coupled_embedding, refuse_renormalizing
from packfunc.engine.recurrent import CELL_OPS, run_cell

__all__ = [
    "DECOMPOSED_OPS",
    "ONLY_UNDER_TRANSFORMS",
    "bag_reduction",
    "embedding",
    "embedding_bag",
    "hardsigmoid",
    "linalg_solve",
    "linalg_solve_ex",
    "pack_padded_sequence",
    "pad_packed_sequence",
    "prelu",
    "run_decomposed",
    "weight_norm",
]


def prelu(input: Tensor, weight: Tensor) -> Tensor:
    """``torch.prelu`` as ``where(x ≥ 0, x, a·x)``, ``a`` per channel (dim 1) or one for all.

    Args:
        input: Any tensor; its dim 1 holds the channels where it has two dims or more.
        weight: One slope, or one per channel.

    Returns:
        ``torch.prelu(input, weight)``.

    Example:
        >>> x, a = torch.randn(2, 3, 4), torch.rand(3)
        >>> torch.allclose(prelu(x, a), torch.prelu(x, a))
        True
    """
    if weight.numel() == 1 or input.dim() < 2:
        slope = weight.reshape(())
    else:
        slope = weight.reshape(1, -1, *[1] * (input.dim() - 2))
    return torch.where(input >= 0, input, slope * input)


_SOLVING = threading.local()
"""Set while a decomposed solve runs its own solve (which is not decomposed again)."""


def _common_batch(A: Tensor, B: Tensor) -> tuple[Tensor, Tensor, bool] | None:
    """A solve's operands expanded to their common batch shape; ``None`` inside a decomposition.

    Returns ``(A, B, vector)``: ``vector`` where ``B`` holds vectors (torch's rule: ``B`` of
    one dim, or of ``A``'s shape without its last dim), then expanded as one column. They are
    expanded even where nothing broadcasts (a batch of one), so that the calls are the same
    for any batch size.
    """
    if getattr(_SOLVING, "active", False):
        return None
    vector = B.dim() == 1 or (B.dim() == A.dim() - 1 and B.shape == A.shape[:-1])
    rhs = B.unsqueeze(-1) if vector else B
    batch = torch.broadcast_shapes(A.shape[:-2], rhs.shape[:-2])
    return A.expand(*batch, *A.shape[-2:]), rhs.expand(*batch, *rhs.shape[-2:]), vector


def _expanded_solve(
    solve: Callable[..., Any], A: Tensor, B: Tensor, out: Any, **options: Any
) -> Any:
    """``(solve(A, B, **options), vector)`` on the operands of :func:`_common_batch`.

    ``NotImplemented`` for ``out=`` and inside a decomposition: the op itself runs.
    """
    expanded = None if out is not None else _common_batch(A, B)
    if expanded is None:
        return NotImplemented
    wide, rhs, vector = expanded
    with _solving():
        return solve(wide, rhs, **options), vector


@contextlib.contextmanager
def _solving() -> Iterator[None]:
    """Within the block, solves run as themselves (see :data:`_SOLVING`)."""
    _SOLVING.active = True
    try:
        yield
    finally:
        _SOLVING.active = False


def linalg_solve(A: Tensor, B: Tensor, *, left: bool = True, out: Tensor | None = None) -> Any:
    """``torch.linalg.solve(A, B)`` with ``A`` and ``B`` expanded to their common batch shape.

    Args:
        A: Matrices ``[*, n, n]``.
        B: Right-hand sides ``[*, n, k]`` (``left=False``: ``[*, k, n]``), or vectors
            ``[*, n]`` (torch's rule: ``B`` of one dim, or of ``A``'s shape without its
            last dim).
        left: Solve ``A X = B`` (``False``: ``X A = B``).
        out: Left to torch.

    Returns:
        ``torch.linalg.solve(A, B, left=left)``; ``NotImplemented`` for ``out=`` and for the
        solve a decomposition runs: the op itself runs.

    Example:
        >>> A, B = torch.eye(2) * 2, torch.ones(3, 2, 1)
        >>> torch.equal(linalg_solve(A, B), torch.linalg.solve(A, B))
        True
    """
    found = _expanded_solve(torch.linalg.solve, A, B, out, left=left)
    if found is NotImplemented:
        return found
    X, vector = found
    return X.squeeze(-1) if vector else X


def linalg_solve_ex(
    A: Tensor,
    B: Tensor,
    *,
    left: bool = True,
    check_errors: bool = False,
    out: tuple[Tensor, Tensor] | None = None,
) -> Any:
    """``torch.linalg.solve_ex(A, B)`` with ``A`` and ``B`` expanded as in :func:`linalg_solve`.

    Args:
        A: Matrices ``[*, n, n]``.
        B: Right-hand sides, as in :func:`linalg_solve`.
        left: Solve ``A X = B`` (``False``: ``X A = B``).
        check_errors: Raise for a singular ``A``.
        out: Left to torch.

    Returns:
        ``(result, info)`` as torch's (``info`` in ``A``'s batch shape); ``NotImplemented``
        as for :func:`linalg_solve`.

    Example:
        >>> A, B = torch.eye(2) * 2, torch.ones(3, 2, 1)
        >>> linalg_solve_ex(A, B).info.shape == torch.linalg.solve_ex(A, B).info.shape
        True
    """
    solved = _expanded_solve(torch.linalg.solve_ex, A, B, out, left=left, check_errors=check_errors)
    if solved is NotImplemented:
        return solved
    found, vector = solved
    # A's own batch: one entry where it was broadcast (its solves' infos are the same)
    info = found.info[(0,) * (found.info.dim() - (A.dim() - 2))]
    for dim, size in enumerate(A.shape[:-2]):
        info = info.narrow(dim, 0, size)
    X = found.result
    return type(found)((X.squeeze(-1) if vector else X, info))


def _fused_weight_norm(v: Tensor, g: Tensor, dim: int) -> bool:
    """Whether ``torch._weight_norm(v, g, dim)`` runs torch's fused kernel.

    Its rule (``aten/src/ATen/native/WeightNorm.cpp``): ``dim`` 0 or ``v.dim() - 1`` as
    given (not ``-1``, nor another negative ``dim``), neither operand half.
    """
    half = torch.float16 in (v.dtype, g.dtype)
    return not half and dim in (0, v.dim() - 1)


def weight_norm(v: Tensor, g: Tensor, dim: int = 0) -> Any:
    """``torch._weight_norm(v, g, dim)`` as ``v * (g / ‖v‖)``, the norm over all dims but ``dim``.

    As torch's: ``dim=-1`` (what ``dim=None`` of ``nn.utils.weight_norm`` becomes) takes the
    norm of the whole of ``v``; another negative ``dim`` counts from the end. Where torch runs
    its fused kernel (:func:`_fused_weight_norm`), ``g`` is read as one value per slice of
    ``dim`` (any shape of that many elements) and a ``bfloat16`` result is computed in
    ``float``; elsewhere ``g`` broadcasts against the norm.

    Args:
        v: The direction.
        g: The magnitude.
        dim: The dim that keeps its own norm (``-1``: none).

    Returns:
        ``torch._weight_norm(v, g, dim)`` (to rounding); ``NotImplemented`` where torch
        refuses the call or reads ``g`` oddly: the op itself runs.

    Example:
        >>> v, g = torch.randn(3, 2, 2), torch.rand(3, 1, 1)
        >>> torch.allclose(weight_norm(v, g, 0), torch._weight_norm(v, g, 0))
        True
    """
    if type(dim) is not int or v.dim() == 0 or not -v.dim() <= dim < v.dim():
        return NotImplemented  # torch's own error (a dim that is no int, or out of range)
    if dim == -1:
        return v * (g / torch.linalg.vector_norm(v))
    kept = dim % v.dim()
    over = [d for d in range(v.dim()) if d != kept]
    if not _fused_weight_norm(v, g, dim):
        return v * (g / torch.linalg.vector_norm(v, dim=over, keepdim=True))
    if v.dtype != g.dtype or g.numel() != v.shape[kept]:
        return NotImplemented  # torch refuses mixed dtypes (and reads past a short g)
    wide = torch.float32 if v.dtype == torch.bfloat16 else v.dtype
    norm = torch.linalg.vector_norm(v.to(wide), dim=over, keepdim=True)
    return (v.to(wide) * (g.to(wide).reshape(norm.shape) / norm)).to(v.dtype)


def run_decomposed(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``func(*args, **kwargs)``, as its decomposition in :data:`DECOMPOSED_OPS` where it has one.

    Args:
        func: The op.
        args: Its positional arguments.
        kwargs: Its keyword arguments.

    Returns:
        The op's output.

    Example:
        >>> run_decomposed(torch.prelu, (torch.tensor([-2.0, 1.0]), torch.tensor([0.5])), {})
        tensor([-1.,  1.])
    """
    decomposition = DECOMPOSED_OPS.get(func)
    out = NotImplemented if decomposition is None else decomposition(*args, **kwargs)
    return func(*args, **kwargs) if out is NotImplemented else out


def embedding(
    input: Tensor,
    weight: Tensor,
    padding_idx: int | None = None,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
) -> Any:
    """``F.embedding`` in packfunc's passes (see the module docstring).

    Args:
        input: Indices.
        weight: The table ``[rows, dim]``.
        padding_idx: The row whose gradient is zero, or ``None``.
        max_norm: Refused where set.
        norm_type: The norm of ``max_norm``.
        scale_grad_by_freq: Refused where set.
        sparse: Sparse gradients (the op itself).

    Returns:
        The rows, or ``NotImplemented`` (the op itself) outside ``torch.func`` transforms.

    Raises:
        ValueError: for ``max_norm`` or ``scale_grad_by_freq``.

    Example:
        >>> embedding(torch.tensor([0]), torch.ones(2, 3), padding_idx=0)
        NotImplemented
    """
    refuse_coupled_embedding({"max_norm": max_norm, "scale_grad_by_freq": scale_grad_by_freq})
    if padding_idx is None or sparse or not is_functorch_wrapped_tensor(weight):
        return NotImplemented
    is_padding = torch.arange(weight.shape[0], device=weight.device) == padding_idx % len(weight)
    constant_padding = torch.where(is_padding[:, None], weight.detach(), weight)
    return torch.nn.functional.embedding(input, constant_padding)


def embedding_bag(*args: Any, **kwargs: Any) -> Any:
    """``F.embedding_bag`` in packfunc's passes: its ``max_norm`` refused before it acts.

    Under ``torch.func`` transforms it runs as rows gathered from the table and reduced per
    bag by :func:`bag_reduction` (torch's kernel has no forward-mode derivative and its
    backward no derivative: the GGN products and the Hessians need both).

    Example:
        >>> embedding_bag(torch.tensor([[0, 1]]), torch.ones(2, 3))
        NotImplemented
    """
    refuse_renormalizing("EmbeddingBag", bag_option(args, kwargs, "max_norm"))
    bound = dict(zip(_BAG_ARGUMENTS, args, strict=False)) | kwargs
    input, weight, offsets = bound["input"], bound["weight"], bound.get("offsets")
    if bound.get("sparse") or not is_functorch_wrapped_tensor(weight):
        return NotImplemented
    if (input.dim() == 2) != (offsets is None) or input.dim() not in (1, 2):
        return NotImplemented  # torch's own message
    return bag_reduction(
        input,
        weight,
        offsets,
        bound.get("mode", "mean"),
        bound.get("per_sample_weights"),
        bool(bound.get("include_last_offset", False)),
        bound.get("padding_idx"),
    )


_BAG_ARGUMENTS = (
    "input",
    "weight",
    "offsets",
    "max_norm",
    "norm_type",
    "scale_grad_by_freq",
    "mode",
    "sparse",
    "per_sample_weights",
    "include_last_offset",
    "padding_idx",
)
"""``F.embedding_bag``'s arguments, in order."""


def bag_reduction(
    input: Tensor,
    weight: Tensor,
    offsets: Tensor | None,
    mode: str,
    per_sample_weights: Tensor | None,
    include_last_offset: bool,
    padding_idx: int | None,
) -> Tensor:
    """``F.embedding_bag`` as a gather of rows and a per-bag ``index_add``/``scatter_reduce``.

    Entries equal to ``padding_idx`` belong to no bag (they go to an extra bag, dropped);
    an empty bag gives zeros, as in torch.

    Args:
        input: Indices: ``[B, L]`` (fixed bags) or ``[M]`` with ``offsets``.
        weight: The table ``[rows, dim]``.
        offsets: Each bag's first entry in a 1-D ``input`` (``None`` for 2-D).
        mode: ``"sum"``, ``"mean"`` or ``"max"``.
        per_sample_weights: Weights of the entries (``"sum"`` only), shaped like ``input``.
        include_last_offset: Whether ``offsets`` ends with the end of the last bag.
        padding_idx: The index that belongs to no bag, or ``None``.

    Returns:
        ``[B, dim]``.

    Example:
        >>> table = torch.arange(6.0).reshape(3, 2)
        >>> bag_reduction(torch.tensor([0, 2, 1]), table, torch.tensor([0, 2]), "sum", None,
        ...               False, None)
        tensor([[4., 6.],
                [2., 3.]])
    """
    entries = input.reshape(-1)
    if offsets is None:
        bags = input.shape[0]
        bag = torch.arange(bags, device=input.device).repeat_interleave(input.shape[1])
    else:
        starts = offsets[:-1] if include_last_offset else offsets
        bags = starts.shape[0]
        position = torch.arange(entries.shape[0], device=input.device)
        bag = torch.bucketize(position, starts, right=True) - 1
        if include_last_offset:  # entries past the last offset belong to no bag
            bag = torch.where(position < offsets[-1], bag, bags)
        bag = torch.where(bag < 0, bags, bag)
    if padding_idx is not None:
        bag = torch.where(entries == padding_idx % weight.shape[0], bags, bag)
    rows = torch.nn.functional.embedding(entries, weight)
    if per_sample_weights is not None:
        rows = rows * per_sample_weights.reshape(-1, 1)
    shape = (bags + 1, weight.shape[1])
    if mode == "max":
        spread = bag[:, None].expand(rows.shape)
        found = rows.new_zeros(shape).scatter_reduce(0, spread, rows, "amax", include_self=False)
        return found[:bags]
    summed = rows.new_zeros(shape).index_add(0, bag, rows)[:bags]
    if mode == "sum":
        return summed
    counts = torch.zeros(bags + 1, dtype=rows.dtype, device=rows.device)
    counts = counts.index_add(0, bag, torch.ones_like(bag, dtype=rows.dtype))[:bags]
    return summed / counts.clamp(min=1)[:, None]


def hardsigmoid(input: Tensor, inplace: bool = False) -> Any:
    """``F.hardsigmoid`` under ``torch.func`` transforms, written with ``where``.

    torch's ``hardsigmoid_backward`` has no derivative (a Hessian through a
    MobileNetV3-style gate raised); this form has the same values and first derivative
    (``1/6`` strictly inside ``(-3, 3)``, zero elsewhere) and a second derivative.

    Args:
        input: The pre-activation.
        inplace: torch's flag (out of place here: a transform's tensors are new anyway).

    Returns:
        The activation, or ``NotImplemented`` (the op itself) outside transforms.

    Example:
        >>> hardsigmoid(torch.tensor([-4.0, 0.0, 4.0]))
        NotImplemented
    """
    if not is_functorch_wrapped_tensor(input):
        return NotImplemented
    inside = (input > -3) & (input < 3)
    return torch.where(inside, input / 6 + 0.5, (input >= 3).to(input.dtype))


ONLY_UNDER_TRANSFORMS = frozenset(
    {
        torch._pack_padded_sequence,
        torch._pad_packed_sequence,
        torch.nn.functional.embedding,
        torch.nn.functional.embedding_bag,
        torch.nn.functional.hardsigmoid,
    }
)
"""Decomposed ops that run as themselves outside ``torch.func`` transforms (they only refuse
what discovery refuses too): a batch pass with them need not run in a mode."""


def pack_padded_sequence(input: Tensor, lengths: Tensor, batch_first: bool) -> Any:
    """``torch._pack_padded_sequence`` under ``torch.func`` transforms, written with slices.

    torch's kernel reads its input's data pointer, which a transform's tensors have not.

    Args:
        input: ``[T, B, *]`` (``[B, T, *]`` if ``batch_first``), samples sorted by length.
        lengths: The samples' lengths, decreasing (int64, on the CPU).
        batch_first: Whether ``input`` has the samples first.

    Returns:
        ``(data, batch_sizes)`` as torch's (``data``: time-major rows of the running
        samples), or ``NotImplemented`` (the op itself) outside transforms.

    Example:
        >>> pack_padded_sequence(torch.ones(2, 3), torch.tensor([3, 1]), True)
        NotImplemented
    """
    if not is_functorch_wrapped_tensor(input):
        return NotImplemented
    steps = input.unbind(1 if batch_first else 0)
    sizes = [int((lengths > t).sum()) for t in range(int(lengths[0]))]
    data = torch.cat([step[:size] for step, size in zip(steps, sizes)])
    return data, torch.tensor(sizes, dtype=torch.int64)


def pad_packed_sequence(
    data: Tensor, batch_sizes: Tensor, batch_first: bool, padding_value: float, total_length: int
) -> Any:
    """``torch._pad_packed_sequence`` under ``torch.func`` transforms, written with ``cat``.

    Args:
        data: Packed rows ``[S, *]``.
        batch_sizes: Running samples per step (int64, on the CPU).
        batch_first: Whether to return the samples first.
        padding_value: The value of the positions past a sample's length.
        total_length: Steps to pad to (at least ``len(batch_sizes)``).

    Returns:
        ``(padded, lengths)`` as torch's, or ``NotImplemented`` (the op itself) outside
        transforms.

    Example:
        >>> pad_packed_sequence(torch.ones(3), torch.tensor([2, 1]), True, 0.0, 2)
        NotImplemented
    """
    if not is_functorch_wrapped_tensor(data):
        return NotImplemented
    sizes = [int(size) for size in batch_sizes.tolist()]
    batch, steps = sizes[0], max(total_length, len(sizes))
    rows = list(data.split(sizes))
    filler = data.new_full((batch, *data.shape[1:]), padding_value)
    padded = torch.stack(
        [torch.cat([r, filler[len(r) :]]) for r in rows] + [filler] * (steps - len(rows)),
        dim=1 if batch_first else 0,
    )
    lengths = torch.tensor([sum(size > n for size in sizes) for n in range(batch)])
    return padded, lengths


DECOMPOSED_OPS: dict[Callable[..., Any], Callable[..., Any]] = {
    torch._pack_padded_sequence: pack_padded_sequence,
    torch._pad_packed_sequence: pad_packed_sequence,
    torch.prelu: prelu,
    torch.linalg.solve: linalg_solve,
    torch.linalg.solve_ex: linalg_solve_ex,
    torch._weight_norm: weight_norm,
    torch.nn.functional.embedding: embedding,
    torch.nn.functional.embedding_bag: embedding_bag,
    torch.nn.functional.hardsigmoid: hardsigmoid,
    **{cell: partial(run_cell, cell) for cell in CELL_OPS},
}
"""Op -> the decomposition the modes run in its place (``NotImplemented``: the op itself)."""
