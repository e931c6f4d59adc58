"""Whole datasets: every public quantity over an iterable of batches, and over ranks.

``data=`` (any iterable of ``(X, y)`` batches, e.g. a ``DataLoader``) replaces
``X, y``; the result is what one batch holding every sample would give. Each
batch is computed with a copy of the loss whose ``reduction`` is ``'sum'``; the
partial results are summed (over batches, then over the ranks of
``process_group``) and rescaled once at the end by the dataset's mean normalizer
``Z`` (:func:`packfunc.losses.mean_normalizer`, accumulated per batch from the
targets; ``Z = 1`` for ``reduction='sum'``; ``Z = 0``, every target ignored, gives
autograd's zeros and PyTorch's NaN loss):

* gradient, GGN, Hessian, their diagonals and products, the loss value, a
  Kronecker ``A`` factor: ``× 1/Z`` (linear in the loss);
* ``sum_grad_squared``: ``× 1/Z²``; ``variance`` is combined from the summed
  gradient and ``sum_grad_squared`` with the global sample count ``N``;
* a Kronecker ``B`` factor (an input covariance averaged over samples): the
  batches' factors weighted by their sample counts, divided by ``N``;
* KFRA is refused over more than one batch: its factors are nested batch
  averages, not sums over samples;
* Monte-Carlo quantities draw from the same distribution as for one batch (the
  generator is consumed batch by batch, so the draws differ from one big batch's).

Per-sample quantities (``batch_grad`` ...) over a dataset are :func:`per_batch`'s:
an iterator over per-batch results scaled for the whole dataset; with ``reduction='mean'`` a first,
targets-only pass over ``data`` finds ``Z``, so ``data`` must be re-iterable; over
ranks, each rank yields its own shard's per-sample results, scaled for all shards.
Only one batch's intermediate state is alive at a time.
"""

from __future__ import annotations

import copy
import difflib
import functools
import inspect
import math
from collections.abc import Callable, Iterable, Iterator, Sized
from dataclasses import dataclass
from functools import partial
from typing import Any, TypedDict, TypeVar

import optree
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from packfunc.distributed import (
    ProcessGroup,
    agree_on_call,
    check_group,
    describe_call,
    is_first_rank,
    sum_counts_over_ranks,
    sum_over_ranks,
    world_size,
    zeros_like_others,
)
from packfunc.engine.discovery import in_out_weights
from packfunc.engine.randomness import check_generator
from packfunc.evaluation import check_per_sample_loss, compute_batch, statistic_quantities
from packfunc.functionalize import (
    flatten_params,
    has_packed_sequences,
    module_of,
    normal_tensors,
    packing,
    padded_sequences,
    public_entry,
)
from packfunc.losses import GivenOutputGradient, check_loss, default_loss, mean_normalizer
from packfunc.specs import QUANTITIES, SPECS, Combine, Family, Quantity
from packfunc.types import BatchT, Inputs, ModelFn, ParamsT

F = TypeVar("F", bound=Callable[..., Any])

BatchToXY = Callable[[BatchT], tuple[Inputs, Tensor]]
"""Turns one batch of ``data`` into ``(X, y)`` (e.g. for dict-shaped batches)."""


class DataOptions(TypedDict, total=False):
    """The keyword arguments of every public quantity that :func:`over_data` consumes.

    Attributes:
        data: An iterable of ``(X, y)`` batches (e.g. a ``DataLoader``) in place of ``X, y``.
        batch_to_xy: Function from one item of ``data`` to ``(X, y)``.
        progress: Show a tqdm progress bar over the batches.
        process_group: A ``torch.distributed`` group whose ranks' shards combine.
    """

    data: Iterable[object] | None
    batch_to_xy: BatchToXY[Any] | None
    progress: bool
    process_group: ProcessGroup | None


PerBatch = Callable[[Any, Tensor, nn.Module], dict[str, Any]]
"""``(X, y, loss) -> {name: value}``: one batch's partial results."""


def over_data(spec: Quantity | None, required: tuple[str, ...] = ()) -> Callable[[F], F]:
    """Let a one-batch public function take a dataset, a progress bar and a process group.

    The decorated function keeps computing one batch ``(X, y)``; its signature
    declares the four keyword arguments (for documentation and typing) but this
    wrapper consumes them: without any of them the call goes straight through.

    Args:
        spec: The quantity the function computes (its :class:`~packfunc.specs.Quantity`
            says how batches combine), or ``None`` for :func:`packfunc.compute` (the
            quantities named by its ``quantities=``).
        required: Arguments the function needs besides ``X, y`` (e.g. ``"v"``).

    Returns:
        A decorator.

    Example:
        >>> from packfunc.specs import SPECS
        >>> @over_data(SPECS["ggn_vector_product"])
        ... def total_loss(model_fn, params, X=None, y=None, *, loss=None, data=None):
        ...     return {"w": loss(model_fn(params, X), y)}
        >>> batches = [(torch.ones(2, 1), torch.zeros(2, 1)), (torch.ones(1, 1), torch.ones(1, 1))]
        >>> total_loss(lambda p, X: X * p, 2.0, data=batches, loss=torch.nn.MSELoss())["w"]
        tensor(3.)
    """

    def decorate(function: F) -> F:
        keywords = _keyword_names(function)

        @functools.wraps(function)
        @public_entry
        def wrapper(
            model_fn: ModelFn,
            params: Any,
            X: Any = None,
            y: Tensor | None = None,
            *args: Any,
            data: Iterable[Any] | None = None,
            batch_to_xy: BatchToXY[Any] | None = None,
            progress: bool = False,
            process_group: ProcessGroup | None = None,
            **options: Any,
        ) -> Any:
            _check_keywords(function.__name__, options, keywords)
            check_generator(options.get("generator"), f"{function.__name__}()")
            for name in required[len(args) :]:
                if options.get(name) is None:
                    raise TypeError(f"{function.__name__}() needs the argument {name!r}.")
            if data is None and process_group is None and not progress:
                if X is None or y is None:
                    raise TypeError(
                        f"{function.__name__}() needs the batch X, y, or data= (an iterable "
                        "of (X, y) batches such as a DataLoader)."
                    )
                if has_packed_sequences(X):
                    model_fn, X = packing(model_fn), padded_sequences(X)
                return function(model_fn, params, X, y, *args, **options)
            if spec is not None and spec.combine is Combine.PER_SAMPLE and data is not None:
                name = function.__name__
                raise TypeError(
                    f"{name}() has one entry per sample, so over data= it gives one result "
                    f"per batch: iterate over pf.per_batch(pf.{name}, model_fn, params, "
                    "data=...) instead."
                )
            source = DataSource(X, y, data, batch_to_xy, progress, process_group)
            model_fn = packing(model_fn)  # (the batches' PackedSequences come padded)
            call = partial(_one_batch, function, model_fn, params, args)
            return _over_dataset(spec, function.__name__, call, model_fn, params, source, options)

        return wrapper  # type: ignore[return-value]

    return decorate


def _keyword_names(function: Callable[..., Any]) -> frozenset[str]:
    """The names ``function`` takes by keyword (not those its ``**kwargs`` would swallow)."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    parameters = inspect.signature(function).parameters.values()
    return frozenset(p.name for p in parameters if p.kind in kinds)


def _check_keywords(name: str, options: dict[str, Any], keywords: frozenset[str]) -> None:
    """Refuse a keyword the function does not take (ignored, it would change nothing, silently).

    A typo, or ``noise_multiplier=`` given to ``clipped_grad``, is an error.

    Raises:
        TypeError: naming the unknown keywords and the closest known ones.
    """
    unknown = sorted(set(options) - keywords)
    if not unknown:
        return
    known = sorted(keywords - {"model_fn", "params", "X", "y"} | set(DataOptions.__annotations__))
    hints = {word: difflib.get_close_matches(word, known, n=1) for word in unknown}
    close = "; ".join(
        f"{word!r}: did you mean {found[0]!r}?" for word, found in hints.items() if found
    )
    raise TypeError(
        f"{name}() got unexpected keyword arguments {unknown}"
        + (f" ({close})" if close else "")
        + f". It takes {', '.join(known)}."
    )


@public_entry
def per_batch(
    quantity: Callable[..., ParamsT],
    model_fn: ModelFn,
    params: ParamsT,
    *,
    data: Iterable[BatchT],
    batch_to_xy: BatchToXY[BatchT] | None = None,
    progress: bool = False,
    process_group: ProcessGroup | None = None,
    **options: Any,
) -> Iterator[ParamsT]:
    """A per-sample quantity over a dataset: one result per batch, scaled for the dataset.

    Each result is what one batch holding every sample would give for that batch's
    samples (for ``reduction='mean'``: divided by the whole dataset's normalizer,
    found by a first pass over the targets, so ``data`` must be re-iterable). Only one
    batch's intermediate state is alive at a time. Over ranks (``process_group=``),
    each rank yields its own shard's results, scaled for all shards. An empty ``data``
    yields nothing.

    Args:
        quantity: A per-sample function: ``pf.batch_grad``, ``pf.batch_l2_grad``,
            ``pf.sqrt_ggn``, ``pf.batch_diag_ggn`` or ``pf.batch_diag_hessian``.
        model_fn: ``model_fn(params, X) -> output``.
        params: Pytree of floating-point tensors.
        data: An iterable of ``(X, y)`` batches (e.g. a ``DataLoader``).
        batch_to_xy: Function from one item of ``data`` to ``(X, y)``.
        progress: Show a tqdm progress bar over the batches (needs ``tqdm``).
        process_group: A ``torch.distributed`` group (see :mod:`packfunc.distributed`).
        **options: ``quantity``'s other keyword arguments (``loss=``, ``mc_samples=`` ...).

    Returns:
        An iterator over the batches' results, each a pytree like ``params`` with the
        batch's samples first.

    Raises:
        TypeError: for a function that is not a per-sample quantity.
        ValueError: for ``loss=GivenOutputGradient(G)`` (one batch's ``G``: call the
            quantity per batch with ``X, y``).

    Example:
        >>> model_fn, params = packfunc.functional(torch.nn.Linear(3, 2))
        >>> data = [(torch.randn(4, 3), torch.randint(0, 2, (4,))) for _ in range(3)]
        >>> [g["weight"].shape[0] for g in per_batch(packfunc.batch_grad, model_fn, params,
        ...                                           data=data)]
        [4, 4, 4]
    """
    spec = SPECS.get(getattr(quantity, "__name__", ""))
    one_batch = getattr(quantity, "__wrapped__", None)
    if spec is None or spec.combine is not Combine.PER_SAMPLE or one_batch is None:
        names = [name for name, s in SPECS.items() if s.combine is Combine.PER_SAMPLE]
        raise TypeError(
            f"per_batch() takes a per-sample quantity ({', '.join(f'pf.{n}' for n in names)}); "
            f"got {quantity!r}. Aggregate quantities take data= themselves."
        )
    source = DataSource(None, None, data, batch_to_xy, progress, process_group)
    model_fn = packing(model_fn)  # (the batches' PackedSequences come padded)
    call = partial(_one_batch, one_batch, model_fn, params, ())
    stream: Iterator[ParamsT] = _over_dataset(
        spec, spec.name, call, model_fn, params, source, options
    )
    return stream


def _one_batch(
    function: Callable[..., Any],
    model_fn: ModelFn,
    params: Any,
    args: tuple[Any, ...],
    X_b: Any,
    y_b: Tensor,
    **options: Any,
) -> Any:
    """``function`` on one batch of a dataset (made normal by :meth:`DataSource.batches`)."""
    return function(model_fn, params, X_b, y_b, *args, **options)


@dataclass(frozen=True)
class DataSource:
    """Where the samples come from: one batch ``X, y`` or ``data``, on one rank or several."""

    X: Any
    y: Tensor | None
    data: Iterable[Any] | None
    batch_to_xy: BatchToXY[Any] | None
    progress: bool
    group: ProcessGroup | None

    def batches(self, device: torch.device, name: str) -> Iterator[tuple[Any, Tensor]]:
        """The ``(X, y)`` batches on ``device`` (with a progress bar if asked for).

        A ``PackedSequence`` among the inputs comes padded (:func:`padded_sequences`), for
        the model function :func:`packing` wraps.

        Args:
            device: Where the parameters live.
            name: The public function's name, for the progress bar.

        Returns:
            An iterator over ``(X, y)`` pairs.

        Raises:
            TypeError: for both ``X, y`` and ``data``, neither, or a ``data`` that is
                not an iterable of batches.
        """
        if self.data is not None and (self.X is not None or self.y is not None):
            raise TypeError("pass either the batch X, y or data=, not both.")
        if self.data is None:
            if self.X is None or self.y is None:
                raise TypeError("pass the batch X, y (this rank's shard) or data=.")
            batches: Iterator[tuple[Any, Tensor]] = iter([(padded_sequences(self.X), self.y)])
        else:  # (tensors made in inference mode made normal: packfunc differentiates them)
            batches = (
                normal_tensors(_to_device((padded_sequences(X), y), device))
                for X, y in self.pairs()
            )
        return self._with_progress(batches, name) if self.progress else batches

    def pairs(self) -> Iterator[tuple[Any, Tensor]]:
        """``data``'s items as ``(X, y)``, after checking that ``data`` is an iterable."""
        if isinstance(self.data, Tensor) or not isinstance(self.data, Iterable):
            raise TypeError(
                "data= takes an iterable of (X, y) batches (a DataLoader, or [(X, y), ...]); "
                f"got {type(self.data).__name__}."
            )
        split = self.batch_to_xy or default_batch_to_xy
        return (_checked_batch(split(batch), self.data) for batch in self.data)

    def targets(self) -> Iterable[Tensor]:
        """Every batch's targets, for a first pass that reads ``data`` again afterwards.

        Raises:
            TypeError: if ``data`` is an iterator (it could be read only once).
        """
        if self.data is None:
            assert self.y is not None  # checked by batches()
            return [self.y]
        if isinstance(self.data, Iterator):  # (no iter(): a loader would draw a shuffle)
            raise TypeError(
                "per-sample quantities with reduction='mean' read data= twice (first the "
                "targets, for the dataset's mean normalizer): pass a re-iterable (a "
                "DataLoader, a list), not an iterator, or use reduction='sum'."
            )
        return (y_b for _, y_b in self.pairs())

    def _with_progress(self, batches: Iterator[Any], name: str) -> Iterator[Any]:
        """``batches`` in a tqdm bar, shown on the group's first rank."""
        try:
            from tqdm.auto import tqdm  # type: ignore[import-untyped]
        except ImportError as error:
            raise ImportError(
                "progress=True needs tqdm: pip install tqdm (or pass progress=False)."
            ) from error
        total = len(self.data) if isinstance(self.data, Sized) else None
        return iter(tqdm(batches, total=total, desc=name, disable=not is_first_rank(self.group)))


def default_batch_to_xy(batch: Any) -> tuple[Any, Tensor]:
    """Split one batch into ``(X, y)``: a pair (tuple or list) is taken as it is.

    Args:
        batch: One item of ``data``.

    Returns:
        ``(X, y)``.

    Raises:
        TypeError: for anything else, naming ``batch_to_xy=`` (dict batches need it).

    Example:
        >>> default_batch_to_xy((torch.zeros(2, 3), torch.zeros(2)))[1].shape
        torch.Size([2])
    """
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    shape = f"a dict with keys {sorted(batch)}" if isinstance(batch, dict) else type(batch).__name__
    raise TypeError(
        f"data= must yield (X, y) pairs; got {shape}. Pass batch_to_xy=, a function from "
        "one batch to (X, y), e.g. batch_to_xy=lambda b: (b['input_ids'], b['labels'])."
    )


def _checked_batch(pair: tuple[Any, Any], data: Iterable[Any]) -> tuple[Any, Tensor]:
    """One ``(X, y)`` batch of ``data``, checked to hold tensor targets with a batch dimension.

    Args:
        pair: The batch's inputs ``X`` and targets ``y``.
        data: The dataset, to name a ``DataLoader(batch_size=None)`` as the cause.

    Returns:
        ``(X, y)``.

    Raises:
        TypeError: for targets that are not a tensor (as for one batch).
        ValueError: for a batch without a batch dimension (0-d targets, or a
            ``DataLoader(batch_size=None)`` whose inputs and targets differ in length).

    Example:
        >>> _checked_batch((torch.zeros(2, 3), torch.zeros(2)), [])[1].shape
        torch.Size([2])
    """
    X, y = pair
    if not isinstance(y, Tensor):
        raise TypeError(f"targets y must be a tensor; got {type(y).__name__}.")
    unbatched = isinstance(data, DataLoader) and data.batch_sampler is None  # batch_size=None
    lengths_differ = isinstance(X, Tensor) and (X.dim() == 0 or X.shape[:1] != y.shape[:1])
    if y.dim() == 0 or (unbatched and lengths_differ):
        shape = f" and inputs {tuple(X.shape)}" if isinstance(X, Tensor) else ""
        raise ValueError(
            f"data= yielded a batch without a batch dimension (targets {tuple(y.shape)}"
            f"{shape}): a DataLoader(batch_size=None) yields single samples, unbatched. "
            "Pass DataLoader(..., batch_size=...) with the number of samples per batch "
            "(or batches with the samples along dim 0)."
        )
    return X, y


def _over_dataset(
    spec: Quantity | None,
    name: str,
    one_call: Callable[..., Any],
    model_fn: ModelFn,
    params: Any,
    source: DataSource,
    options: dict[str, Any],
) -> Any:
    """The quantity over every batch of ``source`` (and every rank of its group)."""
    check_group(source.group)
    options = dict(options)
    loss = options.pop("loss", None) or default_loss("sum" if _per_sample_loss(spec) else "mean")
    check_loss(loss)
    if source.data is not None:
        _check_loss_over_batches(loss, name)
    if options.get("subsampling") is not None:
        raise ValueError(
            "subsampling= selects samples of one batch; with data= or process_group= "
            "subsample the dataset itself (e.g. a torch.utils.data.Subset)."
        )
    device = _device(params)
    if source.data is not None or world_size(source.group) > 1:
        _refuse_batch_statistics(model_fn, name)
    call = _Call(source.group, device, name, spec, options, loss, params)
    try:
        batches = source.batches(device, name)
    except Exception as error:  # (the other ranks learn of it at their first agreement)
        call.agree(error)
        raise
    if spec is not None and spec.combine is Combine.ONE_BATCH:
        return _one_batch_only(
            batches,
            source.group,
            name,
            lambda X_b, y_b: one_call(X_b, y_b, loss=loss, **options),
        )
    specs, options = _requested(spec, options)
    check_per_sample_loss(specs, loss)
    partials = _per_batch(spec, specs, one_call, model_fn, params, options)
    if spec is not None and spec.combine is Combine.PER_SAMPLE:
        normalizer = _dataset_normalizer(loss, source, call)
        scale = _inverse_normalizer(normalizer) ** spec.loss_power
        counted = _Normalizers(batches, loss, device)
        stream = _streamed(spec.name, iter(counted), partials, _sum_reduced(loss), scale)
        if source.data is None:
            return next(stream)  # X, y: the one result (no collective after it)
        check = loss.reduction == "mean"
        return _agreed_at_end(
            stream, call, lambda: counted.check(normalizer, call) if check else None
        )
    kronecker = {s.name for s in specs if s.combine is Combine.KRONECKER}
    layout = _FactorLayout(model_fn, params)
    if kronecker:
        partials = layout.canonical(partials, kronecker)
    batches = (batch for batch in batches if len(batch[1]))  # an empty one adds nothing
    totals, samples, normalizer = _summed(batches, partials, loss, device, kronecker, call)
    scale = _inverse_normalizer(normalizer) if loss.reduction == "mean" else 1.0
    result = {s.name: _finish(s, totals, scale, samples) for s in specs}
    result = {k: layout.own(v) if k in kronecker else v for k, v in result.items()}
    if spec is not None:
        return result[spec.name]
    # the loss itself is PyTorch's: 0/0 = NaN where every target is ignored
    value = totals["loss"] / normalizer if loss.reduction == "mean" else totals["loss"]
    return {"loss": value} | result


def _check_loss_over_batches(loss: nn.Module, name: str) -> None:
    """Refuse a loss that holds one batch's data, which every batch of ``data=`` would reuse.

    Raises:
        ValueError: for :class:`~packfunc.losses.GivenOutputGradient`.
    """
    if isinstance(loss, GivenOutputGradient):
        raise ValueError(
            f"{name}() over data= runs every batch with the same loss, but "
            "loss=GivenOutputGradient(G) holds one batch's output gradient G (the targets "
            "are ignored), so every batch would reuse that G. Call "
            f"pf.{name}(model_fn, params, X, y, loss=GivenOutputGradient(G)) per batch, "
            "with each batch's X, y and G."
        )


def _inverse_normalizer(normalizer: float) -> float:
    """``1/Z``, and ``inf`` for ``Z = 0`` (every target ignored), where ``0 · inf`` counts as 0.

    With every target ignored, PyTorch's mean loss is ``0/0 = NaN`` but its gradient and
    Hessian are 0: every term summed over the batches is 0 and stays 0 (:func:`_scaled`).

    Args:
        normalizer: The dataset's mean normalizer ``Z``.

    Returns:
        ``1/Z``, or ``inf``.

    Example:
        >>> _inverse_normalizer(4.0), _inverse_normalizer(0.0)
        (0.25, inf)
    """
    return 1 / normalizer if normalizer != 0 else math.inf


def _scaled(value: Tensor, factor: float) -> Tensor:
    """``value · factor``, where an infinite ``factor`` (``Z = 0``) leaves zeros zero.

    Args:
        value: A summed partial result.
        factor: A power of :func:`_inverse_normalizer`.

    Returns:
        The product; ``0 · inf = 0`` (a term that no target weighs), ``x · inf = ±inf``.

    Example:
        >>> _scaled(torch.tensor([0.0, 2.0]), math.inf)
        tensor([0., inf])
    """
    if math.isfinite(factor):
        return value * factor
    return torch.where(value == 0, torch.zeros_like(value), value * factor)


def _per_sample_loss(spec: Quantity | None) -> bool:
    """Whether ``spec`` needs each sample's own loss (its default loss sums)."""
    return spec is not None and spec.per_sample_loss


def _device(params: Any) -> torch.device:
    """Where the parameters live (batches are moved there)."""
    leaves = optree.tree_leaves(params)
    return leaves[0].device if leaves and isinstance(leaves[0], Tensor) else torch.device("cpu")


def _to_device(pair: Any, device: torch.device) -> tuple[Any, Tensor]:
    """One ``(X, y)`` batch with every tensor moved to ``device``."""
    X, y = pair
    return optree.tree_map(lambda t: t.to(device), X), y.to(device)


def _sum_reduced(loss: nn.Module) -> nn.Module:
    """A shallow copy of ``loss`` with ``reduction='sum'`` (sharing weights and options)."""
    summed = copy.copy(loss)
    summed.reduction = "sum"  # type: ignore[assignment]
    return summed


def _requested(
    spec: Quantity | None, options: dict[str, Any]
) -> tuple[tuple[Quantity, ...], dict[str, Any]]:
    """The specs to return (``compute``'s ``quantities=``, or one), and the other options."""
    if spec is not None:
        return (spec,), options
    rest = {key: value for key, value in options.items() if key != "quantities"}
    specs = tuple(QUANTITIES[name] for name in statistic_quantities(options["quantities"]))
    streamed = [s.name for s in specs if s.combine is Combine.PER_SAMPLE]
    if streamed:
        raise ValueError(
            f"compute(data=...) and compute(process_group=...) combine the quantities over "
            f"batches or ranks; the per-sample quantities {streamed} have one entry per "
            "sample: ask for them with their own functions (pf.batch_l2_grad(..., "
            "process_group=...) gives this rank's samples), or over a DataLoader with "
            "pf.per_batch(...), one result per batch."
        )
    return specs, rest


def _per_batch(
    spec: Quantity | None,
    specs: tuple[Quantity, ...],
    one_call: Callable[..., Any],
    model_fn: ModelFn,
    params: Any,
    options: dict[str, Any],
) -> PerBatch:
    """One batch's partial sums: statistics from one batch pass (moments from their parts)."""
    if spec is not None and spec.family is not Family.STATISTIC:
        return lambda X_b, y_b, loss: {spec.name: one_call(X_b, y_b, loss=loss, **options)}
    parts: list[str] = []
    for s in specs:
        for part in s.parts if s.combine is Combine.MOMENTS else (s.name,):
            if part not in parts:
                parts.append(part)
    return lambda X_b, y_b, loss: compute_batch(
        model_fn, params, X_b, y_b, tuple(parts), loss, **options
    )


class _FactorLayout:
    """Kronecker factor pairs in the combiner's order, ``[output, input]``, and back.

    A weight stored ``[in, out]`` (``x @ W``, GPT-2's ``Conv1D``) has its factors
    ``[in×in, out×out]``: the batches' input factors are weighted by their sizes and the
    output factors summed, so its pair is swapped for the combining and swapped back after.
    Which weights those are is read from the plan the first batch's pass cached.
    """

    def __init__(self, model_fn: ModelFn, params: Any) -> None:
        self.model_fn, self.params = model_fn, params
        self.flags: Any = None

    def canonical(self, per_batch: PerBatch, kronecker: set[str]) -> PerBatch:
        """``per_batch`` with the ``kronecker`` quantities' pairs in the combiner's order."""

        def run(X_b: Any, y_b: Tensor, loss: nn.Module) -> dict[str, Any]:
            found = per_batch(X_b, y_b, loss)
            if self.flags is None:  # (right after the pass that cached the plan)
                _, treespec, names = flatten_params(self.params)
                in_out = in_out_weights(self.model_fn, self.params, X_b)
                self.flags = optree.tree_unflatten(treespec, [name in in_out for name in names])
            return {k: self.own(v) if k in kronecker else v for k, v in found.items()}

        return run

    def own(self, factors: Any) -> Any:
        """Each pair of a weight stored ``[in, out]`` swapped (its own order <-> the combiner's)."""
        if self.flags is None:
            return factors
        return optree.tree_map(
            lambda f, swap: [f[1], f[0]] if swap and f is not None and len(f) == 2 else f,
            factors,
            self.flags,
            is_leaf=lambda x: x is None or isinstance(x, list),
            none_is_leaf=True,
        )


def _input_factors_times(factors: Any, weight: float) -> Any:
    """Kronecker factor lists with each ``B`` (input-side) factor multiplied by ``weight``."""
    return optree.tree_map(
        lambda f: f if f is None or len(f) == 1 else [f[0], f[1] * weight],
        factors,
        is_leaf=lambda x: x is None or isinstance(x, list),
        none_is_leaf=True,
    )


def _summed(
    batches: Iterator[tuple[Any, Tensor]],
    per_batch: PerBatch,
    loss: nn.Module,
    device: torch.device,
    kronecker: set[str],
    call: _Call,
) -> tuple[dict[str, Any], float, float]:
    """Partial results summed over batches and ranks; sample count ``N`` and normalizer ``Z``.

    The ``B`` factors of the ``kronecker`` quantities enter weighted by their batch's
    sample count. Before any sum the ranks agree that each made the same ``call`` and none
    raised (:meth:`_Call.agree`).
    """
    group = call.group
    summed_loss = _sum_reduced(loss)
    totals: dict[str, Any] | None = None
    samples, normalizer = 0, torch.zeros((), dtype=torch.float64, device=device)
    failure: Exception | None = None
    try:
        for X_b, y_b in batches:
            n = int(y_b.shape[0])
            part = {
                name: _input_factors_times(value, n) if name in kronecker else value
                for name, value in per_batch(X_b, y_b, summed_loss).items()
            }
            totals = part if totals is None else _added(totals, part)
            del part  # the next batch's intermediate state replaces this one's
            samples += n
            normalizer += mean_normalizer(loss, y_b)  # on the device: no sync per batch
    except Exception as error:  # (raised after the others learn of it)
        failure = error
    call.agree(failure)
    samples_all, normalizer_all, empty = sum_counts_over_ranks(
        [float(samples), float(normalizer), float(totals is None)], group, device
    )
    if empty and (empty == world_size(group) or kronecker):  # (every rank refuses alike)
        raise ValueError(
            "data= yielded no non-empty batch (on every rank, or on one rank for Kronecker "
            "factors); pass non-empty shards. (A Poisson-sampled DP-SGD step that drew no "
            "sample has a clipped sum of zero: add the noise alone, pf.privacy.add_noise on "
            "zeros shaped like params, as DPOptimizer does.)"
        )
    if empty:  # a rank that drew no sample (Poisson sampling) adds zeros laid out as the others'
        # (a Kronecker pair's order is read from a batch's plan: there every rank refuses)
        totals = zeros_like_others(totals, group, device)
    return sum_over_ranks(totals, group), samples_all, normalizer_all


def _added(totals: Any, part: Any) -> dict[str, Any]:
    """The leafwise sum of two dicts of partial results (pytrees)."""
    return dict(optree.tree_map(torch.add, totals, part))


def _finish(spec: Quantity, totals: dict[str, Any], scale: float, samples: float) -> Any:
    """Rescale a summed quantity to the dataset's reduced loss (see the module docstring)."""
    if spec.combine is Combine.MOMENTS:
        from_parts = spec.from_parts
        assert from_parts is not None
        parts = [_finish(QUANTITIES[part], totals, scale, samples) for part in spec.parts]
        return optree.tree_map(lambda *p: from_parts(p, samples), *parts)
    power = spec.loss_power
    if spec.combine is Combine.KRONECKER:
        return optree.tree_map(
            lambda f: (
                None if f is None else [_scaled(f[0], scale**power), *(b / samples for b in f[1:])]
            ),
            totals[spec.name],
            is_leaf=lambda x: x is None or isinstance(x, list),
            none_is_leaf=True,
        )
    return optree.tree_map(lambda t: _scaled(t, scale**power), totals[spec.name])


def _dataset_normalizer(loss: nn.Module, source: DataSource, call: _Call) -> float:
    """``Z`` of the whole dataset (over ranks), from a first pass over the targets only.

    The ranks agree first (:meth:`_Call.agree`): a rank whose pass raised leaves no other
    waiting in the sum.
    """
    if loss.reduction == "sum":
        return 1.0
    total, failure = 0.0, None
    try:
        total = sum(float(mean_normalizer(loss, y_b.to(call.device))) for y_b in source.targets())
    except Exception as error:
        failure = error
    call.agree(failure)
    return sum_counts_over_ranks([total], source.group, call.device)[0]


class _Normalizers:
    """Batches that note their targets' normalizer, for :meth:`check` after the last one.

    A loader whose samples change between passes (a sampler with replacement, a shuffled
    one with ``drop_last``) gave results scaled by another pass's normalizer, silently.
    """

    def __init__(
        self, batches: Iterator[tuple[Any, Tensor]], loss: nn.Module, device: torch.device
    ) -> None:
        self.batches, self.loss = batches, loss
        self.total = torch.zeros((), dtype=torch.float64, device=device)

    def __iter__(self) -> Iterator[tuple[Any, Tensor]]:
        for X_b, y_b in self.batches:
            self.total += mean_normalizer(self.loss, y_b)  # on the device: no sync per batch
            yield X_b, y_b

    def check(self, expected: float, call: _Call) -> None:
        """Refuse a normalizer (over ranks) other than the first pass's ``expected``.

        Raises:
            ValueError: if the targets' normalizer differs.
        """
        found = sum_counts_over_ranks([float(self.total)], call.group, call.device)[0]
        if not math.isclose(found, expected, rel_tol=1e-9, abs_tol=1e-12):
            raise ValueError(
                "data= gave other samples in this pass than in the first pass over its "
                f"targets (their mean normalizer {found:g} against {expected:g}: a sampler "
                "with replacement, a shuffled loader with drop_last): the per-batch results "
                "were scaled by the first pass's. With reduction='mean' give a loader that "
                "yields the same samples each pass (a fixed order, or shuffling without "
                "drop_last), or use reduction='sum'."
            )


def _agreed_at_end(stream: Iterator[Any], call: _Call, after: Callable[[], None]) -> Iterator[Any]:
    """``stream``, then the ranks' agreement (:meth:`_Call.agree`), then ``after``.

    A rank whose stream raises takes part in the agreement before raising: the others, at the
    end of theirs, raise too instead of waiting in ``after``'s collective.
    """
    failure = None
    try:
        yield from stream
    except Exception as error:
        failure = error
    call.agree(failure)
    after()


class _Call:
    """One public call over ranks: what the ranks agree on (:func:`agree_on_call`)."""

    def __init__(
        self,
        group: ProcessGroup | None,
        device: torch.device,
        name: str,
        spec: Quantity | None,
        options: dict[str, Any],
        loss: nn.Module,
        params: Any,
    ) -> None:
        self.group, self.device = group, device
        self.signature, self.values = "", list[Tensor]()  # (one process: nothing to agree on)
        if group is not None:
            same = {k: v for k, v in options.items() if k != "chunk_size"}  # (memory alone)
            self.signature, self.values = describe_call(name, same, loss, params)

    def agree(self, failure: Exception | None) -> None:
        """Every rank learns whether all made this call and none raised (``failure``)."""
        agree_on_call(self.signature, self.values, failure, self.group, self.device)


def _refuse_batch_statistics(model_fn: ModelFn, name: str) -> None:
    """Refuse BatchNorm that normalizes by batch statistics, over several batches or ranks.

    Each batch is normalized by its own statistics there (and, in training mode, updates the
    running ones once per batch): the sum over batches is not what one batch holding every
    sample gives. (Per-sample quantities refuse it anyway; the gradient alone and the
    products took it per batch, silently.) A hand-written ``model_fn`` is not inspected.

    Raises:
        ValueError: naming the fix.
    """
    module = module_of(model_fn)
    if module is None:
        return
    for child in module.modules():
        if isinstance(child, nn.modules.batchnorm._BatchNorm) and (
            child.training or not child.track_running_stats
        ):
            raise ValueError(
                f"{name}() over data= or ranks normalizes each batch by its own statistics "
                f"where the model's {type(child).__name__} uses batch statistics (training "
                "mode, or track_running_stats=False): the results would not be those of one batch "
                "holding every sample. Call model.eval() (running statistics), or pass the "
                "whole dataset as one batch X, y."
            )


def _streamed(
    name: str,
    batches: Iterator[tuple[Any, Tensor]],
    per_batch: PerBatch,
    summed_loss: nn.Module,
    scale: float,
) -> Iterator[Any]:
    """Each batch's per-sample quantity ``name``, times ``scale`` (for the whole dataset)."""
    for X_b, y_b in batches:
        value = per_batch(X_b, y_b, summed_loss)[name]
        yield optree.tree_map(lambda t: _scaled(t, scale), value)


def _one_batch_only(
    batches: Iterator[tuple[Any, Tensor]],
    group: ProcessGroup | None,
    name: str,
    one_batch: Callable[[Any, Tensor], Any],
) -> Any:
    """A quantity that is not a sum over samples, for a single batch on a single process."""
    refusal = (
        f"{name}() is not a sum over samples (its factors are nested batch averages), so it "
        "cannot be combined over batches or ranks; pass one batch X, y on one process, or "
        "use kflr/kfac, which combine."
    )
    if world_size(group) > 1:
        raise ValueError(refusal)
    first = next(batches, None)
    if first is None or next(batches, None) is not None:
        raise ValueError(refusal)
    return one_batch(*first)


__all__ = ["BatchToXY", "DataSource", "default_batch_to_xy", "over_data", "per_batch"]
