"""DP-SGD on scikit-learn's bundled digits with packfunc's per-sample gradients.

Trains a 64-128-10 tanh MLP on the 8x8 digits that ship with scikit-learn (no download).
Each step makes one packfunc.compute call for the per-sample gradients and their squared
norms; packfunc.clip_and_noise then clips every sample's gradient to norm C, sums, adds
Gaussian noise of standard deviation sigma * C and divides by the batch size, and a plain
SGD step returns fresh parameters (the model itself is never changed).

Needs scikit-learn: pip install -e ".[demo]"
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor, nn

import packfunc as pf
from packfunc.types import ModelFn

Params = dict[str, Tensor]


@dataclass(frozen=True)
class Config:
    """DP-SGD hyper-parameters.

    Attributes:
        epochs: Passes over the training set.
        batch_size: Samples per step.
        lr: SGD learning rate.
        clip: Per-sample gradient norm bound C.
        noise: Noise multiplier sigma; the summed gradient gets N(0, (sigma * C)^2) noise.
        seed: Seed of the split, the initialization, the shuffling and the noise.
    """

    epochs: int = 20
    batch_size: int = 64
    lr: float = 0.1
    clip: float = 1.0
    noise: float = 1.0
    seed: int = 0


class Split(NamedTuple):
    """Standardized train and test tensors."""

    X_train: Tensor
    y_train: Tensor
    X_test: Tensor
    y_test: Tensor


def load_digits_split(seed: int, test_fraction: float = 0.25) -> Split:
    """Load the digits, split them (stratified) and standardize with the training statistics.

    Args:
        seed: Random state of the split.
        test_fraction: Share of the 1797 samples held out for testing.

    Returns:
        float32 features [n, 64] and int64 labels [n] for both parts.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    X, y = load_digits(return_X_y=True)
    X_tr, X_te, y_tr, y_te = train_test_split(
        X, y, test_size=test_fraction, random_state=seed, stratify=y
    )
    scaler = StandardScaler().fit(X_tr)
    return Split(
        torch.as_tensor(scaler.transform(X_tr), dtype=torch.float32),
        torch.as_tensor(y_tr, dtype=torch.long),
        torch.as_tensor(scaler.transform(X_te), dtype=torch.float32),
        torch.as_tensor(y_te, dtype=torch.long),
    )


def dp_sgd_step(
    model_fn: ModelFn,
    params: Params,
    X: Tensor,
    y: Tensor,
    config: Config,
    generator: torch.Generator,
) -> tuple[Params, float]:
    """One DP-SGD step on a batch.

    Args:
        model_fn: model_fn(params, X) -> logits.
        params: Current parameters.
        X: [N, 64] batch.
        y: [N] labels.
        config: Clipping bound, noise multiplier and learning rate.
        generator: Source of the noise.

    Returns:
        The new parameters and the batch's summed (unclipped, noise-free) loss.
    """
    out = pf.compute(
        model_fn,
        params,
        X,
        y,
        loss=nn.CrossEntropyLoss(reduction="sum"),  # batch_grad[n]: sample n's own gradient
        quantities=("batch_grad", "batch_l2_grad"),
    )
    grad = pf.clip_and_noise(
        out["batch_grad"],
        config.clip,
        config.noise,
        batch_l2=out["batch_l2_grad"],
        generator=generator,
    )
    return {name: p - config.lr * grad[name] for name, p in params.items()}, float(out["loss"])


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


def parse_args(argv: Sequence[str] | None = None) -> Config:
    """Parse command-line options (default: sys.argv[1:]) into a Config."""
    default = Config()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--epochs", type=_positive_int, default=default.epochs, help="passes over the data"
    )
    parser.add_argument(
        "--batch-size", type=_positive_int, default=default.batch_size, help="samples per step"
    )
    parser.add_argument("--lr", type=float, default=default.lr, help="SGD learning rate")
    parser.add_argument(
        "--clip", type=float, default=default.clip, help="per-sample gradient norm bound C"
    )
    parser.add_argument(
        "--noise",
        type=float,
        default=default.noise,
        help="noise multiplier sigma (noise std is sigma * C)",
    )
    parser.add_argument("--seed", type=int, default=default.seed, help="random seed")
    args = parser.parse_args(argv)
    return Config(
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        clip=args.clip,
        noise=args.noise,
        seed=args.seed,
    )


def main(argv: Sequence[str] | None = None) -> dict[str, float | list[float]]:
    """Train with DP-SGD, printing one line per epoch and a summary.

    Args:
        argv: Command-line arguments (default: sys.argv[1:]).

    Returns:
        "train_loss" (mean loss per sample in the last epoch), "test_accuracy", "losses"
        and "accuracies" (one per epoch) and "seconds" (total training time).
    """
    config = parse_args(argv)
    data = load_digits_split(config.seed)
    torch.manual_seed(config.seed)
    model_fn, params = pf.functional(
        nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 10))
    )
    shuffle = torch.Generator().manual_seed(config.seed)
    noise = torch.Generator().manual_seed(config.seed + 1)
    n = data.X_train.shape[0]
    print(
        f"DP-SGD on digits: {n} train / {data.X_test.shape[0]} test, batch {config.batch_size},"
        f" lr {config.lr}, C {config.clip}, sigma {config.noise}"
    )
    losses: list[float] = []
    accuracies: list[float] = []
    start = time.perf_counter()
    for epoch in range(1, config.epochs + 1):
        tic = time.perf_counter()
        total = 0.0
        for index in torch.randperm(n, generator=shuffle).split(config.batch_size):
            params, loss = dp_sgd_step(
                model_fn, params, data.X_train[index], data.y_train[index], config, noise
            )
            total += loss
        losses.append(total / n)
        accuracies.append(accuracy(model_fn, params, data.X_test, data.y_test))
        print(
            f"epoch {epoch:3d}  train loss {losses[-1]:.4f}  test acc {accuracies[-1]:.4f}"
            f"  {time.perf_counter() - tic:.2f} s/epoch"
        )
    seconds = time.perf_counter() - start
    print(
        f"done: {config.epochs} epochs in {seconds:.2f} s, final test accuracy {accuracies[-1]:.4f}"
    )
    return {
        "train_loss": losses[-1],
        "test_accuracy": accuracies[-1],
        "losses": losses,
        "accuracies": accuracies,
        "seconds": seconds,
    }


if __name__ == "__main__":
    main()
