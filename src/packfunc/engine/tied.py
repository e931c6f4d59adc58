"""Squared norms of a parameter that calls of several kinds share (tied weights), in Gram form.

A language model's embedding and its output head often share one matrix (Hugging
Face's ``tie_word_embeddings``; a tied autoencoder uses ``W`` and ``Wᵀ``). Each call's
share of a sample's gradient is a sum of outer products over its positions,
``Σ_l a_l b_lᵀ`` (:meth:`~packfunc.engine.rules.base.Rule.outer_factors`): the head's
cotangent times its input, a one-hot row times the embedding's cotangent. The squared
norm of the sample's whole gradient is then ``Σ_{i,j} (a_i·a_j)(b_i·b_j)`` over the
positions of every call together, where a one-hot row's products are a lookup
(``a_i[idx_j]``) or an equality (``idx_i == idx_j``). Where the positions are few, this
costs far less than forming each sample's gradient (``[n, V, D]`` for a vocabulary of
``V`` rows).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from packfunc.engine.memory import DEFAULT_BUDGET
from packfunc.engine.rules.product import formed_where_cancelled

Factors = tuple[Tensor, Tensor]
"""A call's ``(a, b)``: rows ``[n, L, R]`` (or one-hot row indices ``[n, L]``), columns
``[n, L, C]``."""


def tied_gram_is_cheaper(factors: Sequence[Factors], rows: int) -> bool:
    """Whether :func:`tied_squared_norms` costs less than forming each sample's gradient.

    Its Gram matrices of the positions must also fit in the memory budget.

    Args:
        factors: One ``(a, b)`` pair per call, the same samples in each.
        rows: Rows of the parameter (the length of a one-hot row).

    Returns:
        Whether to take the Gram form.

    Example:
        >>> ids, delta = torch.zeros(2, 8, dtype=torch.long), torch.randn(2, 8, 64)
        >>> v, u = torch.randn(2, 8, 1000), torch.randn(2, 8, 64)
        >>> tied_gram_is_cheaper([(ids, delta), (v, u)], rows=1000)  # 8 positions, 1000 rows
        True
    """
    n, cols = factors[0][1].shape[0], factors[0][1].shape[-1]
    if n * sum(b.shape[1] for _, b in factors) ** 2 > DEFAULT_BUDGET:
        return False
    return _gram_cost(factors, rows, cols) < _formed_cost(factors, rows, cols)


def tied_squared_norms(factors: Sequence[Factors], rows: int) -> Tensor:
    """Per-sample squared norms ``[n]`` of a gradient that several calls' outer products add up to.

    As :func:`~packfunc.engine.rules.product.gram_squared_norms`, a sample whose positions
    cancel gets its squared norm from its gradient, formed.

    Args:
        factors: One ``(a, b)`` pair per call, the same samples in each.
        rows: Rows of the parameter (the length of a one-hot row).

    Returns:
        The squared norms (``≥ 0``).

    Example:
        >>> ids = torch.tensor([[0, 2, 0]])  # an embedding's row per position
        >>> delta, v, u = torch.randn(1, 3, 4), torch.randn(1, 2, 5), torch.randn(1, 2, 4)
        >>> found = tied_squared_norms([(ids, delta), (v, u)], rows=5)  # and a head's
        >>> gradient = torch.zeros(5, 4).index_add(0, ids[0], delta[0]) + v[0].T @ u[0]
        >>> torch.allclose(found, gradient.square().sum()[None])
        True
    """
    total: Tensor | None = None
    diagonal: Tensor | None = None
    for i, (a_i, b_i) in enumerate(factors):
        for j, (a_j, b_j) in enumerate(factors[i:], start=i):
            products, columns = _row_products(a_i, a_j, b_i.dtype), b_i @ b_j.mT
            block = (products * columns).sum((1, 2))
            block = block if i == j else 2 * block  # (j, i) is the transpose of (i, j)
            total = block if total is None else total + block
            if i == j:
                terms = (products.diagonal(0, 1, 2) * columns.diagonal(0, 1, 2)).sum(1)
                diagonal = terms if diagonal is None else diagonal + terms
    assert total is not None and diagonal is not None
    dense = any(a.is_floating_point() for a, _ in factors)  # (rows' products sum rows)
    return formed_where_cancelled(
        total,
        diagonal,
        lambda index: _gradients(factors, index, rows),
        features=(rows if dense else 1) + factors[0][1].shape[-1],
    )


def _gradients(factors: Sequence[Factors], index: Tensor, rows: int) -> Tensor:
    """The gradients ``[k, R, C]`` of the samples ``index``: each call's outer products, added."""
    total = factors[0][1].new_zeros((len(index), rows, factors[0][1].shape[-1]))
    for a, b in factors:
        a, b = a[index], b[index]
        if a.is_floating_point():
            total += a.mT @ b
        else:  # one-hot rows: each position's columns added to its row
            for k in range(len(index)):
                total[k].index_add_(0, a[k], b[k].to(total.dtype))
    return total


def _row_products(a: Tensor, other: Tensor, dtype: torch.dtype) -> Tensor:
    """``[n, L_a, L_o]`` products of two calls' rows, dense or one-hot (equalities in ``dtype``)."""
    if a.is_floating_point() and other.is_floating_point():
        return a @ other.mT
    if a.is_floating_point():  # a dense row times a one-hot one: a lookup
        return a.gather(2, other.unsqueeze(1).expand(-1, a.shape[1], -1))
    if other.is_floating_point():
        return _row_products(other, a, dtype).mT
    return (a.unsqueeze(2) == other.unsqueeze(1)).to(dtype)


def _gram_cost(factors: Sequence[Factors], rows: int, cols: int) -> int:
    """Multiply-adds of the Gram form per sample."""
    cost = 0
    for a_i, b_i in factors:
        for a_j, b_j in factors:
            dense = a_i.is_floating_point() and a_j.is_floating_point()
            cost += b_i.shape[1] * b_j.shape[1] * ((rows if dense else 1) + cols)
    return cost


def _formed_cost(factors: Sequence[Factors], rows: int, cols: int) -> int:
    """Multiply-adds of forming each sample's gradient, and its squared norm."""
    formed = sum(b.shape[1] * (rows if a.is_floating_point() else 1) * cols for a, b in factors)
    return formed + rows * cols
