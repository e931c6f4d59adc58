"""Rules for ``F.embedding``: row ``idx`` of the weight receives the cotangent at ``idx``."""

from __future__ import annotations

import torch
from torch import Tensor

from packfunc.engine.memory import is_plain, new_output
from packfunc.engine.ops import SiteCall
from packfunc.engine.rules.base import Rule
from packfunc.engine.rules.product import formed_where_cancelled


class EmbeddingWeight(Rule):
    """Embedding weight ``[V, D]``; canonical ``x: [1, N, L]`` indices, ``g: [K, N, L, D]``.

    Squared reductions avoid ``[K, N, V, D]``: the cotangents of each distinct
    (column, sample, row) key are summed first, so work and memory scale with
    the number of indices, not with the vocabulary.
    """

    merge_dim = 2
    fresh_columns = True

    def canonical(
        self, x: Tensor, g: Tensor, call: SiteCall, param: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Flatten positions; zero the cotangents at ``padding_idx``."""
        n, columns, width = x.shape[0], g.shape[0], g.shape[-1]
        x, g = x.reshape(1, n, -1), g.reshape(columns, n, -1, width)
        padding_idx = call.option("padding_idx")
        if padding_idx is not None:
            g = g * (x != padding_idx % param.shape[0]).unsqueeze(-1).to(g.dtype)
        return x, g

    def outer_factors(
        self, x: Tensor, g: Tensor, call: SiteCall, param: Tensor
    ) -> tuple[Tensor, Tensor]:
        """``(indices [n, L], cotangents [n, L, D])``: row ``idx`` receives the cotangent at it.

        Example:
            >>> from packfunc.engine.ops import SIGNATURES
            >>> call = SiteCall(SIGNATURES[F.embedding], (("weight", 1),), (("padding_idx", None),))
            >>> a, b = EmbeddingWeight().outer_factors(
            ...     torch.tensor([[0, 2]]), torch.ones(1, 1, 2, 3), call, torch.ones(4, 3))
            >>> a, b.shape
            (tensor([[0, 2]]), torch.Size([1, 2, 3]))
        """
        indices, cotangents = self.canonical(x, g, call, param)
        return indices[0], cotangents[0]

    def columns(self, x: Tensor, g: Tensor, call: SiteCall, param: Tensor) -> Tensor:
        """Scatter-add each column's cotangents into its own copy of the weight."""
        columns, n, _, width = g.shape
        keys = _keys(x, columns, param.shape[0])
        source = g.reshape(-1, width)
        size = columns * n * param.shape[0]
        if is_plain(g):
            out = new_output((size, width), like=g).zero_().index_add_(0, keys, source)
        else:
            out = g.new_zeros(size, width).index_add(0, keys, source)
        return out.view(columns, n, *param.shape)

    def add_columns(
        self, total: Tensor, x: Tensor, g: Tensor, call: SiteCall, param: Tensor
    ) -> Tensor:
        """Scatter-add each column's cotangents into ``total`` (no copy of the weight's size)."""
        columns, _, _, width = g.shape
        if not total.is_contiguous() or not is_plain(total, g):
            return super().add_columns(total, x, g, call, param)
        keys = _keys(x, columns, param.shape[0])
        total.view(-1, width).index_add_(0, keys, g.reshape(-1, width).to(total.dtype))
        return total

    def column_sum(self, x: Tensor, g: Tensor, call: SiteCall, param: Tensor) -> Tensor:
        """Scatter-add all cotangents into one weight."""
        return g.new_zeros(param.shape).index_add(
            0, x.reshape(-1), g.sum(0).reshape(-1, g.shape[-1])
        )

    def diagonal(self, x: Tensor, g: Tensor, call: SiteCall, param: Tensor) -> Tensor:
        """Squared per-key sums, scattered into rows."""
        rows = param.shape[0]
        unique, sums = _key_sums(x, g, rows)
        return g.new_zeros(param.shape).index_add(0, unique % rows, sums.square())

    def diagonal_per_sample(self, x: Tensor, g: Tensor, call: SiteCall, param: Tensor) -> Tensor:
        """Squared per-key sums, scattered into each sample's rows."""
        n, rows = x.shape[1], param.shape[0]
        unique, sums = _key_sums(x, g, rows)
        target = (unique // rows) % n * rows + unique % rows
        out = g.new_zeros(n * rows, g.shape[-1]).index_add(0, target, sums.square())
        return out.view(n, *param.shape)

    def position_terms(self, x: Tensor, g: Tensor, call: SiteCall, param: Tensor) -> Tensor:
        """``Σ_{k,l} ‖g_kl‖²`` per sample: the terms its rows' sums add (see base)."""
        return g.square().sum(-1).sum(-1).sum(0)

    def squared_norms(self, x: Tensor, g: Tensor, call: SiteCall, param: Tensor) -> Tensor:
        """Squared norms of the per-key sums, gathered per sample.

        A sample whose repeated tokens' cotangents cancel (a per-key sum far below its
        terms) gets its squared norm from its gradient, formed, and is noted
        (:func:`~packfunc.engine.rules.product.formed_where_cancelled`): its clipped sum is
        then taken from that gradient too, not from the batch's scatter-add, whose rounding
        of its terms the norm does not bound.
        """
        n, rows = x.shape[1], param.shape[0]
        unique, sums = _key_sums(x, g, rows)
        squares = g.new_zeros(n).index_add(0, (unique // rows) % n, sums.square().sum(-1))
        terms = self.position_terms(x, g, call, param)

        def gradients(index: Tensor) -> Tensor:
            return self.columns(x[:, index], g[:, index], call, param).transpose(0, 1)

        return formed_where_cancelled(squares, terms, gradients, features=x.shape[-1])


def _keys(x: Tensor, columns: int, rows: int) -> Tensor:
    """Flat key ``(k·N + n)·V + row`` of every index of every column."""
    n = x.shape[1]
    column_of = torch.arange(columns * n, device=x.device).view(columns, n, 1)
    return (column_of * rows + x).reshape(-1)


def _key_sums(x: Tensor, g: Tensor, rows: int) -> tuple[Tensor, Tensor]:
    """Distinct (column, sample, row) keys and the sums of their cotangents.

    Under ``vmap`` over the indices (batches of tokens), where the number of distinct keys
    would be a shape that depends on the values, every key: the sums of all ``N·V`` rows
    (the per-sample gradients' size).

    Example:
        >>> unique, sums = _key_sums(torch.tensor([[[1, 1]]]), torch.ones(1, 1, 2, 3), 4)
        >>> unique.tolist(), sums.tolist()
        ([1], [[2.0, 2.0, 2.0]])
    """
    keys, flat = _keys(x, g.shape[0], rows), g.reshape(-1, g.shape[-1])
    try:
        unique, inverse = torch.unique(keys, return_inverse=True)
    except RuntimeError as error:
        if "dynamic shape" not in str(error):
            raise
        every = torch.arange(g.shape[0] * x.shape[1] * rows, device=x.device)
        return every, g.new_zeros(every.shape[0], g.shape[-1]).index_add(0, keys, flat)
    return unique, g.new_zeros(unique.shape[0], g.shape[-1]).index_add(0, inverse, flat)
