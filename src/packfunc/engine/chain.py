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


class _ChainMode(FunctionalMode):
    leaf_of: LeafIndex

    def __init__(self, leaf_of: LeafIndex, start: Tensor):
        super().__init__()
        self.leaf_of, self.current = leaf_of, start
        self.links: list[Link] = []
        self.seen: set[int] = set()

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

    def _follow(
        self,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        run: Callable[[], Any],
        call: SiteCall | None,
    ) -> Any:
        arguments = list(args) + list(kwargs.values())
        positions = [i for i, a in enumerate(arguments) if a is self.current]
        stale = [a for a in arguments if isinstance(a, Tensor) and id(a) in self.seen]
        if stale or len(positions) > 1:
            raise NotSequentialError(
                f"{getattr(func, '__name__', func)} reads an earlier activation or the current "
                "one twice (a residual connection or reuse); KFRA's recursion is only defined "
                "for sequential networks. Use kflr or kfac instead."
            )
        if not positions:
            return run()
        name = getattr(func, "__name__", "")
        if name.endswith("_") and not name.startswith("__"):
            raise NotSequentialError(
                f"{name} changes an activation in place; write the model with "
                "out-of-place ops (e.g. nn.ReLU() rather than nn.ReLU(inplace=True)) for KFRA."
            )
        saved = self.current.clone() if kwargs.get("inplace") else self.current
        out = run()
        if "inplace" in kwargs:
            kwargs = {**kwargs, "inplace": False}
        self.links.append(Link(func, args, kwargs, positions[0], saved, out, call))
        if out is not self.current:
            self.seen.add(id(self.current))
        self.current = out
        return out


def trace_chain(model_fn: ModelFn, params: Any, leaves: list[Tensor], X: Tensor) -> list[Link]:
    """Record the ops of a sequential model applied to ``X``.

    Args:
        model_fn: ``model_fn(params, X)``.
        params: The parameter pytree.
        leaves: Its flattened leaves.
        X: The inputs, one tensor.

    Returns:
        The links, in the order the ops ran.

    Raises:
        NotSequentialError: if an op reads an earlier activation (residual connections,
            reused activations) or the output is not the end of the chain.

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
        output = model_fn(params, X)
    if output is not mode.current:
        raise NotSequentialError(
            "the model output is not the last op applied to its input; KFRA's recursion is "
            "only defined for sequential networks. Use kflr or kfac instead."
        )
    return mode.links


def passes_recursions(link: Link) -> bool:
    """Whether the chain recursions handle the op (layers, elementwise, reshapes, pooling)."""
    return bool(
        link.call
        or link.func in ELEMENTWISE
        or link.func in RESHAPES
        or link.func in PIECEWISE_LINEAR
    )
