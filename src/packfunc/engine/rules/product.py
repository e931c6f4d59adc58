"""Weights of ops that multiply a (grouped) input matrix by the weight: linear and convolution.

After canonicalization both families look alike per sample ``n`` and group:
``u[n, g]`` is ``[I, L]`` (input features by positions) and ``g[n, g]`` is
``[O, L]`` (output cotangents by positions); the weight gradient of a sample
is ``Σ_l g_l u_lᵀ``. For a linear layer ``u`` is the input itself, for a
convolution the unfolded input (``I = C_in/G · kernel`` elements per position).
"""

from __future__ import annotations

import torch
from torch import Tensor

from packfunc.engine.memory import is_plain, new_output
from packfunc.engine.ops import TapCall
from packfunc.engine.rules.base import Rule


class ProductWeight(Rule):
    """Closed forms on canonical ``u: [N, G, I, L]``, ``g: [N, G, O, L]``.

    For ``L == 1`` the moments need no per-sample gradients:
    ``Σ_n (g_n u_nᵀ)² = Σ_n g_n² (u_n²)ᵀ`` and ``‖g_n u_nᵀ‖² = ‖g_n‖²‖u_n‖²``;
    for ``L > 1`` the squared norm has the Gram form ``Σ_{l,m} (g_l·g_m)(u_l·u_m)``,
    used when it is cheaper than materializing. Several calls of one layer
    (weight sharing) are concatenated along ``L``.
    """

    merge_dim = -1

    def batch_grad(self, x: Tensor, g: Tensor, call: TapCall, param: Tensor) -> Tensor:
        """Per-sample ``Σ_l g_l u_lᵀ``, shaped ``[n, *param.shape]``."""
        n, groups, n_out, length = g.shape
        shape = (n, groups, n_out, x.shape[2])
        if not is_plain(x, g):
            return torch.matmul(g, x.transpose(-1, -2)).reshape(n, *param.shape)
        out = new_output(shape, like=g)
        if length == 1:
            torch.mul(g, x.transpose(-1, -2), out=out)
        else:
            torch.matmul(g, x.transpose(-1, -2), out=out)
        return out.view(n, *param.shape)

    def grad(self, x: Tensor, g: Tensor, call: TapCall, param: Tensor) -> Tensor:
        """``Σ_{n,l} g_{nl} u_{nl}ᵀ`` per group."""
        return _contract_samples(g, x).reshape(param.shape)

    def sum_grad_squared(self, x: Tensor, g: Tensor, call: TapCall, param: Tensor
                         ) -> Tensor | None:
        """``Σ_n g_n² (u_n²)ᵀ`` per group when every sample has one position."""
        if x.shape[-1] != 1:
            return None
        return _contract_samples(g.square(), x.square()).reshape(param.shape)

    def batch_l2(self, x: Tensor, g: Tensor, call: TapCall, param: Tensor) -> Tensor | None:
        """``‖g‖²‖u‖²`` summed over groups; the Gram form for ``L > 1`` when it is cheaper."""
        n_in, n_out, length = x.shape[2], g.shape[2], x.shape[3]
        if length == 1:
            return (g[..., 0].square().sum(-1) * x[..., 0].square().sum(-1)).sum(1)
        if length * (n_in + n_out) >= n_in * n_out:
            return None
        gram_g = g.transpose(-1, -2) @ g
        gram_u = x.transpose(-1, -2) @ x
        return (gram_g * gram_u).sum((1, 2, 3))


def _contract_samples(a: Tensor, b: Tensor) -> Tensor:
    """``Σ_{n,l} a[n, g, :, l] b[n, g, :, l]ᵀ`` as one batched matrix product over groups."""
    n, groups, rows, length = a.shape
    left = a.permute(1, 2, 0, 3).reshape(groups, rows, n * length)
    right = b.permute(1, 0, 3, 2).reshape(groups, n * length, b.shape[2])
    return torch.bmm(left, right)
