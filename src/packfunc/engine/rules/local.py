"""The rule of every op that consumes a parameter outside the linear-like ops.

See ``engine/local.py``: the batch pass records such a call's arguments
(:class:`~packfunc.engine.local.LocalInputs`) and its output cotangents; the
column gradients are the vjp of that op alone, ``vmap``-ed over samples.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor
from torch._C._functorch import is_functorch_wrapped_tensor
from torch.func import vmap

from packfunc.engine.autodiff import vjp
from packfunc.engine.local import LocalInputs
from packfunc.engine.memory import DEFAULT_BUDGET, chunks
from packfunc.engine.ops import SiteCall
from packfunc.engine.precision import difference_beyond_rounding
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
        :data:`~packfunc.engine.memory.DEFAULT_BUDGET` holds. The columns must add up to the
        op's vjp over the batch (:meth:`column_sum`, no ``vmap``), or they are refused:
        torch's batching rules of other ops' backward have been wrong under one ``vmap``
        too (``linalg.solve`` of a broadcast matrix, before its decomposition).

        Raises:
            RuntimeError: where the columns do not add up to the batch's vjp.
        """
        local = as_local(x)
        leaf = local.leaf_of(param)

        def one_pair(samples: list[Tensor], cotangent: Tensor) -> Tensor:
            rows = {p: s.unsqueeze(0) for p, s in zip(local.batched, samples)}
            out, pullback = vjp(lambda value: local.evaluate(leaf, value, rows), param)
            return cast(Tensor, pullback(_like_output(cotangent.unsqueeze(0), out))[0])

        columns, n = g.shape[:2]
        samples = [local.arguments.values[p] for p in local.batched]
        per_column = max(1, sum(s.numel() for s in samples))
        found = []
        for part in chunks(columns, max(1, DEFAULT_BUDGET // per_column)):
            count = part.stop - part.start  # [count·n, ...]: sample n's arguments per column
            repeated = [s.expand(count, *s.shape).flatten(0, 1) for s in samples]
            pairs = vmap(one_pair)(repeated, g[part].flatten(0, 1))
            found.append(pairs.view(count, n, *param.shape))
        total = found[0] if len(found) == 1 else torch.cat(found)
        _check_adds_up(total, _batch_vjp(local, param, g), local.func)
        return total

    def column_sum(self, x: Tensor, g: Tensor, call: SiteCall, param: Tensor) -> Tensor:
        """``Σ_{k,n}`` of the column gradients: one vjp of the op over the recorded batch."""
        return _batch_vjp(as_local(x), param, g)


def _batch_vjp(local: LocalInputs, param: Tensor, g: Tensor) -> Tensor:
    """``Σ_{k,n}`` of a local call's column gradients: one vjp over the recorded batch.

    The columns' cotangents ``g [K, n, ...]`` are summed first (the vjp is linear in them),
    so no ``vmap`` runs.
    """
    leaf = local.leaf_of(param)
    out, pullback = vjp(lambda value: local.evaluate(leaf, value, None), param)
    return cast(Tensor, pullback(_like_output(g.sum(0), out))[0])


def _like_output(cotangent: Tensor, output: Tensor) -> Tensor:
    """A cotangent in its output's dtype: a complex parameter's real part gets a real one.

    The terms come in the parameter's dtype (:meth:`BatchPass.site_terms`); a real output
    of a complex parameter (``w.real``, ``view_as_real(w)``) takes its cotangent real
    (its imaginary part is zero, made by that cast).

    Example:
        >>> _like_output(torch.ones(2, dtype=torch.complex64), torch.zeros(2)).dtype
        torch.float32
    """
    if cotangent.is_complex() and not output.is_complex():
        return cotangent.real.to(output.dtype)
    return cotangent.to(output.dtype)


def _check_adds_up(columns: Tensor, total: Tensor, func: Any) -> None:
    """Refuse column gradients ``[K, n, ...]`` that do not add up to ``total`` (to rounding).

    Skipped under ``vmap``, whose values decide nothing.
    """
    try:
        scale = float(columns.detach().abs().max()) if columns.numel() else 0.0
        what = difference_beyond_rounding(columns.sum((0, 1)), total, scale)
    except RuntimeError:
        if is_functorch_wrapped_tensor(columns):
            return
        raise
    if what is not None:
        name = getattr(func, "__name__", repr(func))
        raise RuntimeError(
            f"the per-sample gradients of a parameter through {name} do not add up to its "
            f"batch gradient: their sum {what}. torch's batching rule of {name}'s backward "
            "under vmap is wrong here; packfunc refuses rather than return them. Please "
            "report it with the model (packfunc's issues), and compute this parameter's "
            "quantities without packfunc meanwhile (a loop over samples)."
        )


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
