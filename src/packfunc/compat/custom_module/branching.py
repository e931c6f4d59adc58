"""Branching as modules: ``Parallel`` feeds one input through several modules and merges."""

from __future__ import annotations

from collections import OrderedDict

from torch import Tensor, nn


class _Branch(nn.Module):
    """Feed one input through each child module; return their outputs as a tuple.

    Args:
        *args: The modules, or one ``OrderedDict`` of name -> module (as
            ``torch.nn.Sequential`` takes them).
    """

    def __init__(self, *args: OrderedDict[str, nn.Module] | nn.Module):
        super().__init__()
        first = args[0] if len(args) == 1 else None
        if isinstance(first, OrderedDict):
            for name, module in first.items():
                self.add_module(name, module)
            return
        for i, child in enumerate(args):
            self.add_module(str(i), child)  # type: ignore[arg-type]

    def forward(self, input: Tensor) -> tuple[Tensor, ...]:
        """Return each child's output on ``input``."""
        return tuple(module(input) for module in self.children())


class SumModule(nn.Module):
    """Merge branches: the sum of all inputs, which must be tensors of one shape.

    Example:
        >>> import torch
        >>> SumModule()(torch.ones(2), torch.ones(2))
        tensor([2., 2.])
    """

    def forward(self, *input: Tensor) -> Tensor:
        """Sum the inputs.

        Args:
            *input: Tensors of equal shape.

        Returns:
            Their sum.

        Raises:
            AssertionError: if an input is not a tensor or the shapes differ (as in BackPACK).
        """
        if not all(isinstance(x, Tensor) for x in input):
            raise AssertionError(f"SumModule sums tensors, got {[type(x) for x in input]}.")
        if len({x.shape for x in input}) > 1:
            raise AssertionError(
                f"SumModule's inputs differ in shape: {[tuple(x.shape) for x in input]}."
            )
        return sum(input[1:], input[0])


class Parallel(nn.Module):
    """Feed the same input through parallel modules and merge their outputs (by default, sum).

    Attributes ``branch`` (the parallel modules, named like ``Sequential``'s) and
    ``merge`` give the same parameter names as BackPACK's ``Parallel``.

    Args:
        *args: The modules, or one ``OrderedDict`` of name -> module.
        merge_module: Takes the branch outputs as positional arguments; ``None`` means
            ``SumModule()``.

    Example:
        >>> import torch
        >>> residual = Parallel(torch.nn.Identity(), torch.nn.Linear(3, 3))
        >>> x = torch.randn(2, 3)
        >>> torch.allclose(residual(x), x + residual.branch.get_submodule("1")(x))
        True
    """

    def __init__(
        self, *args: OrderedDict[str, nn.Module] | nn.Module, merge_module: nn.Module | None = None
    ):
        super().__init__()
        self.branch = _Branch(*args)
        self.merge = SumModule() if merge_module is None else merge_module

    def forward(self, input: Tensor) -> Tensor:
        """Merge the outputs of every branch on ``input``."""
        return self.merge(*self.branch(input))
