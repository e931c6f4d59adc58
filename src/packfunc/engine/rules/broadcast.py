"""Closed forms for a parameter broadcast against a batch: ``x ± α·w``, ``x ⊙ w``, ``x / w``.

A learned position embedding or a bias added by hand broadcasts ``w`` over the
samples: sample ``n``'s column gradient is its output cotangent summed over the
dims ``w`` is broadcast along, times the sign and scale ``w`` enters with. A scale
multiplied with the samples (the weight of an RMSNorm written by hand, as in Hugging
Face's LLaMA: ``weight * hidden``) gets the cotangent times the other operand, summed
the same way; a temperature dividing the logits, ``-g·x / w²``. An operand computed
from ``w`` alone (a derivation: Hugging Face's position embedding ``wpe(arange(T))``, a
slice ``pos[:T]``) gets that sum pulled back through its derivation, one vjp ``vmap``-ed
over the columns. Any other use (the parameter on both sides, a weight with a batch dim)
takes the local rule's vjp. A parameter's rows copied over the batch and concatenated
with the samples' (a class token ``cat([cls.expand(N, 1, D), x], 1)``, prompt tuning's
prompt) get their slice of the cotangent, pulled back through the copy as one sample
sees it.
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
_DIVIDE = (
    torch.div,
    torch.divide,
    torch.true_divide,
    Tensor.div,
    Tensor.divide,
    Tensor.true_divide,
    Tensor.__truediv__,
)


class _SampleSized(LocalRule):
    """A closed form whose column gradients have the parameter's size per sample."""

    closed_form = True

    def column_sum(self, x: Tensor, g: Tensor, call: SiteCall, param: Tensor) -> Tensor:
        """``Σ_{k,n}`` of the column gradients."""
        return self.columns(x, g, call, param).sum((0, 1))


class _Broadcast(_SampleSized):
    """A parameter that is one operand of two of an elementwise op with a batched tensor."""

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
        found = self._closed_operand(local, param, g.dim() - 1)
        if found is None:
            return super().columns(x, g, call, param)
        position, source = found
        shares = self.operand_cotangent(local, g, position)
        if isinstance(source, int):
            return _summed_to(shares, param)
        if source.rows is not None:  # rows looked up: their cotangents added into those rows
            summed = _summed_to(shares, local.arguments.values[position])
            return _added_into_rows(summed, source.rows, param)
        leaf = local.leaf_of(param)
        operand, pullback = vjp(lambda w: source.compute({leaf: w}), param)
        summed = _summed_to(shares, operand).flatten(0, 1)
        pulled = vmap(lambda s: pullback(s)[0])(summed)
        return cast(Tensor, pulled).view(*g.shape[:2], *param.shape)

    def takes_closed_form(self, x: Any, call: SiteCall, param: Tensor, rank: int) -> bool:
        """Whether ``param`` is one operand of two, the other fits, and its rows are shared.

        Example:
            >>> from packfunc.engine.local import CallArguments
            >>> x, w = torch.ones(2, 4, 3), torch.ones(3)
            >>> local = LocalInputs(torch.mul, CallArguments.of((x, w), {}), {1: 0}, (0,),
            ...                     frozenset(), {0: w})
            >>> BroadcastMul().takes_closed_form(local, None, w, 3)
            True
        """
        return self._closed_operand(as_local(x), param, rank) is not None

    def _closed_operand(
        self, local: LocalInputs, param: Tensor, rank: int
    ) -> tuple[int, Source] | None:
        """``param``'s operand (position, source) where the closed form applies, else ``None``."""
        found = _operand(local, param, self.keywords)
        if found is None or not self.other_fits(local, found[0], rank):
            return None
        return found if _shared(local.arguments.values[found[0]], rank) else None

    def other_fits(self, local: LocalInputs, position: int, rank: int) -> bool:
        """Whether the call's other arguments allow the closed form, the operand at ``position``."""
        return True

    def operand_cotangent(self, local: LocalInputs, g: Tensor, position: int) -> Tensor:
        """The cotangents ``[K, n, ...]`` of the operand at ``position``, before the sum."""
        raise NotImplementedError


class BroadcastAdd(_Broadcast):
    """A parameter that is one operand of an addition or subtraction with a batched tensor."""

    keywords = frozenset({"alpha"})

    def other_fits(self, local: LocalInputs, position: int, rank: int) -> bool:
        """Whether ``alpha`` is a number (not a tensor)."""
        alpha = _alpha(local)
        return isinstance(alpha, (int, float)) and not isinstance(alpha, bool)

    def operand_cotangent(self, local: LocalInputs, g: Tensor, position: int) -> Tensor:
        """``g`` times the sign and scale the operand enters with."""
        scale = 1.0 if position == 0 else float(_alpha(local)) * (1 if local.func in _ADD else -1)
        return g if scale == 1 else g * scale


def _alpha(local: LocalInputs) -> Any:
    """The ``alpha`` of an addition or subtraction (1 if not given)."""
    arguments = local.arguments
    return dict(zip(arguments.keys, arguments.values[2:])).get("alpha", 1)


class _Factor(_Broadcast):
    """An operand whose cotangent needs the other: one row per sample and the output's dims."""

    def other_fits(self, local: LocalInputs, position: int, rank: int) -> bool:
        """Whether the other operand has one row per sample and ``rank`` dims."""
        other = 1 - position
        value = local.arguments.values[other]
        # with fewer dims, its first would not be the samples' in the output
        return other in local.per_sample() and isinstance(value, Tensor) and value.dim() == rank


class BroadcastMul(_Factor):
    """A parameter that is one factor of a product with a batched tensor (an RMSNorm's weight)."""

    def operand_cotangent(self, local: LocalInputs, g: Tensor, position: int) -> Tensor:
        """``g`` times the other factor.

        Example:
            >>> from packfunc.engine.local import CallArguments
            >>> x, w = torch.arange(6.0).view(2, 3), torch.ones(3)
            >>> local = LocalInputs(torch.mul, CallArguments.of((w, x), {}), {0: 0}, (1,),
            ...                     frozenset(), {0: w})
            >>> BroadcastMul().operand_cotangent(local, torch.ones(1, 2, 3), 0)
            tensor([[[0., 1., 2.],
                     [3., 4., 5.]]])
        """
        return g * cast(Tensor, local.arguments.values[1 - position]).conj()  # (complex: x̄)


class ConcatenatedCopy(_SampleSized):
    """A parameter copied over the batch and concatenated with batched tensors (a class token)."""

    def takes_closed_form(self, x: Any, call: SiteCall, param: Tensor, rank: int) -> bool:
        """Whether ``param``'s copy is one tensor of the list, concatenated beside the samples."""
        return _concatenated(as_local(x), param) is not None

    def columns(self, x: Tensor, g: Tensor, call: SiteCall, param: Tensor) -> Tensor:
        """The copy's slice of ``g``, pulled back through the copy: ``[K, n, *param.shape]``.

        The copy is a derivation whose rows are alike (``cls.expand(N, 1, D)``): each
        sample sees its first row, and its slice of the cotangent is that row's.

        Args:
            x: The recorded concatenation, its list holding the copy.
            g: Cotangents ``[K, n, ...]`` of the concatenated tensor.
            call: The concatenation's site call.
            param: The parameter copied.

        Returns:
            Its column gradients (the op-local vjp's, where the copy is not one).

        Example:
            >>> from packfunc.engine.local import CallArguments, derive
            >>> cls, x = torch.ones(1, 1, 2), torch.ones(3, 4, 2)
            >>> copy = derive(Tensor.expand, CallArguments.of((cls, 3, 1, 2), {}), {0: 0},
            ...               None, broadcast=True)
            >>> arguments = CallArguments.of(([copy.compute({0: cls}), x],), {"dim": 1})
            >>> local = LocalInputs(torch.cat, arguments, {0: copy}, (1,), frozenset({0}),
            ...                     {0: cls})
            >>> g = torch.arange(30.0).view(1, 3, 5, 2)
            >>> ConcatenatedCopy().columns(local, g, None, cls)[0, :, 0, 0]
            tensor([[ 0.,  1.],
                    [10., 11.],
                    [20., 21.]])
        """
        local = as_local(x)
        found = _concatenated(local, param)
        if found is None:
            return super().columns(x, g, call, param)
        source, dim, start, size = found
        leaf = local.leaf_of(param)
        row, pullback = vjp(lambda w: source.compute({leaf: w})[:1], param)
        piece = g.narrow(dim + 1, start, size)  # [K, n, ...]: each sample's share of its row
        pulled = vmap(lambda s: pullback(s)[0])(piece.flatten(0, 1).unsqueeze(1))
        return cast(Tensor, pulled).view(*g.shape[:2], *param.shape)


def _concatenated(local: LocalInputs, param: Tensor) -> tuple[Derivation, int, int, int] | None:
    """``(copy, dim, start, size)`` of ``param``'s copy in a concatenation, else ``None``.

    The copy must be one tensor of the list, a derivation of ``param`` alone whose rows
    are alike (or a single row, of a batch of one), and the list concatenated along
    another dim than the samples'.
    """
    arguments = local.arguments
    if not arguments.layout or arguments.layout[0] is None:
        return None
    length, keywords = arguments.layout[0][1], len(arguments.values) - len(arguments.keys)
    items = arguments.values[:length]
    named = dict(zip(arguments.keys, arguments.values[keywords:]))
    positional = arguments.values[length:keywords]
    if any(arguments.layout[1:]) or set(named) - {"dim"} or len(positional) > 1:
        return None
    dim = positional[0] if positional else named.get("dim", 0)
    if len(local.sources) != 1 or not isinstance(dim, int):
        return None
    ((position, source),) = local.sources.items()
    rank = items[position].dim()
    if not isinstance(source, Derivation) or source.leaves != {local.leaf_of(param)}:
        return None
    # its rows alike, or a single row (one sample's): each sample sees its first row
    alike = position in local.narrow or items[position].shape[0] == 1
    if not alike or not -rank <= dim < rank or dim % rank == 0:
        return None
    dim %= rank
    start = sum(item.shape[dim] for item in items[:position])
    return source, dim, start, items[position].shape[dim]


class BroadcastDiv(_Factor):
    """A parameter that divides a batched tensor, or is divided by one (a temperature)."""

    def operand_cotangent(self, local: LocalInputs, g: Tensor, position: int) -> Tensor:
        """``g / b`` for the dividend, ``-g·a / b²`` for the divisor (``a / b`` the call).

        Example:
            >>> from packfunc.engine.local import CallArguments
            >>> x, t = torch.tensor([[2.0, 4.0]]), torch.tensor(2.0)
            >>> local = LocalInputs(torch.div, CallArguments.of((x, t), {}), {1: 0}, (0,),
            ...                     frozenset(), {0: t})
            >>> BroadcastDiv().operand_cotangent(local, torch.ones(1, 1, 2), 1)
            tensor([[[-0.5000, -1.0000]]])
        """
        values = local.arguments.values
        dividend, divisor = cast(Tensor, values[0]), cast(Tensor, values[1])
        if position == 0:
            return g / divisor.conj()  # (complex: the conjugate derivative)
        return -g * (dividend / divisor.square()).conj()


def _shared(operand: Any, rank: int) -> bool:
    """Whether an operand of an op with ``rank`` output dims is the same for every sample.

    It has fewer dims than the output, or a leading dim of one (else a dim of the samples'
    own).

    Example:
        >>> _shared(torch.ones(4), 3), _shared(torch.ones(1, 2, 4), 3), _shared(torch.ones(2, 4), 2)
        (True, True, False)
    """
    if not isinstance(operand, Tensor):
        return False
    leading = rank - operand.dim()
    return leading > 0 or (leading == 0 and operand.shape[0] == 1)


def _added_into_rows(g: Tensor, ids: Tensor, param: Tensor) -> Tensor:
    """Column gradients ``[K, n, *param.shape]`` of ``F.embedding(ids, param)`` from its ``g``.

    Args:
        g: Cotangents of the lookup ``[K, n, *ids.shape, D]``.
        ids: The rows looked up.
        param: The table ``[rows, D]``.

    Example:
        >>> ids, table = torch.tensor([0, 2, 0]), torch.ones(4, 2)
        >>> _added_into_rows(torch.ones(1, 1, 3, 2), ids, table)[0, 0]
        tensor([[2., 2.],
                [0., 0.],
                [1., 1.],
                [0., 0.]])
    """
    columns = g.reshape(g.shape[0] * g.shape[1], ids.numel(), param.shape[-1])
    columns = columns.to(param.device, param.dtype)  # (a lookup moved or cast: back)
    found = columns.new_zeros(columns.shape[0], *param.shape)
    found.index_add_(1, ids.reshape(-1).to(param.device), columns)
    return found.view(*g.shape[:2], *param.shape)


def _summed_to(g: Tensor, operand: Tensor) -> Tensor:
    """``g [K, n, ...]`` summed over the dims a :func:`_shared` operand is broadcast along.

    Returns:
        ``[K, n, *operand.shape]``.

    Example:
        >>> _summed_to(torch.ones(1, 2, 3, 4), torch.ones(4)).shape
        torch.Size([1, 2, 4])
    """
    padded = (1,) * (g.dim() - 1 - operand.dim()) + tuple(operand.shape)
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
    **{func: BroadcastDiv() for func in _DIVIDE},
    **{func: ConcatenatedCopy() for func in (torch.cat, torch.concat, torch.concatenate)},
}
"""The closed-form rule of each addition, subtraction, multiplication, division and
concatenation function."""
