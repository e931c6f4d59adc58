"""Rules for ``F.linear``: ``z = x Wᵀ + b`` over any number of leading dims."""

from __future__ import annotations

from torch import Tensor

from packfunc.engine.ops import TapCall
from packfunc.engine.rules.base import Rule
from packfunc.engine.rules.product import ProductWeight


class LinearWeight(ProductWeight):
    """Weight of ``F.linear``: one group, positions are the dims between samples and features."""

    def canonical(self, x: Tensor, g: Tensor, call: TapCall, param: Tensor
                  ) -> tuple[Tensor, Tensor]:
        """``x: [N, ..., in] -> [N, 1, in, L]`` and ``g`` likewise, as views."""
        n = x.shape[0]
        u = x.reshape(n, -1, x.shape[-1]).transpose(1, 2).unsqueeze(1)
        return u, g.reshape(n, -1, g.shape[-1]).transpose(1, 2).unsqueeze(1)


class Bias(Rule):
    """Bias of a linear or convolution op; canonical ``g``: per-sample bias gradient ``[N, C]``."""

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

    def sum_grad_squared(self, x: Tensor, g: Tensor, call: TapCall, param: Tensor) -> Tensor:
        """``Σ_n g_n²``."""
        return g.square().sum(0)

    def batch_l2(self, x: Tensor, g: Tensor, call: TapCall, param: Tensor) -> Tensor:
        """``‖g_n‖²``."""
        return g.square().sum(1)
