"""DP-SGD on scikit-learn's digits with packfunc's per-sample gradients.

Run ``python -m packfunc.demo --help`` for the options. Each step makes one
:func:`packfunc.compute` call for the per-sample gradients and their squared
norms, clips every sample's gradient to norm ``C``, sums, adds Gaussian noise of
standard deviation ``σ·C``, divides by the batch size and takes a plain SGD step
on a fresh parameter dict. The model itself is never mutated.

Needs scikit-learn (``pip install packfunc[demo]``) for the bundled dataset; no
download happens.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor, nn

import packfunc as pf

Params = dict[str, Tensor]
"""Parameters by name, as returned by :func:`packfunc.functional`."""

ModelFn = Callable[[Params, Tensor], Tensor]


class Split(NamedTuple):
    """Standardized train and test tensors."""

    X_train: Tensor
    y_train: Tensor
    X_test: Tensor
    y_test: Tensor


@dataclass(frozen=True)
class Config:
    """DP-SGD hyper-parameters.

    Attributes:
        epochs: Passes over the training set.
        batch_size: Samples per step.
        lr: SGD learning rate.
        clip: Per-sample gradient norm bound ``C``.
        noise: Noise multiplier ``σ``; the summed gradient gets ``N(0, (σ·C)²)`` noise.
        seed: Seed for the split, the initialization, the shuffling and the noise.
    """

    epochs: int = 20
    batch_size: int = 64
    lr: float = 0.1
    clip: float = 1.0
    noise: float = 1.0
    seed: int = 0


def load_digits_split(seed: int = 0, test_fraction: float = 0.25) -> Split:
    """Load scikit-learn's bundled digits, split them and standardize the features.

    The split is stratified and fixed by ``seed``; mean and standard deviation
    come from the training part only (constant pixels are left at zero).

    Args:
        seed: Random state of the train/test split.
        test_fraction: Share of the 1797 samples held out for testing.

    Returns:
        A :class:`Split` with float32 features ``[n, 64]`` and int64 labels ``[n]``.

    Example:
        >>> data = load_digits_split(seed=0)
        >>> data.X_train.shape[1], int(data.y_train.max())
        (64, 9)
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    X, y = load_digits(return_X_y=True)
    X_tr, X_te, y_tr, y_te = train_test_split(
        X, y, test_size=test_fraction, random_state=seed, stratify=y)
    scaler = StandardScaler().fit(X_tr)
    return Split(torch.as_tensor(scaler.transform(X_tr), dtype=torch.float32),
                 torch.as_tensor(y_tr, dtype=torch.long),
                 torch.as_tensor(scaler.transform(X_te), dtype=torch.float32),
                 torch.as_tensor(y_te, dtype=torch.long))


def build_mlp(n_in: int = 64, hidden: int = 128, n_out: int = 10) -> nn.Module:
    """Return the ``64-128-10`` tanh MLP trained by the demo.

    Args:
        n_in: Input features.
        hidden: Hidden units.
        n_out: Classes.

    Returns:
        An ``nn.Sequential`` of ``Linear``, ``Tanh``, ``Linear``.

    Example:
        >>> build_mlp()(torch.zeros(2, 64)).shape
        torch.Size([2, 10])
    """
    return nn.Sequential(nn.Linear(n_in, hidden), nn.Tanh(), nn.Linear(hidden, n_out))


def per_sample_norms(batch_l2: Params) -> Tensor:
    """Total per-sample gradient norm over all parameters.

    Args:
        batch_l2: ``batch_l2_grad`` output: name -> ``[N]`` squared norms.

    Returns:
        ``[N]`` tensor ``sqrt(Σ_params batch_l2[name])``.

    Example:
        >>> per_sample_norms({"a": torch.tensor([9.0, 0.0]), "b": torch.tensor([16.0, 1.0])})
        tensor([5., 1.])
    """
    return torch.stack(list(batch_l2.values())).sum(0).sqrt()


def clip_factors(norms: Tensor, clip: float) -> Tensor:
    """Scale factors ``min(1, C / (norm + 1e-6))`` that bound each sample's norm by ``C``.

    Args:
        norms: ``[N]`` per-sample gradient norms.
        clip: The bound ``C``.

    Returns:
        ``[N]`` factors in ``(0, 1]``.

    Example:
        >>> clip_factors(torch.tensor([0.5, 4.0]), clip=1.0)
        tensor([1.0000, 0.2500])
    """
    return (clip / (norms + 1e-6)).clamp(max=1.0)


def clip_per_sample(batch_grads: Params, norms: Tensor, clip: float) -> Params:
    """Clip every sample's gradient (across all parameters) to norm at most ``clip``.

    Args:
        batch_grads: name -> ``[N, *p]`` per-sample gradients.
        norms: ``[N]`` total per-sample norms (see :func:`per_sample_norms`).
        clip: The bound ``C``.

    Returns:
        A new dict of ``[N, *p]`` tensors; samples with norm ``≤ C`` are unchanged.

    Example:
        >>> g = {"w": torch.tensor([[3.0, 4.0], [0.3, 0.4]])}
        >>> clip_per_sample(g, torch.tensor([5.0, 0.5]), clip=1.0)["w"]
        tensor([[0.6000, 0.8000],
                [0.3000, 0.4000]])
    """
    factors = clip_factors(norms, clip)
    return {name: g * factors.view(-1, *([1] * (g.dim() - 1))) for name, g in batch_grads.items()}


def noisy_mean(clipped: Params, clip: float, noise: float, generator: torch.Generator) -> Params:
    """Sum clipped per-sample gradients, add ``N(0, (σ·C)²)`` noise, divide by the batch size.

    Args:
        clipped: name -> ``[N, *p]`` clipped per-sample gradients.
        clip: The clipping bound ``C``.
        noise: The noise multiplier ``σ``.
        generator: Source of the Gaussian noise (keeps runs reproducible).

    Returns:
        name -> ``[*p]`` privatized gradient estimate.

    Example:
        >>> g = {"w": torch.ones(4, 3)}
        >>> noisy_mean(g, 1.0, 0.0, torch.Generator().manual_seed(0))["w"]
        tensor([1., 1., 1.])
    """
    result = {}
    for name, g in clipped.items():
        summed = g.sum(0)
        z = torch.randn(summed.shape, generator=generator, dtype=summed.dtype)
        result[name] = (summed + noise * clip * z.to(summed.device)) / g.shape[0]
    return result


def sgd_update(params: Params, grads: Params, lr: float) -> Params:
    """Return ``params - lr * grads`` as a new dict (no in-place change).

    Args:
        params: name -> tensor.
        grads: name -> tensor of the same shape.
        lr: Learning rate.

    Returns:
        The updated parameters.

    Example:
        >>> sgd_update({"w": torch.ones(2)}, {"w": torch.ones(2)}, lr=0.5)["w"]
        tensor([0.5000, 0.5000])
    """
    return {name: p - lr * grads[name] for name, p in params.items()}


def dp_sgd_step(model_fn: ModelFn, params: Params, X: Tensor, y: Tensor, config: Config,
                generator: torch.Generator) -> tuple[Params, float]:
    """One DP-SGD step on a batch.

    Args:
        model_fn: ``model_fn(params, X) -> logits``.
        params: Current parameters.
        X: ``[N, features]`` batch.
        y: ``[N]`` labels.
        config: Clipping bound, noise multiplier and learning rate.
        generator: Noise generator.

    Returns:
        The new parameters and the batch's summed (unclipped, noise-free) loss.

    Example:
        >>> model_fn, params = pf.functional(build_mlp())
        >>> X, y = torch.randn(8, 64), torch.randint(0, 10, (8,))
        >>> new, loss = dp_sgd_step(model_fn, params, X, y, Config(), torch.Generator())
        >>> new.keys() == params.keys()
        True
    """
    out = pf.compute(model_fn, params, X, y, loss=nn.CrossEntropyLoss(reduction="sum"),
                         quantities=("batch_grad", "batch_l2_grad"))
    norms = per_sample_norms(out["batch_l2_grad"])
    clipped = clip_per_sample(out["batch_grad"], norms, config.clip)
    grad = noisy_mean(clipped, config.clip, config.noise, generator)
    return sgd_update(params, grad, config.lr), float(out["loss"])


def batches(n: int, batch_size: int, generator: torch.Generator) -> Iterator[Tensor]:
    """Yield shuffled index batches covering ``range(n)`` once.

    Args:
        n: Number of samples.
        batch_size: Indices per batch (the last may be smaller).
        generator: Source of the permutation.

    Returns:
        An iterator of ``[≤ batch_size]`` int64 index tensors.

    Example:
        >>> [b.numel() for b in batches(5, 2, torch.Generator().manual_seed(0))]
        [2, 2, 1]
    """
    return iter(torch.randperm(n, generator=generator).split(batch_size))


@torch.no_grad()
def accuracy(model_fn: ModelFn, params: Params, X: Tensor, y: Tensor) -> float:
    """Share of samples whose arg-max logit is the label.

    Args:
        model_fn: ``model_fn(params, X) -> logits``.
        params: Parameters.
        X: ``[N, features]`` inputs.
        y: ``[N]`` labels.

    Returns:
        Accuracy in ``[0, 1]``.

    Example:
        >>> model_fn, params = pf.functional(build_mlp())
        >>> 0.0 <= accuracy(model_fn, params, torch.randn(4, 64), torch.zeros(4).long()) <= 1.0
        True
    """
    return (model_fn(params, X).argmax(1) == y).float().mean().item()


def _positive_int(text: str) -> int:
    """Parse a strictly positive integer for argparse."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def parse_args(argv: Sequence[str] | None = None) -> Config:
    """Parse command-line options into a :class:`Config`.

    Args:
        argv: Arguments without the program name (default: ``sys.argv[1:]``).

    Returns:
        The configuration.

    Example:
        >>> parse_args(["--epochs", "2"]).epochs
        2
    """
    default = Config()
    parser = argparse.ArgumentParser(prog="python -m packfunc.demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=_positive_int, default=default.epochs,
                        help="passes over the data")
    parser.add_argument("--batch-size", type=_positive_int, default=default.batch_size,
                        help="samples per step")
    parser.add_argument("--lr", type=float, default=default.lr, help="SGD learning rate")
    parser.add_argument("--clip", type=float, default=default.clip,
                        help="per-sample gradient norm bound C")
    parser.add_argument("--noise", type=float, default=default.noise,
                        help="noise multiplier sigma (noise std is sigma * C)")
    parser.add_argument("--seed", type=int, default=default.seed, help="random seed")
    args = parser.parse_args(argv)
    return Config(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, clip=args.clip,
                  noise=args.noise, seed=args.seed)


def main(argv: list[str] | None = None) -> dict:
    """Train the MLP with DP-SGD, printing one line per epoch and a summary.

    Args:
        argv: Command-line arguments (default: ``sys.argv[1:]``).

    Returns:
        Final metrics: ``"train_loss"`` (mean loss per sample in the last epoch),
        ``"test_accuracy"``, ``"losses"`` (one mean loss per epoch), ``"accuracies"``
        and ``"seconds"`` (total training time).

    Example:
        >>> main(["--epochs", "1"])["test_accuracy"] > 0.1  # doctest: +SKIP
        True
    """
    config = parse_args(argv)
    data = load_digits_split(config.seed)
    torch.manual_seed(config.seed)
    model_fn, params = pf.functional(build_mlp())
    shuffle = torch.Generator().manual_seed(config.seed)
    noise = torch.Generator().manual_seed(config.seed + 1)
    n = data.X_train.shape[0]
    print(f"DP-SGD on digits: {n} train / {data.X_test.shape[0]} test, batch {config.batch_size},"
          f" lr {config.lr}, C {config.clip}, sigma {config.noise}")
    losses: list[float] = []
    accuracies: list[float] = []
    start = time.perf_counter()
    for epoch in range(1, config.epochs + 1):
        tic = time.perf_counter()
        total = 0.0
        for index in batches(n, config.batch_size, shuffle):
            params, loss = dp_sgd_step(model_fn, params, data.X_train[index],
                                       data.y_train[index], config, noise)
            total += loss
        losses.append(total / n)
        accuracies.append(accuracy(model_fn, params, data.X_test, data.y_test))
        print(f"epoch {epoch:3d}  train loss {losses[-1]:.4f}  test acc {accuracies[-1]:.4f}"
              f"  {time.perf_counter() - tic:.2f} s/epoch")
    seconds = time.perf_counter() - start
    print(f"done: {config.epochs} epochs in {seconds:.2f} s, final test accuracy "
          f"{accuracies[-1]:.4f}")
    return {"train_loss": losses[-1], "test_accuracy": accuracies[-1], "losses": losses,
            "accuracies": accuracies, "seconds": seconds}


if __name__ == "__main__":
    main()
