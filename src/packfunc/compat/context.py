"""The ``backpack`` and ``disable`` context managers and the state they set."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from packfunc.compat.extensions.backprop_extension import BackpropExtension


@dataclass(frozen=True)
class Context:
    """The extensions and options of the innermost active ``with backpack(...)``."""

    extensions: tuple[BackpropExtension, ...]
    extension_hook: Callable[[nn.Module], None] | None
    debug: bool
    retain_graph: bool


_ACTIVE: list[Context] = []
_DISABLED: list[bool] = []


def active() -> Context | None:
    """Return the innermost active context, or ``None`` outside ``with backpack(...)``."""
    return _ACTIVE[-1] if _ACTIVE else None


def recording() -> bool:
    """Whether forward passes are recorded (not inside ``with disable()``)."""
    return not _DISABLED


class backpack:  # noqa: N801 (BackPACK's name)
    """Activate extensions for the backward passes inside the ``with`` block.

    Args:
        *exts: Extension instances, e.g. ``BatchGrad()``, ``DiagGGNExact()``.
        extension_hook: Called on each module after all extensions ran; takes the
            module, returns ``None``.
        debug: Print what runs.
        retain_graph: Keep the recorded inputs and outputs for another backward pass
            (use the same value as ``backward(retain_graph=...)``).

    Raises:
        ValueError: if an argument is not an extension instance (e.g. the class
            ``BatchGrad`` instead of ``BatchGrad()``), or two extensions share a savefield.

    Example:
        >>> from packfunc.compat.extensions import BatchGrad
        >>> with backpack(BatchGrad()):
        ...     pass
    """

    def __init__(
        self,
        *exts: BackpropExtension,
        extension_hook: Callable[[nn.Module], None] | None = None,
        debug: bool = False,
        retain_graph: bool = False,
    ):
        for ext in exts:
            if isinstance(ext, type) and issubclass(ext, BackpropExtension):
                raise ValueError(
                    f"pass an instance, {ext.__name__}(), not the class {ext.__name__}."
                )
            if not isinstance(ext, BackpropExtension):
                raise ValueError(
                    f"{ext!r} is not a packfunc.compat extension; pass instances "
                    "from packfunc.compat.extensions."
                )
        fields = [ext.savefield for ext in exts]
        duplicates = sorted({f for f in fields if fields.count(f) > 1})
        if duplicates:
            raise ValueError(f"several extensions save to {duplicates}; pass each once.")
        self.context = Context(tuple(exts), extension_hook, debug, retain_graph)

    def __enter__(self) -> backpack:
        if _DISABLED:
            raise RuntimeError(
                "backpack(...) cannot run inside disable(): forward passes there "
                "record nothing. Leave the disable() block first."
            )
        _ACTIVE.append(self.context)
        return self

    def __exit__(self, *exc: Any) -> None:
        _ACTIVE.pop()


class disable:  # noqa: N801 (BackPACK's name)
    """Record nothing during forward passes (no memory overhead); extensions cannot run.

    Example:
        >>> with disable():
        ...     disable.is_active()
        True
    """

    def __enter__(self) -> disable:
        _DISABLED.append(True)
        return self

    def __exit__(self, *exc: Any) -> None:
        _DISABLED.pop()

    @staticmethod
    def is_active() -> bool:
        """Whether recording is disabled."""
        return bool(_DISABLED)

    @staticmethod
    def should_store_io() -> bool:
        """Whether forward passes store module inputs and outputs (BackPACK's name).

        Example:
            >>> disable.should_store_io()
            True
        """
        return not _DISABLED


from packfunc.compat._ctx import CTX  # noqa: E402, F401 (BackPACK imports it from here)
