"""Weights of ops that multiply a (grouped) input matrix by the weight: linear and convolution.

After canonicalization both kinds of layer look alike per sample ``n`` and group:
``u[n, g]`` is ``[I, L]`` (input features by positions) and ``v[k, n, g]`` is
``[O, L]`` (output cotangents by positions); column ``(k, n)``'s weight
gradient is ``Σ_l v_l u_lᵀ``. For a linear layer ``u`` is the input itself, for
a convolution the unfolded input (``I = C_in/G · kernel`` per position).
Canonical tensors are ``x: [Kx, N, G, I, L]`` and ``g: [Kg, N, G, O, L]`` with
the column dim on one side only (``Kx == 1`` or ``Kg == 1``).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from packfunc.engine.autodiff import under_vmap
from packfunc.engine.memory import is_plain, new_output
from packfunc.engine.ops import SiteCall
from packfunc.engine.rules.base import Rule
from packfunc.engine.thread_lists import collecting, note


class ProductWeight(Rule):
    """Closed forms on canonical ``x: [Kx, N, G, I, L]``, ``g: [Kg, N, G, O, L]``.

    For ``L == 1`` the squares need no column gradients: ``(v uᵀ)² = v² (u²)ᵀ``,
    so every squared reduction is a product of squared factors summed over the
    column dim first. For ``L > 1`` the squared norm has the Gram form
    ``Σ_{l,m} (v_l·v_m)(u_l·u_m)``, used when cheaper than materializing.
    Several calls of one layer (weight sharing) concatenate along ``L``.
    """

    merge_dim = -1
    kronecker_factors = 2
    fresh_columns = True

    def columns(self, x: Tensor, g: Tensor, call: SiteCall, param: Tensor) -> Tensor:
        """Column gradients ``Σ_l v_l u_lᵀ``, shaped ``[K, n, *param.shape]``."""
        columns, n, groups, n_out, _ = g.shape
        if max(columns, x.shape[0]) > 1:
            return _column_products(x, g).reshape(max(columns, x.shape[0]), n, *param.shape)
        if not is_plain(x, g):
            return torch.matmul(g, x.transpose(-1, -2)).reshape(1, n, *param.shape)
        out = new_output((1, n, groups, n_out, x.shape[-2]), like=g)
        if g.shape[-1] == 1:
            torch.mul(g, x.transpose(-1, -2), out=out)
        else:
            torch.matmul(g, x.transpose(-1, -2), out=out)
        return out.view(1, n, *param.shape)

    def add_columns(
        self, total: Tensor, x: Tensor, g: Tensor, call: SiteCall, param: Tensor
    ) -> Tensor:
        """``total += Σ_l v_l u_lᵀ`` as one batched product into ``total`` (one column)."""
        columns, n, groups, n_out, _ = g.shape
        if max(columns, x.shape[0]) > 1 or not total.is_contiguous() or not is_plain(total, x, g):
            return super().add_columns(total, x, g, call, param)
        flat = total.view(n * groups, n_out, x.shape[-2])
        flat.baddbmm_(g.reshape(-1, n_out, g.shape[-1]), x.reshape(-1, *x.shape[-2:]).mT)
        return total

    def column_sum(self, x: Tensor, g: Tensor, call: SiteCall, param: Tensor) -> Tensor:
        """``Σ_{k,n,l} v u_lᵀ`` per group; the column dim is summed on its side first."""
        return _contract_samples(_column_sum(g), _column_sum(x)).reshape(param.shape)

    def diagonal(self, x: Tensor, g: Tensor, call: SiteCall, param: Tensor) -> Tensor | None:
        """``Σ_n (Σ_k v_kn²)(Σ_k u_kn²)ᵀ`` when every sample has one position."""
        if x.shape[-1] != 1:
            return None
        return _contract_samples(*_summed_squares(x, g)).reshape(param.shape)

    def diagonal_per_sample(
        self, x: Tensor, g: Tensor, call: SiteCall, param: Tensor
    ) -> Tensor | None:
        """``(Σ_k v_kn²)(Σ_k u_kn²)ᵀ`` per sample when every sample has one position."""
        if x.shape[-1] != 1:
            return None
        v2, u2 = _summed_squares(x, g)
        n = v2.shape[0]
        if not is_plain(v2, u2):
            return (v2 * u2.transpose(-1, -2)).reshape(n, *param.shape)
        out = new_output((n, v2.shape[1], v2.shape[2], u2.shape[2]), like=v2)
        return torch.mul(v2, u2.transpose(-1, -2), out=out).view(n, *param.shape)

    def squared_norms(self, x: Tensor, g: Tensor, call: SiteCall, param: Tensor) -> Tensor | None:
        """``Σ_k ‖v_kn‖²‖u_kn‖²`` over groups; the Gram form for one column and ``L > 1``."""
        n_in, n_out, length = x.shape[-2], g.shape[-2], x.shape[-1]
        if length == 1:  # ‖v‖‖u‖ squared per group: no overflow where the result has none
            v_norms: Tensor = torch.linalg.vector_norm(g, dim=(0, -2, -1))
            u_norms: Tensor = torch.linalg.vector_norm(x, dim=(0, -2, -1))
            return (v_norms * u_norms).square().sum(1)
        if g.shape[0] != 1 or x.shape[0] != 1 or not gram_is_cheaper(length, n_in, n_out):
            return None
        gram_g = g[0].transpose(-1, -2) @ g[0]
        gram_u = x[0].transpose(-1, -2) @ x[0]
        return gram_squared_norms(
            gram_g, gram_u, lambda i: g[0][i] @ x[0][i].transpose(-1, -2), features=n_in + n_out
        )

    def position_terms(self, x: Tensor, g: Tensor, call: SiteCall, param: Tensor) -> Tensor:
        """``Σ_{k,l} ‖v_kl‖²‖u_kl‖²`` per sample, over groups: a gradient's terms (see base)."""
        return (g.square().sum(-2) * x.square().sum(-2)).sum((0, 2, 3))

    def sums_positions(self, g: Tensor, approx: str) -> bool:
        """Unless ``"expand"`` keeps several positions apart."""
        return approx != "expand" or g.shape[-1] == 1

    def output_factor(self, g: Tensor, approx: str) -> Tensor:
        """``Σ_{k,n} s sᵀ`` over all output channels, ``s`` the position-summed cotangent.

        With ``"expand"``, one outer product per position instead.
        """
        columns, n, groups, n_out, length = g.shape
        if approx == "expand" or length == 1:  # (one position: no sum to take)
            flat = g.permute(0, 1, 4, 2, 3).reshape(-1, groups * n_out)
        else:
            flat = g.sum(-1).reshape(-1, groups * n_out)
        return flat.T @ flat

    def input_factor(
        self, x: Tensor, approx: str, *, add_to: Tensor | None = None, samples: int | None = None
    ) -> Tensor:
        """Uncentered input covariance, averaged over samples and groups.

        ``"sum"``: ``Σ_{n,l} u uᵀ / N``; ``"expand"``: ``/ (N·L)``; ``"reduce"``:
        ``Σ_n ū ūᵀ / N`` with ``ū`` the mean over positions. With ``add_to``, the factor of
        these samples is added into it (in place; a chunk of one sample of one group then
        makes no temporary); ``samples`` is the ``N`` it is averaged over (default: the
        samples of ``x``).
        """
        _, n, groups, n_in, length = x.shape
        total = n if samples is None else samples
        scale = total * groups * (length if approx == "expand" else 1)
        if approx == "reduce" or length == 1:
            flat = x[0].mean(-1).reshape(-1, n_in) if approx == "reduce" else x[0].view(-1, n_in)
            # scaled within the product: neither the input nor the factor is copied
            if add_to is not None:
                return add_to.addmm_(flat.T, flat, alpha=1 / (total * groups))
            return torch.addmm(flat.new_zeros(()), flat.T, flat, beta=0, alpha=1 / (total * groups))
        u = x[0]  # [N, G, I, L]
        if add_to is not None and n * groups == 1:
            return add_to.addmm_(u[0, 0], u[0, 0].T, alpha=1 / scale)
        # scaled within the products, before their sum (a float16 sum of N·L terms overflows
        # where the average does not)
        if n * groups * n_in * n_in <= u.numel():  # per-sample products, no transposed copy
            rows = u.reshape(n * groups, n_in, length)
        else:
            rows = u.permute(1, 2, 0, 3).reshape(groups, n_in, n * length)  # a copy the size of u
        products = torch.baddbmm(rows.new_zeros(()), rows, rows.mT, beta=0, alpha=1 / scale)
        found = products.sum(0)
        return found if add_to is None else add_to.add_(found)


def gram_is_cheaper(length: int, n_in: int, n_out: int) -> bool:
    """Whether the Gram form of a squared norm beats materializing the gradient.

    Per sample and group the Gram form costs ``L²(I + O)`` multiply-adds, the
    gradient ``Σ_l v_l u_lᵀ`` costs ``L·I·O`` and its squared norm ``I·O`` more.

    Args:
        length: Positions ``L``.
        n_in: Input features per position ``I``.
        n_out: Output features per position ``O``.

    Returns:
        ``L (I + O) < I·O``.

    Example:
        >>> gram_is_cheaper(4, 512, 512), gram_is_cheaper(1024, 144, 16)
        (True, False)
    """
    return length * (n_in + n_out) < n_in * n_out


def gram_squared_norms(
    gram_v: Tensor, gram_u: Tensor, gradients: Callable[[Tensor], Tensor], *, features: int = 1
) -> Tensor:
    """``Σ_{l,m} (v_l·v_m)(u_l·u_m)`` per sample (dim 0): squared norms in Gram form, ``≥ 0``.

    The Gram form loses to rounding what a gradient's positions cancel: its error is of the
    order of the terms ``‖v_l‖‖v_m‖‖u_l‖‖u_m‖``, not of the result. A sample whose squared
    norm is below :func:`cancellation_tolerance` of ``Σ_l ‖v_l‖²‖u_l‖²`` (the diagonal's
    terms) gets it from its gradient, formed (``gradients``): a crafted sample whose
    positions cancel would otherwise read a norm of about zero, and go unclipped.

    Args:
        gram_v: Gram matrices of the output cotangents over positions, ``[N, ..., L, L]``.
        gram_u: Those of the inputs, the same shape.
        gradients: Maps sample indices ``[k]`` to those samples' gradients ``[k, ...]``.
        features: The entries each Gram entry sums, both sides together (``O + I``).

    Returns:
        ``[N]``.

    Example:
        >>> v, u = torch.tensor([[[1.0], [-1.0]]]), torch.ones(1, 2, 1)
        >>> gram_squared_norms(v @ v.mT, u @ u.mT, lambda i: v[i].mT @ u[i])
        tensor([0.])
    """
    squares = (gram_v * gram_u).flatten(1).sum(1)
    diagonal = (gram_v.diagonal(0, -2, -1) * gram_u.diagonal(0, -2, -1)).flatten(1).sum(1)
    return formed_where_cancelled(squares, diagonal, gradients, features=features)


def formed_where_cancelled(
    squares: Tensor, diagonal: Tensor, gradients: Callable[[Tensor], Tensor], *, features: int = 1
) -> Tensor:
    """Squared norms in Gram form, those of samples whose positions cancel from their gradients.

    Args:
        squares: Squared norms in Gram form ``[N]``.
        diagonal: Their terms of equal positions, ``Σ_l ‖v_l‖²‖u_l‖²`` ``[N]``.
        gradients: Maps sample indices ``[k]`` to those samples' gradients ``[k, ...]``.
        features: The entries each of the terms' products sums (:func:`cancellation_tolerance`).

    Returns:
        ``[N]``, ``≥ 0``.

    Example:
        >>> formed_where_cancelled(torch.tensor([1e-9, 2.0]), torch.tensor([1.0, 2.0]),
        ...                        lambda i: torch.full((len(i), 2), 0.5))
        tensor([0.5000, 2.0000])
    """
    cancelled = cancelled_samples(squares, diagonal, features=features)
    if under_vmap():  # (no branch on values there: every sample's gradient, formed)
        everyone = torch.arange(len(squares), device=squares.device)
        formed = gradients(everyone).flatten(1).square().sum(1).to(squares.dtype)
        return torch.where(cancelled, formed, squares).clamp(min=0)
    if bool(cancelled.any()):
        index = cancelled.nonzero().squeeze(1)
        formed = gradients(index).flatten(1).square().sum(1).to(squares.dtype)
        squares = squares.index_put((index,), formed)
        note(_CANCELLED, "samples", index)
    return squares.clamp_(min=0)


_CANCELLED = threading.local()
"""This thread's list of the samples :func:`formed_where_cancelled` formed, where one is kept."""


@contextmanager
def noting_cancelled() -> Iterator[list[Tensor]]:
    """The indices of the samples whose gradients :func:`formed_where_cancelled` formed, within.

    Their sums need them too: a contraction over the batch rounds their positions' terms
    otherwise than the formed gradient that set their norm did, and where those terms cancel
    to below their rounding a clipped sample would add that rounding, unbounded by the norm.

    Yields:
        A list that gets one index tensor per leaf with such samples (this thread's calls).

    Example:
        >>> v, u = torch.tensor([[[1.0], [-1.0]]]), torch.ones(1, 2, 1)
        >>> with noting_cancelled() as found:
        ...     _ = gram_squared_norms(v @ v.mT, u @ u.mT, lambda i: v[i].mT @ u[i])
        >>> found
        [tensor([0])]
    """
    with collecting(_CANCELLED, "samples") as found:
        yield found


def cancelled_samples(squares: Tensor, terms: Tensor, *, features: int = 1) -> Tensor:
    """Which samples' squared norms are below :func:`cancellation_tolerance` of their terms.

    Their positions cancel: a norm or sum taken from the terms is not trusted there. A NaN
    (terms that overflowed to ``inf - inf``) counts as cancelled.

    Args:
        squares: Squared norms ``[N]``.
        terms: Their positions' terms, ``Σ_l ‖v_l‖²‖u_l‖²`` ``[N]``.
        features: The entries each of the terms' products sums.

    Returns:
        A boolean mask ``[N]``.

    Example:
        >>> cancelled_samples(torch.tensor([1e-9, 2.0, float("nan")]), torch.ones(3))
        tensor([ True, False,  True])
    """
    # (not >=: a NaN is cancelled too)
    return ~(squares >= cancellation_tolerance(squares.dtype, features) * terms.to(squares.dtype))


def cancellation_tolerance(dtype: torch.dtype, features: int = 1) -> float:
    """The share of its diagonal terms below which a Gram-form squared norm is not trusted.

    ``32·√(κε)``, ``κ = 1 + features / 128``: the Gram form's rounding is of the order of
    ``κε`` times the terms, where its entries are dot products of ``features`` entries (a
    CPU's float32 products round by about ``features / 200·ε`` of their terms where the
    entries share a sign; crafted samples just above ``32·√ε`` read their norms 8e-4 low
    with 16384 output features, 1.2e-2 with 262144, a probe). At the threshold the rounding
    is ``√(κε) / 32`` of the result: 1e-4 at 16384 float32 features, 3e-4 at 262144.

    Args:
        dtype: The squares' dtype.
        features: The entries each product the terms are made of sums (1: none).

    Returns:
        The share.

    Example:
        >>> [round(cancellation_tolerance(torch.float32, n), 3) for n in (1, 16384)]
        [0.011, 0.125]
    """
    return 32 * math.sqrt(torch.finfo(dtype).eps * (1 + features / 128))


def _column_products(x: Tensor, g: Tensor) -> Tensor:
    """``g xᵀ`` for every column as ``[K, N, G, O, I]``, one product per column.

    Broadcasting the side without columns would copy it ``K`` times (for a
    convolution, the unfolded input); one product per column copies nothing.
    """
    columns = max(x.shape[0], g.shape[0])
    xs = x.expand(columns, *x.shape[1:]).unbind(0)
    gs = g.expand(columns, *g.shape[1:]).unbind(0)
    if not is_plain(x, g):
        return torch.stack([torch.matmul(b, a.transpose(-1, -2)) for a, b in zip(xs, gs)])
    out = new_output((columns, *g.shape[1:-1], x.shape[-2]), like=g)
    for a, b, o in zip(xs, gs, out.unbind(0)):
        torch.matmul(b, a.transpose(-1, -2), out=o)
    return out


def _summed_squares(x: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """``(Σ_k g², Σ_k x²)`` as ``[N, G, O, L]`` and ``[N, G, I, L]``."""
    return _column_sum(g.square()), _column_sum(x.square())


def _column_sum(t: Tensor) -> Tensor:
    """``Σ_k t[k]``; a view for a single column (no copy)."""
    return t[0] if t.shape[0] == 1 else t.sum(0)


def _contract_samples(a: Tensor, b: Tensor) -> Tensor:
    """``Σ_{n,l} a[n, g, :, l] b[n, g, :, l]ᵀ`` as one batched matrix product over groups."""
    n, groups, rows, length = a.shape
    left = a.permute(1, 2, 0, 3).reshape(groups, rows, n * length)
    right = b.permute(1, 0, 3, 2).reshape(groups, n * length, b.shape[2])
    return torch.bmm(left, right)
