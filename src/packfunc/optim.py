"""Curvature preconditioners: a functional (optax-style) transformation and torch optimizers.

:func:`preconditioner` returns ``Preconditioner(init, update)``: ``init(params)`` gives
a :class:`PreconditionerState` (a NamedTuple, hence an optree pytree) and
``update(grads, state, params, (X, y))`` returns ``(updates, new_state)`` with
``updates = -learning_rate · (C + damping·I)⁻¹ grads`` — add them to the params
(:func:`apply_updates`). Nothing is modified in place. The curvature ``C`` is

* ``"kfac"``: KFAC factors (``mc_samples=None``: KFLR), an exponential moving average
  (``ema``) refreshed every ``update_period`` steps and inverted every
  ``inverse_period`` steps — exactly in the Kronecker eigenbasis, or with π-damped
  factors (``pi_damping=True``, Martens & Grosse 2015);
* ``"ekfac"``: the eigenbasis of the (averaged) KFAC factors, recomputed every
  ``inverse_period`` steps, with eigenvalues re-fitted to the batch's column gradients
  every ``update_period`` steps (moving average between basis refreshes);
* ``"diag_ggn"``: the GGN diagonal (Adam-like: the averaged diagonal GGN where Adam
  has averaged squared gradients; exact, or Monte-Carlo with ``mc_samples``).

Step 0 always refreshes the curvature and its inverse. Which steps refresh is decided
in Python from ``state.step``. Parameters without a Kronecker rule, and transposed
convolutions, are refused by the Kronecker methods.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor, nn

from packfunc import kron
from packfunc.eigen_kfac import ekfac, ekfac_and_factors
from packfunc.engine.discovery import discover
from packfunc.functionalize import flatten_params, functional, select_samples
from packfunc.kronecker_factors import kfac, kflr
from packfunc.losses import default_loss
from packfunc.secondorder import diag_ggn
from packfunc.types import KfacApprox, ModelFn

METHODS = ("kfac", "ekfac", "diag_ggn")
"""The curvatures a preconditioner can use."""


class PreconditionerState(NamedTuple):
    """The state of a :func:`preconditioner` (an optree pytree).

    Attributes:
        step: Updates done so far (an integer scalar tensor).
        curvature: The averaged curvature: factor lists (``"kfac"``), ``kron.Eigen``
            (``"ekfac"``) or diagonals (``"diag_ggn"``); ``None`` before the first update.
        factors: ``"ekfac"``: the averaged KFAC factors its basis comes from; else ``None``.
        inverse: What multiplies the gradient to give the updates:
            ``-learning_rate · (C + damping·I)⁻¹`` as a curvature pytree (``kron``), or
            the damped diagonal's reciprocal times ``-learning_rate``.
    """

    step: Tensor
    curvature: Any
    factors: Any
    inverse: Any


class Preconditioner(NamedTuple):
    """An optax-style gradient transformation: ``init`` and ``update`` (pure functions).

    Attributes:
        init: ``init(params) -> state``.
        update: ``update(grads, state, params, (X, y)) -> (updates, state)``.
    """

    init: Callable[[Any], PreconditionerState]
    update: Callable[[Any, PreconditionerState, Any, tuple[Any, Tensor]], tuple[Any, Any]]


def preconditioner(
    model_fn: ModelFn,
    loss: nn.Module | None = None,
    *,
    method: str = "kfac",
    learning_rate: float = 1e-2,
    damping: float = 1e-3,
    ema: float = 0.95,
    update_period: int = 1,
    inverse_period: int = 10,
    mc_samples: int | None = 1,
    kfac_approx: KfacApprox = "backpack",
    pi_damping: bool = False,
    generator: torch.Generator | None = None,
) -> Preconditioner:
    """A curvature preconditioner for ``loss(model_fn(params, X), y)``.

    Args:
        model_fn: ``model_fn(params, X) -> output`` (e.g. from :func:`packfunc.functional`).
        loss: The loss module (default ``CrossEntropyLoss()``).
        method: One of :data:`METHODS`.
        learning_rate: Scales the preconditioned gradient (updates are its negative).
        damping: Added to the curvature's eigenvalues (positive).
        ema: Weight of the old curvature in its moving average, in ``[0, 1)``.
        update_period: Steps between curvature refreshes.
        inverse_period: Steps between inversions (``"kfac"``) or eigenbasis refreshes
            (``"ekfac"``); also refreshes the curvature.
        mc_samples: Monte-Carlo samples per sample, or ``None`` for the exact curvature.
        kfac_approx: Position convention of the Kronecker factors (see :func:`packfunc.kfac`).
        pi_damping: ``"kfac"`` only: invert π-damped factors instead of the exact damped
            Kronecker product.
        generator: Random generator for the Monte-Carlo samples.

    Returns:
        The :class:`Preconditioner`.

    Raises:
        ValueError: for an unknown method or bad hyper-parameters.

    Example:
        >>> model_fn, params = packfunc.functional(torch.nn.Linear(3, 2))
        >>> pre = preconditioner(model_fn, method="kfac", learning_rate=0.1)
        >>> X, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
        >>> grads = torch.func.grad(
        ...     lambda p: torch.nn.functional.cross_entropy(model_fn(p, X), y))(params)
        >>> updates, state = pre.update(grads, pre.init(params), params, (X, y))
        >>> int(state.step), updates["weight"].shape
        (1, torch.Size([2, 3]))
    """
    _check_hyperparameters(method, damping, ema, update_period, inverse_period, pi_damping)
    loss = loss or default_loss()
    step_size = -learning_rate

    def curvature_of(params: Any, X: Any, y: Tensor) -> Any:
        """The batch's Kronecker factors or GGN diagonal."""
        if method == "diag_ggn":
            return diag_ggn(
                model_fn, params, X, y, loss=loss, mc_samples=mc_samples, generator=generator
            )
        if mc_samples is None:
            return kflr(model_fn, params, X, y, loss=loss, kfac_approx=kfac_approx)
        return kfac(
            model_fn,
            params,
            X,
            y,
            loss=loss,
            mc_samples=mc_samples,
            generator=generator,
            kfac_approx=kfac_approx,
        )

    def init(params: Any) -> PreconditionerState:
        """The state before the first step (the curvature is computed at step 0)."""
        leaves = optree.tree_leaves(params)
        device = leaves[0].device if leaves else None
        return PreconditionerState(
            torch.zeros((), dtype=torch.int64, device=device), None, None, None
        )

    def update(
        grads: Any, state: PreconditionerState, params: Any, batch: tuple[Any, Tensor]
    ) -> tuple[Any, PreconditionerState]:
        """Refresh the curvature when due and precondition ``grads``."""
        X, y = batch
        step = int(state.step)
        first = state.curvature is None
        if first and method != "diag_ggn":
            _refuse_transposed_convolutions(model_fn, params, X)
        invert = first or step % inverse_period == 0
        refresh = invert or step % update_period == 0
        curvature, factors, inverse = state.curvature, state.factors, state.inverse
        if method == "ekfac" and refresh:
            if invert:
                previous = factors
                factors, curvature = ekfac_and_factors(
                    model_fn,
                    params,
                    X,
                    y,
                    lambda new: _average(previous, new, ema),
                    loss=loss,
                    mc_samples=mc_samples,
                    generator=generator,
                    kfac_approx=kfac_approx,
                )
            else:
                fitted = ekfac(
                    model_fn,
                    params,
                    X,
                    y,
                    loss=loss,
                    mc_samples=mc_samples,
                    generator=generator,
                    eigenvectors=curvature,
                )
                curvature = _average_eigenvalues(curvature, fitted, ema)
            inverse = _update_matrix(kron.inverse(curvature, damping), step_size)
        elif refresh:
            curvature = _average(curvature, curvature_of(params, X, y), ema)
            if method == "diag_ggn":
                inverse = optree.tree_map(lambda d: step_size / (d + damping), curvature)
            elif invert:
                inverse = _update_matrix(
                    kron.factor_damped_power(curvature, damping)
                    if pi_damping
                    else kron.inverse(curvature, damping),
                    step_size,
                )
        if method == "diag_ggn":
            updates = optree.tree_map(torch.mul, inverse, grads)
        else:
            updates = kron.matvec(inverse, grads)
        return updates, PreconditionerState(state.step + 1, curvature, factors, inverse)

    return Preconditioner(init, update)


def apply_updates(params: Any, updates: Any) -> Any:
    """``params + updates``, leaf by leaf (new tensors; nothing modified).

    Args:
        params: A pytree of tensors.
        updates: A pytree like ``params``.

    Returns:
        The updated pytree.

    Example:
        >>> apply_updates({"w": torch.ones(2)}, {"w": torch.ones(2)})
        {'w': tensor([2., 2.])}
    """
    return optree.tree_map(torch.add, params, updates)


class CurvatureOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` around :func:`preconditioner` for ordinary training loops.

    Call ``loss.backward()`` as usual, then ``opt.step(X, y)``: the gradients are read
    from ``p.grad`` and the curvature is computed on ``(X, y)``; each parameter moves by
    ``lr`` (of its parameter group, so schedulers work) times the functional update with
    learning rate 1. It follows the functional path step for step.

    Args:
        model: The module to train (all its parameters).
        lr: Learning rate.
        damping: Damping of the curvature.
        method: One of :data:`METHODS`.
        loss: The loss module used in training (default ``CrossEntropyLoss()``).
        **options: Further :func:`preconditioner` arguments (``ema``, ``update_period``,
            ``inverse_period``, ``mc_samples``, ``kfac_approx``, ``pi_damping``, ``generator``).

    Example:
        >>> model = torch.nn.Linear(3, 2)
        >>> opt = KFAC(model, lr=0.1, damping=1e-2)
        >>> X, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
        >>> torch.nn.functional.cross_entropy(model(X), y).backward()
        >>> opt.step(X, y)
    """

    def __init__(
        self,
        model: nn.Module,
        lr: float = 1e-2,
        damping: float = 1e-3,
        *,
        method: str = "kfac",
        loss: nn.Module | None = None,
        **options: Any,
    ):
        model_fn, params = functional(model)
        self.method = method
        self._named = dict(model.named_parameters())
        super().__init__(list(self._named.values()), {"lr": lr})
        self.preconditioner = preconditioner(
            model_fn, loss, method=method, learning_rate=1.0, damping=damping, **options
        )
        self.functional_state = self.preconditioner.init(params)

    @torch.no_grad()
    def step(self, X: Any, y: Tensor) -> None:  # type: ignore[override]
        """One preconditioned step from ``p.grad`` and the curvature on ``(X, y)``.

        Args:
            X: The batch's inputs.
            y: The batch's targets.

        Raises:
            ValueError: if a parameter has no gradient (call ``loss.backward()`` first).
        """
        grads = {name: p.grad for name, p in self._named.items()}
        if any(g is None for g in grads.values()):
            missing = [name for name, g in grads.items() if g is None]
            raise ValueError(
                f"no gradient for {missing}: call loss.backward() before opt.step(X, y)."
            )
        params = {name: p.detach() for name, p in self._named.items()}
        updates, self.functional_state = self.preconditioner.update(
            grads, self.functional_state, params, (X, y)
        )
        moved = list(params.values())  # aliases of the parameters: one in-place add for all
        lr = self.param_groups[0]["lr"]
        torch._foreach_add_(moved, [updates[name] for name in params], alpha=lr)


class KFAC(CurvatureOptimizer):
    """:class:`CurvatureOptimizer` with ``method="kfac"``.

    Example:
        >>> KFAC(torch.nn.Linear(3, 2), lr=0.1).preconditioner.init({}).step
        tensor(0)
    """

    def __init__(self, model: nn.Module, lr: float = 1e-2, damping: float = 1e-3, **options: Any):
        super().__init__(model, lr, damping, method="kfac", **options)


class EKFAC(CurvatureOptimizer):
    """:class:`CurvatureOptimizer` with ``method="ekfac"``.

    Example:
        >>> EKFAC(torch.nn.Linear(3, 2), lr=0.1).param_groups[0]["lr"]
        0.1
    """

    def __init__(self, model: nn.Module, lr: float = 1e-2, damping: float = 1e-3, **options: Any):
        super().__init__(model, lr, damping, method="ekfac", **options)


class DiagGGN(CurvatureOptimizer):
    """:class:`CurvatureOptimizer` with ``method="diag_ggn"`` (Adam-like, no square root).

    Example:
        >>> DiagGGN(torch.nn.Linear(3, 2), lr=0.1).param_groups[0]["lr"]
        0.1
    """

    def __init__(self, model: nn.Module, lr: float = 1e-2, damping: float = 1e-3, **options: Any):
        super().__init__(model, lr, damping, method="diag_ggn", **options)


def _check_hyperparameters(
    method: str,
    damping: float,
    ema: float,
    update_period: int,
    inverse_period: int,
    pi_damping: bool,
) -> None:
    """Refuse bad hyper-parameters with the fix."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}; got {method!r}.")
    if not damping > 0:
        raise ValueError(f"damping must be positive; got {damping!r}.")
    if not 0 <= ema < 1:
        raise ValueError(f"ema must be in [0, 1) (the old curvature's weight); got {ema!r}.")
    for name, period in (("update_period", update_period), ("inverse_period", inverse_period)):
        if not isinstance(period, int) or period < 1:
            raise ValueError(f"{name} must be a positive integer; got {period!r}.")
    if pi_damping and method != "kfac":
        raise ValueError("pi_damping applies to method='kfac' only (its factors are damped).")


def _refuse_transposed_convolutions(model_fn: ModelFn, params: Any, X: Any) -> None:
    """Refuse transposed convolutions: their factors are in the ``weight.transpose(0, 1)`` layout.

    Raises:
        ValueError: naming the parameters of transposed convolutions.
    """
    leaves, _, names = flatten_params(params)
    plan = discover(model_fn, params, leaves, select_samples(X, slice(0, 1)))
    used = {
        names[leaf] for site in plan.sites if site.call.transposed for _, leaf in site.call.leaves
    }
    if used:
        raise ValueError(
            f"the Kronecker preconditioners do not support transposed convolutions yet "
            f"({sorted(used)}): their factors act on weight.transpose(0, 1). Use "
            "method='diag_ggn', or apply packfunc.kron to the transposed weights yourself."
        )


def _update_matrix(inverse: Any, step_size: float) -> Any:
    """``step_size`` times every entry of a damped inverse: what multiplies the gradient.

    The scale is folded into one factor (or the eigenvalues); a one-factor
    :class:`kron.Eigen` (a bias) becomes its dense matrix, applied with one product.
    """

    def scale(entry: Any) -> Any:
        if isinstance(entry, kron.Eigen) and len(entry.eigenvectors) == 1:
            return [step_size * kron.dense(entry)]
        if isinstance(entry, kron.Eigen):
            return kron.Eigen(entry.eigenvectors, step_size * entry.eigenvalues)
        return [step_size * entry[0], *entry[1:]]

    return kron.map_entries(scale, inverse)


def _average(old: Any, new: Any, ema: float) -> Any:
    """``ema · old + (1 - ema) · new`` leaf by leaf; ``new`` when there is no ``old``."""
    if old is None:
        return new
    return optree.tree_map(lambda o, n: torch.lerp(n, o, ema), old, new)  # n + ema·(o − n)


def _average_eigenvalues(old: Any, new: Any, ema: float) -> Any:
    """Average EKFAC eigenvalues fitted in the same eigenbasis."""
    return optree.tree_map(
        lambda o, n: kron.Eigen(o.eigenvectors, torch.lerp(n.eigenvalues, o.eigenvalues, ema)),
        old,
        new,
        is_leaf=lambda node: isinstance(node, kron.Eigen),
    )


__all__ = [
    "EKFAC",
    "METHODS",
    "CurvatureOptimizer",
    "DiagGGN",
    "KFAC",
    "Preconditioner",
    "PreconditionerState",
    "apply_updates",
    "preconditioner",
]
