"""What the shim records of a forward pass of an extended model, and of its losses."""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from packfunc.compat.layout import SampleLayout
from packfunc.compat.watch import ForwardRecorder
from packfunc.losses import CLASS_LOSSES

_serials = itertools.count()


@dataclass
class LossCall:
    """An extended loss applied to (a rearrangement of) a recorded output.

    Attributes:
        module: The loss module.
        target: Its targets, as passed.
        layout: How its input rearranges the recorded output.
        task: The autograd graph task of the last backward pass through it.
    """

    module: nn.Module
    target: Any
    layout: SampleLayout
    task: int = -1

    def output(self, out: Tensor) -> Tensor:
        """The loss input in packfunc's per-sample form, from a model output ``out``."""
        return self.layout.output(out, isinstance(self.module, CLASS_LOSSES))

    def targets(self) -> Any:
        """The targets in the per-sample form of :meth:`output`."""
        probabilities = isinstance(self.module, CLASS_LOSSES) and self.target.is_floating_point()
        return self.layout.target(self.target, probabilities)


@dataclass(eq=False)
class ForwardRecord:
    """One forward pass of an extended model.

    Attributes:
        model: The outermost extended module that ran.
        args: Its positional inputs.
        kwargs: Its keyword inputs.
        recorder: What it watched of its own forward pass.
        output: Its output (dropped after the backward pass, unless the graph is retained).
        output_shape: The shape of its output.
        losses: Extended losses applied to its output.
        consumers: Records of extended modules that took its output as their only input
            (weak references, with the layout of that input).
        serial: Numbers the forward passes: the model's latest one has the highest.
    """

    model: nn.Module
    args: tuple
    kwargs: dict
    recorder: ForwardRecorder
    output: Tensor | None
    output_shape: torch.Size
    losses: list[LossCall] = field(default_factory=list)
    consumers: list[tuple[weakref.ref, SampleLayout]] = field(default_factory=list)
    serial: int = field(default_factory=lambda: next(_serials))


@dataclass(frozen=True)
class LossRoute:
    """How a recorded output reaches the loss of the running backward pass.

    Attributes:
        stages: Records of extended modules the output passes through first, each with
            the layout of its input (empty when the loss takes the output itself).
        loss: The loss call, or ``None`` if the pass goes through no extended loss.
        error: Why the loss cannot be used, if so.
    """

    stages: tuple[tuple[ForwardRecord, SampleLayout], ...] = ()
    loss: LossCall | None = None
    error: str | None = None
