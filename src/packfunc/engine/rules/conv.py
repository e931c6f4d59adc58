"""Rules for convolutions and transposed convolutions (1d, 2d, 3d, any options).

Per-sample weight gradients (and their sum) come straight from the recorded
call: the samples (and cotangent columns) become groups of one convolution,
input ``[1, K·N·C_in, *S]`` and cotangent ``[1, K·N·C_out, *S_out]`` with
``K·N·G`` groups, whose weight gradient ``[K·N·C_out, C_in/G, *k]`` holds every
column's (:func:`per_sample_weight_gradients`, functorch's batching rule).
Closed forms on the canonical layout unfold instead: the input is unfolded (a
strided view, copied once) into ``[N, G, C_in/G·K, L]`` so that the weight
gradient is a grouped matrix product (see ``product.py``).
A transposed convolution is the adjoint of the convolution with the same
weight, so its weight gradient is that convolution's with the roles of input
and output cotangent swapped: the cotangent is unfolded, the input is not. Its
Kronecker factors are read from the input unfolded per output position and the
output cotangent (:meth:`ConvWeight.kronecker_layout`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from packfunc.engine.memory import chunks, unfold_chunk_length
from packfunc.engine.ops import SiteCall
from packfunc.engine.rules.base import Route
from packfunc.engine.rules.product import ProductWeight, gram_is_cheaper
from packfunc.engine.vocabulary import Statistic

GROUPED_MIN_CHANNELS = 8
"""Channels per group (the weight's dim 1) from which per-sample weight gradients come from
one grouped convolution rather than the unfolded input: measured on CPU (2 threads, 3×3
kernels, 32×32 and 16×16 inputs) the grouped convolution is 2–4× faster from 8 channels
up, and for 1–6 channels 1.1–1.8× slower at small batches (within 10 % at 6 channels and a
few hundred samples) until the unfolded input passes :data:`UNFOLD_CPU_LIMIT_BYTES`."""

UNFOLD_CPU_LIMIT_BYTES = 32 * 2**20
"""Unfolded-input size above which a CPU convolution with few channels per group takes the
grouped convolution too. glibc maps allocations above 32 MiB fresh on every call, so such
an unfolded input pays a page fault per 4 KiB written: measured on CPU (2 threads, 3×3
kernels, 1–6 channels, 16×16 and 32×32 inputs) unfolding takes 0.55–1.1× the grouped
convolution's time below 32 MiB and 1.45–2.9× above it, where the grouped convolution also
holds no unfolded copy."""


def _per_dim(value: int | tuple[int, ...] | list[int], dims: int) -> list[int]:
    return list(value) if isinstance(value, (tuple, list)) else [value] * dims


def _padding_pairs(call: SiteCall, kernel: list[int], dilation: list[int]) -> list[tuple[int, int]]:
    """(before, after) padding per spatial dim; ``'same'`` may be asymmetric."""
    padding = call.option("padding")
    if padding == "valid":
        return [(0, 0)] * len(kernel)
    if padding == "same":
        totals = [d * (k - 1) for d, k in zip(dilation, kernel)]
        return [(t // 2, t - t // 2) for t in totals]
    return [(p, p) for p in _per_dim(padding, len(kernel))]


def weight_gradient(x: Tensor, g: Tensor, call: SiteCall, weight_shape: Sequence[int]) -> Tensor:
    """The weight gradient of ``call`` summed over the batch, without unfolding.

    Args:
        x: The op's input ``[B, C, *S]``.
        g: Cotangent of its output ``[B, C', *S_out]``.
        call: The convolution or transposed convolution (its ``groups`` option is
            ignored: the groups follow from ``weight_shape``).
        weight_shape: The weight's shape; its channels fix the groups.

    Returns:
        ``Σ_b`` of the weight gradients, ``weight_shape``.

    Example:
        >>> from packfunc.engine.ops import SIGNATURES
        >>> options = (("stride", 1), ("padding", "same"), ("dilation", 1))
        >>> call = SiteCall(SIGNATURES[torch.conv1d], (), options)
        >>> weight_gradient(torch.ones(1, 2, 4), torch.ones(1, 3, 4), call, (3, 2, 2)).shape
        torch.Size([3, 2, 2])
    """
    kernel = list(weight_shape[2:])
    dims = len(kernel)
    dilation = _per_dim(call.option("dilation"), dims)
    stride = _per_dim(call.option("stride"), dims)
    if call.transposed:
        groups = g.shape[1] // weight_shape[1]
        padding = _per_dim(call.option("padding"), dims)
        output_padding = _per_dim(call.option("output_padding"), dims)
    else:
        groups = x.shape[1] // weight_shape[1]
        pairs = _padding_pairs(call, kernel, dilation)
        if any(before != after for before, after in pairs):
            x = F.pad(x, [side for pair in reversed(pairs) for side in pair])
            pairs = [(0, 0)] * dims
        padding, output_padding = [before for before, _ in pairs], [0] * dims
    weight = g.new_empty(1).expand(*weight_shape)
    grad: Tensor
    _, grad, _ = torch.ops.aten.convolution_backward(
        g,
        x,
        weight,
        None,
        stride,
        padding,
        dilation,
        call.transposed,
        output_padding,
        groups,
        [False, True, False],
    )
    return grad


def per_sample_weight_gradients(x: Tensor, g: Tensor, call: SiteCall, param: Tensor) -> Tensor:
    """Column gradients ``[K, N, *param.shape]`` of a convolution weight, one grouped convolution.

    Every (column, sample) pair becomes its own set of groups, so the batch sum of
    :func:`weight_gradient` keeps them apart. The input is copied ``K`` times for
    ``K > 1`` columns (never unfolded).

    Args:
        x: The op's input ``[N, C_in, *S]``.
        g: Cotangents of its output ``[K, N, C_out, *S_out]``.
        call: The convolution or transposed convolution.
        param: The weight.

    Returns:
        The weight gradient of every column and sample.

    Example:
        >>> from packfunc.engine.ops import SIGNATURES
        >>> options = (("stride", 1), ("padding", 0), ("dilation", 1))
        >>> call = SiteCall(SIGNATURES[torch.conv1d], (), options)
        >>> per_sample_weight_gradients(
        ...     torch.ones(5, 2, 4), torch.ones(3, 5, 6, 3), call, torch.ones(6, 1, 2)
        ... ).shape
        torch.Size([3, 5, 6, 1, 2])
    """
    columns, n = g.shape[:2]
    batch = columns * n
    if batch == 0:
        return param.new_zeros((columns, n, *param.shape))
    inputs = x.expand(columns, *x.shape) if columns > 1 else x
    grad = weight_gradient(
        inputs.reshape(1, batch * x.shape[1], *x.shape[2:]),
        g.reshape(1, batch * g.shape[2], *g.shape[3:]),
        call,
        (batch * param.shape[0], *param.shape[1:]),
    )
    return grad.view(columns, n, *param.shape)


def unfold(
    x: Tensor,
    kernel: list[int],
    stride: list[int],
    dilation: list[int],
    padding: list[tuple[int, int]],
    positions: list[int] | None = None,
    samples_inner: bool = False,
) -> Tensor:
    """Unfold ``x: [N, C, *S]`` into ``[N, C·K, L]``: every kernel window as a column.

    Args:
        x: Input with any number of spatial dims.
        kernel: Kernel size per spatial dim.
        stride: Stride per spatial dim.
        dilation: Dilation per spatial dim.
        padding: (before, after) zero padding per spatial dim.
        positions: Windows per spatial dim (default: all that fit).
        samples_inner: Lay the windows out ``[C·K, N·L]`` instead (one matrix whose
            product with its transpose sums over samples and positions; the same one copy).

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
    if samples_inner:
        dims = len(kernel)
        order = (1, *range(2, 2 + dims), 0, *range(2 + dims, 2 + 2 * dims))
        return windows.permute(order).reshape(channels * math.prod(kernel), -1)
    return windows.reshape(n, channels * math.prod(kernel), math.prod(positions))


def _unfold_for(
    source: Tensor,
    call: SiteCall,
    param: Tensor,
    positions: list[int],
    samples_inner: bool = False,
) -> Tensor:
    """:func:`unfold` with the recorded convolution's kernel, stride, dilation and padding."""
    kernel = list(param.shape[2:])
    stride = _per_dim(call.option("stride"), len(kernel))
    dilation = _per_dim(call.option("dilation"), len(kernel))
    padding = _padding_pairs(call, kernel, dilation)
    return unfold(source, kernel, stride, dilation, padding, positions, samples_inner)


def im2col_is_faster(x: Tensor) -> bool:
    """Whether ``F.unfold`` of one sample beats :func:`unfold` on ``x``'s device (not the CPU)."""
    return x.device.type != "cpu"


def one_sample_unfolded(x: Tensor, call: SiteCall, param: Tensor) -> Tensor | None:
    """One sample's input unfolded ``[C·K, L]`` by ``F.unfold``: one kernel, padding in place.

    :func:`unfold` pads a copy first (a pad, a fill and a copy: three launches where a
    GPU's small calls are bound by launches). On the CPU ``F.unfold`` is the slower (42
    against 31 µs for ``[1, 3, 32, 32]``, 3×3, padding 1), so callers take it elsewhere.

    Args:
        x: One sample's input ``[1, C, H, W]``.
        call: The convolution (stride, dilation, padding).
        param: Its weight.

    Returns:
        ``[C·K, L]``; ``None`` for more samples, other dimensions or asymmetric padding.

    Example:
        >>> from packfunc.engine.ops import SIGNATURES, make_call
        >>> sig = SIGNATURES[torch.conv2d]
        >>> args = (torch.ones(1, 2, 4, 4), torch.ones(3, 2, 3, 3))
        >>> call = make_call(sig, sig.bind(args, {"padding": 1}), lambda value: None)
        >>> one_sample_unfolded(args[0], call, args[1]).shape
        torch.Size([18, 16])
    """
    kernel = list(param.shape[2:])
    if x.shape[0] != 1 or len(kernel) != 2:
        return None
    dilation = _per_dim(call.option("dilation"), 2)
    padding = _padding_pairs(call, kernel, dilation)
    if any(before != after for before, after in padding):
        return None
    stride = _per_dim(call.option("stride"), 2)
    spans = tuple(before for before, _ in padding)
    return F.unfold(x, tuple(kernel), tuple(dilation), spans, tuple(stride))[0]


def unfold_transposed(x: Tensor, kernel: list[int], call: SiteCall) -> Tensor:
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

    def route(self, stat: Statistic, x: Tensor, g: Tensor, call: SiteCall, param: Tensor) -> Route:
        """One column and any sum from the call; squares in closed form only where cheaper.

        Several columns (the GGN's) share one unfolded input: the grouped convolution
        would copy the input once per column. Below :data:`GROUPED_MIN_CHANNELS` channels
        per group (an RGB stem) the grouped convolution is slower than unfolding, unless
        the unfolded input would pass :data:`UNFOLD_CPU_LIMIT_BYTES` on CPU.

        The canonical closed forms of squares exist for one position (``L = 1``) and,
        for squared norms of one column, as the Gram form when it is cheaper than the
        weight-sized column gradients; otherwise the columns are materialized.
        """
        one_column = g.shape[0] == 1
        if stat is Statistic.SUM:
            return Route.CALL
        if stat is Statistic.COLUMNS:
            grouped = one_column and (
                param.shape[1] >= GROUPED_MIN_CHANNELS
                or self._unfolds_past_limit(x, g, call, param)
            )
            return Route.CALL if grouped else Route.CANONICAL
        # canonical positions: the output's; transposed (cotangent unfolded), the input's
        length = math.prod(x.shape[2:] if call.transposed else g.shape[3:])
        n_in = param.shape[1] * math.prod(param.shape[2:])
        n_out = param.shape[0] // call.option("groups")
        if length == 1:
            return Route.CANONICAL
        if stat is Statistic.SQUARED_NORMS and one_column and gram_is_cheaper(length, n_in, n_out):
            return Route.CANONICAL
        return Route.MATERIALIZED

    def _unfolds_past_limit(self, x: Tensor, g: Tensor, call: SiteCall, param: Tensor) -> bool:
        """Whether the unfolded input would pass :data:`UNFOLD_CPU_LIMIT_BYTES` on CPU.

        Transposed convolutions (whose cotangent is unfolded instead) keep their route: the
        limit was measured on convolutions.
        """
        if call.transposed or x.device.type != "cpu":
            return False
        per_sample = self.canonical_input_size(x, g, call, param) * x.element_size()
        return per_sample * x.shape[0] > UNFOLD_CPU_LIMIT_BYTES

    def from_call(
        self, stat: Statistic, x: Tensor, g: Tensor, call: SiteCall, param: Tensor
    ) -> Tensor:
        """Column gradients (one grouped convolution) or their sum (one convolution backward)."""
        if stat is Statistic.COLUMNS:
            return per_sample_weight_gradients(x, g, call, param)
        if stat is Statistic.SUM:
            return weight_gradient(x, g[0] if g.shape[0] == 1 else g.sum(0), call, param.shape)
        raise NotImplementedError(f"ConvWeight routes only columns and their sum, not {stat}")

    def canonical_input_size(self, x: Tensor, g: Tensor, call: SiteCall, param: Tensor) -> int:
        """The unfolded input's elements per sample: one kernel window per output position."""
        if call.transposed:  # the cotangent is unfolded; the input keeps its size
            return super().canonical_input_size(x, g, call, param)
        window = int(call.option("groups")) * math.prod(param.shape[1:])
        return window * math.prod(g.shape[3:])

    def canonical(
        self, x: Tensor, g: Tensor, call: SiteCall, param: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Unfold the op's input (or, transposed, its cotangent) and group the channels."""
        groups, n, columns = call.option("groups"), x.shape[0], g.shape[0]
        g = g.reshape(columns * n, *g.shape[2:])
        source, target = (g, x) if call.transposed else (x, g)
        # a transposed op's output_padding adds trailing positions no input position reaches
        windows = _unfold_for(source, call, param, list(target.shape[2:]))
        unfolded = windows.view(-1, n, groups, windows.shape[1] // groups, windows.shape[-1])
        other = target.reshape(-1, n, groups, target.shape[1] // groups, windows.shape[-1])
        return unfolded, other

    def unfolded_kronecker_factors(
        self, x: Tensor, g: Tensor, call: SiteCall, param: Tensor, approx: str
    ) -> tuple[Tensor, Tensor]:
        """The output and input factors of a convolution, its input unfolded in chunks.

        The output factor comes from all cotangents at once (with ``"expand"``, whose
        product copies the cotangents, chunk by chunk). The input is unfolded no more
        samples at a time than make up the input's own size (the backward pass's
        activations are still alive; on an accelerator up to a floor of a few MiB, see
        :func:`~packfunc.engine.memory.unfold_chunk_length`), each chunk's factor added
        into the first: with one group and positions not reduced, straight into the
        layout ``[C_in·k, samples·L]`` of one matrix product (one copy and one product per
        chunk, nothing per sample).
        """
        if call.transposed:
            return self._transposed_kronecker_factors(x, g, call, param, approx)
        n, groups = x.shape[0], call.option("groups")
        cotangents = g.reshape(g.shape[0], n, groups, g.shape[2] // groups, -1)
        output = None if approx == "expand" else self.output_factor(cotangents, approx)
        per_sample = self.canonical_input_size(x, g, call, param)
        at_once = unfold_chunk_length(n, x.numel(), per_sample, x.device)
        inputs: Tensor | None = None
        for chunk in chunks(n, at_once):
            if approx == "expand":
                found = self.output_factor(cotangents[:, chunk], approx)
                output = found if output is None else output.add_(found)
            part = x[chunk]
            if groups != 1 or approx == "reduce":
                unfolded, _ = self.canonical(part, g[:, chunk], call, param)
                inputs = self.input_factor(unfolded, approx, add_to=inputs, samples=n)
                continue
            flat = one_sample_unfolded(part, call, param) if im2col_is_faster(part) else None
            if flat is None:
                flat = _unfold_for(part, call, param, list(g.shape[3:]), samples_inner=True)
            scale = n * (math.prod(g.shape[3:]) if approx == "expand" else 1)
            if inputs is None:
                inputs = torch.addmm(flat.new_zeros(()), flat, flat.T, beta=0, alpha=1 / scale)
            else:
                inputs.addmm_(flat, flat.T, alpha=1 / scale)
        assert output is not None and inputs is not None
        return output, inputs

    def kronecker_factors_unfold(self, x: Tensor, g: Tensor, call: SiteCall, param: Tensor) -> bool:
        """Where the input is unfolded, and for every transposed convolution (its layout)."""
        return call.is_transposed_convolution or self.unfolds_input(x, g, call, param)

    def _transposed_kronecker_factors(
        self, x: Tensor, g: Tensor, call: SiteCall, param: Tensor, approx: str
    ) -> tuple[Tensor, Tensor]:
        """A transposed convolution's factors in :meth:`kronecker_layout`, a few samples at a time.

        Its input unfolded per output position (``C_in·K`` entries each, dozens of times the
        input's size for a strided 3×3 kernel) is formed no more samples at a time than
        make up the input's own size, as a convolution's (:meth:`unfolded_kronecker_factors`).
        """
        n, groups = x.shape[0], call.option("groups")
        cotangents = g.reshape(g.shape[0], n, groups, g.shape[2] // groups, -1)
        kernel = list(param.shape[2:])
        per_sample = x.shape[1] * math.prod(kernel) * cotangents.shape[-1]
        at_once = unfold_chunk_length(n, x.numel(), per_sample, x.device)
        output = None if approx == "expand" else self.output_factor(cotangents, approx)
        inputs: Tensor | None = None
        for chunk in chunks(n, at_once):
            if approx == "expand":
                found = self.output_factor(cotangents[:, chunk], approx)
                output = found if output is None else output.add_(found)
            unfolded = unfold_transposed(x[chunk], kernel, call)
            layout = unfolded.view(1, -1, groups, unfolded.shape[1] // groups, unfolded.shape[-1])
            inputs = self.input_factor(layout, approx, add_to=inputs, samples=n)
        assert output is not None and inputs is not None
        return output, inputs

    def kronecker_gradients(self, grads: Tensor, call: SiteCall) -> Tensor:
        """Transposed: per group, the kernel's channel axes swapped (see :meth:`kronecker_layout`).

        A transposed convolution's weight ``[C_in, C_out/G, k…]`` becomes, per group,
        ``[C_out/G, C_in/G, k…]`` (``weight.transpose(0, 1)`` for one group).

        Example:
            >>> from packfunc.engine.ops import SIGNATURES
            >>> call = SiteCall(SIGNATURES[torch.conv_transpose1d], (), (("groups", 1),))
            >>> ConvWeight().kronecker_gradients(torch.ones(7, 2, 3, 2), call).shape
            torch.Size([7, 1, 3, 2, 2])
        """
        if not call.transposed:
            return grads
        groups = call.option("groups")
        m, c_in, c_out, *kernel = grads.shape
        grouped = grads.reshape(m, groups, c_in // groups, c_out, *kernel)
        return grouped.transpose(2, 3)

    def kronecker_layout(
        self, x: Tensor, g: Tensor, call: SiteCall, param: Tensor
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
