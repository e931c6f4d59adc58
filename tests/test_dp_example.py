"""The DP-SGD transformer example: a quick end-to-end run and its empty-batch step."""

from __future__ import annotations

import math
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import packfunc as pf

pytest.importorskip("sklearn")
pytest.importorskip("transformers")
pytest.importorskip("opacus")

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "dp_transformer_digits.py"


def _number(text: str, label: str) -> float:
    """The number printed after ``label:`` on its own line of ``text``."""
    found = re.search(rf"^{re.escape(label)}: ([-+0-9.eEinfa]+)", text, re.MULTILINE)
    assert found, f"no {label!r} line in:\n{text}"
    return float(found.group(1))


def test_quick_run_prints_its_comparison() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--epsilon", "8"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    spent = _number(done.stdout, "epsilon spent")
    assert math.isfinite(spent) and 0 < spent <= 8.0 + 1e-6
    for label in ("private test accuracy", "non-private test accuracy"):
        assert 0.0 <= _number(done.stdout, label) <= 1.0
    for label in ("private median step", "non-private median step"):
        assert _number(done.stdout, label) > 0
    assert math.isfinite(_number(done.stdout, "step time ratio (private / non-private)"))


def test_empty_batch_step_is_the_noise_alone() -> None:
    demo = runpy.run_path(str(SCRIPT))
    model_fn, params = pf.functional(nn.Linear(3, 2))
    config = demo["Config"](clip=2.0)
    grad_fn = demo["private_grad_fn"](model_fn, config, 1.5, 4.0, torch.Generator().manual_seed(0))
    grad = grad_fn(params, torch.zeros(0, 3), torch.zeros(0, dtype=torch.long))
    expected = pf.privacy.add_noise(
        {k: torch.zeros_like(p) for k, p in params.items()},
        2.0,
        1.5,
        generator=torch.Generator().manual_seed(0),
    )
    for name, p in params.items():
        assert grad[name].shape == p.shape
        torch.testing.assert_close(grad[name], expected[name] / 4.0)
        assert grad[name].abs().sum() > 0
