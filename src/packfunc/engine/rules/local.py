"""The rule of every op that consumes a parameter outside the linear-like ops.

See ``engine/local.py``: the batch pass records such a call's arguments
(:class:`~packfunc.engine.local.LocalInputs`) and its output cotangents; the
column gradients are the vjp of that op alone, ``vmap``-ed over samples.
"""

from __future__ import annotations

from typing import Any, cast

from torch import Tensor
from torch.func import vmap

from packfunc.engine.autodiff import vjp
from packfunc.engine.local import LocalInputs
from packfunc.engine.ops import SiteCall
from packfunc.engine.rules.base import Rule


class LocalRule(Rule):
    """Column gradients of a parameter from the vjp of the one op call that consumes it.

    ``x`` is the call's :class:`LocalInputs`, ``g`` its output cotangents ``[K, N, ...]``.
    Statistics other than the gradient reduce the materialized column gradients,
    which have the parameter's size per sample (small for norm layers and scales).
    """

    closed_form = False

    def columns(self, x: Tensor, g: Tensor, call: SiteCall, param: Tensor) -> Tensor:
        """Column gradients ``[K, n, *param.shape]``: vmap over samples of the op's vjp."""
        local = as_local(x)
        leaf = local.leaf_of(param)

        def one_sample(samples: list[Tensor], cotangents: Tensor) -> Tensor:
            rows = {p: s.unsqueeze(0) for p, s in zip(local.batched, samples)}
            _, pullback = vjp(lambda value: local.evaluate(leaf, value, rows), param)
            if cotangents.shape[0] == 1:
                return cast(Tensor, pullback(cotangents[0].unsqueeze(0))[0].unsqueeze(0))
            return cast(Tensor, vmap(lambda c: pullback(c.unsqueeze(0))[0])(cotangents))

        samples = [local.arguments.values[p] for p in local.batched]
        return vmap(one_sample, in_dims=(0, 1), out_dims=1)(samples, g)

    def column_sum(self, x: Tensor, g: Tensor, call: SiteCall, param: Tensor) -> Tensor:
        """``Σ_{k,n}`` of the column gradients: one vjp of the op over the recorded batch."""
        local = as_local(x)
        leaf = local.leaf_of(param)
        _, pullback = vjp(lambda value: local.evaluate(leaf, value, None), param)
        if g.shape[0] == 1:
            return cast(Tensor, pullback(g[0])[0])
        return cast(Tensor, vmap(lambda c: pullback(c)[0])(g).sum(0))


def as_local(x: Any) -> LocalInputs:
    """The recorded call a local rule receives (the rule interface types it as a tensor).

    Args:
        x: What the rule received as the op's input.

    Returns:
        The :class:`~packfunc.engine.local.LocalInputs`.

    Raises:
        TypeError: if ``x`` is not a recorded call.
    """
    if not isinstance(x, LocalInputs):
        raise TypeError(f"a local rule needs the recorded call, got {type(x).__name__}")
    return x


LOCAL = LocalRule()
"""The rule of every local site."""
