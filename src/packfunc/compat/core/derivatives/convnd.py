"""``weight_jac_t_save_memory``: BackPACK's switch for convolution weight Jacobians."""

from __future__ import annotations

from typing import Any


class weight_jac_t_save_memory:  # noqa: N801 (BackPACK's name)
    """Choose the memory-saving algorithm for transposed convolution weight Jacobians.

    BackPACK switches how it multiplies by a convolution's transposed weight
    Jacobian; packfunc's convolution rules pick their own algorithm, so the switch
    is kept (readable as ``weight_jac_t_save_memory._SAVE_MEMORY``, restored on exit)
    and changes no result.

    Args:
        save_memory: The value of the switch inside the ``with`` block.

    Example:
        >>> with weight_jac_t_save_memory(save_memory=True):
        ...     weight_jac_t_save_memory._SAVE_MEMORY
        True
        >>> weight_jac_t_save_memory._SAVE_MEMORY
        False
    """

    _SAVE_MEMORY = False

    def __init__(self, save_memory: bool = True):
        self._new_save_memory = save_memory

    def __enter__(self) -> weight_jac_t_save_memory:
        self._old_save_memory = weight_jac_t_save_memory._SAVE_MEMORY
        weight_jac_t_save_memory._SAVE_MEMORY = self._new_save_memory
        return self

    def __exit__(self, *exc: Any) -> None:
        weight_jac_t_save_memory._SAVE_MEMORY = self._old_save_memory
