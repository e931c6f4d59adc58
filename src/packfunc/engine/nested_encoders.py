"""``nn.TransformerEncoder``'s nested-tensor path, which packfunc's passes cannot all take.

In evaluation mode, with a padding mask and nothing that requires grad among its input and
first layer's weights, the encoder runs on nested tensors: its padded positions come out
zero. Inside a torch function mode (discovery, products, the shim's recording) or ``vmap``
it takes its other path, which computes them. Where the padded positions reach the loss the
two are different functions, and a call that mixes passes of both (discovery's one sample
and the batch pass, or a product) would return the other function's values or a wrong
error: an encoder call that takes the nested path in the user's forward is refused, naming
the fix (``enable_nested_tensor=False``), in every pass with gradients (discovery's has none,
and says nothing of which tensors the user's forward differentiates).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.forward_ad import unpack_dual
from torch.nn.modules.module import register_module_forward_hook

NESTED_ENCODER_FIX = (
    "this nn.TransformerEncoder runs on nested tensors in your forward (evaluation mode, a "
    "padding mask, no weight of its first layer and not its input requiring grad), which "
    "leave padded positions zero; packfunc's passes take its other path, which computes "
    "them, so the quantities would be those of another function. Build it with "
    "enable_nested_tensor=False (the same function, padded positions computed) or call "
    "torch.backends.mha.set_fastpath_enabled(False)."
)

_THREAD = threading.local()
"""Per thread: how deep in :func:`refusing_nested_encoders` blocks (``depth``)."""


def _physical(tensor: Tensor) -> Tensor:
    """``tensor`` beneath ``vmap``'s samples, the mapped dimension first.

    Example:
        >>> _physical(torch.ones(2)).shape
        torch.Size([2])
    """
    functorch = torch._C._functorch
    while functorch.is_batchedtensor(tensor):
        mapped = functorch.maybe_get_bdim(tensor)
        tensor = functorch.get_unwrapped(tensor).movedim(mapped, 0)
    return tensor


def _follows_parameters(tensor: Tensor) -> bool:
    """Whether ``tensor`` requires grad in the user's forward, as far as this pass shows it.

    It requires grad (autograd, ``torch.func.grad``/``vjp``), carries a tangent (``jvp``),
    or is a tensor subclass that sees calls (packfunc's tapped leaves, which the user's
    forward has as parameters requiring grad); beneath ``vmap``'s samples likewise.

    Example:
        >>> _follows_parameters(torch.ones(1, requires_grad=True))
        True
    """
    functorch = torch._C._functorch
    if functorch.is_batchedtensor(tensor):
        return _follows_parameters(functorch.get_unwrapped(tensor))
    sees_calls = type(tensor) not in (Tensor, nn.Parameter) and torch.overrides.has_torch_function(
        (tensor,)
    )
    return tensor.requires_grad or unpack_dual(tensor).tangent is not None or sees_calls


def _pads_at_ends(padding: Tensor) -> tuple[bool, bool]:
    """Whether any position is padded, and whether every row's padding comes last.

    Torch's ``mask_check`` (its nested tensor needs each row's kept positions first), read
    off the mask alone, also under ``vmap``.

    Example:
        >>> _pads_at_ends(torch.tensor([[False, True], [False, False]]))
        (True, True)
    """
    with torch._C.DisableTorchFunction():
        padded = _physical(padding)
        padded = padded if padded.dtype == torch.bool else padded != 0
        kept_after_padding = padded[..., :-1] & ~padded[..., 1:]
        return bool(padded.any()), not bool(kept_after_padding.any())


def runs_nested_in_users_forward(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> bool:
    """Whether ``module`` is an encoder that runs this call on nested tensors outside packfunc.

    Torch's conditions (``nn.TransformerEncoder.forward``) but the one a torch function mode
    changes: fast path on, nested tensors enabled, evaluation mode, a batched input with a
    padding mask and no other mask, no autocast, rows padded at their end, and none of the
    input and the first layer's weights requiring grad; and a position padded (without one
    both paths compute the same).

    Args:
        module: Any module being called.
        args: Its positional arguments.
        kwargs: Its keyword arguments.

    Returns:
        ``True`` for such an encoder call.

    Example:
        >>> layer = nn.TransformerEncoderLayer(4, 2, 8, batch_first=True)
        >>> encoder = nn.TransformerEncoder(layer, 1).eval().requires_grad_(False)
        >>> padding = torch.tensor([[False, True]])
        >>> runs_nested_in_users_forward(encoder, (torch.ones(1, 2, 4),), {
        ...     "src_key_padding_mask": padding})
        True
    """
    if not isinstance(module, nn.TransformerEncoder):
        return False
    src = args[0] if args else kwargs.get("src")
    mask = args[1] if len(args) > 1 else kwargs.get("mask")
    padding = args[2] if len(args) > 2 else kwargs.get("src_key_padding_mask")
    first = module.layers[0]
    if not (
        torch.backends.mha.get_fastpath_enabled()
        and getattr(module, "use_nested_tensor", False)
        and not first.training
        and isinstance(src, Tensor)
        and src.dim() == 3
        and isinstance(padding, Tensor)
        and mask is None
        and not torch.is_autocast_enabled()
    ):
        return False
    weights = (first.self_attn.in_proj_weight, first.self_attn.in_proj_bias)
    layers = (first.self_attn.out_proj, first.norm1, first.norm2, first.linear1, first.linear2)
    weights += tuple(t for layer in layers for t in (layer.weight, layer.bias))
    if any(t is not None and _follows_parameters(t) for t in (src, *weights)):
        return False
    padded, at_ends = _pads_at_ends(padding)
    return padded and (at_ends or not getattr(module, "mask_check", True))


def _refuse_the_nested_path(module: nn.Module, args: tuple[Any, ...], *rest: Any) -> None:
    """A global forward hook: refuse an encoder call the user's forward runs nested.

    Called ``(module, args, kwargs, output)``, or without ``kwargs`` by another thread's
    call that took the hook as its registration was being removed.
    """
    if getattr(_THREAD, "depth", 0) == 0 or not isinstance(module, nn.TransformerEncoder):
        return
    if not torch.is_grad_enabled():  # discovery: checked against the batch pass after it
        return
    kwargs: dict[str, Any] = rest[0] if len(rest) == 2 else {}
    if runs_nested_in_users_forward(module, args, kwargs):
        raise ValueError(NESTED_ENCODER_FIX)


@contextlib.contextmanager
def refusing_nested_encoders() -> Iterator[None]:
    """Refuse, on the calling thread, encoder calls the user's forward runs nested.

    A global forward hook for the outermost block (no module of the user's gets one);
    other threads' calls pass through it untouched.

    Example:
        >>> with refusing_nested_encoders():
        ...     nn.Linear(2, 2)(torch.ones(1, 2)).shape
        torch.Size([1, 2])
    """
    depth = getattr(_THREAD, "depth", 0)
    _THREAD.depth = depth + 1
    handle = (
        register_module_forward_hook(_refuse_the_nested_path, with_kwargs=True)
        if depth == 0
        else None
    )
    try:
        yield
    finally:
        if handle is not None:
            handle.remove()
        _THREAD.depth = depth
