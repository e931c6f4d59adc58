"""Turn modules into pure functions and handle pytrees of parameters and inputs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import torch
from torch import Tensor, nn
from torch.func import functional_call

ModelFn = Callable[[Any, Any], Tensor]
"""A pure model: ``model_fn(params, X) -> output`` with ``params`` a pytree of tensors."""


def functional(module: nn.Module) -> tuple[ModelFn, dict[str, Tensor]]:
    """Split a module into a pure function and a dict of its parameters.

    The returned ``model_fn(params, X)`` evaluates ``module`` with the given
    parameters (``torch.func.functional_call``); buffers (e.g. BatchNorm
    running statistics) and the train/eval mode are read from the module at
    call time. ``X`` is passed as ``module(X)``; a tuple is unpacked as
    ``module(*X)`` and a dict as ``module(**X)``.

    Args:
        module: Any ``torch.nn.Module``.

    Returns:
        ``(model_fn, params)`` where ``params`` maps parameter names to
        detached tensors sharing storage with the module's parameters.

    Example:
        >>> model_fn, params = functional(torch.nn.Linear(3, 2))
        >>> model_fn(params, torch.zeros(4, 3)).shape
        torch.Size([4, 2])
    """
    params = {name: p.detach() for name, p in module.named_parameters()}

    def model_fn(params: dict[str, Tensor], X: Any) -> Tensor:
        if isinstance(X, tuple):
            return functional_call(module, params, X)
        if isinstance(X, dict):
            return functional_call(module, params, (), X)
        return functional_call(module, params, (X,))

    return model_fn, params


def flatten_params(params: Any) -> tuple[list[Tensor], optree.PyTreeSpec, list[str]]:
    """Flatten a parameter pytree and check that every leaf is a floating tensor.

    Args:
        params: Pytree (dict, list, tuple, ...) whose leaves are tensors.

    Returns:
        ``(leaves, treespec, names)``; ``names[i]`` is a dotted path naming leaf ``i``.

    Raises:
        TypeError: if a leaf is not a floating-point tensor.

    Example:
        >>> leaves, spec, names = flatten_params({"w": torch.zeros(2)})
        >>> names
        ['w']
    """
    paths, leaves, treespec = optree.tree_flatten_with_path(params)
    names = [".".join(str(key) for key in path) or "<root>" for path in paths]
    for name, leaf in zip(names, leaves):
        if not isinstance(leaf, Tensor):
            raise TypeError(
                f"params leaf {name!r} is a {type(leaf).__name__}, not a tensor; "
                "params must be a pytree of floating-point tensors."
            )
        if not (leaf.is_floating_point() or leaf.is_complex()):
            raise TypeError(
                f"params leaf {name!r} has dtype {leaf.dtype}; gradients need floating-point "
                "params. Keep integer tensors out of params (pass them as buffers or "
                "close over them in model_fn)."
            )
    return leaves, treespec, names


def batch_size(X: Any) -> int:
    """Return the common leading dimension of all tensors in the input pytree.

    Args:
        X: A tensor or a pytree of tensors, each with leading batch dimension.

    Returns:
        The batch size ``N``.

    Raises:
        ValueError: if there is no tensor or leading dimensions disagree.

    Example:
        >>> batch_size((torch.zeros(5, 2), torch.zeros(5)))
        5
    """
    sizes = {leaf.shape[0] for leaf in optree.tree_leaves(X)
             if isinstance(leaf, Tensor) and leaf.dim()}
    if len(sizes) != 1:
        raise ValueError(
            "X must be a tensor or a pytree of tensors sharing one leading batch dimension; "
            f"found leading sizes {sorted(sizes)}."
        )
    return sizes.pop()


def select_samples(X: Any, index: slice | Tensor) -> Any:
    """Index the batch dimension of every tensor in a pytree.

    Args:
        X: A tensor or pytree of tensors with leading batch dimension.
        index: A slice or an integer index tensor of samples.

    Returns:
        The pytree with each tensor restricted to the selected samples.

    Example:
        >>> select_samples(torch.arange(6).view(3, 2), slice(0, 1))
        tensor([[0, 1]])
    """
    return optree.tree_map(lambda leaf: leaf[index] if isinstance(leaf, Tensor) else leaf, X)


def as_index(subsampling: Any, n: int, device: torch.device) -> slice | Tensor:
    """Turn a ``subsampling`` argument into an index over the batch.

    Args:
        subsampling: ``None`` (all samples) or a sequence/tensor of sample indices.
        n: Batch size.
        device: Device of the data.

    Returns:
        ``slice(0, n)`` or a long tensor of indices.

    Raises:
        ValueError: if an index is out of range.

    Example:
        >>> as_index([0, 2], 3, torch.device("cpu"))
        tensor([0, 2])
    """
    if subsampling is None:
        return slice(0, n)
    index = torch.as_tensor(subsampling, dtype=torch.long, device=device).reshape(-1)
    if index.numel() and (int(index.min()) < -n or int(index.max()) >= n):
        raise ValueError(f"subsampling indices must lie in [0, {n}); got {index.tolist()}.")
    return index % n
