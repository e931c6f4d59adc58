"""The statistics every quantity is made of, reduced from column gradients.

A column gradient ``c[k, n]`` is a parameter's gradient pulled back from output
cotangent ``k`` of sample ``n``: the loss gradient (``K = 1``) for first-order
quantities, a column of the loss Hessian's square root for the GGN. Rules name
their closed forms after these statistics (``rule.diagonal(...)`` and so on).
"""

from __future__ import annotations

from enum import Enum


class Statistic(str, Enum):
    """A reduction of column gradients ``c[k, n]`` (``k``: output cotangent, ``n``: sample)."""

    COLUMNS = "columns"
    """``c`` itself, ``[K, n, *p]``: per-sample gradients, or the GGN's square root."""

    SUM = "column_sum"
    """``Σ_{k,n} c[k, n]``: the gradient."""

    SQUARED_NORMS = "squared_norms"
    """``Σ_k ‖c[k, n]‖²`` per sample, ``[n]``: per-sample gradient norms."""

    DIAGONAL = "diagonal"
    """``Σ_{k,n} c[k, n]²``: the diagonal of ``Σ c cᵀ`` (e.g. the GGN's)."""

    DIAGONAL_PER_SAMPLE = "diagonal_per_sample"
    """``Σ_k c[k, n]²`` per sample, ``[n, *p]``: each sample's share of the diagonal."""


PER_SAMPLE = frozenset({Statistic.COLUMNS, Statistic.SQUARED_NORMS, Statistic.DIAGONAL_PER_SAMPLE})
"""Statistics with one entry per requested sample; the others sum over the whole batch."""

SQUARED = frozenset({Statistic.SQUARED_NORMS, Statistic.DIAGONAL, Statistic.DIAGONAL_PER_SAMPLE})
"""Statistics made of squares (float16 ones are taken in float32: ``precision.for_squares``)."""
