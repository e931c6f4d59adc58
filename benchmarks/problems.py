"""Benchmark problems: a seeded model, a batch ``(X, y)`` and the loss.

Every contender gets its own :meth:`Problem.model` copy (BackPACK and opacus
install hooks on the modules they are given), all with identical parameters.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

SEED = 0


@dataclass
class Problem:
    """A model with fixed parameters, one batch and a loss."""

    name: str
    base: nn.Module
    X: Tensor
    y: Tensor
    make_loss: Callable[[], nn.Module] = field(
        default=lambda: nn.CrossEntropyLoss(reduction="mean")
    )

    @property
    def n(self) -> int:
        """The batch size."""
        return self.X.shape[0]

    def model(self) -> nn.Module:
        """Return a fresh copy of the model (same parameters, no hooks)."""
        return copy.deepcopy(self.base)

    def loss(self) -> nn.Module:
        """Return a fresh loss module."""
        return self.make_loss()


def mlp(n: int = 128) -> Problem:
    torch.manual_seed(SEED)
    model = nn.Sequential(
        nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
    )
    X, y = torch.randn(n, 784), torch.randint(0, 10, (n,))
    return Problem("MLP", model, X, y)


def cnn(n: int = 64) -> Problem:
    torch.manual_seed(SEED)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 8 * 8, 10),
    )
    X, y = torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,))
    return Problem("CNN", model, X, y)


def tanh_mlp(n: int = 32) -> Problem:
    torch.manual_seed(SEED)
    model = nn.Sequential(
        nn.Linear(784, 128), nn.Tanh(), nn.Linear(128, 64), nn.Tanh(), nn.Linear(64, 10)
    )
    X, y = torch.randn(n, 784), torch.randint(0, 10, (n,))
    return Problem("tanh MLP", model, X, y)


PROBLEMS: list[Callable[[], Problem]] = [mlp, cnn, tanh_mlp]
"""Problem factories, in table order."""
