"""One DP-SGD step (clip each sample's gradient to C, add N(0, σ²C²), SGD update), per contender.

Each contender of each problem runs alone in a fresh process (allocator state and the
peak resident memory are its own): two warm-up steps, then ``--repeats`` timed steps;
``--processes`` such processes per contender, interleaved with the other contenders'
(one process's median moves by up to 30 % with its allocator and thread placement).
Time is the median over processes of each process's median step (the fastest and slowest
step of any beside it); memory is the peak resident set size during the steps minus the
resident set size after set-up (model, batch and contender built), i.e. what the steps
themselves add, and the process's peak, medians over processes.

Contenders: plain training (forward, backward, SGD: no privacy), packfunc's
``clipped_grad`` (no per-sample gradients), packfunc's ``batch_grad`` + ``clip_and_noise``,
a hand-written ``vmap(grad)`` + clipping, opacus 1.6 hooks (``GradSampleModule`` +
``DPOptimizer``), opacus ghost clipping (``GradSampleModuleFastGradientClipping``,
two backward passes) and "hooks by hand": the least a per-layer implementation does (a
forward hook per module, one backward to the modules' outputs, each layer's norm in its
cheaper closed form and its clipped sum in one product; ``nn.Linear``, ``nn.Embedding``,
``nn.LayerNorm`` and the LMs' learned position only). Contenders that refuse a model are
listed as refusing.

Opacus and the hooks by hand run ``nn.MultiheadAttention`` as opacus tells its users to:
replaced by opacus' ``DPMultiheadAttention`` (``ModuleValidator.fix``'s fixer for it, and
only it: its other fixes, such as BatchNorm to GroupNorm, change the model). In opacus
1.6.0 that replacement computes another function when ``batch_first=True`` (its output's
heads and positions are interleaved; opacus pull request 825), as in the LMs: the row says
by how much the output differs, and its time is the cost of the same amount of work.

Run: ``python benchmarks/dp_step.py [--problems LM,LM-N64,LM-d256,ResNet-GN,ResNet-BN,GPT-2,LLaMA]
[--large-lm]`` (``--large-lm`` adds the 55M LM and GPT-2 with its full vocabulary).
"""

from __future__ import annotations

import argparse
import copy
import json
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

import packfunc as pf  # noqa: E402
import problems  # noqa: E402

MAX_NORM, SIGMA, LR = 1.0, 1.0, 1e-3
CONTENDERS = (
    "plain",
    "packfunc",
    "packfunc batch_grad",
    "vmap(grad)",
    "opacus",
    "opacus ghost",
    "hooks by hand",
)
Step = Callable[[], None]
NOTES: dict[str, str] = {}
"""What a builder found worth a row's note (opacus' replacement changing the output)."""


def large_lm(n: int = 16) -> problems.Problem:
    """The 55M-parameter pre-norm LM of issue 22: 6 layers, d=768, T=128, vocabulary 8000."""
    torch.manual_seed(problems.SEED)
    model = problems.TokenLM(8000, 768, 128, heads=12, hidden=4 * 768, layers=6)
    X, y = torch.randint(0, 8000, (n, 128)), torch.randint(0, 8000, (n, 128))
    return problems.Problem("LM-55M", model, X, y)


def gpt2_vocabulary(n: int = 8) -> problems.Problem:
    """Hugging Face GPT-2 with its 50257-token vocabulary, tied to the head: 2 layers, d=768, T=128.

    The tied ``[50257, 768]`` matrix is most of the parameters: its per-sample gradients
    would be 154 MB a sample.
    """
    return problems.hugging_face("gpt2", n=n, length=128, width=768, layers=2, vocab=50257)


PROBLEMS: dict[str, Callable[[], problems.Problem]] = {
    "LM": problems.lm,
    # the LM with 4x the samples, and 4x as wide: where kernels outweigh per-call overhead
    "LM-N64": lambda: problems.lm(n=64),
    "LM-d256": lambda: problems.lm(width=256),
    "ResNet-GN": problems.resnet_gn,
    "ResNet-BN": problems.resnet_bn,
    "GPT-2": lambda: problems.hugging_face("gpt2"),
    "LLaMA": lambda: problems.hugging_face("llama"),
    "LM-55M": large_lm,
    "GPT-2-50k": gpt2_vocabulary,
}
LARGE = ("LM-55M", "GPT-2-50k")
"""The problems ``--large-lm`` adds: one process per contender, three steps."""


def _sgd(parameters: Sequence[Tensor], updates: Sequence[Tensor], scale: float = 1.0) -> None:
    """``p -= LR · scale · update`` for every parameter, in place."""
    with torch.no_grad():
        torch._foreach_add_(list(parameters), list(updates), alpha=-LR * scale)


def plain_step(model: nn.Module, X: Tensor, y: Tensor) -> Step:
    """Forward, backward, SGD on the summed loss divided by N: ordinary training."""
    loss = nn.CrossEntropyLoss(reduction="sum")
    parameters = [p for p in model.parameters() if p.requires_grad]

    def step() -> None:
        model.zero_grad(set_to_none=True)
        (loss(model(X), y) / len(X)).backward()
        _sgd(parameters, [p.grad for p in parameters])  # type: ignore[misc]

    return step


def packfunc_step(model: nn.Module, X: Tensor, y: Tensor) -> Step:
    """``pf.clipped_grad`` + ``add_noise``: no per-sample gradients."""
    loss = nn.CrossEntropyLoss(reduction="sum")
    model_fn, params = pf.functional(model)
    generator = torch.Generator().manual_seed(0)

    def step() -> None:
        clipped = pf.clipped_grad(model_fn, params, X, y, loss=loss, max_norm=MAX_NORM)
        noisy = pf.privacy.add_noise(clipped, MAX_NORM, SIGMA, generator=generator)
        _sgd(list(params.values()), [noisy[k] for k in params], 1 / len(X))

    return step


def packfunc_batch_grad_step(model: nn.Module, X: Tensor, y: Tensor) -> Step:
    """``pf.compute(batch_grad, batch_l2_grad)`` + ``clip_and_noise``: ``[N, *p]`` formed."""
    loss = nn.CrossEntropyLoss(reduction="sum")
    model_fn, params = pf.functional(model)
    generator = torch.Generator().manual_seed(0)

    def step() -> None:
        out = pf.compute(
            model_fn, params, X, y, loss=loss, quantities=("batch_grad", "batch_l2_grad")
        )
        noisy = pf.clip_and_noise(
            out["batch_grad"], MAX_NORM, SIGMA, batch_l2=out["batch_l2_grad"], generator=generator
        )
        _sgd(list(params.values()), [noisy[k] for k in params])

    return step


def vmap_step(model: nn.Module, X: Tensor, y: Tensor) -> Step:
    """Hand-written ``vmap(grad(per-sample loss))``, then ``clip_and_noise``."""
    loss = nn.CrossEntropyLoss(reduction="sum")
    params = {k: p.detach() for k, p in model.named_parameters()}
    generator = torch.Generator().manual_seed(0)

    def sample_loss(p: dict[str, Tensor], x: Tensor, t: Tensor) -> Tensor:
        out = torch.func.functional_call(model, p, (x.unsqueeze(0),))
        value: Tensor = loss(out, t.unsqueeze(0))
        return value

    per_sample = torch.func.vmap(torch.func.grad(sample_loss), in_dims=(None, 0, 0))

    def step() -> None:
        grads = per_sample(params, X, y)
        noisy = pf.clip_and_noise(grads, MAX_NORM, SIGMA, generator=generator)
        _sgd(list(params.values()), [noisy[k] for k in params])

    return step


def with_opacus_attention(model: nn.Module, X: Tensor, contender: str) -> nn.Module:
    """A copy of ``model`` whose ``nn.MultiheadAttention`` modules are opacus' replacement.

    Where the replacement changes the output, :data:`NOTES` says by how much.

    Args:
        model: Any model.
        X: A batch, to compare the outputs on.
        contender: The contender the note is for.

    Returns:
        ``model`` itself if it has no attention, else the copy.
    """
    from opacus.validators.multihead_attention import fix

    if not any(isinstance(m, nn.MultiheadAttention) for m in model.modules()):
        return model
    fixed = copy.deepcopy(model)
    for parent in list(fixed.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.MultiheadAttention):
                setattr(parent, name, fix(child))
    with torch.no_grad():
        change = (fixed(X) - model(X)).abs().max().item()
    if change > 1e-4:
        NOTES[contender] = f"output differs by up to {change:.2f}"
    return fixed


def opacus_step(model: nn.Module, X: Tensor, y: Tensor) -> Step:
    """Opacus' ``GradSampleModule`` + ``DPOptimizer``: per-sample gradients by hooks."""
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    model = with_opacus_attention(model, X, "opacus")

    wrapped = GradSampleModule(model, loss_reduction="sum")
    sgd = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    optimizer = DPOptimizer(
        sgd,
        noise_multiplier=SIGMA,
        max_grad_norm=MAX_NORM,
        expected_batch_size=len(X),
        loss_reduction="sum",
    )
    loss = nn.CrossEntropyLoss(reduction="sum")

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss(wrapped(X), y).backward()
        optimizer.step()

    return step


def opacus_ghost_step(model: nn.Module, X: Tensor, y: Tensor) -> Step:
    """Opacus ghost clipping: norms in a first backward, the clipped sum in a second."""
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    model = with_opacus_attention(model, X, "opacus ghost")
    wrapped = GradSampleModuleFastGradientClipping(
        model, loss_reduction="sum", max_grad_norm=MAX_NORM
    )
    sgd = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    optimizer = DPOptimizerFastGradientClipping(
        sgd,
        noise_multiplier=SIGMA,
        max_grad_norm=MAX_NORM,
        expected_batch_size=len(X),
        loss_reduction="sum",
    )
    criterion = DPLossFastGradientClipping(
        wrapped, optimizer, nn.CrossEntropyLoss(reduction="sum"), loss_reduction="sum"
    )

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        out = wrapped(X)
        if y.dim() == 1:
            criterion(out, y).backward()
        else:  # a sequence ([N, V, T] logits): opacus wants [N·T, V] rows and their shape
            rows = out.transpose(1, 2).reshape(-1, out.shape[1])
            criterion(rows, y.reshape(-1), shape=(*y.shape, out.shape[1])).backward()
        optimizer.step()

    return step


HAND_MODULES = (nn.Linear, nn.Embedding, nn.LayerNorm, problems.LearnedPosition)
"""What the hooks by hand handle: any other module with parameters is refused."""


def hand_hooks_step(model: nn.Module, X: Tensor, y: Tensor) -> Step:
    """:func:`clipped_grad_by_hand`, then packfunc's step's noise and update."""
    model = with_opacus_attention(model, X, "hooks by hand")
    clipped_grad = clipped_grad_by_hand(model, MAX_NORM)
    parameters = dict(model.named_parameters())
    generator = torch.Generator().manual_seed(0)

    def step() -> None:
        noisy = pf.privacy.add_noise(clipped_grad(X, y), MAX_NORM, SIGMA, generator=generator)
        _sgd(list(parameters.values()), [noisy[k] for k in parameters], 1 / len(X))

    return step


def clipped_grad_by_hand(model: nn.Module, max_norm: float) -> Callable[..., dict[str, Tensor]]:
    """The least per-layer work for the clipped sum: hooks, one backward, closed forms by hand.

    Each layer's input and output are kept by a forward hook; one ``autograd.grad`` gives
    every output's cotangent; the squared norms are summed over layers, each in the
    cheaper of its Gram form and its materialized gradient; the clipped sum is one product
    per parameter. Inputs have the sample first; each layer is called once.

    Args:
        model: A model whose parameters all belong to :data:`HAND_MODULES` (hooks are added).
        max_norm: The clipping bound.

    Returns:
        ``clipped_grad(X, y)``: ``{name: Σ_n g_n · min(1, C / ‖g_n‖)}`` of the summed
        cross-entropy.

    Raises:
        TypeError: For a parameter outside :data:`HAND_MODULES`, or a shared one.
    """
    layers = [
        m
        for m in model.modules()
        if isinstance(m, HAND_MODULES) and any(True for _ in m.parameters(recurse=False))
    ]
    owned = [id(p) for m in layers for p in m.parameters(recurse=False)]
    if len(set(owned)) != len(owned) or len(owned) != len(list(model.parameters())):
        raise TypeError("hooks by hand: a parameter outside Linear/Embedding/LayerNorm, or tied")
    loss = nn.CrossEntropyLoss(reduction="sum")
    parameters = dict(model.named_parameters())
    seen: list[tuple[nn.Module, Tensor, Tensor]] = []
    for layer in layers:
        layer.register_forward_hook(lambda m, a, out: seen.append((m, a[0], out)))

    def clipped_grad(X: Tensor, y: Tensor) -> dict[str, Tensor]:
        seen.clear()
        value = loss(model(X), y)
        if len({id(m) for m, _, _ in seen}) != len(seen):
            raise TypeError("hooks by hand: a layer called twice in one forward")
        cotangents = torch.autograd.grad(value, [out for _, _, out in seen])
        with torch.no_grad():
            # a norm layer's input is replaced by its per-sample gradients, formed once
            records = [
                (m, _hand_norm_gradients(m, a, g) if isinstance(m, nn.LayerNorm) else a, g)
                for (m, a, _), g in zip(seen, cotangents)
            ]
            squares = torch.stack([_hand_squared_norms(m, a, g) for m, a, g in records]).sum(0)
            factors = (max_norm / (squares.sqrt() + 1e-6)).clamp(max=1.0)
            sums = {
                id(p): s for m, a, g in records for p, s in _hand_clipped_sums(m, a, g, factors)
            }
        seen.clear()
        return {k: sums[id(p)] for k, p in parameters.items()}

    return clipped_grad


def _rows(a: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """Input and cotangent as ``[N, L, ·]``: a sample's positions in rows."""
    return a.reshape(len(a), -1, a.shape[-1]), g.reshape(len(g), -1, g.shape[-1])


def _hand_squared_norms(m: nn.Module, a: Any, g: Tensor) -> Tensor:
    """``[N]``: the squared norm of each sample's gradient of ``m``'s parameters.

    ``a`` is the layer's input, or a norm layer's per-sample gradients.
    """
    if isinstance(m, problems.LearnedPosition):
        return g.square().sum((1, 2))
    if isinstance(m, nn.Embedding):  # Σ_{t,s} [token_t = token_s] g_t·g_s
        ids, rows = a.reshape(len(a), -1), g.reshape(len(g), -1, g.shape[-1])
        same = (ids[:, :, None] == ids[:, None, :]).to(g.dtype)
        found: Tensor = (same * (rows @ rows.transpose(1, 2))).sum((1, 2))
        return found
    if isinstance(m, nn.LayerNorm):  # a: its per-sample gradients
        weight, bias = cast(tuple[Tensor, Tensor], a)
        squares = weight.square().sum(1)
        return squares + bias.square().sum(1) if m.bias is not None else squares
    assert isinstance(m, nn.Linear)
    x, d = _rows(a, g)
    length, n_in, n_out = x.shape[1], x.shape[2], d.shape[2]
    if length * length < n_in * n_out:  # the Gram form is cheaper
        weight = ((x @ x.transpose(1, 2)) * (d @ d.transpose(1, 2))).sum((1, 2))
    else:
        weight = (d.transpose(1, 2) @ x).square().sum((1, 2))
    return weight + d.sum(1).square().sum(1) if m.bias is not None else weight


def _hand_norm_gradients(m: nn.LayerNorm, a: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """A LayerNorm's per-sample affine gradients ``[N, D]`` (weight, bias)."""
    normalized = nn.functional.layer_norm(a, m.normalized_shape, eps=m.eps)
    x, d = _rows(normalized, g)
    return (x * d).sum(1), d.sum(1)


def _hand_clipped_sums(
    m: nn.Module, a: Any, g: Tensor, factors: Tensor
) -> list[tuple[Tensor, Tensor]]:
    """``(parameter, Σ_n c_n g_n)`` for each of ``m``'s parameters.

    ``a`` is as in :func:`_hand_squared_norms`.
    """
    found: list[tuple[Tensor, Tensor]]
    if isinstance(m, problems.LearnedPosition):
        return [(m.weight, torch.einsum("n,n...->...", factors, g))]
    if isinstance(m, nn.LayerNorm):  # a: its per-sample gradients
        weight, bias = a
        found = [(m.weight, factors @ weight)]
        return found + ([(m.bias, factors @ bias)] if m.bias is not None else [])
    scaled = g * factors.view(-1, *[1] * (g.dim() - 1))
    if isinstance(m, nn.Embedding):
        rows = scaled.reshape(-1, scaled.shape[-1])
        return [(m.weight, torch.zeros_like(m.weight).index_add_(0, a.reshape(-1), rows))]
    assert isinstance(m, nn.Linear)
    x, d = _rows(a, scaled)
    found = [(m.weight, d.flatten(0, 1).T @ x.flatten(0, 1))]
    return found + ([(m.bias, d.sum((0, 1)))] if m.bias is not None else [])


BUILDERS: dict[str, Callable[[nn.Module, Tensor, Tensor], Step]] = {
    "plain": plain_step,
    "packfunc": packfunc_step,
    "packfunc batch_grad": packfunc_batch_grad_step,
    "vmap(grad)": vmap_step,
    "opacus": opacus_step,
    "opacus ghost": opacus_ghost_step,
    "hooks by hand": hand_hooks_step,
}


def measure(problem_name: str, contender: str, repeats: int) -> dict[str, object]:
    """Time one contender's step in this process; the peak memory the steps add.

    Args:
        problem_name: A key of :data:`PROBLEMS`.
        contender: A key of :data:`BUILDERS`.
        repeats: Timed steps.

    Returns:
        ``{"median", "min", "max"}`` in seconds, ``"peak_mb"`` (added by the steps) and
        ``"peak_total_mb"`` (the process's peak resident set size), and ``"note"`` where
        :data:`NOTES` has one; or ``{"refused": why}``.
    """
    torch.set_num_threads(2)
    problem = PROBLEMS[problem_name]()
    model, X, y = problem.model(), problem.X, problem.y
    try:
        step = BUILDERS[contender](model, X, y)
        before = _rss_mb()
        step()
        step()
    except Exception as error:  # noqa: BLE001 - a refusal is a result here
        return {"refused": f"{type(error).__name__}: {str(error).splitlines()[0][:90]}"}
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    note: dict[str, object] = {"note": NOTES[contender]} if contender in NOTES else {}
    return {
        "median": statistics.median(times),
        "min": min(times),
        "max": max(times),
        "peak_mb": peak - before,
        "peak_total_mb": peak,
    } | note


def _rss_mb() -> float:
    """The current resident set size of this process, in MB."""
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[1])
    return pages * resource.getpagesize() / 2**20


def main() -> None:
    """Run every contender of every problem in a fresh process; print a markdown table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", default="LM,LM-N64,LM-d256,ResNet-GN,ResNet-BN,GPT-2,LLaMA")
    parser.add_argument(
        "--large-lm", action="store_true", help="add the 55M LM and GPT-2's vocabulary (slow)"
    )
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--processes", type=int, default=3, help="fresh processes per contender (interleaved)"
    )
    parser.add_argument("--one", nargs=2, metavar=("PROBLEM", "CONTENDER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one[0], args.one[1], args.repeats)))
        return
    names = args.problems.split(",") + (list(LARGE) if args.large_lm else [])
    print(
        "| problem | contender | step ms (min–max) | × plain | peak MB added | × plain "
        "| peak RSS MB | × plain |"
    )
    print("|---|---|--:|--:|--:|--:|--:|--:|")
    for name in names:
        repeats = 3 if name in LARGE else args.repeats
        runs: dict[str, list[dict[str, object]]] = {c: [] for c in CONTENDERS}
        for _ in range(1 if name in LARGE else args.processes):
            for contender in CONTENDERS:  # interleaved: a slow spell hits every contender
                if not any("refused" in run for run in runs[contender]):
                    runs[contender].append(_fresh(name, contender, repeats))
        rows = {c: combined(found) for c, found in runs.items()}
        plain = rows["plain"]
        for contender, row in rows.items():
            print(_row(name, contender, row, plain))


def combined(runs: list[dict[str, object]]) -> dict[str, object]:
    """One contender's fresh processes as one row: medians of their medians and peaks.

    Args:
        runs: :func:`measure`'s results, one per process.

    Returns:
        The median step and peaks over the processes, the fastest and slowest step of any,
        or the first refusal.

    Example:
        >>> row = {"median": 1.0, "min": 0.9, "max": 1.2, "peak_mb": 5.0, "peak_total_mb": 9.0}
        >>> combined([row, row | {"median": 3.0, "max": 4.0}])["median"]
        2.0
    """
    refused = [run for run in runs if "refused" in run]
    if refused:
        return refused[0]
    value = {key: [float(str(run[key])) for run in runs] for key in runs[0] if key != "note"}
    middle = {key: statistics.median(values) for key, values in value.items()}
    note = {"note": runs[0]["note"]} if "note" in runs[0] else {}
    return middle | {"min": min(value["min"]), "max": max(value["max"])} | note


def _fresh(problem_name: str, contender: str, repeats: int) -> dict[str, object]:
    """``measure`` in a fresh interpreter."""
    command = [
        sys.executable,
        __file__,
        "--one",
        problem_name,
        contender,
        "--repeats",
        str(repeats),
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"refused": f"crashed: {done.stderr.strip().splitlines()[-1][:90]}"}
    result: dict[str, object] = json.loads(lines[-1])
    return result


def _row(name: str, contender: str, row: dict[str, object], plain: dict[str, object]) -> str:
    """One markdown row."""
    if "refused" in row:
        return f"| {name} | {contender} | refuses ({row['refused']}) | — | — | — | — | — |"
    keys = ("median", "min", "max", "peak_mb", "peak_total_mb")
    value = {key: float(str(row[key])) for key in keys}
    base = {key: float(str(plain.get(key, "nan"))) for key in keys}
    ms = f"{1000 * value['median']:.1f} ({1000 * value['min']:.1f}–{1000 * value['max']:.1f})"
    if "note" in row:
        contender = f"{contender} ({row['note']})"
    return (
        f"| {name} | {contender} | {ms} | {value['median'] / base['median']:.2f}× | "
        f"{value['peak_mb']:.0f} | {value['peak_mb'] / max(base['peak_mb'], 1.0):.2f}× | "
        f"{value['peak_total_mb']:.0f} | {value['peak_total_mb'] / base['peak_total_mb']:.2f}× |"
    )


if __name__ == "__main__":
    main()
