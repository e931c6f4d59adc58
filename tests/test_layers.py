"""The package's layers: no import cycles; the shim reaches the engine through one module."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import packfunc as pf
from packfunc.specs import SPECS

ROOT = Path(pf.__file__).resolve().parent.parent
ENGINE_API = "packfunc.engine.api"


def _name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or path.is_dir()


def _is_package(name: str) -> bool:
    return ROOT.joinpath(*name.split(".")).is_dir()


def _imports(path: Path) -> set[str]:
    """The packfunc modules ``path`` imports, anywhere in it (type-checking imports too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("packfunc"))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("packfunc"):
            for alias in node.names:  # `from packfunc.engine import ops` imports a module
                child = f"{node.module}.{alias.name}"
                found.add(child if _is_module(child) else str(node.module))
    return found


GRAPH = {_name(path): _imports(path) for path in ROOT.joinpath("packfunc").rglob("*.py")}


def test_no_import_cycles():
    """Modules import each other in one direction only (package ``__init__``s aside)."""
    graph = {
        module: {m for m in imported if m in GRAPH and not _is_package(m)}
        for module, imported in GRAPH.items()
        if not _is_package(module)
    }
    on_path: list[str] = []
    done: set[str] = set()
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        on_path.append(module)
        for other in sorted(graph[module]):
            if other in on_path:
                cycles.append([*on_path[on_path.index(other) :], other])
            elif other not in done:
                visit(other)
        on_path.pop()
        done.add(module)

    for module in sorted(graph):
        if module not in done:
            visit(module)
    assert not cycles, cycles


def test_the_shim_reaches_the_engine_through_its_api_only():
    """``compat/`` imports public packfunc modules and ``packfunc.engine.api``, no other
    engine module; nothing outside ``compat/`` imports the shim."""
    for module, imported in GRAPH.items():
        engine = {m for m in imported if m.startswith("packfunc.engine")}
        if module.startswith("packfunc.compat"):
            assert engine <= {ENGINE_API}, (module, engine - {ENGINE_API})
        else:
            assert not any(m.startswith("packfunc.compat") for m in imported), module


@pytest.mark.parametrize("name", [name for name in SPECS if name != "grad"])
def test_every_spec_names_its_public_function(name: str):
    """The shim and the dataset driver find a quantity's function by its spec's name (the
    gradient alone is ``compute``'s and ``torch.func.grad``'s)."""
    assert getattr(pf, name).__name__ == name
