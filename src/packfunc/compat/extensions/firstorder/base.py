"""``FirstOrderModuleExtension``: base of custom first-order module extensions."""

from __future__ import annotations

from packfunc.compat.extensions.module_extension import ModuleExtension


class FirstOrderModuleExtension(ModuleExtension):
    """A module extension for a first-order extension (``backproped`` is ``None``).

    Example:
        >>> FirstOrderModuleExtension(params=["weight"]).handles("weight")
        True
    """
