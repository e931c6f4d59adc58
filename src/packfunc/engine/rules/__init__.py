"""Closed-form rules per (kind of layer, parameter role), and the rules of local calls."""

from __future__ import annotations

from packfunc.engine.ops import LayerKind, SiteCall
from packfunc.engine.rules.base import Rule
from packfunc.engine.rules.broadcast import BROADCAST_RULES
from packfunc.engine.rules.conv import ConvWeight
from packfunc.engine.rules.embedding import EmbeddingWeight
from packfunc.engine.rules.linear import Bias, LinearWeight, LinearWeightInOut
from packfunc.engine.rules.local import LOCAL
from packfunc.engine.rules.norm import NORM_RULES

RULES: dict[tuple[LayerKind, str], Rule] = {
    (LayerKind.LINEAR, "weight"): LinearWeight(),
    (LayerKind.LINEAR, "bias"): Bias(channel_dim=-1, hessian_from_output_curvature=True),
    (LayerKind.CONVOLUTION, "weight"): ConvWeight(),
    (LayerKind.CONVOLUTION, "bias"): Bias(channel_dim=1),
    (LayerKind.EMBEDDING, "weight"): EmbeddingWeight(),
}
"""The rule for each (kind, role) of :data:`packfunc.engine.ops.SIGNATURES`."""

LOCAL_RULES = NORM_RULES | BROADCAST_RULES
"""The closed-form rule of each function a local call may make (else the local rule's vjp)."""

LINEAR_WEIGHT_IN_OUT = LinearWeightInOut()
"""The weight rule of :func:`~packfunc.engine.ops.linear_in_out` (``[in, out]`` layout)."""


def rule_for(call: SiteCall, role: str) -> Rule:
    """The rule of a parameter role of a call: a closed form, or the local rule's vjp.

    A local call gets the closed form of its function (:data:`LOCAL_RULES`), if any,
    else :data:`~packfunc.engine.rules.local.LOCAL`.

    Args:
        call: A site's call.
        role: The parameter's role in it.

    Returns:
        The :class:`Rule`.

    Example:
        >>> from packfunc.engine.ops import SIGNATURES
        >>> call = SiteCall(SIGNATURES[F.linear], (("weight", 0),), ())
        >>> rule_for(call, "weight") is RULES[LayerKind.LINEAR, "weight"]
        True
    """
    if call.op is None:
        return LOCAL_RULES.get(call.option("func"), LOCAL)
    if call.op.kind is LayerKind.LINEAR and call.op.transposed and role == "weight":
        return LINEAR_WEIGHT_IN_OUT
    return RULES[(call.op.kind, role)]


__all__ = ["RULES", "Rule", "rule_for"]
