"""KFAC vs SGD vs Adam on scikit-learn's bundled digits, with packfunc's curvature optimizers.

Trains the DP-SGD demo's 64-128-10 tanh MLP and a small CNN (the 8x8 digits as images)
for the same number of steps with each optimizer and prints the final training loss
(mean over the last 10 steps), the test accuracy and the time per step. KFAC and EKFAC
are pf.optim.KFAC / pf.optim.EKFAC: loss.backward() as usual, then opt.step(batch=(X, y)),
which refreshes the Kronecker factors on the batch every step (moving average) and their
damped inverse every --inverse-period steps.

Needs scikit-learn: pip install -e ".[demo]"
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

import packfunc as pf

OPTIMIZERS = ("sgd", "adam", "kfac", "ekfac")


def load_digits_split(seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Standardized float32 digits ``[n, 64]`` and labels, split 75/25 (stratified).

    Args:
        seed: Random state of the split.

    Returns:
        ``(X_train, y_train, X_test, y_test)``.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    X, y = load_digits(return_X_y=True)
    X_tr, X_te, y_tr, y_te = train_test_split(X, y, test_size=0.25, random_state=seed, stratify=y)
    scaler = StandardScaler().fit(X_tr)
    as_x = lambda a: torch.as_tensor(scaler.transform(a), dtype=torch.float32)  # noqa: E731
    as_y = lambda a: torch.as_tensor(a, dtype=torch.long)  # noqa: E731
    return as_x(X_tr), as_y(y_tr), as_x(X_te), as_y(y_te)


def mlp() -> nn.Module:
    """The DP-SGD demo's MLP: 64-128-10 with tanh."""
    return nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 10))


def cnn() -> nn.Module:
    """A small CNN on the digits as 1x8x8 images."""
    return nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)),
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * 4 * 4, 10),
    )


def make_optimizer(name: str, model: nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    """The optimizer ``name`` (one of OPTIMIZERS) for ``model`` with the command line's settings."""
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=args.sgd_lr, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=args.adam_lr)
    curvature = pf.optim.KFAC if name == "kfac" else pf.optim.EKFAC
    return curvature(
        model,
        lr=args.kfac_lr,
        damping=args.damping,
        inverse_period=args.inverse_period,
        generator=torch.Generator().manual_seed(args.seed),
    )


def train(
    build: Callable[[], nn.Module], name: str, data: tuple[Tensor, ...], args: argparse.Namespace
) -> dict[str, float]:
    """Train a fresh model with one optimizer; return its loss, accuracy and time per step."""
    X_tr, y_tr, X_te, y_te = data
    torch.manual_seed(args.seed)
    model = build()
    opt = make_optimizer(name, model, args)
    loss_fn = nn.CrossEntropyLoss()
    batches = torch.Generator().manual_seed(args.seed)
    losses: list[float] = []
    start = time.perf_counter()
    for _ in range(args.steps):
        index = torch.randint(0, X_tr.shape[0], (args.batch_size,), generator=batches)
        X, y = X_tr[index], y_tr[index]
        opt.zero_grad()
        loss = loss_fn(model(X), y)
        loss.backward()
        if isinstance(opt, pf.optim.CurvatureOptimizer):
            opt.step(batch=(X, y))
        else:
            opt.step()
        losses.append(loss.item())
    seconds = (time.perf_counter() - start) / args.steps
    with torch.no_grad():
        accuracy = (model(X_te).argmax(1) == y_te).float().mean().item()
    return {
        "loss": sum(losses[-10:]) / len(losses[-10:]),
        "accuracy": accuracy,
        "ms": 1e3 * seconds,
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse command-line options (default: sys.argv[1:])."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=150, help="training steps per run")
    parser.add_argument("--batch-size", type=int, default=128, help="samples per step")
    parser.add_argument("--sgd-lr", type=float, default=0.05, help="SGD (momentum 0.9) rate")
    parser.add_argument("--adam-lr", type=float, default=1e-2, help="Adam learning rate")
    parser.add_argument("--kfac-lr", type=float, default=0.1, help="KFAC/EKFAC learning rate")
    parser.add_argument("--damping", type=float, default=0.1, help="KFAC/EKFAC damping")
    parser.add_argument("--inverse-period", type=int, default=10, help="steps between inverses")
    parser.add_argument("--optimizers", nargs="+", choices=OPTIMIZERS, default=list(OPTIMIZERS))
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, dict[str, dict[str, float]]]:
    """Train both models with every optimizer and print one line per run.

    Args:
        argv: Command-line arguments (default: sys.argv[1:]).

    Returns:
        Per model and optimizer: "loss" (mean of the last 10 steps), "accuracy" (test)
        and "ms" (milliseconds per step).
    """
    args = parse_args(argv)
    data = load_digits_split(args.seed)
    print(f"digits: {data[0].shape[0]} train / {data[2].shape[0]} test, {args.steps} steps")
    results: dict[str, dict[str, dict[str, float]]] = {}
    for model_name, build in (("mlp", mlp), ("cnn", cnn)):
        results[model_name] = {}
        for name in args.optimizers:
            found = train(build, name, data, args)
            results[model_name][name] = found
            print(
                f"{model_name:4s} {name:6s} loss {found['loss']:.4f}  "
                f"test accuracy {found['accuracy']:.3f}  {found['ms']:.1f} ms/step"
            )
    return results


if __name__ == "__main__":
    main()
