"""Closed-form rules per (op family, parameter role)."""

from __future__ import annotations

from packfunc.engine.ops import TapCall
from packfunc.engine.rules.base import Rule
from packfunc.engine.rules.conv import ConvWeight
from packfunc.engine.rules.embedding import EmbeddingWeight
from packfunc.engine.rules.linear import Bias, LinearWeight, LinearWeightInOut
from packfunc.engine.rules.local import LOCAL
from packfunc.engine.rules.norm import NORM_RULES

RULES: dict[tuple[str, str], Rule] = {
    ("linear", "weight"): LinearWeight(),
    ("linear", "bias"): Bias(channel_dim=-1),
    ("conv", "weight"): ConvWeight(),
    ("conv", "bias"): Bias(channel_dim=1),
    ("embedding", "weight"): EmbeddingWeight(),
    ("local", "local"): LOCAL,
}
"""The rule for each (family, role) of :data:`packfunc.engine.ops.SIGNATURES`, and the local
rule (family and role ``"local"``) of every other op that consumes a parameter."""

LINEAR_WEIGHT_IN_OUT = LinearWeightInOut()
"""The weight rule of :func:`~packfunc.engine.ops.linear_in_out` (``[in, out]`` layout)."""


def rule_for(call: TapCall, role: str) -> Rule:
    """The rule of a parameter role of a call: a closed form, or the local rule's vjp.

    Args:
        call: A site's call.
        role: The parameter's role in it.

    Returns:
        The :class:`Rule`.

    Example:
        >>> rule_for(TapCall("linear", (("weight", 0),), ()), "weight") is RULES["linear", "weight"]
        True
    """
    if call.family == "local":
        return NORM_RULES.get(call.option("func"), LOCAL)
    if call.family == "linear" and call.transposed and role == "weight":
        return LINEAR_WEIGHT_IN_OUT
    return RULES[(call.family, role)]


__all__ = ["RULES", "Rule", "rule_for"]
