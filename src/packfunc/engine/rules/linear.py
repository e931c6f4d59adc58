"""Rules for ``F.linear``: ``z = x Wᵀ + b`` over any number of leading dims."""

from __future__ import annotations

import torch
from torch import Tensor

from packfunc.engine.memory import is_plain, new_output
from packfunc.engine.ops import TapCall
from packfunc.engine.rules.base import Rule


class LinearWeight(Rule):
    """Weight of ``F.linear``; canonical layout ``x: [N, L, in]``, ``g: [N, L, out]``.

    ``L`` collects every dim between the sample dim and the features (sequence
    positions, several calls of a shared layer). For ``L == 1`` the moments have
    closed forms: ``Σ_n (g_n x_nᵀ)² = (g²)ᵀ(x²)`` and ``‖g_n x_nᵀ‖² = ‖g_n‖²‖x_n‖²``.
    """

    mergeable = True

    def canonical(self, x: Tensor, g: Tensor, call: TapCall, param: Tensor
                  ) -> tuple[Tensor, Tensor]:
        """Flatten the dims between samples and features into one dim ``L``."""
        n = x.shape[0]
        return x.reshape(n, -1, x.shape[-1]), g.reshape(n, -1, g.shape[-1])

    def batch_grad(self, x: Tensor, g: Tensor, call: TapCall, param: Tensor) -> Tensor:
        """Per-sample ``Σ_l g_l x_lᵀ`` as ``[n, out, in]``."""
        if not is_plain(x, g):
            return torch.einsum("nlo,nli->noi", g, x)
        out = new_output((x.shape[0], g.shape[-1], x.shape[-1]), like=g)
        if x.shape[1] == 1:
            return torch.mul(g.transpose(1, 2), x, out=out)
        return torch.bmm(g.transpose(1, 2), x, out=out)

    def grad(self, x: Tensor, g: Tensor, call: TapCall, param: Tensor) -> Tensor:
        """``Σ_{n,l} g_{nl} x_{nl}ᵀ`` as one matrix product."""
        return g.reshape(-1, g.shape[-1]).T @ x.reshape(-1, x.shape[-1])

    def sum_grad_squared(self, x: Tensor, g: Tensor, call: TapCall, param: Tensor
                         ) -> Tensor | None:
        """``(g²)ᵀ(x²)`` when every sample has a single position."""
        if x.shape[1] != 1:
            return None
        return g[:, 0].square().T @ x[:, 0].square()

    def batch_l2(self, x: Tensor, g: Tensor, call: TapCall, param: Tensor) -> Tensor | None:
        """``‖g‖²‖x‖²``; for ``L > 1`` the Gram form ``Σ_{l,m} (g_l·g_m)(x_l·x_m)`` if cheaper."""
        length, n_in, n_out = x.shape[1], x.shape[2], g.shape[2]
        if length == 1:
            return g[:, 0].square().sum(-1) * x[:, 0].square().sum(-1)
        if length * (n_in + n_out) >= n_in * n_out:
            return None
        return (g @ g.transpose(1, 2) * (x @ x.transpose(1, 2))).sum((1, 2))


class Bias(Rule):
    """Bias of a linear or convolution op; canonical ``g``: per-sample bias gradient ``[N, C]``."""

    mergeable = False

    def __init__(self, channel_dim: int):
        self.channel_dim = channel_dim

    def canonical(self, x: Tensor, g: Tensor, call: TapCall, param: Tensor
                  ) -> tuple[Tensor, Tensor]:
        """Sum ``g`` over every dim but samples and channels."""
        channel = self.channel_dim % g.dim()
        dims = [d for d in range(1, g.dim()) if d != channel]
        return x, g.sum(dims) if dims else g

    def batch_grad(self, x: Tensor, g: Tensor, call: TapCall, param: Tensor) -> Tensor:
        """The canonical cotangent itself."""
        return g
