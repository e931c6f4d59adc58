"""The README's Python examples run as written (in order, sharing their names)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.slow  # a fresh interpreter importing torch, BackPACK and laplace
def test_readme_python_blocks_run():
    """In a fresh interpreter, all blocks in order, sharing their names."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 4
    check = "\nassert net[1].scale.diag_ggn_exact.shape == (16,)\nprint('README ok')\n"
    script = "import warnings\nwarnings.simplefilter('ignore')\n" + "\n".join(blocks) + check
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "README ok" in done.stdout
