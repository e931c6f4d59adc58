"""Code whose calls reach no function mode (TorchScript, ``as_subclass``, a numpy round
trip, writes into a tensor made before): never a silently wrong value.

A TorchScript function's operators bypass ``TorchFunctionMode``: discovery took its
outputs for tensors made before the forward (not carrying the samples) and a parameter
used inside it for unused, so per-sample gradients of such parameters came out zero.
Discovery now calls every operator from Python (``_OperatorsInSight``): the outputs carry
the samples, and parameters used inside take the whole-model path.
"""

from __future__ import annotations

import pytest
import torch
from tests.cases import assert_batch_grad_is_a_loop
from torch import Tensor, nn

import packfunc as pf


@torch.jit.script
def _doubled_rows(x: Tensor) -> Tensor:
    return x.reshape(-1, x.shape[-1]) * 2.0


@torch.jit.script
def _scaled(x: Tensor, scale: Tensor) -> Tensor:
    return x * scale


class RowsFromScript(nn.Module):
    """A scripted function flattens the samples' rows; a parameter scales them after it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 5)
        self.scale = nn.Parameter(torch.randn(5))

    def forward(self, x: Tensor) -> Tensor:
        n, t, _ = x.shape
        return (_doubled_rows(self.linear(x)) * self.scale).view(n, t, 5).sum(1)


class ParameterInScript(nn.Module):
    """A parameter used inside a scripted function."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 5)
        self.scale = nn.Parameter(torch.randn(5))

    def forward(self, x: Tensor) -> Tensor:
        return _scaled(self.linear(x), self.scale).sum(1)


def _assert_per_sample_gradients_equal_a_loop(model: nn.Module) -> dict[str, str]:
    torch.manual_seed(0)
    model = model.double()
    model_fn, params = pf.functional(model)
    X = torch.randn(3, 2, 4, dtype=torch.float64)
    assert_batch_grad_is_a_loop(model_fn, params, X, torch.tensor([0, 3, 1]))
    return pf.explain(model_fn, params, X)


def test_rows_made_by_a_script_carry_the_samples():
    paths = _assert_per_sample_gradients_equal_a_loop(RowsFromScript())
    assert paths["scale"].startswith("whole model")  # flat rows: not sample-first
    assert paths["linear.weight"].startswith("closed form")


def test_a_parameter_used_inside_a_script_takes_the_whole_model_path():
    paths = _assert_per_sample_gradients_equal_a_loop(ParameterInScript())
    assert "TorchScript" in paths["scale"]
    assert paths["linear.weight"].startswith("closed form")


class RowsThrough(nn.Module):
    """Flat rows ``[N·T, 5]`` that pass through ``escape`` before a parameter scales them."""

    def __init__(self, escape) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 5)
        self.scale = nn.Parameter(torch.randn(5))
        self.escape = escape

    def forward(self, x: Tensor) -> Tensor:
        n, t, _ = x.shape
        rows = self.escape(torch.tanh(self.linear(x)).reshape(-1, 5))
        return (rows * self.scale).view(n, t, 5).sum(1)


class AliasedWeight(nn.Module):
    """A linear layer whose weight is used through ``as_subclass`` (no mode sees the call)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 5)

    def forward(self, x: Tensor) -> Tensor:
        weight = self.linear.weight.as_subclass(torch.Tensor)
        return nn.functional.linear(x, weight, self.linear.bias).sum(1)


def _written_into_zeros(rows: Tensor) -> Tensor:
    into = torch.zeros(rows.shape, dtype=rows.dtype)  # its size made of the batch's
    into[torch.arange(len(rows))] = rows  # an unpad/scatter, as flash-attention helpers do
    return into


def test_a_parameter_used_through_as_subclass_takes_the_whole_model_path():
    paths = _assert_per_sample_gradients_equal_a_loop(AliasedWeight())
    assert "shares its memory" in paths["linear.weight"]
    assert paths["linear.bias"].startswith("closed form")


def test_samples_aliased_by_as_subclass_carry_the_samples():
    model = RowsThrough(lambda rows: rows.as_subclass(torch.Tensor))
    assert _assert_per_sample_gradients_equal_a_loop(model)["scale"].startswith("whole model")


def test_samples_that_leave_torch_are_refused():
    """Through Python lists the samples reach the output unseen: refused. Through numpy's
    view of their memory they are followed, and the whole-model path cannot run it."""
    as_lists = RowsThrough(lambda rows: torch.tensor(rows.tolist(), dtype=rows.dtype))
    with pytest.raises(ValueError, match="does not depend on its input along any path"):
        _assert_per_sample_gradients_equal_a_loop(as_lists)
    as_numpy = RowsThrough(lambda rows: torch.from_numpy(rows.detach().numpy()))
    with pytest.raises(RuntimeError, match="data pointer"):
        _assert_per_sample_gradients_equal_a_loop(as_numpy)


def test_samples_written_into_a_tensor_made_before_are_not_taken_for_constants():
    """The rows written in place carry the samples: ``scale`` is no derivation of parameters
    alone (it read as unused, with zero per-sample gradients); its whole-model path, which
    ``vmap`` cannot run over the write, loops over the samples."""
    paths = _assert_per_sample_gradients_equal_a_loop(RowsThrough(_written_into_zeros))
    assert paths["scale"].startswith("whole model")
