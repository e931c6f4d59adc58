"""``torch.optim`` optimizers built on the curvature preconditioners of :mod:`.transforms`.

For ordinary training loops: gradients come from the parameters' ``.grad`` (after
``loss.backward()``, or from a closure), and each step moves every parameter by
``-lr`` times the preconditioned gradient, ``lr`` being read from
``param_groups[0]["lr"]`` at every step (so ``torch.optim.lr_scheduler`` works). The
curvature is computed on the batch, passed as a keyword::

    opt = KFAC(model, lr=0.1, damping=1e-2)
    opt.zero_grad()
    loss_fn(model(X), y).backward()
    opt.step(batch=(X, y))                 # or opt.step(closure, batch=(X, y))

Steps that do not refresh the curvature (``update_period > 1``) may omit the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast, overload

import torch
from torch import Tensor, nn

from packfunc.engine.randomness import check_generator
from packfunc.functionalize import functional
from packfunc.optim.transforms import (
    Batch,
    GradientTransformation,
    MissingBatchError,
    scale_by_diag_ggn,
    scale_by_ekfac,
    scale_by_kfac,
)
from packfunc.types import KfacApprox


class CurvatureOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` stepping by ``-lr`` times a transformation's updates.

    The base of :class:`KFAC`, :class:`EKFAC` and :class:`DiagGGN`; give it any
    :class:`~packfunc.optim.transforms.GradientTransformation` of the model's named
    parameters (a dict, as from :func:`packfunc.functional`). It holds one parameter
    group, the model's parameters that require grad: a frozen parameter
    (``requires_grad=False`` when the optimizer is made) is left out and left where it is,
    as ``torch.optim``'s optimizers leave a parameter without gradient; the curvature is
    that of the trainable ones, the frozen ones being constants of the model.
    ``state_dict()`` carries the transformation's state (a pytree of NamedTuples:
    ``torch.load`` it with ``weights_only=False``) and the generator's.

    Args:
        model: The module to train (its parameters that require grad).
        transformation: Maps the gradients to the updates (without the learning rate).
        lr: Learning rate.
        generator: The generator the transformation draws its Monte-Carlo samples from
            (its state is checkpointed with the optimizer's), if any.

    Raises:
        ValueError: for a negative learning rate, or a model without trainable parameters.

    Example:
        >>> model = torch.nn.Linear(3, 2)
        >>> model_fn, _ = packfunc.functional(model)
        >>> t = packfunc.optim.scale_by_diag_ggn(model_fn, damping=1e-2)
        >>> opt = CurvatureOptimizer(model, t, lr=0.1)
        >>> X, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
        >>> opt.step(lambda: F.cross_entropy(model(X), y).backward(), batch=(X, y))
    """

    def __init__(
        self,
        model: nn.Module,
        transformation: GradientTransformation,
        lr: float = 1e-2,
        *,
        generator: torch.Generator | None = None,
    ):
        if not lr >= 0:
            raise ValueError(f"lr must be non-negative; got {lr!r}.")
        _check_model_and_generator(model, generator, type(self).__name__)
        self._named = trainable_parameters(model)
        if not self._named:
            raise ValueError(
                f"{type(model).__name__} has no parameter that requires grad: nothing to train."
            )
        super().__init__(list(self._named.values()), {"lr": lr})
        self.transformation, self.generator = transformation, generator
        self.transformation_state: Any = transformation.init(
            {name: p.detach() for name, p in self._named.items()}
        )

    @overload
    def step(self, closure: None = None, *, batch: Batch | None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float], *, batch: Batch | None = None) -> float: ...

    def step(self, closure: Callable[[], Any] | None = None, *, batch: Batch | None = None) -> Any:
        """One preconditioned step from the parameters' ``.grad``.

        Args:
            closure: Optional: re-evaluates the model, calls ``backward`` and returns the
                loss; it is called with gradients enabled, before the step.
            batch: ``(X, y)``, the batch the curvature is computed on; needed on the
                steps that refresh it (always on the first).

        Returns:
            The closure's loss, or ``None`` without a closure.

        Raises:
            ValueError: if a parameter has no gradient or was frozen after the optimizer
                was made, or (a
                :class:`~packfunc.optim.transforms.MissingBatchError`) if this step
                refreshes the curvature and no batch was given.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if len(self.param_groups) != 1:
            raise ValueError(
                f"{type(self).__name__} preconditions one parameter group (the model's); "
                f"got {len(self.param_groups)}. Train other parameters with another optimizer."
            )
        self._check_gradients()
        with torch.no_grad():
            grads = {name: p.grad for name, p in self._named.items()}
            params = {name: p.detach() for name, p in self._named.items()}
            try:
                updates, self.transformation_state = self.transformation.update(
                    grads, self.transformation_state, params, batch
                )
            except MissingBatchError as error:
                raise MissingBatchError(
                    f"step {error.step} of {type(self).__name__} refreshes the curvature, "
                    "which is computed on the batch: call opt.step(batch=(X, y)) (or "
                    "opt.step(closure, batch=(X, y)))",
                    error.step,
                ) from None
            lr = self.param_groups[0]["lr"]
            torch._foreach_add_(
                list(self._named.values()),
                [cast(Tensor, cast(Any, updates)[name]) for name in self._named],
                alpha=-lr,
            )
        return loss

    def _check_gradients(self) -> None:
        """Refuse a step where a parameter has no gradient, naming why.

        Raises:
            ValueError: naming the parameters frozen since the optimizer was made, or
                those without ``.grad``.
        """
        frozen = [name for name, p in self._named.items() if not p.requires_grad]
        if frozen:
            raise ValueError(
                f"{frozen} no longer require grad: they were frozen after "
                f"{type(self).__name__} was made, whose curvature includes them. Make a new "
                "optimizer after freezing (it leaves out parameters that do not require grad)."
            )
        missing = [name for name, p in self._named.items() if p.grad is None]
        if missing:
            raise ValueError(
                f"no gradient for {missing}: call loss.backward() before opt.step(batch=(X, y)),"
                " or pass a closure that does."
            )

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state: ``torch.optim``'s, the transformation's, the generator's.

        Returns:
            A dict with ``"state"``, ``"param_groups"``, ``"transformation_state"`` and
            ``"generator"`` (the Monte-Carlo samples' generator state, ``None`` without one:
            torch's global generator, which ``torch.get_rng_state`` saves).
        """
        found = super().state_dict()
        found["transformation_state"] = self.transformation_state
        found["generator"] = None if self.generator is None else self.generator.get_state()
        return found

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`: a resumed run samples as an uninterrupted one.

        Args:
            state_dict: As :meth:`state_dict` returned it (without
                ``"transformation_state"``, the curvature state is left as it is).

        Raises:
            ValueError: for a generator's state where this optimizer has none (its samples
                would not continue the checkpoint's).
        """
        state_dict = dict(state_dict)
        transformation_state = state_dict.pop("transformation_state", None)
        drawn = state_dict.pop("generator", None)
        if drawn is not None and self.generator is None:
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: the checkpoint holds a generator's "
                "state but this optimizer has none; construct it with generator=a "
                "torch.Generator to continue its Monte-Carlo samples."
            )
        super().load_state_dict(state_dict)
        if transformation_state is not None:
            self.transformation_state = transformation_state
        if drawn is not None and self.generator is not None:
            self.generator.set_state(drawn)


class KFAC(CurvatureOptimizer):
    """KFAC: :func:`~packfunc.optim.transforms.scale_by_kfac` as a ``torch.optim.Optimizer``.

    Args:
        model: The module to train (its parameters that require grad).
        lr: Learning rate.
        damping: Damping of the curvature.
        loss: The loss module used in training (default ``CrossEntropyLoss()``).
        ema: Weight of the old factors in their moving average.
        update_period: Steps between refreshes of the factors.
        inverse_period: Steps between inversions.
        mc_samples: Monte-Carlo samples per sample, or ``None`` for KFLR.
        kfac_approx: How positions enter the factors (see :func:`packfunc.kfac`;
            ``None``: its default).
        pi_damping: Invert π-damped factors instead of the exact damped product.
        generator: Random generator for the Monte-Carlo samples.

    Example:
        >>> model = torch.nn.Linear(3, 2)
        >>> opt = KFAC(model, lr=0.1, damping=1e-2)
        >>> X, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
        >>> F.cross_entropy(model(X), y).backward()
        >>> opt.step(batch=(X, y))
    """

    def __init__(
        self,
        model: nn.Module,
        lr: float = 1e-2,
        damping: float = 1e-3,
        *,
        loss: nn.Module | None = None,
        ema: float = 0.95,
        update_period: int = 1,
        inverse_period: int = 10,
        mc_samples: int | None = 1,
        kfac_approx: KfacApprox | None = None,
        pi_damping: bool = False,
        generator: torch.Generator | None = None,
    ):
        _check_model_and_generator(model, generator, type(self).__name__)
        transformation = scale_by_kfac(
            functional(model)[0],
            loss,
            damping=damping,
            ema=ema,
            update_period=update_period,
            inverse_period=inverse_period,
            mc_samples=mc_samples,
            kfac_approx=kfac_approx,
            pi_damping=pi_damping,
            generator=generator,
        )
        super().__init__(model, transformation, lr, generator=generator)


class EKFAC(CurvatureOptimizer):
    """EKFAC: :func:`~packfunc.optim.transforms.scale_by_ekfac` as a ``torch.optim.Optimizer``.

    Args:
        model: The module to train (its parameters that require grad).
        lr: Learning rate.
        damping: Damping of the curvature.
        loss: The loss module used in training (default ``CrossEntropyLoss()``).
        ema: Weight of the old factors and eigenvalues in their averages.
        update_period: Steps between eigenvalue re-fits.
        inverse_period: Steps between eigenbasis refreshes.
        mc_samples: Monte-Carlo samples per sample, or ``None`` for the exact GGN.
        kfac_approx: How positions enter the factors (see :func:`packfunc.kfac`;
            ``None``: its default).
        generator: Random generator for the Monte-Carlo samples.

    Example:
        >>> EKFAC(torch.nn.Linear(3, 2), lr=0.1).param_groups[0]["lr"]
        0.1
    """

    def __init__(
        self,
        model: nn.Module,
        lr: float = 1e-2,
        damping: float = 1e-3,
        *,
        loss: nn.Module | None = None,
        ema: float = 0.95,
        update_period: int = 1,
        inverse_period: int = 10,
        mc_samples: int | None = 1,
        kfac_approx: KfacApprox | None = None,
        generator: torch.Generator | None = None,
    ):
        _check_model_and_generator(model, generator, type(self).__name__)
        transformation = scale_by_ekfac(
            functional(model)[0],
            loss,
            damping=damping,
            ema=ema,
            update_period=update_period,
            inverse_period=inverse_period,
            mc_samples=mc_samples,
            kfac_approx=kfac_approx,
            generator=generator,
        )
        super().__init__(model, transformation, lr, generator=generator)


class DiagGGN(CurvatureOptimizer):
    """The damped GGN diagonal (:func:`~packfunc.optim.transforms.scale_by_diag_ggn`).

    Adam-like, without the square root.

    Args:
        model: The module to train (its parameters that require grad).
        lr: Learning rate.
        damping: Added to the diagonal.
        loss: The loss module used in training (default ``CrossEntropyLoss()``).
        ema: Weight of the old diagonal in its moving average.
        update_period: Steps between refreshes of the diagonal.
        mc_samples: Monte-Carlo samples per sample, or ``None`` for the exact diagonal.
        generator: Random generator for the Monte-Carlo samples.

    Example:
        >>> DiagGGN(torch.nn.Linear(3, 2), lr=0.1).transformation_state.step
        tensor(0)
    """

    def __init__(
        self,
        model: nn.Module,
        lr: float = 1e-2,
        damping: float = 1e-3,
        *,
        loss: nn.Module | None = None,
        ema: float = 0.95,
        update_period: int = 1,
        mc_samples: int | None = 1,
        generator: torch.Generator | None = None,
    ):
        _check_model_and_generator(model, generator, type(self).__name__)
        transformation = scale_by_diag_ggn(
            functional(model)[0],
            loss,
            damping=damping,
            ema=ema,
            update_period=update_period,
            mc_samples=mc_samples,
            generator=generator,
        )
        super().__init__(model, transformation, lr, generator=generator)


def trainable_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The named parameters of ``model`` that require grad (those an optimizer trains).

    Args:
        model: The module.

    Returns:
        Name to parameter, in ``named_parameters()`` order.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))
        >>> _ = model[0].requires_grad_(False)
        >>> list(trainable_parameters(model))
        ['1.weight', '1.bias']
    """
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def _check_model_and_generator(
    model: nn.Module, generator: torch.Generator | None, name: str
) -> None:
    """Refuse a ``DistributedDataParallel`` model, or a ``generator=`` that is not one.

    Under DDP the curvature would be one rank's batch's: each replica would be preconditioned
    by another curvature and the replicas drift apart (a probe: 0.17 after 3 steps on 2
    ranks). The subclasses check before they build their transformation, so that their
    own name is the one a refusal gives.

    Raises:
        ValueError: naming the way over ranks.
        TypeError: for a generator that is not a ``torch.Generator``
            (:func:`~packfunc.engine.randomness.check_generator`).

    Example:
        >>> _check_model_and_generator(nn.Linear(2, 2), None, "KFAC")
    """
    check_generator(generator, f"{name}()")
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise ValueError(
            f"{name} computes its curvature from this rank's own batch: under "
            "DistributedDataParallel each replica would be preconditioned by another curvature "
            "and the replicas drift apart. Train on one process, or compute the factors over "
            "ranks (pf.kflr/pf.kfac(..., process_group=...)) and precondition DDP's averaged "
            "gradient with them (pf.kron)."
        )


__all__ = ["EKFAC", "KFAC", "CurvatureOptimizer", "DiagGGN"]
