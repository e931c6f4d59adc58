"""``nn.TransformerEncoder``'s nested-tensor path, which packfunc's passes cannot take.

In evaluation mode, with a padding mask and nothing that requires grad among its input and
first layer's weights, the encoder runs on nested tensors: its padded positions come out
zero. Inside a torch function mode (packfunc's passes but the batch pass on tapped leaves)
or ``vmap`` it takes its other path, which computes them. Where the padded positions reach
the loss the two are different functions, so a quantity from such a pass would be the other
function's: such a call is refused, naming the fix (``enable_nested_tensor=False``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.module import register_module_forward_hook
from torch.overrides import _get_current_function_mode_stack

from packfunc.engine.modes import ParameterMode

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


Follows = Callable[[Tensor, bool], bool]
"""Whether a tensor (a weight, or else an input) requires grad in the user's forward."""


def _follows_parameters(tensor: Tensor, weight: bool = False) -> bool:
    """Whether ``tensor`` requires grad (beneath ``vmap``'s samples, where it runs under one).

    Example:
        >>> _follows_parameters(torch.ones(1, requires_grad=True))
        True
    """
    if torch._C._functorch.is_batchedtensor(tensor):
        return _follows_parameters(torch._C._functorch.get_unwrapped(tensor))
    return tensor.requires_grad


def _is_left_aligned(src: Tensor, padding: Tensor) -> bool:
    """Torch's check that every row's kept positions come first (``True`` where it fails)."""
    keep = padding.logical_not() if padding.dtype == torch.bool else padding == 0
    try:
        with torch._C.DisableTorchFunction():
            return bool(torch._nested_tensor_from_mask_left_aligned(src, keep))
    except (RuntimeError, ValueError):  # (vmap's samples): refused rather than guessed
        return True


def runs_nested_in_users_forward(
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    follows: Follows = _follows_parameters,
) -> bool:
    """Whether ``module`` is an encoder that runs this call on nested tensors outside packfunc.

    Torch's conditions (``nn.TransformerEncoder.forward``) but the one a torch function mode
    changes: fast path on, nested tensors enabled, evaluation mode, a batched input with a
    padding mask and no other mask, no autocast, rows padded at their end, and none of the
    input and the first layer's weights requiring grad.

    Args:
        module: Any module being called.
        args: Its positional arguments.
        kwargs: Its keyword arguments.
        follows: Whether a tensor requires grad in the user's forward (by default: now).

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
    if follows(src, False) or any(t is not None and follows(t, True) for t in weights):
        return False
    return not getattr(module, "mask_check", True) or _is_left_aligned(src, padding)


def _follows_in_this_pass() -> Follows:
    """How to tell a followed tensor now: without gradients (discovery), by packfunc's mode."""
    if torch.is_grad_enabled():
        return _follows_parameters
    modes = [m for m in _get_current_function_mode_stack() if isinstance(m, ParameterMode)]
    return lambda t, weight: any(mode.may_follow(t, weight) for mode in modes)


def _refuse_a_pass_off_the_nested_path(
    module: nn.Module, args: tuple[Any, ...], *rest: Any
) -> None:
    """A global forward hook: refuse an encoder call packfunc runs off the user's path.

    Called ``(module, args, kwargs, output)``, or without ``kwargs`` by another thread's
    call that took the hook as its registration was being removed.
    """
    if getattr(_THREAD, "depth", 0) == 0 or not isinstance(module, nn.TransformerEncoder):
        return
    kwargs: dict[str, Any] = rest[0] if len(rest) == 2 else {}
    src = args[0] if args else kwargs.get("src")
    off_path = torch._C._is_torch_function_mode_enabled() or (
        isinstance(src, Tensor) and torch._C._functorch.is_batchedtensor(src)
    )
    if off_path and runs_nested_in_users_forward(module, args, kwargs, _follows_in_this_pass()):
        raise ValueError(NESTED_ENCODER_FIX)


@contextlib.contextmanager
def refusing_nested_encoders() -> Iterator[None]:
    """Refuse, on the calling thread, encoder calls off the nested path the user's takes.

    A global forward hook for the block (no module of the user's gets one); other threads'
    calls pass through it untouched.

    Example:
        >>> with refusing_nested_encoders():
        ...     nn.Linear(2, 2)(torch.ones(1, 2)).shape
        torch.Size([1, 2])
    """
    depth = getattr(_THREAD, "depth", 0)
    _THREAD.depth = depth + 1
    handle = register_module_forward_hook(_refuse_a_pass_off_the_nested_path, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()
        _THREAD.depth = depth
