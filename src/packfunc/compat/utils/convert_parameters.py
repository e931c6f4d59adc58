"""Conversion between flat parameter vectors and lists of parameter-shaped tensors."""

from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor, typename
from torch.nn.utils import parameters_to_vector

__all__ = ["parameters_to_vector", "vector_to_parameter_list"]


def vector_to_parameter_list(vec: Tensor, parameters: Iterable[Tensor]) -> list[Tensor]:
    """Split the flat vector ``vec`` into tensors shaped like ``parameters``.

    The inverse of :func:`torch.nn.utils.parameters_to_vector`. Unlike
    :func:`torch.nn.utils.vector_to_parameters`, the parameters are left untouched:
    the result holds views of ``vec`` (cut off the autograd graph) in their shapes.

    Args:
        vec: Tensor with as many entries as all ``parameters`` together, usually 1-D.
        parameters: Tensors (e.g. ``model.parameters()``) giving the shapes, in order.

    Returns:
        One tensor per parameter, with its shape, holding consecutive entries of ``vec``.

    Raises:
        TypeError: If ``vec`` is not a tensor.
        ValueError: If the number of entries of ``vec`` differs from the total number
            of entries of ``parameters``.

    Example:
        >>> shapes = [torch.zeros(2, 2), torch.zeros(1)]
        >>> vector_to_parameter_list(torch.arange(5.0), shapes)
        [tensor([[0., 1.],
                [2., 3.]]), tensor([4.])]
    """
    if not isinstance(vec, Tensor):
        raise TypeError(f"expected Tensor, but got: {typename(vec)}")

    params = list(parameters)
    needed = sum(p.numel() for p in params)
    if vec.numel() != needed:
        shapes = ", ".join(str(tuple(p.shape)) for p in params)
        raise ValueError(
            f"vec has {vec.numel()} entries, but the parameters need {needed} "
            f"(shapes: {shapes or 'none'})"
        )

    flat = vec.detach().reshape(-1)
    pieces = []
    start = 0
    for param in params:
        stop = start + param.numel()
        pieces.append(flat[start:stop].view_as(param))
        start = stop
    return pieces
