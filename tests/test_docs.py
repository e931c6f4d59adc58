"""Every Python block of the pages in docs/ runs as written (per page, in order)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
PAGES = sorted(page.name for page in DOCS.glob("*.md") if "```python" in page.read_text())


@pytest.mark.slow  # a fresh interpreter per page
@pytest.mark.parametrize("page", PAGES)
def test_docs_python_blocks_run(page: str):
    blocks = re.findall(r"```python\n(.*?)```", (DOCS / page).read_text(), flags=re.S)
    script = "import warnings\nwarnings.simplefilter('ignore')\n" + "\n".join(blocks)
    script += "\nprint('page ok')\n"
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "page ok" in done.stdout
