"""``extend``: record what the extensions need during the forward pass.

Every extended module stores its input and output (``module.input0``,
``module.output``, as BackPACK does). The outermost extended module of a
forward pass watches that pass (:class:`~packfunc.engine.taps.ForwardRecorder`:
the input and output of each linear, convolution and embedding call) and
registers, on its output's ``grad_fn``, a hook that runs the active extensions
when the backward pass reaches that output. The hook gets the gradient of
whatever loss is being differentiated w.r.t. the model output, which is all
first-order quantities need; the watched calls let packfunc pull cotangents
back through the user's own graph instead of running the model again. An
extended loss function marks its input, so second-order extensions also know
the loss and the targets.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

import optree
from torch import Tensor, nn
from torch.nn.modules.loss import _Loss

from packfunc.compat import context
from packfunc.compat.run import run_extensions
from packfunc.engine.taps import ForwardRecorder

_depth: list[int] = [0]
_recorders: list[ForwardRecorder] = []


@dataclass
class ForwardRecord:
    """One forward pass of an extended model.

    Attributes:
        model: The outermost extended module that ran.
        args: Its positional inputs.
        kwargs: Its keyword inputs.
        recorder: What it watched of its own forward pass.
        loss: ``(loss module, target)`` once an extended loss consumed the output.
    """

    model: nn.Module
    args: tuple
    kwargs: dict = field(default_factory=dict)
    recorder: ForwardRecorder | None = None
    loss: tuple[nn.Module, Any] | None = None


def extend(module: nn.Module, debug: bool = False, use_converter: bool = False) -> nn.Module:
    """Make a model or loss function ready for ``with backpack(...)``.

    Unlike BackPACK, any module works: residual connections, shared layers,
    custom modules and functional code inside ``forward`` need no support.

    Args:
        module: The model (extend the module that maps the inputs to the loss input)
            or the loss function.
        debug: Print the extended modules.
        use_converter: Accepted for compatibility; packfunc needs no model conversion.

    Returns:
        The same module, extended in place.

    Example:
        >>> model = extend(torch.nn.Sequential(torch.nn.Linear(3, 2)))
        >>> model[0]._packfunc_extended
        True
    """
    if isinstance(module, _Loss):
        if not getattr(module, "_packfunc_extended", False):
            module._packfunc_extended = True
            module.register_forward_hook(_loss_forward)
        return module
    for sub in module.modules():
        if getattr(sub, "_packfunc_extended", False):
            continue
        sub._packfunc_extended = True
        sub.register_forward_pre_hook(_enter, with_kwargs=True)
        sub.register_forward_hook(_exit, with_kwargs=True, always_call=True)
        if debug:
            print(f"[packfunc.compat] extended {type(sub).__name__}")
    return module


def _enter(module: nn.Module, args: tuple, kwargs: dict) -> None:
    if not context.recording():
        return
    _depth[0] += 1
    if _depth[0] == 1:  # the outermost extended module: watch the whole pass
        recorder = ForwardRecorder(optree.tree_leaves(dict(module.named_parameters())))
        recorder.__enter__()
        _recorders.append(recorder)


def _exit(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    if not context.recording():
        return
    _depth[0] -= 1
    module.input0 = args[0] if args else None
    module.output = output
    if _depth[0]:
        return
    recorder = _recorders.pop()
    recorder.__exit__(None, None, None)
    if not isinstance(output, Tensor) or output.grad_fn is None:
        return
    recorder.release(output)
    record = ForwardRecord(module, args, kwargs, recorder)
    output._packfunc_record = record
    output.grad_fn.register_prehook(partial(_on_backward, record))


def _loss_forward(module: nn.Module, args: tuple, output: Tensor) -> None:
    if not context.recording() or len(args) < 2:
        return
    module.input0, module.output = args[0], output
    record = getattr(args[0], "_packfunc_record", None)
    if record is not None:
        record.loss = (module, args[1])


def _on_backward(record: ForwardRecord, grad_outputs: tuple[Tensor, ...]) -> None:
    ctx = context.active()
    if ctx is not None and ctx.extensions and context.recording():
        with context.disable():  # packfunc's own passes must not record or trigger
            run_extensions(ctx, record, grad_outputs[0])
