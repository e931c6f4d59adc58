"""Optax-style gradient transformations, the curvature preconditioners among them.

A :class:`GradientTransformation` is a pair of pure functions: ``init(params)`` gives
the state (a NamedTuple, hence an optree pytree) and
``update(updates, state, params, batch)`` returns ``(new_updates, new_state)``. Nothing
is modified in place. Transformations compose with :func:`chain`; :func:`apply_updates`
adds the result to the parameters::

    opt = chain(scale_by_kfac(model_fn, damping=1e-3), scale(-0.1))
    state = opt.init(params)
    updates, state = opt.update(grads, state, params, (X, y))
    params = apply_updates(params, updates)

**Difference from optax:** ``update`` takes a fourth argument, the batch ``(X, y)``,
because a curvature is computed on data: a preconditioner refreshes its curvature at
``params`` on that batch. ``params`` and ``batch`` default to ``None``; transformations
that need neither (:func:`scale`) ignore them, and a preconditioner needs them only on
the steps that refresh its curvature (:class:`MissingBatchError` otherwise). The
transformations here also run eagerly, deciding in Python from ``state.step`` which
steps refresh; they are not meant for ``jit``.

The preconditioners return ``(C + damping·I)⁻¹ g`` — no learning rate, no sign flip:
:func:`scale` with a negative step size (or :mod:`packfunc.optim.optimizers`) does that.
The curvature ``C`` is

* :func:`scale_by_kfac`: KFAC factors (``mc_samples=None``: KFLR), an exponential moving
  average (``ema``) refreshed every ``update_period`` steps and inverted every
  ``inverse_period`` steps — exactly in the Kronecker eigenbasis, or with π-damped
  factors (``pi_damping=True``, Martens & Grosse 2015);
* :func:`scale_by_ekfac`: the eigenbasis of the (averaged) KFAC factors, recomputed every
  ``inverse_period`` steps, with eigenvalues re-fitted to the batch's column gradients
  every ``update_period`` steps (moving average between basis refreshes);
* :func:`scale_by_diag_ggn`: the GGN diagonal (Adam-like: the averaged diagonal GGN
  where Adam has averaged squared gradients, no square root; exact, or Monte-Carlo with
  ``mc_samples``), refreshed every ``update_period`` steps.

Step 0 always refreshes the curvature and its inverse. Parameters without a Kronecker
rule, and transposed convolutions, are refused by the Kronecker preconditioners; a linear
weight stored ``[in, out]`` (``x @ W``, GPT-2's ``Conv1D``) is preconditioned in that
layout (its factors come as ``[in×in, out×out]``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, Protocol, cast

import optree
import torch
from torch import Tensor, nn

from packfunc import kron
from packfunc.eigen_kfac import ekfac, ekfac_and_factors
from packfunc.engine.discovery import discover
from packfunc.engine.precision import forward_precision_only
from packfunc.engine.randomness import check_generator
from packfunc.functionalize import flatten_params, select_samples
from packfunc.kronecker_factors import kfac, kflr
from packfunc.losses import default_loss
from packfunc.secondorder import diag_ggn
from packfunc.types import Inputs, KfacApprox, ModelFn, Params, ParamsT, PyTree, Targets

Batch = tuple[Inputs, Targets]
"""A batch ``(X, y)``: the data a curvature is computed on."""

Updates = PyTree
"""Gradients, or updates: a pytree shaped like the parameters."""


class InitFn(Protocol):
    """``init(params) -> state``."""

    def __call__(self, params: Params) -> Any:
        """The state before the first update."""


class UpdateFn(Protocol):
    """``update(updates, state, params=None, batch=None) -> (updates, state)``."""

    def __call__(
        self,
        updates: Updates,
        state: Any,
        params: Params | None = None,
        batch: Batch | None = None,
    ) -> tuple[Updates, Any]:
        """Transform ``updates`` and advance ``state``."""


class GradientTransformation(NamedTuple):
    """A pair of pure functions transforming gradients (optax's interface, plus the batch).

    Attributes:
        init: ``init(params) -> state`` (a pytree).
        update: ``update(updates, state, params=None, batch=None) -> (updates, state)``;
            ``batch`` is ``(X, y)``, needed by the curvature preconditioners.
    """

    init: InitFn
    update: UpdateFn


class EmptyState(NamedTuple):
    """The state of a transformation that keeps none (e.g. :func:`scale`)."""


class CurvatureState(NamedTuple):
    """The state of a curvature preconditioner (an optree pytree).

    Attributes:
        step: Updates done so far (an integer scalar tensor).
        curvature: The averaged curvature: factor lists (:func:`scale_by_kfac`), an
            :class:`EkfacCurvature` (:func:`scale_by_ekfac`) or diagonals
            (:func:`scale_by_diag_ggn`); ``None`` before the first update.
        inverse: What multiplies the gradient: ``(C + damping·I)⁻¹`` as a curvature
            pytree (:mod:`packfunc.kron`; a bias as one dense matrix), π-damped factor
            inverses, or the damped diagonal's reciprocal.
    """

    step: Tensor
    curvature: Any
    inverse: Any


class EkfacCurvature(NamedTuple):
    """The averaged curvature of :func:`scale_by_ekfac`.

    Attributes:
        factors: The averaged KFAC factors the eigenbasis comes from.
        eigen: The :class:`packfunc.kron.Eigen` pytree: that basis and the averaged
            eigenvalues fitted in it.
    """

    factors: Any
    eigen: Any


class MissingBatchError(ValueError):
    """A step that refreshes the curvature was given no ``params`` or no batch ``(X, y)``.

    Attributes:
        step: The step that needed them.
    """

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


def scale(step_size: float) -> GradientTransformation:
    """Multiply the updates by ``step_size`` (e.g. ``scale(-learning_rate)``).

    Args:
        step_size: The factor.

    Returns:
        The transformation (its state is an :class:`EmptyState`; ``params`` and
        ``batch`` are ignored).

    Example:
        >>> t = scale(-0.5)
        >>> t.update({"w": torch.ones(2)}, t.init(None))[0]
        {'w': tensor([-0.5000, -0.5000])}
    """

    def init(params: Params) -> EmptyState:
        """No state."""
        return EmptyState()

    def update(
        updates: Updates,
        state: Any,
        params: Params | None = None,
        batch: Batch | None = None,
    ) -> tuple[Updates, Any]:
        """``step_size · updates``."""
        return cast(Updates, optree.tree_map(lambda u: step_size * u, cast(Any, updates))), state

    return GradientTransformation(init, update)


def chain(*transformations: GradientTransformation) -> GradientTransformation:
    """Apply transformations one after the other (each one's updates feed the next).

    Args:
        *transformations: The transformations, first applied first.

    Returns:
        The transformation; its state is the tuple of theirs. ``params`` and ``batch``
        are passed to each.

    Raises:
        ValueError: (from ``update``) for a state of another number of transformations.

    Example:
        >>> t = chain(scale(2.0), scale(-0.5))
        >>> updates, state = t.update({"w": torch.ones(2)}, t.init(None))
        >>> updates["w"], state
        (tensor([-1., -1.]), (EmptyState(), EmptyState()))
    """

    def init(params: Params) -> tuple[Any, ...]:
        """Every transformation's initial state."""
        return tuple(t.init(params) for t in transformations)

    def update(
        updates: Updates,
        state: Any,
        params: Params | None = None,
        batch: Batch | None = None,
    ) -> tuple[Updates, Any]:
        """Thread the updates through every transformation."""
        if len(state) != len(transformations):
            raise ValueError(
                f"the state holds {len(state)} states for a chain of {len(transformations)} "
                "transformations: pass the state this chain's init or update returned."
            )
        states = []
        for transformation, inner in zip(transformations, state):
            updates, inner = transformation.update(updates, inner, params, batch)
            states.append(inner)
        return updates, tuple(states)

    return GradientTransformation(init, update)


def apply_updates(params: ParamsT, updates: Updates) -> ParamsT:
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
    return cast(ParamsT, optree.tree_map(torch.add, cast(Any, params), cast(Any, updates)))


def scale_by_kfac(
    model_fn: ModelFn,
    loss: nn.Module | None = None,
    *,
    damping: float = 1e-3,
    ema: float = 0.95,
    update_period: int = 1,
    inverse_period: int = 10,
    mc_samples: int | None = 1,
    kfac_approx: KfacApprox | None = None,
    pi_damping: bool = False,
    generator: torch.Generator | None = None,
) -> GradientTransformation:
    """Precondition with averaged KFAC factors: ``(A ⊗ B + damping·I)⁻¹ g`` per weight.

    Args:
        model_fn: ``model_fn(params, X) -> output`` (e.g. from :func:`packfunc.functional`).
        loss: The loss module (default ``CrossEntropyLoss()``).
        damping: Added to the curvature's eigenvalues (positive).
        ema: Weight of the old factors in their moving average, in ``[0, 1)``.
        update_period: Steps between refreshes of the factors.
        inverse_period: Steps between inversions (each also refreshes the factors).
        mc_samples: Monte-Carlo samples per sample (KFAC), or ``None`` for KFLR.
        kfac_approx: How positions enter the factors (see :func:`packfunc.kfac`;
            ``None``: its default).
        pi_damping: Invert π-damped factors, ``(A + π√d·I)⁻¹ ⊗ (B + √d/π·I)⁻¹``, instead
            of the exactly damped Kronecker product (see
            :func:`packfunc.kron.factor_damped_power`).
        generator: Random generator for the Monte-Carlo samples.

    Returns:
        The transformation; its state is a :class:`CurvatureState`.

    Raises:
        ValueError: for bad hyper-parameters.

    Example:
        >>> model_fn, params = packfunc.functional(torch.nn.Linear(3, 2))
        >>> t = scale_by_kfac(model_fn, damping=1e-2)
        >>> X, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
        >>> grads = torch.func.grad(lambda p: F.cross_entropy(model_fn(p, X), y))(params)
        >>> updates, state = t.update(grads, t.init(params), params, (X, y))
        >>> int(state.step), updates["weight"].shape
        (1, torch.Size([2, 3]))
    """
    check_generator(generator, "scale_by_kfac()")
    _check_hyperparameters(damping, ema, update_period=update_period, inverse_period=inverse_period)
    loss = loss or default_loss()
    invert = _pi_damped_inverse if pi_damping else _exact_inverse
    approx = _approx_option(kfac_approx)

    def refresh(
        curvature: Any, inverse: Any, params: Params, batch: Batch, full: bool
    ) -> tuple[Any, Any]:
        """Average in the batch's factors; invert the average on full refreshes."""
        X, y = batch
        if curvature is None:
            _refuse_transposed_convolutions(model_fn, params, X)
        with _for_every_stepped_parameter():
            if mc_samples is None:
                new = kflr(model_fn, params, X, y, loss=loss, **approx)
            else:
                new = kfac(
                    model_fn,
                    params,
                    X,
                    y,
                    loss=loss,
                    mc_samples=mc_samples,
                    generator=generator,
                    **approx,
                )
        curvature = _average(curvature, new, ema)
        return curvature, invert(curvature, damping) if full else inverse

    return _scheduled(refresh, kron.matvec, update_period, inverse_period)


@contextlib.contextmanager
def _for_every_stepped_parameter() -> Iterator[None]:
    """Refuse parameters without Kronecker factors in the optimizers' words.

    The factor functions' refusal names ``on_unsupported='skip'``, which the optimizers do
    not take: they precondition every parameter they step.
    """
    try:
        yield
    except ValueError as error:
        listing, found, _ = str(error).partition(". Pass on_unsupported")
        if not (found and listing.startswith("no Kronecker factors")):
            raise
        raise ValueError(
            f"{listing}. The Kronecker optimizers precondition every parameter they step: "
            "step these with another optimizer (pf.optim.DiagGGN, or torch.optim.Adam in a "
            "second optimizer over them), or use each as a layer's weight (nn.Linear, "
            "F.linear, x @ W)."
        ) from error


def scale_by_ekfac(
    model_fn: ModelFn,
    loss: nn.Module | None = None,
    *,
    damping: float = 1e-3,
    ema: float = 0.95,
    update_period: int = 1,
    inverse_period: int = 10,
    mc_samples: int | None = 1,
    kfac_approx: KfacApprox | None = None,
    generator: torch.Generator | None = None,
) -> GradientTransformation:
    """Precondition with EKFAC: averaged KFAC factors' eigenbasis, re-fitted eigenvalues.

    Every ``inverse_period`` steps the KFAC factors of that step's batch enter their
    average (batches in between do not), the basis is recomputed from it and the
    eigenvalues are fitted on that batch alone (the old average, in another basis, is
    dropped); every ``update_period`` steps in between, the eigenvalues are re-fitted in the
    current basis and averaged. Each refresh inverts.

    Args:
        model_fn: ``model_fn(params, X) -> output`` (e.g. from :func:`packfunc.functional`).
        loss: The loss module (default ``CrossEntropyLoss()``).
        damping: Added to the eigenvalues (positive).
        ema: Weight of the old factors (at basis refreshes) and eigenvalues (between
            them) in their averages, in ``[0, 1)``.
        update_period: Steps between eigenvalue re-fits.
        inverse_period: Steps between eigenbasis refreshes.
        mc_samples: Monte-Carlo samples per sample, or ``None`` for the exact GGN.
        kfac_approx: How positions enter the factors (see :func:`packfunc.kfac`;
            ``None``: its default).
        generator: Random generator for the Monte-Carlo samples.

    Returns:
        The transformation; its state is a :class:`CurvatureState` holding an
        :class:`EkfacCurvature`.

    Raises:
        ValueError: for bad hyper-parameters.

    Example:
        >>> model_fn, params = packfunc.functional(torch.nn.Linear(3, 2))
        >>> t = scale_by_ekfac(model_fn, damping=1e-2, mc_samples=None)
        >>> X, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
        >>> grads = torch.func.grad(lambda p: F.cross_entropy(model_fn(p, X), y))(params)
        >>> _, state = t.update(grads, t.init(params), params, (X, y))
        >>> state.curvature.eigen["weight"].eigenvalues.shape
        torch.Size([2, 3])
    """
    check_generator(generator, "scale_by_ekfac()")
    _check_hyperparameters(damping, ema, update_period=update_period, inverse_period=inverse_period)
    loss = loss or default_loss()
    approx = _approx_option(kfac_approx)

    def refresh(
        curvature: Any, inverse: Any, params: Params, batch: Batch, full: bool
    ) -> tuple[Any, Any]:
        """A new basis from the averaged factors (full refresh), or re-fitted eigenvalues."""
        X, y = batch
        if curvature is None:
            _refuse_transposed_convolutions(model_fn, params, X)
        if full:
            previous = None if curvature is None else curvature.factors
            with _for_every_stepped_parameter():
                factors, eigen = ekfac_and_factors(
                    model_fn,
                    params,
                    X,
                    y,
                    lambda new: _average(previous, new, ema),
                    loss=loss,
                    mc_samples=mc_samples,
                    generator=generator,
                    **approx,
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
                eigenvectors=curvature.eigen,
            )
            factors, eigen = curvature.factors, _average_eigenvalues(curvature.eigen, fitted, ema)
        return EkfacCurvature(factors, eigen), _exact_inverse(eigen, damping)

    return _scheduled(refresh, kron.matvec, update_period, inverse_period)


def scale_by_diag_ggn(
    model_fn: ModelFn,
    loss: nn.Module | None = None,
    *,
    damping: float = 1e-3,
    ema: float = 0.95,
    update_period: int = 1,
    mc_samples: int | None = 1,
    generator: torch.Generator | None = None,
) -> GradientTransformation:
    """Divide by the averaged, damped GGN diagonal: ``g / (diag C + damping)``.

    Adam-like: the moving average of the GGN diagonal where Adam averages squared
    gradients, and no square root.

    Args:
        model_fn: ``model_fn(params, X) -> output`` (e.g. from :func:`packfunc.functional`).
        loss: The loss module (default ``CrossEntropyLoss()``).
        damping: Added to the diagonal (positive).
        ema: Weight of the old diagonal in its moving average, in ``[0, 1)``.
        update_period: Steps between refreshes of the diagonal.
        mc_samples: Monte-Carlo samples per sample, or ``None`` for the exact diagonal.
        generator: Random generator for the Monte-Carlo samples.

    Returns:
        The transformation; its state is a :class:`CurvatureState`.

    Raises:
        ValueError: for bad hyper-parameters.

    Example:
        >>> model_fn, params = packfunc.functional(torch.nn.Linear(3, 2))
        >>> t = scale_by_diag_ggn(model_fn, damping=1e-2)
        >>> X, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
        >>> grads = torch.func.grad(lambda p: F.cross_entropy(model_fn(p, X), y))(params)
        >>> updates, _ = t.update(grads, t.init(params), params, (X, y))
        >>> updates["bias"].shape
        torch.Size([2])
    """
    check_generator(generator, "scale_by_diag_ggn()")
    _check_hyperparameters(damping, ema, update_period=update_period)
    loss = loss or default_loss()

    def refresh(
        curvature: Any, inverse: Any, params: Params, batch: Batch, full: bool
    ) -> tuple[Any, Any]:
        """Average in the batch's diagonal; its damped reciprocal."""
        X, y = batch
        new = diag_ggn(
            model_fn, params, X, y, loss=loss, mc_samples=mc_samples, generator=generator
        )
        curvature = _average(curvature, new, ema)
        return curvature, optree.tree_map(lambda d: torch.reciprocal(d + damping), curvature)

    def apply(inverse: Any, updates: Updates) -> Updates:
        """Multiply leaf by leaf."""
        return cast(Updates, optree.tree_map(torch.mul, inverse, cast(Any, updates)))

    return _scheduled(refresh, apply, update_period, update_period)


Refresh = Callable[[Any, Any, Params, Batch, bool], tuple[Any, Any]]
"""``refresh(curvature, inverse, params, batch, full) -> (curvature, inverse)``: one
curvature's refresh (``full``: the first step or one of ``inverse_period``)."""


def _scheduled(
    refresh: Refresh,
    apply: Callable[[Any, Updates], Updates],
    update_period: int,
    inverse_period: int,
) -> GradientTransformation:
    """A preconditioner: refresh the curvature on schedule, apply its inverse every step.

    Step 0, and every ``inverse_period``-th step, refreshes with ``full=True``; other
    multiples of ``update_period`` with ``full=False``; the rest reuse the inverse.
    """

    def init(params: Params) -> CurvatureState:
        """The state before the first step (the curvature is computed at step 0)."""
        leaves: list[Tensor] = optree.tree_leaves(cast(Any, params))
        device = leaves[0].device if leaves else None
        return CurvatureState(torch.zeros((), dtype=torch.int64, device=device), None, None)

    @forward_precision_only
    def update(
        updates: Updates,
        state: Any,
        params: Params | None = None,
        batch: Batch | None = None,
    ) -> tuple[Updates, Any]:
        """Refresh the curvature when due and precondition ``updates``.

        Under ``torch.autocast`` only the model's forwards autocast: the factors, their
        inverses and eigenbases, and the preconditioning stay in the parameters' dtype.
        """
        step = int(state.step)
        full = state.curvature is None or step % inverse_period == 0
        curvature, inverse = state.curvature, state.inverse
        if full or step % update_period == 0:
            if params is None or batch is None:
                raise MissingBatchError(
                    f"step {step} refreshes the curvature, which is computed at params on a "
                    "batch: pass both, update(grads, state, params, (X, y)).",
                    step,
                )
            curvature, inverse = refresh(curvature, inverse, params, batch, full)
        return apply(inverse, updates), CurvatureState(state.step + 1, curvature, inverse)

    return GradientTransformation(init, update)


def _check_hyperparameters(damping: float, ema: float, **periods: int) -> None:
    """Refuse bad hyper-parameters with the fix."""
    if not damping > 0:
        raise ValueError(f"damping must be positive; got {damping!r}.")
    if not 0 <= ema < 1:
        raise ValueError(f"ema must be in [0, 1) (the old curvature's weight); got {ema!r}.")
    for name, period in periods.items():
        if not isinstance(period, int) or period < 1:
            raise ValueError(f"{name} must be a positive integer; got {period!r}.")


def _approx_option(kfac_approx: KfacApprox | None) -> dict[str, Any]:
    """``kfac_approx`` as a keyword argument, or none for the curvature functions' default."""
    return {} if kfac_approx is None else {"kfac_approx": kfac_approx}


def _refuse_transposed_convolutions(model_fn: ModelFn, params: Params, X: Inputs) -> None:
    """Refuse transposed convolutions: their factors are in another layout than the weight's.

    A linear weight stored ``[in, out]`` (``x @ W``, GPT-2's ``Conv1D``) is not refused:
    its factors ``[in×in, out×out]`` are in its own layout.

    Raises:
        ValueError: naming the parameters of transposed convolutions.
    """
    leaves, _, names = flatten_params(params)
    plan = discover(model_fn, params, leaves, select_samples(X, slice(0, 1)))
    used = {
        names[leaf]
        for site in plan.sites
        if site.call.is_transposed_convolution
        for _, leaf in site.call.leaves
    }
    if used:
        raise ValueError(
            f"the Kronecker preconditioners do not support transposed convolutions yet "
            f"({sorted(used)}): their factors act on weight.transpose(0, 1) (each group's "
            "channel axes swapped, with groups). Use scale_by_diag_ggn (DiagGGN), or apply "
            "packfunc.kron to the transposed weights yourself."
        )


def _exact_inverse(curvature: Any, damping: float) -> Any:
    """``(C + damping·I)⁻¹`` in the Kronecker eigenbasis; a bias as one dense matrix.

    A one-factor :class:`packfunc.kron.Eigen` becomes ``[its dense matrix]``, applied
    with one product instead of two.
    """

    def applicable(entry: Any) -> Any:
        if isinstance(entry, kron.Eigen) and len(entry.eigenvectors) == 1:
            return [kron.dense(entry)]
        return entry

    return kron.map_entries(applicable, kron.inverse(curvature, damping))


def _pi_damped_inverse(curvature: Any, damping: float) -> Any:
    """The π-damped factor inverses (see :func:`packfunc.kron.factor_damped_power`)."""
    return kron.factor_damped_power(curvature, damping)


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
    "Batch",
    "CurvatureState",
    "EkfacCurvature",
    "EmptyState",
    "GradientTransformation",
    "InitFn",
    "MissingBatchError",
    "UpdateFn",
    "Updates",
    "apply_updates",
    "chain",
    "scale",
    "scale_by_diag_ggn",
    "scale_by_ekfac",
    "scale_by_kfac",
]
