"""One batch: the statistic quantities of :mod:`packfunc.specs` from one shared batch pass.

A statistic quantity is a reduction of *column gradients* (see
``engine/statistics.py``) for one kind of output cotangents: the loss gradient
(first order), the columns of the loss Hessian's square root (the GGN, exact or
Monte-Carlo), or the exact Hessian (its diagonals, ``engine/hessian.py``). Every
requested quantity shares one forward and one pullback; quantities made of others
(:attr:`~packfunc.specs.Combine.MOMENTS`) are assembled from their parts.
"""

from __future__ import annotations

import collections
import numbers
from collections.abc import Mapping, Sequence
from typing import Any, cast

import optree
import torch
from torch import Tensor, nn
from torch._C._functorch import is_functorch_wrapped_tensor

from packfunc.engine import hessian
from packfunc.engine.autodiff import refuse_differentiation
from packfunc.engine.batch_pass import BatchPass, check_pass_arguments, checked_batch_size
from packfunc.engine.model_state import users_forward
from packfunc.engine.statistics import clipped_sums, ggn_statistics, gradient_statistics
from packfunc.engine.vocabulary import Statistic
from packfunc.functionalize import as_index, flatten_params
from packfunc.losses import check_loss_inputs, default_loss, given_targets
from packfunc.specs import QUANTITIES, SPECS, Combine, Cotangents, Quantity, Stats
from packfunc.types import (
    ClippingGroups,
    Inputs,
    MaxNorm,
    ModelFn,
    Params,
    ParamsT,
    Samples,
    Targets,
)

CLIPPING_EPS = 1e-6
"""Added to each norm before dividing, so zero gradients stay finite (as in opacus)."""


def statistic_quantities(quantities: str | Sequence[str]) -> tuple[str, ...]:
    """The requested names as a tuple (one string is one name), each a statistic quantity.

    Args:
        quantities: The ``quantities=`` argument of :func:`packfunc.compute`.

    Returns:
        The names, in order.

    Raises:
        ValueError: for an unknown name; Kronecker factors and products are named
            with the function that computes them.

    Example:
        >>> statistic_quantities("grad")
        ('grad',)
    """
    names = (quantities,) if isinstance(quantities, str) else tuple(quantities)
    unknown = [name for name in names if name not in QUANTITIES]
    if not unknown:
        return names
    own = [name for name in unknown if name in SPECS]
    hint = (
        f" {own} are computed by their own functions: call "
        + ", ".join(f"pf.{name}(...)" for name in own)
        + " instead."
        if own
        else ""
    )
    raise ValueError(
        f"unknown quantities {unknown}; compute() takes names from {list(QUANTITIES)}.{hint}"
    )


_OF_GRADIENTS_ALONE = {"grad", "batch_grad"}
"""The quantities complex parameters have: gradients, without squares or curvature."""


def refuse_complex_squares(params: Params, names: Sequence[str]) -> None:
    """Refuse squares and curvature of complex parameters (gradients themselves are right).

    Their squared norms and moments would need ``|g|²``, not ``g²``, in every closed form,
    and their curvature a convention for complex Hessians: neither is implemented.

    Args:
        params: The parameter pytree.
        names: The requested quantities.

    Raises:
        ValueError: naming the complex leaves and the quantities that remain.

    Example:
        >>> refuse_complex_squares({"w": torch.ones(2)}, ["batch_l2_grad"])
    """
    asked = sorted(set(names) - _OF_GRADIENTS_ALONE)
    tensors: list[object] = optree.tree_leaves(cast(Any, params))  # (others: refused later)
    if not asked or not any(isinstance(t, Tensor) and t.is_complex() for t in tensors):
        return
    leaves, _, leaf_names = flatten_params(params)
    complex_leaves = [n for n, leaf in zip(leaf_names, leaves, strict=True) if leaf.is_complex()]
    if complex_leaves:
        raise ValueError(
            f"{asked} of the complex parameters {complex_leaves} are not supported: packfunc "
            "gives their gradients (grad, batch_grad) only. Pass the real and imaginary "
            "parts as two real parameters (torch.complex(re, im) in model_fn) for the rest."
        )


def compute_batch(
    model_fn: ModelFn,
    params: Params,
    X: Inputs,
    y: Targets,
    names: Sequence[str],
    loss: nn.Module,
    *,
    subsampling: Samples = None,
    mc_samples: int | None = None,
    generator: torch.Generator | None = None,
    chunk_size: int | None = None,
    max_norm: MaxNorm | None = None,
) -> dict[str, Any]:
    """Statistic quantities of one batch (see :func:`packfunc.compute`).

    Args:
        model_fn: ``model_fn(params, X) -> output``.
        params: Pytree of floating-point tensors.
        X: Inputs with leading batch dimension.
        y: Targets with leading batch dimension.
        names: Names from :data:`~packfunc.specs.QUANTITIES`.
        loss: A supported loss module.
        subsampling: Sample indices for the per-sample quantities.
        mc_samples: ``None`` (exact GGN) or the number of Monte-Carlo samples.
        generator: Random generator for the samples.
        chunk_size: Samples per chunk where per-sample tensors are materialized.
        max_norm: The clipping bound of ``clipped_grad``.

    Returns:
        ``{"loss": reduced loss, name: pytree like params, ...}``.

    Example:
        >>> fn, p = packfunc.functional(torch.nn.Linear(3, 2))
        >>> out = compute_batch(fn, p, torch.randn(4, 3), torch.tensor([0, 1, 1, 0]),
        ...                     ("grad", "variance"), torch.nn.CrossEntropyLoss())
        >>> out["variance"]["weight"].shape
        torch.Size([2, 3])
    """
    targets = given_targets(y, "compute")
    if set(names) == {"grad"} and not _differentiated(params, X):
        return plain_gradient(model_fn, params, X, targets, loss, chunk_size)
    refuse_complex_squares(params, names)
    bp = BatchPass(model_fn, params, X, targets, loss, chunk_size)
    with bp.undone_on_refusal():
        found = evaluate(bp, names, subsampling, mc_samples, generator, max_norm, last_use=True)
    for name in names:
        if not SPECS[name].differentiable:
            found[name] = refuse_differentiation(found[name], bp.leaves, name, bp.X)
    return found


def one_quantity(
    name: str,
    model_fn: ModelFn,
    params: ParamsT,
    X: Inputs,
    y: Targets,
    loss: nn.Module | None,
    **options: Any,
) -> ParamsT:
    """One statistic quantity of one batch; the public functions of each quantity call this.

    Args:
        name: A name from :data:`~packfunc.specs.QUANTITIES`.
        model_fn: As in :func:`compute_batch`.
        params: As in :func:`compute_batch`.
        X: As in :func:`compute_batch`.
        y: As in :func:`compute_batch`.
        loss: A supported loss module (``None``: ``CrossEntropyLoss()``).
        **options: Keyword arguments of :func:`compute_batch`.

    Returns:
        The quantity, a pytree like ``params``.

    Example:
        >>> fn, p = packfunc.functional(torch.nn.Linear(3, 2))
        >>> X, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
        >>> one_quantity("grad", fn, p, X, y, None)["bias"].shape
        torch.Size([2])
    """
    names = (name,)
    value = compute_batch(model_fn, params, X, y, names, loss or default_loss(), **options)[name]
    return cast(ParamsT, value)  # a pytree like params


def _differentiated(params: Params, X: Inputs) -> bool:
    """Whether a result must keep its graph: a tensor requires grad, or a transform wraps it.

    Example:
        >>> _differentiated({"w": torch.ones(1)}, torch.ones(2, 1))
        False
    """
    tensors = [t for t in optree.tree_leaves(cast(Any, (params, X))) if isinstance(t, Tensor)]
    grad = torch.is_grad_enabled()
    return any((grad and t.requires_grad) or is_functorch_wrapped_tensor(t) for t in tensors)


def plain_gradient(
    model_fn: ModelFn,
    params: Any,
    X: Inputs,
    y: Tensor,
    loss: nn.Module,
    chunk_size: int | None,
) -> dict[str, Any]:
    """The gradient alone: one forward and one backward, nothing recorded.

    Checks its arguments as :class:`~packfunc.engine.batch_pass.BatchPass` does.

    Args:
        model_fn: As in :func:`compute_batch`.
        params: As in :func:`compute_batch`.
        X: As in :func:`compute_batch`.
        y: As in :func:`compute_batch`.
        loss: A supported loss module.
        chunk_size: Checked only (nothing is chunked).

    Returns:
        ``{"loss": reduced loss, "grad": pytree like params}``.

    Example:
        >>> fn, p = packfunc.functional(torch.nn.Linear(3, 2))
        >>> plain_gradient(fn, p, torch.randn(4, 3), torch.tensor([0, 1, 1, 0]),
        ...                torch.nn.CrossEntropyLoss(), None)["grad"]["weight"].shape
        torch.Size([2, 3])
    """
    check_pass_arguments(model_fn, params, loss, chunk_size)
    leaves, treespec = optree.tree_flatten(params)
    n = checked_batch_size(X, y, loss)
    with torch.enable_grad():
        watched = [leaf.detach().requires_grad_() for leaf in leaves]
        with users_forward():
            output = model_fn(optree.tree_unflatten(treespec, watched), X)
        check_loss_inputs(loss, output, y, n)
        value = loss(output, y)
        grads = torch.autograd.grad(value, watched, allow_unused=True, materialize_grads=True)
    return {"loss": value.detach(), "grad": optree.tree_unflatten(treespec, list(grads))}


def evaluate(
    bp: BatchPass,
    names: Sequence[str],
    subsampling: Samples = None,
    mc_samples: int | None = None,
    generator: torch.Generator | None = None,
    max_norm: MaxNorm | None = None,
    *,
    last_use: bool = False,
) -> dict[str, Any]:
    """Statistic quantities from an existing batch pass (see :func:`compute_batch`).

    Args:
        bp: The batch pass.
        names: Names from :data:`~packfunc.specs.QUANTITIES`.
        subsampling: Sample indices for the per-sample quantities.
        mc_samples: ``None`` (exact GGN) or the number of Monte-Carlo samples.
        generator: Random generator for the samples.
        max_norm: The clipping bound of ``clipped_grad``.
        last_use: Nothing uses ``bp`` afterwards (its graph may be freed by the last pullback).

    Returns:
        As :func:`compute_batch`.

    Example:
        >>> fn, p = packfunc.functional(torch.nn.Linear(3, 2))
        >>> bp = BatchPass(fn, p, torch.randn(4, 3), torch.tensor([0, 1, 1, 0]),
        ...               torch.nn.CrossEntropyLoss())
        >>> evaluate(bp, ("grad",))["grad"]["bias"].shape
        torch.Size([2])
    """
    specs = [QUANTITIES[name] for name in names]
    check_per_sample_loss(specs, bp.loss)
    made = [QUANTITIES[part] for spec in specs for part in spec.parts] + specs
    index = as_index(subsampling, bp.n, bp.record.output.device)
    wanted: dict[Cotangents, set[Statistic]] = {}
    for spec in made:
        if spec.statistic is not None and spec.cotangents is not None:
            wanted.setdefault(spec.cotangents, set()).add(spec.statistic)
    stats = {
        kind: _statistics(
            bp, kind, needed, index, mc_samples, generator, max_norm, last_use and len(wanted) == 1
        )
        for kind, needed in wanted.items()
    }
    values: dict[str, Any] = {}
    for spec in made:
        if spec.name not in values:
            values[spec.name] = optree.tree_unflatten(bp.treespec, _leaf_values(spec, stats, bp.n))
    return {"loss": bp.loss_value} | {name: values[name] for name in names}


def _leaf_values(spec: Quantity, stats: dict[Cotangents, Sequence[Stats]], n: int) -> list[Tensor]:
    """One quantity's value per leaf: its statistic, or (moments) made of its parts."""
    if spec.combine is Combine.MOMENTS:
        assert spec.from_parts is not None and spec.cotangents is not None
        parts = [QUANTITIES[part] for part in spec.parts]
        return [
            spec.from_parts(tuple(_one_value(part, leaf) for part in parts), n)
            for leaf in stats[spec.cotangents]
        ]
    assert spec.cotangents is not None
    return [_one_value(spec, leaf) for leaf in stats[spec.cotangents]]


def _one_value(spec: Quantity, leaf: Stats) -> Tensor:
    """A statistic quantity's value on one leaf (gradient columns: ``K = 1`` dropped)."""
    assert spec.statistic is not None
    value = leaf[spec.statistic]
    if spec.cotangents is Cotangents.GRADIENT and spec.statistic is Statistic.COLUMNS:
        return value[0]  # the one column: the loss gradient
    return value


def _statistics(
    bp: BatchPass,
    kind: Cotangents,
    stats: set[Statistic],
    index: slice | Tensor,
    mc_samples: int | None,
    generator: torch.Generator | None,
    max_norm: MaxNorm | None,
    last: bool,
) -> Sequence[Stats]:
    """Statistics of every leaf for one kind of output cotangents.

    ``last``: no other kind follows, so the loss gradient's pullback may free the graph.
    """
    if kind is Cotangents.GRADIENT:
        return gradient_statistics(bp, stats, index, last=last)
    if kind is Cotangents.CLIPPED_GRADIENT:
        return [{Statistic.SUM: s} for s in clipped_leaf_sums(bp, max_norm, last=last)]
    if kind is Cotangents.HESSIAN:
        return hessian.diagonals(bp, stats, index)
    return ggn_statistics(bp, stats, index, mc_samples, generator)


def check_per_sample_loss(specs: Sequence[Quantity], loss: nn.Module) -> None:
    """Refuse a mean-reduced loss for quantities of each sample's own loss (clipping).

    Args:
        specs: The quantities asked for.
        loss: The loss module.

    Raises:
        ValueError: if one of them needs ``reduction='sum'`` and the loss has another.

    Example:
        >>> check_per_sample_loss([QUANTITIES["grad"]], torch.nn.CrossEntropyLoss())
    """
    needing = [spec.name for spec in specs if spec.per_sample_loss]
    if needing and loss.reduction != "sum":
        raise ValueError(
            f"{needing} clip each sample's gradient of its own loss; with "
            f"reduction={loss.reduction!r} the gradients are scaled by the batch's normalizer. "
            "Pass the loss with reduction='sum' (and divide the result by the batch size "
            "yourself, as DP-SGD does after adding noise)."
        )


def clipped_leaf_sums(
    bp: BatchPass, max_norm: MaxNorm | None, *, last: bool = False
) -> list[Tensor]:
    """Every leaf's clipped sum ``Σ_n g_n · min(1, max_norm / (‖g_n‖ + 1e-6))``.

    The norm of sample ``n``'s gradient is taken over every leaf of ``params``
    together, from the closed forms where layers allow (no ``[N, *p]`` tensor); see
    :func:`~packfunc.engine.statistics.clipped_sums`.

    Args:
        bp: The batch pass.
        max_norm: The bound ``C > 0``, or one bound per leaf (each leaf clipped alone) or per
            group of leaves (clipped by their joint norm): see :func:`clipping_bounds`.
        last: No pullback through ``bp`` follows (its graph is freed as this one goes).

    Returns:
        One clipped sum per leaf.

    Raises:
        ValueError: for a missing or non-positive ``max_norm`` (see :func:`clipping_bounds`).

    Example:
        >>> fn, p = packfunc.functional(torch.nn.Linear(3, 2))
        >>> bp = BatchPass(fn, p, torch.randn(4, 3), torch.tensor([0, 1, 1, 0]),
        ...               torch.nn.CrossEntropyLoss(reduction="sum"))
        >>> [s.shape for s in clipped_leaf_sums(bp, 1.0)]
        [torch.Size([2]), torch.Size([2, 3])]
    """
    bound = clipping_bounds(max_norm, bp.names)
    return clipped_sums(bp, bound, CLIPPING_EPS, last=last)


def clipping_bounds(max_norm: MaxNorm | None, names: list[str]) -> float | ClippingGroups:
    """``max_norm`` checked: one bound, or groups of leaves each with its bound.

    Args:
        max_norm: A real number (a 0-d tensor too); a sequence of them, one per leaf in
            the flattening order of ``params`` (each leaf clipped alone); or a mapping whose
            keys are leaves' names (as :func:`~packfunc.functionalize.flatten_params` names
            them: a dict's keys) or tuples of names (a group, clipped by its joint norm),
            each leaf in one key.
        names: The leaves' names, in order.

    Returns:
        The bound, or the groups in the order of their first leaves.

    Raises:
        TypeError: for another kind of value, or a key that is neither a name nor a tuple.
        ValueError: for a bound that is not positive (NaN included), or keys that do not
            name every leaf exactly once.

    Example:
        >>> clipping_bounds({"w": 1, "b": 2.0}, ["b", "w"])
        [([0], 2.0), ([1], 1.0)]
        >>> clipping_bounds({("w", "b"): 1.0, "c": 0.5}, ["b", "c", "w"])
        [([0, 2], 1.0), ([1], 0.5)]
    """
    _refuse_differentiable_bounds(max_norm)
    if isinstance(max_norm, numbers.Real) or (isinstance(max_norm, Tensor) and max_norm.dim() == 0):
        return _positive([float(max_norm)], max_norm)[0]
    if isinstance(max_norm, Mapping):
        return _named_groups(max_norm, names)
    if isinstance(max_norm, Sequence) and not isinstance(max_norm, str):
        if len(max_norm) != len(names):
            raise ValueError(
                f"max_norm has {len(max_norm)} bounds for {len(names)} parameters ({names}): "
                "pass one number, one per parameter in that order, or a dict {name: bound}."
            )
        bounds = _positive([float(b) for b in max_norm], max_norm)
        return [([leaf], bound) for leaf, bound in enumerate(bounds)]
    if max_norm is None:
        raise ValueError("clipping needs max_norm > 0; got max_norm=None.")
    raise TypeError(
        "max_norm must be a number, a list of numbers (one per parameter) or a dict "
        f"{{name or tuple of names: bound}}; got {type(max_norm).__name__}."
    )


def _named_groups(max_norm: Mapping[Any, Any], names: list[str]) -> ClippingGroups:
    """The groups of a mapping from names, or tuples of names, to bounds (see above)."""
    keys = [(key,) if isinstance(key, str) else key for key in max_norm]
    if not all(isinstance(key, tuple) and all(isinstance(n, str) for n in key) for key in keys):
        raise TypeError(
            "max_norm's keys are parameter names or tuples of them (a group clipped by its "
            f"joint norm); got {list(max_norm)}."
        )
    named = [name for key in keys for name in key]
    missing, unknown = sorted(set(names) - set(named)), sorted(set(named) - set(names))
    twice = sorted(name for name, count in collections.Counter(named).items() if count > 1)
    if missing or unknown or twice:
        raise ValueError(
            f"max_norm names {named}, the parameters are {names}: missing {missing}, unknown "
            f"{unknown}, in two groups {twice}. Give each parameter name one bound (alone, or "
            "in one tuple of names clipped together)."
        )
    bounds = _positive([float(b) for b in max_norm.values()], max_norm)
    index = {name: leaf for leaf, name in enumerate(names)}
    groups = [(sorted(index[name] for name in key), b) for key, b in zip(keys, bounds)]
    return sorted(groups, key=lambda group: group[0][0])


def _refuse_differentiable_bounds(max_norm: object) -> None:
    """Refuse a bound that requires grad: it is read as a number, its derivative lost.

    Example:
        >>> _refuse_differentiable_bounds({"w": torch.tensor(1.0)})  # a constant: fine
    """
    values: list[object] = [max_norm]
    if isinstance(max_norm, Mapping):
        values = list(max_norm.values())
    elif isinstance(max_norm, Sequence) and not isinstance(max_norm, str):
        values = list(max_norm)
    if any(isinstance(b, Tensor) and b.requires_grad for b in values):
        raise ValueError(
            "max_norm requires grad, but the clipping bound is read as a number: its "
            "derivative would be silently zero. Pass max_norm.detach() (or a float); the "
            "clipped sum is not differentiable in the bound."
        )


def _positive(bounds: list[float], given: object) -> list[float]:
    """``bounds`` if every one is positive (NaN is not)."""
    if not bounds or not all(b > 0 for b in bounds):
        raise ValueError(f"clipping needs max_norm > 0; got max_norm={given!r}.")
    return bounds


__all__ = [
    "clipping_bounds",
    "compute_batch",
    "evaluate",
    "one_quantity",
    "plain_gradient",
    "statistic_quantities",
]
