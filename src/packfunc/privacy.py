"""Differentially private gradients from per-sample gradients: DP-SGD's clipping and noise.

DP-SGD bounds every sample's influence on a step by clipping its gradient (over all
parameters together) to norm ``C``, and hides what remains by adding Gaussian noise of
standard deviation ``σ·C`` to the sum. Both functions take the per-sample gradients of
:func:`packfunc.batch_grad` and, optionally, their squared norms from
:func:`packfunc.batch_l2_grad`; :func:`packfunc.compute` gives both in one pass. Use a loss
with ``reduction='sum'`` so that ``batch_grad[n]`` is sample ``n``'s own gradient. Privacy
accounting (which ``σ`` buys which ``(ε, δ)``) is not part of packfunc.
"""

from __future__ import annotations

from typing import Any, cast

import optree
import torch
from torch import Tensor

from packfunc.types import ParamsT, PyTree

_EPS = 1e-6
"""Added to each norm before dividing, so zero gradients stay finite (as in opacus)."""


def clip_per_sample(batch_grads: ParamsT, max_norm: float, *, batch_l2: PyTree = None) -> ParamsT:
    """Scale each sample's gradient, across all parameters, to norm at most ``max_norm``.

    Sample ``n`` is multiplied by ``min(1, max_norm / (‖g_n‖ + 1e-6))``, where ``‖g_n‖``
    is the norm of its gradient over every leaf; samples within the bound are unchanged.

    Args:
        batch_grads: Pytree of per-sample gradients, leaves ``[N, *p]`` (as from
            :func:`packfunc.batch_grad`).
        max_norm: The bound ``C > 0``.
        batch_l2: Optional pytree (any structure) of the matching squared per-sample norms,
            leaves ``[N]`` (as from :func:`packfunc.batch_l2_grad`); computed from
            ``batch_grads`` when omitted.

    Returns:
        Pytree like ``batch_grads`` with the clipped per-sample gradients.

    Raises:
        ValueError: if ``max_norm`` is not positive, there are no leaves, or the leaves'
            leading (sample) dimensions differ.

    Example:
        >>> g = {"w": torch.tensor([[3.0, 4.0], [0.3, 0.4]])}
        >>> clip_per_sample(g, max_norm=1.0)["w"]
        tensor([[0.6000, 0.8000],
                [0.3000, 0.4000]])
    """
    if max_norm <= 0:
        raise ValueError(f"max_norm must be positive, got {max_norm}")
    leaves, treespec = optree.tree_flatten(cast(Any, batch_grads))
    num_samples = _num_samples(leaves)
    if batch_l2 is None:
        squared_norms = [g.reshape(num_samples, -1).square().sum(1) for g in leaves]
    else:
        squared_norms = optree.tree_leaves(cast(Any, batch_l2))
    norms = torch.stack(squared_norms).sum(0).sqrt()
    factors = (max_norm / (norms + _EPS)).clamp(max=1.0)
    clipped = [g * factors.view(-1, *[1] * (g.dim() - 1)).to(g.dtype) for g in leaves]
    return cast(ParamsT, optree.tree_unflatten(treespec, clipped))


def clip_and_noise(
    batch_grads: ParamsT,
    max_norm: float,
    noise_multiplier: float,
    *,
    batch_l2: PyTree = None,
    generator: torch.Generator | None = None,
) -> ParamsT:
    """DP-SGD's private gradient: clip per sample, sum, add Gaussian noise, divide by ``N``.

    Returns ``(Σ_n clip(g_n) + σ·C·z) / N`` with ``z ~ N(0, I)`` drawn independently for
    every entry, ``clip`` as in :func:`clip_per_sample` and ``N`` the number of samples.

    Args:
        batch_grads: Pytree of per-sample gradients, leaves ``[N, *p]`` (as from
            :func:`packfunc.batch_grad`).
        max_norm: The clipping bound ``C > 0``.
        noise_multiplier: ``σ ≥ 0``; the noise added to the sum has standard deviation
            ``σ·C`` (``0``: no noise, the mean of the clipped gradients).
        batch_l2: Optional pytree of the squared per-sample norms, leaves ``[N]`` (as from
            :func:`packfunc.batch_l2_grad`); computed from ``batch_grads`` when omitted.
        generator: Source of the noise, for reproducible runs (its device may differ from
            the gradients'; the noise is moved to them). Default: the global generator.

    Returns:
        Pytree like ``batch_grads`` with leaves ``[*p]``: the privatized mean gradient.

    Raises:
        ValueError: if ``max_norm`` is not positive, ``noise_multiplier`` is negative, or
            the leaves do not share one positive number of samples.

    Example:
        >>> model_fn, params = packfunc.functional(torch.nn.Linear(3, 2))
        >>> X, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
        >>> out = packfunc.compute(
        ...     model_fn, params, X, y,
        ...     loss=torch.nn.CrossEntropyLoss(reduction="sum"),
        ...     quantities=("batch_grad", "batch_l2_grad"),
        ... )
        >>> grad = clip_and_noise(
        ...     out["batch_grad"], max_norm=1.0, noise_multiplier=1.1,
        ...     batch_l2=out["batch_l2_grad"], generator=torch.Generator().manual_seed(0),
        ... )
        >>> grad["weight"].shape
        torch.Size([2, 3])
    """
    if noise_multiplier < 0:
        raise ValueError(f"noise_multiplier must be non-negative, got {noise_multiplier}")
    leaves, treespec = optree.tree_flatten(
        cast(Any, clip_per_sample(batch_grads, max_norm, batch_l2=batch_l2))
    )
    num_samples = leaves[0].shape[0]
    noisy = []
    for g in leaves:
        summed = g.sum(0)
        if noise_multiplier > 0:
            device = summed.device if generator is None else generator.device
            z = torch.randn(summed.shape, generator=generator, dtype=summed.dtype, device=device)
            summed = summed + noise_multiplier * max_norm * z.to(summed.device)
        noisy.append(summed / num_samples)
    return cast(ParamsT, optree.tree_unflatten(treespec, noisy))


def _num_samples(leaves: list[Tensor]) -> int:
    """The leaves' shared, positive leading dimension ``N``.

    Args:
        leaves: Per-sample tensors ``[N, *p]``.

    Returns:
        ``N``.

    Raises:
        ValueError: if there are no leaves, one is a scalar, or their leading dimensions
            differ or are zero.
    """
    sizes = {g.shape[0] if g.dim() > 0 else 0 for g in leaves}
    if len(sizes) != 1 or 0 in sizes:
        raise ValueError(
            "expected per-sample gradients [N, *p] with one N > 0 for every leaf, got leading "
            f"dimensions {sorted(sizes)}"
        )
    return sizes.pop()
