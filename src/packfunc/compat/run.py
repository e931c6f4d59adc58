"""Run the active extensions for one recorded forward pass, with the functional core.

First-order extensions use the gradient the backward pass itself brings to the
model output (so any loss works, extended or not); second-order ones need the
extended loss and its targets. Results land on ``param.<savefield>``.
"""

from __future__ import annotations

import copy
import warnings
import weakref
from collections.abc import Callable, Hashable, Iterator
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.utils.weak import WeakIdKeyDictionary

import packfunc as pf
from packfunc.compat import context
from packfunc.compat._stored_io import (
    forget_result,
    forget_results,
    memory_cleanup,
    store_result,
    stored_io,
)
from packfunc.compat.elements import select_element
from packfunc.compat.extensions.backprop_extension import BackpropExtension, Job
from packfunc.compat.layout import SampleLayout
from packfunc.compat.records import ForwardRecord, LossCall, LossRoute
from packfunc.compat.site_cotangents import SiteCotangents, UsersCotangents, first_order_only
from packfunc.engine.api import (
    BatchPass,
    BatchRecord,
    Plan,
    RowsNotAloneError,
    cached_discover,
    check_rerun,
    difference_beyond_rounding,
    in_out_weights_of,
    packfunc_passes,
    refuse_differentiation,
    serving_autocast,
)
from packfunc.evaluation import evaluate
from packfunc.functionalize import (
    EMPTY_BATCH,
    clearer_error,
    flatten_params,
    has_packed_sequences,
    module_of,
    packing,
    padded_sequences,
    weakly_bound,
    wraps_module_of,
)
from packfunc.kronecker_factors import factors_from_pass
from packfunc.losses import CLASS_LOSSES, GivenOutputGradient, hessian_factors
from packfunc.specs import Cotangents, Family
from packfunc.types import ModelFn

if TYPE_CHECKING:
    from packfunc.compat.context import Context

NO_OP_MODULES: tuple[type[nn.Module], ...] = (
    nn.Sequential,
    nn.ModuleList,
    nn.ModuleDict,
    torch.fx.GraphModule,
)
"""Containers that compute nothing themselves: no stored IO, no ``extension_hook`` call."""


_RERUN = (
    "packfunc.compat computed it in a pass of its own (the forward this backward pass goes "
    "through could not be reused: another forward of the model since, a second backward "
    "pass of it, extended models chained, a recurrent or attention layer, or other calls "
    "packfunc runs differently), on the parameters "
    "detached: a gradient through it would be missing, not refused. Differentiate the "
    "results of a backward pass that follows its forward directly, or compute it with "
    "pf.{name} on pf.functional(model)'s function and parameters, which follows their "
    "gradients."
)
_MODULE_EXTENSION = (
    "a module extension computed it, from gradients that hold no graph (g_inp, g_out and "
    "backproped are taken without create_graph): a gradient through it would be missing, "
    "not refused. Remove the module extension (packfunc differentiates the module itself) "
    "to differentiate this result."
)


def _why_not_differentiable(job: Job, passes: dict[bool, BatchPass]) -> str | None:
    """Why ``job``'s results under ``backward(create_graph=True)`` have no right gradient.

    Those from the user's forward (statistics, KFAC/KFLR factors) keep its graph, unless
    packfunc ran a pass of its own for them (on detached parameters); the Hessian diagonals
    leave out their residual terms' dependence on the parameters, and KFRA and the block
    products run the model again on detached parameters.

    Returns:
        The refusal's reason, ``""`` for the quantity's own (see
        :func:`_refusing_gradients`), or ``None``: their gradients are right.
    """
    if not job.quantity.differentiable or job.quantity.reruns_model:
        return ""
    if passes[job.second_order].reran:
        return _RERUN.format(name=job.name)
    return None


def _refusing_gradients(value: Any, live: list[Tensor], name: str, why: str | None) -> Any:
    """``value`` (a result, or a block product's function) whose gradient raises.

    Args:
        value: A parameter's result: tensors, or a function of a matrix.
        live: The model's parameters that require gradients.
        name: The quantity, for the message.
        why: Why its gradient would be wrong (``""``: the quantity's own reason; ``None``:
            it is right, and ``value`` is returned as it is).

    Returns:
        ``value`` connected to ``live`` by a node whose backward raises (a function
        returning such values).
    """
    if why is None:
        return value
    if callable(value):
        return partial(_refusing_product_gradients, value, live, name)
    if why:
        return refuse_differentiation(value, live, name, why=why)
    return refuse_differentiation(value, live, name)


_DETACHED_PRODUCT = (
    "packfunc.compat's block products run the model again on its parameters detached, so "
    "they hold no graph (a gradient through them would be missing, not refused). Compute the "
    "product with pf.{name} on pf.functional(model)'s function and parameters, which "
    "follows their gradients."
)


def _refusing_product_gradients(
    product: Callable[[Tensor], Tensor], live: list[Tensor], name: str, mat: Tensor
) -> Tensor:
    """A block product's value whose gradient raises (see :func:`_refusing_gradients`)."""
    why = _DETACHED_PRODUCT.format(name=name)
    if name == "pch_block_products":
        why = "it is the product of a modified curvature, whose gradient is not defined."
    found: Tensor = refuse_differentiation(product(mat), live, name, why=why)
    return found


def _uses_forward(job: Job) -> bool:
    """Whether ``job`` comes from the user's forward pass (statistics, KFAC/KFLR factors).

    The others run the model again (:attr:`~packfunc.specs.Quantity.reruns_model`).
    """
    return not job.quantity.reruns_model


def run_extensions(ctx: Context, record: ForwardRecord, gradient: Tensor, route: LossRoute) -> None:
    """Compute every extension of ``ctx`` for ``record`` and store the results.

    Inside ``backward(create_graph=True)`` (gradients enabled in the hook) the
    results keep their autograd graphs, so they can be differentiated further.

    Args:
        ctx: The active ``backpack`` context.
        record: The forward pass of the extended model.
        gradient: ``∂L/∂output`` from the backward pass.
        route: How the output reaches the extended loss of this backward pass.

    Raises:
        ValueError: for a second-order extension without an extended loss, or model
            inputs packfunc cannot pass on (keyword arguments).
    """
    model = record.model
    if record.kwargs:
        raise ValueError(
            "packfunc.compat passes the model's positional inputs only; call the "
            "extended model without keyword arguments (for model(**batch), extend a module "
            "whose forward takes them positionally: forward(self, input_ids, attention_mask) "
            "returning self.model(input_ids=input_ids, attention_mask=attention_mask).logits)."
        )
    record.check_output_unchanged()
    if not record.inputs_as_called:
        raise ValueError(
            f"a forward pre-hook ran before the shim's on the extended {type(model).__name__} "
            "(one registered on it with prepend=True after extend()): packfunc runs the model "
            "from the inputs its caller passed, with its pre-hooks, and does not have those "
            "inputs. Register the hook without prepend=True, or before extend() (the shim's "
            "goes first from the next forward on: run that step again)."
        )
    if record.output_shape[:1] == (0,):  # (an empty batch: before its layout's reshapes)
        raise ValueError(EMPTY_BATCH)
    _refuse_hooks_on_the_output(record)
    savefields = [ext.savefield for ext in ctx.extensions]
    _refuse_parameters_of_another_model(record, savefields)
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    for name in names:  # (results from this backward pass and this forward pass)
        _WRITTEN[model.get_parameter(name)] = (_graph_task(), record.serial, weakref.ref(model))
    if any(ext.job().second_order for ext in ctx.extensions):
        _refuse_terms_beside_the_loss(record, route, gradient)
    differentiable = torch.is_grad_enabled()
    users = (
        UsersCotangents(record.taken) if _from_users_backward(ctx, record, differentiable) else None
    )
    retained = _retained_gradients(record)
    X = record.args[0] if len(record.args) == 1 else record.args
    # as BackPACK: the parameters that require gradients (a frozen one is a constant, and
    # outside the norm ClippedGrad clips)
    params = {name: p.detach() for name, p in model.named_parameters() if name in names}
    cotangents = {  # per pass
        second: SiteCotangents(rounding=record.rounding) for second in (False, True)
    }
    problems, passes = _batch_passes(ctx, record, route, gradient, differentiable, X, params, (
        users or cotangents[False], cotangents[True]))  # fmt: skip
    finish = partial(_finish, ctx, record, route, gradient, X, params, problems, passes, cotangents)
    if users is None or passes[False].reran or not users.capture(_output_edge(record)):
        record.taken.found.clear()  # (what the hooks took so far is not used)
        if users is not None:
            users.stop_capturing()
        finish(retained)
    else:  # the extensions run when the user's backward pass has brought every cotangent
        forget_results(record.model, savefields)  # (read during it: none, not the last step's)
        # (nothing of packfunc's runs through the user's graph: no retained gradient to put back)
        torch.autograd.Variable._execution_engine.queue_callback(
            partial(_as_own_pass, partial(finish, []), record)
        )


def _as_own_pass(run: Callable[[], None], record: ForwardRecord) -> None:
    """``run()`` as packfunc's own pass (as the backward hook that queued it runs).

    Args:
        run: What to run.
        record: The recorded forward: its autocast (the own forwards run under it, not
            under the backward's), its inputs for the message of an error torch raises.
    """
    try:
        with context.own_pass(), packfunc_passes(), serving_autocast(record.autocast):
            run()
    except RuntimeError as error:
        clearer = clearer_error(error, (record.args, record.kwargs))
        if clearer is None:
            raise
        raise clearer from error


Problem = tuple[ModelFn, nn.Module, Any]
"""What a job differentiates: ``(model_fn, loss, y)``."""


def _batch_passes(
    ctx: Context,
    record: ForwardRecord,
    route: LossRoute,
    gradient: Tensor,
    differentiable: bool,
    X: Any,
    params: dict[str, Tensor],
    watchers: tuple[SiteCotangents | UsersCotangents, SiteCotangents],
) -> tuple[list[Problem], dict[bool, BatchPass]]:
    """Each extension's problem, and the batch passes over the recorded forward they share.

    Args:
        ctx: The active ``backpack`` context.
        record: The forward pass of the extended model.
        route: How its output reaches the extended loss.
        gradient: ``∂L/∂output`` from the backward pass.
        differentiable: Whether the results keep their graphs.
        X: The recorded forward's inputs.
        params: The parameters that require gradients, by name (detached).
        watchers: What watches the first-order pass's and the second-order pass's pullbacks.

    Returns:
        ``(problems, passes)``: one problem per extension; the passes by ``second_order``.
    """
    model = record.model
    model_fn = _model_function(model, record.element)
    problems: list[Problem] = []
    passes: dict[bool, BatchPass] = {}
    for ext in ctx.extensions:
        job = ext.job()
        if ctx.debug:
            print(f"[packfunc.compat] {type(ext).__name__} on {type(model).__name__}: {job.name}")
        if job.second_order:
            fn, loss, y, watched = _second_order_problem(
                ext, job, record, route, model_fn, differentiable, watchers[1]
            )
        else:
            fn, loss, y = model_fn, GivenOutputGradient(gradient), gradient
            watched = partial(_watched, record, None, differentiable, watchers[0])
        problems.append((fn, loss, y))
        if _uses_forward(job) and job.second_order not in passes:
            bp = passes[job.second_order] = _batch_pass(record, fn, params, X, y, loss, watched)
            if bp.reran:
                _check_own_output(record, route if job.second_order else None, bp.record.output)
    return problems, passes


def _finish(
    ctx: Context,
    record: ForwardRecord,
    route: LossRoute,
    gradient: Tensor,
    X: Any,
    params: dict[str, Tensor],
    problems: list[Problem],
    passes: dict[bool, BatchPass],
    cotangents: dict[bool, SiteCotangents],
    retained: list[tuple[Tensor, Tensor | None]],
) -> None:
    """Compute the extensions from their passes, store the results, check, and clean up.

    Args:
        ctx: The active ``backpack`` context.
        record: The forward pass of the extended model.
        route: How its output reaches the extended loss.
        gradient: ``∂L/∂output`` from the backward pass.
        X: The recorded forward's inputs.
        params: The parameters that require gradients, by name (detached).
        problems: Each extension's ``(model_fn, loss, y)``.
        passes: The batch passes, by ``second_order``.
        cotangents: The pullbacks' notes of the passes over the user's graph.
        retained: Retained gradients to put back (see :func:`_retained_gradients`).
    """
    model = record.model
    differentiable = torch.is_grad_enabled()
    names = list(params)
    results: dict[str, dict[str, Any]] = {}
    input_first: dict[str, set[str]] = {}  # by savefield (see store_result)
    for ext, (fn, loss, y) in zip(ctx.extensions, problems):
        job = ext.job()
        with torch.set_grad_enabled(differentiable):
            if job.computes_statistic:
                results[ext.savefield] = evaluate(
                    passes[job.second_order], (job.name,), **_options(job, names)
                )[job.name]
            elif _uses_forward(job):
                handled = _handled_by_module_extensions(ext, record.model)
                results[ext.savefield] = _factors(job, passes[job.second_order], handled)
                bp = passes[job.second_order]  # (factors of [in, out] weights: input first)
                input_first[ext.savefield] = in_out_weights_of(bp.plan, bp.names)
            else:
                own_output = partial(_check_own_output, record, route if job.second_order else None)
                results[ext.savefield] = _compute(job, record, fn, params, X, y, loss, own_output)
        by_extensions = _module_extensions(ext, job, record, route, gradient)
        results[ext.savefield].update(by_extensions)
        if differentiable:
            live: list[Tensor] = [model.get_parameter(name) for name in names]
            why = _why_not_differentiable(job, passes)
            results[ext.savefield] = {
                name: _refusing_gradients(
                    value, live, job.name, _MODULE_EXTENSION if name in by_extensions else why
                )
                for name, value in results[ext.savefield].items()
            }
    samples = next(iter(passes.values())).n if passes else None  # (noted for the ranks)
    for ext in ctx.extensions:
        for name, param in model.named_parameters():
            if name in names and name in results[ext.savefield]:
                value = results[ext.savefield][name]
                first = name in input_first.get(ext.savefield, set()) and len(value) == 2
                store_result(param, ext.savefield, value, input_factor_first=first, samples=samples)
            else:  # (without Kronecker factors, or frozen since: no last step's value either)
                forget_result(param, ext.savefield)
    # the extended loss's own pass is compared as the backward pass scaled it (s * loss)
    scale = route.loss.output_gradient if route.loss else None
    cotangents[True].scale = scale
    if scale is None or scale.numel() != 1:
        cotangents[True].ours.clear()  # (its scale unknown: not compared)
    savefields = [ext.savefield for ext in ctx.extensions]
    for pass_cotangents in cotangents.values():
        if pass_cotangents.ours:  # (a pass over the user's forward pulled its gradient back)
            refuse = partial(_refuse_terms_inside_the_model, record.model, savefields)
            pass_cotangents.check_after_backward(_output_node(record), refuse)
    for tensor, grad in retained:  # packfunc's own pullbacks added to them (or under vmap)
        tensor.grad = grad
    if ctx.extension_hook is not None:
        for module in _backward_order(record, route):
            ctx.extension_hook(module)
    if not ctx.retain_graph and not any(
        ext.job().quantity.family is Family.PRODUCTS for ext in ctx.extensions
    ):
        forget_inputs_and_outputs(record, route.loss.module if route.loss else None)


def _from_users_backward(ctx: Context, record: ForwardRecord, differentiable: bool) -> bool:
    """Whether the extensions take the layers' cotangents from the user's backward pass.

    Where every extension is a first-order statistic of the loss gradient
    (:func:`~packfunc.compat.site_cotangents.first_order_only`), of a model returning one
    tensor, and the results need no graph (see
    :class:`~packfunc.compat.site_cotangents.UsersCotangents`).
    """
    return (
        not differentiable
        and record.element is None
        and record.output is not None
        and first_order_only(ctx)
    )


def _output_edge(record: ForwardRecord) -> GradientEdge:
    """The autograd edge of the recorded output."""
    return get_gradient_edge(cast(Tensor, record.output))


def _batch_pass(
    record: ForwardRecord,
    fn: ModelFn,
    params: dict[str, Tensor],
    X: Any,
    y: Any,
    loss: nn.Module,
    watched: Callable[..., Any],
) -> BatchPass:
    """The batch pass over the recorded forward; a model changed since names the change.

    Its check runs the first sample alone on the model as it is now: a parameter changed
    since the forward (``w.data = ...``, an optimizer step) fails it with a message about
    mixing samples, which the change explains better.
    """
    if has_packed_sequences(X):  # (passed padded, packed again for the model)
        fn, X = packing(fn), padded_sequences(X)
    try:
        return BatchPass(fn, params, X, y, loss, reuse=watched)
    except RowsNotAloneError as error:
        change = record.state.change(record.model)
        if change is None:
            raise
        raise ValueError(
            f"{change} since the forward pass of the extended {type(record.model).__name__}: "
            "backpropagate before changing the model (before optimizer.step(), an assignment "
            "to .data, model.double())."
        ) from error


def _options(job: Job, names: list[str]) -> dict[str, Any]:
    """The job's options, one bound per parameter (a tuple, in the model's order) by name.

    Raises:
        ValueError: for a number of bounds other than of trainable parameters.
    """
    options = dict(job.options)
    bounds = options.get("max_norm")
    if isinstance(bounds, tuple):
        if len(bounds) != len(names):
            raise ValueError(
                f"{len(bounds)} clipping bounds for {len(names)} trainable parameters "
                f"({names}): give one per parameter that requires grad, in "
                "model.parameters() order."
            )
        options["max_norm"] = dict(zip(names, bounds))
    return options


def _second_order_problem(
    ext: BackpropExtension,
    job: Job,
    record: ForwardRecord,
    route: LossRoute,
    model_fn: Callable,
    differentiable: bool,
    cotangents: SiteCotangents,
) -> tuple[Callable, nn.Module, Any, Callable]:
    """``(model_fn, loss, targets, watched)`` for the loss this backward pass goes through.

    The model function ends where the loss starts: extended modules the output
    passes through on the way (chained in plain code) are composed after it, and
    the loss input's rearrangement of the output (``f.view(-1, C)``) is applied
    in packfunc's per-sample form. ``cotangents`` notes what a pullback of the loss
    gradient over the user's forward gives each layer (``ClippedGrad``'s).
    """
    if route.error is not None:
        raise ValueError(route.error)
    if job.quantity.cotangents is Cotangents.CLIPPED_GRADIENT:
        _refuse_clipping_across_records(record, route, ext.savefield)
    call = route.loss
    if call is None:
        raise ValueError(
            f"{type(ext).__name__} needs the loss function, one of torch.nn's losses, taking "
            f"the output of the extended {type(record.model).__name__} this backward pass "
            "goes through: extend it (lossfunc = extend(lossfunc)), apply it to the model's "
            "output (or a reshape of it, or the output of further extended modules) and call "
            "backward on the loss itself. Other code between the model and the loss (a slice "
            "out[:, -1], out / T, a mean) is not followed: move it into the extended model's "
            "forward; a penalty on a layer's own call (+ model[0](X).square().mean()) "
            "needs a backward pass of its own. A loss called inside torch.compile'd code is "
            "not seen either: call it uncompiled."
        )
    ends_at_loss = _ending_at_loss(model_fn, route.stages, call)
    watched = partial(_not_reusable, record)
    if not route.stages:
        watched = partial(_watched, record, call.output, differentiable, cotangents)
    return ends_at_loss, _without_hooks(call.module), call.targets(), watched


def _refuse_clipping_across_records(
    record: ForwardRecord, route: LossRoute, savefield: str
) -> None:
    """Refuse a per-sample norm over one extended model where the loss comes after others.

    ``lf(l2(l1(X)), y)`` with ``l1`` and ``l2`` extended apart (or an extended model's
    children called one by one): each record holds its own parameters alone, so each would
    clip its samples by the norm of its own gradients, and a sample would add up to
    ``√(models)·C`` to the sum. Stages without trainable parameters (an extended
    activation) change no norm. This pass's results are removed from every model of the chain.

    Args:
        record: The forward pass of the extended model.
        route: How its output reaches the extended loss.
        savefield: The extension's attribute (``"grad_clipped"``).

    Raises:
        ValueError: where a later stage of the chain has parameters that require grad.
    """
    later = [stage.model for stage, _ in route.stages]
    if not trains(record.model) or not any(trains(model) for model in later):
        return
    for model in (record.model, *later):
        forget_results(model, [savefield])
    names = " -> ".join(type(model).__name__ for model in (record.model, *later))
    raise ValueError(
        f"ClippedGrad clips each sample's gradient by its norm over all the parameters it "
        f"covers, but this loss is reached through extended modules chained in plain code "
        f"({names}), each with its own parameters: each would clip by the norm of its own "
        "parameters alone, and a sample would add more than max_norm. Extend one module "
        "that runs the whole chain (extend(nn.Sequential(l1, act, l2)), called as a whole), "
        "or use packfunc.clipped_grad on the composed function. This backward pass's "
        f"{savefield} were removed."
    )


def trains(model: nn.Module) -> bool:
    """Whether ``model`` has a parameter that requires grad.

    Example:
        >>> trains(torch.nn.Linear(2, 1)), trains(torch.nn.Linear(2, 1).requires_grad_(False))
        (True, False)
    """
    return any(p.requires_grad for p in model.parameters())


def _loss_gradient(call: LossCall, output: Tensor) -> Tensor | None:
    """The gradient the extended loss alone sends to the model output, or ``None``.

    The loss, run again on the output (in packfunc's per-sample form, which leaves its
    value as it was), pulled back from the gradient the backward pass brought to the loss
    value (``s`` for ``(s * loss).backward()``). ``None`` where that gradient is unknown or
    not one number (a loss without reduction, which second-order extensions refuse).

    Args:
        call: The extended loss the backward pass goes through.
        output: The model output the loss takes (a rearrangement of).

    Returns:
        ``∂(s · loss)/∂output``, of ``output``'s shape (at least float32).

    Example:
        >>> layout = SampleLayout(gather=None, positions=1, row_shape=(1,), row_order=None)
        >>> call = LossCall(torch.nn.MSELoss(reduction="sum"), torch.zeros(2, 1), layout)
        >>> call.output_gradient = torch.tensor(2.0)  # (2 * loss).backward()
        >>> _loss_gradient(call, torch.ones(2, 1)).tolist()
        [[4.0], [4.0]]
    """
    scale = call.output_gradient
    reduced = getattr(call.module, "reduction", None) in ("mean", "sum")
    if scale is None or scale.numel() != 1 or not reduced:
        return None
    dtype = torch.promote_types(output.dtype, torch.float32)  # (a half-precision output)
    with torch.enable_grad():
        out = output.detach().to(dtype).requires_grad_()
        value = _without_hooks(call.module)(call.output(out), call.targets())
        (found,) = torch.autograd.grad(value, out, scale.reshape(()).to(value.dtype))
    return found


def _refuse_terms_beside_the_loss(
    record: ForwardRecord, route: LossRoute, gradient: Tensor
) -> None:
    """Refuse jobs using the loss where the output's gradient is not the extended loss's alone.

    ``(lossfunc(out, y) + 0.1 * out.pow(2).mean()).backward()``: first-order quantities
    take the whole gradient, the curvature (and ``ClippedGrad``'s per-sample losses) would
    be the extended loss's alone, so the results of one backward pass would describe two
    losses (BackPACK's second-order extensions silently do). A scaled loss (``s * loss``, a
    ``GradScaler``) passes (its warning is :func:`~packfunc.compat.extend._on_loss_backward`'s).
    Not checked where the loss comes after further extended modules (their own records check
    their outputs) or the output was let go.

    Args:
        record: The forward pass of the extended model.
        route: How its output reaches the extended loss.
        gradient: ``∂L/∂output`` from the backward pass.

    Raises:
        ValueError: naming the fix.
    """
    if route.loss is None or route.stages or record.output is None:
        return
    expected = _loss_gradient(route.loss, record.output)
    if expected is None:
        return
    difference = difference_beyond_rounding(gradient, expected)
    if difference is not None:
        loss, model = type(route.loss.module).__name__, type(record.model).__name__
        raise ValueError(
            f"the gradient this backward pass brings to the output of the extended {model} is "
            f"not that of the extended {loss} alone (it {difference}): the value "
            "backpropagated adds other terms of the output (a penalty such as "
            "0.1 * out.pow(2).mean(), a second loss), or a hook changes that gradient on its "
            "way (out.register_hook(...), gradient clipping of the output), which the "
            "extensions that use the loss function (second-order ones, ClippedGrad) would "
            "leave out while first-order ones take their gradient. Compute such a term outside "
            "the backpack(...) block: lossfunc(out, y).backward(retain_graph=True) inside it, "
            "penalty.backward() after it (.grad gets both), and no hook on the output; "
            "first-order extensions alone take any loss."
        )


_HOOKS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
)
"""The hook dicts of a module."""


def _refuse_terms_inside_the_model(model: nn.Module, savefields: list[str], _: list[int]) -> None:
    """Remove this backward pass's results and refuse: a term reached the layers directly.

    Raises:
        ValueError: always, naming the fix.
    """
    forget_results(model, savefields)
    raise ValueError(
        f"this backward pass brings a layer inside the extended {type(model).__name__} a "
        "gradient that does not come through the model's output (a loss term on an "
        "activation the forward keeps, such as a penalty on a hidden layer or a router's "
        "auxiliary loss): where packfunc pulls the output's gradient back itself (a "
        "second-order extension or ClippedGrad in the block) the per-sample gradients would "
        "hold the output's terms alone, without it (BackPACK's first-order results include "
        f"it), so this backward pass's results were removed ({', '.join(savefields)}). "
        "First-order extensions alone in a block take it. Else make the term part of the "
        "model's output (return it beside the logits from an outer module, and add it to the "
        "loss there), or backpropagate it in a backward pass of its own outside `with "
        "backpack(...)` (.grad still sums both)."
    )


_WRITTEN: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""Per parameter of an extended model, ``(graph task, record serial, model)`` of its latest
results (the model weakly)."""


def _graph_task() -> int:
    """The running backward pass (``-1`` outside one)."""
    return torch._C._current_graph_task_id()


def _refuse_parameters_of_another_model(record: ForwardRecord, savefields: list[str]) -> None:
    """Refuse a backward pass that reaches a parameter through two extended models' outputs.

    Two models extended apart that share a layer (an encoder beside two heads), both in one
    loss: each model's results hold its own output's terms, and the second model's results
    would replace the first's on the shared parameters (per-sample gradients that do not
    sum to ``.grad``, one head's GGN). BackPACK raises there too (its ``module.output`` is
    the last model's).

    Args:
        record: The forward pass about to be pulled back.
        savefields: The block's extensions' savefields (removed from the model on refusal).

    Raises:
        ValueError: naming the shared parameters and the fix.
    """
    task = _graph_task()
    found = {
        name: written[2]()
        for name, param in record.model.named_parameters()
        if param.requires_grad
        and (written := _WRITTEN.get(param)) is not None
        and written[0] == task
        and written[1] != record.serial
    }
    if found:
        shared = list(found)
        models = {id(m): m for m in [record.model, *found.values()] if m is not None}
        for model in models.values():
            forget_results(model, savefields)  # (the other model's may not have run yet)
        layer = _layer_called_apart(record.model, list(found.values()))
        if layer is not None:
            raise ValueError(
                f"this backward pass reaches {', '.join(shared[:4])}"
                f"{', ...' if len(shared) > 4 else ''} through the extended {layer} called "
                "outside the model around it as well as inside (a penalty on a layer's own "
                "call, + model[0](X).square().mean(), or another model sharing the layer): "
                "the results would hold one call's terms only. Backpropagate that term in a "
                "backward pass of its own (.grad sums them), or put both calls in one extended "
                f"module; the results were removed ({', '.join(savefields)})."
            )
        raise ValueError(
            f"this backward pass reaches parameters of the extended {type(record.model).__name__} "
            f"({', '.join(shared[:4])}{', ...' if len(shared) > 4 else ''}) through another "
            "extended model's output as well (two models that share a layer, in one loss): "
            "each model's results hold the terms of its own output, so neither would be the "
            "loss's. Put both models in one extended module whose output the loss takes, or "
            "backpropagate each model's loss in a backward pass of its own (.grad sums "
            f"them); both models' results were removed ({', '.join(savefields)})."
        )


def _layer_called_apart(model: nn.Module, others: list[nn.Module | None]) -> str | None:
    """``"Linear (0)"`` where one of ``others`` is a layer of ``model`` or ``model`` one of theirs.

    Args:
        model: The extended model whose forward is being pulled back.
        others: The models whose results this backward pass wrote on the same parameters.

    Returns:
        The layer's type and name within the larger model, or ``None`` for unrelated models.

    Example:
        >>> net = nn.Sequential(nn.Linear(2, 2))
        >>> _layer_called_apart(net, [net[0]])
        'Linear (0)'
    """
    for other in others:
        if other is None:
            continue
        for outer, inner in ((model, other), (other, model)):
            name = next((n for n, m in outer.named_modules() if m is inner and n), None)
            if name is not None:
                return f"{type(inner).__name__} ({name})"
    return None


def _refuse_hooks_on_the_output(record: ForwardRecord) -> None:
    """Refuse a hook on the model's output: packfunc's own pullback from it would run it again.

    ``out.register_hook(lambda g: 2 * g)``: the gradient the backward pass brings has been
    through it once, and packfunc's pullback of that gradient from the output runs it a
    second time (per-sample gradients summing to twice ``.grad``).

    Raises:
        ValueError: naming the fix.
    """
    output = record.output
    if output is not None and output._backward_hooks:
        raise ValueError(
            f"a hook is registered on the output of the extended {type(record.model).__name__}"
            " (out.register_hook): packfunc.compat pulls the output's gradient back from "
            "that tensor again, which would run the hook a second time. Register it on a "
            "copy the loss takes instead (out = out.clone(); out.register_hook(...))."
        )


def _retained_gradients(record: ForwardRecord) -> list[tuple[Tensor, Tensor | None]]:
    """The forward's tensors that retain their gradient (``t.retain_grad()``), with ``.grad``.

    The output and every tensor of the forward still alive (made from the inputs or the
    parameters). packfunc's own pullbacks through the user's graph fill retained gradients
    too: added again, a sampled cotangent's (KFAC), or a batched tensor out of ``vmap``
    (second-order extensions); they are put back after them.

    Args:
        record: The forward pass of the extended model.

    Returns:
        ``[(tensor, its .grad now), ...]``.
    """
    recorder = record.recorder
    candidates = [record.output, *recorder.samples.values()]
    candidates += recorder.made_of_parameters.values()
    found: dict[int, tuple[Tensor, Tensor | None]] = {}
    for tensor in candidates:
        if isinstance(tensor, Tensor) and tensor.retains_grad:
            found.setdefault(id(tensor), (tensor, tensor.grad))
    return list(found.values())


def _output_node(record: ForwardRecord) -> object:
    """The autograd node of the record's output (``None`` once it is let go)."""
    return None if record.output is None else record.output.grad_fn


def _without_hooks(loss: nn.Module) -> nn.Module:
    """``loss`` for packfunc's own runs of it: a shallow copy without hooks, where it has any.

    Its forward and (full) backward hooks are the user's, for the user's own backward pass
    (or the shim's recording): packfunc's passes neither call them nor pass through the
    identity a full backward hook wraps the loss input in.

    Example:
        >>> loss = torch.nn.MSELoss()
        >>> _ = loss.register_full_backward_hook(lambda *_: None)
        >>> bare = _without_hooks(loss)
        >>> type(bare).__name__, bool(bare._backward_hooks), bool(loss._backward_hooks)
        ('MSELoss', False, True)
    """
    if not any(getattr(loss, name) for name in _HOOKS):
        return loss
    bare = copy.copy(loss)
    for name in _HOOKS:
        bare.__dict__[name] = type(getattr(loss, name))()
    bare.__dict__["_is_full_backward_hook"] = None
    return bare


_FUNCTIONS: weakref.WeakKeyDictionary[nn.Module, dict[Hashable, Callable]] = (
    weakref.WeakKeyDictionary()
)
"""Per extended model, the model functions the shim ran, kept across backward passes:
packfunc caches its plan per model function, so a training loop discovers once, as with
the functional API (each function holds the model weakly)."""


def _model_function(model: nn.Module, element: tuple[Any, int] | None = None) -> Callable:
    """The model function of ``model`` (:func:`~packfunc.functionalize.weakly_bound`), kept.

    For a model returning several tensors, the one at ``element`` (see
    :func:`~packfunc.compat.elements.select_element`).
    """
    functions = _FUNCTIONS.setdefault(model, {})
    if None not in functions:
        functions[None] = weakly_bound(model)
    whole = functions[None]
    if element is None:
        return whole
    key = ("element", element[1], element[0])
    if key not in functions:
        functions[key] = wraps_module_of(whole, partial(_selected, whole, element))
    return functions[key]


def _selected(model_fn: Callable, element: tuple[Any, int], params: Any, X: Any) -> Tensor:
    """The output tensor at ``element`` of ``model_fn(params, X)``."""
    return select_element(model_fn(params, X), element)


def _ending_at_loss(model_fn: Callable, stages: tuple, call: LossCall) -> Callable:
    """``model_fn`` up to the loss input in packfunc's per-sample form (see :class:`LossCall`).

    Kept per model function (the model's, or one of its outputs') and layout where the
    layout holds no index tensors and no extended modules come in between (a loss on the
    output or a reshape of it, the usual case).
    """
    key = None
    layout, model = call.layout, module_of(model_fn)
    class_dim = isinstance(call.module, CLASS_LOSSES)
    if not stages and layout.gather is None and layout.row_order is None and model is not None:
        key = ("loss", model_fn, layout.positions, layout.row_shape, class_dim)
        found = _FUNCTIONS.setdefault(model, {}).get(key)
        if found is not None:
            return found
    fn = _composed(model_fn, stages)

    @partial(wraps_module_of, model_fn)
    def ends_at_loss(params: Any, X: Any) -> Tensor:
        return layout.output(fn(params, X), class_dim)

    if key is not None:
        _FUNCTIONS[cast(nn.Module, model)][key] = ends_at_loss
    return ends_at_loss


def _composed(model_fn: Callable, stages: tuple) -> Callable:
    """``model_fn`` followed by each stage's module (its parameters held fixed)."""
    for consumer, layout in stages:
        later_fn, later_params = pf.functional(consumer.model)
        model_fn = partial(
            _then, model_fn, later_fn, later_params, layout, consumer.args[0].shape[1:]
        )
    return model_fn


def _then(
    first: Callable,
    later_fn: Callable,
    later_params: dict[str, Tensor],
    layout: SampleLayout,
    input_tail: torch.Size,
    params: Any,
    X: Any,
) -> Tensor:
    out = layout.output(first(params, X))
    return later_fn(later_params, out.reshape(out.shape[0], *input_tail))


def _watched(
    record: ForwardRecord,
    adapt: Callable | None,
    differentiable: bool,
    cotangents: SiteCotangents | UsersCotangents | None,
    plan: Plan,
    leaves: list[Tensor],
    loss: nn.Module,
    y: Any,
    n: int,
) -> BatchRecord | None:
    """The batch pass from the user's own forward, if its recording fits.

    Where it does not, packfunc's own pass runs the model again: refused if the model
    changed since its forward pass (see :meth:`ForwardRecord.check_unchanged`).
    ``cotangents`` notes what its pullbacks give each site (see
    :mod:`~packfunc.compat.site_cotangents`).
    """
    plan.note_random(record.recorder.random)
    output = record.output
    found = None
    if output is not None:
        found = record.recorder.record(
            plan,
            leaves,
            output,
            loss,
            y,
            n,
            adapt=adapt,
            differentiable=differentiable,
            cotangents=cotangents,
        )
    if found is None:
        record.check_unchanged(_OWN_PASS)
    return found


def _check_own_output(record: ForwardRecord, route: LossRoute | None, output: Tensor) -> None:
    """Refuse packfunc's own pass where its output is not that of the user's forward.

    ``route``: the loss a second-order pass ends at (its output is the loss input in
    packfunc's per-sample form), or ``None`` (the model's output). A pass through further
    extended modules is not compared.
    """
    if route is None:
        record.check_same_output(output, None)
    elif not route.stages and route.loss is not None:
        record.check_same_output(output, route.loss)


def _not_reusable(record: ForwardRecord, *_: Any) -> BatchRecord | None:
    """A reuse of a recording that cannot serve (the loss comes after further modules)."""
    record.check_unchanged(_OWN_PASS)
    return None


_OWN_PASS = "packfunc's own pass (the recorded forward pass cannot be reused here)"


def _factors(job: Job, bp: BatchPass, handled: set[str]) -> dict[str, list[Tensor]]:
    """KFAC's or KFLR's factors from the batch pass of the user's forward, by parameter name.

    Parameters without a Kronecker rule are left out, with a warning, but those a module
    extension handles (``handled``).
    """
    found = factors_from_pass(bp, job.name, dict(job.options))
    left = [bp.names[leaf] for leaf in sorted(found.unsupported)]
    _warn_about_unsupported(job.name, [name for name in left if name not in handled])
    return {bp.names[leaf]: f for leaf, f in enumerate(found.per_leaf) if f is not None}


def _handled_by_module_extensions(ext: BackpropExtension, model: nn.Module) -> set[str]:
    """The names of the parameters whose results ``ext``'s module extensions give."""
    return {key for _, _, handled in _extended_modules(ext, model) for key, _ in handled}


def _compute(
    job: Job,
    record: ForwardRecord,
    model_fn: Callable,
    params: dict[str, Tensor],
    X: Any,
    y: Any,
    loss: nn.Module,
    check_own_output: Callable[[Tensor], None],
) -> dict[str, Any]:
    """Run a job that runs the model again (KFRA, block products), by parameter name.

    Refused for a model that changed since its forward pass, draws random numbers, or
    changes a buffer or its input in its forward, or whose output run again is not the
    forward pass's (``check_own_output``: a change the recorded state does not cover,
    a Python attribute or a parameter-free child).
    """
    rerun = f"{job.name} (which packfunc computes with a pass of its own)"
    record.check_unchanged(rerun)
    leaves = flatten_params(params)[0]
    check_rerun(cached_discover(model_fn, params, leaves, X)[0], rerun)
    with torch.no_grad():
        check_own_output(model_fn(params, X))
    options = dict(job.options)
    public_function = getattr(pf, job.name)  # every spec names its public function
    if job.quantity.family is Family.FACTORS:
        factors = public_function(
            model_fn, params, X, y, loss=loss, on_unsupported="skip", **options
        )
        _warn_about_unsupported(job.name, [name for name, f in factors.items() if f is None])
        return {name: f for name, f in factors.items() if f is not None}
    # the state and model, not the record: a closure must not keep the forward's graph
    problem = (model_fn, params, X, y, loss, options)
    unchanged = partial(record.state.check, record.model)
    return {
        name: partial(_block_product, unchanged, public_function, name, problem) for name in params
    }


def _warn_about_unsupported(quantity: str, names: list[str]) -> None:
    """Warn about parameters left out (BackPACK raises ``NotImplementedError`` there)."""
    if names:
        warnings.warn(
            f"{quantity} has no Kronecker rule for {names} (not the weight or bias of a "
            "linear, convolution or recurrent layer — embeddings and norm layers have none "
            "— or used "
            "several ways, or called where "
            "your forward pass records no graph: under no_grad, or in a reentrant "
            "checkpoint, for which checkpoint(..., use_reentrant=False) is the fix): they "
            f"get no {quantity} attribute.",
            UserWarning,
            stacklevel=2,
        )


def _block_product(
    check_unchanged: Callable[[str], None],
    product: Callable,
    name: str,
    problem: tuple[Callable, dict[str, Tensor], Any, Any, nn.Module, dict],
    mat: Tensor,
) -> Tensor:
    """``block(name) @ mat`` for ``mat`` of shape ``[V, *param.shape]`` or ``param.shape``.

    Refused once the model changed since the forward pass (BackPACK's closures keep the
    curvature of the backward pass; this one runs the model again).
    """
    model_fn, params, X, y, loss, options = problem
    check_unchanged(f"the {name} block product")
    single = mat.shape == params[name].shape
    mats = {key: (mat.unsqueeze(0) if single else mat) if key == name else None for key in params}
    with context.own_pass():  # may run inside ``with backpack(...)``: record nothing
        result = product(model_fn, params, X, y, mats, loss=loss, **options)[name]
    return result.squeeze(0) if single else result


def _module_extensions(
    ext: BackpropExtension, job: Job, record: ForwardRecord, route: LossRoute, gradient: Tensor
) -> dict[str, Any]:
    """Results of the module extensions registered on ``ext``, by parameter name."""
    extended = list(_extended_modules(ext, record.model))
    if not any(handled for _, _, handled in extended):
        return {}
    if not (job.computes_statistic or _uses_forward(job)):  # KFRA, block products
        names = ", ".join(sorted(type_.__name__ for type_ in ext.module_extensions))
        raise ValueError(
            f"{type(ext).__name__} runs the model again in packfunc.compat (its own pass), "
            f"which does not call module extensions (registered for {names}); remove them "
            "(packfunc differentiates any module itself), or compute this quantity's blocks of "
            "that module by hand."
        )
    found: dict[str, Any] = {}
    output = _live_output(record)
    backproped = None
    _refuse_shared_parameters(ext, record.model, extended)
    for module, extension, handled in extended:
        io = stored_io(module)
        module_output = io.get("output")
        if module_output is None:
            continue
        g_out = torch.autograd.grad(output, module_output, gradient, retain_graph=True)
        g_inp = _input_gradients(output, gradient, io)
        if job.second_order:
            backproped = _backproped(job, record, route, module_output)
        for key, name in handled:
            found[key] = getattr(extension, name)(ext, module, g_inp, g_out, backproped)
    return found


def _refuse_shared_parameters(
    ext: BackpropExtension,
    model: nn.Module,
    extended: list[tuple[nn.Module, Any, list[tuple[str, str]]]],
) -> None:
    """Refuse a module extension's parameter registered at two paths (tied, or one module twice).

    The extension's result covers one call's use of it; it replaced the whole parameter's
    (a per-sample gradient not summing to ``.grad``; BackPACK's is wrong too). A module
    registered twice but called once (a second handle) is refused too: the paths do not
    tell it from one called at both places.

    Args:
        ext: The extension whose module extensions run.
        model: The extended model.
        extended: Its modules with a module extension (:func:`_extended_modules`).

    Raises:
        ValueError: if a parameter a module extension handles is held at two paths.
    """
    paths: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        paths.setdefault(id(param), []).append(name)
    for _, _, handled in extended:
        for key, _ in handled:
            held = paths[id(model.get_parameter(key))]
            if len(held) > 1:
                raise ValueError(
                    f"the parameter {key} that a module extension of {type(ext).__name__} "
                    f"computes is also registered as {', '.join(h for h in held if h != key)} "
                    "(a tied parameter, or one module at two places): the extension's result "
                    "covers one module call's use of it only (BackPACK's stores the last "
                    "call's input). Untie the parameter or call the module once (a second "
                    "handle to a submodule counts too: keep it out of the module tree), or "
                    "remove the module extension (packfunc differentiates any module itself)."
                )


def _extended_modules(
    ext: BackpropExtension, model: nn.Module
) -> Iterator[tuple[nn.Module, Any, list[tuple[str, str]]]]:
    """Each module of ``model`` with a module extension of ``ext``, and what it handles.

    Yields:
        ``(module, extension, [(name in the model, name in the module), ...])``.
    """
    if not ext.module_extensions:  # (the common case: no walk of the model)
        return
    for prefix, module in model.named_modules():
        extension = ext.module_extensions.get(type(module))
        if extension is not None:
            handled = [
                (f"{prefix}.{name}" if prefix else name, name)
                for name, _ in module.named_parameters(recurse=False)
                if extension.handles(name)
            ]
            yield module, extension, handled


def _input_gradients(
    output: Tensor, gradient: Tensor, io: dict[str, Any]
) -> tuple[Tensor | None, ...]:
    """A module's ``g_inp``: the gradients of its stored inputs, as BackPACK's hooks get them.

    ``None`` for an input that takes none (the model's input, an integer tensor).

    Args:
        output: The extended model's output, in its graph.
        gradient: ``∂L/∂output``.
        io: The module's stored ``input0``, ``input1``, … and ``output``.
    """
    inputs = [io[f"input{i}"] for i in range(len(io)) if f"input{i}" in io]
    wanted = [i for i, x in enumerate(inputs) if isinstance(x, Tensor) and x.requires_grad]
    found: list[Tensor | None] = [None] * max(len(inputs), 1)
    if wanted:
        grads = torch.autograd.grad(
            output, [inputs[i] for i in wanted], gradient, retain_graph=True, allow_unused=True
        )
        for i, g in zip(wanted, grads, strict=True):
            found[i] = g
    return tuple(found)


def _backproped(job: Job, record: ForwardRecord, route: LossRoute, target: Tensor) -> Tensor:
    """Square-root columns of the GGN w.r.t. ``target``, ``[K, *target.shape]``."""
    call = route.loss
    if call is None or route.stages:
        raise ValueError(
            "module extensions of second-order extensions need the extended loss "
            "applied to the extended model's output (or a reshape of it)."
        )
    with torch.enable_grad():
        output = call.output(_live_output(record))
    y = call.targets()
    options = dict(job.options)
    roots = hessian_factors(call.module, output.detach(), y, mc_samples=options.get("mc_samples"))
    (columns,) = torch.autograd.grad(
        output, target, roots.all(), retain_graph=True, is_grads_batched=True
    )
    return columns


def _live_output(record: ForwardRecord) -> Tensor:
    """The recorded output, still part of its graph."""
    if record.output is None:
        raise RuntimeError(
            "the extended model's output was released after an earlier backward "
            "pass; pass retain_graph=True to backpack(...) to reuse it."
        )
    return record.output


def _backward_order(record: ForwardRecord, route: LossRoute) -> list[nn.Module]:
    """The modules that compute something, loss first, then the model from last to first.

    Containers (``Sequential`` ...) are left out, as BackPACK does.
    """
    modules = [
        m for m in reversed(list(record.model.modules())) if not isinstance(m, NO_OP_MODULES)
    ]
    return ([route.loss.module] if route.loss and not route.stages else []) + modules


def forget_inputs_and_outputs(record: ForwardRecord, loss: nn.Module | None) -> None:
    """Drop the stored inputs and outputs: nothing outlives the backward pass.

    Args:
        record: The forward pass of the extended model.
        loss: The extended loss function, if any.
    """
    record.output = None
    for module in [*record.model.modules(), *([loss] if loss is not None else [])]:
        memory_cleanup(module)
