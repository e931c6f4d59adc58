"""Rules for convolutions and transposed convolutions (1d, 2d, 3d, any options).

The input is unfolded (a strided view, copied once) into ``[N, G, C_in/G·K, L]``
so that the weight gradient is a grouped matrix product (see ``product.py``).
A transposed convolution is the adjoint of the convolution with the same
weight, so its weight gradient is that convolution's with the roles of input
and output cotangent swapped: the cotangent is unfolded, the input is not. Its
Kronecker factors are read from the input unfolded per output position and the
output cotangent (:meth:`ConvWeight.kronecker_layout`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from packfunc.engine.ops import TapCall
from packfunc.engine.rules.product import ProductWeight


def _per_dim(value: int | tuple[int, ...] | list[int], dims: int) -> list[int]:
    return list(value) if isinstance(value, (tuple, list)) else [value] * dims


def _padding_pairs(call: TapCall, kernel: list[int], dilation: list[int]) -> list[tuple[int, int]]:
    """(before, after) padding per spatial dim; ``'same'`` may be asymmetric."""
    padding = call.option("padding")
    if padding == "valid":
        return [(0, 0)] * len(kernel)
    if padding == "same":
        totals = [d * (k - 1) for d, k in zip(dilation, kernel)]
        return [(t // 2, t - t // 2) for t in totals]
    return [(p, p) for p in _per_dim(padding, len(kernel))]


def unfold(
    x: Tensor,
    kernel: list[int],
    stride: list[int],
    dilation: list[int],
    padding: list[tuple[int, int]],
    positions: list[int] | None = None,
) -> Tensor:
    """Unfold ``x: [N, C, *S]`` into ``[N, C·K, L]``: every kernel window as a column.

    Args:
        x: Input with any number of spatial dims.
        kernel: Kernel size per spatial dim.
        stride: Stride per spatial dim.
        dilation: Dilation per spatial dim.
        padding: (before, after) zero padding per spatial dim.
        positions: Windows per spatial dim (default: all that fit).

    Returns:
        The unfolded input; for 2-D equal to ``F.unfold``.

    Example:
        >>> unfold(torch.ones(1, 2, 3, 3), [2, 2], [1, 1], [1, 1], [(0, 0), (0, 0)]).shape
        torch.Size([1, 8, 4])
    """
    if any(before or after for before, after in padding):
        x = F.pad(x, [side for pair in reversed(padding) for side in pair])
    n, channels, *size = x.shape
    if positions is None:
        positions = [
            (s - d * (k - 1) - 1) // st + 1 for s, k, st, d in zip(size, kernel, stride, dilation)
        ]
    sample_stride, channel_stride, *space = x.stride()
    windows = x.as_strided(
        (n, channels, *kernel, *positions),
        (
            sample_stride,
            channel_stride,
            *[s * d for s, d in zip(space, dilation)],
            *[s * st for s, st in zip(space, stride)],
        ),
    )
    return windows.reshape(n, channels * math.prod(kernel), math.prod(positions))


def unfold_transposed(x: Tensor, kernel: list[int], call: TapCall) -> Tensor:
    """Unfold the input of a transposed convolution per *output* position.

    Column ``l`` holds, for every input channel and kernel entry, the input entry
    that kernel entry carries to output position ``l`` (zero where none does), so
    that the op's output is ``Wᵀ U`` with ``W`` the kernel with its two channel axes
    swapped (BackPACK's ``unfold_by_conv_transpose``). A transposed convolution of
    ``x`` with a one-hot kernel per (channel, kernel entry) builds it.

    Args:
        x: Input ``[N, C_in, *S_in]``.
        kernel: Kernel size per spatial dim.
        call: The transposed convolution (stride, padding, output padding, dilation).

    Returns:
        ``[N, C_in·K, L_out]``, channels major and kernel entries minor.

    Example:
        >>> from packfunc.engine.ops import SIGNATURES, make_call
        >>> sig = SIGNATURES[torch.conv_transpose1d]
        >>> call = make_call(sig, sig.bind((torch.ones(1, 2, 3), torch.ones(2, 1, 2)), {}),
        ...                  lambda value: None)
        >>> unfold_transposed(torch.ones(1, 2, 3), [2], call).shape
        torch.Size([1, 4, 4])
    """
    dims, channels, entries = len(kernel), x.shape[1], math.prod(kernel)
    onehot = torch.eye(entries, dtype=x.dtype, device=x.device).view(1, entries, *kernel)
    convolution = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[dims - 1]
    unfolded = convolution(
        x,
        onehot.expand(channels, *onehot.shape[1:]),
        None,
        call.option("stride"),
        call.option("padding"),
        call.option("output_padding"),
        channels,
        call.option("dilation"),
    )
    return unfolded.flatten(2)


class ConvWeight(ProductWeight):
    """Weight of ``torch.convNd`` / ``torch.conv_transposeNd``."""

    def canonical(
        self, x: Tensor, g: Tensor, call: TapCall, param: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Unfold the op's input (or, transposed, its cotangent) and group the channels."""
        kernel = list(param.shape[2:])
        dims = len(kernel)
        stride = _per_dim(call.option("stride"), dims)
        dilation = _per_dim(call.option("dilation"), dims)
        groups, n, columns = call.option("groups"), x.shape[0], g.shape[0]
        g = g.reshape(columns * n, *g.shape[2:])
        source, target = (g, x) if call.transposed else (x, g)
        # a transposed op's output_padding adds trailing positions no input position reaches
        windows = unfold(
            source,
            kernel,
            stride,
            dilation,
            _padding_pairs(call, kernel, dilation),
            positions=list(target.shape[2:]),
        )
        unfolded = windows.view(-1, n, groups, windows.shape[1] // groups, windows.shape[-1])
        other = target.reshape(-1, n, groups, target.shape[1] // groups, windows.shape[-1])
        return unfolded, other

    def kronecker_layout(
        self, x: Tensor, g: Tensor, call: TapCall, param: Tensor
    ) -> tuple[Tensor, Tensor] | None:
        """Transposed: the input unfolded per output position, and the output cotangent.

        The factors then approximate the curvature of the kernel with its channel axes
        swapped, per group ``[C_out/G, C_in/G·K]`` (BackPACK's ``weight.transpose(0, 1)``
        for ``G = 1``), as for a convolution with that kernel.
        """
        if not call.transposed:
            return None
        groups, n, columns = call.option("groups"), x.shape[0], g.shape[0]
        unfolded = unfold_transposed(x, list(param.shape[2:]), call)
        return (
            unfolded.view(1, n, groups, unfolded.shape[1] // groups, unfolded.shape[-1]),
            g.reshape(columns, n, groups, g.shape[2] // groups, -1),
        )
