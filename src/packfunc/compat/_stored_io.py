"""The inputs and output ``extend`` stores on a module, without touching the user's own.

BackPACK stores a module's forward inputs and output as ``module.input0``,
``module.input1``, … and ``module.output`` and deletes them after the backward
pass. A module may define those names itself (a container whose last layer is
called ``output``, Hugging Face's ``BertLayer.output``): the shim never
overwrites or deletes such a parameter, buffer, child module or attribute. Every
stored value is kept in a private record of the module, which :func:`stored_io`
reads; only names the module does not define become attributes, as in BackPACK.
Results on parameters (``param.grad_batch``, …) are noted as the shim's, so that a
backward pass that computes none forgets the last ones (:func:`forget_results`) and
nothing else.
"""

from __future__ import annotations

from typing import Any

from torch import nn

_STORED = "_packfunc_stored_io"
"""Key of the record in the module's ``__dict__``: stored name -> value."""
_SET = "_packfunc_stored_names"
"""Key of the names among the stored ones that the shim set as attributes (the others are
the user's: a hook or the forward that keeps ``self.output``, even holding the same value)."""
_RESULTS = "_packfunc_results"
"""Key of the record in a parameter's ``__dict__``: result name -> identity of the value
the shim set (not the value: ``del param.grad_batch`` frees it)."""
_INPUT_FIRST = "_packfunc_input_factor_first"
"""A parameter's savefields whose Kronecker factors come input first (see :func:`store_result`)."""


def store_io(module: nn.Module, inputs: tuple, output: Any) -> None:
    """Store ``input0``, ``input1``, … and ``output`` of a forward pass of ``module``.

    Each value is an attribute of the module only where the module does not define
    that name itself; all of them are in :func:`stored_io`.

    Args:
        module: The module that ran.
        inputs: Its positional inputs.
        output: Its output.

    Example:
        >>> layer = nn.Linear(2, 1)
        >>> store_io(layer, ("x",), "y")
        >>> layer.input0, stored_io(layer)["output"]
        ('x', 'y')
    """
    memory_cleanup(module)
    stored = {f"input{i}": value for i, value in enumerate(inputs)} | {"output": output}
    module.__dict__[_STORED] = stored
    # a parameter, buffer, child or attribute of that name is the user's
    own = [name for name in stored if not hasattr(module, name)]
    module.__dict__[_SET] = own
    for name in own:
        module.__dict__[name] = stored[name]


def stored_io(module: nn.Module) -> dict[str, Any]:
    """The inputs and output the last recorded forward pass of ``module`` stored.

    Extension hooks and custom module extensions read ``module.input0`` and
    ``module.output`` as in BackPACK; on a module that defines one of those names
    itself (a child module called ``output``), the stored value is only here.

    Args:
        module: An extended module.

    Returns:
        ``{"input0": …, "input1": …, "output": …}``; empty when nothing is stored.

    Example:
        >>> import torch
        >>> from packfunc.compat import backpack, extend
        >>> layer = extend(nn.Linear(2, 1))
        >>> layer.register_buffer("output", torch.zeros(1))  # the user's own "output"
        >>> with backpack():
        ...     out = layer(torch.ones(3, 2, requires_grad=True))
        >>> layer.output, stored_io(layer)["output"] is out
        (tensor([0.]), True)
    """
    return dict(module.__dict__.get(_STORED, {}))


def memory_cleanup(module: nn.Module) -> None:
    """Forget the inputs and output stored by ``module``'s last forward pass.

    Removes ``module.output`` and ``module.input0``, ``module.input1``, … where the
    shim stored them, as BackPACK's function of the same name does; the module's own
    attributes of those names, and its children, are untouched.

    Args:
        module: An extended module (any module: nothing stored, nothing removed).

    Example:
        >>> import torch
        >>> from packfunc.compat import extend
        >>> layer = extend(torch.nn.Linear(2, 1))
        >>> _ = layer(torch.randn(3, 2, requires_grad=True))
        >>> memory_cleanup(layer)
        >>> hasattr(layer, "output"), hasattr(layer, "input0")
        (False, False)
    """
    stored = module.__dict__.pop(_STORED, {})
    for name in module.__dict__.pop(_SET, ()):
        if module.__dict__.get(name) is stored[name]:  # still the shim's value
            del module.__dict__[name]


def store_result(
    param: nn.Parameter,
    name: str,
    value: Any,
    *,
    input_factor_first: bool = False,
    samples: int | None = None,
) -> None:
    """Set ``param.<name>`` to an extension's result, noted as the shim's.

    Args:
        param: A parameter of an extended model.
        name: The extension's savefield (``"grad_batch"``, …).
        value: The result.
        input_factor_first: Kronecker factors ``[A, G]`` of a weight stored ``[in, out]``
            (``x @ W``, GPT-2's ``Conv1D``), where others have ``[G, A]``: noted for
            :func:`input_factor_first`.
        samples: The batch's samples the result is of (see :func:`samples_of`).

    Example:
        >>> import torch
        >>> weight = nn.Parameter(torch.zeros(2))
        >>> store_result(weight, "grad_batch", torch.ones(3, 2))
        >>> weight.grad_batch.shape
        torch.Size([3, 2])
    """
    setattr(param, name, value)
    param.__dict__.setdefault(_RESULTS, {})[name] = (type(value), id(value), samples)
    first = param.__dict__.setdefault(_INPUT_FIRST, set())
    if input_factor_first:
        first.add(name)
    else:
        first.discard(name)


def input_factor_first(param: nn.Parameter, name: str) -> bool:
    """Whether ``param.<name>`` holds the shim's Kronecker factors with the input factor first.

    Example:
        >>> import torch
        >>> weight = nn.Parameter(torch.zeros(3, 2))
        >>> store_result(weight, "kflr", [torch.eye(3), torch.eye(2)], input_factor_first=True)
        >>> input_factor_first(weight, "kflr")
        True
    """
    stored = param.__dict__.get(_RESULTS, {}).get(name)
    ours = stored is not None and stored[1] == id(getattr(param, name, None))
    return ours and name in param.__dict__.get(_INPUT_FIRST, set())


def samples_of(param: nn.Parameter, name: str) -> int | None:
    """The number of samples the shim's ``param.<name>`` is of, where it noted one.

    Example:
        >>> import torch
        >>> weight = nn.Parameter(torch.zeros(3, 2))
        >>> store_result(weight, "kflr", [torch.eye(3), torch.eye(2)], samples=5)
        >>> samples_of(weight, "kflr")
        5
    """
    stored = param.__dict__.get(_RESULTS, {}).get(name)
    ours = stored is not None and stored[1] == id(getattr(param, name, None))
    return stored[2] if ours else None


def forget_results(module: nn.Module, names: list[str]) -> None:
    """Delete the results named ``names`` the shim set on ``module``'s parameters.

    A backward pass inside ``with backpack(...)`` that computes none (its forward ran
    under ``disable()``) leaves no stale values behind this way, where BackPACK raises.
    A value the user set is kept.

    Args:
        module: An extended model.
        names: Savefields of the block's extensions (their values from an earlier pass go).

    Example:
        >>> import torch
        >>> layer = nn.Linear(2, 1)
        >>> store_result(layer.weight, "grad_batch", torch.ones(3, 1, 2))
        >>> layer.bias.grad_batch = "the user's"
        >>> forget_results(layer, ["grad_batch"])
        >>> hasattr(layer.weight, "grad_batch"), layer.bias.grad_batch
        (False, "the user's")
    """
    for param in module.parameters():
        for name in names:
            forget_result(param, name)


def forget_result(param: nn.Parameter, name: str) -> None:
    """Delete the result ``name`` the shim set on ``param`` (a value the user set is kept).

    Args:
        param: A parameter of an extended model.
        name: A savefield (``"grad_batch"``, ``"kflr"``, …).

    Example:
        >>> import torch
        >>> layer = nn.Linear(2, 1)
        >>> store_result(layer.weight, "kflr", [torch.ones(1, 1)])
        >>> forget_result(layer.weight, "kflr"); hasattr(layer.weight, "kflr")
        False
    """
    mine = param.__dict__.get(_RESULTS, {})
    value = param.__dict__.get(name)
    if name in mine and mine[name][:2] == (type(value), id(value)):
        del param.__dict__[name]
        del mine[name]
