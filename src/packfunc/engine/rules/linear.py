"""Rules for ``F.linear``: ``z = x Wᵀ + b`` over any number of leading dims."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from packfunc.engine.ops import SiteCall
from packfunc.engine.rules.base import Rule
from packfunc.engine.rules.product import ProductWeight


class LinearWeight(ProductWeight):
    """Weight of ``F.linear``: one group, positions are the dims between samples and features."""

    hessian_from_output_curvature = True

    def canonical(
        self, x: Tensor, g: Tensor, call: SiteCall, param: Tensor
    ) -> tuple[Tensor, Tensor]:
        """``x: [N, ..., in] -> [1, N, 1, in, L]``, ``g: [K, N, ..., out] -> [K, N, 1, out, L]``."""
        n, columns = x.shape[0], g.shape[0]
        u = x.reshape(1, n, 1, -1, x.shape[-1]).transpose(-1, -2)
        return u, g.reshape(columns, n, 1, -1, g.shape[-1]).transpose(-1, -2)


class LinearWeightInOut(LinearWeight):
    """A linear weight stored ``[in, out]`` (:func:`~packfunc.engine.ops.linear_in_out`).

    Its gradient ``Σ_l u_l v_lᵀ`` is the ``[out, in]`` one transposed: the canonical pair
    is the linear one with input and cotangent swapped, so every closed form gives the
    ``[in, out]`` layout. Kronecker factors are read from the unswapped pair and come in
    the parameter's order: ``[in×in, out×out]``.
    """

    def canonical(
        self, x: Tensor, g: Tensor, call: SiteCall, param: Tensor
    ) -> tuple[Tensor, Tensor]:
        """The linear canonical pair, swapped: ``([K, N, 1, out, L], [1, N, 1, in, L])``."""
        u, v = super().canonical(x, g, call, param)
        return v, u

    def kronecker_layout(
        self, x: Tensor, g: Tensor, call: SiteCall, param: Tensor
    ) -> tuple[Tensor, Tensor] | None:
        """The unswapped pair: factors are of the input and the output as for ``F.linear``."""
        return super().canonical(x, g, call, param)

    def kronecker_order(self, output: Tensor, input: Tensor) -> list[Tensor]:
        """``[input, output]``: the order of the weight's ``[in, out]`` layout."""
        return [input, output]


class Bias(Rule):
    """Bias of a linear or convolution op; canonical ``g``: column gradients ``[K, N, C]``.

    Args:
        channel_dim: The dim of the op's output that holds the channels.
        hessian_from_output_curvature: See :attr:`Rule.hessian_from_output_curvature`
            (a linear layer's bias).
    """

    def __init__(self, channel_dim: int, hessian_from_output_curvature: bool = False):
        self.channel_dim = channel_dim
        self.hessian_from_output_curvature = hessian_from_output_curvature

    def canonical(
        self, x: Tensor, g: Tensor, call: SiteCall, param: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Sum ``g [K, N, ...]`` over every dim but columns, samples and channels.

        ``x`` is not needed; it gets the column dim that canonical inputs share.
        """
        channel = self.channel_dim % (g.dim() - 1) + 1
        dims = [d for d in range(2, g.dim()) if d != channel]
        return x.unsqueeze(0), g.sum(dims) if dims else g

    kronecker_factors = 1

    def merge(
        self, xs: list[Tensor], gs: list[Tensor], options: list[tuple[tuple[str, Any], ...]]
    ) -> tuple[Tensor, Tensor] | None:
        """Several calls add their (position-summed) cotangents: the bias gradient's sum."""
        if len({g.shape for g in gs}) != 1:
            return None
        return xs[0], torch.stack(gs).sum(0)

    def columns(self, x: Tensor, g: Tensor, call: SiteCall, param: Tensor) -> Tensor:
        """The canonical cotangent itself."""
        return g

    def sums_positions(self, g: Tensor, approx: str) -> bool:
        """Always: the canonical cotangent is summed over positions."""
        return True

    def output_factor(self, g: Tensor, approx: str) -> Tensor:
        """The exact GGN block of the bias: ``Σ_{k,n} g gᵀ`` (positions already summed)."""
        flat = g.reshape(-1, g.shape[-1])
        return flat.T @ flat

    def diagonal(self, x: Tensor, g: Tensor, call: SiteCall, param: Tensor) -> Tensor:
        """``Σ_{k,n} g²``."""
        return g.square().sum((0, 1))

    def diagonal_per_sample(self, x: Tensor, g: Tensor, call: SiteCall, param: Tensor) -> Tensor:
        """``Σ_k g²`` per sample."""
        return g.square().sum(0)

    def squared_norms(self, x: Tensor, g: Tensor, call: SiteCall, param: Tensor) -> Tensor:
        """``Σ_k ‖g_kn‖²``."""
        return g.square().sum((0, 2))
