"""``memory_cleanup``: forget the inputs and outputs ``extend`` stored on a module."""

from __future__ import annotations

from itertools import count

from torch import nn


def memory_cleanup(module: nn.Module) -> None:
    """Delete the inputs and output stored on ``module`` by its last forward pass.

    Removes ``module.output`` and ``module.input0``, ``module.input1``, ... where
    present, as BackPACK's function of the same name does; children are untouched.

    Args:
        module: An extended module (any module: missing attributes are skipped).

    Example:
        >>> import torch
        >>> from packfunc.compat import extend
        >>> layer = extend(torch.nn.Linear(2, 1))
        >>> _ = layer(torch.randn(3, 2, requires_grad=True))
        >>> memory_cleanup(layer)
        >>> hasattr(layer, "output"), hasattr(layer, "input0")
        (False, False)
    """
    if hasattr(module, "output"):
        delattr(module, "output")
    for i in count():
        if not hasattr(module, f"input{i}"):
            return
        delattr(module, f"input{i}")
