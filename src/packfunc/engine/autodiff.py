"""``torch.func``'s ``vjp`` and ``jvp`` with precise return types.

``torch.func.vjp`` returns two or three values depending on ``has_aux``, and its
stub says so with a union; these wrappers fix the arity for the type checker.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch


def vjp(func: Callable[..., Any], *primals: Any) -> tuple[Any, Callable[..., tuple[Any, ...]]]:
    """``torch.func.vjp(func, *primals)``: the output and its pullback.

    Args:
        func: The function to differentiate.
        *primals: Its arguments.

    Returns:
        ``(func(*primals), pullback)``.

    Example:
        >>> out, pullback = vjp(torch.sin, torch.zeros(2))
        >>> pullback(torch.ones(2))
        (tensor([1., 1.]),)
    """
    return cast(tuple[Any, Callable[..., tuple[Any, ...]]], torch.func.vjp(func, *primals))


def vjp_with_aux(
    func: Callable[..., Any], *primals: Any
) -> tuple[Any, Callable[..., tuple[Any, ...]], Any]:
    """``torch.func.vjp(func, *primals, has_aux=True)``: output, pullback and auxiliary data.

    Args:
        func: Returns ``(output, aux)``.
        *primals: Its arguments.

    Returns:
        ``(output, pullback, aux)``.

    Example:
        >>> out, pullback, aux = vjp_with_aux(lambda x: (x.sin(), x.cos()), torch.zeros(2))
        >>> aux
        tensor([1., 1.])
    """
    return cast(
        tuple[Any, Callable[..., tuple[Any, ...]], Any],
        torch.func.vjp(func, *primals, has_aux=True),
    )


def jvp(
    func: Callable[..., Any], primals: tuple[Any, ...], tangents: tuple[Any, ...]
) -> tuple[Any, Any]:
    """``torch.func.jvp``: the output and its directional derivative.

    Args:
        func: The function to differentiate.
        primals: Its arguments.
        tangents: One tangent per argument.

    Returns:
        ``(func(*primals), J @ tangents)``.

    Example:
        >>> jvp(torch.sin, (torch.zeros(2),), (torch.ones(2),))[1]
        tensor([1., 1.])
    """
    return cast(tuple[Any, Any], torch.func.jvp(func, primals, tangents))
