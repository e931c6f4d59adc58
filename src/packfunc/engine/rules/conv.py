"""Rules for convolutions and transposed convolutions (1d, 2d, 3d, any options).

Per-sample weight gradients come from one grouped weight-gradient
convolution: stacking the samples as groups (``groups = N · G``) makes
``aten.convolution_backward`` return one weight gradient per sample.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from packfunc.engine.ops import TapCall
from packfunc.engine.rules.base import Rule


def _per_dim(value: int | tuple[int, ...] | list[int], dims: int) -> list[int]:
    return list(value) if isinstance(value, (tuple, list)) else [value] * dims


def _explicit_padding(x: Tensor, call: TapCall, kernel: tuple[int, ...]
                      ) -> tuple[Tensor, list[int]]:
    """Turn ``padding='same'/'valid'`` into integers, padding ``x`` where 'same' is asymmetric."""
    dims = len(kernel)
    padding = call.option("padding")
    if not isinstance(padding, str):
        return x, _per_dim(padding, dims)
    if padding == "valid":
        return x, [0] * dims
    dilation = _per_dim(call.option("dilation"), dims)
    total = [d * (k - 1) for d, k in zip(dilation, kernel)]
    if all(t % 2 == 0 for t in total):
        return x, [t // 2 for t in total]
    pads = [side for t in reversed(total) for side in (t // 2, t - t // 2)]
    return F.pad(x, pads), [0] * dims


def _weight_grad(x: Tensor, g: Tensor, call: TapCall, weight_shape: tuple[int, ...],
                 groups: int) -> Tensor:
    """``aten.convolution_backward``'s weight gradient for the given grouping."""
    kernel = tuple(weight_shape[2:])
    x, padding = _explicit_padding(x, call, kernel)
    dims = len(kernel)
    output_padding = [0] * dims
    if call.transposed:
        output_padding = _per_dim(call.option("output_padding"), dims)
    weight = x.new_zeros(()).expand(weight_shape)
    return torch.ops.aten.convolution_backward(
        g, x, weight, None,
        _per_dim(call.option("stride"), dims), padding, _per_dim(call.option("dilation"), dims),
        call.transposed, output_padding, groups, [False, True, False],
    )[1]


class ConvWeight(Rule):
    """Weight of ``torch.convNd`` / ``torch.conv_transposeNd``; ``x``, ``g`` as in the op."""

    def batch_grad(self, x: Tensor, g: Tensor, call: TapCall, param: Tensor) -> Tensor:
        """One grouped weight-gradient convolution over ``n · groups`` groups."""
        n, groups = x.shape[0], call.option("groups")
        stacked = (n * param.shape[0], *param.shape[1:])
        grads = _weight_grad(x.reshape(1, -1, *x.shape[2:]), g.reshape(1, -1, *g.shape[2:]),
                             call, stacked, n * groups)
        return grads.view(n, *param.shape)

    def grad(self, x: Tensor, g: Tensor, call: TapCall, param: Tensor) -> Tensor:
        """The ordinary weight gradient of the batch."""
        return _weight_grad(x, g, call, tuple(param.shape), call.option("groups"))
