"""What the shim records of a forward pass of an extended model, and of its losses."""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field
from typing import Any

import optree
import torch
from torch import Tensor, nn
from torch._C._functorch import is_functorch_wrapped_tensor

from packfunc.compat.layout import SampleLayout
from packfunc.compat.site_cotangents import TakenCotangents
from packfunc.compat.watch import ForwardRecorder
from packfunc.engine.api import autocast_in_force, difference_beyond_rounding, narrowest
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
        output_gradient: The gradient that backward pass brought to the loss value (1 for
            ``loss.backward()``, ``s`` for a scaled loss), detached.
    """

    module: nn.Module
    target: Any
    layout: SampleLayout
    task: int = -1
    output_gradient: Tensor | None = None

    def output(self, out: Tensor) -> Tensor:
        """The loss input in packfunc's per-sample form, from a model output ``out``."""
        return self.layout.output(out, isinstance(self.module, CLASS_LOSSES))

    def targets(self) -> Any:
        """The targets in the per-sample form of :meth:`output`."""
        probabilities = isinstance(self.module, CLASS_LOSSES) and self.target.is_floating_point()
        return self.layout.target(self.target, probabilities)


@dataclass(eq=False)
class ModelState:
    """What running a model again depends on besides its inputs: its tensors and modes.

    Taken at the end of a forward pass. A backward pass that runs the model again
    (packfunc's own pass, Kronecker factors, block products) compares it first: a
    parameter or buffer changed in place (``optimizer.step()``) or replaced, or a module
    switched between training and evaluation, would give values of another forward pass.
    An assignment to ``.data`` (``w.data = w.data + 1``, ``model.double()``) is seen by
    its new memory; writes in place through ``.data`` bump no version and are not seen.

    Attributes:
        tensors: Qualified name -> ``(id, version, data pointer)`` of every parameter and
            buffer.
        training: Qualified name -> training flag of every module.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout())
        >>> state = ModelState.of(model)
        >>> state.change(model) is None
        True
        >>> _ = model[1].eval()
        >>> state.change(model)
        "module '1' (Dropout) was switched to evaluation mode"
    """

    tensors: dict[str, tuple[int, int, int]]
    training: dict[str, bool]

    @staticmethod
    def of(model: nn.Module) -> ModelState:
        """The state of ``model`` now.

        Args:
            model: A module.

        Returns:
            Its :class:`ModelState`.
        """
        named = itertools.chain(
            model.named_parameters(remove_duplicate=False),
            model.named_buffers(remove_duplicate=False),
        )
        tensors = {name: (id(t), t._version, _memory(t)) for name, t in named}
        return ModelState(tensors, {name: m.training for name, m in model.named_modules()})

    def check(self, model: nn.Module, rerun: str) -> None:
        """Refuse to run ``model`` again if it changed since this state.

        Args:
            model: The module this state was taken of.
            rerun: What would run it, for the message.

        Raises:
            ValueError: naming the change and what to do instead.
        """
        change = self.change(model)
        if change is not None:
            raise ValueError(
                f"{change} since the forward pass of the extended {type(model).__name__}, "
                f"and {rerun} runs the model again: its values would not be those of the "
                "forward pass whose loss is backpropagated. Backpropagate before changing the "
                "model (before optimizer.step(), model.eval() or model.train())."
            )

    def change(self, model: nn.Module) -> str | None:
        """What changed in ``model`` since this state, or ``None``.

        Args:
            model: The module this state was taken of.

        Returns:
            The first change found, as a clause for a message.
        """
        now = ModelState.of(model)
        for name, (identity, version, pointer) in self.tensors.items():
            found = now.tensors.get(name)
            if found is None or found[0] != identity:
                return f"{name!r} was replaced"
            if found[1] != version:
                return f"{name!r} was changed in place"
            if found[2] != pointer:
                return f"{name!r} was given new values through .data"
        for name, training in self.training.items():
            if now.training.get(name, training) != training:
                what = f"module {name!r} ({type(model.get_submodule(name)).__name__})"
                mode = "training" if not training else "evaluation"
                return f"{what if name else 'the model'} was switched to {mode} mode"
        return None


def _memory(tensor: Tensor) -> int:
    """Where ``tensor``'s values lie (0 for a tensor without storage, a functorch wrapper's).

    Example:
        >>> inside = torch.func.vmap(lambda t: t + _memory(t))(torch.zeros(2))
        >>> inside.tolist(), _memory(torch.zeros(0)) == torch.zeros(0).data_ptr()
        ([0.0, 0.0], True)
    """
    return 0 if is_functorch_wrapped_tensor(tensor) else tensor.data_ptr()


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
        output_version: The output's version counter at the end of the forward pass.
        state: The model's parameters, buffers and modes at the end of the forward pass.
        output_nr: Which output of its autograd node the output is (``tensor.output_nr``: a
            chunk of ``h.chunk(2)`` is the second output of one node).
        element: For a model returning several tensors, ``(structure, position)`` of this
            record's one (see :mod:`packfunc.compat.elements`); ``None``: the output itself.
        losses: Extended losses applied to its output.
        consumers: Records of extended modules that took its output as their only input
            (weak references, with the layout of that input).
        serial: Numbers the forward passes: the model's latest one has the highest.
        kept_rows: The output's first and last rows, kept where the output is let go (a
            later forward of the model): what packfunc's own pass must compute again.
        kept_loss_rows: Those of each loss input (by ``id`` of its :class:`LossCall`): a
            second-order pass computes the loss input.
        inputs_as_called: Whether ``args`` and ``kwargs`` are the caller's, before the
            model's forward pre-hooks (``False``: one registered with ``prepend=True`` after
            ``extend`` ran before the shim's; they are those the forward saw, and the
            backward pass is refused).
    """

    model: nn.Module
    args: tuple
    kwargs: dict
    recorder: ForwardRecorder
    output: Tensor | None
    output_shape: torch.Size
    output_version: int
    state: ModelState
    output_nr: int = 0
    element: tuple[Any, int] | None = None
    losses: list[LossCall] = field(default_factory=list)
    consumers: list[tuple[weakref.ref, SampleLayout]] = field(default_factory=list)
    serial: int = field(default_factory=lambda: next(_serials))
    kept_rows: tuple[Tensor, Tensor] | None = None
    kept_loss_rows: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)
    inputs_as_called: bool = True
    graph_task: int | None = None
    """The backward pass (its graph task) that pulled the output back with ``create_graph=True``
    (a gradient penalty's ``autograd.grad``), if one did: its gradient is differentiable."""
    autocast: tuple[tuple[str, torch.dtype], ...] = field(
        default_factory=lambda: autocast_in_force()
    )
    """The autocast the forward ran under: packfunc's own passes for it run under it too,
    wherever the backward pass runs."""
    taken: TakenCotangents = field(default_factory=TakenCotangents, repr=False)
    """What the user's backward passes bring its calls' outputs (see
    :class:`~packfunc.compat.site_cotangents.TakenCotangents`)."""
    input_versions: list[tuple[Tensor, int]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        """Note the inputs' versions: an input changed in place since is refused on a re-run."""
        inputs: list[Any] = optree.tree_leaves((self.args, self.kwargs))  # type: ignore[arg-type]
        self.input_versions = [
            (t, t._version) for t in inputs if isinstance(t, Tensor) and not t.is_inference()
        ]  # (an inference tensor keeps no version, and cannot be changed in place outside)

    @property
    def rounding(self) -> torch.dtype | None:
        """The narrowest dtype autocast computed the forward in (``None``: none in force).

        Its cotangents agree to that dtype's rounding only.
        """
        dtypes = [dtype for _, dtype in self.autocast]
        return narrowest(*dtypes) if dtypes else None

    @staticmethod
    def next_serial() -> int:
        """A serial for records of one forward pass (a model returning several tensors)."""
        return next(_serials)

    def check_unchanged(self, rerun: str) -> None:
        """Refuse to run the model again if it changed since this forward pass.

        Args:
            rerun: What would run it, for the message.

        Raises:
            ValueError: naming the change and what to do instead.
        """
        self.state.check(self.model, rerun)
        if any(t._version != version for t, version in self.input_versions):
            raise ValueError(
                f"an input of the extended {type(self.model).__name__} was changed in place "
                f"since its forward pass (a reused input buffer), and {rerun} runs the model "
                "again on it: its values would not be those of the forward pass whose loss is "
                "backpropagated. Backpropagate before changing the input, or pass a new tensor."
            )

    def let_output_go(self) -> None:
        """Drop the output (and its graph), keeping the rows to check against.

        Its first and last rows, and those of each loss input made of it.
        """
        if self.output is not None:
            rows = self.output.detach()
            self.kept_rows = _ends(rows)
            self.kept_loss_rows = {id(loss): _ends(loss.output(rows)) for loss in self.losses}
        self.output = None

    def check_same_output(self, output: Tensor, loss: LossCall | None) -> None:
        """Refuse packfunc's own pass if its output is not this forward pass's, to rounding.

        Its first and last rows are compared (the output of a model whose forward updates
        Python state, a call counter scaling it, would differ).

        Args:
            output: The own pass's output.
            loss: The loss whose input the own pass computes (a rearrangement of this
                forward's output), or ``None``: the output itself.

        Raises:
            ValueError: naming the difference and the likely cause.
        """
        if self.output is not None:
            rows = _ends(loss.output(self.output) if loss is not None else self.output)
        elif loss is None and self.kept_rows is not None:
            rows = self.kept_rows
        elif loss is not None and id(loss) in self.kept_loss_rows:
            rows = self.kept_loss_rows[id(loss)]
        else:  # (a loss applied after the output was let go: nothing was kept for it)
            return
        for own, theirs in zip((output[:1], output[-1:]), rows):
            difference = difference_beyond_rounding(own, theirs)
            if difference is not None:
                raise ValueError(
                    f"packfunc's own pass of the extended {type(self.model).__name__} (your "
                    "forward pass cannot be reused here) computed another output than your "
                    f"forward pass: it {difference}. The forward depends on more than its "
                    "inputs and parameters (Python state it updates, such as a call counter, "
                    "or a change since it ran), so per-sample values would not be those of "
                    "your forward. Make the forward depend on its inputs and parameters only."
                )

    def check_output_unchanged(self) -> None:
        """Refuse a forward pass whose output was changed in place after it ended.

        Raises:
            ValueError: naming the fix (an out-of-place change).
        """
        if self.output is not None and self.output._version != self.output_version:
            raise ValueError(
                f"the output of the extended {type(self.model).__name__} was changed in place "
                "after its forward pass (out.add_(...), out.clamp_(...), out[...] = ...): "
                "packfunc.compat computes from that forward pass, whose output it no longer "
                "is. Change it out of place (out = out + 1), or inside the model."
            )


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


def _ends(rows: Tensor) -> tuple[Tensor, Tensor]:
    """The first and last rows of ``rows``, copied (the tensor itself may go).

    Example:
        >>> [r.tolist() for r in _ends(torch.arange(3.0)[:, None])]
        [[[0.0]], [[2.0]]]
    """
    return rows[:1].detach().clone(), rows[-1:].detach().clone()
