"""Let libraries that ``import backpack`` run on packfunc: alias BackPACK's module paths.

``alias_backpack()`` puts an import hook first on ``sys.meta_path`` that answers
``backpack`` with ``packfunc.compat`` and ``backpack.<sub>`` with
``packfunc.compat.<sub>`` (the same module objects: ``backpack.extensions.BatchGrad
is packfunc.compat.extensions.BatchGrad``). Paths the shim does not provide fail
with the usual ``ModuleNotFoundError``, so libraries that treat BackPACK as
optional fall back as they would without it.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Sequence
from importlib.abc import Loader, MetaPathFinder
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

ALIASED = "backpack"
TARGET = "packfunc.compat"


def _aliased(name: str) -> bool:
    return name == ALIASED or name.startswith(ALIASED + ".")


class _BackpackFinder(MetaPathFinder, Loader):
    """Finds ``backpack[.<sub>]`` as the module ``packfunc.compat[.<sub>]``."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if not _aliased(fullname):
            return None
        spec = importlib.util.find_spec(TARGET + fullname[len(ALIASED) :])
        if spec is None:
            return None
        return ModuleSpec(fullname, self, is_package=spec.submodule_search_locations is not None)

    def create_module(self, spec: ModuleSpec) -> None:
        return None  # a placeholder; exec_module replaces it in sys.modules

    def exec_module(self, module: ModuleType) -> None:
        # the import system returns what sys.modules holds after exec_module, so the
        # importer gets packfunc's module itself, with its own __name__ and __spec__
        name = module.__name__
        sys.modules[name] = importlib.import_module(TARGET + name[len(ALIASED) :])


_FINDER = _BackpackFinder()
_users: list[BackpackAlias] = []
_shadowed: dict[str, ModuleType] = {}  # the real BackPACK's modules, hidden while aliased


class BackpackAlias:
    """An active alias of ``backpack`` to ``packfunc.compat``; ``remove()`` or leave the ``with``.

    Returned by :func:`alias_backpack`. Aliases nest: the import hook stays until
    the last active one is removed.
    """

    def __enter__(self) -> BackpackAlias:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def remove(self) -> None:
        """Undo this alias; the last one removes the hook and the aliased ``sys.modules`` entries.

        Modules imported meanwhile keep the ``packfunc.compat`` objects they bound;
        a real BackPACK hidden by ``shadow=True`` is put back, and otherwise a later
        ``import backpack`` finds the real one again, if installed.
        """
        if self not in _users:
            return
        _users.remove(self)
        if _users:
            return
        sys.meta_path.remove(_FINDER)
        for name in [n for n, m in sys.modules.items() if _aliased(n) and _is_ours(m)]:
            del sys.modules[name]
        sys.modules.update(_shadowed)
        _shadowed.clear()


def _is_ours(module: ModuleType | None) -> bool:
    name = getattr(module, "__name__", "")
    return name == TARGET or name.startswith(TARGET + ".")


def alias_backpack(shadow: bool = False) -> BackpackAlias:
    """Make ``import backpack`` and ``import backpack.<sub>`` give packfunc's shim.

    Call it before importing a library written for BackPACK (laplace-torch,
    cockpit-for-pytorch, ...); that library then runs on ``packfunc.compat``
    without changes. Use the result as a context manager, or call its
    ``remove()``, to undo the alias (tests); otherwise it lasts for the process.

    Args:
        shadow: If the real BackPACK is already imported, hide its ``sys.modules``
            entries while the alias is active (they come back on removal) instead of
            raising. Modules that already bound the real BackPACK keep it: do not mix
            them with the aliased ones on one model.

    Returns:
        The active alias.

    Raises:
        RuntimeError: if the real BackPACK is already imported and ``shadow`` is
            ``False``: modules holding it would keep it, so aliasing would mix the two.
            Call ``alias_backpack()`` before anything imports ``backpack``.

    Example:
        >>> import sys
        >>> with alias_backpack(shadow=True):  # shadow: this process may hold the real one
        ...     import backpack.extensions
        ...     from backpack import extend
        >>> backpack.extensions.BatchGrad is sys.modules["packfunc.compat.extensions"].BatchGrad
        True
        >>> extend.__module__
        'packfunc.compat.extend'
    """
    real = sorted(n for n, m in sys.modules.items() if _aliased(n) and not _is_ours(m))
    if real and not shadow:
        raise RuntimeError(
            f"the real BackPACK is already imported ({', '.join(real[:3])}); call "
            "packfunc.compat.alias_backpack() before anything imports backpack, or pass "
            "shadow=True to hide it while the alias is active."
        )
    _shadowed.update((name, sys.modules.pop(name)) for name in real)
    if not _users:
        sys.meta_path.insert(0, _FINDER)
    alias = BackpackAlias()
    _users.append(alias)
    return alias
