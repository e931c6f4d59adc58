"""Which path each parameter takes: a closed form, its own op's vjp, or the whole model."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import cast

import optree
import torch

from packfunc.engine.batch_pass import other_samples
from packfunc.engine.batch_record import PlanMismatch, probed_forward, zero_probes
from packfunc.engine.discovery import Plan, Recorded, discover
from packfunc.engine.model_state import kept_model_state
from packfunc.engine.ops import SiteCall
from packfunc.engine.randomness import private_generators
from packfunc.engine.rules import rule_for
from packfunc.functionalize import (
    batch_size,
    check_model_arguments,
    flatten_params,
    has_packed_sequences,
    module_of,
    packing,
    padded_sequences,
    public_entry,
    refuse_unsplittable_inputs,
    select_samples,
)
from packfunc.types import Inputs, ModelFn, Params, shares_arguments

PathTree = str | Mapping[str, "PathTree"] | Sequence["PathTree"]
"""A pytree like ``params`` whose leaves are the descriptions :func:`explain` gives."""


@shares_arguments("model_fn", "params", "X")
@public_entry
def explain(model_fn: ModelFn, params: Params, X: Inputs) -> PathTree:
    """Say, per parameter, how packfunc differentiates it per sample.

    ``"closed form (F.linear)"``: a rule of a linear, convolution or embedding
    layer, or of a normalization layer's affine parameters; ``"op-local (add)"``:
    ``vmap`` over samples of the vjp of the one op that consumes it;
    ``"whole model: <reason>"``: ``vmap`` over samples of the whole model's vjp
    (slow; the reason names the op that prevents the others);
    ``"unused"``: the output does not depend on it. Nothing is differentiated:
    one forward of one sample and one of the batch run.

    Returns:
        A pytree like ``params`` of strings.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
        >>> fn, p = packfunc.functional(model)
        >>> explain(fn, p, torch.randn(2, 3))["1.weight"]
        'closed form (layer_norm)'
    """
    check_model_arguments(model_fn, params)
    leaves, treespec, _ = flatten_params(params)
    if has_packed_sequences(X):
        model_fn, X = packing(model_fn), padded_sequences(X)
    refuse_unsplittable_inputs(X)
    n = batch_size(X)
    # a probe, not a forward of the user's: what it sets on the model (a running statistic,
    # a power iteration) is put back
    with torch.no_grad(), private_generators(leaves), kept_model_state(module_of(model_fn)):
        for sample in [0, *other_samples(n)]:  # as the batch pass: another sample's path
            plan = discover(model_fn, params, leaves, select_samples(X, slice(sample, sample + 1)))
            failed: set[int] = set()
            forward = probed_forward(model_fn, params, leaves, plan, X, failed)
            try:  # (with gradients on, as a batch pass: a call that runs without them, in a
                # custom autograd.Function's forward or under no_grad, takes the whole model)
                with torch.enable_grad():
                    _, inputs = forward(zero_probes(plan, plan.active(), n))
                break
            except PlanMismatch as mismatch:
                last = mismatch
        else:
            raise ValueError(str(last)) from last
    paths = [_path(plan, failed, inputs, leaves, leaf) for leaf in range(len(leaves))]
    return cast(PathTree, optree.tree_unflatten(treespec, paths))


def _path(
    plan: Plan,
    failed: set[int],
    inputs: Mapping[int, Recorded],
    leaves: list[torch.Tensor],
    leaf: int,
) -> str:
    """The description of one leaf's path (``inputs``: each site's recorded input)."""
    if leaf in plan.uncovered:
        return f"whole model: {plan.reasons.get(leaf, 'used outside the ops packfunc follows')}"
    calls = [
        (k, site.call, role)
        for k, site in enumerate(plan.sites)
        for role, used in site.call.leaves
        if used == leaf
    ]
    if not calls:
        return "unused"
    broken = [call for k, call, _ in calls if k in failed]
    if broken:
        return (
            f"whole model: its call of {broken[0].name} cannot be recorded per sample (its "
            "arguments change shape with the batch size without keeping one row per sample, "
            "or it runs without gradients: in a custom autograd.Function's forward, or under "
            "torch.no_grad())"
        )
    names = sorted({call.name for _, call, _ in calls})
    kinds = {
        _kind(call, role, inputs.get(k), leaves[leaf], len(plan.sites[k].tail) + 1)
        for k, call, role in calls
    }
    return f"{' and '.join(sorted(kinds))} ({', '.join(names)})"


def _kind(
    call: SiteCall, role: str, recorded: Recorded | None, param: torch.Tensor, rank: int
) -> str:
    """``"closed form"`` if the parameter's rule takes its closed forms here, else ``"op-local"``.

    Without a record of the call (a site not recorded), the rule's kind decides.
    """
    rule = rule_for(call, role)
    if recorded is None:
        closed = rule.closed_form
    else:
        closed = rule.takes_closed_form(recorded, call, param, rank)
    return "closed form" if closed else "op-local"
