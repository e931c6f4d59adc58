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


def over_samples(func: Callable[..., Any], what: str, **options: Any) -> Callable[..., Any]:
    """``torch.func.vmap(func, **options)`` over samples, with a clear error for branching.

    A model that branches on tensor values (Hugging Face's mask code calls ``.all()``
    on the padding mask) cannot be run per sample under ``vmap``; the error then says
    which path needed it, instead of vmap's generic message.

    Args:
        func: The per-sample function.
        what: The path that runs it, for the message (e.g. ``"the whole-model path"``).
        **options: ``vmap``'s options (``in_dims``, ``randomness``).

    Returns:
        The vmapped function.

    Example:
        >>> over_samples(torch.sin, "an example")(torch.zeros(2))
        tensor([0., 0.])
    """
    mapped = torch.func.vmap(func, **options)

    def run(*args: Any) -> Any:
        try:
            return mapped(*args)
        except RuntimeError as error:
            if "data-dependent control flow" not in str(error):
                raise
            raise ValueError(
                f"{what} runs the model once per sample under torch.func.vmap, and the model "
                "branches on tensor values (e.g. Hugging Face's mask code calls .all() on "
                "the padding mask), which vmap cannot follow. Quantities from op-local paths "
                "work (pf.explain shows them); for this one, pass batches without padding "
                "(no attention_mask) or compute it one sample at a time."
            ) from error

    return run
