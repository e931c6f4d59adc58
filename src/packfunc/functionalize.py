"""Turn modules into pure functions and handle pytrees of parameters and inputs."""

from __future__ import annotations

import contextlib
import functools
import traceback
import types
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple, TypeVar, cast

import optree
import torch
from torch import Tensor, nn
from torch.autograd import forward_ad
from torch.nn.utils import parametrize
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from packfunc.engine.autodiff import (
    PACKED_UNDER_VMAP,
    is_untransformable_function,
    mutates_captured_tensor,
)
from packfunc.engine.model_state import (
    attribute_restorer,
    packfunc_passes,
    restoring_attributes,
    submodules,
)
from packfunc.engine.nested_encoders import refusing_nested_encoders
from packfunc.engine.precision import autocast_enabled, forward_precision_only, serving_autocast
from packfunc.engine.vmap_checks import poisoned, poisoning_results
from packfunc.reparametrize import call_with_tensors
from packfunc.types import ModelFn

F = TypeVar("F", bound=Callable[..., Any])

_MODULES: weakref.WeakKeyDictionary[ModelFn, weakref.ref[nn.Module]] = weakref.WeakKeyDictionary()
"""The module behind each model function of :func:`functional` (weakly: a cache keyed by the
module may hold its function)."""


def functional(module: nn.Module) -> tuple[ModelFn, dict[str, Tensor]]:
    """Split a module into a pure function and a dict of its parameters.

    The returned ``model_fn(params, X)`` evaluates ``module`` with the given
    parameters (as ``torch.func.functional_call`` does, see
    :func:`~packfunc.reparametrize.call_with_tensors`); buffers (e.g. BatchNorm
    running statistics) and the train/eval mode are read from the module at
    call time. ``X`` is passed as ``module(X)``; a tuple is unpacked as
    ``module(*X)`` and a dict as ``module(**X)``. ``params`` may hold only some of
    the names: the others are the module's own tensors, as in ``functional_call``.
    That is how to leave out a frozen backbone: every quantity is then taken of the
    given parameters only, and the backbone costs a plain forward through it.

    The returned ``params`` do **not** require grad: packfunc's functions then
    take their fastest path (plain autograd inside; with leaves that require
    grad they build differentiable results through ``torch.func``, about 3x
    slower on an MLP). To differentiate through ``model_fn`` or a packfunc
    result yourself, use ``torch.func.grad``/``vjp`` (they need nothing), or
    for ``torch.autograd.grad``/``backward`` make leaves that require grad:
    ``params = {k: p.requires_grad_() for k, p in params.items()}``.

    A module compiled with ``torch.compile`` is run as its original module, eagerly
    (the values are the eager ones; parameter names have no ``_orig_mod.`` prefix).

    Args:
        module: Any ``torch.nn.Module``.

    Returns:
        ``(model_fn, params)`` where ``params`` maps parameter names to
        detached tensors (``requires_grad=False``) sharing storage with the
        module's parameters.

    Example:
        >>> model_fn, params = functional(torch.nn.Linear(3, 2))
        >>> model_fn(params, torch.zeros(4, 3)).shape
        torch.Size([4, 2])
        >>> params["weight"].requires_grad
        False
        >>> model_fn({"bias": torch.zeros(2)}, torch.zeros(4, 3)).shape  # the module's weight
        torch.Size([4, 2])
        >>> leaves = {k: p.requires_grad_() for k, p in params.items()}  # for torch.autograd
        >>> torch.autograd.grad(model_fn(leaves, torch.ones(4, 3)).sum(),
        ...                     leaves["bias"])[0]
        tensor([4., 4.])
    """
    module = uncompiled(module)
    params = {name: p.detach() for name, p in module.named_parameters()}

    def model_fn(params: dict[str, Tensor], X: Any) -> Tensor:
        return _call_module(module, params, X)

    _MODULES[model_fn] = weakref.ref(module)
    return model_fn, params


def weakly_bound(module: nn.Module) -> ModelFn:
    """:func:`functional`'s model function, holding ``module`` weakly.

    For a cache of model functions keyed by the module (so that packfunc's plan, cached
    per model function, serves every call on that module): the function does not keep
    its key alive.

    Args:
        module: The model.

    Returns:
        ``model_fn(params, X)``; it raises ``ReferenceError`` once ``module`` is gone.

    Example:
        >>> layer = torch.nn.Linear(3, 2)
        >>> fn = weakly_bound(layer)
        >>> fn(functional(layer)[1], torch.zeros(4, 3)).shape, module_of(fn) is layer
        (torch.Size([4, 2]), True)
    """
    ref = weakref.ref(uncompiled(module))

    def model_fn(params: dict[str, Tensor], X: Any) -> Tensor:
        found = ref()
        if found is None:
            raise ReferenceError("the module of this model function was deleted")
        return _call_module(found, params, X)

    _MODULES[model_fn] = ref
    return model_fn


def _call_module(module: nn.Module, params: dict[str, Tensor], X: Any) -> Tensor:
    """``module`` on ``X`` (a tuple: positional inputs; a dict: keyword inputs) with ``params``.

    In one of packfunc's own passes (see :mod:`packfunc.engine.model_state`), the
    attributes the call sets on the model are put back afterwards.
    """
    if isinstance(X, tuple) and not isinstance(X, PackedSequence):  # (a PackedSequence: one)
        args, kwargs = X, {}
    else:
        args, kwargs = ((), X) if isinstance(X, dict) else ((X,), {})
    put_back = attribute_restorer(module) if restoring_attributes() else None
    try:
        with eagerly_if_compiled_in_place(module):
            return cast(Tensor, call_with_tensors(module, params, args, kwargs))
    finally:
        if put_back is not None:
            put_back()


def eagerly_if_compiled_in_place(module: nn.Module) -> contextlib.AbstractContextManager[Any]:
    """Run ``module`` eagerly where it or a submodule was compiled by ``Module.compile()``.

    ``model.compile()`` compiles in place (there is no wrapper to unwrap, as for
    ``torch.compile(model)``); compiled code would bypass packfunc's modes. Its
    ``force_eager`` stance runs the module's own code, leaving the module as it is.

    Args:
        module: The model.

    Returns:
        A context manager.

    Raises:
        ValueError: on PyTorch before 2.6 (no stance), naming the fix.

    Example:
        >>> layer = torch.nn.Linear(2, 2)
        >>> layer.compile()
        >>> with eagerly_if_compiled_in_place(layer):
        ...     layer(torch.zeros(1, 2)).shape
        torch.Size([1, 2])
    """
    if all(getattr(sub, "_compiled_call_impl", None) is None for sub in submodules(module)):
        return contextlib.nullcontext()
    if not hasattr(torch.compiler, "set_stance"):
        raise ValueError(
            "the model (or a submodule) was compiled in place with .compile(); packfunc runs "
            "models eagerly, which this PyTorch cannot do for it (torch.compiler.set_stance "
            "needs PyTorch 2.6). Pass torch.compile(model) instead: packfunc unwraps it."
        )
    return cast(contextlib.AbstractContextManager[Any], torch.compiler.set_stance("force_eager"))


def is_compiled(value: Any) -> bool:
    """Whether ``value`` is a module or function wrapped by ``torch.compile``.

    Args:
        value: Anything.

    Returns:
        ``True`` for ``torch.compile``'s ``OptimizedModule`` and compiled functions.

    Example:
        >>> is_compiled(torch.nn.Linear(2, 2)), is_compiled(torch.compile(torch.nn.Linear(2, 2)))
        (False, True)
    """
    compiled_module = type(value).__name__ == "OptimizedModule" and hasattr(value, "_orig_mod")
    return compiled_module or hasattr(value, "_torchdynamo_orig_callable")


def uncompiled(module: nn.Module) -> nn.Module:
    """The module ``torch.compile`` wrapped, or ``module`` itself if it is not compiled.

    packfunc runs models eagerly, inside its own ``TorchFunctionMode``s, which
    compiled code does not pass through.

    Args:
        module: A module, compiled or not.

    Returns:
        The original module.

    Raises:
        ValueError: if a submodule is compiled (only the whole model can be unwrapped
            without changing it).

    Example:
        >>> layer = torch.nn.Linear(2, 2)
        >>> uncompiled(torch.compile(layer)) is layer
        True
    """
    while is_compiled(module):
        module = getattr(module, "_orig_mod")  # noqa: B009 (a Tensor | Module attribute)
    inner = [name for name, sub in module.named_modules() if name and is_compiled(sub)]
    if inner:
        raise ValueError(
            f"the submodules {inner} are compiled with torch.compile; packfunc runs models "
            "eagerly in its own modes, which compiled code bypasses. Pass the model with its "
            "uncompiled submodules (compiling the whole model is fine: packfunc unwraps it)."
        )
    return module


def public_entry(function: F) -> F:
    """Let a public function run inside ``torch.inference_mode()`` and ``torch.autocast``.

    packfunc differentiates internally, which inference mode forbids: the call runs
    with inference mode off, on normal copies of any inference tensors it was given
    (tensors made inside ``torch.inference_mode()``). Under ``torch.autocast`` only the
    model's forward passes autocast; statistics are formed in the parameters' dtype
    (see :mod:`packfunc.engine.precision`). Inside a function compiled with
    ``torch.compile``, the call runs eagerly (``torch.compiler.disable``): the compiled
    code breaks its graph around it. Under ``torch.func.vmap``, a check of values that
    fails makes the result NaN (:mod:`packfunc.engine.vmap_checks`). Gradient mode is
    handled by the functions themselves.

    Args:
        function: A public function.

    Returns:
        The same function, callable inside ``torch.inference_mode()``.

    Example:
        >>> double = public_entry(lambda x: torch.func.grad(lambda t: t.square())(x))
        >>> with torch.inference_mode():
        ...     double(torch.tensor(3.0))
        tensor(6.)
    """
    precise = forward_precision_only(function)

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # traced by torch.compile: run eagerly, around it
            return torch.compiler.disable(run)(*args, **kwargs)
        try:
            _refuse_dual_tensors((args, kwargs))
            with _packfunc_call() as failed_checks:
                if not torch.is_inference_mode_enabled():
                    result = precise(*args, **kwargs)
                else:
                    with torch.inference_mode(False):
                        args, kwargs = normal_tensors((args, kwargs))
                        result = precise(*args, **kwargs)
            if isinstance(result, Iterator):  # (per_batch): its steps run after this block
                return _each_step_inside(result, autocast_enabled(), (args, kwargs))
            return poisoned(result, failed_checks)
        except Exception as error:
            clearer = clearer_error(error, (args, kwargs))
            if clearer is None:
                raise
            raise clearer from error

    return run  # type: ignore[return-value]


@contextlib.contextmanager
def _packfunc_call() -> Iterator[list[Tensor]]:
    """Enter packfunc's passes, its nested-encoder refusal and its vmap checks for one call.

    Yields:
        The call's failed-check flags (:func:`~packfunc.engine.vmap_checks.poisoning_results`).

    Example:
        >>> with _packfunc_call() as failed_checks:
        ...     failed_checks
        []
    """
    with packfunc_passes(), refusing_nested_encoders(), poisoning_results() as failed_checks:
        yield failed_checks


def _refuse_dual_tensors(arguments: Any) -> None:
    """Refuse ``torch.autograd.forward_ad`` dual tensors among a public call's arguments.

    packfunc's passes do not carry their tangents: its quantities' tangents came back wrong
    (``batch_l2_grad``'s 0.54 off, ``kflr``'s 1.0) or dropped (a probe). ``torch.func.jvp``
    around the call is exact (its tensors are functorch's, not dual tensors).

    Args:
        arguments: The call's ``(args, kwargs)``.

    Raises:
        ValueError: for a dual tensor, naming ``torch.func.jvp``.

    Example:
        >>> _refuse_dual_tensors(((torch.ones(1),), {}))  # no dual level: nothing to check
    """
    if forward_ad._current_level < 0:  # no dual level entered: no dual tensor exists
        return
    for value in optree.tree_leaves(arguments):
        if (
            isinstance(value, Tensor)
            and not torch._C._functorch.is_functorch_wrapped_tensor(value)
            and forward_ad.unpack_dual(value).tangent is not None
        ):
            raise ValueError(
                "an argument is a torch.autograd.forward_ad dual tensor: packfunc's passes do "
                "not carry its tangent, so the quantities' tangents would be wrong or missing. "
                "Take forward-mode derivatives of a packfunc call with torch.func.jvp instead "
                "(jvp(lambda p: pf.batch_l2_grad(model_fn, p, X, y), (params,), (tangents,)))."
            )


def _each_step_inside(
    steps: Iterator[Any], autocast: tuple[tuple[str, torch.dtype], ...], arguments: Any
) -> Iterator[Any]:
    """A public function's iterator whose every step runs as its call did (:func:`public_entry`).

    Without it a generator's body (``per_batch``'s batches) ran after the call's block had
    closed: outside packfunc's passes, its refusals and its autocast (found by a probe).

    Args:
        steps: What the public function returned.
        autocast: The autocast in force at the call (its forwards run under it).
        arguments: The call's ``(args, kwargs)``, to make errors clearer.

    Yields:
        Each step's result.
    """
    while True:
        try:
            with (
                _packfunc_call() as failed_checks,
                serving_autocast(autocast),
                torch.inference_mode(False),
            ):
                step = next(steps, _DONE)
        except Exception as error:
            clearer = clearer_error(error, arguments)
            if clearer is None:
                raise
            raise clearer from error
        if step is _DONE:
            return
        yield poisoned(step, failed_checks)


_DONE = object()
"""The end of an iterator :func:`_each_step_inside` runs."""


_COMPILED_INSIDE = (
    "a function compiled with torch.compile runs inside the model and failed under packfunc's "
    "recording ({error}): packfunc follows the model's calls eagerly, which compiled code "
    "hides. Compile the whole model instead (torch.compile(model) or model.compile(): packfunc "
    "runs it eagerly), or call that function uncompiled inside it."
)


def compiled_inside(error: BaseException) -> bool:
    """Whether ``error`` was raised by ``torch.compile``'s tracer beneath a packfunc call.

    A public function runs eagerly (inside compiled code it is run around it), so a frame of
    dynamo's compiler (``torch/_dynamo/convert_frame.py``) below it belongs to a compiled
    function the model calls (one that takes a parameter: its tracing meets packfunc's
    recording and fails). A function run around compiled code (``torch.compiler.disable``,
    whose wrapper is dynamo's too) compiles nothing there.

    Args:
        error: What a public function raised.

    Returns:
        Whether its traceback passes through dynamo's compiler.

    Example:
        >>> compiled_inside(ValueError("plain"))
        False
    """
    frames = traceback.walk_tb(error.__traceback__)
    compiler = "torch/_dynamo/convert_frame.py"
    return any(compiler in f.f_code.co_filename.replace("\\", "/") for f, _ in frames)


def _first_line(error: BaseException) -> str:
    """``error``'s type and the first line of its message."""
    lines = str(error).splitlines()
    return f"{type(error).__name__}: {lines[0][:160]}" if lines else type(error).__name__


def clearer_error(error: Exception, values: Any) -> ValueError | None:
    """The error naming the fix for one of torch's that a model packfunc cannot run gives.

    Any error raised beneath a compiled function the model calls (:func:`compiled_inside`);
    otherwise only torch's ``RuntimeError``s (packfunc's own refusals stay as they are).

    Args:
        error: What torch raised inside a packfunc pass.
        values: The call's arguments (a pytree): its inputs, for the messages on them.

    Returns:
        The :class:`ValueError` to raise from ``error``, or ``None`` (raise it as it is).

    Example:
        >>> clearer_error(RuntimeError("an unrelated failure"), ()) is None
        True
    """
    if compiled_inside(error):
        return ValueError(_COMPILED_INSIDE.format(error=_first_line(error)))
    if not isinstance(error, RuntimeError):
        return None
    if is_untransformable_function(error):
        return ValueError(_UNTRANSFORMABLE)
    if PACKED_UNDER_VMAP in str(error):  # (packfunc's own vmap loops instead: the caller's)
        return ValueError(_PACKED_UNDER_YOUR_VMAP)
    if mutates_captured_tensor(error):
        return ValueError(_MUTATES_CAPTURED)
    unsplittable = _unsplittable_among(values)
    symptom = any(word in str(error) for word in _UNSPLITTABLE_SYMPTOMS)
    if unsplittable is not None and symptom:  # (a path that checks no inputs: explain)
        return ValueError(_unsplittable_input(unsplittable, "an input"))
    if "inference tensor" in str(error).lower():
        return ValueError(_INFERENCE_TENSORS)
    if isinstance(error, NotImplementedError) and "'Sparse" in str(error):
        return ValueError(_SPARSE_GRADIENTS)  # (from the 'SparseCPU' backend)
    if _channels_last_among(values) and any(
        symptom in str(error) for symptom in _CHANNELS_LAST_SYMPTOMS
    ):
        return ValueError(_CHANNELS_LAST)
    return None


def _channels_last_among(values: Any) -> bool:
    """Whether a tensor among ``values`` (a pytree) is laid out channels-last."""
    return any(
        isinstance(t, Tensor)
        and t.dim() in (4, 5)
        and t.stride() != _contiguous_strides(t.shape)  # (a channel of one: is_contiguous too)
        and t.is_contiguous(
            memory_format=torch.channels_last if t.dim() == 4 else torch.channels_last_3d
        )
        for t in optree.tree_leaves(values)
    )


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


_CHANNELS_LAST_SYMPTOMS = (
    "querying is_contiguous inside of vmap",
    "view size is not compatible with input tensor's size and stride",
)
"""What torch 2.13 says of channels-last tensors under torch.func transforms."""


_CHANNELS_LAST = (
    "the model's parameters or inputs are laid out channels-last (see the error above), which "
    "torch's function transforms this quantity differentiates through cannot run in torch "
    "2.13 (max pooling's and group norm's derivatives query or view their layout). Compute it "
    "with model.to(memory_format=torch.contiguous_format) and X.contiguous(); per-sample "
    "gradients, their moments, clipped sums, GGN diagonals and Kronecker factors run "
    "channels-last as it is."
)


_PACKED_UNDER_YOUR_VMAP = (
    "the model packs its batch (pack_padded_sequence) inside torch.func.vmap over stacked "
    "batches: a packed batch's length depends on its samples' lengths, which vmap cannot "
    "batch. Call packfunc once per batch (a Python loop); vmap over an ensemble's stacked "
    "parameters works."
)

_UNTRANSFORMABLE = (
    "model_fn calls a custom torch.autograd.Function (or a torch.library.custom_op) that "
    "torch.func cannot transform (see the error above), and this quantity differentiates "
    "through it with torch.func. Give the Function a setup_context staticmethod and a vmap "
    "rule (generate_vmap_rule=True), see "
    "https://pytorch.org/docs/stable/notes/extending.func.html; give a custom op a vmap rule "
    "(torch.library.register_vmap) beside its autograd one. A hook registered with "
    "register_full_backward_hook wraps its module's inputs in such a Function of torch's "
    "own: remove it (handle.remove()) while computing this. Per-sample gradients, their "
    "moments, clipped sums, GGN diagonals and Kronecker factors run such a Function as it is."
)


_MUTATES_CAPTURED = (
    "model_fn changes in place a tensor that torch.func does not differentiate (a buffer: a "
    "counter, a running statistic; or its input X: x.add_(...); see the error above), and "
    "this quantity differentiates through the model with torch.func, which cannot run that. "
    "Call model.eval() or stop the update in the forward, and change the input out of place "
    "(x = x + 1), before computing this; per-sample gradients, their moments, clipped sums, "
    "GGN diagonals and Kronecker factors run such a model as your forward does."
)


_INFERENCE_TENSORS = (
    "the model's parameters, buffers or the batch include tensors made under "
    "torch.inference_mode(), or its forward makes one in a torch.inference_mode() block (see "
    "the error above), which autograd cannot differentiate or update outside it, for "
    "packfunc as for a plain backward pass. In the forward, use torch.no_grad() for such a "
    "block (the same values, a constant to autograd); otherwise make them outside inference "
    "mode (build the model, load its state_dict there), or pass normal copies ({k: v.clone() "
    "for k, v in params.items()}, cloned outside inference mode); packfunc called inside "
    "torch.inference_mode() uses such copies of what it is given."
)

_SPARSE_GRADIENTS = (
    "a layer of model_fn gives sparse gradients (nn.Embedding or nn.EmbeddingBag with "
    "sparse=True; see the error above), which this quantity cannot differentiate further. "
    "Build it with sparse=False: the values are the same, and packfunc forms per-sample "
    "gradients and curvature of its rows itself."
)


_UNSPLITTABLE_SYMPTOMS = ("Sparse", "sparse", "Nested", "nested", "strides", "layout")
"""Words of torch's errors on sparse or nested tensors (a model's own error keeps its own)."""

_SPARSE_LAYOUTS = frozenset(
    {torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc}
)
"""The layouts of sparse tensors."""


def refuse_unsplittable_inputs(X: Any) -> None:
    """Refuse inputs packfunc cannot take samples of: sparse and nested tensors.

    packfunc runs the model on single samples and on rows of the batch, under torch's
    function transforms: a sparse tensor has neither strides nor per-sample rows there,
    and a nested tensor's samples have lengths of their own (torch's errors name neither,
    and a sparse input's reads like a layer's sparse gradients).

    Args:
        X: The inputs, a tensor or a pytree.

    Raises:
        ValueError: naming the input and the dense tensor to pass instead.

    Example:
        >>> refuse_unsplittable_inputs({"x": torch.ones(2, 3), "scale": 2.0})
    """
    paths, leaves, _ = optree.tree_flatten_with_path(X)
    for path, leaf in zip(paths, leaves):
        if _is_unsplittable(leaf):
            name = input_name(path)
            raise ValueError(_unsplittable_input(leaf, name, name))


def input_name(path: tuple[Any, ...]) -> str:
    """An input's name from its path in ``X``.

    Example:
        >>> input_name(("ids",)), input_name((0,)), input_name(())
        ("X['ids']", 'X[0]', 'X')
    """
    return "X" + "".join(f"[{key!r}]" for key in path)


def _is_unsplittable(value: Any) -> bool:
    """Whether ``value`` is a sparse or nested tensor."""
    return isinstance(value, Tensor) and (value.is_nested or value.layout in _SPARSE_LAYOUTS)


def _unsplittable_among(values: Any) -> Tensor | None:
    """The first sparse or nested tensor among ``values`` (a pytree), if any."""
    return next((t for t in optree.tree_leaves(values) if _is_unsplittable(t)), None)


def _unsplittable_input(tensor: Tensor, what: str, name: str = "X") -> str:
    """The refusal of a sparse or nested input ``what``, its fix written for ``name``."""
    if tensor.is_nested:
        return (
            f"{what} is a nested tensor (torch.nested, layout {tensor.layout}): its samples "
            "have lengths of their own, and packfunc needs every input dense with the batch "
            f"first. Pad it to a dense tensor with a mask: torch.nested.to_padded_tensor({name}, "
            "0.0) is [N, T_max, ...], and a boolean mask [N, T_max] of the real positions lets "
            "model_fn leave the padding out (a masked mean, an attention mask)."
        )
    return (
        f"{what} is a sparse tensor (layout {tensor.layout}): packfunc runs the model on "
        "single samples and rows of the batch under torch's function transforms, which "
        f"cannot take them from a sparse tensor. Pass it dense: {name}.to_dense() (the model "
        "computes the same values)."
    )


def normal_tensors(tree: Any) -> Any:
    """``tree`` with every inference tensor replaced by a normal copy (outside inference mode).

    Args:
        tree: Any pytree.

    Returns:
        The same pytree; tensors made inside ``torch.inference_mode()`` are cloned.

    Example:
        >>> with torch.inference_mode():
        ...     x = torch.ones(2)
        >>> normal_tensors({"x": x})["x"].is_inference()
        False
    """
    return optree.tree_map(_normal_tensor, tree)


def _normal_tensor(value: Any) -> Any:
    """A normal copy of an inference tensor; anything else as it is."""
    return value.clone() if isinstance(value, Tensor) and value.is_inference() else value


def module_of(model_fn: ModelFn) -> nn.Module | None:
    """Return the module behind a ``model_fn``, else ``None``.

    That of :func:`functional`'s model functions, or the modules a function closes over or
    names as globals, directly, in a dict, list or tuple, or through such a model function
    (``lambda p, X: model_fn(p, X).logits``, ``lambda p, X: functional_call(model, p, X)
    - teacher(X)``): discovery keeps their buffers and attributes as they were and knows
    their buffers for constants.

    Args:
        model_fn: Any model function.

    Returns:
        The module; a module holding them under their names in the function (registered
        nowhere) for a function that closes over several; ``None`` for one that closes over
        none.

    Example:
        >>> layer, teacher = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
        >>> fn = functional(layer)[0]
        >>> module_of(fn) is layer, module_of(lambda p, X: fn(p, X) * 2) is layer
        (True, True)
        >>> dict(module_of(lambda p, X: fn(p, X) - teacher(X)).named_children())
        {'fn': Linear(in_features=3, out_features=2, bias=True), 'teacher': Linear(...)}
        >>> module_of(lambda p, X: X)
    """
    found = _registered_module(model_fn)
    if found is not None:
        return found
    named: dict[int, tuple[str, nn.Module]] = {}
    used = read_names(model_fn)
    for name, value in closed_over(model_fn):
        for key, module in _modules_in(name, value, used):
            named.setdefault(id(module), (key, module))
    if len(named) > 1:
        return _holder(list(named.values()))
    return next((module for _, module in named.values()), None)


def is_own_model_function(model_fn: Any) -> bool:
    """Whether ``model_fn`` is one of :func:`functional`'s (or :func:`weakly_bound`'s).

    Such a function reads nothing from outside but its module: no closed-over setting
    can change what it computes.

    Example:
        >>> is_own_model_function(functional(torch.nn.Linear(3, 2))[0])
        True
        >>> is_own_model_function(lambda p, X: X)
        False
    """
    return _registered_module(model_fn) is not None


def run_model(model_fn: ModelFn, params: Any, X: Any) -> Any:
    """``model_fn(params, X)``, put back in packfunc's own passes as the user's model would be.

    In one of packfunc's own passes, what it sets on the modules it reads from outside
    (:func:`module_of`) is put back afterwards. :func:`functional`'s model functions put their
    module's attributes back themselves; a hand-written one (``lambda p, X:
    functional_call(model, p, (X,))``, a closed-over teacher) counts as running the modules
    it closes over, whose counters and logs then show one forward per call, as the user's
    own forward leaves them.

    Args:
        model_fn: Any model function.
        params: Its parameters.
        X: Its inputs.

    Returns:
        What ``model_fn`` returns.

    Example:
        >>> layer = torch.nn.Linear(3, 2)
        >>> run_model(lambda p, X: layer(X), {}, torch.ones(1, 3)).shape
        torch.Size([1, 2])
    """
    if not restoring_attributes() or is_own_model_function(model_fn):
        return model_fn(params, X)
    put_back = attribute_restorer(module_of(model_fn))
    try:
        return model_fn(params, X)
    finally:
        put_back()


def _registered_module(model_fn: Any) -> nn.Module | None:
    """The module of one of :func:`functional`'s model functions, else ``None``."""
    try:
        ref = _MODULES.get(model_fn)
    except TypeError:  # not weakly referenceable: not one of ours
        return None
    return None if ref is None else ref()


def closed_over(function: Any, depth: int = 2) -> list[tuple[str, Any]]:
    """The values a function reads from outside, by name.

    Its closure cells, the globals it names and its default arguments; a ``partial``'s
    function, arguments and keywords; and, ``depth`` functions deep, those of the plain
    functions among them (a wrapper of a wrapper of the model).

    Args:
        function: Any callable.
        depth: How many levels of functions among the values to open.

    Returns:
        ``(name, value)`` pairs, a value read twice once.

    Example:
        >>> scale = 2.0
        >>> [name for name, _ in closed_over(lambda x: x * scale)]
        ['scale']
    """
    found: dict[int, tuple[str, Any]] = {}
    for name, value in _read_from_outside(function):
        found.setdefault(id(value), (name, value))
        if depth and (isinstance(value, (types.FunctionType, functools.partial))):
            for entry in closed_over(value, depth - 1):
                found.setdefault(id(entry[1]), entry)
    return list(found.values())


def _read_from_outside(function: Any) -> list[tuple[str, Any]]:
    """A function's closure cells, named globals and defaults.

    A ``partial``'s are its function, arguments and keywords; a bound method's, the object
    it is bound to and its function's.
    """
    if isinstance(function, types.MethodType):  # (a module's own model_fn method: the module)
        return [("self", function.__self__), *_read_from_outside(function.__func__)]
    if isinstance(function, functools.partial):
        arguments = [(f"arg{i}", a) for i, a in enumerate(function.args)]
        return [("func", function.func), *arguments, *function.keywords.items()]
    code, found = getattr(function, "__code__", None), getattr(function, "__globals__", {})
    values = []
    cells = getattr(function, "__closure__", None) or ()
    for name, cell in zip(code.co_freevars if code is not None else (), cells, strict=False):
        with contextlib.suppress(ValueError):  # an empty cell
            values.append((name, cell.cell_contents))
    names = code.co_names if code is not None else ()
    values += [(name, found[name]) for name in names if name in found]
    defaults = getattr(function, "__defaults__", None) or ()
    values += [(f"default{i}", value) for i, value in enumerate(defaults)]
    values += list((getattr(function, "__kwdefaults__", None) or {}).items())
    return values


def _modules_in(name: str, value: Any, used: frozenset[str]) -> list[tuple[str, nn.Module]]:
    """The modules in a closed-over value, by name: itself, or those among its entries.

    Those of a dict, list or tuple of a few entries (a holder, not a registry of models
    the function picks one of) are named ``holder_net`` for ``holder["net"]``; those an
    object that is not a module holds as attributes that the function's code names
    (``used``: a trainer whose method reads ``self.model``, not its EMA copy),
    ``trainer_model``. A :func:`functional` model function counts as its module.

    Example:
        >>> class Trainer:
        ...     def __init__(self): self.model, self.ema = torch.nn.Linear(2, 1), torch.nn.ReLU()
        >>> [key for key, _ in _modules_in("trainer", Trainer(), frozenset({"model"}))]
        ['trainer_model']
    """
    attributes = object_attributes(value)
    if isinstance(value, dict) and len(value) <= _HOLDER_ENTRIES:
        entries = [(f"{name}_{key}", v) for key, v in value.items()]
    elif isinstance(value, (list, tuple)) and len(value) <= _HOLDER_ENTRIES:
        entries = [(f"{name}_{i}", v) for i, v in enumerate(value)]
    elif attributes is not None:
        entries = [(f"{name}_{key}", v) for key, v in attributes.items() if key in used]
    else:
        entries = [(name, value)]
    found = [(k, v if isinstance(v, nn.Module) else _registered_module(v)) for k, v in entries]
    return [(key, module) for key, module in found if module is not None]


_NOT_HOLDERS = (
    nn.Module,
    Tensor,
    type,
    types.ModuleType,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    functools.partial,
    list,
    tuple,
    dict,
)


def object_attributes(value: Any) -> dict[str, Any] | None:
    """The own attributes of an object that may hold the model (a trainer), else ``None``.

    Its ``__dict__`` and slots. ``None`` for a module, tensor, container, class, Python module
    or function, an object without attributes, and one of more than 64 (a configuration or
    a registry, not a holder).

    Example:
        >>> class Slotted:
        ...     __slots__ = ("model",)
        >>> held = Slotted(); held.model = 1
        >>> object_attributes(held), object_attributes(3)
        ({'model': 1}, None)
    """
    if isinstance(value, _NOT_HOLDERS):
        return None
    own = getattr(value, "__dict__", None)
    found: dict[str, Any] = dict(own) if type(own) is dict else {}
    for kind in type(value).__mro__:
        slots = kind.__dict__.get("__slots__", ())
        for slot in (slots,) if isinstance(slots, str) else slots:
            if slot not in ("__dict__", "__weakref__") and slot not in found:
                with contextlib.suppress(AttributeError):
                    found[slot] = getattr(value, slot)
    return found if 0 < len(found) <= _OBJECT_ATTRIBUTES else None


_OBJECT_ATTRIBUTES = 64
"""The most attributes of an object :func:`_modules_in` looks among."""


def read_names(function: Any, depth: int = 2) -> frozenset[str]:
    """The attribute and global names a function's code reads.

    Also those of the functions it closes over and, for a method, of the methods of its
    object that it names (``self._logits(...)``), ``depth`` deep; and of nested functions.

    Example:
        >>> sorted(read_names(lambda p, X: trainer.model(X)))
        ['model', 'trainer']
    """
    names: set[str] = set()
    stack = [(function, depth)]
    while stack:
        current, level = stack.pop()
        owner = None
        if isinstance(current, types.MethodType):
            current, owner = current.__func__, getattr(current, "__self__", None)
        if isinstance(current, functools.partial):
            current = current.func
        code = getattr(current, "__code__", None)
        read = _code_names(code) if isinstance(code, types.CodeType) else frozenset()
        names |= read
        if level:
            stack += [
                (value, level - 1)
                for _, value in _read_from_outside(current)
                if isinstance(value, (types.FunctionType, types.MethodType, functools.partial))
            ]
            stack += [(method, level - 1) for method in _methods_named(owner, read)]
    return frozenset(names)


@functools.lru_cache(maxsize=1024)
def _code_names(code: types.CodeType) -> frozenset[str]:
    """The attribute and global names ``code`` and the code nested in it read.

    Example:
        >>> sorted(_code_names((lambda x: x.weight + torch.ones(1)).__code__))
        ['ones', 'torch', 'weight']
    """
    names: set[str] = set()
    codes = [code]
    while codes:
        found = codes.pop()
        names.update(found.co_names)
        codes += [c for c in found.co_consts if isinstance(c, types.CodeType)]
    return frozenset(names)


def _methods_named(owner: object, names: frozenset[str]) -> list[types.MethodType]:
    """The methods and property getters of ``owner`` (in Python on its class) among ``names``.

    Bound to ``owner``.

    Only for an object that is not a module: a module's whole tree is walked anyway.

    Example:
        >>> class Trainer:
        ...     def step(self): ...
        >>> [m.__name__ for m in _methods_named(Trainer(), {"step", "model"})]
        ['step']
    """
    if owner is None or isinstance(owner, (type, nn.Module)):
        return []
    found = []
    for name in sorted(names):
        # (the class's own attribute, as inspect.getattr_static finds it, at a tenth of its cost)
        owners = (c.__dict__ for c in type(owner).__mro__)
        attribute = next((entries[name] for entries in owners if name in entries), None)
        if isinstance(attribute, property):  # (its getter reads the object too)
            attribute = attribute.fget
        if isinstance(attribute, types.FunctionType):
            found.append(types.MethodType(attribute, owner))
    return found


_HOLDER_ENTRIES = 8
"""The most entries of a dict, list or tuple :func:`_modules_in` looks into."""


def _holder(named: list[tuple[str, nn.Module]]) -> nn.Module:
    """A module holding ``named`` under their names (where a name cannot be one: its index).

    Registered nowhere: the modules themselves are not changed.
    """
    holder = nn.Module()
    for i, (name, module) in enumerate(named):
        key = str(name).replace(".", "_")
        if not key or hasattr(holder, key):
            key = str(i)
        holder.add_module(key, module)
    return holder


def wraps_module_of(model_fn: ModelFn, wrapper: F) -> F:
    """Let ``wrapper``, a function around ``model_fn``, count as running the same module.

    Discovery reads the module's buffers and training flags (see :func:`module_of`).

    Args:
        model_fn: A model function from :func:`functional` (anything else: no effect).
        wrapper: A function that calls it.

    Returns:
        ``wrapper``.

    Example:
        >>> layer = torch.nn.Linear(3, 2)
        >>> fn = wraps_module_of(functional(layer)[0], lambda p, X: X)
        >>> module_of(fn) is layer
        True
    """
    module = module_of(model_fn)
    if module is not None:
        _MODULES[wrapper] = weakref.ref(module)
    return wrapper


def check_no_cached_parametrizations(model_fn: ModelFn) -> None:
    """Refuse to run inside ``torch.nn.utils.parametrize.cached()`` on a parametrized model.

    There a parametrized weight is computed once and kept: the parameters packfunc passes in
    (``original``) never reach it (its per-sample quantities came out zero, silently), and
    a weight computed from packfunc's tensors would stay in the cache, cut off from the
    model's own parameters, for the caller's next backward pass.

    Args:
        model_fn: The model function (of :func:`packfunc.functional`: its module is looked
            at; any other is refused while the cache is on).

    Raises:
        ValueError: naming the fix.
    """
    if not parametrize._cache_enabled:
        return
    module = module_of(model_fn)
    if module is not None and not any(parametrize.is_parametrized(m) for m in module.modules()):
        return
    raise ValueError(
        "packfunc was called inside torch.nn.utils.parametrize.cached(), which computes each "
        "parametrized weight once and keeps it: the parameters packfunc passes in would not "
        "reach it (zero per-sample quantities), and the cache would keep packfunc's weight. "
        "Call packfunc outside the cached() block."
    )


def check_model_arguments(model_fn: Any, params: Any) -> None:
    """Check that ``model_fn`` and ``params`` are a pure function and its parameter pytree.

    Every public function calls this first, so that passing the module itself, or
    ``list(model.parameters())`` to a ``model_fn`` that expects the dict of
    :func:`functional`, fails with an error naming the fix.

    Args:
        model_fn: What was passed as ``model_fn``.
        params: What was passed as ``params``.

    Raises:
        TypeError: if ``model_fn`` is a module, not callable or compiled, if ``params`` is a
            module or an iterator, or if a ``model_fn`` from :func:`functional`
            gets something other than a dict of its parameters.
        ValueError: inside ``torch.nn.utils.parametrize.cached()`` on a parametrized model
            (see :func:`check_no_cached_parametrizations`).

    Example:
        >>> try:
        ...     check_model_arguments(torch.nn.Linear(3, 2), {})
        ... except TypeError as error:
        ...     print(str(error).split(": ")[-1])
        use model_fn, params = pf.functional(model).
    """
    fix = "use model_fn, params = pf.functional(model)"
    if isinstance(model_fn, nn.Module):
        raise TypeError(
            f"model_fn is a {type(model_fn).__name__} module; packfunc needs a pure "
            f"function model_fn(params, X): {fix}."
        )
    if not callable(model_fn):
        raise TypeError(
            f"model_fn must be a function model_fn(params, X); got "
            f"{type(model_fn).__name__}: {fix}."
        )
    if is_compiled(model_fn):
        raise TypeError(
            "model_fn is compiled with torch.compile; packfunc runs it eagerly in its own "
            "modes, which compiled code bypasses. Pass the uncompiled function (or "
            "pf.functional(torch.compile(model)), which runs the original module)."
        )
    if isinstance(params, (nn.Module, Iterator)):
        raise TypeError(
            f"params is a {type(params).__name__}, not a pytree of tensors; {fix} "
            "and pass the params it returns."
        )
    if _registered_module(model_fn) is not None and not isinstance(params, Mapping):
        raise TypeError(
            f"this model_fn (from pf.functional) takes the dict of parameters that "
            f"pf.functional returned (name -> tensor), not a {type(params).__name__}; "
            f"{fix} and pass those params."
        )
    check_no_cached_parametrizations(model_fn)


def flatten_params(params: Any) -> tuple[list[Tensor], optree.PyTreeSpec, list[str]]:
    """Flatten a parameter pytree and check that every leaf is a floating tensor.

    Args:
        params: Pytree (dict, list, tuple, ...) whose leaves are tensors.

    Returns:
        ``(leaves, treespec, names)``; ``names[i]`` is a dotted path naming leaf ``i``.

    Raises:
        TypeError: if a leaf is not a floating-point tensor.
        ValueError: if two leaves get the same name (see :func:`leaf_names`).

    Example:
        >>> leaves, spec, names = flatten_params({"w": torch.zeros(2)})
        >>> names
        ['w']
    """
    paths, leaves, treespec = optree.tree_flatten_with_path(params)
    names = leaf_names(paths)
    for name, leaf in zip(names, leaves):
        if not isinstance(leaf, Tensor):
            raise TypeError(
                f"params leaf {name!r} is a {type(leaf).__name__}, not a tensor; "
                "params must be a pytree of floating-point tensors."
            )
        if not (leaf.is_floating_point() or leaf.is_complex()):
            raise TypeError(
                f"params leaf {name!r} has dtype {leaf.dtype}; gradients need floating-point "
                "params. Keep integer tensors out of params (pass them as buffers or "
                "close over them in model_fn)."
            )
    return leaves, treespec, names


def path_name(path: tuple[Any, ...]) -> str:
    """A pytree leaf's name: its path's keys joined with dots (``"<root>"`` for a bare leaf).

    Example:
        >>> path_name(("layer", 0, "weight")), path_name(())
        ('layer.0.weight', '<root>')
    """
    return ".".join(str(key) for key in path) or "<root>"


def leaf_names(paths: list[tuple[Any, ...]]) -> list[str]:
    """Name every leaf by its path's keys joined with dots; refuse two leaves of one name.

    Names select leaves (``max_norm={name: C}``, results by name): two leaves of one name
    (``{"a": [w0], "a.0": w1}``: both ``a.0``) would both take one entry's option, and the
    noise of DP-SGD be sized for one of them.

    Args:
        paths: The leaves' paths (tuples of keys), as ``optree.tree_flatten_with_path``'s.

    Returns:
        The names, ``"<root>"`` for a bare tensor.

    Raises:
        ValueError: naming the two paths of a name given twice.

    Example:
        >>> leaf_names([("a", 0), ("b",)])
        ['a.0', 'b']
    """
    names = [path_name(path) for path in paths]
    first: dict[str, tuple[Any, ...]] = {}
    for name, path in zip(names, paths):
        if name in first:
            raise ValueError(
                f"two leaves of params are both named {name!r}: the paths {first[name]!r} "
                f"and {path!r} join with dots to the same name, so per-parameter options "
                "(max_norm={name: C}) and results by name cannot tell them apart. Rename a "
                "key (e.g. one without '.') so that every leaf has a name of its own."
            )
        first[name] = path
    return names


def leading_sizes(X: Any) -> set[int]:
    """The sizes of dim 0 of the tensors in a pytree (those of no dims left out).

    Example:
        >>> leading_sizes({"x": torch.zeros(5, 2), "scale": 2.0, "t": torch.tensor(1.0)})
        {5}
    """
    return {
        leaf.shape[0] for leaf in optree.tree_leaves(X) if isinstance(leaf, Tensor) and leaf.dim()
    }


class PaddedSequence(NamedTuple):
    """A ``PackedSequence`` of the inputs, as packfunc passes it: padded, in the batch's order.

    Attributes:
        padded: ``[N, T, *]`` (``pad_packed_sequence(..., batch_first=True)``).
        lengths: ``[N]``, on the CPU.
    """

    padded: Tensor
    lengths: Tensor


def has_packed_sequences(X: Any) -> bool:
    """Whether the inputs ``X`` hold a ``PackedSequence``.

    Example:
        >>> from torch.nn.utils.rnn import pack_sequence
        >>> has_packed_sequences((pack_sequence([torch.ones(2, 1)]), torch.ones(1)))
        True
    """
    return isinstance(X, PackedSequence) or any(
        isinstance(leaf, PackedSequence) for leaf in optree.tree_leaves(X, is_leaf=_is_packed)
    )


def padded_sequences(X: Any) -> Any:
    """``X`` with each ``PackedSequence`` as a :class:`PaddedSequence`: the batch along dim 0.

    A ``PackedSequence`` (a ``collate_fn``'s ``pack_sequence``) has no batch along dim 0: its
    rows are time-major and its samples sorted by length. Padded in the batch's order, sample
    ``n`` alone is row ``n`` of both tensors; :func:`packing` packs them again for the model.

    Args:
        X: The inputs.

    Returns:
        ``X`` with its ``PackedSequence``s replaced (``X`` itself where it holds none).

    Example:
        >>> from torch.nn.utils.rnn import pack_sequence
        >>> found = padded_sequences(pack_sequence([torch.ones(3, 2), torch.ones(1, 2)]))
        >>> tuple(found.padded.shape), found.lengths.tolist()
        ((2, 3, 2), [3, 1])
    """
    if not has_packed_sequences(X):
        return X
    return optree.tree_map(
        lambda x: (
            PaddedSequence(*pad_packed_sequence(x, batch_first=True))
            if isinstance(x, PackedSequence)
            else x
        ),
        X,
        is_leaf=_is_packed,
        none_is_leaf=True,
    )


def packing(model_fn: ModelFn) -> ModelFn:
    """``model_fn`` on inputs whose :class:`PaddedSequence` entries it packs again first.

    The model sees the sequences it was given (``enforce_sorted=False``: its outputs come in
    the batch's order); inputs without a :class:`PaddedSequence` go through as they are.
    A new function each call (a cache of them would keep ``model_fn`` alive): packfunc's
    plan, cached per model function, is found again once per call; what ``model_fn``
    closes over (its module, its settings) is read through it.

    Args:
        model_fn: ``model_fn(params, X)``.

    Returns:
        The wrapped model function.

    Example:
        >>> from torch.nn.utils.rnn import pack_sequence
        >>> fn = packing(lambda p, X: X.data.sum(0))
        >>> fn(None, padded_sequences(pack_sequence([torch.ones(3, 2), torch.ones(1, 2)])))
        tensor([4., 4.])
    """

    def packed(x: Any) -> Any:
        if not isinstance(x, PaddedSequence):
            return x
        lengths = x.lengths.cpu()  # (data= moved it with the batch)
        return pack_padded_sequence(x.padded, lengths, batch_first=True, enforce_sorted=False)

    def packing_model_fn(params: Any, X: Any) -> Tensor:
        if isinstance(X, PaddedSequence) or any(
            isinstance(leaf, PaddedSequence)
            for leaf in optree.tree_leaves(X, is_leaf=_is_padded, none_is_leaf=True)
        ):
            X = optree.tree_map(packed, X, is_leaf=_is_padded, none_is_leaf=True)
        return model_fn(params, X)

    return packing_model_fn


def _is_packed(x: Any) -> bool:
    return isinstance(x, PackedSequence)


def _is_padded(x: Any) -> bool:
    return isinstance(x, PaddedSequence)


def batch_size(X: Any) -> int:
    """Return the common leading dimension of all tensors in the input pytree.

    Args:
        X: A tensor or a pytree of tensors, each with leading batch dimension.

    Returns:
        The batch size ``N``.

    Raises:
        ValueError: if there is no tensor, leading dimensions disagree, or the batch
            is empty.

    Example:
        >>> batch_size((torch.zeros(5, 2), torch.zeros(5)))
        5
    """
    sizes = leading_sizes(X)
    if len(sizes) != 1:
        paths, leaves, _ = optree.tree_flatten_with_path(X)
        listed = ", ".join(
            f"{input_name(path)}: {leaf.shape[0]}"
            for path, leaf in zip(paths, leaves)
            if isinstance(leaf, Tensor) and leaf.dim()
        )
        raise ValueError(
            "X must be a tensor or a pytree of tensors sharing one leading batch dimension; "
            f"found leading sizes {sorted(sizes)} ({listed}). An input the samples share "
            "(position ids [1, T] or [T], a mask for every sample) is closed over in model_fn "
            "(lambda p, X: model_fn(p, {**X, 'position_ids': ids})) or expanded to [N, ...] "
            "(ids.expand(N, -1))."
        )
    size = sizes.pop()
    if size == 0:
        raise ValueError(EMPTY_BATCH)
    return size


EMPTY_BATCH = (
    "X is an empty batch (N=0): per-sample quantities need at least one sample; skip empty "
    "batches before calling packfunc."
)
"""The refusal of a batch without samples (a Poisson-sampled batch may be empty)."""


def select_samples(X: Any, index: slice | Tensor) -> Any:
    """Index the batch dimension of every tensor in a pytree.

    Args:
        X: A tensor or pytree of tensors with leading batch dimension.
        index: A slice or an integer index tensor of samples.

    Returns:
        The pytree with each tensor restricted to the selected samples.

    Example:
        >>> select_samples(torch.arange(6).view(3, 2), slice(0, 1))
        tensor([[0, 1]])
    """
    # (a 0-dim tensor has no batch dimension: shared by the samples, as batch_size reads it)
    return optree.tree_map(
        lambda leaf: leaf[index] if isinstance(leaf, Tensor) and leaf.dim() else leaf, X
    )


def as_index(subsampling: Any, n: int, device: torch.device) -> slice | Tensor:
    """Turn a ``subsampling`` argument into an index over the batch.

    Args:
        subsampling: ``None`` (all samples), a sequence/tensor of sample indices, or a
            ``slice`` of the batch (``range(n)[subsampling]``).
        n: Batch size.
        device: Device of the data.

    Returns:
        ``slice(0, n)`` or a long tensor of indices.

    Raises:
        ValueError: if an index is out of range.

    Example:
        >>> as_index([0, 2], 3, torch.device("cpu"))
        tensor([0, 2])
        >>> as_index(slice(1, None), 3, torch.device("cpu"))
        tensor([1, 2])
    """
    if subsampling is None:
        return slice(0, n)
    if isinstance(subsampling, slice):
        subsampling = list(range(n)[subsampling])
    if torch.as_tensor(subsampling).dtype == torch.bool:
        raise ValueError(
            "subsampling= takes sample indices, not a boolean mask (it would read as indices "
            "0 and 1): pass mask.nonzero().flatten()."
        )
    index = torch.as_tensor(subsampling, dtype=torch.long, device=device).reshape(-1)
    if index.numel() and (int(index.min()) < -n or int(index.max()) >= n):
        raise ValueError(
            f"subsampling indices must lie in [0, {n}) (or [-{n}, 0), counted from the end); "
            f"got {index.tolist()}."
        )
    return index % n
