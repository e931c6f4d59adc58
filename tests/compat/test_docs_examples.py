"""BackPACK's documentation examples run on ``packfunc.compat`` with only the prefix changed.

Each example is read from BackPACK's sdist at test time (never copied here), its
import prefix rewritten, its MNIST download replaced by scikit-learn's digits and
its training loops shrunk (``tests/compat/examples_support.py`` says how), then
executed in a fresh namespace with matplotlib's Agg backend and ``plt.show``
silenced. The example passes if it runs to its end and none of its own checks
failed: they raise, or (two examples) print booleans (``Same Tr(H)? False``).

The same examples with the same substitutions also run on real BackPACK, which
shows that the harness, not the shim, is right when they pass there.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.compat.examples_support import (
    EXAMPLES,
    FAILED_CHECK,
    Example,
    SdistUnavailable,
    locate_sdist,
    make_examples_module,
    prepare_source,
)

PACKAGES = [pytest.param("backpack", marks=pytest.mark.backpack), "packfunc.compat"]

pytestmark = pytest.mark.filterwarnings(
    "ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning"
)


@pytest.fixture(scope="module")
def sdist() -> Path:
    try:
        return locate_sdist()
    except SdistUnavailable as error:
        pytest.skip(f"BackPACK's sdist is unavailable: {error}")


@pytest.fixture
def quiet_matplotlib(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Agg backend, ``plt.show`` a no-op and every figure closed afterwards."""
    try:
        import matplotlib
    except ImportError:  # the examples that plot skip themselves (Example.requires)
        yield
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    monkeypatch.setattr(plt, "show", lambda *args, **kwargs: None)
    yield
    plt.close("all")


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Run single-threaded: these small examples gain nothing from threads, and on a busy
    machine spinning intra-op threads make them many times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("package", PACKAGES)
@pytest.mark.parametrize("example", EXAMPLES, ids=lambda example: example.name)
def test_docs_example_runs(
    example: Example,
    package: str,
    sdist: Path,
    quiet_matplotlib: None,
    one_thread: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip(package)
    for module in example.requires:
        pytest.importorskip(module)
    source = prepare_source(sdist, example, package)
    # the stand-in data module, in place of the one that downloads MNIST
    importlib.import_module(f"{package}.utils")
    monkeypatch.setitem(sys.modules, f"{package}.utils.examples", make_examples_module(package))

    code = compile(source, f"<{package}: {example.path}>", "exec")
    exec(code, {"__name__": "__main__"})  # a fresh namespace, as runpy would give

    printed = capsys.readouterr().out
    failed = [
        line for line in printed.splitlines() if example.prints_checks and FAILED_CHECK.search(line)
    ]
    assert not failed, f"{example.path} reports failed checks:\n" + "\n".join(failed)
