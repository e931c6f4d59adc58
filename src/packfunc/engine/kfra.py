"""KFRA's step: the expected Jacobian sandwich ``E_n[J_nᵀ H J_n]`` of one op of a chain.

KFRA (Botev et al., 2017) propagates one batch-averaged matrix ``H`` (the GGN
w.r.t. the current chain tensor) from the output back to the input, op by op
(``engine/layer_factors.py`` reads a layer's factors off it on the way). Selections
(max pooling, padding, slicing) average their Jacobians with one gather and one
matrix product instead of a pass per sample.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.func import vmap

from packfunc.engine.autodiff import jvp, vjp
from packfunc.engine.chain import Link
from packfunc.engine.memory import DEFAULT_BUDGET, chunks, is_plain, new_output
from packfunc.engine.ops import ELEMENTWISE, PIECEWISE_LINEAR, RESHAPES, SAMPLE_INDEPENDENT


def expected_jacobian_sandwich(link: Link, H: Tensor) -> Tensor:
    """``E_n[J_nᵀ H J_n]`` for one op, ``H`` over a sample's output entries.

    Reshapes keep ``H``; elementwise ops scale it by ``E_n[φ'_n φ'_nᵀ]``; a linear
    layer gives ``Wᵀ H W`` per position pair; a convolution has one Jacobian for all
    samples; every other op is averaged over the samples.

    Args:
        link: The op.
        H: ``[D_out, D_out]``.

    Returns:
        ``[D_in, D_in]``.
    """
    if link.func in RESHAPES:
        return H
    n = link.input.shape[0]
    if link.func in ELEMENTWISE:
        _, slope = jvp(link.apply, (link.input,), (torch.ones_like(link.input),))
        return _masked_gram(slope.reshape(n, -1), lambda rows: H[rows], H)
    if link.op is not None and link.op.input_jacobian_is_weight:
        weight = link.kwargs["weight"]
        positions = link.output[0].numel() // weight.shape[0]
        blocks = H.view(positions, weight.shape[0], positions, weight.shape[0])
        return torch.einsum("oi,xoyp,pj->xiyj", weight, blocks, weight).reshape(
            positions * weight.shape[1], -1
        )
    if link.call is not None or link.func in SAMPLE_INDEPENDENT:
        return _sandwich(link.apply, link.input[:1], H)
    selection = _selection(link) if link.func in PIECEWISE_LINEAR else None
    if selection is not None:
        return _selection_sandwich(*selection, H, link.input[0].numel())
    total = _sandwich(link.apply, link.input[:1], H)
    for sample in range(1, n):  # one sample at a time: each term is [D_in, D_in]
        total = total + _sandwich(link.apply, link.input[sample : sample + 1], H)
    return total / n


def _selection(link: Link) -> tuple[Tensor, Tensor] | None:
    """``(source, slope)`` if every output entry is one scaled input entry, else ``None``.

    Max pooling, dropout and padding pick, per sample, one input entry (or none)
    for each output entry: ``J_n[a] = slope[n, a] · e_{source[n, a]}``. Three
    forward-mode products in float64 find and verify that: with tangents ``1``,
    ``i`` and ``i²`` (``i`` the entry's index), a one-hot row gives ``s``, ``s·i``
    and ``s·i²``; any other row fails the check.

    Args:
        link: A piecewise-linear op of the chain.

    Returns:
        ``source`` (int64) and ``slope``, both ``[N, D_out]``; ``None`` for other ops.
    """
    x = link.input.double()
    n = x.shape[0]
    index = torch.arange(x[0].numel(), dtype=x.dtype, device=x.device).expand(n, -1)
    try:
        slope, first, second = (
            jvp(link.apply, (x,), (t.reshape(x.shape),))[1].reshape(n, -1)
            for t in (torch.ones_like(index), index, index.square())
        )
    except RuntimeError:  # the op does not take a float64 copy of its input
        return None
    source = torch.where(slope != 0, first / slope.where(slope != 0, 1), 0).round()
    if not torch.allclose(second, slope * source.square(), rtol=1e-9, atol=1e-6):
        return None
    return source.long(), slope.to(link.input.dtype)


def _selection_sandwich(source: Tensor, slope: Tensor, H: Tensor, d_in: int) -> Tensor:
    """``E_n[J_nᵀ H J_n]`` for the scaled selections of :func:`_selection`.

    When each input entry is picked by at most one output entry (non-overlapping
    pools, dropout, padding), the result is ``H[owner, owner] ⊙ MᵀM / N``, with
    ``owner[i]`` that output entry and ``M[n, i]`` the slope with which sample ``n``
    picks ``i``: a gather and one matrix product for the whole batch. Otherwise the
    samples' blocks are scattered into the result one at a time.

    Args:
        source: ``[N, D_out]`` picked input entries.
        slope: ``[N, D_out]`` their factors (0 where nothing is picked).
        H: ``[D_out, D_out]``.
        d_in: Entries of one sample's input.

    Returns:
        ``[D_in, D_in]``.
    """
    n, d_out = source.shape
    picked = slope != 0
    owner = torch.full((d_in,), -1, dtype=torch.long, device=H.device)
    outputs = torch.arange(d_out, device=H.device).expand(n, -1)
    owner[source[picked]] = outputs[picked]
    if not torch.equal(owner[source[picked]], outputs[picked]):  # shared inputs
        total = H.new_zeros(d_in, d_in)
        for src, s in zip(source, slope):
            total.index_put_((src[:, None], src[None, :]), H * torch.outer(s, s), accumulate=True)
        return total / n
    M = H.new_zeros(n, d_in).scatter_add_(1, source, slope)
    owner = owner.clamp_min(0)  # inputs nobody picks have zero rows and columns in MᵀM
    return _masked_gram(M, lambda rows: H.index_select(0, owner[rows]).index_select(1, owner), H)


def _masked_gram(M: Tensor, factor: Callable[[slice], Tensor], H: Tensor) -> Tensor:
    """``F ⊙ MᵀM / N`` for ``M [N, D]``, with ``F[rows] = factor(rows)`` computed from ``H``.

    Built a block of rows at a time, in place where nothing is traced (the ``[D, D]``
    results of KFRA reach gigabytes).
    """
    n, d = M.shape
    if not is_plain(M, H):
        return factor(slice(0, d)) * (M.T @ M) / n
    result = new_output((d, d), M)
    torch.matmul(M.T, M, out=result)
    for rows in chunks(d, max(1, DEFAULT_BUDGET // d)):
        result[rows] *= factor(rows)
    return result.div_(n)


def _sandwich(apply: Callable[[Tensor], Tensor], x: Tensor, H: Tensor) -> Tensor:
    """``Jᵀ H J`` for the Jacobian ``J`` of ``apply`` at one sample ``x`` (``[1, ...]``).

    Rows of ``H`` and then columns of ``H J`` are pulled back in slices that keep
    the pulled-back block within the memory budget.
    """
    out, pullback = vjp(apply, x)

    def pull(rows: Tensor) -> Tensor:
        slices = chunks(rows.shape[0], max(1, DEFAULT_BUDGET // x.numel()))
        return torch.cat(
            [
                vmap(lambda row: pullback(row.view(out.shape))[0].reshape(-1))(rows[s])
                for s in slices
            ]
        )

    return pull(pull(H).T)  # Jᵀ (H J)
