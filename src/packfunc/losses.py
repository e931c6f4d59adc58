"""Loss functions: which ones packfunc supports and how their inputs must look.

A supported loss is a ``torch.nn`` loss module whose reduced value is a sum of
per-sample terms, ``L = Σ_n ℓ_n(f_n)``, where ``f_n`` is sample ``n``'s
output. ``reduction='mean'`` divides by a constant that depends only on the
targets (number of elements, or the summed class weights), so the gradient of
``L`` with respect to ``f_n`` is sample ``n``'s share of the reduced loss: the
per-sample gradients that packfunc computes sum to the gradient of ``L``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
from torch import Tensor, nn

from packfunc.engine.autodiff import under_vmap, vjp

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


class GivenOutputGradient(nn.Module):
    """A loss known only by its gradient ``G = ∂L/∂f`` w.r.t. the model output: first order.

    ``loss=GivenOutputGradient(G)`` gives the first-order quantities of any loss whose
    output gradient you have (e.g. one computed by your own code, or a loss packfunc
    does not support): it is the linear loss ``⟨G, f⟩``, whose gradient w.r.t. ``f`` is
    ``G``. Row ``n`` of ``G`` is sample ``n``'s share, so the reduction's scaling is
    already in ``G`` (``reduction`` is ``"sum"``). ``G`` may carry an autograd graph
    (a backward pass with ``create_graph=True``); that dependence is not differentiated.
    It has no curvature: second-order quantities refuse it.

    Args:
        gradient: ``∂L/∂f`` for the whole batch, shaped like the model output.

    Example:
        >>> model_fn, params = packfunc.functional(torch.nn.Linear(3, 2))
        >>> X = torch.randn(4, 3)
        >>> G = torch.ones(4, 2)  # e.g. the output gradient of sum(f)
        >>> g = packfunc.batch_grad(model_fn, params, X, G, loss=GivenOutputGradient(G))
        >>> torch.allclose(g["weight"][0], torch.ones(2, 1) * X[0])
        True
    """

    reduction = "sum"

    def __init__(self, gradient: Tensor):
        super().__init__()
        self.gradient = gradient

    def forward(self, output: Tensor, target: object) -> Tensor:
        """Return ``⟨G, output⟩`` (``target`` is ignored).

        Args:
            output: The model output.
            target: Ignored (pass ``G`` itself, or anything with the batch first).

        Returns:
            The scalar ``⟨G, output⟩``; its gradient w.r.t. ``output`` is ``G``.
        """
        value: Tensor = _InnerProduct.apply(output, self.gradient)  # type: ignore[no-untyped-call]
        return value


class _InnerProduct(torch.autograd.Function):
    """``⟨f, G⟩`` whose derivative w.r.t. ``f`` is ``G``, keeping ``G``'s own graph."""

    generate_vmap_rule = True

    @staticmethod
    def forward(output: Tensor, gradient: Tensor) -> Tensor:
        return (output * gradient.detach()).sum()

    @staticmethod
    def setup_context(
        ctx: torch.autograd.function.FunctionCtx, inputs: tuple[Tensor, Tensor], output: Tensor
    ) -> None:
        ctx.save_for_backward(inputs[1])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        (gradient,) = ctx.saved_tensors
        return grad * gradient, None


def given_targets(y: Tensor | None, function: str) -> Tensor:
    """The targets ``y``, checked to be there (``None`` only where ``data=`` gives them).

    Args:
        y: The ``y`` argument of a public function.
        function: The function's name, for the error.

    Returns:
        ``y``.

    Raises:
        TypeError: if ``y`` is ``None``.

    Example:
        >>> given_targets(torch.zeros(2), "diag_ggn").shape
        torch.Size([2])
    """
    if y is None:
        raise TypeError(f"{function}() needs the targets y (or data=, which gives them).")
    return y


def default_loss(reduction: Literal["mean", "sum"] = "mean") -> nn.Module:
    """Return the default loss, ``CrossEntropyLoss()`` (with mean reduction unless told).

    Args:
        reduction: ``'sum'`` for quantities of each sample's own loss (clipping).

    Returns:
        A fresh ``torch.nn.CrossEntropyLoss``.

    Example:
        >>> default_loss().reduction, default_loss("sum").reduction
        ('mean', 'sum')
    """
    return nn.CrossEntropyLoss(reduction=reduction)


def check_loss(loss: nn.Module) -> None:
    """Check that ``loss`` is a supported loss module with a usable reduction.

    Args:
        loss: The loss module passed as ``loss=``.

    Raises:
        TypeError: if the loss type is not supported, or a subclass overrides its forward.
        ValueError: if ``reduction`` is not ``'mean'`` or ``'sum'``.

    Example:
        >>> check_loss(torch.nn.MSELoss(reduction="sum"))
    """
    if not isinstance(loss, (*SUPPORTED_LOSSES, GivenOutputGradient)):
        names = ", ".join(cls.__name__ for cls in SUPPORTED_LOSSES)
        raise TypeError(
            f"loss={type(loss).__name__} is not supported; pass one of the torch.nn losses "
            f"{names} (their reduced value is a sum of per-sample terms)."
        )
    base = next((c for c in SUPPORTED_LOSSES if isinstance(loss, c)), None)
    if base is not None and type(loss).forward is not base.forward:
        raise TypeError(
            f"loss={type(loss).__name__} overrides the forward of torch.nn.{base.__name__}: "
            f"packfunc's per-sample scaling and curvature are {base.__name__}'s own formulas, "
            f"not those of {type(loss).__name__}'s forward. Pass the torch.nn loss itself; "
            "for first-order quantities of your loss, pass its gradient with respect to the "
            "model's output as loss=packfunc.losses.GivenOutputGradient(G) and y=G."
        )
    if loss.reduction not in ("mean", "sum"):
        raise ValueError(
            f"{type(loss).__name__}(reduction={loss.reduction!r}) has no per-sample scaling; "
            "pass reduction='mean' or reduction='sum' (clipped_grad and DP-SGD: 'sum')."
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
        raise TypeError(
            f"model_fn returned a {type(output).__name__}; it must return one tensor for {name}, "
            f"the output with the batch first. {PICK_THE_OUTPUT}"
        )
    if isinstance(loss, GivenOutputGradient):
        if output.shape != loss.gradient.shape:
            raise ValueError(
                f"the model output {tuple(output.shape)} does not match the "
                f"gradient {tuple(loss.gradient.shape)} of the recorded pass."
            )
        return
    if not isinstance(target, Tensor):
        raise TypeError(f"targets y must be a tensor; got {type(target).__name__}.")
    if output.dim() == 0 or output.shape[0] != n:
        raise ValueError(
            f"model output has shape {tuple(output.shape)} but the batch has {n} samples; "
            "the output must keep the batch dimension first."
        )
    check_target_batch(loss, target, n)
    if isinstance(loss, CLASS_LOSSES):
        _check_class_targets(loss, output, target)
    elif target.shape != output.shape:
        raise ValueError(
            f"{name} got output {tuple(output.shape)} and target {tuple(target.shape)}; "
            "PyTorch would broadcast them silently. Reshape y to the output's shape."
        )
    else:
        _check_element_weights(loss, output, n)


def _check_element_weights(loss: nn.Module, output: Tensor, n: int) -> None:
    """Refuse an element-wise loss's ``weight``/``pos_weight`` that does not fit the batch.

    A weight with one row per sample of another batch (``BCEWithLogitsLoss(weight=[N, 1])``
    with ``data=``, whose batches are smaller) would meet torch's raw broadcasting error.

    Example:
        >>> loss = torch.nn.BCEWithLogitsLoss(weight=torch.ones(4, 1))
        >>> _check_element_weights(loss, torch.zeros(4, 3), 4)
    """
    for option in ("weight", "pos_weight"):
        weight = getattr(loss, option, None)
        if not isinstance(weight, Tensor) or weight.dim() == 0:
            continue
        try:
            torch.broadcast_shapes(weight.shape, output.shape)
        except RuntimeError:
            raise ValueError(
                f"{type(loss).__name__}({option}=...) has shape {tuple(weight.shape)}, which "
                f"does not broadcast to this batch's output {tuple(output.shape)} ({n} "
                "samples; with data= each batch is its own). Give a weight that fits every "
                "batch (one per output entry, e.g. [C]), or pass each batch with a loss of "
                "its own rows."
            ) from None


PICK_THE_OUTPUT = (
    "Return the output tensor from model_fn: lambda p, X: model_fn(p, X)[0] for a tuple, "
    "model_fn(p, X)['logits'] for a dict, model_fn(p, X).logits for a Hugging Face model's "
    "output; where a module is given (DPOptimizer, the shim's extend), wrap it in one whose "
    "forward returns that tensor (self.model(X).logits, as the loss takes it)."
)
"""How to make a ``model_fn`` that returns a tuple or dict return its output tensor."""


def check_target_batch(loss: nn.Module, target: object, n: int) -> None:
    """Check that the targets have one entry per sample, before the model runs.

    The batch size ``n`` is the leading size of the inputs ``X``. Checked before
    discovery, a model whose inputs do not have the sample along dim 0 (a graph batch's
    nodes, a sequence-first ``[T, N, d]`` tensor) is refused here, not by what running
    it on ``X[0:1]`` as one sample would do.

    Args:
        loss: A loss that passed :func:`check_loss`.
        target: The targets ``y`` (anything else than a tensor is left to
            :func:`check_loss_inputs`, as is :class:`GivenOutputGradient`'s ``y``).
        n: The batch size of the inputs.

    Raises:
        ValueError: if ``y`` has no dim 0 of ``n`` entries.

    Example:
        >>> check_target_batch(torch.nn.MSELoss(), torch.zeros(3, 2), 3)
    """
    if isinstance(loss, GivenOutputGradient) or not isinstance(target, Tensor):
        return
    if target.dim() == 0 or target.shape[0] != n:
        raise ValueError(
            f"targets have shape {tuple(target.shape)} but the batch has {n} samples; "
            "y needs one entry per sample along dim 0. The batch size is the leading size "
            "of X: dim 0 of every input must be the sample (not a graph batch's nodes with "
            "targets per graph, nor the positions of a sequence-first [T, N, d] input). Put "
            "the samples first: batch_first=True, X.transpose(0, 1), or each graph's nodes "
            "padded to [graphs, nodes, d] with a mask."
        )


def _check_class_targets(loss: nn.Module, output: Tensor, target: Tensor) -> None:
    """Check class-index (or, for cross-entropy, class-probability) targets."""
    name = type(loss).__name__
    if output.dim() < 2:
        raise ValueError(f"{name} needs outputs [N, C, d...]; got {tuple(output.shape)}.")
    index_shape = output.shape[:1] + output.shape[2:]
    takes_probabilities = isinstance(loss, nn.CrossEntropyLoss)
    if target.shape == index_shape and not target.is_floating_point():
        kdim_uint8 = target.dtype == torch.uint8 and output.dim() > 2  # (torch refuses it)
        if target.dtype not in (torch.long, torch.uint8) or kdim_uint8:
            raise ValueError(
                f"{name} needs class targets of dtype torch.int64 (long); got {target.dtype}. "
                "Pass y.long()."
            )
        return
    if takes_probabilities and target.shape == output.shape and target.is_floating_point():
        return
    alternative = " or float class probabilities of the output's shape" * takes_probabilities
    raise ValueError(
        f"{name} with output {tuple(output.shape)} needs integer class targets of shape "
        f"{tuple(index_shape)}{alternative}; got {target.dtype} targets of shape "
        f"{tuple(target.shape)}."
    )


# ----------------------------------------------------------------------------- curvature


@dataclass(frozen=True)
class HessianFactors:
    """Square-root factors of the loss Hessian w.r.t. the model output.

    Column ``k`` of sample ``n`` is a tensor shaped like the output of one
    sample; ``Σ_k S[k, n] S[k, n]ᵀ`` is sample ``n``'s block ``∂²L/∂f_n²`` of
    the reduced loss (exact factors), or its expectation (Monte-Carlo factors).
    Columns are produced in slices, so ``K`` may be large (1000 classes, or
    classes × positions for dense predictions) without being held at once.

    Attributes:
        count: Number of columns ``K``.
        make: Returns columns ``[k, N, *output.shape[1:]]`` for a slice of ``range(K)``.
    """

    count: int
    make: Callable[[slice], Tensor]

    def all(self) -> Tensor:
        """Return every column, ``[K, N, ...]``."""
        return self.make(slice(0, self.count))


def hessian_factors(
    loss: nn.Module,
    output: Tensor,
    target: Tensor,
    *,
    mc_samples: int | None = None,
    generator: torch.Generator | None = None,
) -> HessianFactors:
    """Factor the loss Hessian w.r.t. the output, exactly or by sampling.

    Exact factors: cross-entropy ``diag(√p) − p√pᵀ`` per position (``K = C·positions``),
    MSE ``√2·I``, BCE-with-logits ``√(σ(1−σ))`` on the diagonal, other elementwise
    losses the square root of their (autodiff) diagonal Hessian; all scaled by the
    reduction and every loss option. Monte-Carlo factors (``K = mc_samples``)
    sample targets from the model's predictive distribution (categorical,
    Gaussian, Bernoulli) and are scaled by ``1/√mc_samples``.

    Args:
        loss: A supported loss (``check_loss``); ``NLLLoss`` is refused.
        output: Model output ``[N, ...]`` of the batch.
        target: Targets of the batch.
        mc_samples: ``None`` for exact factors, else the number of samples.
        generator: Random generator for the samples (on the output's device).

    Returns:
        The :class:`HessianFactors`.

    Raises:
        ValueError: for ``NLLLoss``, a bad ``mc_samples``, or a loss whose Hessian
            is not positive semi-definite at ``output``.

    Example:
        >>> f = hessian_factors(nn.MSELoss(reduction="sum"), torch.zeros(3, 2), torch.ones(3, 2))
        >>> f.count, f.all().shape
        (2, torch.Size([2, 3, 2]))
    """
    whole = isinstance(mc_samples, int) and not isinstance(mc_samples, bool)
    if mc_samples is not None and (not whole or mc_samples < 1):
        raise ValueError(f"mc_samples must be a positive integer or None; got {mc_samples!r}.")
    if isinstance(loss, GivenOutputGradient):
        raise ValueError(
            "second-order quantities need the loss function and targets; a loss given by its "
            "output gradient (GivenOutputGradient) has no curvature: pass the loss module."
        )
    if isinstance(loss, nn.NLLLoss):
        raise ValueError(
            "NLLLoss is linear in its input (log-probabilities), so its Hessian and the GGN at "
            "that split are zero. Use CrossEntropyLoss on logits for second-order quantities."
        )
    if isinstance(loss, nn.CrossEntropyLoss):
        return _cross_entropy_factors(loss, output, target, mc_samples, generator)
    curvature = _elementwise_curvature(loss, output, target)
    if isinstance(loss, nn.BCEWithLogitsLoss) and mc_samples is not None:
        probs = torch.sigmoid(output)
        weight = curvature / (probs * (1 - probs)).clamp_min(torch.finfo(output.dtype).tiny)

        def sample(s: slice) -> Tensor:
            odds = probs.nan_to_num(0.5)  # (a NaN output: its factor reads NaN, as exactly)
            draws = torch.bernoulli(odds.expand(_length(s), *probs.shape), generator=generator)
            return (weight / mc_samples).sqrt() * (probs - draws)

        return HessianFactors(mc_samples, sample)
    if mc_samples is not None:

        def gaussian(s: slice) -> Tensor:
            noise = torch.randn(
                (_length(s), *output.shape),
                generator=generator,
                dtype=output.dtype,
                device=output.device,
            )
            return (curvature / mc_samples).sqrt() * noise

        return HessianFactors(mc_samples, gaussian)
    return _diagonal_factors(curvature.sqrt())


def _length(s: slice) -> int:
    return cast(int, s.stop - s.start)


def _diagonal_factors(root: Tensor) -> HessianFactors:
    """Factors of a diagonal Hessian: column ``j`` is ``root`` at output entry ``j`` only."""
    n, entries = root.shape[0], root[0].numel()
    flat = root.reshape(n, entries)

    def make(s: slice) -> Tensor:
        picks = torch.arange(s.start, s.stop, device=root.device)
        onehot = (picks.unsqueeze(1) == torch.arange(entries, device=root.device)).to(root.dtype)
        return (onehot.unsqueeze(1) * flat).reshape(_length(s), *root.shape)

    return HessianFactors(entries, make)


def _elementwise_curvature(loss: nn.Module, output: Tensor, target: Tensor) -> Tensor:
    """Diagonal of the reduced loss's Hessian w.r.t. the output, ``[N, ...]``.

    A negative ``weight``/``pos_weight`` (or, with ``pos_weight``, a target beyond ``[0, 1]``
    that makes its factor negative) is refused as a negative curvature is: the closed form's
    square root read NaN, and the autodiff path's rounding floor let small ones through.
    """
    _refuse_negative_weights(loss)
    if isinstance(loss, nn.MSELoss):
        return torch.full_like(output, 2.0 / float(_mean_divisor(loss, output.numel())))
    if isinstance(loss, nn.BCEWithLogitsLoss):
        probs = torch.sigmoid(output)
        weight = torch.ones_like(output)
        if loss.pos_weight is not None:
            weight = nonnegative_curvature(loss, loss.pos_weight * target + 1 - target)
        if loss.weight is not None:
            weight = weight * loss.weight
        return probs * (1 - probs) * weight / _mean_divisor(loss, output.numel())

    # any other elementwise loss: its Hessian is diagonal (and symmetric), so 1ᵀH is the
    # diagonal; reverse over reverse, as some losses have no forward-mode backward rule
    def loss_of(f: Tensor) -> Tensor:
        return cast(Tensor, loss(f, target))

    _, pullback = vjp(torch.func.grad(loss_of), output)
    (hvp,) = pullback(torch.ones_like(output))
    return nonnegative_curvature(loss, hvp, floor=1.0)


def _refuse_negative_weights(loss: nn.Module) -> None:
    """Refuse a loss whose ``weight`` or ``pos_weight`` has a negative entry (not convex).

    Raises:
        ValueError: naming the option.

    Example:
        >>> _refuse_negative_weights(nn.BCELoss(weight=torch.tensor([1.0, 2.0])))
    """
    for option in ("weight", "pos_weight"):
        weight = getattr(loss, option, None)
        if isinstance(weight, Tensor) and bool((weight < 0).any()):
            raise ValueError(
                f"{type(loss).__name__}({option}=...) has negative entries: the loss has "
                "negative curvature there, and the GGN needs a convex loss (positive "
                "semi-definite Hessian w.r.t. the output). Give nonnegative weights."
            )


def nonnegative_curvature(loss: nn.Module, curvature: Tensor, *, floor: float = 0.0) -> Tensor:
    """``curvature`` clamped at 0, after refusing entries below ``-1e-6 · max(|curvature|)``.

    Args:
        loss: The loss, for the error message.
        curvature: Diagonal curvatures (or scale factors of PSD blocks) of the loss.
        floor: Least size the tolerance is taken relative to (1 for autodiff curvatures).

    Returns:
        ``curvature`` with its rounding below 0 set to 0.

    Raises:
        ValueError: if an entry is negative beyond rounding (the GGN needs a convex loss);
            under ``torch.func.vmap``, where values cannot decide a branch, such an entry
            is NaN instead.

    Example:
        >>> nonnegative_curvature(nn.MSELoss(), torch.tensor([2.0, -1e-9]))
        tensor([2., 0.])
    """
    if curvature.numel() == 0:
        return curvature
    negative = curvature < -1e-6 * curvature.abs().max().clamp_min(floor)
    if under_vmap():
        return torch.where(negative, torch.nan, curvature.clamp_min(0))
    if bool(negative.any()):
        raise ValueError(
            f"{type(loss).__name__} has negative curvature at these outputs; the GGN needs a "
            "convex loss (positive semi-definite Hessian w.r.t. the output)."
        )
    return curvature.clamp_min(0)


def _mean_divisor(loss: nn.Module, count: float | Tensor) -> float | Tensor:
    return count if loss.reduction == "mean" else 1.0


def mean_normalizer(loss: nn.Module, target: Tensor) -> Tensor:
    """The divisor ``Z`` of ``reduction='mean'``: ``loss(f, y) = Σ_n ℓ_n / Z``.

    ``Z`` depends on the targets only, so a dataset's is the sum over its batches:
    the number of target elements for elementwise losses, the number of positions
    for class-probability targets, and ``Σ weight[y]`` over targets that are not
    ``ignore_index`` for class indices (their count without ``weight``).

    Args:
        loss: A supported loss module (any reduction).
        target: Targets of one batch.

    Returns:
        ``Z`` as a float64 scalar tensor on the targets' device.

    Example:
        >>> ce = torch.nn.CrossEntropyLoss(weight=torch.tensor([1.0, 3.0]), ignore_index=-1)
        >>> mean_normalizer(ce, torch.tensor([0, 1, -1]))
        tensor(4., dtype=torch.float64)
    """
    if not isinstance(loss, CLASS_LOSSES):
        return torch.tensor(float(target.numel()), dtype=torch.float64, device=target.device)
    if target.is_floating_point():  # class probabilities [N, C, d...]: one term per position
        positions = target.numel() // target.shape[1]
        return torch.tensor(float(positions), dtype=torch.float64, device=target.device)
    valid = target != loss.ignore_index
    if loss.weight is None:
        return valid.sum().to(torch.float64)
    classes = loss.weight.shape[0]
    return (loss.weight[class_indices(target, classes)] * valid).sum().to(torch.float64)


def class_indices(target: Tensor, classes: int) -> Tensor:
    """Class-index targets as ``int64`` indices into ``classes`` (ignored ones clamped in).

    A ``uint8`` index tensor would be read as a boolean mask, so every target is made
    ``long`` first; ``ignore_index`` entries are clamped into range (their mask zeroes them).

    Args:
        target: Integer class targets (``int64`` or ``uint8``), any shape.
        classes: Number of classes ``C``.

    Returns:
        ``target`` as ``int64`` in ``[0, C)``.

    Example:
        >>> torch.tensor([3.0, 5.0])[class_indices(torch.tensor([1, 1], dtype=torch.uint8), 2)]
        tensor([5., 5.])
    """
    return target.long().clamp(0, classes - 1)


def _cross_entropy_factors(
    loss: nn.CrossEntropyLoss,
    output: Tensor,
    target: Tensor,
    mc_samples: int | None,
    generator: torch.Generator | None,
) -> HessianFactors:
    """``diag(√p) − p√pᵀ`` per position, scaled; or ``p − onehot(sample)``."""
    probs = torch.softmax(output, dim=1)
    n, classes, spatial = output.shape[0], output.shape[1], output.shape[2:]
    positions = math.prod(spatial)
    scale = _cross_entropy_scale(loss, output, target)  # [N, *spatial]
    if mc_samples is not None:
        return _sampled_cross_entropy_factors(probs, scale, mc_samples, generator)
    flat_p = probs.reshape(n, classes, positions)
    root_scale = scale.reshape(n, 1, positions).sqrt()  # scale >= 0: checked there
    tau = flat_p.sqrt()

    def make(s: slice) -> Tensor:
        picks = torch.arange(s.start, s.stop, device=output.device)
        k, q = picks // positions, picks % positions
        # column (k, q): at position q, (diag(τ) − p τᵀ)[:, k]; zero at the other positions
        at_q = (q.unsqueeze(1) == torch.arange(positions, device=output.device)).to(probs.dtype)
        delta = (k.unsqueeze(1) == torch.arange(classes, device=output.device)).to(probs.dtype)
        tau_k = tau[:, k].transpose(0, 1).unsqueeze(2)  # [k, N, 1, P]
        column = delta.view(-1, 1, classes, 1) * tau - flat_p * tau_k
        return (root_scale * column * at_q.view(-1, 1, 1, positions)).reshape(
            _length(s), *output.shape
        )

    return HessianFactors(classes * positions, make)


def _sampled_cross_entropy_factors(
    probs: Tensor, scale: Tensor, mc_samples: int, generator: torch.Generator | None
) -> HessianFactors:
    """Columns ``√(c/D/mc_samples) · (p − onehot(draw))``, a class drawn per sample and position.

    Args:
        probs: Predicted probabilities ``[N, C, d...]``.
        scale: The per-position factor ``c/D`` of :func:`_cross_entropy_scale`, ``[N, d...]``.
        mc_samples: Draws per sample and position.
        generator: Random generator, or ``None``.

    Returns:
        The :class:`HessianFactors` (``K = mc_samples``).
    """
    shape = probs.shape
    n, classes, positions = shape[0], shape[1], math.prod(shape[2:])
    # one row per (sample, position)
    rows = probs if positions == 1 else probs.reshape(n, classes, -1).transpose(1, 2)
    root = scale.reshape(-1, 1).sqrt()
    if mc_samples != 1:
        root = root / math.sqrt(mc_samples)
    # draws come from the scaled rows (a positive factor per row leaves the distribution as
    # it is; a zero row gives a zero column): the probabilities are not kept
    scaled, minus = rows.reshape(-1, classes) * root, -root
    del probs, rows

    def sample(s: slice) -> Tensor:
        count = _length(s)
        draws = categorical_draws(scaled, count, generator)  # [N·P, count]
        # s·(p − onehot(draw)) without a one-hot: add −s at each drawn class of a copy
        if count == 1:
            columns = scaled.scatter_add(1, draws, minus)
        else:
            columns = scaled.expand(count, *scaled.shape).scatter_add(
                2, draws.T.unsqueeze(2), minus.expand(count, -1, -1)
            )
        if positions == 1:
            return columns.view(count, *shape)
        # classes back to dim 2 as a view (the pullback takes any strides)
        by_class = columns.view(count, n, positions, classes).transpose(2, 3)
        return cast(Tensor, by_class.unflatten(3, shape[2:]))

    return HessianFactors(mc_samples, sample)


def categorical_draws(probs: Tensor, count: int, generator: torch.Generator | None) -> Tensor:
    """Draw ``count`` classes per row of ``probs [R, C]`` by inverting the cumulative distribution.

    One uniform number per draw, where ``torch.multinomial`` draws one exponential per
    class for a single sample (20x slower for ``R = 512``, ``C = 256`` on CPU).

    Args:
        probs: Nonnegative class probabilities, one distribution per row (need not sum to 1).
        count: Draws per row (with replacement).
        generator: Random generator (on ``probs``' device), or ``None``.

    Returns:
        Class indices ``[R, count]``.

    Example:
        >>> categorical_draws(torch.tensor([[0.0, 1.0], [1.0, 0.0]]), 3, None)
        tensor([[1, 1, 1],
                [0, 0, 0]])
    """
    dtype = torch.promote_types(probs.dtype, torch.float32)
    cdf = (probs if probs.dtype == dtype else probs.to(dtype)).cumsum(1)
    uniform = torch.rand(
        (probs.shape[0], count), generator=generator, dtype=cdf.dtype, device=cdf.device
    )
    total = cdf[:, -1:]
    # x = total - u·total in (0, total]: the first class whose cumulative mass reaches x has
    # positive mass, and one exists (x never exceeds the total, whatever the rounding); a row
    # of NaN (a NaN in the model's output) finds none: its last class, where the factors read
    # NaN as the exact path's do (an index out of bounds before)
    drawn = torch.searchsorted(cdf, torch.addcmul(total, uniform, total, value=-1))
    return drawn.clamp(max=probs.shape[1] - 1)


def _cross_entropy_scale(loss: nn.CrossEntropyLoss, output: Tensor, target: Tensor) -> Tensor:
    """Per-position factor ``c/D``: the loss Hessian there is ``c/D · (diag p − ppᵀ)``.

    ``c`` is the total target mass the position's term puts on ``−log p`` (class
    weights and label smoothing included, 0 where ignored); ``D`` divides for
    ``reduction='mean'``.
    """
    classes, smoothing = output.shape[1], loss.label_smoothing
    if not target.is_floating_point() and loss.weight is None and smoothing == 0:
        # c is 1 where the target is not ignored
        c = (target != loss.ignore_index).to(output.dtype)
        return _share(c, c.sum()) if loss.reduction == "mean" else c
    weight = loss.weight if loss.weight is not None else output.new_ones(classes)
    if target.is_floating_point():  # class probabilities
        mass = (1 - smoothing) * target + smoothing / classes
        shape = (1, classes) + (1,) * (output.dim() - 2)
        c = (mass * weight.view(shape)).sum(1)
        scale = _share(c, _mean_divisor(loss, c.numel()))
    else:
        valid = target != loss.ignore_index
        target_weight = weight[class_indices(target, classes)] * valid
        c = (1 - smoothing) * target_weight + smoothing * weight.mean() * valid
        scale = _share(c, _mean_divisor(loss, target_weight.sum()))
    # a negative mass (a negative class weight or target probability) flips the block's sign
    return nonnegative_curvature(loss, scale)


def _share(c: Tensor, divisor: float | Tensor) -> Tensor:
    """``c / divisor`` with ``0 / 0 = 0``: where every target is ignored, so is the Hessian.

    PyTorch's mean over no target is ``0/0 = NaN``, but its gradient and Hessian w.r.t.
    the output are 0 there (autograd); a nonzero ``c`` over a zero divisor stays ``±inf``.

    Args:
        c: Per-position target masses.
        divisor: The mean's divisor (1 for ``reduction='sum'``).

    Returns:
        ``c / divisor``, 0 where ``c`` is 0.

    Example:
        >>> _share(torch.zeros(2), torch.tensor(0.0))
        tensor([0., 0.])
    """
    return torch.where(c == 0, torch.zeros_like(c), c / divisor)
