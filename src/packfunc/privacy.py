"""Differentially private training: DP-SGD's clipped sum, noise, Poisson batches, accounting.

DP-SGD bounds every sample's influence on a step by clipping its gradient (over all
parameters together) to norm ``C``, and hides what remains by adding Gaussian noise of
standard deviation ``σ·C`` to the sum. :func:`clipped_grad` gives the clipped sum from one
forward and one backward, without per-sample gradients; :func:`add_noise` adds the noise;
:class:`PoissonBatches` samples each example independently with probability ``q`` per step
(the sampling the accountants assume); :func:`epsilon` and :func:`noise_multiplier` ask
opacus' accountants (RDP or PRV; ``pip install opacus``) what a run spends. For per-sample
gradients you already have, :func:`clip_per_sample` and :func:`clip_and_noise` do the same
from :func:`packfunc.batch_grad`. Use a loss with ``reduction='sum'`` (each sample's own
loss). The noise comes from ``torch``'s generator: for a deployment that must resist an
attacker who could predict it, draw it from a cryptographically secure source instead.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal, cast

import optree
import torch
import torch.distributed as dist
from torch import Tensor, nn
from typing_extensions import Unpack

from packfunc.data import DataOptions, over_data
from packfunc.distributed import (
    ProcessGroup,
    check_group,
    is_first_rank,
    sum_counts_over_ranks,
)
from packfunc.engine.randomness import check_generator
from packfunc.engine.statistics import clipping_factors, norms_from_squares, squared_row_norms
from packfunc.evaluation import CLIPPING_EPS, clipping_bounds, one_quantity
from packfunc.functionalize import flatten_params, functional, leading_sizes
from packfunc.losses import check_loss, default_loss
from packfunc.optim.transforms import EmptyState, GradientTransformation
from packfunc.specs import SPECS
from packfunc.types import (
    DATA_ARGUMENTS,
    Inputs,
    MaxNorm,
    ModelFn,
    ParamsT,
    PyTree,
    Targets,
    shares_arguments,
)


@over_data(SPECS["clipped_grad"], required=("max_norm",))
@shares_arguments("model_fn", "params", "X", "y", "chunk_size", *DATA_ARGUMENTS)
def clipped_grad(
    model_fn: ModelFn,
    params: ParamsT,
    X: Inputs = None,
    y: Targets = None,
    *,
    max_norm: MaxNorm,
    loss: nn.Module | None = None,
    chunk_size: int | None = None,
    **dataset: Unpack[DataOptions],
) -> ParamsT:
    """DP-SGD's clipped sum ``Σ_n g_n · min(1, C / (‖g_n‖ + 1e-6))``, without ``[N, *p]``.

    ``g_n`` is sample ``n``'s gradient of its own loss, its norm taken over every leaf of
    ``params`` together (pass a subset of the parameters to clip and train only those).
    One forward and one backward: the norms come from the layers' closed forms (the
    Gram form over positions where that is cheaper), and the clipped sum is one more
    contraction of the same recorded inputs with the clipping-weighted output
    gradients; parameters without a closed form take their op-local path. With
    ``data=`` the batches' clipped sums add up.

    Args:
        max_norm: The bound ``C > 0`` on each sample's gradient norm over all of ``params``;
            or one bound per leaf of ``params`` (a dict ``{name: C_i}``, or a list in the
            flattening order: a dict's sorted keys), each leaf's per-sample
            gradient clipped alone (opacus' per-layer clipping; the step's sensitivity is then
            ``√Σ C_i²``); or one per group of leaves, a tuple of names clipped by their joint
            norm (``{("0.weight", "0.bias"): C_1, ...}``, each leaf in one key).
        loss: A ``torch.nn`` loss with ``reduction='sum'``, each sample's own loss
            (default ``CrossEntropyLoss(reduction='sum')``); a mean is refused.

    Returns:
        Pytree like ``params``: the sum of the clipped per-sample gradients (add noise and
        divide by the batch size for DP-SGD, e.g. with :func:`add_noise`).

    Raises:
        ValueError: for ``max_norm <= 0`` or a loss without ``reduction='sum'``.
        FloatingPointError: where a sample's norm overflows the dtype (clipping would drop
            that sample instead of scaling it).

    Example:
        >>> model_fn, params = packfunc.functional(torch.nn.Linear(3, 2))
        >>> X, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
        >>> clipped_grad(model_fn, params, X, y, max_norm=1.0)["weight"].shape
        torch.Size([2, 3])
    """
    return one_quantity(
        "clipped_grad",
        model_fn,
        params,
        X,
        y,
        loss or default_loss("sum"),
        chunk_size=chunk_size,
        max_norm=max_norm,
    )


def add_noise(
    clipped_sum: ParamsT,
    max_norm: float,
    noise_multiplier: float,
    *,
    generator: torch.Generator | None = None,
    process_group: ProcessGroup | None = None,
) -> ParamsT:
    """The clipped sum plus Gaussian noise of standard deviation ``σ·C`` in every coordinate.

    Divide the result by the (expected) batch size for DP-SGD's mean gradient.

    Args:
        clipped_sum: The clipped sum (e.g. from :func:`clipped_grad`).
        max_norm: The clipping bound ``C``.
        noise_multiplier: ``σ >= 0``, finite.
        generator: Random generator for the noise (on the sum's device).
        process_group: Ranks that each hold the global clipped sum (``clipped_grad(...,
            process_group=...)``): the noise is drawn once, on the group's first rank
            (from its ``generator``), and sent to the others, so that every rank adds the
            same noise (noise drawn on each rank would leave the replicas apart, and an
            average of it would be ``√ranks`` too small).

    Returns:
        Pytree like ``clipped_sum``.

    Raises:
        ValueError: for a negative, infinite or NaN ``noise_multiplier``, or a ``max_norm``
            that is not finite and positive.

    Example:
        >>> add_noise({"w": torch.zeros(3)}, 1.0, 0.0)["w"]
        tensor([0., 0., 0.])
    """
    _check_noise_multiplier(noise_multiplier, "add_noise")
    if not 0 < max_norm < math.inf:  # (NaN is not)
        raise ValueError(f"add_noise needs a finite max_norm > 0; got {max_norm!r}.")
    leaves, treespec = optree.tree_flatten(cast(Any, clipped_sum))
    integral = [i for i, leaf in enumerate(leaves) if not leaf.is_floating_point()]
    if integral:
        raise ValueError(
            f"add_noise needs floating-point leaves (Gaussian noise); leaf {integral[0]} is "
            f"{leaves[integral[0]].dtype}. Pass the clipped sum (clipped_grad's result)."
        )
    if process_group is None:
        noisy = _plus_gaussian(leaves, noise_multiplier * max_norm, generator)
    else:
        check_group(process_group)
        noise = [torch.zeros_like(leaf, memory_format=torch.contiguous_format) for leaf in leaves]
        if is_first_rank(process_group):
            noise = _plus_gaussian(noise, noise_multiplier * max_norm, generator)
        first = dist.get_global_rank(process_group, 0)
        for drawn in noise:
            dist.broadcast(drawn, src=first, group=process_group)
        noisy = [leaf + drawn for leaf, drawn in zip(leaves, noise, strict=True)]
    return cast(ParamsT, optree.tree_unflatten(treespec, noisy))


def _check_noise_multiplier(noise_multiplier: float, caller: str) -> None:
    """Refuse a noise multiplier ``σ`` that is negative, infinite or NaN.

    The noise's standard deviation is ``σ·C``: an infinite ``σ`` makes every coordinate of
    the gradient ``±inf`` (and a NaN ``σ`` NaN), which no step can use.

    Args:
        noise_multiplier: ``σ``.
        caller: The function or class named in the error.

    Raises:
        ValueError: naming ``caller`` and the value.

    Example:
        >>> _check_noise_multiplier(1.1, "add_noise")
        >>> try:
        ...     _check_noise_multiplier(float("inf"), "add_noise")
        ... except ValueError as error:
        ...     print(str(error)[:51])
        add_noise needs a finite noise_multiplier σ >= 0 (0
    """
    if not 0 <= noise_multiplier < math.inf:  # (NaN is not)
        raise ValueError(
            f"{caller} needs a finite noise_multiplier σ >= 0 (0: no noise); got "
            f"{noise_multiplier!r}. The noise's standard deviation is σ·max_norm: an infinite "
            "σ would make every gradient entry ±inf."
        )


def _check_summed_loss(loss: nn.Module, caller: str) -> None:
    """Refuse a loss whose reduction is not ``'sum'`` for a private gradient.

    Clipping bounds each sample's gradient of its own loss; a mean scales them by the
    batch's normalizer (which, with Poisson batches, varies from step to step).

    Args:
        loss: The loss module.
        caller: The function or class named in the error.

    Raises:
        TypeError: for a loss packfunc does not support.
        ValueError: for a reduction other than ``'sum'``.

    Example:
        >>> _check_summed_loss(nn.CrossEntropyLoss(reduction="sum"), "private_gradient")
        >>> try:
        ...     _check_summed_loss(nn.CrossEntropyLoss(), "private_gradient")
        ... except ValueError as error:
        ...     print(str(error)[:50])
        private_gradient needs a loss with reduction='sum'
    """
    if getattr(loss, "reduction", "sum") == "sum":
        check_loss(loss)  # (a loss packfunc does not support)
    else:
        raise ValueError(
            f"{caller} needs a loss with reduction='sum' (each sample's own loss, whose "
            f"gradient clipping bounds); got {type(loss).__name__}(reduction="
            f"{loss.reduction!r}). Pass {type(loss).__name__}(reduction='sum'): the private "
            "gradient is divided by expected_batch_size after the noise is added."
        )


_NOISE_BUFFER = 2**22
"""Most elements of noise drawn in one call (16 MiB at float32): a small model's leaves share
one call; a larger buffer would be mapped fresh by the allocator and add its whole size to
the peak resident memory, where buffers of a leaf's size reuse memory the step just freed."""


def _plus_gaussian(
    leaves: list[Tensor], std: float, generator: torch.Generator | None
) -> list[Tensor]:
    """Each leaf plus ``N(0, std²)`` noise, drawn on the generator's device.

    Consecutive leaves of one dtype and device draw their noise at once, up to
    :data:`_NOISE_BUFFER` elements (a larger leaf draws its own), and get it added in place in
    one call, so that nothing beside the results is allocated; a group with a leaf that
    requires grad gets it added out of place.
    """
    check_generator(generator, "the noise (add_noise, clip_and_noise)")
    noisy: list[Tensor] = []
    for group in _noise_groups(leaves):
        dtype, device = group[0].dtype, group[0].device
        sizes = [leaf.numel() for leaf in group]
        drawn_on = device if generator is None else generator.device
        z = torch.randn(sum(sizes), generator=generator, dtype=dtype, device=drawn_on)
        z = z.to(device).mul_(std)
        parts = [part.view(leaf.shape) for leaf, part in zip(group, z.split(sizes), strict=True)]
        if any(leaf.requires_grad for leaf in group):
            noisy.extend(torch._foreach_add(group, parts))
        else:  # into the noise itself: one call for the group, nothing allocated
            torch._foreach_add_(parts, group)
            noisy.extend(parts)
    return noisy


def _noise_groups(leaves: list[Tensor]) -> list[list[Tensor]]:
    """Runs of consecutive leaves of one dtype and device to draw noise for at once.

    Each run has at most :data:`_NOISE_BUFFER` elements, unless one leaf alone is larger.
    """
    groups: list[list[Tensor]] = []
    size = 0
    for leaf in leaves:
        last = groups[-1][-1] if groups else None
        same_kind = last is not None and (last.dtype, last.device) == (leaf.dtype, leaf.device)
        if same_kind and size + leaf.numel() <= _NOISE_BUFFER:
            groups[-1].append(leaf)
            size += leaf.numel()
        else:
            groups.append([leaf])
            size = leaf.numel()
    return groups


class PoissonBatches:
    """Poisson sampling: each step includes every example independently with probability ``q``.

    Iterating yields ``steps`` index tensors of varying length (possibly empty: the
    clipped sum of an empty batch is zero, and the step is the noise alone). Use it as a
    ``DataLoader``'s ``batch_sampler`` (with a ``collate_fn`` that accepts an empty list)
    or index a tensor dataset yourself.

    Args:
        size: Number of examples ``n``.
        sample_rate: ``q`` in ``(0, 1]``; the expected batch size is ``q·n``.
        steps: Batches per pass (default ``int(1 / q)``, as opacus' sampler: about one
            epoch in expectation).
        generator: Random generator for the draws.

    Example:
        >>> batches = PoissonBatches(100, 0.1, generator=torch.Generator().manual_seed(0))
        >>> len(batches), all(len(b) <= 100 for b in batches)
        (10, True)
    """

    def __init__(
        self,
        size: int,
        sample_rate: float,
        steps: int | None = None,
        generator: torch.Generator | None = None,
    ):
        whole = _whole_number(size), None if steps is None else _whole_number(steps)
        if (
            whole[0] is None
            or whole[0] < 1
            or not 0 < sample_rate <= 1
            or (steps is not None and (whole[1] is None or whole[1] < 1))
        ):
            raise ValueError(
                f"PoissonBatches needs a whole size >= 1, 0 < sample_rate <= 1 and a whole "
                f"number of steps >= 1; got {size!r}, {sample_rate!r} and {steps!r}."
            )
        check_generator(generator, "PoissonBatches()")
        self.size, self.sample_rate, self.generator = whole[0], sample_rate, generator
        self.steps = whole[1] or max(1, int(1 / sample_rate))

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[Tensor]:
        for _ in range(self.steps):
            # float64: float32's draws lie on a grid of 2⁻²⁴, which would round a small rate up
            drawn = torch.rand(self.size, generator=self.generator, dtype=torch.float64)
            yield torch.nonzero(drawn < self.sample_rate).flatten()


class DPOptimizer:
    """DP-SGD for an ordinary training loop: any ``torch.optim`` optimizer on private gradients.

    ``step(batch=(X, y))`` sets each trainable parameter's ``.grad`` to
    ``(clipped_grad + N(0, σ²C²)) / expected_batch_size`` for that batch (one forward and
    one backward, no per-sample gradients; the model is only read) and steps the wrapped
    optimizer. An empty batch (Poisson sampling) gives the noise alone. The parameters
    clipped together are, at each step, the model's parameters in the optimizer that
    require grad, at their current values (``p.data = ...``, ``model.to(...)`` are seen).

    It is no ``torch.optim.Optimizer``: give a learning-rate scheduler the wrapped optimizer,
    ``StepLR(dp.optimizer, ...)`` (``dp.param_groups`` are its groups). ``state_dict()`` and
    ``load_state_dict()`` checkpoint the wrapped optimizer and the noise generator's state.

    Args:
        model: The module being trained (its trainable parameters are clipped together).
        optimizer: A ``torch.optim`` optimizer over those parameters.
        max_norm: The clipping bound ``C``; or bounds per parameter or group of parameters
            by name, as :func:`clipped_grad` takes them (the names of
            ``model.named_parameters()``); or a list, one bound per trainable parameter the
            optimizer steps, in its ``param_groups`` order (as opacus' ``DPPerLayerOptimizer``
            reads it; :func:`clipped_grad` reads a list in its ``params``' order, sorted
            names, and the shim's ``ClippedGrad`` in ``model.parameters()`` order).
        noise_multiplier: ``σ``.
        expected_batch_size: ``q·n`` for Poisson sampling (the batch size otherwise), over
            every rank's shard.
        loss: A loss with ``reduction='sum'`` (default ``CrossEntropyLoss(reduction='sum')``).
        generator: Random generator for the noise.
        process_group: Ranks that each step on their own batch of one model replica (not
            wrapped in ``DistributedDataParallel``): every rank steps with the private
            gradient of all ranks' samples, the noise drawn once (:func:`add_noise`).

    Raises:
        ValueError: for a ``noise_multiplier`` that is negative, infinite or NaN, bounds
            that are not finite and positive, or a loss without ``reduction='sum'``.

    Example:
        >>> model = torch.nn.Linear(3, 2)
        >>> opt = DPOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), max_norm=1.0,
        ...                   noise_multiplier=1.0, expected_batch_size=4)
        >>> opt.step(batch=(torch.randn(4, 3), torch.randint(0, 2, (4,))))
        >>> model.weight.grad.shape
        torch.Size([2, 3])
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        max_norm: MaxNorm,
        noise_multiplier: float,
        expected_batch_size: float,
        loss: nn.Module | None = None,
        generator: torch.Generator | None = None,
        process_group: ProcessGroup | None = None,
    ):
        _check_noise_multiplier(noise_multiplier, "DPOptimizer")
        check_generator(generator, "DPOptimizer()")
        if isinstance(model, nn.parallel.DistributedDataParallel):
            raise ValueError(
                "DPOptimizer takes the module itself, not a DistributedDataParallel wrapper: "
                "DDP's averaged .grad is not DP's clipped sum, and each rank stepped on its own "
                "shard. Pass model.module with process_group= (every rank gets the private "
                "gradient of all ranks' samples, the noise drawn once)."
            )
        if loss is not None:
            _check_summed_loss(loss, "DPOptimizer")
        self.model, self.optimizer, self.generator = model, optimizer, generator
        model_fn, _ = functional(model)
        self.private = private_gradient(
            model_fn,
            max_norm=_bounds_by_name(model, optimizer, max_norm),
            noise_multiplier=noise_multiplier,
            expected_batch_size=expected_batch_size,
            loss=loss,
            generator=generator,
            process_group=process_group,
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the wrapped optimizer's gradients."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's parameter groups (the same list: set ``lr`` there).

        Example:
            >>> model = torch.nn.Linear(3, 2)
            >>> dp = DPOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1),
            ...                  max_norm=1.0, noise_multiplier=1.0, expected_batch_size=4)
            >>> dp.param_groups[0]["lr"]
            0.1
        """
        return self.optimizer.param_groups

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs: the wrapped optimizer's state and the generator's.

        Returns:
            ``{"optimizer": optimizer.state_dict(), "generator": generator.get_state()}``
            (``None`` for the generator where none was given: the noise is drawn from
            torch's global generator, which ``torch.get_rng_state`` saves).

        Example:
            >>> model = torch.nn.Linear(3, 2)
            >>> dp = DPOptimizer(model, torch.optim.Adam(model.parameters()), max_norm=1.0,
            ...                  noise_multiplier=1.0, expected_batch_size=4)
            >>> sorted(dp.state_dict())
            ['generator', 'optimizer']
        """
        drawn = None if self.generator is None else self.generator.get_state()
        return {"optimizer": self.optimizer.state_dict(), "generator": drawn}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` (or the wrapped optimizer's own state dict).

        Args:
            state_dict: As :meth:`state_dict` returned it; a plain optimizer's state dict
                (``state`` and ``param_groups``) restores the wrapped optimizer alone.

        Raises:
            ValueError: for the state of a generator where this one has none (its noise
                would not continue the checkpoint's).

        Example:
            >>> model = torch.nn.Linear(3, 2)
            >>> dp = DPOptimizer(model, torch.optim.Adam(model.parameters()), max_norm=1.0,
            ...                  noise_multiplier=1.0, expected_batch_size=4)
            >>> dp.load_state_dict(dp.state_dict())
        """
        if "optimizer" not in state_dict:  # the wrapped optimizer's own
            self.optimizer.load_state_dict(dict(state_dict))
            return
        drawn = state_dict.get("generator")
        if drawn is not None and self.generator is None:
            raise ValueError(
                "DPOptimizer.load_state_dict: the checkpoint holds a noise generator's state "
                "but this DPOptimizer has no generator; construct it with generator=a "
                "torch.Generator to continue that noise."
            )
        self.optimizer.load_state_dict(state_dict["optimizer"])
        if drawn is not None and self.generator is not None:
            self.generator.set_state(drawn)

    def step(self, *args: Any, batch: tuple[Inputs, Tensor] | None = None) -> None:
        """One DP-SGD step on ``batch``: private gradients into ``.grad``, then the update.

        Args:
            *args: None (a closure or a positional batch is refused, naming ``batch=``).
            batch: ``(X, y)``, possibly empty.

        Raises:
            TypeError: without ``batch=`` (opacus' ``loss.backward(); optimizer.step()``: the
                gradients of that backward are not DP's, and this step makes its own).
        """
        if args or batch is None:
            raise TypeError(
                "DPOptimizer.step(batch=(X, y)) runs its own forward and backward (clipping "
                "each sample's gradient, then the noise); call it with the batch by keyword "
                "instead of loss.backward(); optimizer.step() as in opacus (that backward's "
                ".grad is not the private gradient and is replaced)."
            )
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise TypeError(
                f"DPOptimizer.step takes batch=(X, y), a pair; got {type(batch).__name__}."
            )
        trainable = self._trainable()
        params = {name: p.detach() for name, p in trainable.items()}  # their memory now
        grads, _ = self.private.update(None, EmptyState(), params, batch)
        for name, parameter in trainable.items():
            parameter.grad = cast(dict[str, Tensor], grads)[name]
        self.optimizer.step()

    def _trainable(self) -> dict[str, nn.Parameter]:
        """The model's parameters the optimizer steps that require grad, at this step.

        (As opacus: clipped together, and only those; a layer frozen or unfrozen between
        steps is followed.)
        """
        stepped = {id(p): p for group in self.optimizer.param_groups for p in group["params"]}
        found = {
            name: p
            for name, p in self.model.named_parameters()
            if p.requires_grad and id(p) in stepped
        }
        own = {id(p) for p in self.model.parameters()}
        foreign = [p for key, p in stepped.items() if key not in own and p.requires_grad]
        if foreign:
            raise ValueError(
                f"DPOptimizer: the optimizer steps a tensor of shape {tuple(foreign[0].shape)} "
                "that is not a parameter of the model, so it would be neither clipped nor "
                "noised (its update would leak its raw gradient). Register it on the model "
                "(an nn.Parameter attribute of a module, e.g. a soft prompt) or leave it out "
                "of the optimizer."
            )
        if not found:
            raise ValueError(
                "DPOptimizer: none of the optimizer's parameters is a parameter of the model "
                "that requires grad; nothing to train."
            )
        return found


def private_gradient(
    model_fn: ModelFn,
    *,
    max_norm: MaxNorm,
    noise_multiplier: float,
    expected_batch_size: float,
    loss: nn.Module | None = None,
    generator: torch.Generator | None = None,
    process_group: ProcessGroup | None = None,
) -> GradientTransformation:
    """DP-SGD's gradient as an optax-style transformation: chain it with ``scale(-lr)``.

    ``update(updates, state, params, batch)`` ignores the incoming ``updates`` and returns
    ``(clipped_grad(params, batch) + N(0, σ²C²)) / expected_batch_size`` (an empty batch
    gives the noise alone; with one bound per parameter ``C = √Σ C_i²``).

    Args:
        model_fn: ``model_fn(params, X) -> output``.
        max_norm: The clipping bound (or one per parameter).
        noise_multiplier: ``σ``.
        expected_batch_size: ``q·n`` for Poisson sampling (over every rank's shard).
        loss: A loss with ``reduction='sum'`` (default ``CrossEntropyLoss(reduction='sum')``).
        generator: Random generator for the noise.
        process_group: Ranks that each pass their own batch: every rank gets the private
            gradient of all ranks' samples, with the noise drawn once (see
            :func:`add_noise`).

    Returns:
        The transformation (its state is an :class:`~packfunc.optim.EmptyState`).

    Raises:
        ValueError: at construction, for a ``noise_multiplier`` that is negative, infinite or
            NaN, a non-positive ``expected_batch_size``, bounds that are not finite and
            positive, or a loss without ``reduction='sum'``; at a step (an empty batch too),
            for bounds by name that do not match ``params``' leaves one to one, or two
            leaves of one name (:func:`~packfunc.functionalize.leaf_names`).

    Example:
        >>> from packfunc.optim import apply_updates, chain, scale
        >>> model_fn, params = packfunc.functional(torch.nn.Linear(3, 2))
        >>> dp = chain(private_gradient(model_fn, max_norm=1.0, noise_multiplier=1.0,
        ...                             expected_batch_size=4), scale(-0.1))
        >>> batch = (torch.randn(4, 3), torch.randint(0, 2, (4,)))
        >>> updates, state = dp.update(None, dp.init(params), params, batch)
        >>> apply_updates(params, updates)["weight"].shape
        torch.Size([2, 3])
    """
    if not 0 < expected_batch_size < math.inf:
        raise ValueError(
            f"expected_batch_size must be positive and finite; got {expected_batch_size!r}."
        )
    _check_noise_multiplier(noise_multiplier, "private_gradient")
    summed = loss or default_loss("sum")
    _check_summed_loss(summed, "private_gradient")
    bound = _sensitivity(max_norm)

    def init(params: PyTree) -> EmptyState:
        """No state."""
        return EmptyState()

    def update(
        updates: PyTree,
        state: Any,
        params: PyTree | None = None,
        batch: tuple[Inputs, Targets] | None = None,
    ) -> tuple[PyTree, Any]:
        """The private gradient of ``params`` on ``batch``."""
        if params is None or batch is None:
            raise ValueError("private_gradient needs params and the batch (X, y) at every step.")
        X, y = batch
        # the bounds match the leaves one to one (two leaves of one name are refused), also
        # for the noise alone: else one bound could clip two leaves, the noise sized for one
        clipping_bounds(max_norm, flatten_params(params)[2])
        total: PyTree
        empty = _is_empty(X, y)
        if process_group is not None:  # (every rank's batch empty: each adds the noise alone)
            device = optree.tree_leaves(cast(Any, params))[0].device
            empty = sum_counts_over_ranks([float(not empty)], process_group, device)[0] == 0
        if empty:
            # an empty Poisson batch: the noise alone (inputs with samples beside no targets
            # go on to clipped_grad, which refuses the mismatch)
            total = cast(PyTree, optree.tree_map(torch.zeros_like, cast(Any, params)))
        else:
            total = clipped_grad(
                model_fn,
                params,
                X,
                y,
                loss=summed,
                max_norm=max_norm,
                process_group=process_group,
            )
        noisy = add_noise(
            total, bound, noise_multiplier, generator=generator, process_group=process_group
        )
        scaled = optree.tree_map(lambda t: t / expected_batch_size, cast(Any, noisy))
        return cast(PyTree, scaled), state

    return GradientTransformation(init, update)


def _is_empty(X: Inputs, y: Targets) -> bool:
    """Whether ``(X, y)`` is an empty batch; a malformed one is not.

    (:func:`clipped_grad` refuses it then, on every rank alike where there are several.)

    Example:
        >>> _is_empty(torch.zeros(0, 3), torch.zeros(0)), _is_empty(None, torch.tensor(1.0))
        (True, False)
    """
    if not isinstance(y, Tensor) or y.dim() == 0:
        return False
    try:
        return len(y) == 0 and leading_sizes(X) <= {0}
    except (TypeError, ValueError):
        return False


def _bounds_by_name(
    model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: MaxNorm
) -> MaxNorm:
    """A list of bounds as a dict by name, in the optimizer's order of the parameters.

    As opacus' ``DPPerLayerOptimizer``: the list follows the trainable parameters the
    optimizer steps, group after group (those of the model; a foreign one is refused at
    the step). A one-dimensional array or tensor of bounds is read as a list.

    Args:
        model: The model the parameters are named in.
        optimizer: The wrapped optimizer, whose ``param_groups`` order the list follows.
        max_norm: A bound, a list of bounds or bounds by name (the last two as they are).

    Returns:
        ``max_norm``, a list keyed by the names of the parameters it follows.

    Raises:
        ValueError: for a list whose length is not the number of those parameters.

    Example:
        >>> layer = torch.nn.Linear(2, 1)
        >>> _bounds_by_name(layer, torch.optim.SGD([layer.bias, layer.weight]), [1.0, 2.0])
        {'bias': 1.0, 'weight': 2.0}
    """
    if hasattr(max_norm, "tolist") and not isinstance(max_norm, (int, float)):
        max_norm = cast(Any, max_norm).tolist()  # numpy or torch bounds
    if isinstance(max_norm, Mapping) or not isinstance(max_norm, Sequence):
        return max_norm
    name_of = {id(p): name for name, p in model.named_parameters()}
    names = [
        name_of[id(p)]
        for group in optimizer.param_groups
        for p in group["params"]
        if p.requires_grad and id(p) in name_of
    ]
    if len(max_norm) != len(names):
        raise ValueError(
            f"DPOptimizer got {len(max_norm)} bounds for the {len(names)} trainable "
            "parameters of the model its optimizer steps: a list gives one bound per such "
            "parameter, in the optimizer's param_groups order (as opacus' "
            "DPPerLayerOptimizer); or pass bounds by name, {name: C}."
        )
    return dict(zip(names, max_norm, strict=True))


def _whole_number(value: object) -> int | None:
    """``value`` as an ``int`` if it is a whole number (a numpy or 0-dim torch integer too).

    Example:
        >>> _whole_number(torch.tensor(3)), _whole_number(2.5), _whole_number(True)
        (3, None, None)
    """
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def _sensitivity(max_norm: MaxNorm) -> float:
    """The clipped sum's L2 sensitivity: ``C``, or ``√Σ C_i²`` with one bound ``C_i`` each.

    One bound per parameter, or per group of parameters clipped together.
    """
    if isinstance(max_norm, Mapping):
        bounds = [float(c) for c in max_norm.values()]
    elif isinstance(max_norm, Sequence) and not isinstance(max_norm, str):
        bounds = [float(c) for c in max_norm]
    else:
        bounds = [float(max_norm)]
    if not bounds or not all(0 < c < math.inf for c in bounds):
        raise ValueError(f"clipping needs finite bounds max_norm > 0; got {max_norm!r}.")
    return math.sqrt(sum(c**2 for c in bounds))


Accountant = Literal["rdp", "prv"]
"""opacus' accountants: Rényi DP (``"rdp"``) or the privacy random variable (``"prv"``)."""


def epsilon(
    *,
    noise_multiplier: float,
    sample_rate: float,
    steps: int,
    delta: float,
    accountant: Accountant = "rdp",
) -> float:
    """The privacy spent, ``ε`` at ``δ``, by ``steps`` DP-SGD steps with Poisson sampling.

    Computed by opacus' accountant (the value opacus itself reports for the run).

    Args:
        noise_multiplier: ``σ``.
        sample_rate: ``q``, each example's probability of being in a batch.
        steps: Number of steps.
        delta: ``δ``.
        accountant: ``"rdp"`` or ``"prv"``.

    Returns:
        ``ε``.

    Raises:
        ImportError: without opacus.

    Example:
        >>> round(epsilon(noise_multiplier=1.1, sample_rate=0.01, steps=1000, delta=1e-5), 3)
        1.712
    """
    _check_accounting(sample_rate, steps, delta, noise_multiplier=noise_multiplier)
    accounting = _opacus_accountant(accountant)
    accounting.history = [(noise_multiplier, sample_rate, operator.index(steps))]
    try:
        return float(accounting.get_epsilon(delta=delta))
    except MemoryError:  # opacus' PRV grid for a tiny noise multiplier
        raise ValueError(
            f"the {accountant!r} accountant cannot represent noise_multiplier="
            f"{noise_multiplier!r} (its grid would not fit in memory): use accountant='rdp'."
        ) from None


def noise_multiplier(
    *,
    epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: Accountant = "rdp",
) -> float:
    """The noise multiplier ``σ`` for which ``steps`` steps spend at most ``ε`` (opacus' search).

    Args:
        epsilon: The target ``ε``.
        delta: ``δ``.
        sample_rate: ``q``.
        steps: Number of steps.
        accountant: ``"rdp"`` or ``"prv"``.

    Returns:
        ``σ``.

    Raises:
        ImportError: without opacus.

    Example:
        >>> sigma = noise_multiplier(epsilon=2.0, delta=1e-5, sample_rate=0.01, steps=1000)
        >>> 0.9 < sigma < 1.1
        True
    """
    _check_accounting(sample_rate, steps, delta, epsilon=epsilon)
    _opacus_accountant(accountant)  # the clear error without opacus
    from opacus.accountants.utils import get_noise_multiplier

    return float(
        get_noise_multiplier(
            target_epsilon=epsilon,
            target_delta=delta,
            sample_rate=sample_rate,
            steps=operator.index(steps),
            accountant=accountant,
        )
    )


def _check_accounting(
    sample_rate: float,
    steps: int,
    delta: float,
    *,
    noise_multiplier: float | None = None,
    epsilon: float | None = None,
) -> None:
    """Refuse accounting arguments outside their ranges (opacus' accountants do not).

    Raises:
        ValueError: naming each argument's range.
    """
    problems = []
    if not 0 < sample_rate <= 1:
        problems.append(f"0 < sample_rate <= 1 (got {sample_rate!r})")
    whole = _whole_number(steps)
    if whole is None or whole < 1:
        problems.append(f"a whole number of steps >= 1 (got {steps!r})")
    if not 0 < delta < 1:
        problems.append(f"0 < delta < 1 (got {delta!r})")
    if noise_multiplier is not None and not 0 < noise_multiplier < math.inf:
        problems.append(f"0 < noise_multiplier < inf (got {noise_multiplier!r})")
    if epsilon is not None and not 0 < epsilon < math.inf:
        problems.append(f"0 < epsilon < inf (got {epsilon!r})")
    if problems:
        raise ValueError("privacy accounting needs " + ", ".join(problems) + ".")


def _opacus_accountant(kind: Accountant) -> Any:
    """A fresh opacus accountant of that kind."""
    try:
        from opacus.accountants import create_accountant
    except ImportError as error:
        raise ImportError(
            "privacy accounting uses opacus' accountants: pip install opacus (only its "
            "accountants are used)."
        ) from error
    if kind not in ("rdp", "prv"):
        raise ValueError(f"accountant must be 'rdp' or 'prv'; got {kind!r}.")
    return create_accountant(kind)


def clip_per_sample(batch_grads: ParamsT, max_norm: float, *, batch_l2: PyTree = None) -> ParamsT:
    """Scale each sample's gradient, across all parameters, to norm at most ``max_norm``.

    Sample ``n`` is multiplied by ``min(1, max_norm / (‖g_n‖ + 1e-6))``, where ``‖g_n‖``
    is the norm of its gradient over every leaf; samples within the bound are unchanged.

    Args:
        batch_grads: Pytree of per-sample gradients, leaves ``[N, *p]`` (as from
            :func:`packfunc.batch_grad`).
        max_norm: The bound ``C > 0``.
        batch_l2: Optional pytree (any structure) of the matching squared per-sample norms,
            leaves ``[N]`` (as from :func:`packfunc.batch_l2_grad`); computed from
            ``batch_grads`` when omitted.

    Returns:
        Pytree like ``batch_grads`` with the clipped per-sample gradients.

    Raises:
        ValueError: if ``max_norm`` is not positive, there are no leaves, or the leaves'
            leading (sample) dimensions differ.
        FloatingPointError: where a sample's norm overflows the dtype.

    Example:
        >>> g = {"w": torch.tensor([[3.0, 4.0], [0.3, 0.4]])}
        >>> clip_per_sample(g, max_norm=1.0)["w"]
        tensor([[0.6000, 0.8000],
                [0.3000, 0.4000]])
    """
    if not max_norm > 0:  # (NaN is not)
        raise ValueError(f"max_norm must be positive, got {max_norm}")
    leaves, treespec = optree.tree_flatten(cast(Any, batch_grads))
    num_samples = _num_samples(leaves)
    if batch_l2 is None:
        # (float32 squares where float16: the norms fit, their squares may not; by segments)
        squared_norms = [squared_row_norms(g.reshape(num_samples, -1)) for g in leaves]
    else:
        squared_norms = optree.tree_leaves(cast(Any, batch_l2))
        if len(squared_norms) != len(leaves) or any(
            s.shape != (num_samples,) for s in squared_norms
        ):
            raise ValueError(
                f"batch_l2 must hold one [N] tensor of squared norms per leaf of batch_grads "
                f"({len(leaves)} leaves, N={num_samples}); got shapes "
                f"{[tuple(s.shape) for s in squared_norms]}."
            )
    norms = norms_from_squares(torch.stack(squared_norms).sum(0))
    factors = clipping_factors(norms, max_norm, CLIPPING_EPS)
    clipped = [g * factors.view(-1, *[1] * (g.dim() - 1)).to(g.dtype) for g in leaves]
    return cast(ParamsT, optree.tree_unflatten(treespec, clipped))


def clip_and_noise(
    batch_grads: ParamsT,
    max_norm: float,
    noise_multiplier: float,
    *,
    batch_l2: PyTree = None,
    generator: torch.Generator | None = None,
) -> ParamsT:
    """DP-SGD's private gradient: clip per sample, sum, add Gaussian noise, divide by ``N``.

    Returns ``(Σ_n clip(g_n) + σ·C·z) / N`` with ``z ~ N(0, I)`` drawn independently for
    every entry, ``clip`` as in :func:`clip_per_sample` and ``N`` the number of samples.

    Args:
        batch_grads: Pytree of per-sample gradients, leaves ``[N, *p]`` (as from
            :func:`packfunc.batch_grad`).
        max_norm: The clipping bound ``C > 0``.
        noise_multiplier: ``σ ≥ 0``, finite; the noise added to the sum has standard
            deviation ``σ·C`` (``0``: no noise, the mean of the clipped gradients).
        batch_l2: Optional pytree of the squared per-sample norms, leaves ``[N]`` (as from
            :func:`packfunc.batch_l2_grad`); computed from ``batch_grads`` when omitted.
        generator: Source of the noise, for reproducible runs (its device may differ from
            the gradients'; the noise is moved to them). Default: the global generator.

    Returns:
        Pytree like ``batch_grads`` with leaves ``[*p]``: the privatized mean gradient.

    Raises:
        ValueError: if ``max_norm`` is not positive, ``noise_multiplier`` is negative,
            infinite or NaN, or the leaves do not share one positive number of samples.

    Example:
        >>> model_fn, params = packfunc.functional(torch.nn.Linear(3, 2))
        >>> X, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
        >>> out = packfunc.compute(
        ...     model_fn, params, X, y,
        ...     loss=torch.nn.CrossEntropyLoss(reduction="sum"),
        ...     quantities=("batch_grad", "batch_l2_grad"),
        ... )
        >>> grad = clip_and_noise(
        ...     out["batch_grad"], max_norm=1.0, noise_multiplier=1.1,
        ...     batch_l2=out["batch_l2_grad"], generator=torch.Generator().manual_seed(0),
        ... )
        >>> grad["weight"].shape
        torch.Size([2, 3])
    """
    _check_noise_multiplier(noise_multiplier, "clip_and_noise")
    clipped = clip_per_sample(batch_grads, max_norm, batch_l2=batch_l2)
    num_samples = _num_samples(optree.tree_leaves(cast(Any, clipped)))
    total = cast(ParamsT, optree.tree_map(lambda g: g.sum(0), cast(Any, clipped)))
    if noise_multiplier > 0:
        total = add_noise(total, max_norm, noise_multiplier, generator=generator)
    return cast(ParamsT, optree.tree_map(lambda t: t / num_samples, cast(Any, total)))


def _num_samples(leaves: list[Tensor]) -> int:
    """The leaves' shared, positive leading dimension ``N``.

    Args:
        leaves: Per-sample tensors ``[N, *p]``.

    Returns:
        ``N``.

    Raises:
        ValueError: if there are no leaves, one is a scalar, or their leading dimensions
            differ or are zero.
    """
    sizes = {g.shape[0] if g.dim() > 0 else 0 for g in leaves}
    if len(sizes) != 1 or 0 in sizes:
        raise ValueError(
            "expected per-sample gradients [N, *p] with one N > 0 for every leaf, got leading "
            f"dimensions {sorted(sizes)}"
        )
    return sizes.pop()


__all__ = [
    "Accountant",
    "DPOptimizer",
    "PoissonBatches",
    "add_noise",
    "clip_and_noise",
    "clip_per_sample",
    "clipped_grad",
    "epsilon",
    "noise_multiplier",
    "private_gradient",
]
