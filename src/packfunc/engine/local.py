"""Op-local column gradients: any op that consumes a parameter, differentiated on its own.

A parameter used outside the linear-like ops of ``engine/ops.py`` — a LayerNorm
or BatchNorm affine weight, a positional embedding added to activations, a
scalar temperature, a raw matrix in ``x @ W`` — still reaches the loss through
one op call whose output keeps the sample index at dim 0. The batch pass records
that call's arguments and the cotangent of its output; a parameter's column
gradient for sample ``n`` is then the vector-Jacobian product of *that op alone*
at sample ``n``'s arguments, ``vmap``-ed over samples. The rest of the model is
never re-run.

A tensor computed from parameters only — ``pos[:T]``, ``W.t()``,
``log_scale.exp()``, an embedding of ``torch.arange(T)``, ``cls.expand(N, 1, D)``
— is a *derivation*: it is recomputed from the parameter inside that vjp, so the
op that finally meets the samples is still the only one differentiated.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import Tensor

from packfunc.engine.decompositions import run_decomposed
from packfunc.engine.ops import BROADCASTS, CONVERSIONS


@dataclass(frozen=True)
class CallArguments:
    """A call's positional and keyword arguments, flattened one level (lists of tensors open).

    Attributes:
        values: Every argument value, the items of list or tuple arguments in place.
        layout: Per positional argument, then per keyword: ``None`` for a value, the
            container type and length for a list or tuple.
        keys: The keyword names, in order.
    """

    values: tuple[Any, ...]
    layout: tuple[tuple[type, int] | None, ...]
    keys: tuple[str, ...]

    @classmethod
    def of(cls, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> CallArguments:
        """Flatten ``(args, kwargs)``.

        Args:
            args: Positional arguments.
            kwargs: Keyword arguments.

        Returns:
            The flattened arguments.

        Example:
            >>> CallArguments.of((1, [2, 3]), {"a": 4}).values
            (1, 2, 3, 4)
        """
        values: list[Any] = []
        layout: list[tuple[type, int] | None] = []
        for value in (*args, *kwargs.values()):
            if isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
                layout.append((type(value), len(value)))
                values.extend(value)
            else:
                layout.append(None)
                values.append(value)
        return cls(tuple(values), tuple(layout), tuple(kwargs))

    def with_values(self, values: Iterable[Any]) -> CallArguments:
        """The same layout with other values (``dataclasses.replace`` costs 3× the calls).

        Args:
            values: One value per entry of :attr:`values`.

        Returns:
            The arguments with those values.

        Example:
            >>> CallArguments.of((1, [2, 3]), {}).with_values([4, 5, 6]).rebuild([7, 8, 9])
            ((7, [8, 9]), {})
        """
        return CallArguments(tuple(values), self.layout, self.keys)

    def rebuild(
        self, values: list[Any] | tuple[Any, ...]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Return ``(args, kwargs)`` with the flattened ``values`` put back in place.

        Args:
            values: One value per entry of :attr:`values`.

        Returns:
            Positional and keyword arguments.

        Example:
            >>> flat = CallArguments.of((1, [2, 3]), {"a": 4})
            >>> flat.rebuild([5, 6, 7, 8])
            ((5, [6, 7]), {'a': 8})
        """
        rebuilt: list[Any] = []
        position = 0
        for entry in self.layout:
            if entry is None:
                rebuilt.append(values[position])
                position += 1
            else:
                kind, length = entry
                items = list(values[position : position + length])
                rebuilt.append(items if kind is list else tuple(items))
                position += length
        split = len(rebuilt) - len(self.keys)
        return tuple(rebuilt[:split]), dict(zip(self.keys, rebuilt[split:]))


@dataclass(frozen=True)
class Derivation:
    """A tensor computed from parameters only, as a function of their values.

    Attributes:
        leaves: The parameter leaves it depends on.
        compute: Maps leaf index -> value (for every leaf in :attr:`leaves`) to the tensor.
        broadcast: Whether every row along dim 0 is the same (a size-one dim copied,
            e.g. ``cls.expand(N, 1, D)``): one sample's share is its first row.
        copied: Whether it is, or is computed from, such a copy (``h0.expand(N, H)``
            through a layer, or a copy along another dim that a selection made dim 0: a
            learned initial state ``h0.expand(L, N, H)[layer]``): its rows are then the same
            where their values are.
        copy_dims: The dims known to be copies of a size-one dim (see :func:`copy_dims`).
        rows: For a lookup of a leaf's rows by constant indices (``F.embedding(ids, w)``:
            Hugging Face's ``wpe(arange(T))``), the indices: its pullback adds the
            cotangent's rows into those rows (:func:`looked_up_rows`); else ``None``.
    """

    leaves: frozenset[int]
    compute: Callable[[Mapping[int, Tensor]], Tensor]
    broadcast: bool = False
    copied: bool = False
    copy_dims: frozenset[int] = frozenset()
    rows: Tensor | None = None


def copies_along_batch(func: Callable[..., Any], arguments: CallArguments, out: Any) -> bool:
    """Whether a call copies its input along dim 0 (every row of the output the same).

    ``expand``/``broadcast_to``/``repeat`` of a tensor with fewer dims, or with a
    leading dim of one — e.g. a class token copied over the batch.

    Args:
        func: The op.
        arguments: Its flattened arguments.
        out: Its output.

    Returns:
        Whether the output's rows along dim 0 are copies.

    Example:
        >>> token = torch.zeros(1, 1, 4)
        >>> copies_along_batch(Tensor.expand, CallArguments.of((token, 3, 1, 4), {}),
        ...                    token.expand(3, 1, 4))
        True
    """
    first = arguments.values[0] if arguments.values else None
    if func not in BROADCASTS or not isinstance(first, Tensor) or not isinstance(out, Tensor):
        return False
    return first.dim() < out.dim() or first.shape[:1] == (1,)


_SAME_VALUES = CONVERSIONS | {Tensor.clone, torch.clone}
"""Calls whose output has the values of their input (in another dtype or place)."""


def copy_dims(
    func: Callable[..., Any], arguments: CallArguments, sources: Mapping[int, Source], out: Any
) -> frozenset[int]:
    """The dims of a call's output known to be copies of a size-one dim.

    An ``expand``/``broadcast_to``/``repeat`` makes them (a size-one or missing dim copied);
    conversions keep them, and an integer index or ``select`` and ``transpose`` move them
    (``h0.expand(L, N, H)[layer]``: dim 1 becomes dim 0). Any other op knows none.

    Args:
        func: The op.
        arguments: Its flattened arguments.
        sources: Its parameter arguments.
        out: Its output.

    Returns:
        The dims.

    Example:
        >>> h0 = torch.zeros(2, 1, 3)
        >>> made = copy_dims(Tensor.expand, CallArguments.of((h0, 2, 4, 3), {}), {0: 0},
        ...                  h0.expand(2, 4, 3))
        >>> made
        frozenset({1})
        >>> moved = Derivation(frozenset({0}), lambda v: v[0], copy_dims=made)
        >>> copy_dims(Tensor.__getitem__, CallArguments.of((h0, 1), {}), {0: moved}, h0[1])
        frozenset({0})
    """
    values = arguments.values
    first = values[0] if values else None
    if not isinstance(first, Tensor) or not isinstance(out, Tensor):
        return frozenset()
    if func in BROADCASTS:
        lead = out.dim() - first.dim()
        return frozenset(
            d
            for d in range(out.dim())
            if out.shape[d] != 1 and (d < lead or first.shape[d - lead] == 1)
        )
    source = sources.get(0)
    dims = source.copy_dims if isinstance(source, Derivation) else frozenset()
    if not dims:
        return frozenset()
    if func in _SAME_VALUES or func is Tensor.detach:
        return dims if out.shape == first.shape else frozenset()
    removed = _selected_dim(func, values, first, out)
    if removed is not None:
        return frozenset(d - (d > removed) for d in dims if d != removed)
    if func in (Tensor.transpose, torch.transpose) and len(values) == 3:
        a, b = (int(v) % first.dim() for v in values[1:])
        swap = {a: b, b: a}
        return frozenset(swap.get(d, d) for d in dims)
    return frozenset()


def _selected_dim(
    func: Callable[..., Any], values: tuple[Any, ...], first: Tensor, out: Tensor
) -> int | None:
    """The dim an integer index (``t[k]``) or ``select(dim, k)`` removes, else ``None``."""
    if out.dim() != first.dim() - 1:
        return None
    if func is Tensor.__getitem__ and len(values) == 2 and type(values[1]) is int:
        return 0
    if func in (Tensor.select, torch.select) and len(values) == 3:
        return int(values[1]) % first.dim()
    return None


Source = int | Derivation
"""Where a parameter-valued argument comes from: a leaf index or a derivation."""


def derive(
    func: Callable[..., Any],
    arguments: CallArguments,
    sources: Mapping[int, Source],
    index: int | None,
    broadcast: bool,
    constant: bool = False,
    copies: frozenset[int] = frozenset(),
) -> Derivation:
    """The derivation of an output of ``func`` whose parameter arguments are ``sources``.

    Args:
        func: The op.
        arguments: Its flattened arguments (other tensors are held as constants).
        sources: Flat position -> leaf index or derivation, for every parameter argument.
        index: Which output of a multi-output op, or ``None`` for a single tensor.
        broadcast: Whether the op copies a size-one dim 0 (see :attr:`Derivation.broadcast`).
        constant: Whether the model made it under ``torch.no_grad()`` (a statistic of a
            weight): differentiation then holds it constant.
        copies: The output's dims known to be copies (:func:`copy_dims`).

    Returns:
        The :class:`Derivation`.

    Example:
        >>> w = torch.ones(2, 3)
        >>> d = derive(Tensor.t, CallArguments.of((w,), {}), {0: 0}, None, False)
        >>> d.compute({0: w}).shape
        torch.Size([3, 2])
    """
    leaves = frozenset(
        leaf for s in sources.values() for leaf in ((s,) if isinstance(s, int) else s.leaves)
    )

    def compute(values: Mapping[int, Tensor]) -> Tensor:
        args, kwargs = arguments.rebuild(_substituted(arguments, sources, values))
        out = func(*args, **kwargs)
        found = cast(Tensor, out if index is None else out[index])
        return found.detach() if constant else found

    copied = (
        broadcast
        or 0 in copies
        or any(isinstance(s, Derivation) and s.copied for s in sources.values())
    )
    rows = None if constant or index is not None else looked_up_rows(func, arguments, sources)
    return Derivation(leaves, compute, broadcast, copied, copies, rows)


_EMBEDDING = inspect.signature(F.embedding)


def looked_up_rows(
    func: Callable[..., Any], arguments: CallArguments, sources: Mapping[int, Source]
) -> Tensor | None:
    """The constant indices of a plain lookup of a leaf's rows, ``F.embedding(ids, w)``.

    Plain: no ``padding_idx`` (whose row gets no gradient), ``max_norm`` (which rescales
    rows in place) or ``scale_grad_by_freq``; the indices take no gradient. A lookup
    converted (``.to(device)``, ``.float()``, a clone) keeps its indices.

    Args:
        func: The op.
        arguments: Its flattened arguments.
        sources: Flat position -> leaf index or derivation, for every parameter argument.

    Returns:
        The indices, or ``None`` for any other call.

    Example:
        >>> w, ids = torch.ones(5, 2), torch.arange(3)
        >>> looked_up_rows(F.embedding, CallArguments.of((ids, w), {}), {1: 0})
        tensor([0, 1, 2])
        >>> looked_up_rows(F.embedding, CallArguments.of((ids, w), {"padding_idx": 0}), {1: 0})
    """
    if any(arguments.layout) or len(sources) != 1:
        return None
    ((position, source),) = sources.items()
    if func in _SAME_VALUES:  # (a lookup moved or cast: `wpe(ids).to(device)`)
        return source.rows if isinstance(source, Derivation) and position == 0 else None
    if func is not F.embedding:
        return None
    args, kwargs = arguments.rebuild(arguments.values)
    try:
        options = _EMBEDDING.bind(*args, **kwargs).arguments
    except TypeError:
        return None
    ids = options.get("input")
    plain = options.get("padding_idx") is None and options.get("max_norm") is None
    plain = plain and not options.get("scale_grad_by_freq", False)
    weight_at = arguments.values[position] is options.get("weight")
    if not (isinstance(source, int) and weight_at and plain and isinstance(ids, Tensor)):
        return None
    return ids if not ids.requires_grad and not ids.is_floating_point() else None


def _substituted(
    arguments: CallArguments,
    sources: Mapping[int, Source],
    leaf_values: Mapping[int, Tensor],
    samples: Mapping[int, Tensor] | None = None,
) -> list[Any]:
    """The flat argument values with parameters (re)computed from ``leaf_values``."""
    values = list(arguments.values)
    for position, source in sources.items():
        if isinstance(source, int):
            values[position] = leaf_values[source]
        else:
            values[position] = source.compute(leaf_values)
    for position, sample in (samples or {}).items():
        values[position] = sample
    return values


@dataclass(frozen=True)
class LocalInputs:
    """What the batch pass keeps of one op call that consumes parameters (a *local site*).

    Attributes:
        func: The op.
        arguments: Its flattened arguments, as called in the batch pass.
        sources: Flat position -> leaf index or derivation, for every parameter argument.
        batched: Flat positions of tensors with one row per sample (dim 0).
        narrow: Positions of broadcast derivations: a sample sees their first row.
        leaf_values: The parameter leaves the call depends on, by index.
        rows: Samples of a restriction to some of them (``local[:, index]``): the broadcast
            derivations are copied to as many rows; ``None``: the recorded batch.
    """

    func: Callable[..., Any]
    arguments: CallArguments
    sources: Mapping[int, Source]
    batched: tuple[int, ...]
    narrow: frozenset[int]
    leaf_values: Mapping[int, Tensor]
    rows: int | None = None

    def with_arguments(self, arguments: CallArguments) -> LocalInputs:
        """The same call with other (flattened) arguments, e.g. detached ones.

        Args:
            arguments: The call's arguments, laid out as :attr:`arguments`.

        Returns:
            The recorded call with those arguments.
        """
        return LocalInputs(
            self.func,
            arguments,
            self.sources,
            self.batched,
            self.narrow,
            self.leaf_values,
            self.rows,
        )

    def __getitem__(self, key: tuple[slice, slice | Tensor]) -> LocalInputs:
        """Restrict to some samples: ``local[:, index]``, as canonical tensors' dim 1."""
        index = key[1]
        values = list(self.arguments.values)
        batched = self.per_sample()
        for position in batched:
            values[position] = values[position][index]
        rows = len(values[batched[0]]) if batched else None
        arguments = self.arguments.with_values(values)
        return LocalInputs(
            self.func, arguments, self.sources, batched, self.narrow, self.leaf_values, rows
        )

    def per_sample(self) -> tuple[int, ...]:
        """Positions of the arguments with one row per sample.

        :attr:`batched`; in a record of one sample, whose arguments kept their shapes,
        those with one row (that sample's, or the same for it).

        Returns:
            Flat argument positions.
        """
        return self.batched or self._rows_of_one()

    def _rows_of_one(self) -> tuple[int, ...]:
        """A record of one sample, whose arguments kept their shapes: those with one row.

        They are that sample's (or the same for it): a restriction to samples ``[0, 0]``
        copies them (without, a norm's input kept one row beside cotangents of two).
        """
        return tuple(
            position
            for position, value in enumerate(self.arguments.values)
            if position not in self.sources
            and isinstance(value, Tensor)
            and value.dim()
            and value.shape[0] == 1
        )

    def detach(self) -> LocalInputs:
        """The same call with its recorded tensors detached from autograd (values only)."""
        values = tuple(
            v.detach() if isinstance(v, Tensor) and i not in self.sources else v
            for i, v in enumerate(self.arguments.values)
        )
        return self.with_arguments(self.arguments.with_values(values))

    def leaf_of(self, param: Tensor) -> int:
        """Index of the leaf ``param`` (by identity) among those the call depends on."""
        for leaf, value in self.leaf_values.items():
            if value is param:
                return leaf
        raise KeyError("the parameter is not used by this call")

    def evaluate(self, leaf: int, value: Tensor, samples: Mapping[int, Tensor] | None) -> Tensor:
        """The op's output with leaf ``leaf`` set to ``value`` and batched arguments replaced.

        Args:
            leaf: The leaf to replace.
            value: Its value.
            samples: Flat position -> tensor for batched arguments (``None``: as recorded).

        Returns:
            The output.
        """
        leaf_values = {**self.leaf_values, leaf: value}
        values = _substituted(self.arguments, self.sources, leaf_values, samples)
        for position in self.narrow:  # a sample sees the first row; a restriction, copies
            first = values[position][:1]
            if samples is not None:
                values[position] = first
            elif self.rows is not None:
                values[position] = first.expand(self.rows, *first.shape[1:])
        args, kwargs = without_running_updates(self.func, *self.arguments.rebuild(values))
        # an op whose batching rules are wrong runs as one whose rules are exact
        return cast(Tensor, run_decomposed(self.func, args, kwargs))


_OWN_STATISTICS: dict[Callable[..., Any], tuple[str, bool]] = {
    F.instance_norm: ("use_input_stats", True),
    F.batch_norm: ("training", False),
}
"""Normalizations with running averages: the flag (and its default) of using their own
statistics, where the averages are only updated (see :func:`without_running_updates`)."""


def without_running_updates(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A normalization that uses its own statistics, run again without its running averages.

    ``F.instance_norm`` with ``use_input_stats`` and ``F.batch_norm`` in training mode
    update their running averages in place and do not read them: a replay of the call
    (op-local statistics) would update them once more.

    Args:
        func: The function of the call.
        args: Its positional arguments.
        kwargs: Its keyword arguments.

    Returns:
        ``(args, kwargs)``, the running averages ``None`` where they are only updated.

    Example:
        >>> stats = (torch.zeros(2), torch.ones(2))
        >>> args, _ = without_running_updates(F.batch_norm, (torch.ones(3, 2), *stats), {
        ...     "training": True})
        >>> args[1:]
        (None, None)
    """
    if func not in _OWN_STATISTICS:
        return args, kwargs
    bound = inspect.signature(func).bind(*args, **kwargs)
    flag, default = _OWN_STATISTICS[func]
    if not bound.arguments.get(flag, default):
        return args, kwargs
    bound.arguments["running_mean"] = bound.arguments["running_var"] = None
    return bound.args, bound.kwargs


def _flatten_local(local: LocalInputs) -> tuple[list[Tensor], tuple[LocalInputs, tuple[int, ...]]]:
    """The tensors of a recorded call, for ``torch.func`` (which unwraps them from its levels)."""
    positions = tuple(i for i, v in enumerate(local.arguments.values) if isinstance(v, Tensor))
    return [local.arguments.values[i] for i in positions], (local, positions)


def _unflatten_local(
    tensors: Iterable[Tensor], context: tuple[LocalInputs, tuple[int, ...]]
) -> LocalInputs:
    local, positions = context
    values = list(local.arguments.values)
    for position, tensor in zip(positions, tensors):
        values[position] = tensor
    return local.with_arguments(local.arguments.with_values(values))


pytree.register_pytree_node(LocalInputs, _flatten_local, _unflatten_local)
