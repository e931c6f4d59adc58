"""EKFAC: eigenvalues re-fitted to the column gradients in a Kronecker eigenbasis.

For a weight with Kronecker eigenbasis ``Q_A ⊗ Q_B`` (George et al., 2018), the
eigenvalue of ``Q_A[:, i] ⊗ Q_B[:, j]`` is ``λ[i, j] = Σ_{k,n} ((Q_Aᵀ G_kn Q_B)[i, j])²``
with ``G_kn`` the weight's gradient for square-root column ``k`` of sample ``n`` in the
Kronecker layout ``[dim A, dim B]``. The columns carry the reduction's scale, so
``Σ_{k,n} vec G vec Gᵀ`` is the GGN of the reduced loss (exact columns) or its
Monte-Carlo estimate, and ``λ`` is its diagonal in the eigenbasis.

With one position per sample (a linear layer on ``[N, in]``), ``G_kn = v uᵀ`` is rank
one and the squares factor: ``λ = Σ_{k,n} (Q_Aᵀ v)² ((Q_Bᵀ u)²)ᵀ``, without any
``[N, *p]`` tensor. Otherwise the column gradients are materialized in chunks of
samples (bounded memory) and rotated.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from packfunc.engine.batch_pass import BatchPass, ColumnGradients, Term
from packfunc.engine.memory import chunk_length, chunks
from packfunc.engine.rules.product import ProductWeight
from packfunc.losses import hessian_factors


def fitted_eigenvalues(
    bp: BatchPass,
    bases: list[list[Tensor] | None],
    mc_samples: int | None,
    generator: torch.Generator | None,
    columns: ColumnGradients | None = None,
) -> list[Tensor | None]:
    """Eigenvalues of every leaf's GGN block in its Kronecker eigenbasis.

    The square-root columns are drawn exactly as :func:`~packfunc.engine.layer_factors.sqrt_factors`
    draws them (same slices), so a generator in the same state gives the same samples.

    Args:
        bp: The batch pass.
        bases: Per leaf, its eigenvectors ``[Q_A, Q_B]`` or ``[Q_A]`` (``None``: skipped).
        mc_samples: Monte-Carlo samples per sample, or ``None`` for the exact columns.
        generator: Random generator for the samples.
        columns: All column gradients of these samples, already pulled back (e.g. by
            :func:`~packfunc.engine.layer_factors.sqrt_factors`); ``None``: pull them back.

    Returns:
        Per leaf, ``λ`` shaped ``[dim A, dim B]`` (or ``[dim A]``), or ``None``.

    Example:
        >>> fn, p = packfunc.functional(torch.nn.Linear(3, 2))
        >>> bp = BatchPass(fn, p, torch.randn(4, 3), torch.tensor([0, 1, 1, 0]),
        ...               torch.nn.CrossEntropyLoss())
        >>> bases = [[torch.eye(2), torch.eye(3)] if name == "weight" else None
        ...          for name in bp.names]
        >>> fitted_eigenvalues(bp, bases, None, None)[bp.names.index("weight")].shape
        torch.Size([2, 3])
    """
    values: list[Tensor | None] = [None] * len(bases)
    for chunk in [columns] if columns is not None else _column_chunks(bp, mc_samples, generator):
        for leaf, basis in enumerate(bases):
            if basis is None:
                continue
            if values[leaf] is None and len(basis) == 2:  # (once a leaf: its first chunk)
                _check_layout(chunk, leaf, basis)
            fitted = _rotated_squares(chunk, leaf, basis)
            previous = values[leaf]
            values[leaf] = fitted if previous is None else previous + fitted
    return values


def _column_chunks(
    bp: BatchPass, mc_samples: int | None, generator: torch.Generator | None
) -> Iterator[ColumnGradients]:
    """The square-root columns' gradients in memory-bounded chunks of columns."""
    roots = hessian_factors(
        bp.loss, bp.record.output, bp.y, mc_samples=mc_samples, generator=generator
    )
    length = chunk_length(roots.count, bp.n * bp.column_width(), None)
    for s in chunks(roots.count, length):
        yield bp.columns(roots.make(s))


def _rotated_squares(columns: ColumnGradients, leaf: int, basis: list[Tensor]) -> Tensor:
    """``Σ_{k,n} (Q_Aᵀ G_kn Q_B)²`` of one leaf for one slice of columns."""
    bp, terms = columns.bp, columns.terms.get(leaf, [])
    sizes = tuple(q.shape[0] for q in basis)
    if not terms and leaf not in bp.whole_model:  # the output does not depend on the leaf
        return basis[0].new_zeros(sizes)
    if len(basis) == 2 and len(terms) == 1 and _rank_one(terms[0]):
        return _rank_one_squares(terms[0], basis)
    total = basis[0].new_zeros(sizes)
    for [grads] in columns.iter_leaf_columns([leaf], slice(0, bp.n)):
        flat = kronecker_layout(grads.flatten(0, 1), terms[0] if terms else None, sizes)
        rotated = flat @ basis[0] if len(basis) == 1 else basis[0].T @ flat @ basis[1]
        total = total + rotated.square().sum(0)
    return total


def kronecker_layout(grads: Tensor, term: Term | None, sizes: tuple[int, ...]) -> Tensor:
    """Parameter-shaped gradients ``[M, *p]`` in the Kronecker layout ``[M, *sizes]``.

    The leaf's rule puts the axes in its factors' order
    (:meth:`~packfunc.engine.rules.base.Rule.kronecker_gradients`): a transposed
    convolution's weight ``[C_in, C_out/G, k…]`` becomes, per group, ``[C_out/G, C_in/G·k…]``
    (``weight.transpose(0, 1)`` for one group). A linear weight stored ``[in, out]`` has its
    factors in that order already.

    Args:
        grads: Gradients ``[M, *param.shape]``.
        term: The leaf's term (its rule and call), or ``None`` for a leaf without one
            (plain row-major layout).
        sizes: The factors' sizes.

    Returns:
        The gradients as ``[M, dim A]`` or ``[M, dim A, dim B]``.

    Example:
        >>> fn, p = packfunc.functional(torch.nn.ConvTranspose1d(2, 3, 2))
        >>> bp = BatchPass(fn, p, torch.randn(1, 2, 4), torch.randn(1, 3, 5), torch.nn.MSELoss())
        >>> term = bp.gradient_columns().terms[0][0]
        >>> kronecker_layout(torch.randn(7, 2, 3, 2), term, (3, 4)).shape
        torch.Size([7, 3, 4])
    """
    m = grads.shape[0]
    if len(sizes) == 2 and term is not None:
        grads = term.rule.kronecker_gradients(grads, term.call)
    return grads.reshape(m, *sizes)


def _check_layout(columns: ColumnGradients, leaf: int, basis: list[Tensor]) -> None:
    """Refuse a basis whose two sizes are not a matrix leaf's factors' (in their order).

    A basis of the right total size in the other order (``[Q_in, Q_out]`` for a linear
    weight ``[out, in]``) was multiplied into a reshape of the gradients, silently.

    Raises:
        ValueError: naming the leaf, both layouts and the fix.
    """
    bp, terms = columns.bp, columns.terms.get(leaf, [])
    term, sizes = (terms[0] if terms else None), tuple(q.shape[0] for q in basis)
    param = bp.leaves[leaf]
    probe = torch.empty((1, *param.shape), device="meta", dtype=param.dtype)
    laid = term.rule.kronecker_gradients(probe, term.call) if term is not None else probe
    if laid.dim() != 3:  # (a convolution's layout: its factors' sizes are the rule's to say)
        return
    expected = (laid.shape[1], laid.shape[2])
    if sizes != expected:
        raise ValueError(
            f"eigenvectors[{bp.names[leaf]!r}] have sizes {list(sizes)}, but its Kronecker "
            f"factors have sizes {list(expected)}, in that order (the order pf.kfac returns "
            "them in): pass [Q_A, Q_B] of those factors (kron.eigh of pf.kfac's, or "
            "pf.ekfac's eigenvectors)."
        )


def _rank_one(term: Term) -> bool:
    """Whether each column gradient is one outer product ``v uᵀ`` in the Kronecker layout."""
    return (
        isinstance(term.rule, ProductWeight)
        and not term.call.transposed
        and term.x.shape[-1] == 1
        and term.g.shape[2] == 1
    )


def _rank_one_squares(term: Term, basis: list[Tensor]) -> Tensor:
    """``Σ_{k,n} (Q_Aᵀ v)² ((Q_Bᵀ u)²)ᵀ`` from ``x [Kx, N, 1, I, 1]`` and ``g [Kg, N, 1, O, 1]``.

    One column dim is 1 (canonical tensors carry columns on one side only).
    """
    v = term.g[:, :, 0, :, 0]  # [Kg, N, O]
    u = term.x[:, :, 0, :, 0]  # [Kx, N, I]
    a, b = (v @ basis[0]).square(), (u @ basis[1]).square()
    if a.shape[0] == 1 or b.shape[0] == 1:  # the column dim on one side: sum it there first
        return a.sum(0).T @ b.sum(0)
    return a.flatten(0, 1).T @ b.flatten(0, 1)


__all__ = ["fitted_eigenvalues", "kronecker_layout"]
