"""One forward, one randomness: which calls draw random numbers, and which runs must not.

Every quantity comes from the forward pass whose loss it reports. The batch pass
*is* that forward (in the shim, the user's own forward is), so whatever it draws
(dropout masks in training mode) is part of the model being differentiated, and
every statistic the rules compute from its recording is consistent with it.

Other runs of the model are of two kinds:

* probes (discovery, the piecewise-linearity test, the chain trace of KFRA): their
  values are never used, so they run on a private copy of the random generators
  (:func:`private_generators`) and leave the user's streams where they were;
* re-runs whose values are used (the whole-model path's per-sample ``vmap``, the
  Hessian's second derivatives, the shim's own pass when the user's forward cannot be
  reused): they would draw other masks, so a model that draws random numbers is
  refused there (:func:`refuse_rerun`), naming the call and the fix.

A batch pass that stops part-way (its calls were not the plan's: the aliased pass of a model
that reaches a parameter another way, or a cached plan the code no longer follows) is run
again from the random numbers it began with (:meth:`GeneratorMark.rewind`): its values are
those of one forward pass, and the user's streams advance by one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from packfunc.engine.modes import dropout_rate
from packfunc.engine.recurrent import RECURRENT_OPS

RANDOM_FUNCTIONS = frozenset(
    {
        torch.rand,
        torch.randn,
        torch.randint,
        torch.rand_like,
        torch.randn_like,
        torch.randint_like,
        torch.randperm,
        torch.bernoulli,
        torch.multinomial,
        torch.normal,
        torch.poisson,
        torch.rrelu,
        Tensor.bernoulli,
        Tensor.bernoulli_,
        Tensor.uniform_,
        Tensor.normal_,
        Tensor.exponential_,
        Tensor.geometric_,
        Tensor.cauchy_,
        Tensor.log_normal_,
        Tensor.random_,
        Tensor.multinomial,
        F.gumbel_softmax,
    }
)
"""Calls that always draw from a random generator."""

DEFAULT_GENERATOR_DRAW = "a call that draws from torch's default random generator"
"""How a plan describes a forward seen to move the default generator by no call it knows."""


class RandomModelError(ValueError):
    """A model that draws random numbers would be run again where the values must match."""


def random_call(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> str | None:
    """Describe a call that draws random numbers, or return ``None``.

    Dropout (functions, builtins, attention's ``dropout_p``) in training mode, recurrent
    ops with inter-layer dropout in training mode, ``F.rrelu`` in training mode and the
    sampling functions of :data:`RANDOM_FUNCTIONS`.

    Args:
        func: The function called.
        args: Its positional arguments.
        kwargs: Its keyword arguments.

    Returns:
        A short description such as ``"dropout(p=0.1)"``.

    Example:
        >>> random_call(F.dropout, (torch.ones(2), 0.3), {}), random_call(F.relu, (), {})
        ('dropout(p=0.3)', None)
    """
    name = getattr(func, "__name__", repr(func))
    p = dropout_rate(func, args, kwargs)
    if p:
        return f"{name}(p={p:g})"
    if func in RECURRENT_OPS:
        p, train = _recurrent_dropout(args, kwargs)
        return f"{name} with dropout={p:g}" if p and train else None
    if func is F.rrelu:
        return name if kwargs.get("training", args[3] if len(args) > 3 else False) else None
    return name if func in RANDOM_FUNCTIONS else None


def _recurrent_dropout(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[float, bool]:
    """``(dropout, train)`` of a fused recurrent op: its first float argument and the next."""
    if "dropout" in kwargs:
        return float(kwargs["dropout"]), bool(kwargs.get("train", False))
    for i, value in enumerate(args):
        if isinstance(value, float):
            return value, bool(args[i + 1]) if i + 1 < len(args) else False
    return 0.0, False


def _cuda_devices(tensors: list[Tensor]) -> list[int]:
    """The indices of the CUDA devices ``tensors`` are on, sorted."""
    return sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})


def _generator_states(devices: list[int]) -> list[Tensor]:
    """The states of the CPU generator and of the default generators of CUDA ``devices``."""
    return [torch.get_rng_state()] + [torch.cuda.get_rng_state(d) for d in devices]


@contextlib.contextmanager
def private_generators(tensors: list[Tensor]) -> Iterator[Callable[[], bool]]:
    """Run a probe on a copy of the default random generators; theirs stay as they were.

    Args:
        tensors: Tensors the probe computes with (their CUDA devices' generators are
            copied too).

    Yields:
        A function telling whether the probe drew random numbers so far.

    Example:
        >>> state = torch.get_rng_state()
        >>> with private_generators([]) as drew:
        ...     _ = torch.rand(3)
        ...     drew()
        True
        >>> torch.equal(state, torch.get_rng_state())
        True
    """
    devices = _cuda_devices(tensors)
    with torch.random.fork_rng(devices=devices):
        before = _generator_states(devices)

        def drew() -> bool:
            after = _generator_states(devices)
            return any(not torch.equal(a, b) for a, b in zip(before, after))

        yield drew


class GeneratorMark:
    """The default random generators' states at one point: put them back, or see them move.

    A forward pass that stopped part-way (the calls were not its plan's) runs again from
    the same random numbers (:meth:`rewind`): the pass whose values are used draws what
    one forward pass draws, and the user's streams advance by one forward pass, not two.
    A pass on a kept plan that drew random numbers where discovery's drew none
    (:meth:`moved`: dropout switched on since) makes that plan random.

    Args:
        tensors: Tensors the pass computes with (their CUDA devices' generators too).

    Example:
        >>> mark = GeneratorMark([])
        >>> first = torch.rand(2)
        >>> mark.moved()
        True
        >>> mark.rewind()
        >>> torch.equal(torch.rand(2), first)
        True
    """

    def __init__(self, tensors: list[Tensor]):
        self.devices = _cuda_devices(tensors)
        self.states = _generator_states(self.devices)

    def rewind(self) -> None:
        """Put the generators back where they were."""
        cpu, *cuda = self.states
        torch.set_rng_state(cpu)
        for device, state in zip(self.devices, cuda, strict=True):
            torch.cuda.set_rng_state(state, device)

    def moved(self) -> bool:
        """Whether a generator drew since."""
        now = _generator_states(self.devices)
        return any(not torch.equal(a, b) for a, b in zip(self.states, now, strict=True))


def refuse_rerun(random: str | None, rerun: str) -> None:
    """Refuse to run a model that draws random numbers again where its values are used.

    Args:
        random: What the model draws (see :func:`random_call`), ``None`` if nothing.
        rerun: What would run it again, e.g. ``"the whole-model path"``.

    Raises:
        RandomModelError: if ``random`` is set.

    Example:
        >>> refuse_rerun(None, "the whole-model path")
    """
    if random is not None:
        raise random_model_error(random, rerun)


def random_model_error(random: str, rerun: str) -> RandomModelError:
    """The error :func:`refuse_rerun` raises, naming the random call and the fix.

    Args:
        random: What the model draws (see :func:`random_call`).
        rerun: What would run it again.

    Returns:
        The error, to raise.

    Example:
        >>> str(random_model_error("dropout(p=0.1)", "KFRA's chain"))[:60]
        'the model draws random numbers in its forward pass (dropout('
    """
    return RandomModelError(
        f"the model draws random numbers in its forward pass ({random}), and {rerun} runs it "
        "again, which would draw other values than the forward pass whose loss is reported. "
        "Call model.eval() (or set the dropout probability to 0) before computing this, or "
        "request only parameters on op-local paths (pf.explain shows each parameter's path)."
    )


def check_generator(generator: object, where: str) -> None:
    """Refuse a ``generator=`` that is not a ``torch.Generator`` (a seed, say), naming the fix.

    Given a seed, torch's samplers failed with their own argument errors, some only at the
    first draw (an optimizer's first step) and some with an ``AttributeError``.

    Args:
        generator: The argument, ``None`` or a ``torch.Generator``.
        where: What it was given to, as the message names it (``"kfac()"``).

    Raises:
        TypeError: for anything else.

    Example:
        >>> check_generator(torch.Generator().manual_seed(0), "kfac()")
        >>> check_generator(3, "kfac()")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        TypeError: kfac(): generator= takes a torch.Generator (or None), not the int 3; ...
    """
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(
            f"{where}: generator= takes a torch.Generator (or None), not the "
            f"{type(generator).__name__} {generator!r}; for a seed, pass "
            f"torch.Generator().manual_seed({generator!r})."
        )


__all__ = [
    "RANDOM_FUNCTIONS",
    "RandomModelError",
    "check_generator",
    "private_generators",
    "random_call",
    "random_model_error",
    "refuse_rerun",
]
