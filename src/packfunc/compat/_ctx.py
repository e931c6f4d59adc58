"""``CTX``: BackPACK's static view of the active ``with backpack(...)`` configuration.

The shim keeps its state in :mod:`packfunc.compat.context` (a stack of contexts);
``CTX`` answers BackPACK's questions about it and keeps the hook handles client code
hands in, so that ``CTX.remove_hooks()`` removes them as BackPACK's does.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from torch.utils.hooks import RemovableHandle

from packfunc.compat import context
from packfunc.compat.extensions.backprop_extension import BackpropExtension


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
        ctx = context.active()
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
        ctx = context.active()
        return ctx is not None and ctx.debug

    @staticmethod
    def get_extension_hook() -> Callable[[nn.Module], None]:
        """The hook run on each module after the extensions.

        Returns:
            The active ``extension_hook``, a function doing nothing if there is none.
        """
        ctx = context.active()
        if ctx is None or ctx.extension_hook is None:
            return _no_hook
        return ctx.extension_hook

    @staticmethod
    def get_retain_graph() -> bool:
        """Whether the active ``with backpack(...)`` keeps recorded inputs for another backward.

        Returns:
            Its ``retain_graph`` argument, ``False`` outside one.
        """
        ctx = context.active()
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
