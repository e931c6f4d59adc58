"""DP-SGD training of a small Hugging Face vision transformer on scikit-learn's digits.

Builds a tiny ViT (transformers.ViTForImageClassification from a config: random
initialization, nothing is downloaded) for the 8x8 digits that ship with scikit-learn,
seen as 1x8x8 images in [0, 1], and trains it with DP-SGD:

- Poisson sampling (packfunc.privacy.PoissonBatches): each step includes every training
  example independently with probability q (expected batch --batch-size); a batch may
  be empty, and then the step is the noise alone;
- packfunc.clipped_grad: the sum of the per-sample gradients, each clipped to norm C,
  from one forward and one backward (no per-sample gradients are materialized);
- packfunc.privacy.add_noise: Gaussian noise of standard deviation sigma * C, then a
  division by the expected batch size q * n and an Adam step on the parameter dict
  (pure functions: the module's own parameters are never changed).

The noise multiplier sigma is chosen with packfunc.privacy.noise_multiplier so that the
planned steps spend the target --epsilon at delta = 1e-5 (opacus' RDP accountant), and
packfunc.privacy.epsilon reports what the run spent. The same model is then trained
without privacy (same initialization, same batches and steps, plain torch.func.grad) for
comparison: the script prints both test accuracies, the median step times and their ratio.

Run it (needs scikit-learn, transformers and opacus):

    python examples/dp_transformer_digits.py               # full run, epsilon = 8
    python examples/dp_transformer_digits.py --epsilon 3 --epochs 20 --seed 1
    python examples/dp_transformer_digits.py --quick       # a few steps, a smoke test
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import torch
from torch import Tensor, nn

import packfunc as pf
from packfunc.types import ModelFn

Params = dict[str, Tensor]
GradFn = Callable[[Params, Tensor, Tensor], Params]
"""``grad_fn(params, X, y)``: the update direction for one (possibly empty) batch."""

DELTA = 1e-5
QUICK_STEPS = 6


@dataclass(frozen=True)
class Config:
    """Training and privacy settings.

    Attributes:
        epsilon: Target privacy budget at ``delta``.
        delta: The delta of (epsilon, delta)-DP.
        epochs: Planned passes over the data (``round(1 / q)`` steps each).
        batch_size: Expected batch size ``q * n``.
        clip: Per-sample gradient norm bound C.
        lr: Adam learning rate.
        seed: Seed of the split, the initialization, the sampling and the noise.
        quick: Run only a few steps (a smoke test).
        threads: CPU threads for torch (the model is tiny: one thread is as fast as more,
            and its timings stay stable when other processes share the cores).
    """

    epsilon: float = 8.0
    delta: float = DELTA
    epochs: int = 30
    batch_size: int = 64
    clip: float = 1.0
    lr: float = 1e-2
    seed: int = 0
    quick: bool = False
    threads: int = 1


class Split(NamedTuple):
    """Digits as images ``[n, 1, 8, 8]`` in [0, 1] and labels, for training and testing."""

    X_train: Tensor
    y_train: Tensor
    X_test: Tensor
    y_test: Tensor


def load_digits_images(seed: int, test_fraction: float = 0.25) -> Split:
    """Load the digits as 1x8x8 float32 images scaled to [0, 1] and split them (stratified).

    Args:
        seed: Random state of the split.
        test_fraction: Share of the 1797 samples held out for testing.

    Returns:
        The train and test images and int64 labels.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    X, y = load_digits(return_X_y=True)  # pixel values 0..16
    X_tr, X_te, y_tr, y_te = train_test_split(
        X, y, test_size=test_fraction, random_state=seed, stratify=y
    )
    images = [
        torch.as_tensor(a / 16.0, dtype=torch.float32).view(-1, 1, 8, 8) for a in (X_tr, X_te)
    ]
    labels = [torch.as_tensor(a, dtype=torch.long) for a in (y_tr, y_te)]
    return Split(images[0], labels[0], images[1], labels[1])


class Logits(nn.Module):
    """A Hugging Face image classifier whose forward returns the logits tensor.

    Hugging Face models return a ``ModelOutput``; packfunc's model functions return the
    tensor the loss is applied to.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, pixel_values: Tensor) -> Tensor:
        """Logits ``[N, num_labels]`` of images ``[N, C, H, W]``."""
        return cast(Tensor, self.model(pixel_values=pixel_values).logits)


def build_vit(seed: int) -> nn.Module:
    """A randomly initialized two-layer ViT for 1x8x8 images and 10 classes (no download).

    Args:
        seed: Seed of the initialization.

    Returns:
        The model, returning logits ``[N, 10]``, in eval mode (it has no dropout anyway).
    """
    from transformers import ViTConfig, ViTForImageClassification

    settings: dict[str, Any] = {
        "image_size": 8,
        "patch_size": 2,
        "num_channels": 1,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 64,
        "num_labels": 10,
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
    }
    config = ViTConfig(**settings)
    torch.manual_seed(seed)
    return Logits(ViTForImageClassification(config)).eval()


class AdamState(NamedTuple):
    """Adam's moment estimates and step count."""

    first: Params
    second: Params
    step: int


def adam_init(params: Params) -> AdamState:
    """Zero moments for ``params``."""
    zeros = {name: torch.zeros_like(p) for name, p in params.items()}
    return AdamState(zeros, dict(zeros), 0)


def adam_update(
    params: Params,
    grad: Params,
    state: AdamState,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
) -> tuple[Params, AdamState]:
    """One Adam step, returning new parameters and state (nothing is changed in place).

    Args:
        params: Current parameters.
        grad: The update direction (a gradient estimate) for every parameter.
        state: Adam's state before the step.
        lr: Learning rate.
        betas: Decay rates of the first and second moments.
        eps: Term added to the root of the second moment.

    Returns:
        ``(new_params, new_state)``.
    """
    b1, b2 = betas
    step = state.step + 1
    first = {k: b1 * state.first[k] + (1 - b1) * g for k, g in grad.items()}
    second = {k: b2 * state.second[k] + (1 - b2) * g.square() for k, g in grad.items()}
    scale = lr * math.sqrt(1 - b2**step) / (1 - b1**step)
    new = {k: p - scale * first[k] / (second[k].sqrt() + eps) for k, p in params.items()}
    return new, AdamState(first, second, step)


def private_grad_fn(
    model_fn: ModelFn,
    config: Config,
    sigma: float,
    expected_batch: float,
    generator: torch.Generator,
) -> GradFn:
    """DP-SGD's direction: (clipped sum + N(0, sigma^2 C^2)) / (q * n).

    Args:
        model_fn: ``model_fn(params, X) -> logits``.
        config: Supplies the clipping bound C.
        sigma: Noise multiplier.
        expected_batch: ``q * n``, the divisor (the same for every batch, empty or not).
        generator: Source of the noise.

    Returns:
        ``grad_fn(params, X, y)``; an empty batch gives the noise alone.
    """
    loss = nn.CrossEntropyLoss(reduction="sum")  # each sample's own loss

    def grad_fn(params: Params, X: Tensor, y: Tensor) -> Params:
        if len(y) == 0:  # Poisson sampling drew nobody: the clipped sum is zero
            clipped = {name: torch.zeros_like(p) for name, p in params.items()}
        else:
            clipped = pf.clipped_grad(model_fn, params, X, y, max_norm=config.clip, loss=loss)
        noisy = pf.privacy.add_noise(clipped, config.clip, sigma, generator=generator)
        return {name: g / expected_batch for name, g in noisy.items()}

    return grad_fn


def plain_grad_fn(model_fn: ModelFn, expected_batch: float) -> GradFn:
    """The non-private direction: the gradient of the summed loss over ``q * n``.

    Args:
        model_fn: ``model_fn(params, X) -> logits``.
        expected_batch: ``q * n``, the same divisor as the private run's.

    Returns:
        ``grad_fn(params, X, y)``; an empty batch gives zeros.
    """
    loss = nn.CrossEntropyLoss(reduction="sum")
    grad = torch.func.grad(lambda p, X, y: loss(model_fn(p, X), y) / expected_batch)

    def grad_fn(params: Params, X: Tensor, y: Tensor) -> Params:
        if len(y) == 0:
            return {name: torch.zeros_like(p) for name, p in params.items()}
        return cast(Params, grad(params, X, y))

    return grad_fn


def train(
    params: Params,
    grad_fn: GradFn,
    data: Split,
    batches: pf.privacy.PoissonBatches,
    lr: float,
) -> tuple[Params, list[float]]:
    """Run one Adam step per Poisson batch.

    Args:
        params: Initial parameters (not changed).
        grad_fn: The update direction of a batch.
        data: Training images and labels.
        batches: Index tensors, one per step.
        lr: Adam learning rate.

    Returns:
        The trained parameters and every step's wall time in seconds.
    """
    state = adam_init(params)
    times: list[float] = []
    for index in batches:
        tic = time.perf_counter()
        grad = grad_fn(params, data.X_train[index], data.y_train[index])
        params, state = adam_update(params, grad, state, lr)
        times.append(time.perf_counter() - tic)
    return params, times


@torch.no_grad()
def accuracy(model_fn: ModelFn, params: Params, X: Tensor, y: Tensor) -> float:
    """Share of samples whose largest logit is the label."""
    return (model_fn(params, X).argmax(1) == y).float().mean().item()


def _positive_int(text: str) -> int:
    """Parse a strictly positive integer for argparse."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def _positive_float(text: str) -> float:
    """Parse a strictly positive float for argparse."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return value


def parse_args(argv: Sequence[str] | None = None) -> Config:
    """Parse command-line options (default: sys.argv[1:]) into a Config."""
    default = Config()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--epsilon",
        type=_positive_float,
        default=default.epsilon,
        help=f"target privacy budget at delta = {DELTA:g}",
    )
    parser.add_argument(
        "--epochs", type=_positive_int, default=default.epochs, help="planned passes over the data"
    )
    parser.add_argument(
        "--batch-size",
        type=_positive_int,
        default=default.batch_size,
        help="expected batch size q * n",
    )
    parser.add_argument("--lr", type=_positive_float, default=default.lr, help="Adam step size")
    parser.add_argument(
        "--clip", type=_positive_float, default=default.clip, help="per-sample norm bound C"
    )
    parser.add_argument("--seed", type=int, default=default.seed, help="random seed")
    parser.add_argument(
        "--quick", action="store_true", help=f"only {QUICK_STEPS} steps (a smoke test)"
    )
    parser.add_argument(
        "--threads", type=_positive_int, default=default.threads, help="CPU threads for torch"
    )
    args = parser.parse_args(argv)
    return Config(
        epsilon=args.epsilon,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        clip=args.clip,
        seed=args.seed,
        quick=args.quick,
        threads=args.threads,
    )


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    """Train the ViT with DP-SGD and without privacy, printing the comparison.

    Args:
        argv: Command-line arguments (default: sys.argv[1:]).

    Returns:
        "epsilon" (spent), "sigma", "steps", "private_accuracy", "private_step_s",
        "plain_accuracy", "plain_step_s" (median step times) and "step_time_ratio".
    """
    config = parse_args(argv)
    torch.set_num_threads(config.threads)
    data = load_digits_images(config.seed)
    n = len(data.y_train)
    q = min(1.0, config.batch_size / n)
    steps = QUICK_STEPS if config.quick else config.epochs * max(1, round(1 / q))
    sigma = pf.privacy.noise_multiplier(
        epsilon=config.epsilon, delta=config.delta, sample_rate=q, steps=steps
    )
    model_fn, params = pf.functional(build_vit(config.seed))
    init = {name: p.detach().clone() for name, p in params.items()}
    print(
        f"DP-SGD on digits with a ViT ({sum(p.numel() for p in init.values()):,} parameters):"
        f" {n} train / {len(data.y_test)} test, expected batch {q * n:.0f} (q = {q:.4f}),"
        f" {steps} steps, C = {config.clip:g}, sigma = {sigma:.3f}"
        f" for epsilon = {config.epsilon:g} at delta = {config.delta:g}"
    )

    def batches() -> pf.privacy.PoissonBatches:  # the same draws for both runs
        generator = torch.Generator().manual_seed(config.seed)
        return pf.privacy.PoissonBatches(n, q, steps=steps, generator=generator)

    noise = torch.Generator().manual_seed(config.seed + 1)
    private = private_grad_fn(model_fn, config, sigma, q * n, noise)
    dp_params, dp_times = train(init, private, data, batches(), config.lr)
    spent = pf.privacy.epsilon(
        noise_multiplier=sigma, sample_rate=q, steps=steps, delta=config.delta
    )
    plain_params, plain_times = train(
        init, plain_grad_fn(model_fn, q * n), data, batches(), config.lr
    )

    metrics = {
        "epsilon": spent,
        "sigma": sigma,
        "steps": float(steps),
        "private_accuracy": accuracy(model_fn, dp_params, data.X_test, data.y_test),
        "private_step_s": statistics.median(dp_times),
        "plain_accuracy": accuracy(model_fn, plain_params, data.X_test, data.y_test),
        "plain_step_s": statistics.median(plain_times),
    }
    metrics["step_time_ratio"] = metrics["private_step_s"] / metrics["plain_step_s"]
    print(f"epsilon spent: {spent:.3f} (delta = {config.delta:g}, RDP accountant)")
    print(f"private test accuracy: {metrics['private_accuracy']:.4f}")
    print(f"private median step: {1e3 * metrics['private_step_s']:.2f} ms")
    print(f"non-private test accuracy: {metrics['plain_accuracy']:.4f}")
    print(f"non-private median step: {1e3 * metrics['plain_step_s']:.2f} ms")
    print(f"step time ratio (private / non-private): {metrics['step_time_ratio']:.2f}")
    return metrics


if __name__ == "__main__":
    main()
