"""Run the active extensions for one recorded forward pass, with the functional core.

First-order extensions use the gradient the backward pass itself brings to the
model output (so any loss works, extended or not); second-order ones need the
extended loss and its targets. Results land on ``param.<savefield>``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

import packfunc as pf
from packfunc.compat.extensions.backprop_extension import BackpropExtension, Job
from packfunc.engine.persample import Backprop
from packfunc.losses import GivenGradient, hessian_factors
from packfunc.quantities import evaluate

if TYPE_CHECKING:
    from packfunc.compat.context import Context
    from packfunc.compat.extend import ForwardRecord

KRONECKER = {"kfac": pf.kfac, "kflr": pf.kflr, "kfra": pf.kfra}
BLOCKS = {"ggn": pf.ggn_block_products, "hessian": pf.hessian_block_products,
          "pch": pf.pch_block_products}


def run_extensions(ctx: Context, record: ForwardRecord, gradient: Tensor) -> None:
    """Compute every extension of ``ctx`` for ``record`` and store the results.

    Args:
        ctx: The active ``backpack`` context.
        record: The forward pass of the extended model.
        gradient: ``∂L/∂output`` from the backward pass.

    Raises:
        ValueError: for a second-order extension without an extended loss, or model
            inputs packfunc cannot pass on (keyword arguments).
    """
    model = record.model
    if record.kwargs:
        raise ValueError("packfunc.compat passes the model's positional inputs only; call the "
                         "extended model without keyword arguments.")
    X = record.args[0] if len(record.args) == 1 else record.args
    model_fn, params = pf.functional(model)
    results: dict[str, dict[str, Any]] = {}
    passes: dict[bool, Backprop] = {}
    for ext in ctx.extensions:
        job = ext.job()
        if job.second_order and record.loss is None:
            raise ValueError(
                f"{type(ext).__name__} needs the loss function: extend it "
                "(lossfunc = extend(lossfunc)) and apply it to the model's output directly.")
        if ctx.debug:
            print(f"[packfunc.compat] {type(ext).__name__} on {type(model).__name__}: {job.name}")
        loss, y = record.loss if job.second_order else (GivenGradient(gradient), gradient)
        if job.kind == "quantity" and job.second_order not in passes:
            passes[job.second_order] = Backprop(model_fn, params, X, y, loss,
                                                watched=(record.recorder, model.output))
        with torch.no_grad():
            if job.kind == "quantity":
                results[ext.savefield] = evaluate(passes[job.second_order], (job.name,),
                                                  **dict(job.options))[job.name]
            else:
                results[ext.savefield] = _compute(job, model_fn, params, X, y, loss)
        results[ext.savefield].update(_module_extensions(ext, job, record, gradient))
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    for ext in ctx.extensions:
        for name in names:
            setattr(model.get_parameter(name), ext.savefield, results[ext.savefield][name])
    if ctx.extension_hook is not None:
        for module in _backward_order(record):
            ctx.extension_hook(module)
    if not ctx.retain_graph:
        _forget_inputs_and_outputs(record)


def _compute(job: Job, model_fn: Callable, params: dict[str, Tensor], X: Any, y: Any,
             loss: nn.Module) -> dict[str, Any]:
    """Run a Kronecker or block-product job with the functional API, by parameter name."""
    options = dict(job.options)
    if job.kind == "kronecker":
        return KRONECKER[job.name](model_fn, params, X, y, loss=loss, **options)
    product = BLOCKS[job.name]
    return {name: partial(_block_product, product, name, model_fn, params, X, y, loss, options)
            for name in params}


def _block_product(product: Callable, name: str, model_fn: Callable, params: dict[str, Tensor],
                   X: Any, y: Any, loss: nn.Module, options: dict, mat: Tensor) -> Tensor:
    """``block(name) @ mat`` for ``mat`` of shape ``[V, *param.shape]``."""
    mats = {key: mat if key == name else None for key in params}
    return product(model_fn, params, X, y, mats, loss=loss, **options)[name]


def _module_extensions(ext: BackpropExtension, job: Job, record: ForwardRecord,
                       gradient: Tensor) -> dict[str, Any]:
    """Results of the module extensions registered on ``ext``, by parameter name."""
    if not ext.module_extensions or job.kind != "quantity":
        return {}
    found: dict[str, Any] = {}
    output = record.model.output
    backproped = None
    for prefix, module in record.model.named_modules():
        extension = ext.module_extensions.get(type(module))
        if extension is None or getattr(module, "output", None) is None:
            continue
        g_out = torch.autograd.grad(output, module.output, gradient, retain_graph=True)
        g_inp = (None,)
        if job.second_order:
            backproped = _backproped(job, record, output, module.output)
        for name, _ in module.named_parameters(recurse=False):
            if extension.handles(name):
                method = getattr(extension, name)
                key = f"{prefix}.{name}" if prefix else name
                found[key] = method(ext, module, g_inp, g_out, backproped)
    return found


def _backproped(job: Job, record: ForwardRecord, output: Tensor, target: Tensor) -> Tensor:
    """Square-root columns of the GGN w.r.t. ``target``, ``[K, *target.shape]``."""
    loss, y = record.loss
    options = dict(job.options)
    roots = hessian_factors(loss, output.detach(), y, mc_samples=options.get("mc_samples"))
    (columns,) = torch.autograd.grad(output, target, roots.all(), retain_graph=True,
                                     is_grads_batched=True)
    return columns


def _backward_order(record: ForwardRecord) -> list[nn.Module]:
    """The extended modules, loss first, then the model from its last module to its first."""
    modules = list(reversed(list(record.model.modules())))
    return ([record.loss[0]] if record.loss else []) + modules


def _forget_inputs_and_outputs(record: ForwardRecord) -> None:
    """Drop the stored inputs and outputs: nothing outlives the backward pass."""
    for module in _backward_order(record):
        for attribute in ("input0", "output"):
            if hasattr(module, attribute):
                delattr(module, attribute)
