"""Closed-form rules per (op family, parameter role)."""

from __future__ import annotations

from packfunc.engine.rules.base import Rule
from packfunc.engine.rules.conv import ConvWeight
from packfunc.engine.rules.embedding import EmbeddingWeight
from packfunc.engine.rules.linear import Bias, LinearWeight

RULES: dict[tuple[str, str], Rule] = {
    ("linear", "weight"): LinearWeight(),
    ("linear", "bias"): Bias(channel_dim=-1),
    ("conv", "weight"): ConvWeight(),
    ("conv", "bias"): Bias(channel_dim=1),
    ("embedding", "weight"): EmbeddingWeight(),
}
"""The rule for each (family, role) of :data:`packfunc.engine.ops.SIGNATURES`."""

__all__ = ["RULES", "Rule"]
