"""The engine: per-sample gradients of every parameter leaf, from the cheapest source.

:class:`PerSampleGradients` runs discovery and the batch pass once, then
answers per leaf: closed forms from the rules for tapped leaves, per-sample
gradients in chunks (tapped or generic) otherwise, zeros for unused leaves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from packfunc.engine import generic
from packfunc.engine.memory import chunk_length, index_length, split_index
from packfunc.engine.ops import TapCall
from packfunc.engine.rules import RULES, Rule
from packfunc.engine.taps import TapPlan, TapRecord, discover, record
from packfunc.functional import batch_size, flatten_params, select_samples
from packfunc.losses import check_loss


@dataclass(frozen=True)
class Term:
    """One tapped call's contribution to a leaf's gradient, in the rule's canonical layout."""

    rule: Rule
    x: Tensor
    g: Tensor
    call: TapCall


def _merge(terms: list[Term]) -> list[Term]:
    """Concatenate the terms of several calls of one rule along its positions dim."""
    rule, dim = terms[0].rule, terms[0].rule.merge_dim
    if len(terms) == 1 or dim is None or any(t.rule is not rule for t in terms):
        return terms
    if len({(t.call.options, t.x.dtype, t.x.shape[:dim], t.g.shape[:dim]) for t in terms}) != 1:
        return terms
    x = torch.cat([t.x for t in terms], dim=dim)
    g = torch.cat([t.g for t in terms], dim=dim)
    return [Term(rule, x, g, terms[0].call)]


class PerSampleGradients:
    """Per-sample gradients of ``loss(model_fn(params, X), y)``, one leaf at a time.

    Args:
        model_fn: ``model_fn(params, X) -> output``.
        params: Pytree of floating-point tensors.
        X: Inputs (tensor or pytree) with leading batch dimension.
        y: Targets with leading batch dimension.
        loss: A supported ``torch.nn`` loss module.
        chunk_size: Samples per chunk when per-sample gradients are materialized
            (``None``: automatic).

    Example:
        >>> fn, p = packfunc.functional(torch.nn.Linear(3, 2))
        >>> grads = PerSampleGradients(fn, p, torch.randn(4, 3), torch.tensor([0, 1, 1, 0]),
        ...                            torch.nn.CrossEntropyLoss())
        >>> grads.batch_grad(grads.names.index("weight"), slice(0, 4)).shape
        torch.Size([4, 2, 3])
    """

    def __init__(self, model_fn: Callable, params: Any, X: Any, y: Tensor, loss: nn.Module,
                 chunk_size: int | None = None):
        check_loss(loss)
        chunk_length(1, 1, chunk_size)  # validates chunk_size before any work
        self.leaves, self.treespec, self.names = flatten_params(params)
        self.n = batch_size(X)
        self.model_fn, self.X, self.chunk_size = model_fn, X, chunk_size
        plan = discover(model_fn, params, self.leaves, select_samples(X, slice(0, 1)))
        self.record = record(model_fn, params, self.leaves, plan, X, y, loss, self.n)
        self.generic = sorted(plan.uncovered | self._leaves_of(plan, self.record.failed))
        self.terms = self._collect_terms(plan, self.record)

    @property
    def loss(self) -> Tensor:
        """The reduced loss of the batch."""
        return self.record.loss

    def _leaves_of(self, plan: TapPlan, sites: set[int]) -> set[int]:
        return {leaf for k in sites for _, leaf in plan.sites[k].call.leaves}

    def _collect_terms(self, plan: TapPlan, rec: TapRecord) -> dict[int, list[Term]]:
        by_leaf: dict[int, list[Term]] = {}
        for k, x in rec.inputs.items():
            call = plan.sites[k].call
            for role, leaf in call.leaves:
                if leaf in self.generic:
                    continue
                rule = RULES[(call.family, role)]
                cx, cg = rule.canonical(x, rec.cotangents[k], call, self.leaves[leaf])
                by_leaf.setdefault(leaf, []).append(Term(rule, cx, cg, call))
        return {leaf: _merge(terms) for leaf, terms in by_leaf.items()}

    def closed_form(self, leaf: int, quantity: str) -> Tensor | None:
        """Return ``grad``, ``sum_grad_squared`` or ``batch_l2`` of a leaf in closed form.

        Args:
            leaf: Leaf index.
            quantity: ``"grad"``, ``"sum_grad_squared"`` or ``"batch_l2"``.

        Returns:
            The quantity, or ``None`` if it needs materialized per-sample gradients.
        """
        if leaf in self.generic:
            return None
        terms, param = self.terms.get(leaf, []), self.leaves[leaf]
        if not terms:
            return _zeros_of(param, quantity, self.n)
        if quantity == "grad":
            return sum(t.rule.grad(t.x, t.g, t.call, param) for t in terms)
        if len(terms) != 1:
            return None
        (t,) = terms
        return getattr(t.rule, quantity)(t.x, t.g, t.call, param)

    def batch_grad(self, leaf: int, index: slice | Tensor) -> Tensor:
        """Per-sample gradients ``[n, *leaf.shape]`` of a tapped or unused leaf.

        Args:
            leaf: Leaf index (not generic).
            index: Samples to compute.

        Returns:
            The per-sample gradients of those samples.
        """
        param = self.leaves[leaf]
        terms = self.terms.get(leaf)
        if not terms:
            return param.new_zeros((index_length(index), *param.shape))
        grads = [t.rule.batch_grad(t.x[index], t.g[index], t.call, param) for t in terms]
        return grads[0] if len(grads) == 1 else sum(grads)

    def iter_batch_grads(self, wanted: list[int], index: slice | Tensor) -> Iterator[list[Tensor]]:
        """Yield per-sample gradients of ``wanted`` leaves for chunks of ``index``.

        Generic leaves come from one shared vmap pass per chunk; the others from
        their rules.

        Args:
            wanted: Leaf indices, all generic or all non-generic.
            index: Samples to compute.

        Yields:
            Per chunk, one ``[chunk, *leaf.shape]`` tensor per wanted leaf.
        """
        numel = sum(self.leaves[i].numel() for i in wanted)
        length = chunk_length(index_length(index), numel, self.chunk_size)
        for chunk in split_index(index, length):
            if wanted and wanted[0] in self.generic:
                yield generic.per_sample_grads(self.model_fn, self.leaves, self.treespec, wanted,
                                               self.X, self.record.output_cotangent, chunk)
            else:
                yield [self.batch_grad(i, chunk) for i in wanted]


def _zeros_of(param: Tensor, quantity: str, n: int) -> Tensor:
    """Quantities of a leaf the loss does not depend on."""
    return param.new_zeros(n) if quantity == "batch_l2" else torch.zeros_like(param)
