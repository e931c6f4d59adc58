"""``FirstOrderModuleExtension``: base of custom first-order module extensions."""

from __future__ import annotations

from packfunc.compat.extensions.module_extension import ModuleExtension


class FirstOrderModuleExtension(ModuleExtension):
    """A module extension for a first-order extension (``backproped`` is ``None``).

    Example:
        >>> class ScaleBatchGrad(FirstOrderModuleExtension):
        ...     def weight(self, ext, module, g_inp, g_out, backproped):
        ...         return g_out[0].sum(1)
        >>> ScaleBatchGrad(params=["weight"]).handles("weight")
        True
    """
