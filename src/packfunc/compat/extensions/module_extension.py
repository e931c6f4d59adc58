"""``ModuleExtension``: the base of custom per-module extensions (BackPACK's API).

packfunc computes every quantity of every module itself, by autodiff where no
rule applies. A module extension registered with ``ext.set_module_extension``
overrides that for its module class: its method named after each parameter is
called with ``(ext, module, g_inp, g_out, backproped)`` — ``module.input0`` and
``module.output`` hold the forward's input and output, ``g_out[0]`` the gradient
of the loss w.r.t. the output (per-sample shares), ``g_inp`` each input's gradient
(``None`` for one that takes none) and, for second-order
extensions, ``backproped`` the square-root columns of the GGN w.r.t. the module
output, ``[K, *module.output.shape]`` — and its result is stored. (A module that
defines ``output`` or ``input0`` itself keeps its own: the stored values are then
read with ``packfunc.compat.stored_io(module)``.) A
``backpropagate`` method is accepted but not needed: packfunc propagates through
any module with autograd.
"""

from __future__ import annotations

from collections.abc import Iterable


class ModuleExtension:
    """Base class of module extensions.

    Args:
        params: Names of the parameters the extension handles (default: all the
            methods named like parameters).

    Raises:
        NotImplementedError: for a parameter named without its method.

    Example:
        >>> class ScaleBatchGrad(ModuleExtension):
        ...     def __init__(self):
        ...         super().__init__(params=["weight"])
        ...     def weight(self, ext, module, g_inp, g_out, backproped):
        ...         return g_out[0].sum(1)
        >>> ScaleBatchGrad().params
        ['weight']
    """

    def __init__(self, params: Iterable[str] | None = None):
        self.params = list(params) if params is not None else []
        for name in self.params:  # (as BackPACK: a named parameter needs its method)
            if not callable(getattr(self, name, None)):
                raise NotImplementedError(
                    f"{type(self).__name__} names the parameter {name!r} but defines no "
                    f"method {name}(self, ext, module, g_inp, g_out, backproped) computing it."
                )

    def handles(self, name: str) -> bool:
        """Whether this extension computes the parameter ``name``."""
        return name in self.params or (not self.params and callable(getattr(self, name, None)))
