"""The interface every rule implements."""

from __future__ import annotations

from torch import Tensor

from packfunc.engine.ops import TapCall


class Rule:
    """Closed forms for one parameter role (weight or bias) of one op family.

    A rule receives, for a batch of samples, the op's input ``x`` and the
    cotangent ``g`` of its output (both with the sample dimension first), the
    call's options and the parameter itself. Methods that have no closed form
    return ``None``; the engine then reduces materialized per-sample gradients
    in chunks.
    """

    merge_dim: int | None = None
    """Dim along which canonical terms of several calls concatenate (``None``: they add up)."""

    def canonical(self, x: Tensor, g: Tensor, call: TapCall, param: Tensor
                  ) -> tuple[Tensor, Tensor]:
        """Bring ``(x, g)`` into the layout the other methods expect.

        Args:
            x: Input of the op, ``[N, ...]``.
            g: Cotangent of the op's output, ``[N, ...]``.
            call: The call's description.
            param: The parameter this rule handles.

        Returns:
            The canonical ``(x, g)``.
        """
        return x, g

    def batch_grad(self, x: Tensor, g: Tensor, call: TapCall, param: Tensor) -> Tensor:
        """Return per-sample gradients ``[n, *param.shape]`` from canonical ``(x, g)``."""
        raise NotImplementedError

    def grad(self, x: Tensor, g: Tensor, call: TapCall, param: Tensor) -> Tensor:
        """Return the gradient ``Σ_n batch_grad[n]``."""
        return self.batch_grad(x, g, call, param).sum(0)

    def sum_grad_squared(self, x: Tensor, g: Tensor, call: TapCall, param: Tensor
                         ) -> Tensor | None:
        """Return ``Σ_n batch_grad[n]**2`` without materializing it, or ``None``."""
        return None

    def batch_l2(self, x: Tensor, g: Tensor, call: TapCall, param: Tensor) -> Tensor | None:
        """Return ``‖batch_grad[n]‖²`` per sample without materializing it, or ``None``."""
        return None
