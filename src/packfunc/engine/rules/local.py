"""The rule of every op that consumes a parameter outside the linear-like ops.

See ``engine/local.py``: the batch pass records such a call's arguments
(:class:`~packfunc.engine.local.LocalInputs`) and its output cotangents; the
column gradients are the vjp of that op alone, ``vmap``-ed over samples.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor
from torch.func import vmap

from packfunc.engine.autodiff import vjp
from packfunc.engine.local import LocalInputs
from packfunc.engine.memory import DEFAULT_BUDGET, chunks
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
        """Column gradients ``[K, n, *param.shape]``: one vmap of the op's vjp over pairs.

        Each (column, sample) pair is one lane of a single ``vmap``: nested over samples
        and then columns, torch's batching rules of some ops' backward mix the two levels
        (``prelu``, ``cdist``: wrong where ``K`` equals the batch size, an error otherwise).
        The samples' arguments are repeated per column, for as many columns at a time as
        :data:`~packfunc.engine.memory.DEFAULT_BUDGET` holds.
        """
        local = as_local(x)
        leaf = local.leaf_of(param)

        def one_pair(samples: list[Tensor], cotangent: Tensor) -> Tensor:
            rows = {p: s.unsqueeze(0) for p, s in zip(local.batched, samples)}
            _, pullback = vjp(lambda value: local.evaluate(leaf, value, rows), param)
            return cast(Tensor, pullback(cotangent.unsqueeze(0))[0])

        columns, n = g.shape[:2]
        samples = [local.arguments.values[p] for p in local.batched]
        per_column = max(1, sum(s.numel() for s in samples))
        found = []
        for part in chunks(columns, max(1, DEFAULT_BUDGET // per_column)):
            count = part.stop - part.start  # [count·n, ...]: sample n's arguments per column
            repeated = [s.expand(count, *s.shape).flatten(0, 1) for s in samples]
            pairs = vmap(one_pair)(repeated, g[part].flatten(0, 1))
            found.append(pairs.view(count, n, *param.shape))
        return found[0] if len(found) == 1 else torch.cat(found)

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
