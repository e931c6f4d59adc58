"""Rules for ``F.linear``: ``z = x Wᵀ + b`` over any number of leading dims."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from packfunc.engine.ops import SiteCall
from packfunc.engine.rules.base import Route, Rule
from packfunc.engine.rules.product import ProductWeight, gram_is_cheaper, gram_squared_norms
from packfunc.engine.vocabulary import Statistic


class LinearWeight(ProductWeight):
    """Weight of ``F.linear``: one group, positions are the dims between samples and features."""

    hessian_from_output_curvature = True

    def route(self, stat: Statistic, x: Tensor, g: Tensor, call: SiteCall, param: Tensor) -> Route:
        """The sum, and one column's squared norms where they have a closed form, from the call.

        Those need no canonical layout: the input and cotangents as recorded, with their
        positions flattened, are the product's operands (for a weight stored ``[in, out]``
        too). Squared norms without a closed form (the Gram form costlier than the
        weight-sized gradients) are materialized as ever.
        """
        if stat is Statistic.SUM:
            return Route.CALL
        if stat is Statistic.SQUARED_NORMS and g.shape[0] == 1:
            length = math.prod(x.shape[1:-1])
            if length == 1 or gram_is_cheaper(length, x.shape[-1], g.shape[-1]):
                return Route.CALL
        return Route.CANONICAL

    def from_call(
        self, stat: Statistic, x: Tensor, g: Tensor, call: SiteCall, param: Tensor
    ) -> Tensor:
        """``Σ_{k,n,l} v uᵀ`` as one product; squared norms ``‖v‖²‖u‖²`` or in Gram form.

        A weight stored ``[in, out]`` gets ``Σ u vᵀ``.

        Args:
            stat: :attr:`~Statistic.SUM` or :attr:`~Statistic.SQUARED_NORMS`.
            x: The recorded input ``[n, ..., in]``.
            g: Cotangents of the output ``[K, n, ..., out]`` (``K = 1`` for squared norms).
            call: The op call.
            param: The weight ``[out, in]`` (or ``[in, out]``).

        Returns:
            The weight-shaped sum, or the squared norms ``[n]``.

        Example:
            >>> from packfunc.engine.ops import SIGNATURES
            >>> call = SiteCall(SIGNATURES[F.linear], (("weight", 0),), ())
            >>> x, g = torch.ones(2, 3, 4), torch.ones(1, 2, 3, 5)
            >>> LinearWeight().from_call(Statistic.SQUARED_NORMS, x, g, call, torch.ones(5, 4))
            tensor([180., 180.])
        """
        n_in, n_out = x.shape[-1], g.shape[-1]
        if stat is Statistic.SUM:
            v = (g[0] if g.shape[0] == 1 else g.sum(0)).reshape(-1, n_out)
            u = x.reshape(-1, n_in)
            return u.T @ v if call.transposed else v.T @ u
        if stat is not Statistic.SQUARED_NORMS:
            raise NotImplementedError(f"LinearWeight routes sums and squared norms, not {stat}")
        positions = math.prod(x.shape[1:-1])  # (not -1: an empty batch has no length to infer)
        u, v = x.reshape(x.shape[0], positions, n_in), g[0].reshape(x.shape[0], positions, n_out)
        if u.shape[1] == 1:  # ‖u‖‖v‖ squared: no overflow where the squared norm has none
            u_norms: Tensor = torch.linalg.vector_norm(u, dim=(1, 2))
            v_norms: Tensor = torch.linalg.vector_norm(v, dim=(1, 2))
            return (u_norms * v_norms).square()
        return gram_squared_norms(
            v @ v.mT, u @ u.mT, lambda i: v[i].mT @ u[i], features=n_in + n_out
        )

    def outer_factors(
        self, x: Tensor, g: Tensor, call: SiteCall, param: Tensor
    ) -> tuple[Tensor, Tensor]:
        """``(v, u)``: the cotangents ``[n, L, out]`` and inputs ``[n, L, in]`` per position.

        A weight stored ``[in, out]`` gets ``(u, v)``.

        Example:
            >>> from packfunc.engine.ops import SIGNATURES
            >>> call = SiteCall(SIGNATURES[F.linear], (("weight", 0),), ())
            >>> a, b = LinearWeight().outer_factors(
            ...     torch.ones(2, 3, 4), torch.ones(1, 2, 3, 5), call, torch.ones(5, 4))
            >>> a.shape, b.shape
            (torch.Size([2, 3, 5]), torch.Size([2, 3, 4]))
        """
        n = x.shape[0]
        u, v = x.reshape(n, -1, x.shape[-1]), g[0].reshape(n, -1, g.shape[-1])
        return (u, v) if call.transposed else (v, u)

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
