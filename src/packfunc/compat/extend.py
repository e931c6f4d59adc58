"""``extend``: record what the extensions need during the forward pass.

Every extended module stores its inputs and output (``module.input0``,
``module.output``, as BackPACK does: only while gradients are enabled and
recording is not disabled; where the module defines such a name itself, the
value is only in :func:`~packfunc.compat.stored_io`). The outermost extended
module of a forward pass watches that pass
(:class:`~packfunc.compat.watch.ForwardRecorder`: the input and output of each
linear, convolution and embedding call) and registers, on its output's autograd
node, a hook that runs the active extensions when the backward pass reaches that
output. The hook gets the gradient of whatever loss is being differentiated
w.r.t. the model output, which is all first-order quantities need; the watched
calls let packfunc pull cotangents back through the user's own graph instead of
running the model again.

An extended loss function applied to the output — directly, through shape-only
ops (``f.view(-1, C)``), or through further extended modules chained in plain
code — is noted too; its own hook marks it when a backward pass goes through it,
so second-order extensions use the loss actually being differentiated.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable
from functools import partial
from typing import Any, cast

import optree
import torch
from torch import Tensor, nn
from torch.nn.modules.loss import _Loss

from packfunc.compat import context
from packfunc.compat._stored_io import forget_results, memory_cleanup, store_io
from packfunc.compat.elements import aliased_output, output_nodes
from packfunc.compat.layout import RECORD_KEY, SampleLayout, find_layout, node_metadata
from packfunc.compat.records import ForwardRecord, LossCall, LossRoute, ModelState
from packfunc.compat.run import NO_OP_MODULES, forget_inputs_and_outputs, run_extensions, trains
from packfunc.compat.watch import ForwardRecorder
from packfunc.engine.api import (
    NESTED_ENCODER_FIX,
    FunctionalMode,
    packfunc_passes,
    runs_nested_in_users_forward,
    serving_autocast,
)
from packfunc.functionalize import batch_size, clearer_error, is_compiled

_THREAD = threading.local()
"""Per thread (as PyTorch's modes are), the forward passes of extended modules running."""


_COMPILED_FORWARD = (
    "an extended model runs compiled (torch.compile(model), model.compile()) inside "
    "backpack(...): its forward is traced, and the shim records nothing there (the last "
    "step's results would stay). Run the extended model uncompiled in the backpack(...) "
    "steps, or use packfunc's functional API (pf.functional runs a compiled module's "
    "original eagerly)."
)


def _refusal_of_a_compiled_forward(module: nn.Module) -> None:
    """Refuse an extended forward that runs compiled inside ``backpack(...)``.

    Its hooks are traced with it: they recorded nothing, and the first-order extensions
    computed nothing and left the last step's results (0.13 off, silently); those of the
    block's extensions are removed. (Traced, the recorders' torch function modes stayed
    pushed for the process; the hooks do nothing there now.) Called where
    ``torch.compiler.is_compiling()``; not traced, so it runs (and raises) each time the
    compiled code runs.

    Args:
        module: The extended module whose forward runs.

    Raises:
        RuntimeError: inside ``backpack(...)``.
    """
    ctx = context.active()
    if ctx is not None and not context.in_own_pass():
        forget_results(module, [ext.savefield for ext in ctx.extensions])
        raise RuntimeError(_COMPILED_FORWARD)


_refuse_a_compiled_forward = cast(
    Callable[[nn.Module], None], torch.compiler.disable(_refusal_of_a_compiled_forward)
)
""":func:`_refusal_of_a_compiled_forward`, run eagerly from compiled code (not traced)."""


def _entered() -> list[int]:
    """The ids of the extended modules whose forward runs in this thread, outermost first.

    A module's forward hook undoes its pre-hook's entry only: a user's pre-hook that raises
    before the shim's runs leaves none to undo.
    """
    if not hasattr(_THREAD, "entered"):
        _THREAD.entered = []
    return cast(list[int], _THREAD.entered)


def _callers_inputs() -> list[tuple[tuple, dict] | None]:
    """The inputs the callers passed the outermost extended forwards running in this thread.

    As given, before the module's forward pre-hooks (``None``: a pre-hook ran before the
    shim's, see :func:`_inputs_as_called`).
    """
    if not hasattr(_THREAD, "callers_inputs"):
        _THREAD.callers_inputs = []
    return cast(list[tuple[tuple, dict] | None], _THREAD.callers_inputs)


def _recorders() -> list[ForwardRecorder | None]:
    """The recorders of the outermost extended forwards running in this thread (``None``: none)."""
    if not hasattr(_THREAD, "recorders"):
        _THREAD.recorders = []
    return cast(list[ForwardRecorder | None], _THREAD.recorders)


_LATEST: weakref.WeakKeyDictionary[nn.Module, weakref.ref[ForwardRecord]] = (
    weakref.WeakKeyDictionary()
)
"""Per extended model, its latest recorded forward pass (weakly, held outside the model: the
model pickles and deep-copies as it would without the shim).

Only that one keeps its output (and with it its autograd graph) alive: a model run
without a backward pass (validation with gradients enabled) holds one graph, as
BackPACK's ``module.output`` does; an earlier pass backpropagated later is
answered by packfunc's own forward pass on its recorded inputs."""
_RUN: weakref.WeakKeyDictionary[nn.Module, tuple[int, int]] = weakref.WeakKeyDictionary()
"""Per extended model, ``(graph task, serial)`` of the last extensions run."""


def extend(module: nn.Module, debug: bool = False, use_converter: bool = False) -> nn.Module:
    """Make a model or loss function ready for ``with backpack(...)``.

    Unlike BackPACK, any module works: residual connections, shared layers,
    in-place activations, custom modules and functional code inside ``forward``
    need no support and no conversion.

    Args:
        module: The model (extend the module that maps the inputs to the loss input)
            or the loss function.
        debug: Print the extended modules.
        use_converter: Accepted for compatibility; packfunc needs no model conversion.

    Returns:
        The same module, extended in place.

    Raises:
        ValueError: for a module compiled with ``torch.compile``.

    Example:
        >>> model = extend(torch.nn.Sequential(torch.nn.Linear(3, 2)))
        >>> model[0]._packfunc_extended
        True
    """
    if is_compiled(module):
        raise ValueError(
            "extend() got a module compiled with torch.compile, whose forward bypasses the "
            "hooks the shim records with. Extend and run the uncompiled module."
        )
    if isinstance(module, _Loss):
        if not getattr(module, "_packfunc_extended", False):
            setattr(module, "_packfunc_extended", True)  # noqa: B010 (not a declared attribute)
            module.register_forward_hook(_loss_forward)
        return module
    context.EXTENDED_MODELS.add(module)
    for sub in module.modules():
        if getattr(sub, "_packfunc_extended", False):
            continue
        setattr(sub, "_packfunc_extended", True)  # noqa: B010 (not a declared attribute)
        sub.register_forward_pre_hook(_enter, with_kwargs=True, prepend=True)
        handle = sub.register_forward_hook(_exit, with_kwargs=True, always_call=True)
        sub.__dict__[_EXIT_HOOK] = handle.id
        if debug:
            print(f"[packfunc.compat] extended {type(sub).__name__}")
    return module


def _recording() -> bool:
    """Inside ``backpack(...)`` with grad on, not in one of packfunc's own passes nor a backward.

    A forward inside a backward pass is a reentrant checkpoint's recomputation
    (``checkpoint(..., use_reentrant=True)``): its inner backward pass is no loss's, and
    the forward it repeats was recorded already.
    """
    modes = torch.overrides._get_current_function_mode_stack()
    own_pass = any(isinstance(mode, FunctionalMode) for mode in modes)
    in_backward = torch._C._current_graph_task_id() != -1
    return context.recording() and torch.is_grad_enabled() and not own_pass and not in_backward


_EXIT_HOOK = "_packfunc_exit_hook"
"""Key in an extended module's ``__dict__``: the id of the shim's forward hook there."""


def _last_of_the_forward_hooks(module: nn.Module) -> None:
    """Move the shim's forward hook behind the user's, also those registered after ``extend``.

    The output the shim records is then the one the model's caller gets (a hook may
    replace it: ``2 * out``), and the attributes the user's hooks set (``mod.output =
    out``) are theirs when the shim stores its own (it never overwrites them).

    Example:
        >>> layer = extend(torch.nn.Linear(2, 2))
        >>> handle = layer.register_forward_hook(lambda m, i, o: o)
        >>> _last_of_the_forward_hooks(layer)
        >>> list(layer._forward_hooks)[-1] == layer.__dict__[_EXIT_HOOK]
        True
    """
    hooks = cast(OrderedDict[int, Any], module._forward_hooks)  # (an OrderedDict in torch)
    own: int = module.__dict__.get(_EXIT_HOOK, -1)
    if own in hooks and next(reversed(hooks)) != own:
        hooks.move_to_end(own)


def _inputs_as_called(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """The inputs the caller passed ``module``, if the shim's pre-hook is the first to see them.

    packfunc's own passes call the model with them, its forward pre-hooks applied there
    once: the inputs its forward saw (``(2 * x,)`` from a pre-hook that scales them) would
    have them applied twice. The shim's pre-hook is registered first; one registered before
    it since (``prepend=True``) may have changed the inputs already: ``None``, and the shim's
    goes first from the next forward on. (A global pre-hook, ``register_module_forward_pre_hook``,
    runs before any module's: its inputs are taken as the caller's; one that changes them is
    applied twice, which the checks of packfunc's runs find unless it changes inner rows only.)

    Example:
        >>> layer = extend(torch.nn.Linear(2, 2))
        >>> inputs = ((torch.ones(1, 2),), {})
        >>> _inputs_as_called(layer, *inputs) is not None
        True
    """
    hooks = cast(OrderedDict[int, Any], module._forward_pre_hooks)
    if next(iter(hooks.values()), None) is _enter:
        return args, kwargs
    for key, hook in list(hooks.items()):
        if hook is _enter:
            hooks.move_to_end(key, last=False)
    return None


def _refuse_nested_fast_path(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Refuse a recorded forward of an encoder that would take PyTorch's nested-tensor path.

    The recording's torch function mode turns that path off: the padded positions the
    user's forward leaves zero would be computed, and the output would change under
    ``extend`` (:mod:`packfunc.engine.nested_encoders`).

    Raises:
        ValueError: for such a call, naming the fix.
    """
    if runs_nested_in_users_forward(module, args, kwargs):
        raise ValueError(NESTED_ENCODER_FIX)


def _enter(module: nn.Module, args: tuple, kwargs: dict) -> None:
    if torch.compiler.is_compiling():  # traced: record nothing (no mode may stay pushed)
        _refuse_a_compiled_forward(module)  # (runs in the compiled code, each call)
        return
    _last_of_the_forward_hooks(module)
    entered = _entered()
    entered.append(id(module))
    if len(entered) == 1:  # the outermost extended module: watch the whole pass
        recorder = None
        if _recording():
            # leaves in packfunc's own order (optree sorts dict keys), as the plan numbers them:
            # those that require gradients (a frozen one is a constant there, as in BackPACK)
            parameters: dict[str, Tensor] = {
                name: p for name, p in module.named_parameters() if p.requires_grad
            }
            leaves: list[Tensor] = optree.tree_leaves(parameters)  # type: ignore[arg-type]
            recorder = ForwardRecorder(leaves, (args, kwargs), tuple(module.buffers()))
            recorder.__enter__()
        _recorders().append(recorder)
        _callers_inputs().append(_inputs_as_called(module, args, kwargs))
    if _recording():  # (last: the always-called _exit undoes the above on a refusal)
        _refuse_nested_fast_path(module, args, kwargs)


def _exit(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    entered = _entered()
    if not entered or entered[-1] != id(module):  # its forward pre-hooks raised before _enter
        return None
    entered.pop()
    if _recording() and not isinstance(module, NO_OP_MODULES):
        store_io(module, args, output[0] if isinstance(output, tuple) else output)
    if entered:
        return None
    recorder, called = _recorders().pop(), _callers_inputs().pop()
    if recorder is None:
        _note_unrecorded(module, output)
        return None
    recorder.__exit__(None, None, None)
    if _reduced_without_parameters(module, output):
        return None
    # the record keeps the caller's inputs: packfunc's own passes apply the pre-hooks again
    args, kwargs = called if called is not None else (args, kwargs)
    if not isinstance(output, Tensor):
        return _record_outputs(module, args, kwargs, recorder, output, called is not None)
    if output.grad_fn is None:
        return None
    recorder.release(output)
    state = ModelState.of(module)
    record = ForwardRecord(
        module,
        args,
        kwargs,
        recorder,
        output,
        output.shape,
        output._version,
        state,
        output.output_nr,
        inputs_as_called=called is not None,
    )
    _note_latest(module, record)
    _link_to_producer(record)
    if recorder.usable:  # (else packfunc runs its own pass: nothing to take)
        sampled = [c for c in recorder.calls if c.carries_samples]
        record.taken.hook([c.edge for c in sampled if c.edge is not None])
    node_metadata(output.grad_fn)[RECORD_KEY] = record
    output.grad_fn.register_prehook(partial(_on_backward, record))
    return None


def _reduced_without_parameters(module: nn.Module, output: Any) -> bool:
    """A scalar of a module without trainable parameters: a loss of the user's own.

    It has no rows per sample to record and nothing to compute; recorded, it stood for the
    model whose output it reduces (BackPACK's first-order extensions take any loss).
    """
    reduced = isinstance(output, Tensor) and output.dim() == 0
    return reduced and not trains(module)


def _note_latest(module: nn.Module, record: ForwardRecord) -> None:
    """Make ``record`` the model's latest forward; the one before drops its output."""
    previous = _LATEST.get(module, _no_record)()
    if previous is not None:
        previous.let_output_go()
    _LATEST[module] = weakref.ref(record)


def _record_outputs(
    module: nn.Module,
    args: tuple,
    kwargs: dict,
    recorder: ForwardRecorder,
    output: Any,
    inputs_as_called: bool,
) -> Any:
    """Record a forward returning several tensors; the output, its tensors aliased.

    See :mod:`packfunc.compat.elements`. Without a tensor with a row per sample that
    requires grad, nothing is recorded (inside ``backpack(...)`` a warning says so).
    """
    try:
        n = batch_size(args[0] if len(args) == 1 else (args or kwargs))
    except ValueError:  # no tensor input, or leading sizes that disagree: no rows per sample
        n = -1
    state, serial = ModelState.of(module), ForwardRecord.next_serial()

    def make_record(tensor: Tensor, element: tuple[Any, int]) -> ForwardRecord:
        version = tensor._version
        return ForwardRecord(
            module, args, kwargs, recorder, tensor, tensor.shape, version, state,
            element=element, serial=serial, inputs_as_called=inputs_as_called,
        )  # fmt: skip

    aliased, records = aliased_output(output, n, make_record, _on_backward, _on_refusal)
    if not records:
        _warn_unrecorded(module, output)
        return None
    _note_latest(module, records[0])
    for record in records:
        _link_to_producer(record)
    return aliased


def _note_unrecorded(module: nn.Module, output: Any) -> None:
    """Hook an unrecorded forward's output: its backward in ``backpack(...)`` computes nothing.

    The hook deletes the earlier results of the block's extensions on ``module`` (a forward
    under ``disable()``; BackPACK raises in that backward pass, and without the hook the
    last step's ``grad_batch`` stayed, silently).
    """
    if torch._C._current_graph_task_id() != -1:  # a reentrant checkpoint's recomputation:
        return  # its inner backward pass is part of the recorded one
    # (a copy of an extended model, or a submodule called alone, is extended as well)
    if module in context.EXTENDED_MODELS or getattr(module, "_packfunc_extended", False):
        for node in output_nodes(output):
            node.register_prehook(partial(_on_unrecorded_backward, weakref.ref(module)))


def _on_unrecorded_backward(
    model: weakref.ref[nn.Module], grad_outputs: tuple[Tensor | None, ...]
) -> None:
    """Delete the active extensions' earlier results on ``model`` (see :func:`_note_unrecorded`)."""
    ctx, module = context.active(), model()
    if ctx is not None and not context.in_own_pass() and module is not None:
        forget_results(module, [ext.savefield for ext in ctx.extensions])


def _warn_unrecorded(module: nn.Module, output: Any) -> None:
    """Inside ``with backpack(...)``, say that an output without per-sample tensors is unused.

    The shim records the tensors of the outermost extended module's output that have a row
    per sample (see :mod:`packfunc.compat.elements`); a container of others (a loss or
    statistics over the batch, or tensors inside an object the pytree does not know) has
    none. Only for a module passed to :func:`extend` (a layer run alone by activation
    checkpointing's recomputation is not the model), and an output holding a tensor that
    requires grad.
    """
    if module not in context.EXTENDED_MODELS or not output_nodes(output):
        return
    ctx = context.active()
    if ctx is not None and ctx.extensions:
        warnings.warn(
            f"the extended {type(module).__name__} returned a {type(output).__name__} without "
            "a tensor with one row per sample (dim 0 the batch) among those that require "
            "grad: packfunc.compat records the output the loss takes, so no extension runs for "
            "this forward pass. Extend a module that returns that tensor.",
            UserWarning,
            stacklevel=3,
        )


def _no_record() -> None:
    """Stands in for a weak reference to a model's latest record before its first forward."""
    return None


def _link_to_producer(record: ForwardRecord) -> None:
    """Note ``record`` as a consumer of the recorded output its only input rearranges."""
    if len(record.args) != 1 or record.kwargs or not isinstance(record.args[0], Tensor):
        return
    found = _layout_of(record.args[0])
    if found is not None and found[1].positions == 1:
        producer, layout = found
        producer.consumers.append((weakref.ref(record), layout))


def _layout_of(tensor: Tensor) -> tuple[ForwardRecord, SampleLayout] | None:
    """The record whose output ``tensor`` rearranges, or ``None`` (also on mixing layouts)."""
    try:
        return find_layout(tensor)
    except ValueError:
        return None


def _loss_forward(module: nn.Module, args: tuple, output: Tensor) -> None:
    if torch.compiler.is_compiling() or not _recording() or len(args) < 2:
        return  # (traced: nothing is recorded, as for a model's forward)
    store_io(module, args[:2], output)
    if not isinstance(args[0], Tensor) or output.grad_fn is None:
        return
    found = _layout_of(args[0])
    call = None
    if found is not None:
        record, layout = found
        call = LossCall(module, args[1], layout)
        record.losses.append(call)
    output.grad_fn.register_prehook(partial(_on_loss_backward, module, call))


def _on_loss_backward(
    module: nn.Module, call: LossCall | None, grad_outputs: tuple[Tensor | None, ...]
) -> None:
    """Mark ``call`` as part of the running backward pass; warn if the loss was changed.

    Second-order extensions use the loss function's own curvature: a backward pass
    from a scaled or otherwise changed loss value gets a warning, as in BackPACK
    (also when no extended model produced the loss input).
    """
    grad = grad_outputs[0]
    if call is not None:
        call.task = torch._C._current_graph_task_id()
        call.output_gradient = None if grad is None else grad.detach()
    ctx = context.active()
    if ctx is None or context.in_own_pass():
        return
    second_order = any(ext.job().second_order for ext in ctx.extensions)
    if second_order and grad is not None and not bool((grad == 1).all()):
        warnings.warn(
            f"The output of {module} seems to have been modified. Second-order extensions "
            "use the loss function's own curvature; call backward() on the output of the "
            "extended loss module itself.",
            UserWarning,
            stacklevel=2,
        )


def _refuse_differentiated_gradients(record: ForwardRecord, task: int) -> None:
    """Refuse a backward pass of a loss made of the model's gradient (double backprop).

    A pullback with ``create_graph=True`` through the model (a gradient penalty:
    ``autograd.grad(loss, X, create_graph=True)``) makes a gradient that reaches the
    parameters through the model's backward, not its output: a later backward pass of a loss
    holding it brings the extensions only the part through the output (per-sample gradients
    were off by 15 % and no longer summed to ``.grad``).

    Args:
        record: The forward pass being pulled back.
        task: The running backward pass.

    Raises:
        RuntimeError: in a later backward pass than the one with ``create_graph=True``.
    """
    if torch.is_grad_enabled():  # this backward pass has create_graph=True
        record.graph_task = task
    elif record.graph_task is not None and record.graph_task != task:
        raise RuntimeError(
            "this backward pass differentiates a gradient of the model taken with "
            "create_graph=True (a gradient penalty, double backprop): the parameters get "
            "gradient through the model's backward as well as its output, which the "
            "extensions do not follow. Compute that loss's per-sample quantities with a loop, "
            "or take the penalty outside with backpack(...)."
        )


def _on_backward(record: ForwardRecord, grad_outputs: tuple[Tensor, ...]) -> None:
    if context.in_own_pass():  # packfunc's own pass through the user's graph
        return
    ctx = context.active()
    if ctx is None or not ctx.extensions:  # a plain backward: drop what was stored
        forget_inputs_and_outputs(record, None)
        return
    task = torch._C._current_graph_task_id()
    try:
        _refuse_differentiated_gradients(record, task)
        _refuse_mixed_forwards(record, ctx, task)
        route = _route_to_loss(record, task)
        # packfunc's own passes must not record or trigger, and put back what they set
        # (the forward's autocast, for packfunc's own forwards only: not the backward's)
        with context.own_pass(), packfunc_passes(), serving_autocast(record.autocast):
            run_extensions(ctx, record, _output_gradient(record, grad_outputs), route)
    except RuntimeError as error:
        _forget_results_of_the_pass(ctx, record, task)
        clearer = clearer_error(error, (record.args, record.kwargs))
        if clearer is None:
            raise
        raise clearer from error
    except BaseException:
        _forget_results_of_the_pass(ctx, record, task)
        raise


def _on_refusal(record: ForwardRecord) -> None:
    """A refusal of the backward pass through ``record``'s output outside :func:`_on_backward`."""
    ctx = context.active()
    if ctx is not None:
        _forget_results_of_the_pass(ctx, record, torch._C._current_graph_task_id())


def _forget_results_of_the_pass(ctx: context.Context, record: ForwardRecord, task: int) -> None:
    """Remove the block's results from every extended model a refused backward pass concerns.

    A refusal stops the backward pass: the models it had not reached yet (whose forward
    is still pending) would keep the last step's values, and those it had reached hold
    half a step's; none is left. The refused model's and its losses' stored inputs and
    outputs (``input0``, ``output``) go as after a backward pass that ran (unless the
    block retains the graph).

    Args:
        ctx: The active ``backpack`` context.
        record: The forward pass whose extensions were refused.
        task: The refused backward pass.
    """
    savefields = [ext.savefield for ext in ctx.extensions]
    forget_results(record.model, savefields)
    if not ctx.retain_graph:
        forget_inputs_and_outputs(record, None)
        for call in record.losses:
            memory_cleanup(call.module)
    for other, latest in list(_LATEST.items()):
        pending, ran = latest(), _RUN.get(other)
        if (pending is not None and pending.output is not None) or (ran and ran[0] == task):
            forget_results(other, savefields)


def _output_gradient(record: ForwardRecord, grad_outputs: tuple[Tensor | None, ...]) -> Tensor:
    """``∂L/∂output`` among the gradients of the outputs of the output's autograd node.

    A model returning ``h.chunk(2, 1)[1]`` has an output that is the second of its node's.

    Raises:
        ValueError: if the backward pass reaches that node through another of its outputs
            only (a tensor of the forward kept aside, not the output).
    """
    found = grad_outputs[record.output_nr]
    if found is None:
        raise ValueError(
            f"this backward pass goes through the forward pass of the extended "
            f"{type(record.model).__name__} by another tensor than its output (one the "
            "forward kept aside): packfunc.compat computes from the gradient of the output. "
            "Return the tensor the loss takes from the extended model."
        )
    return found


def _refuse_mixed_forwards(record: ForwardRecord, ctx: context.Context, task: int) -> None:
    """Refuse what one record per module cannot answer when a model ran several times.

    BackPACK keeps one forward pass per module (``module.input0``/``output`` are the
    last one's). Backpropagating the latest forward's output, or an earlier one's
    with the built-in extensions, is answered from that forward's own record. Two
    forward passes in one backward pass would each write every result (the last
    write would win), and an earlier pass with ``extension_hook`` or custom module
    extensions would show them the later pass's ``input0``/``output``: both refused.

    A refusal removes the results this backward pass stored on the model (the other
    forward's, half of its loss): :func:`_on_backward` does, for every refusal.

    Raises:
        ValueError: naming what to do instead.
    """
    model = record.model
    ran = _RUN.get(model)
    _RUN[model] = (task, record.serial)
    name = type(model).__name__
    if ran is not None and ran[0] == task and ran[1] != record.serial:
        raise ValueError(
            f"this backward pass goes through two forward passes of the same extended {name}; "
            "BackPACK's extensions keep one forward pass per module, so per-sample results of "
            "both cannot be stored. Call backward on each forward's loss separately, or run "
            "the model once on the concatenated inputs."
        )
    hooked = ctx.extension_hook is not None or any(
        getattr(ext, "module_extensions", None) for ext in ctx.extensions
    )
    latest = _LATEST.get(model, _no_record)()
    if hooked and latest is not None and latest.serial != record.serial:
        raise ValueError(
            f"this backward pass goes through an earlier forward pass of the extended {name} "
            "than its latest one: module.input0/output hold the latest forward, which "
            "extension_hook and custom module extensions would read. Backpropagate right "
            "after each forward (or backpropagate the latest forward's output)."
        )


def _route_to_loss(record: ForwardRecord, task: int) -> LossRoute:
    """Find the extended loss the running backward goes through, from ``record``'s output."""
    routes = _routes(record, task, ())
    if len(routes) > 1:
        return LossRoute(
            error=f"the backward pass goes through {len(routes)} extended losses "
            "applied to this model's output; second-order extensions need "
            "exactly one (call backward on each loss separately)."
        )
    if not routes:
        return LossRoute()
    return routes[0]


def _routes(
    record: ForwardRecord, task: int, stages: tuple[tuple[ForwardRecord, SampleLayout], ...]
) -> list[LossRoute]:
    found = [LossRoute(stages, call) for call in record.losses if call.task == task]
    for ref, layout in record.consumers:
        consumer = ref()
        if consumer is not None:
            found += _routes(consumer, task, (*stages, (consumer, layout)))
    return found
