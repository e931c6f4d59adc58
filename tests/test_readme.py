"""Every Python block of the README runs on its own, as a newcomer would paste it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_its_quick_starts():
    """The functional and shim quick starts are there; the first fits on one screen."""
    assert len(BLOCKS) >= 4
    assert len(BLOCKS[0].strip().splitlines()) <= 15


@pytest.mark.slow  # a fresh interpreter importing torch per block
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs_alone(index: int):
    """In a fresh interpreter, with nothing defined by an earlier block."""
    script = "import warnings\nwarnings.simplefilter('ignore')\n" + BLOCKS[index]
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
