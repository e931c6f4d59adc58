"""Fixtures of every test: the parametrized ``case`` and the BackPACK oracle.

``case`` runs a test on every model of ``tests/cases.py``; narrow it with
``@pytest.mark.parametrize("case", [names...], indirect=True)``. Tests on a case marked
``slow`` get the ``slow`` marker, and tests using ``backpack_oracle`` the ``backpack``
marker, so ``-m "not slow"`` and ``-m "not backpack"`` select without editing tests.
"""

from __future__ import annotations

import types

import pytest

from tests.cases import CASES, Case


@pytest.fixture(params=list(CASES))
def case(request: pytest.FixtureRequest) -> Case:
    """One model of ``tests/cases.py`` (parametrized by name)."""
    return CASES[request.param]


@pytest.fixture
def backpack_oracle() -> types.ModuleType:
    """BackPACK with its ``extensions`` imported; skips the test when it is not installed."""
    backpack = pytest.importorskip("backpack")
    pytest.importorskip("backpack.extensions")
    return backpack


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark tests that use BackPACK, and tests on slow cases."""
    for item in items:
        if "backpack_oracle" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.backpack)
        callspec = getattr(item, "callspec", None)
        name = callspec.params.get("case") if callspec else None
        if isinstance(name, str) and name in CASES and CASES[name].slow:
            item.add_marker(pytest.mark.slow)
