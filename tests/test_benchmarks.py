"""Smoke tests of the benchmark harness (``benchmarks/``) on tiny versions of its problems.

Every row is built and run once, untimed: packfunc must agree with the row's reference
(BackPACK, ``vmap(grad)``, the brute-force Hessian diagonal or curvlinops; Monte-Carlo rows
by shape), and the brute-force peer itself is checked against a dense Hessian.
"""

from __future__ import annotations

import doctest
import importlib.util
import pathlib
import sys

import pytest
import torch
from torch.func import functional_call

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import peers  # noqa: E402
import problems  # noqa: E402
import run  # noqa: E402
import timing  # noqa: E402

TINY = {
    "LM": lambda: problems.lm(n=2, length=4, vocab=11, width=8),
    "ResNet-GN": lambda: problems.resnet_gn(n=3, width=4, size=6),
    "ResNet-BN": lambda: problems.resnet_bn(n=3, width=4, size=6),
    "LSTM": lambda: problems.lstm(n=3, length=4, vocab=7),
    "ResNet-BN 5k": lambda: problems.resnet_hessian(n=2, width=2, size=4),
}
"""The new problems at toy sizes (same architectures)."""


def _no_sync() -> None:
    return None


@pytest.mark.parametrize("name", list(TINY))
def test_packfunc_agrees_with_the_reference_on_every_row(name: str) -> None:
    problem = TINY[name]()
    rows = run.registry([problem], run.QUANTITIES)
    assert [row.quantity for row in rows] == run.QUANTITIES[name]
    for row in rows:
        outcome = run.check(row, sync=_no_sync)
        assert outcome.reference is not None, f"{row.key}: no reference ran {outcome.errors}"
        assert outcome.matches, f"{row.key}: {outcome.mismatch} {outcome.errors}"
        assert not outcome.peer_mismatches, f"{row.key}: {outcome.peer_mismatches}"
        assert not outcome.errors, f"{row.key}: {outcome.errors}"


def test_refusals_are_notes_not_errors() -> None:
    lm_rows = run.registry([TINY["LM"]()], run.QUANTITIES)
    notes = {row.quantity: row.notes for row in lm_rows}
    assert notes["batch_grad"]["BackPACK"].startswith("refused: incomplete")
    bn_rows = run.registry([TINY["ResNet-BN"]()], run.QUANTITIES, only="batch_l2")
    if importlib.util.find_spec("opacus") is None:
        assert "not installed" in notes["batch_l2_grad"]["opacus ghost"]
    else:
        assert "MultiheadAttention" in notes["batch_l2_grad"]["opacus ghost"]
        assert "buffers" in bn_rows[0].notes["opacus"]
    with pytest.raises(peers.Unsupported, match="too slow"):
        peers.brute_force_builder(problems.tanh_mlp(n=2), "diag_hessian")


def test_brute_force_hessian_diagonal_matches_the_dense_hessian() -> None:
    problem = problems.resnet_hessian(n=2, width=1, size=4)
    closure = peers.brute_force_builder(problem, "diag_hessian", chunk=64)
    assert closure is not None
    diagonal = closure()
    model, lossfunc = problem.model(), problem.loss()
    params = {name: p.detach() for name, p in model.named_parameters()}
    names, sizes = list(params), [p.numel() for p in params.values()]

    def loss_of(flat: torch.Tensor) -> torch.Tensor:
        pieces = dict(zip(names, flat.split(sizes)))
        values = {name: pieces[name].view_as(p) for name, p in params.items()}
        return lossfunc(functional_call(model, values, (problem.X,)), problem.y)

    dense = torch.func.hessian(loss_of)(torch.cat([p.flatten() for p in params.values()]))
    brute = torch.cat([diagonal[name].flatten() for name in names])
    torch.testing.assert_close(brute, dense.diagonal(), rtol=1e-4, atol=1e-6)


def test_vmap_monte_carlo_ggn_diagonal_averages_to_the_dense_ggn_diagonal() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 6), torch.nn.Unflatten(1, (3, 2)))
    X, y = torch.randn(4, 3), torch.randint(0, 3, (4, 2))  # [N, C, T] logits, [N, T] targets
    copies = 1000  # the batch repeated: same mean loss and GGN, 1000 draws per sample
    repeated = problems.Problem("toy", model, X.repeat(copies, 1), y.repeat(copies, 1))
    closure = peers.vmap_builder(repeated, "diag_ggn_mc")
    assert closure is not None
    estimate = closure()
    params = {name: p.detach() for name, p in model.named_parameters()}
    output = functional_call(model, params, (X,))
    jacobians = torch.func.jacrev(lambda ps: functional_call(model, ps, (X,)))(params)
    loss_hessian = torch.func.hessian(lambda out: repeated.loss()(out, y))(output)
    H = loss_hessian.reshape(output.numel(), output.numel())
    for name, p in params.items():
        J = jacobians[name].reshape(output.numel(), p.numel())
        exact = (J.T @ H @ J).diagonal().reshape(p.shape)
        scale = exact.abs().max().item()
        torch.testing.assert_close(estimate[name], exact, atol=0.1 * scale, rtol=0)


def test_sampled_classes_follow_the_softmax() -> None:
    logits = torch.tensor([[[0.0, 0.0], [2.0, -30.0]]]).repeat(4000, 1, 1)  # [N, C=2, T=2]
    draws = peers.sample_classes(logits, torch.Generator().manual_seed(0))
    assert draws.shape == (4000, 2)
    frequency = draws.float().mean(0)  # P(class 1) = sigmoid(2) at T=0, sigmoid(-30) at T=1
    torch.testing.assert_close(frequency, torch.tensor([0.8808, 0.0]), atol=0.02, rtol=0)


def test_sizes_of_the_new_problems() -> None:
    assert sum(p.numel() for p in problems.small_resnet().parameters()) == 5266
    lm = TINY["LM"]()
    assert lm.model()(lm.X).shape == (2, 11, 4)  # [N, V, T]
    assert lm.kronecker is not None and not any("out_proj" in n for n in lm.kronecker)
    lstm = TINY["LSTM"]()
    assert lstm.parameter_names("batch_grad") == ("head.weight", "head.bias")


def test_cli_runs_a_tiny_problem(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setattr(run, "PROBLEMS", [TINY["LSTM"]])
    assert run.main(["--problems", "lstm", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "| LSTM | kfac (Linear/Conv2d) |" in out
    assert "MISMATCH" not in out


@pytest.mark.parametrize("module", [peers, problems, timing])
def test_doctests(module) -> None:
    assert doctest.testmod(module).failed == 0
