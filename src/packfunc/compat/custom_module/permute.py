"""``Permute``: reorder the dimensions of the input, keeping the batch dimension first."""

from __future__ import annotations

from torch import Tensor, nn


class Permute(nn.Module):
    """Permute the input's dimensions, or swap two of them.

    Args:
        *dims: The new order of all dimensions (``dims[0]`` must be 0), or, with
            ``init_transpose=True``, the two dimensions to swap (neither may be 0).
        init_transpose: Read ``dims`` as a transposition; it becomes the equivalent
            permutation on the first forward pass, when the number of dimensions is known.

    Raises:
        ValueError: if the batch dimension would move (as in BackPACK).

    Example:
        >>> import torch
        >>> Permute(0, 2, 1)(torch.zeros(2, 3, 4)).shape
        torch.Size([2, 4, 3])
        >>> Permute(1, 2, init_transpose=True)(torch.zeros(2, 3, 4)).shape
        torch.Size([2, 4, 3])
    """

    def __init__(self, *dims: int, init_transpose: bool = False):
        super().__init__()
        moves_batch = 0 in dims if init_transpose else dims[0] != 0
        if moves_batch:
            raise ValueError(f"Permute{dims} would move the batch dimension 0; keep it first.")
        self.dims = dims
        self.init_transpose = init_transpose

    def forward(self, input: Tensor) -> Tensor:
        """Return ``input`` with its dimensions in the new order."""
        if self.init_transpose:
            first, second = self.dims
            order = list(range(input.dim()))
            order[first], order[second] = order[second], order[first]
            self.dims, self.init_transpose = tuple(order), False
        return input.permute(self.dims)
