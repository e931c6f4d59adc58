"""Every quantity on each accelerator torch sees equals the CPU result on the same problem.

The CPU values are proven against the oracles in the other modules; here the same float64
problem, moved to an accelerator (CUDA), must give the same values, on the inputs' device,
through the functional API, the BackPACK shim, the DP clipped sum, KFLR and Hugging Face
models. Without an accelerator (CI) these tests are skipped; run them on a GPU machine with
``python -m pytest tests/test_devices.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import packfunc as pf
from packfunc import compat
from tests.cases import (
    Problem,
    assert_trees_close,
    hugging_face_problem,
    make_problem,
    run_backward_with,
)

ACCELERATORS = ["cuda"] if torch.cuda.is_available() else []
DETERMINISTIC = pf.FIRST_ORDER + ("diag_ggn", "batch_diag_ggn", "diag_hessian", "sqrt_ggn")
CLOSE = {"rtol": 1e-7, "atol": 1e-9}
HUGGING_FACE_CLOSE = {"rtol": 1e-4, "atol": 1e-6}
"""LLaMA's rotary tables are computed in float32 also in a float64 model: CPU and CUDA differ
there by float32 rounding (relative 1e-5 seen on an H200)."""


@pytest.fixture(
    params=ACCELERATORS or [pytest.param("cuda", marks=pytest.mark.skip(reason="no CUDA device"))]
)
def device(request: pytest.FixtureRequest) -> torch.device:
    """An accelerator torch sees (the tests skip where there is none)."""
    return torch.device(request.param)


def moved(problem: Problem, device: torch.device) -> Problem:
    """``problem`` with its model, loss and batch on ``device`` (the original untouched)."""
    import copy

    model = copy.deepcopy(problem.model).to(device)
    loss = copy.deepcopy(problem.loss).to(device)
    return Problem(model, loss, problem.X.to(device), problem.y.to(device))


def outcome(function, *args, **kwargs) -> object:
    """``function``'s result, or the type of the error it refused with."""
    try:
        return function(*args, **kwargs)
    except (ValueError, NotImplementedError, TypeError, RuntimeError) as error:
        return type(error)


def assert_on(tree: object, device: torch.device) -> None:
    """Every tensor of ``tree`` lives on ``device``."""
    for leaf in torch.utils._pytree.tree_leaves(tree):
        if isinstance(leaf, torch.Tensor):
            assert leaf.device.type == device.type, leaf.device


def assert_same(
    on_device: object, on_cpu: object, device: torch.device, what: str, **tolerances: float
) -> None:
    """The device's outcome equals the CPU's: the same refusal, or the same values there."""
    if isinstance(on_cpu, type):
        assert on_device is on_cpu, f"{what}: CPU refused with {on_cpu}, device gave {on_device}"
        return
    assert not isinstance(on_device, type), f"{what}: device refused with {on_device}"
    assert_on(on_device, device)
    moved_back = torch.utils._pytree.tree_map(
        lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, on_device
    )
    assert_trees_close(moved_back, on_cpu, what, **(tolerances or CLOSE))


def on_both(function, problem: Problem, there: Problem, **options) -> tuple[object, object]:
    """``function``'s outcomes on ``problem`` (CPU) and on ``there``, its copy on a device."""
    cpu, device = (
        outcome(function, *p.functional(), p.X, p.y, loss=p.loss, **options)
        for p in (problem, there)
    )
    return cpu, device


@pytest.mark.parametrize("loss_name", ["cross_entropy", "mse"])
def test_quantities_match_cpu(case, device: torch.device, loss_name: str):
    problem = make_problem(case, loss_name, "mean", n=3)
    there = moved(problem, device)
    for quantity in DETERMINISTIC:
        on_cpu, on_device = on_both(pf.compute, problem, there, quantities=(quantity,))
        assert_same(on_device, on_cpu, device, f"{case.name}/{quantity}")


def test_kflr_and_clipped_sum_match_cpu(case, device: torch.device):
    problem = make_problem(case, "cross_entropy", "sum", n=4)
    there = moved(problem, device)
    for function, options in ((pf.kflr, {}), (pf.clipped_grad, {"max_norm": 0.5})):
        on_cpu, on_device = on_both(function, problem, there, **options)
        assert_same(on_device, on_cpu, device, f"{case.name}/{function.__name__}")


@pytest.mark.parametrize("case", ["mlp", "conv2d", "lstm", "norms_and_scales"], indirect=True)
def test_shim_matches_cpu(case, device: torch.device):
    problem = make_problem(case, "cross_entropy", "mean", n=3)
    there = moved(problem, device)

    def run(p: Problem) -> dict[str, dict[str, torch.Tensor]]:
        extensions = [compat.extensions.BatchGrad(), compat.extensions.DiagGGNExact()]
        model = run_backward_with(compat, extensions, p.model, p.loss, p.X, p.y)
        return {
            name: {"grad_batch": param.grad_batch, "diag_ggn_exact": param.diag_ggn_exact}
            for name, param in model.named_parameters()
        }

    assert_same(run(there), run(problem), device, f"{case.name}/shim")


@pytest.mark.parametrize("name", ["gpt2", "bert", "llama"])
def test_hugging_face_matches_cpu(name: str, device: torch.device):
    model, X, y = hugging_face_problem(name)
    loss = nn.CrossEntropyLoss()
    problem = Problem(model, loss, X, y)
    there = moved(problem, device)
    quantities = ("batch_grad", "batch_l2_grad", "diag_ggn")
    on_cpu = pf.compute(*problem.functional(), X, y, loss=loss, quantities=quantities)
    on_device = pf.compute(*there.functional(), there.X, there.y, loss=loss, quantities=quantities)
    assert_same(on_device, on_cpu, device, f"{name} on {device}", **HUGGING_FACE_CLOSE)


def test_autocast_batch_grad_sums_to_autocast_gradient(device: torch.device):
    """Under CUDA autocast (bfloat16 matmuls) per-sample gradients add up to the gradient
    autograd takes under the same autocast, to bfloat16's precision."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 5))
    model = model.to(device)
    X, y = torch.randn(8, 16, device=device), torch.randint(0, 5, (8,), device=device)
    loss = nn.CrossEntropyLoss(reduction="sum")
    with torch.autocast(device.type, dtype=torch.bfloat16):
        per_sample = pf.batch_grad(*pf.functional(model), X, y, loss=loss)
        grads = torch.autograd.grad(loss(model(X), y), list(model.parameters()))
    for (name, _), g in zip(model.named_parameters(), grads):
        assert per_sample[name].device.type == device.type
        torch.testing.assert_close(per_sample[name].sum(0).float(), g.float(), rtol=3e-2, atol=3e-2)
