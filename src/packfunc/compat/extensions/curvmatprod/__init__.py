"""Block curvature-matrix products: ``GGNMP``, ``HMP`` and ``PCHMP``.

Each stores on every parameter a function ``mat -> block @ mat`` for
``mat`` of shape ``[V, *param.shape]``, where ``block`` is the parameter's own
block of the GGN, the Hessian or the positive-curvature Hessian.
"""

from __future__ import annotations

from packfunc.compat.extensions.backprop_extension import BackpropExtension, Job
from packfunc.specs import SPECS


class GGNMP(BackpropExtension):
    """GGN block products in ``param.ggnmp``.

    Args:
        savefield: Attribute to store the function in.

    Example:
        >>> GGNMP().savefield
        'ggnmp'
    """

    def __init__(self, savefield: str = "ggnmp"):
        super().__init__(savefield=savefield)

    def job(self) -> Job:
        """GGN block products."""
        return Job(SPECS["ggn_block_products"])


class HMP(BackpropExtension):
    """Hessian block products in ``param.hmp``.

    Args:
        savefield: Attribute to store the function in.

    Example:
        >>> HMP().savefield
        'hmp'
    """

    def __init__(self, savefield: str = "hmp"):
        super().__init__(savefield=savefield)

    def job(self) -> Job:
        """Hessian block products."""
        return Job(SPECS["hessian_block_products"])


class PCHMP(BackpropExtension):
    """Positive-curvature Hessian block products in ``param.pchmp``.

    Args:
        savefield: Attribute to store the function in.
        modify: ``"clip"`` (negative curvature to zero) or ``"abs"``.

    Example:
        >>> PCHMP(modify="abs").savefield
        'pchmp'
    """

    def __init__(self, savefield: str = "pchmp", modify: str = "clip"):
        super().__init__(savefield=savefield)
        if modify not in ("clip", "abs"):
            raise ValueError(f"modify must be 'clip' or 'abs'; got {modify!r}.")
        self.modify = modify

    def get_modification_mode(self) -> str:
        """How negative curvature is modified."""
        return self.modify

    def job(self) -> Job:
        """Positive-curvature Hessian block products."""
        return Job(SPECS["pch_block_products"], (("modify", self.modify),))


__all__ = ["GGNMP", "HMP", "PCHMP"]
