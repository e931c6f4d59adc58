"""The interface every rule implements.

A rule works on *columns*: a column ``(k, n)`` is the gradient of parameter
``θ`` pulled back from output cotangent ``k`` of sample ``n``. For first-order
quantities there is one output cotangent (``K = 1``: the loss gradient), for
the generalized Gauss-Newton there are ``K`` (the columns of the loss
Hessian's square root). The column gradient is ``batch_grad[k, n]``; every
other method is a reduction of it that a closed form may give more cheaply.
"""

from __future__ import annotations

from torch import Tensor

from packfunc.engine.ops import TapCall


class Rule:
    """Closed forms for one parameter role (weight or bias) of one op family.

    ``canonical`` receives the op's input ``x: [N, ...]`` and the cotangents of
    its output ``g: [K, N, ...]``; the other methods receive the canonical pair,
    whose sample dim is dim 1, restricted to the samples of interest. Methods
    with no closed form for the given tensors return ``None``; the engine then
    reduces materialized column gradients in chunks.
    """

    merge_dim: int | None = None
    """Dim along which canonical terms of several calls concatenate (``None``: they add up)."""

    def canonical(self, x: Tensor, g: Tensor, call: TapCall, param: Tensor
                  ) -> tuple[Tensor, Tensor]:
        """Bring ``(x [N, ...], g [K, N, ...])`` into the layout the other methods expect."""
        return x, g

    def batch_grad(self, x: Tensor, g: Tensor, call: TapCall, param: Tensor) -> Tensor:
        """Column gradients ``[K, n, *param.shape]``."""
        raise NotImplementedError

    def grad(self, x: Tensor, g: Tensor, call: TapCall, param: Tensor) -> Tensor:
        """``Σ_{k,n} batch_grad[k, n]``."""
        return self.batch_grad(x, g, call, param).sum((0, 1))

    def sum_grad_squared(self, x: Tensor, g: Tensor, call: TapCall, param: Tensor
                         ) -> Tensor | None:
        """``Σ_{k,n} batch_grad[k, n]²`` in closed form, or ``None``."""
        return None

    def batch_sum_squares(self, x: Tensor, g: Tensor, call: TapCall, param: Tensor
                          ) -> Tensor | None:
        """``Σ_k batch_grad[k, n]²`` per sample, ``[n, *param.shape]``, or ``None``."""
        return None

    def batch_l2(self, x: Tensor, g: Tensor, call: TapCall, param: Tensor) -> Tensor | None:
        """``Σ_k ‖batch_grad[k, n]‖²`` per sample, ``[n]``, or ``None``."""
        return None
