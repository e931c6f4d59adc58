"""Per-sample gradients for any parameter, by ``vmap`` over samples of a ``vjp``.

This path defines correctness for every model: sample ``n``'s gradient is the
vector-Jacobian product of the model at ``x_n`` (run as a batch of one) with
``∂L/∂f_n``, the loss gradient of that sample's output taken from the batch
pass. Using the batch's output cotangent, instead of re-deriving a per-sample
loss, keeps every loss option (class weights, ``ignore_index``, label
smoothing, ``pos_weight``) exact by construction.

A custom ``torch.autograd.Function`` that ``torch.func`` cannot transform (written
without ``setup_context``, or without a vmap rule), and a model that packs its batch
(``pack_padded_sequence``), run in a loop over samples with plain autograd instead: the
same products, one backward pass per sample and column.
"""

from __future__ import annotations

from typing import Any, cast

import optree
import torch
from torch import Tensor
from torch._C._functorch import maybe_current_level
from torch.func import vmap

from packfunc.engine.autodiff import (
    PACKED_UNDER_VMAP,
    is_untransformable_function,
    over_samples,
    vjp,
)
from packfunc.engine.modes import functional_mode, twice_differentiable
from packfunc.engine.precision import to_dtype_of
from packfunc.functionalize import batch_size, run_model, select_samples
from packfunc.types import ModelFn


def column_grads(
    model_fn: ModelFn,
    leaves: list[Tensor],
    treespec: optree.PyTreeSpec,
    wanted: list[int],
    X: Any,
    cotangents: Tensor,
    index: slice | Tensor,
) -> list[Tensor]:
    """Return column gradients of the leaves ``wanted`` for the samples ``index``.

    Args:
        model_fn: ``model_fn(params, X)``.
        leaves: Flattened parameter leaves.
        treespec: Their pytree structure.
        wanted: Indices of the leaves to differentiate.
        X: The whole batch of inputs.
        cotangents: Output cotangents ``[K, N, ...]`` for the whole batch.
        index: Samples to compute (a slice or an index tensor).

    Returns:
        One tensor ``[K, len(index), *leaf.shape]`` per wanted leaf.

    Example:
        >>> fn, p = packfunc.functional(torch.nn.Linear(3, 2))
        >>> leaves, spec = optree.tree_flatten(p)  # dict keys sorted: bias, weight
        >>> g = column_grads(fn, leaves, spec, [1], torch.ones(4, 3), torch.ones(1, 4, 2),
        ...                  slice(0, 4))
        >>> g[0].shape
        torch.Size([1, 4, 2, 3])
    """
    xs = select_samples(X, index)
    # options among the inputs (a dict's output_hidden_states=True) are the same for all
    flat, spec = optree.tree_flatten(xs, none_is_leaf=True)
    batched = [i for i, value in enumerate(flat) if isinstance(value, Tensor)]

    def one_sample(tensors: list[Tensor], columns: Tensor) -> list[Tensor]:
        values = list(flat)
        for i, tensor in zip(batched, tensors):
            values[i] = tensor.unsqueeze(0)
        x_batch = optree.tree_unflatten(spec, values)

        def forward(chosen: list[Tensor]) -> Tensor:
            return output_with(model_fn, leaves, treespec, dict(zip(wanted, chosen)), x_batch)

        _, pullback = vjp(forward, [leaves[i] for i in wanted])
        return cast(list[Tensor], vmap(lambda c: pullback(c.unsqueeze(0))[0])(columns))

    # attention's math kernel has batching rules; the fused CPU kernels would run in a
    # loop over samples (and PyTorch warns about it on every call)
    # a packed batch: torch's kernels with plain autograd, unless inside the caller's transform
    escape = () if maybe_current_level() is not None else (PACKED_UNDER_VMAP,)
    try:
        with twice_differentiable():
            per_sample = over_samples(one_sample, escape, in_dims=(0, 1), randomness="different")(
                [flat[i] for i in batched], cotangents[:, index]
            )
    except RuntimeError as error:
        if not is_untransformable_function(error) and PACKED_UNDER_VMAP not in str(error):
            raise
        return _looped_with_autograd(model_fn, leaves, treespec, wanted, xs, cotangents[:, index])
    return [g.transpose(0, 1) for g in per_sample]


def _looped_with_autograd(
    model_fn: ModelFn,
    leaves: list[Tensor],
    treespec: optree.PyTreeSpec,
    wanted: list[int],
    xs: Any,
    columns: Tensor,
) -> list[Tensor]:
    """:func:`column_grads` of the samples ``xs`` by plain autograd, one sample at a time.

    Each sample runs alone; each of its ``K`` output cotangents is pulled back by
    ``torch.autograd.grad`` (any custom ``autograd.Function`` has a backward there).

    Args:
        model_fn: ``model_fn(params, X)``.
        leaves: Flattened parameter leaves.
        treespec: Their pytree structure.
        wanted: Indices of the leaves to differentiate.
        xs: The samples' inputs.
        columns: Their output cotangents ``[K, n, ...]``.

    Returns:
        One tensor ``[K, n, *leaf.shape]`` per wanted leaf.

    Example:
        >>> fn, p = packfunc.functional(torch.nn.Linear(3, 2))
        >>> leaves, spec = optree.tree_flatten(p)
        >>> found = _looped_with_autograd(fn, leaves, spec, [1], torch.ones(4, 3),
        ...                               torch.ones(1, 4, 2))
        >>> found[0].shape
        torch.Size([1, 4, 2, 3])
    """
    samples = []
    for n in range(batch_size(xs)):
        chosen = [leaves[i].detach().requires_grad_() for i in wanted]
        with torch.enable_grad():
            x_batch = select_samples(xs, slice(n, n + 1))
            output = output_with(model_fn, leaves, treespec, dict(zip(wanted, chosen)), x_batch)
        pulled = [
            torch.autograd.grad(
                output, chosen, column[n : n + 1], retain_graph=True, allow_unused=True
            )
            for column in columns
        ]
        samples.append(
            [
                torch.stack([g[j] if g[j] is not None else torch.zeros_like(c) for g in pulled])
                for j, c in enumerate(chosen)
            ]
        )
    return [torch.stack([sample[j] for sample in samples], 1) for j in range(len(wanted))]


def output_with(
    model_fn: ModelFn,
    leaves: list[Tensor],
    treespec: optree.PyTreeSpec,
    replaced: dict[int, Tensor],
    X: Any,
) -> Tensor:
    """The model's output on ``X`` with some leaves replaced, in the replacing leaves' dtype.

    Run as the whole-model path and the Hessian's re-runs run the model (see
    :func:`~packfunc.engine.modes.functional_mode`); the dtype as ``precision`` wants it.

    Args:
        model_fn: ``model_fn(params, X)``.
        leaves: Flattened parameter leaves.
        treespec: Their pytree structure.
        replaced: Leaf index -> the tensor that replaces it (at least one).
        X: The inputs.

    Returns:
        The output.

    Example:
        >>> fn, p = packfunc.functional(torch.nn.Linear(3, 2))
        >>> leaves, spec = optree.tree_flatten(p)  # bias, weight
        >>> output_with(fn, leaves, spec, {0: torch.ones(2)}, torch.zeros(1, 3))
        tensor([[1., 1.]])
    """
    current = [replaced.get(i, leaf) for i, leaf in enumerate(leaves)]
    with functional_mode():
        output = run_model(model_fn, optree.tree_unflatten(treespec, current), X)
    return to_dtype_of(output, next(iter(replaced.values())))
