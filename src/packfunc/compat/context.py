"""The ``backpack`` and ``disable`` context managers, the state they set, and ``CTX``.

``CTX`` is BackPACK's static view of the active ``with backpack(...)`` configuration
(BackPACK's clients import it from ``backpack.context``); it also keeps the hook handles
client code hands in, so that ``CTX.remove_hooks()`` removes them as BackPACK's does.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from packfunc.compat.extensions.backprop_extension import BackpropExtension


@dataclass(frozen=True)
class Context:
    """The extensions and options of the innermost active ``with backpack(...)``."""

    extensions: tuple[BackpropExtension, ...]
    extension_hook: Callable[[nn.Module], None] | None
    debug: bool
    retain_graph: bool


EXTENDED_MODELS: weakref.WeakSet[nn.Module] = weakref.WeakSet()
"""The modules passed to ``extend`` (models, not their layers)."""

_ACTIVE: list[Context] = []
_DISABLED: list[bool] = []
"""One entry per open ``disable()`` (``True``) and per pass of packfunc's own (``False``)."""


def active() -> Context | None:
    """Return the innermost active context, or ``None`` outside ``with backpack(...)``."""
    return _ACTIVE[-1] if _ACTIVE else None


def recording() -> bool:
    """Whether forward passes are recorded (not inside ``with disable()`` nor an own pass)."""
    return not _DISABLED


def in_own_pass() -> bool:
    """Whether one of packfunc's own passes runs: its backward passes trigger nothing.

    A user's ``disable()`` stops recording forward passes only, as in BackPACK: a backward
    pass inside it still runs the extensions on a forward recorded before.
    """
    return False in _DISABLED


@contextlib.contextmanager
def own_pass() -> Iterator[None]:
    """Run one of packfunc's own passes through the user's model: nothing records or triggers.

    Example:
        >>> with own_pass():
        ...     recording(), in_own_pass()
        (False, True)
    """
    _DISABLED.append(False)
    try:
        yield
    finally:
        _DISABLED.pop()


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


def _no_hook(module: nn.Module) -> None:
    """The extension hook outside ``with backpack(...)`` or when none was given."""


class CTX:
    """Read the active ``backpack`` configuration; keep removable hook handles.

    Every method is static, as in BackPACK. The configuration is that of the
    innermost active ``with backpack(...)``; outside one it is empty.

    Example:
        >>> from packfunc.compat import backpack
        >>> from packfunc.compat.extensions import BatchGrad
        >>> with backpack(BatchGrad(), debug=True):
        ...     CTX.is_extension_active(BatchGrad), CTX.get_debug()
        (True, True)
        >>> CTX.get_active_exts()
        ()
    """

    hook_handles: list[RemovableHandle] = []

    @staticmethod
    def get_active_exts() -> tuple[BackpropExtension, ...]:
        """The extensions of the innermost active ``with backpack(...)``.

        Returns:
            The extension instances, ``()`` outside ``with backpack(...)``.
        """
        ctx = active()
        return ctx.extensions if ctx is not None else ()

    @staticmethod
    def is_extension_active(*extension_classes: type[BackpropExtension]) -> bool:
        """Whether an instance of any of ``extension_classes`` is active.

        Args:
            *extension_classes: Extension classes, e.g. ``BatchGrad``.

        Returns:
            ``True`` if at least one active extension is an instance of one of them.
        """
        return any(isinstance(ext, extension_classes) for ext in CTX.get_active_exts())

    @staticmethod
    def get_debug() -> bool:
        """Whether the active ``with backpack(...)`` prints what runs.

        Returns:
            Its ``debug`` argument, ``False`` outside one.
        """
        ctx = active()
        return ctx is not None and ctx.debug

    @staticmethod
    def get_extension_hook() -> Callable[[nn.Module], None]:
        """The hook run on each module after the extensions.

        Returns:
            The active ``extension_hook``, a function doing nothing if there is none.
        """
        ctx = active()
        if ctx is None or ctx.extension_hook is None:
            return _no_hook
        return ctx.extension_hook

    @staticmethod
    def get_retain_graph() -> bool:
        """Whether the active ``with backpack(...)`` keeps recorded inputs for another backward.

        Returns:
            Its ``retain_graph`` argument, ``False`` outside one.
        """
        ctx = active()
        return ctx is not None and ctx.retain_graph

    @staticmethod
    def add_hook_handle(hook_handle: RemovableHandle) -> None:
        """Keep a hook handle for :meth:`remove_hooks`.

        Args:
            hook_handle: The handle ``register_*_hook`` returned.
        """
        CTX.hook_handles.append(hook_handle)

    @staticmethod
    def remove_hooks() -> None:
        """Remove every hook kept with :meth:`add_hook_handle` and forget the handles.

        ``extend`` does not keep its hooks here: extended modules stay extended
        (``extend`` is idempotent, so clients that extend again after this are fine).
        """
        for handle in CTX.hook_handles:
            handle.remove()
        CTX.hook_handles = []
