"""The engine: column gradients of every parameter leaf, from the cheapest source.

:class:`BatchPass` runs discovery and the batch pass once per ``(model_fn,
params, X, y, loss)``. :meth:`BatchPass.columns` then pulls any stack of output
cotangents ``[K, N, ...]`` back through it — the loss gradient (``K = 1``,
first order) or the columns of the loss Hessian's square root (the GGN) — and
returns :class:`ColumnGradients`, which answers per leaf: closed forms from the
rules for tapped and local sites, column gradients in chunks (from the rules or
the whole-model path) otherwise, zeros for unused leaves.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import cached_property, partial
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch._C._functorch import is_functorch_wrapped_tensor

from packfunc.engine import whole_model
from packfunc.engine.batch_record import BatchRecord, PlanMismatch, SiteConsumer, record
from packfunc.engine.discovery import (
    Plan,
    RowsNotAloneError,
    cached_discover,
    check_rows_alone,
    forget_plan,
    last_sample_plan,
)
from packfunc.engine.memory import (
    OUTPUT_CHUNK_BUDGET,
    chunk_length,
    index_length,
    is_plain,
    new_output,
    split_index,
)
from packfunc.engine.model_state import (
    attribute_restorer,
    buffer_restorer,
    made_in_a_pass,
    users_forward,
)
from packfunc.engine.ops import SiteCall
from packfunc.engine.precision import for_squares, to_dtype_of
from packfunc.engine.randomness import DEFAULT_GENERATOR_DRAW, GeneratorMark, refuse_rerun
from packfunc.engine.rules import Rule, rule_for
from packfunc.engine.rules.base import Route
from packfunc.engine.tied import tied_gram_is_cheaper, tied_squared_norms
from packfunc.engine.vocabulary import SQUARED, Statistic
from packfunc.functionalize import (
    batch_size,
    check_model_arguments,
    flatten_params,
    module_of,
    refuse_unsplittable_inputs,
)
from packfunc.losses import check_loss, check_target_batch
from packfunc.types import ModelFn

_VMAPPED_COLUMNS = 32
"""Above this many columns, one vmapped pullback beats a loop of pullbacks.

A loop pays Python overhead per column; vmap pays batching rules, which for
convolutional nets (max-pooling, convolution backward) copy the activations:
3x slower per column on the benchmark CNN, while on an MLP vmap is slightly
faster. Convolutional models below this many columns therefore loop.
"""


_ADDITIVE = frozenset({Statistic.COLUMNS, Statistic.SUM})
"""Statistics that add up over the calls of a leaf."""

ReusedRecord = Callable[[Plan, list[Tensor], nn.Module, Any, int], BatchRecord | None]
"""``reuse(plan, leaves, loss, y, n)``: the record of a forward pass that already ran, or
``None`` if that pass does not fit the plan (see :class:`BatchPass`)."""


@dataclass(frozen=True)
class Term:
    """One tapped call's contribution to a leaf's gradient.

    ``x`` and ``g`` are the call's recorded input ``[N, ...]`` and cotangents
    ``[K, N, ...]``, or (in :meth:`ColumnGradients.leaf_terms`) these in the rule's
    canonical layout.
    """

    rule: Rule
    x: Tensor
    g: Tensor
    call: SiteCall


def sites_by_leaf(plan: Plan, sites: Iterable[int]) -> dict[int, list[int]]:
    """Leaf -> those of ``sites`` whose call uses it, in the order given.

    Args:
        plan: The plan the sites belong to.
        sites: Site indices.

    Returns:
        The sites of each leaf some site uses.
    """
    found: dict[int, list[int]] = {}
    for k in sites:
        for _, leaf in plan.sites[k].call.leaves:
            found.setdefault(leaf, []).append(k)
    return found


def canonical_term(term: Term, param: Tensor) -> Term:
    """A recorded term in its rule's canonical layout.

    Args:
        term: A call's recorded input and cotangents.
        param: The leaf.

    Returns:
        The term with canonical ``x`` and ``g``.

    Example:
        >>> from packfunc.engine.ops import SIGNATURES
        >>> call = SiteCall(SIGNATURES[F.linear], (("weight", 0),), ())
        >>> term = Term(rule_for(call, "weight"), torch.ones(4, 3), torch.ones(1, 4, 2), call)
        >>> canonical_term(term, torch.ones(2, 3)).x.shape
        torch.Size([1, 4, 1, 3, 1])
    """
    return Term(term.rule, *term.rule.canonical(term.x, term.g, term.call, param), term.call)


def _merge(terms: list[Term]) -> list[Term]:
    """Combine the terms of several calls of one rule into one term, where the rule can."""
    rule = terms[0].rule
    if len(terms) == 1 or any(t.rule is not rule for t in terms):
        return terms
    merged = rule.merge([t.x for t in terms], [t.g for t in terms], [t.call.options for t in terms])
    return terms if merged is None else [Term(rule, *merged, terms[0].call)]


def check_pass_arguments(
    model_fn: ModelFn, params: Any, loss: nn.Module, chunk_size: int | None
) -> None:
    """Check a model function, its params, the loss and ``chunk_size`` before any work.

    Args:
        model_fn: ``model_fn(params, X) -> output``.
        params: Pytree of floating-point tensors.
        loss: The loss module.
        chunk_size: Samples per chunk, or ``None``.

    Raises:
        TypeError, ValueError: naming what to pass instead.

    Example:
        >>> check_pass_arguments(lambda p, X: X, {}, torch.nn.MSELoss(), None)
    """
    check_model_arguments(model_fn, params)
    check_loss(loss)
    chunk_length(1, 1, chunk_size)


def refuse_empty_leaves(leaves: list[Tensor], names: list[str]) -> None:
    """Refuse parameters without values: no elements (``nn.Linear(d, 0)``), or on ``meta``.

    Args:
        leaves: The parameter leaves.
        names: Their names.

    Raises:
        ValueError: naming the first such leaf and what to do with it.

    Example:
        >>> refuse_empty_leaves([torch.ones(2)], ["w"])
    """
    for name, leaf in zip(names, leaves):
        if leaf.is_meta:
            raise ValueError(
                f"params leaf {name!r} is on the meta device: it has a shape but no values. "
                "Materialize the model first (model.to_empty(device=...) and initialize or "
                "load its weights)."
            )
        if leaf.numel() == 0:
            raise ValueError(
                f"params leaf {name!r} has no elements (shape {tuple(leaf.shape)}): its "
                "quantities would be empty, and packfunc's layer rules do not run layers "
                "without parameters. Leave it out of params (pf.functional's model_fn reads "
                "the leaves left out from the module; in the shim, requires_grad_(False))."
            )


def checked_batch_size(X: Any, y: Any, loss: nn.Module) -> int:
    """The batch size of ``X``, its inputs and the targets checked before the model runs.

    Args:
        X: The inputs, a tensor or a pytree with leading batch dimension.
        y: The targets (their leading size must be the batch size).
        loss: The loss, checked by :func:`~packfunc.losses.check_loss`.

    Returns:
        The batch size ``N``.

    Raises:
        ValueError: for sparse or nested inputs, inputs of several leading sizes, an
            empty batch, or targets of another batch size.

    Example:
        >>> checked_batch_size(torch.zeros(4, 3), torch.zeros(4), torch.nn.MSELoss())
        4
    """
    refuse_unsplittable_inputs(X)
    n = batch_size(X)
    check_target_batch(loss, y, n)
    return n


_REUSED_ROWS = (
    "Here the rows are those of a forward pass that ran before (packfunc.compat): a parameter "
    "changed through .data between that forward pass and the backward pass differs the same "
    "way; change parameters after the backward pass."
)
"""Added to a refusal of :func:`check_rows_alone` for a reused record."""


def check_rerun(plan: Plan, rerun: str) -> None:
    """Refuse to run a model again if it draws random numbers or changes a buffer or input.

    Another run would not see the values of the forward pass whose loss is reported.

    Args:
        plan: The model's plan.
        rerun: What would run it, for the message (e.g. ``"the whole-model path"``).

    Raises:
        RandomModelError: if discovery saw the model draw random numbers.
        ValueError: if discovery saw its forward change a buffer or its input.

    Example:
        >>> from packfunc.engine.discovery import discover
        >>> fn, p = packfunc.functional(torch.nn.Linear(3, 2))
        >>> check_rerun(discover(fn, p, list(p.values()), torch.ones(1, 3)), "a re-run")
    """
    refuse_rerun(plan.random, rerun)
    if plan.updated_buffer is not None:
        raise ValueError(
            f"the model changes its buffer {plan.updated_buffer!r} in its forward pass "
            f"(a running statistic, spectral norm's power iteration), and {rerun} runs it "
            "again, which would see other values than the forward pass whose loss is "
            "reported. Call model.eval() before computing this, or request only parameters "
            "on op-local paths (pf.explain shows each parameter's path)."
        )
    if plan.updated_input:
        raise ValueError(
            f"the model changes its input in place in its forward pass, and {rerun} runs it "
            "again on the changed input, which would give other values than the forward "
            "pass whose loss is reported. Change it out of place in the forward (x = x * 2, "
            "not x.mul_(2)), or request only parameters on op-local paths (pf.explain shows "
            "each parameter's path)."
        )


_OTHER_SAMPLES = 7
"""How many other samples' paths a batch whose calls follow no discovered plan tries."""


def other_samples(n: int) -> list[int]:
    """Samples besides the first to discover on: the last, and others spread in between.

    Example:
        >>> other_samples(2), other_samples(100)
        ([1], [99, 1, 17, 34, 50, 66, 83])
    """
    if n < 2:
        return []
    spread = torch.linspace(1, n - 1, min(_OTHER_SAMPLES, n - 1)).round().long().tolist()
    return [n - 1, *[i for i in dict.fromkeys(spread) if i != n - 1]]


class BatchPass:
    """Discovery and the batch pass of ``loss(model_fn(params, X), y)``.

    Args:
        model_fn: ``model_fn(params, X) -> output``.
        params: Pytree of floating-point tensors.
        X: Inputs (tensor or pytree) with leading batch dimension.
        y: Targets with leading batch dimension.
        loss: A supported ``torch.nn`` loss module.
        chunk_size: Samples per chunk when column gradients are materialized
            (``None``: automatic).
        reuse: A record of a forward pass that already ran, or ``None``:
            ``reuse(plan, leaves, loss, y, n)`` returns its
            :class:`~packfunc.engine.batch_record.BatchRecord`, or ``None`` if that pass does
            not fit the plan (packfunc then runs its own).

    Attributes:
        keeps_loss: ``False`` where nothing reads :attr:`loss_value`: a last pullback of
            other cotangents than ``∂L/∂output`` then lets the output go without taking
            the loss.
        reran: Whether a ``reuse`` was given but packfunc ran its own pass (the caller
            may check its output against the reused pass's).

    Example:
        >>> fn, p = packfunc.functional(torch.nn.Linear(3, 2))
        >>> bp = BatchPass(fn, p, torch.randn(4, 3), torch.tensor([0, 1, 1, 0]),
        ...               torch.nn.CrossEntropyLoss())
        >>> bp.gradient_columns().leaf_columns(bp.names.index("weight"), slice(0, 4)).shape
        torch.Size([1, 4, 2, 3])
    """

    def __init__(
        self,
        model_fn: ModelFn,
        params: Any,
        X: Any,
        y: Tensor,
        loss: nn.Module,
        chunk_size: int | None = None,
        reuse: ReusedRecord | None = None,
    ):
        check_pass_arguments(model_fn, params, loss, chunk_size)
        self.leaves, self.treespec, self.names = flatten_params(params)
        refuse_empty_leaves(self.leaves, self.names)
        self.n = checked_batch_size(X, y, loss)
        self.model_fn, self.params, self.X, self.y, self.loss = model_fn, params, X, y, loss
        self.chunk_size = chunk_size
        self.keeps_loss = True
        self.reran = False
        self.plan, cached = cached_discover(model_fn, params, self.leaves, X)
        self._cached = cached
        mark = GeneratorMark(self.leaves)
        # a refusal after this pass leaves the buffers and attributes it changed as they were
        self._restore_buffers = (
            buffer_restorer(module_of(model_fn)) if self.plan.updated_buffer else None
        )
        # (in the shim, the user's forward ran: packfunc's own pass puts back what it sets)
        self._put_back = attribute_restorer(module_of(model_fn) if reuse is None else None)
        try:
            self.record = self._recorded(reuse, mark)
            if mark.moved():
                self.plan.note_random(DEFAULT_GENERATOR_DRAW)
            # what the user's forward sets stays, but not the tensors the pass made
            self._put_back(made_in_a_pass)
            last = partial(last_sample_plan, model_fn, params, self.leaves, X, self.n)
            recorded = set(self.record.inputs)  # (sites whose rows moved are taken out)
            checked = check_rows_alone(self.plan, self.record.output, last, self.record.inputs)
            self.record.failed |= recorded - set(self.record.inputs)
        except RowsNotAloneError as error:  # (the plan is kept: it refuses every later pass)
            self._undo()
            if reuse is None:
                raise
            raise RowsNotAloneError(f"{error} {_REUSED_ROWS}") from None
        except BaseException:
            self._undo()
            if self.plan.first_output is not None:  # unchecked: the next call discovers again
                forget_plan(model_fn)
            raise
        if not checked and self.n == 1:  # kept for batches of one, which need no check
            self.plan.one_sample_only = True
        elif not checked or self.plan.mixes is not None:
            # (unchecked under vmap: discovered again until checked; a reduction over the
            # batch that reaches the output: checked again on every batch)
            forget_plan(model_fn)
        failed = {leaf for k in self.record.failed for _, leaf in self.plan.sites[k].call.leaves}
        self.whole_model = sorted(self.plan.uncovered | failed)
        self._convolutional = any(
            site.call.op is not None and site.call.op.is_convolution for site in self.plan.sites
        )

    def _recorded(self, reuse: ReusedRecord | None, mark: GeneratorMark) -> BatchRecord:
        """The batch pass's record, with a plan the batch's calls follow.

        A cached plan the code does not follow is discovered again; where the batch does not
        follow the first sample's path either (code that skips a padding mask for a sample
        without padding, run on a batch with some), a few other samples' paths are tried.
        """
        try:
            return self._batch_pass(reuse)
        except PlanMismatch as mismatch:
            samples = ([0] if self._cached else []) + other_samples(self.n)
            for sample in samples:
                forget_plan(self.model_fn)  # the code took another path: discover it again
                mark.rewind()  # and run it on the random numbers the stopped pass began with
                self._put_back()  # and on the attributes it began with
                self.plan, self._cached = cached_discover(
                    self.model_fn, self.params, self.leaves, self.X, sample
                )
                with contextlib.suppress(PlanMismatch):
                    return self._batch_pass(reuse)
            raise mismatch

    def _batch_pass(self, reuse: ReusedRecord | None) -> BatchRecord:
        """The reused record if its forward pass fits the plan, else that of packfunc's own pass."""
        reused = reuse(self.plan, self.leaves, self.loss, self.y, self.n) if reuse else None
        if reused is None and reuse is not None and self._cached:
            # the recorded forward may have taken another path than the cached plan's one
            forget_plan(self.model_fn)
            self.plan, self._cached = cached_discover(
                self.model_fn, self.params, self.leaves, self.X
            )
            reused = reuse(self.plan, self.leaves, self.loss, self.y, self.n)
        if reused is not None:
            return reused
        if reuse is not None:
            self.check_rerun(
                "packfunc's own pass (the recorded forward pass cannot be reused: a "
                "recurrent or attention layer, reentrant activation checkpointing, whose "
                "use_reentrant=False keeps the forward, or calls packfunc runs differently)"
            )
            self.reran = True
        with contextlib.nullcontext() if reuse is not None else users_forward(self._put_back):
            return record(
                self.model_fn,
                self.params,
                self.leaves,
                self.plan,
                self.X,
                self.y,
                self.loss,
                self.n,
            )

    def check_rerun(self, rerun: str) -> None:
        """:func:`check_rerun` of this pass's plan.

        A refusal puts back the buffers and attributes this pass changed: the call changes
        nothing.

        Args:
            rerun: What would run it, for the message (e.g. ``"the whole-model path"``).
        """
        try:
            check_rerun(self.plan, rerun)
        except Exception:  # RandomModelError, ValueError
            self._undo()
            raise

    def _undo(self) -> None:
        """Put back the buffers and attributes this pass changed (it is refused)."""
        if self._restore_buffers is not None:
            self._restore_buffers()
        self._put_back()

    @contextlib.contextmanager
    def undone_on_refusal(self) -> Iterator[BatchPass]:
        """Put back what this pass set on the model if the block raises (a refusal).

        Refusals change nothing: a running statistic the batch pass updated goes back when
        a quantity of it is refused (a parameter without Kronecker factors, say).

        Example:
            >>> fn, p = packfunc.functional(torch.nn.Linear(3, 2))
            >>> bp = BatchPass(fn, p, torch.randn(4, 3), torch.tensor([0, 1, 1, 0]),
            ...                torch.nn.CrossEntropyLoss())
            >>> with bp.undone_on_refusal():
            ...     bp.n
            4
        """
        try:
            yield self
        except Exception:
            self._undo()
            raise

    @property
    def loss_value(self) -> Tensor:
        """The reduced loss of the batch."""
        return self.record.loss

    def single_call_sites(self) -> set[int]:
        """The recorded sites each of whose leaves is used there only (and by no other path).

        Returns:
            Site indices.
        """
        sites_of = sites_by_leaf(self.plan, self.record.inputs)
        return {
            k
            for k in self.record.inputs
            if all(
                sites_of[leaf] == [k] and leaf not in self.whole_model
                for _, leaf in self.plan.sites[k].call.leaves
            )
        }

    def site_terms(self, k: int, g: Tensor) -> list[tuple[int, Term]]:
        """Each leaf of a recorded site with its term: the recorded input and cotangents ``g``.

        Both in the parameters' dtype (recorded in bfloat16 under autocast), not canonical.

        Args:
            k: A recorded site.
            g: Cotangents of the site's output ``[K, N, ...]``.

        Returns:
            ``[(leaf, term), ...]`` in the call's order of roles.

        Example:
            >>> fn, p = packfunc.functional(torch.nn.Linear(3, 2))
            >>> bp = BatchPass(fn, p, torch.randn(4, 3), torch.tensor([0, 1, 1, 0]),
            ...               torch.nn.CrossEntropyLoss())
            >>> [(leaf, term.g.shape) for leaf, term in bp.site_terms(0, torch.ones(1, 4, 2))]
            [(1, torch.Size([1, 4, 2])), (0, torch.Size([1, 4, 2]))]
        """
        call, x = self.plan.sites[k].call, self.record.inputs[k]
        param = self.leaves[call.leaves[0][1]]  # its weight and bias share a dtype
        # a local site's rule receives the recorded call (LocalInputs) as its input
        x = to_dtype_of(x, param) if isinstance(x, Tensor) else x
        g = to_dtype_of(g, param)
        return [
            (leaf, Term(rule_for(call, role), cast(Tensor, x), g, call))
            for role, leaf in call.leaves
        ]

    def column_width(self) -> int:
        """Elements one column of one sample occupies at the output and the recorded calls."""
        sites = sum(self.plan.sites[k].tail.numel() for k in self.record.inputs)
        return sites + self.record.output[0].numel()

    def gradient_columns(
        self, *, last: bool = False, consume: SiteConsumer | None = None
    ) -> ColumnGradients:
        """Column gradients for the loss gradient: ``K = 1``, per-sample gradients.

        Args:
            last: No pullback follows: the recorded graph may be freed as this one goes.
            consume: With ``last``, receives each site's cotangent (during the pullback
                where it can) and returns what the column gradients keep of it.

        Returns:
            The :class:`ColumnGradients`.
        """
        if last and self.record.inputs and not self.whole_model:
            self.record.release_output()  # before the loss gradient: the logits go there
        cotangent = self.record.output_cotangent
        return self.columns(cotangent.unsqueeze(0), last=last, consume=consume)

    def columns(
        self, cotangents: Tensor, *, last: bool = False, consume: SiteConsumer | None = None
    ) -> ColumnGradients:
        """Pull a stack of output cotangents ``[K, N, ...]`` back through the batch pass.

        Args:
            cotangents: ``K`` output cotangents for the whole batch.
            last: No pullback follows (``K = 1``): the recorded graph and the output may
                be freed as this one goes.
            consume: With ``last``, receives each site's cotangent ``[N, ...]`` (during the
                pullback where it can) and returns what the column gradients keep of it.

        Returns:
            The :class:`ColumnGradients` of every leaf.
        """
        columns = cotangents.shape[0]
        if last and columns == 1 and self.record.inputs:
            if not self.whole_model:  # (the loss gradient, if wanted, was taken before)
                self.record.release_output(gradient=False, loss=self.keeps_loss)
            found = self.record.last_pullback(cotangents[0], consume)
            sites = {k: g[None] for k, g in found.items()}
            return ColumnGradients(self, cotangents, sites, owns_record=True)
        if not self.record.inputs:
            sites = {}
        elif columns == 1:
            sites = {k: g[None] for k, g in self.record.pullback(cotangents[0]).items()}
        elif columns > _VMAPPED_COLUMNS or not self._convolutional:
            sites = self.record.pullback_columns(cotangents)
        else:
            pulled = [self.record.pullback(column) for column in cotangents.unbind(0)]
            sites = {k: _stack([found[k] for found in pulled]) for k in pulled[0]}
        return ColumnGradients(self, cotangents, sites)


class ColumnGradients:
    """Column gradients ``J_nᵀ c_{k,n}`` of every leaf for output cotangents ``c [K, N, ...]``.

    Args:
        backprop: The batch pass.
        cotangents: Output cotangents ``[K, N, ...]``.
        sites: Their pullback to every recorded tapped call, ``[K, N, ...]`` each.
        weights: Per-sample weights the output cotangents are scaled by, when they are
            first needed (the whole-model path): ``sites`` are scaled already.
        owns_record: Nothing uses the batch pass's record after these column gradients:
            :meth:`release` may drop its recorded inputs.
    """

    def __init__(
        self,
        backprop: BatchPass,
        cotangents: Tensor,
        sites: dict[int, Tensor],
        weights: Tensor | None = None,
        *,
        owns_record: bool = False,
    ):
        self.bp, self._cotangents, self._weights = backprop, cotangents, weights
        self.owns_record = owns_record
        self.count = cotangents.shape[0]
        self.sites = sites
        self.recorded = self._recorded_calls(sites)
        self._canonical: dict[int, list[Term]] = {}
        self._leaf_sites: dict[int, list[int]] | None = None

    @cached_property
    def cotangents(self) -> Tensor:
        """The output cotangents ``[K, N, ...]`` (scaled by the weights, if any)."""
        if self._weights is None:
            return self._cotangents
        return _scaled(self._cotangents, self._weights)

    def reweighted(
        self, weights: Tensor, leaves: list[int], *, in_place: bool = False
    ) -> ColumnGradients:
        """The column gradients of the output cotangents with sample ``n``'s scaled by ``w[n]``.

        Every recorded call's cotangent keeps the samples at dim 1 (``[K, N, ...]``), so
        scaling its rows is the pullback of the scaled output cotangents: no second
        backward pass. ``Σ_n w[n] g_n`` is then the :attr:`~Statistic.SUM` statistic.

        Args:
            weights: One weight per sample, ``[N]``.
            leaves: The leaves whose statistics will be asked (only their calls' cotangents
                are scaled).
            in_place: Scale the recorded cotangents in place (this object is not used
                again) where one shares its memory with no other and not with the output
                cotangents (unless the record is owned and the whole-model path does not
                read them); the others are scaled copies.

        Returns:
            The reweighted :class:`ColumnGradients`.
        """
        wanted = set(leaves)
        needed = [
            k
            for k in self.sites
            if any(leaf in wanted for _, leaf in self.bp.plan.sites[k].call.leaves)
        ]
        # an owned record's output cotangent is not read again unless the whole-model path does
        shared = self.cotangents if not self.owns_record or self.bp.whole_model else None
        mine = _alone([self.sites[k] for k in needed], shared) if in_place else []
        alone = {needed[i] for i in mine}
        sites = {k: _scaled(self.sites[k], weights, in_place=k in alone) for k in needed}
        result = ColumnGradients(
            self.bp, self.cotangents, sites, weights, owns_record=self.owns_record
        )
        for leaf in set(result.recorded) - wanted:  # (a bias whose weight is wanted)
            del result.recorded[leaf]
        return result

    def release(self, leaf: int) -> None:
        """Forget a leaf whose statistics are taken.

        A call no remaining leaf uses frees its cotangent, and its recorded input too
        where the record is owned.

        Args:
            leaf: Leaf index; its statistics are not asked again.
        """
        self.recorded.pop(leaf, None)
        self._canonical.pop(leaf, None)
        calls = self.bp.plan.sites
        for k in self._sites_of().get(leaf, ()):
            if k in self.sites and not any(i in self.recorded for _, i in calls[k].call.leaves):
                del self.sites[k]
                if self.owns_record:
                    self.bp.record.inputs.pop(k, None)

    def _sites_of(self) -> dict[int, list[int]]:
        """Leaf -> the sites given to these column gradients that use it, in their order.

        Found once: :meth:`release` is called for every leaf.
        """
        if self._leaf_sites is None:
            self._leaf_sites = sites_by_leaf(self.bp.plan, self.sites)
        return self._leaf_sites

    def _recorded_calls(self, sites: dict[int, Tensor]) -> dict[int, list[Term]]:
        """Each tapped leaf's calls with their recorded input and cotangents, not canonicalized."""
        by_leaf: dict[int, list[Term]] = {}
        inputs = self.bp.record.inputs
        # in call order (the record's); only those given (a reweighted subset, one site)
        for k in sorted(k for k in sites if k in inputs):
            for leaf, term in self.bp.site_terms(k, sites[k]):
                if leaf not in self.bp.whole_model:
                    by_leaf.setdefault(leaf, []).append(term)
        return by_leaf

    @property
    def terms(self) -> dict[int, list[Term]]:
        """Every tapped leaf's terms in its rule's canonical layout (see :meth:`leaf_terms`)."""
        return {leaf: self.leaf_terms(leaf) for leaf in self.recorded}

    def leaf_terms(self, leaf: int) -> list[Term]:
        """A leaf's terms in its rule's canonical layout, canonicalized on first use.

        Args:
            leaf: Leaf index.

        Returns:
            One term per call, or one for several calls the rule merges; ``[]`` if unused.
        """
        if leaf not in self._canonical:
            param = self.bp.leaves[leaf]
            terms = [canonical_term(c, param) for c in self.recorded.get(leaf, [])]
            self._canonical[leaf] = _merge(terms) if terms else []
        return self._canonical[leaf]

    def _route(self, leaf: int, stat: Statistic) -> Route:
        """Where a tapped leaf's statistic comes from: every call's rule must agree.

        Calls' statistics from the recorded call add up only for additive statistics.
        """
        calls, param = self.recorded[leaf], self.bp.leaves[leaf]
        if len(calls) == 1:
            (c,) = calls
            return c.rule.route(stat, c.x, c.g, c.call, param)
        routes = {c.rule.route(stat, c.x, c.g, c.call, param) for c in calls}
        route = routes.pop() if len(routes) == 1 else Route.CANONICAL
        if route is Route.CALL and len(calls) > 1 and stat not in _ADDITIVE:
            return Route.CANONICAL
        return route

    def _samples(self, term: Term, index: slice | Tensor, x_dim: int = 1) -> tuple[Tensor, Tensor]:
        """A term's input and cotangents restricted to ``index`` (themselves for the batch).

        ``x_dim``: the input's sample dim (1 canonical, 0 as recorded). A recorded call's
        arguments are not rebuilt for the whole batch.
        """
        if isinstance(index, slice) and index == slice(0, self.bp.n):
            return term.x, term.g
        x = term.x[index] if x_dim == 0 else term.x[:, index]
        return x, term.g[:, index]

    def _operands(
        self, stat: Statistic, term: Term, index: slice | Tensor, x_dim: int = 1
    ) -> tuple[Tensor, Tensor]:
        """:meth:`_samples` for ``stat``: float16 ones in float32 where it is made of squares.

        (:func:`~packfunc.engine.precision.for_squares`; :meth:`closed_form` brings the
        result back to the parameter's dtype.)
        """
        x, g = self._samples(term, index, x_dim)
        if stat in SQUARED and isinstance(x, Tensor):  # (not an op-local rule's inputs)
            return for_squares(x), for_squares(g)
        return x, g

    def _from_calls(self, leaf: int, stat: Statistic, index: slice | Tensor) -> Tensor:
        """A statistic :meth:`_route` sends to the recorded calls, summed over them."""
        param = self.bp.leaves[leaf]
        return _total(
            [
                c.rule.from_call(stat, *self._operands(stat, c, index, x_dim=0), c.call, param)
                for c in self.recorded[leaf]
            ]
        )

    def closed_form(
        self, leaf: int, stat: Statistic, index: slice | Tensor, *, wide: bool = False
    ) -> Tensor | None:
        """Return a statistic of a leaf in closed form, or ``None``.

        Args:
            leaf: Leaf index.
            stat: Any statistic but :attr:`~Statistic.COLUMNS`.
            index: Samples the statistic covers.
            wide: Squares of a float16 leaf stay in float32 (DP's norms fit where their
                squares overflow float16).

        Returns:
            The statistic (in the leaf's dtype, or wider with ``wide``), or ``None`` if it
            needs materialized column gradients.
        """
        found = self._closed_form(leaf, stat, index)
        if found is None or stat not in SQUARED or wide:
            return found
        return found.to(self.bp.leaves[leaf].dtype)

    def _closed_form(self, leaf: int, stat: Statistic, index: slice | Tensor) -> Tensor | None:
        """:meth:`closed_form`, squares of float16 operands in float32 (:meth:`_operands`)."""
        if leaf in self.bp.whole_model:
            return None
        param = self.bp.leaves[leaf]
        if leaf not in self.recorded:
            return _zeros_of(param, stat, index_length(index))
        route = self._route(leaf, stat)
        if route is Route.MATERIALIZED:
            return None
        if route is Route.CALL:
            return self._from_calls(leaf, stat, index)
        terms = self.leaf_terms(leaf)
        if stat is Statistic.SUM:
            sums = [t.rule.column_sum(*self._samples(t, index), t.call, param) for t in terms]
            return _total(sums)
        if len(terms) != 1:  # calls of several kinds
            tied = stat is Statistic.SQUARED_NORMS
            return self._tied_squared_norms(leaf, index) if tied else None
        (t,) = terms
        return cast(
            Tensor | None,
            getattr(t.rule, stat.value)(*self._operands(stat, t, index), t.call, param),
        )

    def position_terms(self, leaf: int, index: slice | Tensor) -> Tensor | None:
        """A tapped leaf's per-sample terms over its calls and positions, or ``None``.

        See :meth:`~packfunc.engine.rules.base.Rule.position_terms`: ``None`` where a call's
        rule gives none (an op-local rule's, the whole-model path's).

        Args:
            leaf: Leaf index.
            index: Samples they cover.

        Returns:
            ``[n]``, in the squares' dtype, or ``None``.
        """
        if leaf not in self.recorded or self._route(leaf, Statistic.SQUARED_NORMS) is Route.CALL:
            return None
        param = self.bp.leaves[leaf]
        found = [
            t.rule.position_terms(*self._operands(Statistic.SQUARED_NORMS, t, index), t.call, param)
            for t in self.leaf_terms(leaf)
        ]
        present = [f for f in found if f is not None]
        return _total(present) if len(present) == len(found) else None

    def _tied_squared_norms(self, leaf: int, index: slice | Tensor) -> Tensor | None:
        """A leaf's squared norms over calls of several kinds, in Gram form where cheaper.

        See :mod:`packfunc.engine.tied` (one column only; ``None``: form the gradients).
        """
        param = self.bp.leaves[leaf]
        if self.count != 1 or param.dim() != 2:
            return None
        factors = [
            c.rule.outer_factors(
                *self._operands(Statistic.SQUARED_NORMS, c, index, x_dim=0), c.call, param
            )
            for c in self.recorded[leaf]
        ]
        present = [f for f in factors if f is not None]
        if len(present) != len(factors) or not tied_gram_is_cheaper(present, param.shape[0]):
            return None
        return tied_squared_norms(present, param.shape[0])

    def leaf_columns(self, leaf: int, index: slice | Tensor) -> Tensor:
        """Column gradients ``[K, n, *leaf.shape]`` of a tapped or unused leaf.

        Args:
            leaf: Leaf index (not on the whole-model path).
            index: Samples to compute.

        Returns:
            The column gradients of those samples.
        """
        param = self.bp.leaves[leaf]
        if leaf not in self.recorded:
            return param.new_zeros((self.count, index_length(index), *param.shape))
        if self._route(leaf, Statistic.COLUMNS) is Route.CALL:
            return self._from_calls(leaf, Statistic.COLUMNS, index)
        # the calls of a tied weight add into the first's own tensor (embedding + head)
        terms = self.leaf_terms(leaf)
        if len(terms) > 1:
            terms = sorted(terms, key=lambda t: not t.rule.fresh_columns)
        first, *others = terms
        total = first.rule.columns(*self._samples(first, index), first.call, param)
        for i, t in enumerate(others):
            x, g = self._samples(t, index)
            if i == 0 and not first.rule.fresh_columns:
                total = total + t.rule.columns(x, g, t.call, param)
            else:
                total = t.rule.add_columns(total, x, g, t.call, param)
        return total

    def _forms_own_output(self, leaf: int) -> bool:
        """Whether a leaf's column gradients are formed with nothing of their size beside them.

        (A linear layer's, an embedding's: in a tensor of their own, from no unfolded input.)
        """
        calls = self.recorded.get(leaf, [])
        param = self.bp.leaves[leaf]
        return bool(calls) and all(
            c.rule.fresh_columns and not c.rule.unfolds_input(c.x, c.g, c.call, param)
            for c in calls
        )

    def iter_leaf_columns(
        self, wanted: list[int], index: slice | Tensor, *, into_output: bool = False
    ) -> Iterator[list[Tensor]]:
        """Yield column gradients ``[K, chunk, *p]`` of ``wanted`` leaves for chunks of ``index``.

        Generic leaves come from one shared vmap pass per chunk; the others from
        their rules.

        Args:
            wanted: Leaf indices, all on the whole-model path or none.
            index: Samples to compute.
            into_output: The chunks are copied into an output: where the samples do not
                fit in one chunk (which would be the output itself), the chunks are small
                (:data:`~packfunc.engine.memory.OUTPUT_CHUNK_BUDGET`), being temporaries
                beside the output.

        Yields:
            Per chunk, one tensor per wanted leaf.
        """
        numel = self.count * sum(self.bp.leaves[i].numel() for i in wanted)
        samples = index_length(index)
        length = chunk_length(samples, numel, self.bp.chunk_size)
        if into_output and length < samples:
            if self.bp.chunk_size is None and all(self._forms_own_output(i) for i in wanted):
                length = samples  # the rules' results are the outputs: nothing beside them
            else:
                length = chunk_length(samples, numel, self.bp.chunk_size, OUTPUT_CHUNK_BUDGET)
        for chunk in split_index(index, length):
            if wanted and wanted[0] in self.bp.whole_model:
                names = ", ".join(self.bp.names[i] for i in wanted)
                self.bp.check_rerun(f"the whole-model path (for {names})")
                yield whole_model.column_grads(
                    self.bp.model_fn,
                    self.bp.leaves,
                    self.bp.treespec,
                    wanted,
                    self.bp.X,
                    self.cotangents,
                    chunk,
                )
            else:
                yield [self.leaf_columns(i, chunk) for i in wanted]


def _scaled(t: Tensor, weights: Tensor, *, in_place: bool = False) -> Tensor:
    """``t [K, N, ...]`` with sample ``n``'s rows times ``weights[n]``.

    A copy is contiguous (a permuted view of the output cotangent is then reshaped to a
    layer's layout without a second copy). A cotangent narrower than the weights (bfloat16
    under autocast, float32 factors) is scaled in the weights' dtype: rounded to its own,
    DP-SGD's clipping factors let samples through at up to 1.004 times the bound.
    """
    narrow = t.is_floating_point() and torch.finfo(t.dtype).bits < 32
    if narrow and torch.promote_types(t.dtype, weights.dtype) != t.dtype:
        t, in_place = t.to(weights.dtype), True  # (a copy of its own)
    w = weights.to(t.dtype).view(1, -1, *[1] * (t.dim() - 2))
    if in_place:
        return t.mul_(w)
    if t.is_contiguous() or not is_plain(t, w):
        return t * w
    return torch.mul(t, w, out=torch.empty(t.shape, dtype=t.dtype, device=t.device))


def _alone(tensors: list[Tensor], other: Tensor | None) -> list[int]:
    """The positions in ``tensors`` of those that can be changed in place alone.

    Such a tensor needs no gradient, shares its memory with no other of ``tensors`` and
    not with ``other`` (if given), and no two of its elements share memory (a cotangent
    autograd expanded from a sum over positions does).

    Example:
        >>> t = torch.ones(4)
        >>> _alone([t, t[:2], torch.ones(2), torch.ones(1).expand(3)], torch.ones(1))
        [2]
    """
    if any(map(is_functorch_wrapped_tensor, [*tensors, *([other] if other is not None else [])])):
        return []  # (under a torch.func transform: no storage to compare, and no need)
    pointers = [t.untyped_storage().data_ptr() for t in tensors]
    taken = {other.untyped_storage().data_ptr()} if other is not None else set()
    return [
        i
        for i, (t, p) in enumerate(zip(tensors, pointers))
        if pointers.count(p) == 1 and p not in taken and not t.requires_grad and _disjoint(t)
    ]


def _disjoint(t: Tensor) -> bool:
    """Whether no two elements of ``t`` share memory (judged from its strides, conservatively).

    Example:
        >>> _disjoint(torch.ones(2, 3).T), _disjoint(torch.ones(2, 1).expand(2, 3))
        (True, False)
    """
    reach = 0  # the largest offset the dims taken so far reach
    for size, stride in sorted(
        (d for d in zip(t.shape, t.stride()) if d[0] > 1), key=lambda d: d[1]
    ):
        if stride <= reach:
            return False
        reach += (size - 1) * stride
    return True


def _stack(tensors: list[Tensor]) -> Tensor:
    """``torch.stack``, into a new output where nothing is traced."""
    if not is_plain(*tensors):
        return torch.stack(tensors)
    return torch.stack(tensors, out=new_output((len(tensors), *tensors[0].shape), tensors[0]))


def _zeros_of(param: Tensor, stat: Statistic, n: int) -> Tensor:
    """Statistics of a leaf the output does not depend on."""
    if stat is Statistic.SQUARED_NORMS:
        return param.new_zeros(n)
    if stat is Statistic.DIAGONAL_PER_SAMPLE:
        return param.new_zeros((n, *param.shape))
    return torch.zeros_like(param)


def _total(tensors: list[Tensor]) -> Tensor:
    """The sum of one or more tensors (the first itself if alone)."""
    total = tensors[0]
    for tensor in tensors[1:]:
        total = total + tensor
    return total
