"""Sequential models as chains of ops: tracing, and the ops the recursions understand.

:func:`trace_chain` runs the model once and records every op applied to the
*chain tensor* — the input, then each op's output in turn. A model is
sequential when every op takes the current chain tensor once and nothing
else ever reads an earlier one (no residual connections, no reuse); otherwise
a clear error is raised. KFRA (``engine/kfra.py``), the PCH products
(``engine/pch.py``) and the Hessian-diagonal recursion
(``engine/hessian_recursion.py``) work on the traced chain; the op table
(``engine/ops.py``) says which ops they understand.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor

from packfunc.engine.modes import FunctionalMode, LeafIndex, is_metadata_query
from packfunc.engine.ops import (
    ELEMENTWISE,
    PIECEWISE_LINEAR,
    RESHAPES,
    OpSignature,
    SiteCall,
    make_call,
)
from packfunc.functionalize import run_model
from packfunc.types import ModelFn


@dataclass
class Link:
    """One op of the chain.

    Attributes:
        func: The function called.
        args: Its positional arguments.
        kwargs: Its keyword arguments (``inplace`` switched off).
        position: Index of the chain tensor among ``args`` then ``kwargs`` values.
        input: The chain tensor the op received (a copy, if the op was in place).
        output: The op's output.
        call: For a tapped op with a parameter weight or bias, its description.
    """

    func: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    position: int
    input: Tensor
    output: Tensor
    call: SiteCall | None = None

    @property
    def op(self) -> OpSignature | None:
        """The tapped op's signature, or ``None`` for any other op."""
        return self.call.op if self.call is not None else None

    def apply(self, chain: Tensor) -> Tensor:
        """The op as a function of the chain tensor, every other argument fixed."""
        return cast(Tensor, self.with_argument(self.position, chain))

    def with_argument(self, position: int | str, value: Any) -> Any:
        """Call the op with one argument (an index, or a keyword) replaced."""
        args, kwargs = list(self.args), dict(self.kwargs)
        if isinstance(position, str):
            kwargs[position] = value
        elif position < len(args):
            args[position] = value
        else:
            kwargs[list(kwargs)[position - len(args)]] = value
        return self.func(*args, **kwargs)


class NotSequentialError(ValueError):
    """The model is not a chain of ops."""


@dataclass
class _Made:
    """A tensor of the chain: the op that made it and the one before, for the walk back.

    ``merged``: the op read two chain tensors (or one twice), naming the op.
    """

    tensor: Tensor
    link: Link | None = None
    before: _Made | None = None
    merged: str | None = None


class _ChainMode(FunctionalMode):
    """Follows every op on a tensor computed from the input; the chain is the path to the output.

    A branch whose result does not reach the output (a forward hook that logs an
    activation's statistics) is no part of it.
    """

    leaf_of: LeafIndex

    def __init__(self, leaf_of: LeafIndex, start: Tensor):
        super().__init__()
        self.leaf_of = leaf_of
        self.made: dict[int, _Made] = {id(start): _Made(start)}

    def _tapped(
        self,
        func: Callable[..., Any],
        sig: OpSignature,
        bound: dict[str, Any],
        run: Callable[[], Tensor],
    ) -> Tensor:
        call = make_call(sig, bound, self.leaf_of)
        return cast(Tensor, self._follow(func, (), bound, run, call))

    def _other(
        self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        if is_metadata_query(func):
            return func(*args, **kwargs)
        return self._follow(func, args, kwargs, lambda: func(*args, **kwargs), None)

    def chain_of(self, tensor: Tensor) -> _Made | None:
        """The chain entry of ``tensor``, if it was computed from the input."""
        found = self.made.get(id(tensor))
        return found if found is not None and found.tensor is tensor else None

    def _follow(
        self,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        run: Callable[[], Any],
        call: SiteCall | None,
    ) -> Any:
        arguments = list(args) + list(kwargs.values())
        positions = [i for i, a in enumerate(arguments) if self.chain_of(a) is not None]
        if not positions:
            return run()
        name = getattr(func, "__name__", "")
        if name.endswith("_") and not name.startswith("__"):
            raise NotSequentialError(
                f"{name} changes an activation in place; write the model with "
                "out-of-place ops (e.g. nn.ReLU() rather than nn.ReLU(inplace=True)) for KFRA."
            )
        current = arguments[positions[0]]
        before = self.chain_of(current)
        saved = current.clone() if kwargs.get("inplace") else current
        out = run()
        if "inplace" in kwargs:
            kwargs = {**kwargs, "inplace": False}
        merged = getattr(func, "__name__", str(func)) if len(positions) > 1 else None
        if isinstance(out, Tensor):
            link = Link(func, args, kwargs, positions[0], saved, out, call)
            self.made[id(out)] = _Made(out, link, before, merged)
        elif isinstance(out, tuple):  # h.max(-1), h.topk(k): each output is of the chain too
            for index, element in enumerate(out):
                if isinstance(element, Tensor) and element.is_floating_point():
                    picked = _ElementOf(func, index)
                    link = Link(picked, args, kwargs, positions[0], saved, element, call)
                    self.made[id(element)] = _Made(element, link, before, merged)
        return out


@dataclass(frozen=True)
class _ElementOf:
    """One output of an op that returns several (``values`` of ``h.max(-1)``), as an op.

    Example:
        >>> _ElementOf(torch.max, 0)(torch.tensor([[1.0, 3.0]]), -1)
        tensor([3.])
    """

    func: Callable[..., Any]
    index: int

    @property
    def __name__(self) -> str:  # the name ops are reported by
        return getattr(self.func, "__name__", str(self.func))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.func(*args, **kwargs)[self.index]


def trace_chain(model_fn: ModelFn, params: Any, leaves: list[Tensor], X: Tensor) -> list[Link]:
    """Record the ops of a sequential model applied to ``X``.

    The chain is the path of ops from ``X`` to the output; ops whose results do not reach
    the output are left out.

    Args:
        model_fn: ``model_fn(params, X)``.
        params: The parameter pytree.
        leaves: Its flattened leaves.
        X: The inputs, one tensor.

    Returns:
        The links, in the order the ops ran.

    Raises:
        NotSequentialError: if an op on the path reads an earlier activation or the current
            one twice (residual connections, reused activations), or the output is not
            computed from the input.

    Example:
        >>> fn, p = packfunc.functional(torch.nn.Sequential(torch.nn.Linear(3, 2),
        ...                                                 torch.nn.ReLU()))
        >>> [link.func.__name__ for link in trace_chain(fn, p, list(p.values()),
        ...                                             torch.ones(4, 3))]
        ['linear', 'relu']
    """
    if not isinstance(X, Tensor):
        raise NotSequentialError("KFRA needs a single input tensor X.")
    mode = _ChainMode(LeafIndex(leaves), X)
    with torch.no_grad(), mode:
        output = run_model(model_fn, params, X)
    entry = mode.chain_of(output) if isinstance(output, Tensor) else None
    if entry is None:
        raise NotSequentialError(
            "the model output is not computed from its input by a chain of ops; KFRA's "
            "recursion is only defined for sequential networks. Use kflr or kfac instead."
        )
    links: list[Link] = []
    while entry.link is not None:
        if entry.merged is not None:
            raise NotSequentialError(
                f"{entry.merged} reads an earlier activation or the current one twice (a "
                "residual connection or reuse); KFRA's recursion is only defined for "
                "sequential networks. Use kflr or kfac instead."
            )
        links.append(entry.link)
        assert entry.before is not None
        entry = entry.before
    return links[::-1]


def passes_recursions(link: Link) -> bool:
    """Whether the chain recursions handle the op (layers, elementwise, reshapes, pooling)."""
    return bool(
        link.call
        or link.func in ELEMENTWISE
        or link.func in RESHAPES
        or link.func in PIECEWISE_LINEAR
    )
