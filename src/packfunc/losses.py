"""Loss functions: which ones packfunc supports and how their inputs must look.

A supported loss is a ``torch.nn`` loss module whose reduced value is a sum of
per-sample terms, ``L = Σ_n ℓ_n(f_n)``, where ``f_n`` is sample ``n``'s
output. ``reduction='mean'`` divides by a constant that depends only on the
targets (number of elements, or the summed class weights), so the gradient of
``L`` with respect to ``f_n`` is sample ``n``'s share of the reduced loss: the
per-sample gradients that packfunc computes sum to the gradient of ``L``.
"""

from __future__ import annotations

from torch import Tensor, nn

CLASS_LOSSES = (nn.CrossEntropyLoss, nn.NLLLoss)
ELEMENTWISE_LOSSES = (
    nn.MSELoss,
    nn.BCEWithLogitsLoss,
    nn.BCELoss,
    nn.L1Loss,
    nn.SmoothL1Loss,
    nn.HuberLoss,
)
SUPPORTED_LOSSES = CLASS_LOSSES + ELEMENTWISE_LOSSES


def default_loss() -> nn.Module:
    """Return the default loss, ``CrossEntropyLoss()`` with mean reduction.

    Returns:
        A fresh ``torch.nn.CrossEntropyLoss``.

    Example:
        >>> default_loss().reduction
        'mean'
    """
    return nn.CrossEntropyLoss()


def check_loss(loss: nn.Module) -> None:
    """Check that ``loss`` is a supported loss module with a usable reduction.

    Args:
        loss: The loss module passed as ``loss=``.

    Raises:
        TypeError: if the loss type is not supported.
        ValueError: if ``reduction`` is not ``'mean'`` or ``'sum'``.

    Example:
        >>> check_loss(torch.nn.MSELoss(reduction="sum"))
    """
    if not isinstance(loss, SUPPORTED_LOSSES):
        names = ", ".join(cls.__name__ for cls in SUPPORTED_LOSSES)
        raise TypeError(
            f"loss={type(loss).__name__} is not supported; pass one of the torch.nn losses "
            f"{names} (their reduced value is a sum of per-sample terms)."
        )
    if loss.reduction not in ("mean", "sum"):
        raise ValueError(
            f"{type(loss).__name__}(reduction={loss.reduction!r}) has no per-sample scaling; "
            "pass reduction='mean' or reduction='sum'."
        )


def check_loss_inputs(loss: nn.Module, output: Tensor, target: Tensor, n: int) -> None:
    """Check that model output and targets have the shapes ``loss`` needs.

    Args:
        loss: A loss that passed :func:`check_loss`.
        output: Model output for the whole batch.
        target: Targets for the whole batch.
        n: Batch size.

    Raises:
        TypeError: if the output is not a tensor.
        ValueError: if a shape or dtype does not match (PyTorch would broadcast silently
            or fail with a less helpful message).

    Example:
        >>> check_loss_inputs(torch.nn.MSELoss(), torch.zeros(3, 2), torch.zeros(3, 2), 3)
    """
    name = type(loss).__name__
    if not isinstance(output, Tensor):
        raise TypeError(f"model_fn must return a tensor for {name}; got {type(output).__name__}.")
    if not isinstance(target, Tensor):
        raise TypeError(f"targets y must be a tensor; got {type(target).__name__}.")
    if output.dim() == 0 or output.shape[0] != n:
        raise ValueError(
            f"model output has shape {tuple(output.shape)} but the batch has {n} samples; "
            "the output must keep the batch dimension first."
        )
    if target.dim() == 0 or target.shape[0] != n:
        raise ValueError(
            f"targets have shape {tuple(target.shape)} but the batch has {n} samples; "
            "y needs one entry per sample along dim 0."
        )
    if isinstance(loss, CLASS_LOSSES):
        _check_class_targets(loss, output, target)
    elif target.shape != output.shape:
        raise ValueError(
            f"{name} got output {tuple(output.shape)} and target {tuple(target.shape)}; "
            "PyTorch would broadcast them silently. Reshape y to the output's shape."
        )


def _check_class_targets(loss: nn.Module, output: Tensor, target: Tensor) -> None:
    """Check class-index (or, for cross-entropy, class-probability) targets."""
    name = type(loss).__name__
    if output.dim() < 2:
        raise ValueError(f"{name} needs outputs [N, C, d...]; got {tuple(output.shape)}.")
    index_shape = output.shape[:1] + output.shape[2:]
    takes_probabilities = isinstance(loss, nn.CrossEntropyLoss)
    if target.shape == index_shape and not target.is_floating_point():
        return
    if takes_probabilities and target.shape == output.shape and target.is_floating_point():
        return
    alternative = " or float class probabilities of the output's shape" * takes_probabilities
    raise ValueError(
        f"{name} with output {tuple(output.shape)} needs integer class targets of shape "
        f"{tuple(index_shape)}{alternative}; got {target.dtype} targets of shape "
        f"{tuple(target.shape)}."
    )
