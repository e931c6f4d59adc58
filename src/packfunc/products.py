"""Curvature-matrix products, matrix-free: whole matrices and per-parameter blocks.

Vector products take ``v`` shaped like ``params``; block products take ``mats``
whose leaf for parameter ``p`` is ``[V, *p.shape]`` (or ``None`` to skip it) and
multiply by ``p``'s own block only — BackPACK's ``GGNMP``, ``HMP`` and ``PCHMP``.
The GGN product is ``Jᵀ (∇²_f L) J v`` (forward-mode through the model, the loss
Hessian w.r.t. the output, reverse-mode back); the Hessian product is
forward-over-reverse differentiation of the loss. Both are exact for every
supported loss and model. The positive-curvature Hessian (PCH) replaces the
curvature of each elementwise nonlinearity by its clipped or absolute value; like
BackPACK's, it is defined for sequential models.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast

import optree
import torch
from torch import Tensor, nn
from torch._C._functorch import (
    TransformType,
    get_unwrapped,
    is_functorch_wrapped_tensor,
    maybe_current_level,
    maybe_get_level,
)
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
from torch.func import grad, vmap
from torch.overrides import TorchFunctionMode
from typing_extensions import Unpack

from packfunc.data import DataOptions, over_data
from packfunc.engine.autodiff import jvp, naming_missing_derivatives, refuse_differentiation, vjp
from packfunc.engine.batch_pass import BatchPass
from packfunc.engine.model_state import buffer_restorer
from packfunc.engine.modes import functional_mode, is_metadata_query, twice_differentiable
from packfunc.engine.pch import loss_hessian_product, pch_block_product
from packfunc.engine.precision import difference_beyond_rounding, full_precision, in_loss_dtype
from packfunc.engine.randomness import random_model_error
from packfunc.functionalize import (
    check_model_arguments,
    flatten_params,
    leading_sizes,
    module_of,
    path_name,
    refuse_unsplittable_inputs,
    run_model,
)
from packfunc.losses import (
    check_loss,
    check_loss_inputs,
    check_target_batch,
    default_loss,
    given_targets,
    hessian_factors,
)
from packfunc.specs import SPECS
from packfunc.types import (
    DATA_ARGUMENTS,
    Inputs,
    ModelFn,
    Modify,
    ParamsT,
    PyTree,
    Targets,
    shares_arguments,
)

F = TypeVar("F", bound=Callable[..., Any])


def _buffers_put_back_on_refusal(product: F) -> F:
    """Put the model's buffers back where ``product`` raises (a refusal changes nothing).

    A product runs the model in several transforms; a model that updates a buffer in its
    forward (spectral norm's power iteration in training mode) is refused, after some of
    them ran.

    Args:
        product: A public product function, ``model_fn`` its first argument.

    Returns:
        The same function.

    Example:
        >>> norm = torch.nn.BatchNorm1d(2)
        >>> failing = _buffers_put_back_on_refusal(lambda fn, p: (norm(torch.randn(3, 2)), 1 / 0))
        >>> try:
        ...     failing(packfunc.functional(norm)[0], None)
        ... except ZeroDivisionError:
        ...     norm.running_mean
        tensor([0., 0.])
    """

    @functools.wraps(product)
    def run(model_fn: ModelFn, *args: Any, **kwargs: Any) -> Any:
        restore = buffer_restorer(module_of(model_fn))
        try:
            return product(model_fn, *args, **kwargs)
        except Exception:
            restore()
            raise

    return cast(F, run)


@over_data(SPECS["ggn_vector_product"], required=("v",))
@shares_arguments("model_fn", "params", "X", "y", *DATA_ARGUMENTS)
@_buffers_put_back_on_refusal
def ggn_vector_product(
    model_fn: ModelFn,
    params: ParamsT,
    X: Inputs = None,
    y: Targets = None,
    v: PyTree = None,
    *,
    loss: nn.Module | None = None,
    **dataset: Unpack[DataOptions],
) -> ParamsT:
    """Multiply the GGN of the reduced loss with ``v`` (BackPACK's ``ggn_vector_product``).

    Args:
        v: Pytree shaped like ``params``.
        loss: Loss module (default ``CrossEntropyLoss()``); ``NLLLoss`` is refused.

    Returns:
        ``G v``, a pytree shaped like ``params``.

    Example:
        >>> model_fn, params = packfunc.functional(torch.nn.Linear(3, 2))
        >>> v = {k: torch.ones_like(p) for k, p in params.items()}
        >>> ggn_vector_product(model_fn, params, torch.randn(4, 3), torch.tensor([0, 1, 1, 0]),
        ...                    v)["weight"].shape
        torch.Size([2, 3])
    """
    loss = _checked(loss, model_fn, params, X, y)
    forward = _model(model_fn, X, params, [])
    return cast(
        ParamsT, _first_column(_ggn_products(forward, params, _stacked(_like(v, params)), loss, y))
    )


@over_data(SPECS["hessian_vector_product"], required=("v",))
@shares_arguments("model_fn", "params", "X", "y", *DATA_ARGUMENTS)
@_buffers_put_back_on_refusal
def hessian_vector_product(
    model_fn: ModelFn,
    params: ParamsT,
    X: Inputs = None,
    y: Targets = None,
    v: PyTree = None,
    *,
    loss: nn.Module | None = None,
    **dataset: Unpack[DataOptions],
) -> ParamsT:
    """Multiply the Hessian of the reduced loss w.r.t. the parameters with ``v``.

    Args:
        v: Pytree shaped like ``params``.
        loss: Loss module (default ``CrossEntropyLoss()``).

    Returns:
        ``H v``, a pytree shaped like ``params``.

    Example:
        >>> model_fn, params = packfunc.functional(torch.nn.Linear(3, 2))
        >>> v = {k: torch.ones_like(p) for k, p in params.items()}
        >>> hessian_vector_product(model_fn, params, torch.randn(4, 3),
        ...                        torch.tensor([0, 1, 1, 0]), v)["bias"].shape
        torch.Size([2])
    """
    loss = _checked(loss, model_fn, params, X, y)
    forward = _model(model_fn, X, params, [])
    return cast(
        ParamsT,
        _first_column(_hessian_products(forward, params, _stacked(_like(v, params)), loss, y)),
    )


@over_data(SPECS["ggn_block_products"], required=("mats",))
@shares_arguments("model_fn", "params", "X", "y", *DATA_ARGUMENTS)
@_buffers_put_back_on_refusal
def ggn_block_products(
    model_fn: ModelFn,
    params: ParamsT,
    X: Inputs = None,
    y: Targets = None,
    mats: PyTree = None,
    *,
    loss: nn.Module | None = None,
    **dataset: Unpack[DataOptions],
) -> ParamsT:
    """Multiply each parameter's GGN block with a stack of matrices (BackPACK's ``GGNMP``).

    Args:
        mats: Pytree like ``params``; leaf ``[V, *p.shape]``, or ``None`` to skip.
        loss: Loss module (default ``CrossEntropyLoss()``).

    Returns:
        Pytree like ``params``: ``G_pp @ mats[p]`` per leaf (``None`` where skipped).

    Example:
        >>> model_fn, params = packfunc.functional(torch.nn.Linear(3, 2))
        >>> mats = {k: torch.ones(5, *p.shape) for k, p in params.items()}
        >>> ggn_block_products(model_fn, params, torch.randn(4, 3),
        ...                    torch.tensor([0, 1, 1, 0]), mats)["weight"].shape
        torch.Size([5, 2, 3])
    """
    loss = _checked(loss, model_fn, params, X, y)
    return _per_block(
        model_fn, params, X, mats, lambda forward, leaf, m: _ggn_products(forward, leaf, m, loss, y)
    )


@over_data(SPECS["hessian_block_products"], required=("mats",))
@shares_arguments("model_fn", "params", "X", "y", *DATA_ARGUMENTS)
@_buffers_put_back_on_refusal
def hessian_block_products(
    model_fn: ModelFn,
    params: ParamsT,
    X: Inputs = None,
    y: Targets = None,
    mats: PyTree = None,
    *,
    loss: nn.Module | None = None,
    **dataset: Unpack[DataOptions],
) -> ParamsT:
    """Multiply each parameter's Hessian block with a stack of matrices (BackPACK's ``HMP``).

    Args:
        mats: Pytree like ``params``; leaf ``[V, *p.shape]``, or ``None`` to skip.
        loss: Loss module (default ``CrossEntropyLoss()``).

    Returns:
        Pytree like ``params``: ``H_pp @ mats[p]`` per leaf (``None`` where skipped).

    Example:
        >>> model_fn, params = packfunc.functional(torch.nn.Linear(3, 2))
        >>> mats = {k: torch.ones(5, *p.shape) for k, p in params.items()}
        >>> hessian_block_products(model_fn, params, torch.randn(4, 3),
        ...                        torch.tensor([0, 1, 1, 0]), mats)["bias"].shape
        torch.Size([5, 2])
    """
    loss = _checked(loss, model_fn, params, X, y)
    return _per_block(
        model_fn,
        params,
        X,
        mats,
        lambda forward, leaf, m: _hessian_products(forward, leaf, m, loss, y),
    )


@over_data(SPECS["pch_block_products"], required=("mats",))
@shares_arguments("model_fn", "params", "X", "y", *DATA_ARGUMENTS)
def pch_block_products(
    model_fn: ModelFn,
    params: ParamsT,
    X: Inputs = None,
    y: Targets = None,
    mats: PyTree = None,
    *,
    loss: nn.Module | None = None,
    modify: Modify = "clip",
    **dataset: Unpack[DataOptions],
) -> ParamsT:
    """Multiply each parameter's positive-curvature Hessian block with matrices (``PCHMP``).

    The PCH is the Hessian with every elementwise nonlinearity's curvature term
    ``δ ⊙ φ''`` replaced by its clipped (``max(·, 0)``) or absolute value, so that
    the result is positive semi-definite. (BackPACK 1.7.1's ``PCHMP`` multiplies
    that term by the gradient ``δ`` a second time; this follows the definition.)

    Args:
            nonlinearities are elementwise (or piecewise linear, like max-pooling).
        mats: Pytree like ``params``; leaf ``[V, *p.shape]``, or ``None`` to skip.
        loss: Loss module (default ``CrossEntropyLoss()``).
        modify: ``"clip"``, ``"abs"``, or ``"none"`` (no modification: the Hessian block).

    Returns:
        Pytree like ``params``: ``PCH_pp @ mats[p]`` per leaf (``None`` where skipped).

    Raises:
        ValueError: for a non-sequential model, another nonlinearity, a parameter used
            outside one linear or convolution layer, or a bad ``modify``.

    Example:
        >>> model_fn, params = packfunc.functional(torch.nn.Sequential(
        ...     torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)))
        >>> mats = {k: torch.ones(5, *p.shape) for k, p in params.items()}
        >>> pch_block_products(model_fn, params, torch.randn(4, 3),
        ...                    torch.tensor([0, 1, 1, 0]), mats)["0.weight"].shape
        torch.Size([5, 4, 3])
    """
    if modify not in ("clip", "abs", "none"):
        raise ValueError(f"modify must be 'clip', 'abs' or 'none'; got {modify!r}.")
    bp = BatchPass(
        model_fn,
        params,
        X,
        given_targets(y, "pch_block_products"),
        _checked(loss, model_fn, params),
    )
    blocks = _checked_mats(params, mats)
    with twice_differentiable(), bp.undone_on_refusal():
        results = [
            None if m is None else pch_block_product(bp, i, m, modify) for i, m in enumerate(blocks)
        ]
    found = optree.tree_unflatten(bp.treespec, results)
    # its chain holds the second derivatives before each layer constant: no gradient
    return cast(ParamsT, refuse_differentiation(found, bp.leaves, "pch_block_products", bp.X))


def _checked(
    loss: nn.Module | None, model_fn: ModelFn, params: Any, X: Any = None, y: Any = None
) -> nn.Module:
    """The loss, checked with the arguments before the model runs.

    Sparse and nested inputs, and targets of another batch size than the inputs' (where
    every input has one leading size), are refused here, not after a forward of the batch.
    """
    check_model_arguments(model_fn, params)
    loss = loss or default_loss()
    check_loss(loss)
    flatten_params(params)
    refuse_unsplittable_inputs(X)
    sizes = leading_sizes(X)
    if len(sizes) == 1:
        check_target_batch(loss, y, sizes.pop())
    return loss


def _model(model_fn: ModelFn, X: Any, params: Any, replaced: list[int]) -> Callable[[Any], Tensor]:
    """The model as a function of all params (``replaced=[]``) or of one leaf."""
    leaves, treespec = optree.tree_flatten(params)

    def forward(chosen: Any) -> Tensor:
        current = chosen
        if replaced:
            current = list(leaves)
            current[replaced[0]] = chosen
            current = optree.tree_unflatten(treespec, current)
        # the products are of the whole batch, in full precision (see engine/precision.py)
        with full_precision(), functional_mode(batch_statistics=True), _ReverseModeInside():
            return in_loss_dtype(run_model(model_fn, current, X), leaves)  # engine/precision.py

    return forward


def _per_block(
    model_fn: ModelFn,
    params: ParamsT,
    X: Any,
    mats: Any,
    product: Callable[[Callable[[Any], Tensor], Tensor, Tensor], Tensor],
) -> ParamsT:
    leaves, treespec = optree.tree_flatten(cast(Any, params))
    blocks = _checked_mats(params, mats)
    with twice_differentiable():
        results = [
            None if m is None else product(_model(model_fn, X, params, [i]), leaves[i], m)
            for i, m in enumerate(blocks)
        ]
    return cast(ParamsT, optree.tree_unflatten(treespec, results))


def _checked_mats(params: Any, mats: Any) -> list[Tensor | None]:
    """The leaves of ``mats``, one per parameter leaf, each ``None`` or a stack ``[V, *p]``.

    Raises:
        ValueError: naming the leaf and the layout it takes.
    """
    leaves, _, names = flatten_params(params)
    paths, blocks, _ = optree.tree_flatten_with_path(cast(Any, mats), none_is_leaf=True)
    given = [path_name(path) for path in paths]
    if given != names:
        missing = [name for name in names if name not in given]
        unknown = [name for name in given if name not in names]
        raise ValueError(
            f"mats must have one leaf (or None) per parameter leaf, laid out as params: "
            f"missing {missing}, not parameters {unknown} (mats has {len(blocks)} leaves, "
            f"params {len(leaves)})."
        )
    for name, m, leaf in zip(names, blocks, leaves, strict=True):
        if m is not None and not isinstance(m, Tensor):
            raise TypeError(
                f"mats[{name!r}] is of type {type(m).__name__}; each leaf of mats is a tensor of V "
                f"vectors stacked as [V, *p.shape] (or None: no product for {name!r})."
            )
        if m is not None and not (m.is_floating_point() or m.is_complex()):
            raise TypeError(
                f"mats[{name!r}] has dtype {m.dtype}; products take floating-point vectors "
                f"(mats[{name!r}].to({leaf.dtype}))."
            )
        if m is not None and (m.dim() != leaf.dim() + 1 or m.shape[1:] != leaf.shape):
            stack = ", ".join(["V", *map(str, leaf.shape)])
            raise ValueError(
                f"mats[{name!r}] has shape {list(m.shape)}; the parameter {name!r} of shape "
                f"{list(leaf.shape)} takes V vectors stacked as [{stack}] (from columns laid "
                "out [V, p.numel()]: m.reshape(-1, *p.shape))."
            )
    return cast(list[Tensor | None], blocks)


class _ReverseModeInside(TorchFunctionMode):
    """Refuses a parameter the model differentiates in reverse mode inside its own forward.

    An energy model's ``torch.func.grad`` of ``E`` in ``x``, a PINN's ``jacrev``/``hessian``:
    the products read a zero block for the parameters used there (the first-order quantities
    refuse them in discovery). A ``vmap``, ``jvp`` or ``jacfwd`` inside the forward is exact.
    """

    def __init__(self) -> None:
        super().__init__()
        self.level = maybe_current_level() or 0  # the products' own transforms

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if (maybe_current_level() or 0) > self.level and self._reverse_mode_inside():
            values: list[Any] = optree.tree_leaves((args, kwargs))  # type: ignore[arg-type]
            if any(self._from_outside(v) for v in values):
                raise ValueError(_REVERSE_MODE_INSIDE.format(name=getattr(func, "__name__", func)))
        return func(*args, **kwargs)

    def _reverse_mode_inside(self) -> bool:
        return any(
            i.level() > self.level and i.key() == TransformType.Grad
            for i in retrieve_all_functorch_interpreters()
        )

    def _from_outside(self, value: Any) -> bool:
        """A tensor of the products' levels (the parameters, or made of them) used inside."""
        while isinstance(value, Tensor) and is_functorch_wrapped_tensor(value):
            level = maybe_get_level(value)
            if level <= self.level:
                return level > 0
            value = get_unwrapped(value)
        return False


_REVERSE_MODE_INSIDE = (
    "the model uses a parameter inside a reverse-mode torch.func transform of its own forward "
    "(torch.func.grad, vjp, jacrev or hessian: {name}), whose calls packfunc's products cannot "
    "differentiate through: their block for that parameter would read zero. Compute the "
    "products with torch.func (jvp of grad of the loss) for such a model."
)


class _CallsWithoutGradient(TorchFunctionMode):
    """Notes a call the model makes under ``torch.no_grad()`` on a value of the parameters.

    Autograd (and a plain GGN) takes such a value as a constant; the GGN products' forward
    mode (``J t``) does not see ``no_grad`` and would differentiate it: a wrong product.
    """

    def __init__(self) -> None:
        super().__init__()
        self.found: str | None = None

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if self.found is None and not torch.is_grad_enabled() and not is_metadata_query(func):
            values: list[Any] = optree.tree_leaves((args, kwargs))  # type: ignore[arg-type]
            if any(isinstance(v, Tensor) and is_functorch_wrapped_tensor(v) for v in values):
                name = getattr(func, "__name__", "")
                self.found = name if name and name != "__get__" else "a view"
        return func(*args, **kwargs)

    def refuse(self) -> None:
        """Raise if such a call was made.

        Raises:
            ValueError: naming the call and the fix.
        """
        if self.found is not None:
            raise ValueError(
                f"the model computes {self.found} of its parameters under torch.no_grad(), a "
                "constant to autograd; GGN products take J t in forward mode, which no_grad "
                "does not stop, so the product would differentiate it. Use .detach() for such "
                "a constant (it stops both modes; spectral_norm's power iteration in training "
                "mode is one: call model.eval()), or diag_ggn / hessian_vector_product."
            )


def _ggn_products(
    forward: Callable[[Any], Tensor], primal: Any, tangents: Any, loss: nn.Module, y: Targets
) -> Any:
    """``Jᵀ (∇²_f L) J t`` for a stack of tangents (leading dim ``V``)."""
    targets = given_targets(y, "ggn_vector_product")
    with twice_differentiable():
        with _CallsWithoutGradient() as seen:
            output, pullback = vjp(forward, primal)
        seen.refuse()
        check_loss_inputs(loss, output, targets, output.shape[0])
        hessian_factors(loss, output.detach(), targets)  # refuses losses without a usable curvature
        loss_hessian = loss_hessian_product(loss, output, targets)

        def one(t: Any) -> tuple[Any, Tensor]:
            out, jt = jvp(forward, (primal,), (t,))  # J t, forward mode
            return pullback(loss_hessian(jt))[0], out  # Jᵀ (∇²_f L) J t

        instead = (
            "The GGN products take J v in forward mode, for which torch has no formula of "
            "that op: use hessian_vector_product (reverse mode only), or the GGN quantities "
            "(diag_ggn, batch_diag_ggn, sqrt_ggn, kflr)."
        )
        try:
            with naming_missing_derivatives("forward", instead):
                products, outputs = vmap(one)(tangents)
        except RuntimeError as error:
            if "randomness" not in str(error):
                raise
            rerun = "each Jacobian-vector product"
            raise random_model_error("e.g. dropout in training mode", rerun) from error
        _refuse_another_forward_mode_output(outputs, output)
        return products


def _refuse_another_forward_mode_output(outputs: Tensor, output: Tensor) -> None:
    """Refuse a forward-mode pass whose output is not the reverse-mode pass's.

    ``J t`` is taken in forward mode, ``Jᵀ`` from the reverse-mode pass: a model that
    branches on ``tensor.requires_grad`` (false for forward-mode tensors) runs another
    function in each, and the product mixed them (0.4 off the GGN's; a probe).

    Args:
        outputs: The forward-mode passes' outputs ``[V, ...]``.
        output: The reverse-mode pass's.

    Raises:
        ValueError: where they differ beyond rounding.
    """
    if not len(outputs) or is_functorch_wrapped_tensor(output):
        return  # (under vmap, values decide nothing)
    what = difference_beyond_rounding(outputs[0].detach(), output.detach())
    if what is not None:
        raise ValueError(
            f"the model's output in forward mode (for J v) {what} from its output in reverse "
            "mode (for Jᵀ): the forward takes another path in each, likely a branch on a "
            "tensor's requires_grad (false for forward-mode tensors) or on "
            "torch.is_grad_enabled(). Branch on self.training instead, or use "
            "hessian_vector_product, which runs reverse mode only."
        )


def _hessian_products(
    forward: Callable[[Any], Tensor], primal: Any, tangents: Any, loss: nn.Module, y: Targets
) -> Any:
    """``∇²L t`` for a stack of tangents (leading dim ``V``), reverse-over-reverse.

    The Hessian is symmetric, so pulling ``t`` back through the gradient gives ``∇²L t``;
    unlike forward-over-reverse this needs no forward-mode formula for the loss's
    backward (``MSELoss(reduction='mean')`` and ``HuberLoss`` have none that works).
    """
    targets = given_targets(y, "hessian_vector_product")

    def total(p: Any) -> Tensor:
        output = forward(p)
        check_loss_inputs(loss, output, targets, output.shape[0])
        value: Tensor = loss(output, targets)
        return value

    instead = (
        "The Hessian products differentiate the model twice, and torch has no second "
        "derivative of that op: use ggn_vector_product, or the GGN quantities (diag_ggn, "
        "batch_diag_ggn, sqrt_ggn, kflr)."
    )
    with twice_differentiable(), naming_missing_derivatives("reverse", instead):
        _, pullback = vjp(grad(total), primal)
        return vmap(lambda t: pullback(t)[0])(tangents)


def _like(v: Any, params: Any) -> Any:
    """``v`` in the structure of ``params``: a dict's keys put in their order, shapes checked.

    Args:
        v: The vector, a pytree like ``params``.
        params: The parameters.

    Returns:
        ``v`` with ``params``' structure.

    Raises:
        ValueError: naming the keys or leaves where ``v`` is not shaped like ``params``.

    Example:
        >>> params = {"w": torch.zeros(2), "b": torch.zeros(1)}
        >>> list(_like({"b": torch.ones(1), "w": torch.ones(2)}, params))
        ['w', 'b']
    """
    if isinstance(v, Mapping) and isinstance(params, Mapping):
        missing, unknown = set(params) - set(v), set(v) - set(params)
        if missing or unknown:
            raise ValueError(
                f"v must be shaped like params: missing {sorted(missing, key=str)}, unknown "
                f"{sorted(unknown, key=str)}."
            )
        v = _reordered_like(params, v)
    leaves, spec = optree.tree_flatten(v)
    expected, expected_spec = optree.tree_flatten(params)
    if spec != expected_spec:
        raise ValueError(
            f"v must be shaped like params: its structure is {spec}, not {expected_spec}."
        )
    for path, leaf, param in zip(optree.tree_paths(params), leaves, expected, strict=True):
        if not isinstance(leaf, Tensor) or leaf.shape != param.shape:
            shape = tuple(leaf.shape) if isinstance(leaf, Tensor) else type(leaf).__name__
            raise ValueError(
                f"v must be shaped like params: at {'.'.join(map(str, path))} it has "
                f"{shape}, the parameter {tuple(param.shape)}."
            )
    return v


def _reordered_like(params: Mapping[Any, Any], v: Mapping[Any, Any]) -> Any:
    """``v``'s values in ``params``' key order and mapping type (an ``OrderedDict`` stays one).

    Example:
        >>> from collections import OrderedDict
        >>> _reordered_like(OrderedDict(a=0, b=1), {"b": 2, "a": 3})
        OrderedDict([('a', 3), ('b', 2)])
    """
    if isinstance(params, dict):
        reordered = copy.copy(params)  # (optree tells an OrderedDict from a dict)
        reordered.update((k, v[k]) for k in params)
        return reordered
    return {k: v[k] for k in params}


def _stacked(v: Any) -> Any:
    return optree.tree_map(lambda t: t.unsqueeze(0), v)


def _first_column(stacked: Any) -> Any:
    return optree.tree_map(lambda t: t.squeeze(0), stacked)


__all__ = [
    "ggn_block_products",
    "ggn_vector_product",
    "hessian_block_products",
    "hessian_vector_product",
    "pch_block_products",
]
