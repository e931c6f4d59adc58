"""The DP-SGD example script: a short end-to-end run and its command line."""

from __future__ import annotations

import runpy
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sklearn")

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "dp_sgd_digits.py"


@pytest.fixture(scope="module")
def demo() -> dict:
    """The script's names, loaded without running its ``__main__`` block."""
    return runpy.run_path(str(SCRIPT))


def test_short_run_learns(demo: dict) -> None:
    metrics = demo["main"](["--epochs", "2"])
    assert len(metrics["losses"]) == 2
    assert metrics["losses"][1] < metrics["losses"][0]
    assert metrics["test_accuracy"] > 0.5  # chance is 0.1


def test_rejects_zero_epochs(demo: dict) -> None:
    with pytest.raises(SystemExit):
        demo["parse_args"](["--epochs", "0"])


def test_help_is_plain_text() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "DP-SGD" in done.stdout and "--noise" in done.stdout
    for markup in ("``", ":func:", ":class:", ":mod:"):
        assert markup not in done.stdout
    assert done.stdout.count("--help") == 1  # argparse's own "-h, --help" line only
