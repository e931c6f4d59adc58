"""Rules for ``F.embedding``: row ``idx`` of the weight receives the cotangent at ``idx``."""

from __future__ import annotations

import torch
from torch import Tensor

from packfunc.engine.memory import is_plain, new_output
from packfunc.engine.ops import TapCall
from packfunc.engine.rules.base import Rule


class EmbeddingWeight(Rule):
    """Embedding weight ``[V, D]``; canonical ``x: [N, L]`` indices, ``g: [N, L, D]``.

    Moments avoid ``[N, V, D]``: the cotangents of each distinct (sample, row)
    pair are summed first, so work and memory scale with the number of indices.
    """

    merge_dim = 1

    def canonical(self, x: Tensor, g: Tensor, call: TapCall, param: Tensor
                  ) -> tuple[Tensor, Tensor]:
        """Flatten positions; zero the cotangents at ``padding_idx``."""
        n, width = x.shape[0], g.shape[-1]
        x, g = x.reshape(n, -1), g.reshape(n, -1, width)
        padding_idx = call.option("padding_idx")
        if padding_idx is not None:
            g = g * (x != padding_idx % param.shape[0]).unsqueeze(-1).to(g.dtype)
        return x, g

    def batch_grad(self, x: Tensor, g: Tensor, call: TapCall, param: Tensor) -> Tensor:
        """Scatter-add each sample's cotangents into its own copy of the weight."""
        n, (rows, width) = x.shape[0], param.shape
        keys = (torch.arange(n, device=x.device).unsqueeze(1) * rows + x).reshape(-1)
        source = g.reshape(-1, width)
        if is_plain(g):
            out = new_output((n * rows, width), like=g).zero_()
            return out.index_add_(0, keys, source).view(n, rows, width)
        return g.new_zeros(n * rows, width).index_add(0, keys, source).view(n, rows, width)

    def grad(self, x: Tensor, g: Tensor, call: TapCall, param: Tensor) -> Tensor:
        """Scatter-add all cotangents into one weight."""
        return g.new_zeros(param.shape).index_add(0, x.reshape(-1), g.reshape(-1, g.shape[-1]))

    def _pair_sums(self, x: Tensor, g: Tensor, rows: int) -> tuple[Tensor, Tensor]:
        """Return the distinct (sample, row) keys and their summed cotangents."""
        keys = (torch.arange(x.shape[0], device=x.device).unsqueeze(1) * rows + x).reshape(-1)
        unique, inverse = torch.unique(keys, return_inverse=True)
        sums = g.new_zeros(unique.shape[0], g.shape[-1]).index_add(
            0, inverse, g.reshape(-1, g.shape[-1]))
        return unique, sums

    def sum_grad_squared(self, x: Tensor, g: Tensor, call: TapCall, param: Tensor) -> Tensor:
        """``Σ_n`` of the squared per-(sample, row) sums, scattered into rows."""
        rows = param.shape[0]
        unique, sums = self._pair_sums(x, g, rows)
        return g.new_zeros(param.shape).index_add(0, unique % rows, sums.square())

    def batch_l2(self, x: Tensor, g: Tensor, call: TapCall, param: Tensor) -> Tensor:
        """Squared norms of the per-(sample, row) sums, gathered per sample."""
        rows = param.shape[0]
        unique, sums = self._pair_sums(x, g, rows)
        return g.new_zeros(x.shape[0]).index_add(0, unique // rows, sums.square().sum(-1))
