"""Type aliases of the public API, and the one description of its shared arguments.

The public functions take the same leading arguments and many of the same
options. Their types are named here once, and :func:`shares_arguments` writes
their ``Args:`` descriptions into each function's docstring from
:data:`ARGUMENTS`, so an option is described in one place.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ForwardRef, Literal, TypeVar

from torch import Tensor

if TYPE_CHECKING:
    PyTree = Tensor | Mapping[str, "PyTree"] | Sequence["PyTree"] | None
else:  # forward references that typing.get_type_hints resolves from any module
    _Tree = ForwardRef("PyTree", module=__name__)
    PyTree = Tensor | Mapping[str, _Tree] | Sequence[_Tree] | None
"""A pytree of tensors: a tensor, or nested dicts, lists and tuples of them (see ``optree``)."""

Params = PyTree
"""The parameters: a pytree of floating-point tensors, e.g. ``dict(name -> tensor)``."""

ParamsT = TypeVar("ParamsT", bound=PyTree)
"""The type of ``params``: a result shaped like ``params`` has this type too."""

BatchT = TypeVar("BatchT")
"""The type of one item of ``data=`` (what ``batch_to_xy`` receives)."""

Inputs = PyTree
"""Model inputs: a tensor or a pytree of tensors, each with the batch dimension first."""

Targets = Tensor | None
"""Targets: a tensor with the batch dimension first (``None`` where ``data=`` gives them)."""

ModelFn = Callable[..., Tensor]
"""``model_fn(params, X) -> output`` with the batch dimension first (packfunc passes
``params`` as given and ``X`` or one batch of ``data``)."""

Factors = list[Tensor]
"""Kronecker factors of one parameter: ``[A, B]`` (``A ⊗ B``, a weight) or ``[A]`` (a bias)."""

if TYPE_CHECKING:
    FactorTree = Factors | Mapping[str, "FactorTree"] | Sequence["FactorTree"] | None
else:
    _Factors = ForwardRef("FactorTree", module=__name__)
    FactorTree = Factors | Mapping[str, _Factors] | Sequence[_Factors] | None
"""Kronecker factors shaped like ``params`` (``None`` for a parameter without a rule)."""

MaxNorm = float | Sequence[float] | Mapping[str | tuple[str, ...], float]
"""A clipping bound: one for all parameters together, or one per parameter (in leaf order,
or by name), or one per group of parameters clipped by their joint norm (a tuple of names)."""

ClippingGroups = list[tuple[list[int], float]]
"""Leaves clipped together by their joint per-sample norm (leaf indices), each group's bound."""

Samples = Sequence[int] | Tensor | slice | None
"""Sample indices, or a slice of the batch (``None``: every sample)."""

KfacApprox = Literal["sum", "expand", "reduce"]
"""How positions (sequence entries, pixels, repeated calls) enter Kronecker factors:
summed in both factors (BackPACK's convention), or curvlinops' expand or reduce."""

FisherType = Literal["mc", "empirical"]
"""KFAC's output factor: the Monte-Carlo Fisher (labels sampled from the model), or the
empirical Fisher (the gradients at the given labels)."""

OnUnsupported = Literal["raise", "skip"]
"""What Kronecker functions do with parameters that have no Kronecker rule."""

Curvature = Literal["ggn", "hessian", "pch-clip", "pch-abs"]
"""The curvature KFRA propagates: the GGN, the Hessian, or a positive-curvature Hessian."""

Modify = Literal["clip", "abs"]
"""How a positive-curvature Hessian treats negative curvature: set to zero, or flip."""

ARGUMENTS: dict[str, str] = {
    "model_fn": "``model_fn(params, X) -> output``, batch dimension first (e.g. from "
    ":func:`packfunc.functional`).",
    "params": "Pytree of floating-point tensors (e.g. the dict from :func:`packfunc.functional`).",
    "X": "Inputs (tensor or pytree of tensors) with leading batch dimension ``N``.",
    "y": "Targets with leading batch dimension ``N``.",
    "loss": "A ``torch.nn`` loss module; its ``reduction`` sets the scaling (default "
    "``CrossEntropyLoss()``).",
    "subsampling": "Compute the per-sample results of these samples only (scaling unchanged; "
    "default: all).",
    "mc_samples": "``None`` for the exact loss Hessian, else the number of Monte-Carlo samples "
    "drawn from the model's predictive distribution.",
    "generator": "Random generator for the Monte-Carlo samples (on the outputs' device).",
    "chunk_size": "Samples per chunk where per-sample tensors are materialized (default: "
    "automatic, within a memory budget).",
    "kfac_approx": "How positions (sequence entries, pixels, repeated calls) enter the "
    "factors: ``'sum'`` (default; BackPACK's convention: summed in both factors, "
    "``A`` of the position-summed cotangents, ``B`` of the inputs' outer products summed "
    "over positions, divided by ``N``), or curvlinops' ``'expand'`` (positions as samples) or "
    "``'reduce'`` (cotangents summed, inputs averaged over positions); ``'sum'`` is "
    "``'reduce'``'s ``A`` with ``'expand'``'s ``B`` times ``L`` positions (see "
    ":mod:`packfunc.kronecker_factors`; the former ``'backpack'`` is refused).",
    "on_unsupported": "``'raise'`` for parameters without a Kronecker rule, or ``'skip'`` "
    "(``None`` for those).",
    "data": "An iterable of ``(X, y)`` batches (e.g. a ``DataLoader``) in place of ``X, y``: "
    "the result is that of one batch holding every sample, for the dataset's reduced loss "
    "(per-sample quantities yield one result per batch; see :mod:`packfunc.data`).",
    "batch_to_xy": "Function from one item of ``data`` to ``(X, y)`` (default: the item is an "
    "``(X, y)`` pair), e.g. ``lambda b: (b['input_ids'], b['labels'])``.",
    "progress": "Show a tqdm progress bar over the batches (needs ``tqdm``).",
    "process_group": "A ``torch.distributed`` group (e.g. ``torch.distributed.group.WORLD``): "
    "each rank passes its shard, every rank gets the result over all shards (per-sample "
    "quantities: its own shard's, scaled for all shards; default ``None``: this process only; "
    "see :mod:`packfunc.distributed`).",
}
"""The description of every argument shared by several public functions."""

DATA_ARGUMENTS = ("data", "batch_to_xy", "progress", "process_group")
"""The arguments of every quantity over a dataset or several processes (:mod:`packfunc.data`)."""

F = TypeVar("F", bound=Callable[..., Any])


def shares_arguments(*names: str) -> Callable[[F], F]:
    """Write the shared descriptions of ``names`` as the ``Args:`` section of a docstring.

    The docstring's own ``Args:`` lines (arguments only that function has) follow
    the shared ones; without an ``Args:`` section it is inserted before ``Returns:``.

    Args:
        *names: Keys of :data:`ARGUMENTS`, in signature order.

    Returns:
        A decorator that rewrites the function's docstring and returns the function.

    Example:
        >>> @shares_arguments("X")
        ... def first(X):
        ...     '''Return the first sample.
        ...
        ...     Returns:
        ...         ``X[0]``.
        ...     '''
        ...     return X[0]
        >>> "Inputs (tensor" in first.__doc__
        True
    """
    lines = "".join(f"        {name}: {ARGUMENTS[name]}\n" for name in names)

    def decorate(function: F) -> F:
        doc = function.__doc__ or ""
        if "    Args:\n" in doc:
            doc = doc.replace("    Args:\n", "    Args:\n" + lines, 1)
        else:
            doc = doc.replace("    Returns:\n", "    Args:\n" + lines + "\n    Returns:\n", 1)
        function.__doc__ = doc
        return function

    return decorate
