"""Reduce column gradients to the statistics quantities are made of.

The statistics (:class:`~packfunc.engine.vocabulary.Statistic`) of a leaf's
column gradients ``c[k, n]``: ``COLUMNS`` (``c`` itself over the requested
samples), ``SUM`` and ``DIAGONAL`` (``Σ_{k,n} c`` and ``Σ_{k,n} c²`` over all
samples), ``SQUARED_NORMS`` and ``DIAGONAL_PER_SAMPLE`` (``Σ_k ‖c[k, n]‖²`` and
``Σ_k c[k, n]²`` per requested sample).

Closed forms come first; what is left is reduced from column gradients
materialized in chunks, one pass serving every missing statistic.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Collection, Iterable
from typing import cast

import torch
from torch import Tensor

from packfunc.engine.autodiff import under_vmap
from packfunc.engine.batch_pass import BatchPass, ColumnGradients
from packfunc.engine.memory import (
    DEFAULT_BUDGET,
    chunk_length,
    chunks,
    index_length,
    is_plain,
    new_output,
)
from packfunc.engine.precision import for_squares
from packfunc.engine.rules.product import cancelled_samples, noting_cancelled
from packfunc.engine.vocabulary import PER_SAMPLE, SQUARED, Statistic
from packfunc.losses import hessian_factors
from packfunc.types import ClippingGroups

_SQUARES_AT_ONCE = 2**20
"""Elements squared per temporary: small enough for the allocator to reuse its memory."""


def leaf_statistics(
    columns: ColumnGradients,
    stats: set[Statistic],
    index: slice | Tensor,
    leaves: Collection[int] | None = None,
) -> list[dict[Statistic, Tensor]]:
    """Return, per leaf, the statistics in ``stats``.

    The gradient is summed from materialized column gradients when the squared
    sum is (one pass over them serves both), else taken in closed form.

    Args:
        columns: Column gradients of every leaf.
        stats: Names of the statistics wanted.
        index: Samples that per-sample statistics cover.
        leaves: The leaves to compute (``None``: all); the others get ``{}``.

    Returns:
        One dict of statistics per leaf.

    Example:
        >>> fn, p = packfunc.functional(torch.nn.Linear(3, 2))
        >>> bp = BatchPass(fn, p, torch.randn(4, 3), torch.tensor([0, 1, 1, 0]),
        ...               torch.nn.CrossEntropyLoss())
        >>> stats = leaf_statistics(bp.gradient_columns(), {Statistic.SQUARED_NORMS}, slice(0, 4))
        >>> stats[0][Statistic.SQUARED_NORMS].shape
        torch.Size([4])
    """
    everyone = slice(0, columns.bp.n)
    per_leaf: list[dict[Statistic, Tensor]] = [{} for _ in columns.bp.leaves]
    chosen = set(range(len(per_leaf)) if leaves is None else leaves)
    for leaf, found in enumerate(per_leaf):
        if leaf not in chosen:
            continue
        for stat in stats - {Statistic.COLUMNS, Statistic.SUM}:
            value = columns.closed_form(leaf, stat, index if stat in PER_SAMPLE else everyone)
            if value is not None:
                found[stat] = value
        squares_materialized = Statistic.DIAGONAL in stats - found.keys()
        if Statistic.SUM in stats and not squares_materialized:
            value = columns.closed_form(leaf, Statistic.SUM, everyone)
            if value is not None:
                found[Statistic.SUM] = value
    tapped = [i for i in sorted(chosen) if i not in columns.bp.whole_model]
    whole = [i for i in columns.bp.whole_model if i in chosen]
    for group in [[i] for i in tapped] + [whole]:
        missing = stats - per_leaf[group[0]].keys() if group else set()
        if missing:
            for leaf, found in zip(group, _materialized(columns, group, missing, index)):
                per_leaf[leaf].update(found)
    return per_leaf


def gradient_statistics(
    bp: BatchPass, stats: set[Statistic], index: slice | Tensor, *, last: bool = False
) -> list[dict[Statistic, Tensor]]:
    """Per leaf, the statistics in ``stats`` of the loss gradient's column gradients.

    With ``last``, the statistics of a leaf used at one recorded call only are taken
    during the backward pass as the call's cotangent arrives, and its cotangent and
    recorded input dropped there (as a plain backward pass drops a layer's activations):
    a per-sample output then costs its own size plus a backward pass's working memory.

    Args:
        bp: The batch pass.
        stats: Names of the statistics wanted.
        index: Samples that per-sample statistics cover.
        last: Nothing uses ``bp`` afterwards (its graph and records are used up).

    Returns:
        One dict of statistics per leaf.

    Example:
        >>> fn, p = packfunc.functional(torch.nn.Linear(3, 2))
        >>> bp = BatchPass(fn, p, torch.randn(4, 3), torch.tensor([0, 1, 1, 0]),
        ...               torch.nn.CrossEntropyLoss())
        >>> found = gradient_statistics(bp, {Statistic.COLUMNS}, slice(0, 4), last=True)
        >>> found[1][Statistic.COLUMNS].shape
        torch.Size([1, 4, 2, 3])
    """
    early = _StatisticsDuringBackward(bp, stats, index) if last else None
    columns = bp.gradient_columns(last=last, consume=early)
    done = early.found if early else {}
    rest = [leaf for leaf in range(len(bp.leaves)) if leaf not in done]
    found = leaf_statistics(columns, stats, index, rest)
    return [done.get(leaf, found[leaf]) for leaf in range(len(bp.leaves))]


class _StatisticsDuringBackward:
    """A :data:`~packfunc.engine.batch_record.SiteConsumer` of statistics as cotangents arrive.

    The leaves of a single-call site get their statistics from its cotangent, which is
    then dropped with the recorded input.
    """

    def __init__(self, bp: BatchPass, stats: set[Statistic], index: slice | Tensor):
        self.bp, self.stats, self.index = bp, stats, index
        self.sites = bp.single_call_sites()
        self.found: dict[int, dict[Statistic, Tensor]] = {}

    def __call__(self, k: int, g: Tensor) -> Tensor | None:
        """Site ``k``'s leaves' statistics; ``g`` is kept only for a site of shared leaves."""
        if k not in self.sites:
            return g
        alone = ColumnGradients(self.bp, self.bp.record.output_cotangent[None], {k: g[None]})
        leaves = [leaf for _, leaf in self.bp.plan.sites[k].call.leaves]
        found = leaf_statistics(alone, self.stats, self.index, leaves)
        self.found |= {leaf: found[leaf] for leaf in leaves}
        self.bp.record.inputs.pop(k)
        return None


def clipped_sums(
    bp: BatchPass, max_norm: float | ClippingGroups, eps: float, *, last: bool = False
) -> list[Tensor]:
    """``Σ_n c_n g_n`` per leaf, ``c_n = min(1, max_norm / (‖g_n‖ + eps))``: DP-SGD's clipped sum.

    ``‖g_n‖`` is taken over every leaf together. A leaf whose squared norms have a closed
    form (a linear layer's rank-one or Gram form) gets its sum as one contraction of the
    recorded input with the reweighted cotangents (:meth:`ColumnGradients.reweighted`,
    in place where they own their memory); a leaf whose per-sample gradients are smaller
    than its calls' cotangents, or whose norms need them anyway (the whole-model path's),
    keeps them within the memory budget and sums them with the factors (else the
    whole-model path's are formed again and weighted as formed, :func:`_weighted_sums`;
    a tapped leaf's sum is a contraction, checked as :func:`_squared_norms` says). With
    ``last``, norms are taken during the backward pass as each site's cotangent arrives
    (:class:`_NormsDuringBackward`: a site whose leaves all keep per-sample gradients drops
    its cotangent and recorded input there), and each site is
    released as soon as its leaves' sums are taken.
    A sample whose Gram-form norm was taken from its formed gradient (its positions cancel:
    :func:`~packfunc.engine.rules.product.formed_where_cancelled`) is summed apart from its
    formed gradients, which set its norm: the contraction would round its terms otherwise, and
    that rounding is bounded by the terms, not by the norm the clipping bounds.

    Args:
        bp: The batch pass (of a summed loss).
        max_norm: The bound ``C``; or groups of leaves with a bound each, each group
            clipped alone by its own joint norm (a group of one leaf: ``‖g_{n,leaf}‖``).
        eps: Added to each norm before dividing.
        last: Nothing uses ``bp`` afterwards (its graph and records are used up).

    Returns:
        One clipped sum per leaf, shaped like the leaf.

    Example:
        >>> fn, p = packfunc.functional(torch.nn.Linear(3, 2))
        >>> bp = BatchPass(fn, p, torch.randn(4, 3), torch.tensor([0, 1, 1, 0]),
        ...               torch.nn.CrossEntropyLoss(reduction="sum"))
        >>> [s.shape for s in clipped_sums(bp, 1.0, 1e-6)]
        [torch.Size([2]), torch.Size([2, 3])]
    """
    if not bp.leaves:  # no parameters: nothing to clip (as per-sample gradients of none)
        return []
    everyone = slice(0, bp.n)
    early = _NormsDuringBackward(bp) if last else None
    columns = bp.gradient_columns(last=last, consume=early)
    squares: dict[int, Tensor] = dict(early.squares) if early else {}
    kept: dict[int, Tensor] = dict(early.kept) if early else {}
    cancelled: dict[int, Tensor] = dict(early.cancelled) if early else {}
    room = early.room if early else DEFAULT_BUDGET
    for leaf in range(len(bp.leaves)):
        if leaf not in bp.whole_model and leaf not in squares and leaf not in kept:
            value, found = _squared_norms(columns, leaf, room, cancelled)
            if found is None:
                squares[leaf] = cast(Tensor, value)
            else:
                kept[leaf], room = found, room - found.numel()
    whole_size = bp.n * sum(bp.leaves[leaf].numel() for leaf in bp.whole_model)
    if bp.whole_model and whole_size <= room:  # formed once and kept: one whole-model pass
        whole = _materialized(columns, bp.whole_model, {Statistic.COLUMNS}, everyone)
        kept |= {leaf: f[Statistic.COLUMNS][0] for leaf, f in zip(bp.whole_model, whole)}
        room -= whole_size
    elif bp.whole_model:
        whole = _materialized(
            columns, bp.whole_model, {Statistic.SQUARED_NORMS}, everyone, squares_wide=True
        )
        squares |= {leaf: f[Statistic.SQUARED_NORMS] for leaf, f in zip(bp.whole_model, whole)}
    if isinstance(max_norm, list):
        return _clipped_by_group(columns, squares, kept, max_norm, eps, cancelled)
    rows = SampleRows(list(kept.values()))
    norms = _joint_norms([squares[leaf] for leaf in sorted(squares)], rows)
    everything = list(range(len(bp.leaves)))
    factors, extra = _factors_and_sums_apart(
        columns, kept, everything, cancelled, norms, max_norm, eps
    )
    rest = [leaf for leaf in range(len(bp.leaves)) if leaf not in kept]
    sums = dict(zip(kept, rows.weighted_sums(factors)))
    del rows
    for leaf in kept:
        columns.release(leaf)
    # `columns` is not used again: its cotangents are scaled in place where they can be, and
    # those only the kept leaves used go with it
    reweighted = columns.reweighted(factors, rest, in_place=True) if rest else columns
    outputs = columns.cotangents  # (not scaled in place where the whole-model path reads them)
    del columns
    # smallest first: their calls' records free more than their sums take, before the largest
    for leaf in sorted(rest, key=lambda i: bp.leaves[i].numel()):
        if leaf not in bp.whole_model:
            sums[leaf] = _leaf_sum(reweighted, leaf)
            reweighted.release(leaf)  # the peak: records shrink as the sums grow
    formed_again = [leaf for leaf in bp.whole_model if leaf not in kept]
    if formed_again:
        unscaled = ColumnGradients(bp, outputs, {})
        sums |= dict(zip(formed_again, _weighted_sums(unscaled, formed_again, factors)))
    return [
        sums[leaf] + extra[leaf] if leaf in extra else sums[leaf] for leaf in range(len(bp.leaves))
    ]


def clipping_factors(norms: Tensor, max_norm: float, eps: float) -> Tensor:
    """DP-SGD's factors ``min(1, max_norm / (‖g_n‖ + eps))``; an overflowed or NaN norm is refused.

    A norm that overflows its dtype (a squared norm above its largest value) would give
    the factor 0 and drop that sample from the sum, where it belongs at norm ``max_norm``.

    Args:
        norms: The per-sample norms ``[N]``.
        max_norm: The bound ``C``.
        eps: Added to each norm before dividing.

    Returns:
        The factors ``[N]``.

    Raises:
        FloatingPointError: where a norm is infinite or NaN (under ``torch.func.vmap``,
            whose values decide no branch, its factor is NaN instead).

    Example:
        >>> clipping_factors(torch.tensor([0.5, 4.0]), 2.0, 0.0)
        tensor([1.0000, 0.5000])
    """
    factors = (max_norm / (norms + eps)).clamp(max=1.0)
    if under_vmap():  # (no branch on values there: an overflowed norm's factor is NaN)
        return torch.where(norms.isinf(), torch.nan, factors)
    if bool(norms.isfinite().all()):  # (one wait for the device, where one is used)
        return factors
    if bool(norms.isinf().any()):
        sample = int(norms.isinf().nonzero()[0, 0])
        wider = (
            "float32 parameters (under torch.autocast for half-precision speed)"
            if torch.finfo(norms.dtype).max < torch.finfo(torch.float32).max
            else "float64 (model.double() and the batch)"
        )
        raise FloatingPointError(
            f"the gradient norm of sample {sample} overflows {norms.dtype} (its squared norm "
            f"is above {torch.finfo(norms.dtype).max:.3g}), and clipping it would drop that "
            f"sample instead of scaling it to max_norm. Compute with {wider}, or find why "
            "the loss's gradient is that large."
        )
    if bool(norms.isnan().any()):
        sample = int(norms.isnan().nonzero()[0, 0])
        raise FloatingPointError(
            f"the gradient norm of sample {sample} is NaN (a NaN or inf in its input, output "
            "or loss, or a layer input whose squared norm overflows the dtype, times a zero "
            "gradient): no clipping bounds it, and the clipped sum would be NaN. Drop or fix "
            "that sample (or scale its inputs down)."
        )
    return factors


class SampleRows:
    """Per-sample tensors ``[N, ...]`` as rows: their squared norms and weighted sums together.

    The small ones of the first one's dtype (a layer's bias, a norm's scale) are joined into
    one matrix: one product for all of them costs less in calls than one per tensor does
    in arithmetic there.

    Args:
        per_sample: Tensors ``[N, ...]`` of one batch.

    Example:
        >>> rows = SampleRows([torch.ones(2, 3), torch.ones(2)])
        >>> rows.squared_norms(), rows.weighted_sums(torch.tensor([1.0, 2.0]))
        (tensor([4., 4.]), [tensor([3., 3., 3.]), tensor(3.)])
    """

    def __init__(self, per_sample: list[Tensor]):
        self.shapes = [t.shape[1:] for t in per_sample]
        # (math.prod, not -1: an empty batch has no width to infer)
        self.rows = [t.reshape(len(t), math.prod(t.shape[1:])) for t in per_sample]
        first = self.rows[0].dtype if self.rows else None
        self.small = [
            i for i, r in enumerate(self.rows) if r.shape[1] <= _SMALL and r.dtype == first
        ]
        self.joined: Tensor | None = None
        if len(self.small) > 1:
            self.joined = torch.cat([self.rows[i] for i in self.small], 1)

    def _alone(self) -> list[int]:
        """The tensors not in :attr:`joined`."""
        return [i for i in range(len(self.rows)) if self.joined is None or i not in self.small]

    def squared_norms(self) -> Tensor:
        """``[N]``: each sample's squared norm over all the tensors (float32 where float16)."""
        parts = [self.rows[i] for i in self._alone()]
        if self.joined is not None:
            parts.append(self.joined)
        squares = [squared_row_norms(r) for r in parts]
        total: Tensor = sum(squares[1:], squares[0])
        return total

    def weighted_sums(self, weights: Tensor) -> list[Tensor]:
        """``Σ_n w_n t_n`` of each tensor ``t``, shaped like its sample.

        Args:
            weights: ``[N]``.
        """
        found: dict[int, Tensor] = {}
        if self.joined is not None:
            sizes = [self.rows[i].shape[1] for i in self.small]
            parts = (weights.to(self.joined.dtype) @ self.joined).split(sizes)
            found = dict(zip(self.small, parts, strict=True))
        for i in self._alone():
            found[i] = weights.to(self.rows[i].dtype) @ self.rows[i]
        return [found[i].view(shape) for i, shape in enumerate(self.shapes)]


_SMALL = 2**12
"""Elements per sample up to which :class:`SampleRows` joins a tensor."""


def _joint_norms(squares: list[Tensor], kept: SampleRows) -> Tensor:
    """``[N]``: each sample's norm over leaves of squared norms ``squares`` and kept gradients.

    Example:
        >>> _joint_norms([torch.tensor([9.0])], SampleRows([torch.full((1, 4), 2.0)]))
        tensor([5.])
    """
    parts = squares + ([kept.squared_norms()] if kept.rows else [])
    return norms_from_squares(torch.stack(parts).sum(0))


def norms_from_squares(squares: Tensor) -> Tensor:
    """The square roots of squared norms, with a zero gradient where one is zero.

    ``sqrt``'s derivative is infinite at zero: a sample whose gradient is zero (a padded
    sequence, a target met exactly) made a gradient through the clipped sum NaN. At zero
    the norm's subgradient zero is taken (the clipping factor there is one, flat in it).

    Args:
        squares: Squared norms, ``>= 0``.

    Returns:
        Their square roots (NaN and inf as they are).

    Example:
        >>> s = torch.tensor([0.0, 4.0], requires_grad=True)
        >>> norms_from_squares(s).sum().backward(); s.grad
        tensor([0.0000, 0.2500])
    """
    zero = squares == 0  # (a NaN or inf stays one: the clipping refuses it)
    return torch.where(zero, 0, torch.where(zero, 1, squares).sqrt())


def _squared_norms(
    columns: ColumnGradients, leaf: int, room: int, cancelled: dict[int, Tensor]
) -> tuple[Tensor | None, Tensor | None]:
    """A tapped leaf's per-sample squared norms, or its per-sample gradients where kept.

    They are kept where they are smaller than the leaf's calls' cotangents, or formed for
    the norms anyway (no closed form, or a cheaper one by the cost rule), within ``room``
    elements; their squared norms are then taken with the other kept ones
    (:class:`SampleRows`), and ``None`` is returned in their place. The samples whose
    closed form formed their gradients (:func:`noting_cancelled`) go to ``cancelled[leaf]``,
    as do those whose formed gradients, beyond ``room``, are far below their positions'
    terms (:meth:`ColumnGradients.position_terms`): the batch's contraction would round
    their sums by more than their norms bound. Where no such bound is known, or under
    ``vmap`` (no branch on values), gradients beyond ``room`` are kept all the same.
    """
    everyone = slice(0, columns.bp.n)
    small = _per_sample_is_smaller(columns, leaf)
    value = None
    if not small:
        with noting_cancelled() as formed:
            value = columns.closed_form(leaf, Statistic.SQUARED_NORMS, everyone, wide=True)
        if formed:
            cancelled[leaf] = torch.cat(formed).unique()
    if value is not None:
        return value, None
    found = columns.leaf_columns(leaf, everyone)[0]  # [N, *p]
    if found.numel() <= room:
        return None, found
    squares = _statistic(Statistic.SQUARED_NORMS, found[None])  # (float32 where float16)
    terms = columns.position_terms(leaf, everyone)
    if terms is None or under_vmap():  # nothing bounds the contraction's rounding: kept
        return None, found
    cancelled_here = cancelled_samples(squares, terms)
    if bool(cancelled_here.any()):
        cancelled[leaf] = cancelled_here.nonzero().squeeze(1)
    return squares, None


class _NormsDuringBackward:
    """A :data:`~packfunc.engine.batch_record.SiteConsumer`: squared norms as cotangents arrive.

    A site whose leaves are used there only gets its leaves' squared norms at once; where
    they all keep per-sample gradients (:func:`_squared_norms`: a normalization layer's
    affine parameters, or a layer whose per-sample gradients are cheaper than its Gram
    form), its cotangent and recorded input are dropped there, as a plain backward pass
    drops a layer's activations.
    """

    def __init__(self, bp: BatchPass):
        self.bp, self.room = bp, DEFAULT_BUDGET
        self.squares: dict[int, Tensor] = {}
        self.kept: dict[int, Tensor] = {}
        self.cancelled: dict[int, Tensor] = {}
        self.alone = bp.single_call_sites()

    def __call__(self, k: int, g: Tensor) -> Tensor | None:
        """Take site ``k``'s leaves' norms; keep ``g`` unless they all keep per-sample gradients."""
        if k not in self.alone:
            return g
        columns = ColumnGradients(self.bp, self.bp.record.output_cotangent[None], {k: g[None]})
        dropped = True
        for _, leaf in self.bp.plan.sites[k].call.leaves:
            value, found = _squared_norms(columns, leaf, self.room, self.cancelled)
            if found is None:
                self.squares[leaf], dropped = cast(Tensor, value), False
            else:
                self.kept[leaf], self.room = found, self.room - found.numel()
        if not dropped:
            return g
        self.bp.record.inputs.pop(k)
        return None


def _per_sample_is_smaller(columns: ColumnGradients, leaf: int) -> bool:
    """Whether a leaf's per-sample gradients ``[N, *p]`` are smaller than its calls' cotangents.

    Then (a bias beside a convolution) keeping them beats reweighting the cotangents.
    """
    terms = columns.recorded.get(leaf, [])
    cotangents = sum(term.g.numel() for term in terms)
    return bool(terms) and columns.bp.n * columns.bp.leaves[leaf].numel() < cotangents


def _clipped_by_group(
    columns: ColumnGradients,
    squares: dict[int, Tensor],
    kept: dict[int, Tensor],
    groups: ClippingGroups,
    eps: float,
    cancelled: dict[int, Tensor],
) -> list[Tensor]:
    """Each group's leaves' sums of per-sample gradients clipped by the group's joint norm.

    A group's samples in ``cancelled`` are summed apart, as in :func:`clipped_sums`.
    """
    bp = columns.bp
    sums: dict[int, Tensor] = {}
    for leaves, bound in groups:
        mine = [leaf for leaf in leaves if leaf in kept]
        rest = [leaf for leaf in leaves if leaf not in kept]
        rows = SampleRows([kept[leaf] for leaf in mine])
        norms = _joint_norms([squares[leaf] for leaf in rest], rows)
        factors, extra = _factors_and_sums_apart(
            columns, kept, list(leaves), cancelled, norms, bound, eps
        )
        sums |= dict(zip(mine, rows.weighted_sums(factors)))
        whole = [leaf for leaf in rest if leaf in bp.whole_model]
        sums |= dict(zip(whole, _weighted_sums(columns, whole, factors)))
        tapped = [leaf for leaf in rest if leaf not in bp.whole_model]
        if tapped:
            reweighted = columns.reweighted(factors, tapped)  # copies: a site serves several groups
            sums |= {leaf: _leaf_sum(reweighted, leaf) for leaf in tapped}
        sums |= {leaf: sums[leaf] + value for leaf, value in extra.items()}
    return [sums[leaf] for leaf in range(len(bp.leaves))]


class _SamplesApart:
    """Samples summed from their formed gradients, apart from the batch's contraction.

    Args:
        index: The samples ``[k]``.
        gradients: Their gradients ``[k, *p]`` per leaf (of one clipping group).

    Example:
        >>> apart = _SamplesApart(torch.tensor([1]), {0: torch.tensor([[3.0, 4.0]])})
        >>> apart.norms(torch.tensor([1.0, 0.0]))
        tensor([1., 5.])
        >>> factors = torch.tensor([1.0, 0.2])
        >>> apart.sums(factors), apart.left_out(factors)
        ({0: tensor([0.6000, 0.8000])}, tensor([1., 0.]))
    """

    def __init__(self, index: Tensor, gradients: dict[int, Tensor]):
        self.index, self.gradients = index, gradients

    def norms(self, norms: Tensor) -> Tensor:
        """``norms`` with those of these samples taken from their formed gradients."""
        rows = SampleRows(list(self.gradients.values()))
        squares = rows.squared_norms().to(norms.dtype)
        return norms.index_put((self.index,), norms_from_squares(squares))

    def sums(self, factors: Tensor) -> dict[int, Tensor]:
        """``Σ_k c_k g_k`` over these samples, per leaf."""
        mine = factors[self.index]
        return {
            leaf: torch.tensordot(mine.to(g.dtype), g, dims=1) for leaf, g in self.gradients.items()
        }

    def left_out(self, factors: Tensor) -> Tensor:
        """``factors`` with these samples' zeroed: the batch's contraction leaves them out."""
        return factors.index_fill(0, self.index, 0)


def _factors_and_sums_apart(
    columns: ColumnGradients,
    kept: dict[int, Tensor],
    leaves: list[int],
    cancelled: dict[int, Tensor],
    norms: Tensor,
    bound: float,
    eps: float,
) -> tuple[Tensor, dict[int, Tensor]]:
    """One clipping group's factors for the batch's contraction, and its samples' summed apart.

    The samples of ``leaves`` in ``cancelled`` take their norms and sums from their formed
    gradients (:class:`_SamplesApart`), and a factor of zero in the contraction.

    Args:
        columns: The batch's column gradients (before reweighting).
        kept: Per-sample gradients kept, by leaf.
        leaves: The group's leaves.
        cancelled: Samples whose Gram-form norms were formed, by leaf.
        norms: The group's per-sample norms ``[N]``.
        bound: Its clipping bound.
        eps: Added to each norm before dividing.

    Returns:
        ``(factors, {leaf: Σ_k c_k g_k})`` (an empty dict where no sample is apart).
    """
    # norms from float32 squares where float16 (theirs overflow from 256), factors in the
    # leaves' dtype as their sums are
    dtypes = [columns.bp.leaves[leaf].dtype for leaf in leaves]
    dtype = functools.reduce(torch.promote_types, dtypes)
    noted = [cancelled[leaf] for leaf in leaves if leaf in cancelled]
    if not noted:
        return clipping_factors(norms, bound, eps).to(dtype), {}
    index = torch.cat(noted).unique()
    apart = _SamplesApart(index, {leaf: _formed(columns, kept, leaf, index) for leaf in leaves})
    factors = clipping_factors(apart.norms(norms), bound, eps).to(dtype)
    return apart.left_out(factors), apart.sums(factors)


def _formed(columns: ColumnGradients, kept: dict[int, Tensor], leaf: int, index: Tensor) -> Tensor:
    """A leaf's gradients ``[k, *p]`` of samples ``index`` (kept, or formed for them)."""
    if leaf in kept:
        return kept[leaf][index]
    if leaf in columns.bp.whole_model:
        found = _materialized(columns, [leaf], {Statistic.COLUMNS}, index)
        return found[0][Statistic.COLUMNS][0]
    return columns.leaf_columns(leaf, index)[0]


def _weighted_sums(columns: ColumnGradients, leaves: list[int], factors: Tensor) -> list[Tensor]:
    """``Σ_n c_n g_n`` of whole-model ``leaves``, their gradients formed chunk by chunk, unscaled.

    Each sample's gradient is the one whose norm set ``c_n`` (formed again alike): scaling
    its output cotangent first would round its terms otherwise, by up to ``c_n`` times them,
    which a crafted sample whose terms cancel makes exceed the bound (1.4·C, a probe).

    Args:
        columns: The batch's column gradients (one column, not reweighted).
        leaves: Leaves on the whole-model path.
        factors: The clipping factors ``[N]``.

    Returns:
        One sum per leaf, shaped like it.
    """
    if not leaves:
        return []
    totals: list[Tensor] | None = None
    start = 0
    for chunk in columns.iter_leaf_columns(leaves, slice(0, columns.bp.n)):
        length = chunk[0].shape[1]
        mine = factors[start : start + length]
        parts = [torch.tensordot(mine.to(t.dtype), t.sum(0), dims=1) for t in chunk]
        totals = parts if totals is None else [a + b for a, b in zip(totals, parts, strict=True)]
        start += length
        del chunk  # (not held while the next chunk is formed)
    if totals is None:
        raise ValueError("the batch is empty; pass at least one sample.")
    return totals


def _leaf_sum(columns: ColumnGradients, leaf: int) -> Tensor:
    """A leaf's sum of (reweighted) column gradients: in closed form, else materialized."""
    everyone = slice(0, columns.bp.n)
    value = None
    if leaf not in columns.bp.whole_model:
        value = columns.closed_form(leaf, Statistic.SUM, everyone)
    if value is None:
        value = _materialized(columns, [leaf], {Statistic.SUM}, everyone)[0][Statistic.SUM]
    return value


def _materialized(
    columns: ColumnGradients,
    group: list[int],
    stats: set[Statistic],
    index: slice | Tensor,
    *,
    squares_wide: bool = False,
) -> list[dict[Statistic, Tensor]]:
    """Reduce materialized column gradients of ``group`` to ``stats``.

    Per-sample statistics cover ``index``; the others the whole batch. One
    pass serves both when ``index`` is the whole batch. With ``squares_wide``, squares of
    float16 columns stay in float32 (:func:`_reduce`).
    """
    everyone = slice(0, columns.bp.n)
    whole = isinstance(index, slice) and index == everyone
    per_sample, totals = stats & PER_SAMPLE, stats - PER_SAMPLE
    into_output = Statistic.COLUMNS in stats
    if whole or not per_sample or not totals:
        samples = index if per_sample else everyone
        parts = columns.iter_leaf_columns(group, samples, into_output=into_output)
        return _reduce(parts, stats, index_length(samples), squares_wide)
    parts = columns.iter_leaf_columns(group, index, into_output=into_output)
    first = _reduce(parts, per_sample, index_length(index), squares_wide)
    second = _reduce(columns.iter_leaf_columns(group, everyone), totals, columns.bp.n, squares_wide)
    return [a | b for a, b in zip(first, second)]


def _reduce(
    parts: Iterable[list[Tensor]], stats: set[Statistic], count: int, squares_wide: bool = False
) -> list[dict[Statistic, Tensor]]:
    """Fold chunks of column gradients (one ``[K, n, *p]`` tensor per leaf) into statistics.

    Column gradients asked for themselves are written chunk by chunk into one output of
    all ``count`` samples: no second tensor of that size, as joining the chunks would be.
    Squares of float16 columns are summed in float32 and come back in float16, unless
    ``squares_wide``.
    """
    collected: list[dict[Statistic, list[Tensor]]] | None = None
    outputs: list[_Columns] = []
    dtypes: list[torch.dtype] = []  # (squares of float16 columns add up in float32)
    for chunk in parts:
        if collected is None:
            collected = [{stat: [] for stat in stats - {Statistic.COLUMNS}} for _ in chunk]
            outputs = [_Columns(count) for _ in chunk]
            dtypes = [t.dtype for t in chunk]
        for found, output, per_sample in zip(collected, outputs, chunk):
            for stat in found:
                found[stat].append(_statistic(stat, per_sample))
            if Statistic.COLUMNS in stats:
                output.write(per_sample)
        del chunk, per_sample  # not held while the next chunk is formed
    if collected is None:
        raise ValueError("the batch is empty; pass at least one sample.")
    kept_wide = SQUARED if squares_wide else frozenset()  # (as _statistic took them)
    reduced: list[dict[Statistic, Tensor]] = [
        {
            stat: _combine(stat, values) if stat in kept_wide else _combine(stat, values).to(dtype)
            for stat, values in f.items()
        }
        for f, dtype in zip(collected, dtypes)
    ]
    if Statistic.COLUMNS in stats:
        for leaf_stats, output in zip(reduced, outputs):
            leaf_stats[Statistic.COLUMNS] = output.result()
    return reduced


class _Columns:
    """Column gradients of ``count`` samples, assembled from chunks ``[K, n, *p]`` in order."""

    def __init__(self, count: int):
        self.count, self.filled = count, 0
        self.tensor: Tensor | None = None
        self.parts: list[Tensor] = []  # chunks that cannot be written into memory (vmap, grad)

    def write(self, chunk: Tensor) -> None:
        """Append a chunk (the first, if it covers every sample, is kept as it is)."""
        size = chunk.shape[1]
        if self.tensor is None and size == self.count:
            self.tensor = chunk
        elif self.parts or not is_plain(chunk):
            self.parts.append(chunk)
        else:
            if self.tensor is None:
                shape = (chunk.shape[0], self.count, *chunk.shape[2:])
                self.tensor = new_output(shape, chunk)
            self.tensor[:, self.filled : self.filled + size] = chunk
        self.filled += size

    def result(self) -> Tensor:
        """All samples' column gradients."""
        assert self.filled == self.count
        if self.parts:
            return torch.cat(self.parts, 1)
        assert self.tensor is not None
        return self.tensor


_NORM_SEGMENT = 2**14
"""Entries per norm in :func:`squared_row_norms`."""


def squared_row_norms(rows: Tensor) -> Tensor:
    """Each row's squared norm, ``[N]``, right to rounding at any width (float32 where float16).

    ``torch.linalg.vector_norm`` of a long float32 row reads low on a CPU (its accumulation
    rounds: 3e-5 at 2²² entries, 3e-4 at 2²⁴; a clipped sum then exceeds its bound by as
    much). Norms of segments of :data:`_NORM_SEGMENT` entries are right to rounding; their
    squares are summed. Nothing of the rows' size is formed.

    Args:
        rows: ``[N, W]``.

    Returns:
        ``[N]``.

    Example:
        >>> squared_row_norms(torch.full((2, 40000), 0.5))
        tensor([10000., 10000.])
    """
    n, width = rows.shape
    whole = width - width % _NORM_SEGMENT
    if whole and rows.stride(1) == 1:  # (a view: each row's segments in one call)
        segments = [rows[:, :whole].view(n, -1, _NORM_SEGMENT).transpose(1, 2)]
    else:
        segments = [rows[:, s : s + _NORM_SEGMENT, None] for s in range(0, whole, _NORM_SEGMENT)]
    if width % _NORM_SEGMENT or not width:
        segments.append(rows[:, whole:, None])
    # (squared in float32 where float16: the norms fit, their squares may not)
    if len(segments) == 1 and segments[0].shape[2] == 1:  # (one segment: nothing to sum)
        return for_squares(torch.linalg.vector_norm(segments[0], dim=(1, 2))).square()
    norms = torch.cat([torch.linalg.vector_norm(s, dim=1) for s in segments], 1)
    return for_squares(norms).square().sum(1)


def _statistic(stat: Statistic, columns: Tensor) -> Tensor:
    """One chunk's contribution to a statistic, without a temporary of the chunk's size.

    Squares of float16 columns are taken in float32 (:func:`for_squares`: the caller
    brings the total back).
    """
    if stat is Statistic.COLUMNS:
        return columns
    if stat is Statistic.SUM:
        return columns.sum((0, 1))
    columns = for_squares(columns)
    if stat is Statistic.SQUARED_NORMS:
        width = columns.shape[0] * math.prod(columns.shape[2:])  # (-1: no width for no samples)
        per_sample = columns.transpose(0, 1).reshape(columns.shape[1], width)
        return squared_row_norms(per_sample)
    if stat is Statistic.DIAGONAL_PER_SAMPLE:
        return columns.square().sum(0)
    flat = columns.reshape(-1, *columns.shape[2:])
    length = max(1, _SQUARES_AT_ONCE // max(flat[0].numel(), 1))
    total = torch.zeros_like(flat[0])
    for s in chunks(flat.shape[0], length):
        total = total + flat[s].square().sum(0)
    return total


def _combine(stat: Statistic, values: list[Tensor]) -> Tensor:
    """Join the chunks' contributions to a statistic."""
    if len(values) == 1:
        return values[0]
    if stat is Statistic.COLUMNS:
        return torch.cat(values, dim=1)
    if stat in PER_SAMPLE:
        return torch.cat(values)
    return sum(values[1:], values[0])


def ggn_statistics(
    bp: BatchPass,
    stats: set[Statistic],
    index: slice | Tensor,
    mc_samples: int | None = None,
    generator: torch.Generator | None = None,
) -> list[dict[Statistic, Tensor]]:
    """Statistics of the columns of the GGN's square root, ``J_nᵀ S_n``, per leaf.

    The loss Hessian's square-root columns are pulled back in slices small
    enough for the memory budget; the slices' statistics are combined.

    Args:
        bp: The batch pass.
        stats: Names of the statistics wanted.
        index: Samples that per-sample statistics cover.
        mc_samples: ``None`` for the exact GGN, else Monte-Carlo samples.
        generator: Random generator for the samples.

    Returns:
        One dict of statistics per leaf.

    Example:
        >>> fn, p = packfunc.functional(torch.nn.Linear(3, 2))
        >>> bp = BatchPass(fn, p, torch.randn(4, 3), torch.tensor([0, 1, 1, 0]),
        ...               torch.nn.CrossEntropyLoss())
        >>> ggn_statistics(bp, {Statistic.COLUMNS}, slice(0, 4))[1][Statistic.COLUMNS].shape
        torch.Size([2, 4, 2, 3])
    """
    factors = hessian_factors(
        bp.loss, bp.record.output, bp.y, mc_samples=mc_samples, generator=generator
    )
    length = chunk_length(factors.count, bp.n * bp.column_width(), None)
    parts = [
        leaf_statistics(bp.columns(factors.make(s)), stats, index)
        for s in chunks(factors.count, length)
    ]
    return [_join_columns([part[leaf] for part in parts]) for leaf in range(len(bp.leaves))]


def _join_columns(parts: list[dict[Statistic, Tensor]]) -> dict[Statistic, Tensor]:
    """Combine the statistics of consecutive slices of columns."""
    if len(parts) == 1:
        return parts[0]
    joined = {}
    for stat in parts[0]:
        values = [part[stat] for part in parts]
        joined[stat] = (
            torch.cat(values) if stat is Statistic.COLUMNS else sum(values[1:], values[0])
        )
    return joined
