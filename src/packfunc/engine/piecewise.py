"""Leaves along whose coordinates the model is piecewise affine: no residual curvature.

The loss Hessian is ``Jᵀ H_f J + Σ_k G_k ∇²f_k``. Its diagonal entry for a
coordinate ``θ_i`` has the residual part ``Σ_k G_k ∂²f_k/∂θ_i²``, which is zero
whenever ``t ↦ f(θ + t e_i)`` is piecewise affine: then the Hessian diagonal
*is* the GGN diagonal (as in BackPACK's DiagHessian for ReLU networks). That
holds when every op that reads a tensor depending on the leaf is affine, or
piecewise affine, in the arguments that depend on it — additions, reshapes,
pooling, ReLU, BatchNorm in evaluation mode, and a linear layer, convolution or
product whose *other* factor does not depend on the same leaf (a leaf used
twice, as in ``W relu(W x)``, is curved). Autograd differentiates kinks
(ReLU at 0, ties of a max) with zero second derivative, so the identity is
exact for what autograd computes, not only almost everywhere.

The check walks the autograd graph of one forward pass: it sees every
differentiable op, including those of custom modules, and an op it does not
know counts as curved.
"""

from __future__ import annotations

from typing import Any

import optree
import torch
from torch import Tensor

from packfunc.engine.model_state import kept_model_state
from packfunc.engine.modes import functional_mode, twice_differentiable
from packfunc.engine.randomness import private_generators
from packfunc.functionalize import module_of
from packfunc.types import ModelFn

AFFINE = frozenset(
    {
        "AddBackward0",
        "AddBackward1",
        "SubBackward0",
        "SubBackward1",
        "RsubBackward0",
        "RsubBackward1",
        "NegBackward0",
        "ViewBackward0",
        "UnsafeViewBackward0",
        "ReshapeAliasBackward0",
        "AliasBackward0",
        "CloneBackward0",
        "ToCopyBackward0",
        "ExpandBackward0",
        "PermuteBackward0",
        "TransposeBackward0",
        "TBackward0",
        "SqueezeBackward0",
        "SqueezeBackward1",
        "SqueezeBackward2",
        "UnsqueezeBackward0",
        "SliceBackward0",
        "SelectBackward0",
        "IndexBackward0",
        "IndexSelectBackward0",
        "GatherBackward0",
        "NarrowBackward0",
        "AsStridedBackward0",
        "SplitBackward0",
        "SplitWithSizesBackward0",
        "UnbindBackward0",
        "CatBackward0",
        "StackBackward0",
        "FlipBackward0",
        "RollBackward0",
        "RepeatBackward0",
        "SumBackward0",
        "SumBackward1",
        "MeanBackward0",
        "MeanBackward1",
        "AvgPool2DBackward0",
        "AvgPool3DBackward0",
        "AdaptiveAvgPool2DBackward0",
        "AdaptiveAvgPool3DBackward0",
        "ConstantPadNdBackward0",
        "ReflectionPad1DBackward0",
        "ReflectionPad2DBackward0",
        "ReplicationPad1DBackward0",
        "ReplicationPad2DBackward0",
        "EmbeddingBackward0",
        "NativeDropoutBackward0",
        "ReluBackward0",
        "ThresholdBackward0",
        "LeakyReluBackward0",
        "HardtanhBackward0",
        "AbsBackward0",
        "ClampBackward1",
        "ClampMinBackward0",
        "ClampMaxBackward0",
        "MaxBackward0",
        "MaxBackward1",
        "MinBackward0",
        "MinBackward1",
        "AmaxBackward0",
        "AminBackward0",
        "MaximumBackward0",
        "MinimumBackward0",
        "MaxPool2DWithIndicesBackward0",
        "MaxPool3DWithIndicesBackward0",
        "AdaptiveMaxPool2DBackward0",
        "AdaptiveMaxPool3DBackward0",
    }
)
"""Ops jointly (piecewise) affine in all their differentiable inputs."""

FACTORS: dict[str, tuple[int, int]] = {
    "MulBackward0": (0, 1),
    "MmBackward0": (0, 1),
    "BmmBackward0": (0, 1),
    "MvBackward0": (0, 1),
    "DotBackward0": (0, 1),
    "AddmmBackward0": (1, 2),
    "AddmvBackward0": (1, 2),
    "BaddbmmBackward0": (1, 2),
    "ConvolutionBackward0": (0, 1),
    "LinearBackward0": (0, 1),
}
"""Bilinear ops: the positions of their two factors (the rest enters affinely).

Affine in a leaf unless both factors depend on it."""

NORMALIZATIONS = frozenset(
    {"NativeBatchNormBackward0", "NativeLayerNormBackward0", "NativeGroupNormBackward0"}
)
"""``normalize(input) · weight + bias``: affine in weight and bias for a fixed input.

BatchNorm in evaluation mode normalizes with fixed statistics: then it is
bilinear in its input and weight instead."""


def piecewise_affine_leaves(
    model_fn: ModelFn, leaves: list[Tensor], treespec: optree.PyTreeSpec, X: Any
) -> set[int]:
    """Indices of the leaves along whose coordinates the model output is piecewise affine.

    For these leaves the diagonal of ``∇²⟨G, f⟩`` vanishes for any ``G``: the
    Hessian diagonal of the loss equals the GGN diagonal, summed or per sample.
    Inside a ``torch.func`` transform (``vmap`` over an ensemble, ``grad`` of a
    result) autograd graphs cannot be built, and no leaf is claimed.

    Args:
        model_fn: ``model_fn(params, X)``.
        leaves: Flattened parameter leaves.
        treespec: Their pytree structure.
        X: The batch of inputs.

    Returns:
        The leaf indices (a leaf the output does not depend on is included).

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(),
        ...                             torch.nn.Linear(4, 2), torch.nn.ReLU())
        >>> fn, p = packfunc.functional(model)
        >>> leaves, spec = optree.tree_flatten(p)
        >>> sorted(piecewise_affine_leaves(fn, leaves, spec, torch.randn(5, 3)))
        [2, 3]
    """
    if torch._C._functorch.peek_interpreter_stack() is not None:
        return set()
    copies = [leaf.detach().requires_grad_() for leaf in leaves]
    # a copy: a model that changes its input in place changes the batch once, in the batch pass
    X_copy = optree.tree_map(lambda t: t.detach().clone() if isinstance(t, Tensor) else t, X)
    with (
        private_generators(leaves),  # a probe: its dropout masks do not matter
        kept_model_state(module_of(model_fn)),  # nor what it sets (a running statistic)
        torch.enable_grad(),
        functional_mode(batch_statistics=True),
        twice_differentiable(),
    ):
        output = model_fn(optree.tree_unflatten(treespec, copies), X_copy)
    if not isinstance(output, Tensor):
        return set()
    if output.grad_fn is None:  # the output depends on no leaf
        return set(range(len(leaves)))
    return set(range(len(leaves))) - _curved_leaves(output.grad_fn, copies)


def _curved_leaves(root: Any, copies: list[Tensor]) -> set[int]:
    """Leaves that reach some op which is not (piecewise) affine in them."""
    leaf_of = {id(t): i for i, t in enumerate(copies)}
    depends: dict[Any, frozenset[int]] = {}
    curved: set[int] = set()
    for node in _post_order(root):
        below = [
            depends[child] if child is not None else frozenset() for child, _ in node.next_functions
        ]
        if type(node).__name__ == "AccumulateGrad":
            index = leaf_of.get(id(node.variable))
            depends[node] = frozenset() if index is None else frozenset({index})
            continue
        depends[node] = frozenset().union(*below)
        curved |= _curved_at(node, below)
    return curved


def _curved_at(node: Any, below: list[frozenset[int]]) -> set[int]:
    """Leaves in which the op ``node`` is not (piecewise) affine, given its inputs' leaves."""
    name = type(node).__name__
    everything = set().union(*below)
    if name in AFFINE:
        return set()
    if name in FACTORS:
        first, second = FACTORS[name]
        return set(below[first] & below[second]) if len(below) > second else set()
    if name in NORMALIZATIONS:
        normalized = set(below[0])
        if name == "NativeBatchNormBackward0" and not node._saved_training:
            return normalized & set(below[1]) if len(below) > 1 else set()
        return normalized
    return everything


def _post_order(root: Any) -> list[Any]:
    """The autograd nodes below ``root``, each after all of its inputs."""
    order: list[Any] = []
    seen: set[Any] = set()
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, finished = stack.pop()
        if finished:
            order.append(node)
            continue
        if node in seen:
            continue
        seen.add(node)
        stack.append((node, True))
        stack.extend((child, False) for child, _ in node.next_functions if child is not None)
    return order
