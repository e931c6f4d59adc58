"""``torch.func``'s ``vjp`` and ``jvp`` with precise return types.

``torch.func.vjp`` returns two or three values depending on ``has_aux``, and its
stub says so with a union; these wrappers fix the arity for the type checker.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any, cast

import optree
import torch
from torch import Tensor
from torch.autograd import forward_ad


def vjp(func: Callable[..., Any], *primals: Any) -> tuple[Any, Callable[..., tuple[Any, ...]]]:
    """``torch.func.vjp(func, *primals)``: the output and its pullback.

    Args:
        func: The function to differentiate.
        *primals: Its arguments.

    Returns:
        ``(func(*primals), pullback)``.

    Example:
        >>> out, pullback = vjp(torch.sin, torch.zeros(2))
        >>> pullback(torch.ones(2))
        (tensor([1., 1.]),)
    """
    return cast(tuple[Any, Callable[..., tuple[Any, ...]]], torch.func.vjp(func, *primals))


def vjp_with_aux(
    func: Callable[..., Any], *primals: Any
) -> tuple[Any, Callable[..., tuple[Any, ...]], Any]:
    """``torch.func.vjp(func, *primals, has_aux=True)``: output, pullback and auxiliary data.

    Args:
        func: Returns ``(output, aux)``.
        *primals: Its arguments.

    Returns:
        ``(output, pullback, aux)``.

    Example:
        >>> out, pullback, aux = vjp_with_aux(lambda x: (x.sin(), x.cos()), torch.zeros(2))
        >>> aux
        tensor([1., 1.])
    """
    return cast(
        tuple[Any, Callable[..., tuple[Any, ...]], Any],
        torch.func.vjp(func, *primals, has_aux=True),
    )


def jvp(
    func: Callable[..., Any], primals: tuple[Any, ...], tangents: tuple[Any, ...]
) -> tuple[Any, Any]:
    """``torch.func.jvp``: the output and its directional derivative.

    Args:
        func: The function to differentiate.
        primals: Its arguments.
        tangents: One tangent per argument.

    Returns:
        ``(func(*primals), J @ tangents)``.

    Example:
        >>> jvp(torch.sin, (torch.zeros(2),), (torch.ones(2),))[1]
        tensor([1., 1.])
    """
    with _FORWARD_MODE:
        return cast(tuple[Any, Any], torch.func.jvp(func, primals, tangents))


_FORWARD_MODE = threading.RLock()
"""Held by :func:`jvp`: torch's forward-mode levels are global to the process, so two
threads' forward-mode passes interleaved read each other's levels (torch's "invalid index"
errors, and once in a dozen runs a Hessian diagonal 0.02 off)."""


_VMAP_CANNOT = (
    "data-dependent control flow",
    # an in-place write of a sample's values into a tensor made without them (buf[idx] = h)
    "is not possible because there exists a Tensor `other`",
    # out[mask] = expert(tokens[mask]): a shape that depends on values (a mixture of experts)
    "Attempting to batch over indexing with a boolean mask",
    # rows = torch.where(idx == e)[0] (nonzero), masked_select: shapes that depend on values
    "operators that can output dynamic shape",
    # h.masked_select(mask) with a mask per sample
    "Attempted to vmap over `mask` in torch.masked_select",
    # pack_padded_sequence: the packed data's length is the sum of the samples' lengths
    "a PackedSequence cannot be formed under vmap",
)
"""What ``vmap`` says of models it cannot run but a loop over samples can."""


_UNTRANSFORMABLE_FUNCTION = (
    "it must override the setup_context staticmethod",  # an old-style forward(ctx, ...)
    "but it does not have vmap support",
)
"""What ``torch.func`` says of a custom ``autograd.Function`` it cannot transform."""


PACKED_UNDER_VMAP = (
    "a PackedSequence cannot be formed under vmap (pack_padded_sequence: the packed data's "
    "length is the sum of the samples' lengths): the samples run one by one"
)
"""Raised where ``vmap`` meets ``pack_padded_sequence``: :func:`over_samples` then loops, and
the whole-model path (which escapes it) runs torch's kernels a sample at a time."""


_APPLY = torch.autograd.Function.apply.__func__.__code__  # type: ignore[attr-defined]
"""The code of ``autograd.Function.apply``, on the stack while a custom forward runs."""


def custom_forward_running() -> str | None:
    """The custom ``autograd.Function`` whose forward the calling code runs in, if any.

    Its forward's ops are not what autograd differentiates (its backward is): a parameter
    used there cannot be followed through them. Torch's own (``torch.utils.checkpoint``)
    are left out: they recompute what they run.

    Returns:
        The innermost such function's name, or ``None``.

    Example:
        >>> class Twice(torch.autograd.Function):
        ...     @staticmethod
        ...     def forward(ctx, x):
        ...         return x * 2 if custom_forward_running() == "Twice" else x
        ...     @staticmethod
        ...     def backward(ctx, g):
        ...         return g * 2
        >>> Twice.apply(torch.ones(1))
        tensor([2.])
    """
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _APPLY:
            function = frame.f_locals.get("cls")
            if not getattr(function, "__module__", "").startswith("torch."):
                return cast(str, getattr(function, "__name__", repr(function)))
        frame = frame.f_back
    return None


def is_untransformable_function(error: Exception) -> bool:
    """Whether ``error`` is ``torch.func`` refusing a custom ``autograd.Function``.

    Such a function has no ``setup_context`` (an old-style ``forward(ctx, ...)``) or no
    vmap rule; plain autograd runs it.

    Args:
        error: An error raised under a ``torch.func`` transform.

    Returns:
        ``True`` for those refusals.

    Example:
        >>> is_untransformable_function(RuntimeError("data-dependent control flow"))
        False
    """
    return isinstance(error, RuntimeError) and any(
        reason in str(error) for reason in _UNTRANSFORMABLE_FUNCTION
    )


def mutates_captured_tensor(error: Exception) -> bool:
    """Whether ``error`` is ``torch.func`` refusing an in-place change of a captured tensor.

    A forward that updates a buffer (a counter, a running statistic) in place does that
    under a transform, which ``torch.func`` refuses.

    Args:
        error: An error raised under a ``torch.func`` transform.

    Returns:
        ``True`` for that refusal.

    Example:
        >>> mutates_captured_tensor(RuntimeError("data-dependent control flow"))
        False
    """
    return isinstance(error, RuntimeError) and "would mutate a captured Tensor" in str(error)


@contextlib.contextmanager
def naming_missing_derivatives(kind: str, instead: str) -> Iterator[None]:
    """Re-raise torch's error for an op without the ``kind`` of derivative, adding ``instead``.

    Args:
        kind: ``"forward"`` or ``"reverse"`` (see :func:`missing_derivative`).
        instead: What the caller's users can compute for such a model.

    Raises:
        NotImplementedError: torch's message followed by ``instead``; any other error as is.

    Example:
        >>> with naming_missing_derivatives("reverse", "Use the GGN."):
        ...     raise NotImplementedError("the derivative for 'x' is not implemented.")
        Traceback (most recent call last):
        ...
        NotImplementedError: the derivative for 'x' is not implemented. Use the GGN.
    """
    try:
        yield
    except (NotImplementedError, RuntimeError) as error:
        if missing_derivative(error) != kind:
            raise
        raise NotImplementedError(f"{error} {instead}") from error


def missing_derivative(error: Exception) -> str | None:
    """Which derivative torch lacks, where ``error`` says an op has none.

    Args:
        error: An error raised while differentiating the model.

    Returns:
        ``"forward"`` (no forward-mode formula: ``J v`` fails), ``"reverse"`` (no derivative
        of the op, or of its backward: differentiating twice fails), or ``None`` for any
        other error.

    Example:
        >>> missing_derivative(NotImplementedError("the derivative for 'x' is not implemented."))
        'reverse'
    """
    if not isinstance(error, (NotImplementedError, RuntimeError)):
        return None
    message = str(error)
    if "Trying to use forward AD with" in message:
        return "forward"
    if "derivative for" in message and "not implemented" in message:
        return "reverse"
    return None


class _Undifferentiable(torch.autograd.Function):
    """The identity on a value; its backward refuses (the value's gradient would be wrong)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(value: Tensor, name: str, why: str, *leaves: Tensor) -> Tensor:
        return value.clone()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        ctx.name, ctx.why = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> Any:
        raise RuntimeError(
            f"packfunc's {ctx.name} is not differentiable with respect to the parameters or "
            f"inputs: {ctx.why}"
        )

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> Any:
        """Forward mode (``torch.func.jvp``, ``jacfwd``) refuses as reverse mode does."""
        raise RuntimeError(
            f"packfunc's {ctx.name} is not differentiable with respect to the parameters or "
            f"inputs (forward mode either): {ctx.why}"
        )


_SECOND_DERIVATIVES_HELD = (
    "it holds the second derivatives through the layers before each parameter constant, so "
    "its gradient would be wrong. Differentiate diag_ggn, kflr or a dense Hessian "
    "(torch.autograd.functional.hessian with create_graph=True) instead."
)
"""Why a quantity's gradient is refused, unless another reason is given."""


def refuse_differentiation(
    value: Any,
    leaves: list[Tensor],
    name: str,
    inputs: Any = None,
    why: str = _SECOND_DERIVATIVES_HELD,
) -> Any:
    """``value`` (a pytree) whose gradient w.r.t. ``leaves`` or ``inputs`` raises, where one flows.

    With no leaf or input requiring grad (and outside ``torch.func.grad``) it is ``value``
    detached: a graph it keeps runs to tensors the model closes over (the module's other
    parameters, which are constants), and a backward pass through it wrote a wrong
    gradient into theirs.

    Args:
        value: A pytree of tensors (a quantity's result).
        leaves: The parameter leaves it was computed from.
        name: The quantity, for the message.
        inputs: The inputs ``X`` it was computed from (a pytree; its floating tensors).
        why: Why its gradient would be wrong, and what to do instead (the message's end).

    Returns:
        ``value``, each tensor connected to ``leaves`` by a node whose backward raises (or
        detached, see above).

    Example:
        >>> w = torch.ones(2, requires_grad=True)
        >>> found = refuse_differentiation({"w": w * 2}, [w], "kfra")
        >>> try:
        ...     found["w"].sum().backward()
        ... except RuntimeError as error:
        ...     print(str(error).split(":")[0])
        packfunc's kfra is not differentiable with respect to the parameters or inputs
    """
    tensors = [t for t in optree.tree_leaves(inputs) if isinstance(t, Tensor)]
    sources = [*leaves, *(t for t in tensors if t.is_floating_point())]
    reverse = torch.is_grad_enabled() and any(t.requires_grad for t in sources)
    if not (reverse or any(_has_tangent(t) for t in sources)):
        return optree.tree_map(
            lambda t: t.detach() if isinstance(t, Tensor) else t, value, none_is_leaf=True
        )

    def refused(t: Any) -> Any:
        if not (isinstance(t, Tensor) and t.is_floating_point()):
            return t
        return _Undifferentiable.apply(t, name, why, *sources)  # type: ignore[no-untyped-call]

    return optree.tree_map(refused, value, none_is_leaf=True)


def _has_tangent(t: Tensor) -> bool:
    """Whether ``t`` carries a forward-mode tangent (``torch.func.jvp``, ``jacfwd``, dual)."""
    return forward_ad.unpack_dual(t).tangent is not None


def under_vmap() -> bool:
    """Whether the caller runs inside ``torch.func.vmap`` (values cannot decide branches there).

    Example:
        >>> inside = torch.func.vmap(lambda x: x + under_vmap())(torch.zeros(2))
        >>> under_vmap(), inside.tolist()
        (False, [1.0, 1.0])
    """
    stack = torch._C._functorch.get_interpreter_stack() or []
    return any(level.key() == torch._C._functorch.TransformType.Vmap for level in stack)


def over_samples(
    func: Callable[..., Any], escape: tuple[str, ...] = (), **options: Any
) -> Callable[..., Any]:
    """``torch.func.vmap(func, **options)`` over samples, or a loop where vmap cannot go.

    A model that branches on tensor values (Hugging Face's mask code calls ``.all()``
    on the padding mask), or writes a sample's values in place into a tensor it made
    without them (an unpad/scatter into ``torch.zeros``), cannot run under ``vmap``; it
    then runs once per sample in a Python loop, with the same results.

    Args:
        func: The per-sample function.
        escape: Messages holding one of the reasons above for which the error is raised
            (the caller has a loop of its own for them).
        **options: ``vmap``'s options (``in_dims``; ``randomness`` applies to vmap only:
            models that draw random numbers are refused before a re-run).

    Returns:
        The mapped function (outputs stacked along dim 0, as vmap's).

    Example:
        >>> over_samples(torch.sin)(torch.zeros(2))
        tensor([0., 0.])
    """
    mapped = torch.func.vmap(func, **options)

    def run(*args: Any) -> Any:
        try:
            return mapped(*args)
        except RuntimeError as error:
            reasons = [r for r in _VMAP_CANNOT if not any(r in message for message in escape)]
            if not any(reason in str(error) for reason in reasons):
                raise
        dims = options.get("in_dims", 0)
        dims = dims if isinstance(dims, tuple) else (dims,) * len(args)
        count = optree.tree_leaves(args[0])[0].shape[dims[0]]
        results = [func(*_sample(args, dims, i)) for i in range(count)]
        return optree.tree_map(lambda *rows: torch.stack(rows), *results)

    return run


def _sample(args: tuple[Any, ...], dims: tuple[int, ...], i: int) -> list[Any]:
    """Sample ``i`` of every argument (pytrees of tensors batched along ``dims``)."""
    return [optree.tree_map(lambda t, d=d: t.select(d, i), a) for a, d in zip(args, dims)]
