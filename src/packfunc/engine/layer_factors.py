"""Kronecker factors of each layer's GGN block: KFAC, KFLR (square-root columns) and KFRA.

A linear or convolution weight's GGN block is approximated by ``A ⊗ B`` with
``A`` from the output side (``[C_out, C_out]``) and ``B`` from the input side
(``[C_in/G · kernel, …]``), in BackPACK's order; a bias gets ``[A]``. KFAC and
KFLR build ``A`` from the loss Hessian's square-root columns pulled back to
the layer output (sampled or exact), KFRA from the batch-averaged GGN
propagated through a sequential model (``engine/chain.py``), optionally with the
activations' residual curvature (Hessian variants). A transposed convolution's
factors are those of its kernel with the channel axes swapped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor

from packfunc.engine.batch_pass import BatchPass, ColumnGradients, Term, canonical_term
from packfunc.engine.chain import Link, NotSequentialError, trace_chain
from packfunc.engine.kfra import expected_jacobian_sandwich
from packfunc.engine.memory import chunk_length, chunks
from packfunc.engine.ops import SIGNATURES, SiteCall
from packfunc.engine.pch import summed_residual_curvature
from packfunc.engine.precision import full_precision, to_dtype_of
from packfunc.engine.rules import rule_for
from packfunc.losses import HessianFactors, hessian_factors, mean_normalizer

APPROXIMATIONS = ("sum", "expand", "reduce")
"""Conventions for positions (sequence entries, pixels, several calls of one layer):
``"sum"`` (BackPACK's), and curvlinops' ``"expand"`` and ``"reduce"``."""

RENAMED_APPROXIMATIONS = {"backpack": "sum"}
"""Former names of :data:`APPROXIMATIONS`, refused with a pointer to the new one."""


def checked_approx(approx: str) -> str:
    """``approx`` if it names a convention of :data:`APPROXIMATIONS`.

    Args:
        approx: The ``kfac_approx`` argument.

    Returns:
        ``approx``.

    Raises:
        ValueError: for any other value; a former name is refused with its new one.

    Example:
        >>> checked_approx("sum")
        'sum'
    """
    if approx in APPROXIMATIONS:
        return approx
    if approx in RENAMED_APPROXIMATIONS:
        raise ValueError(
            f"kfac_approx={approx!r} is now kfac_approx={RENAMED_APPROXIMATIONS[approx]!r} "
            "(BackPACK's convention, named for its mathematics: positions summed in both "
            "factors); 'expand' and 'reduce' are curvlinops' conventions."
        )
    raise ValueError(f"kfac_approx must be one of {APPROXIMATIONS}; got {approx!r}.")


CURVATURES = {"ggn": None, "hessian": "none", "pch-clip": "clip", "pch-abs": "abs"}
"""What KFRA propagates (BackPACK's ``curv_type``): the GGN, or the Hessian whose
activations' residual curvature is kept, clipped or made absolute (the modification)."""


@dataclass
class Factors:
    """Kronecker factors per leaf (``None`` where no Kronecker rule applies) and why not."""

    per_leaf: list[list[Tensor] | None]
    unsupported: dict[int, str]
    columns: ColumnGradients | None = None
    """The column gradients the factors came from, when they fit in one chunk (EKFAC
    fits its eigenvalues to the same columns)."""


def refuse_unsupported(bp: BatchPass, found: Factors, on_unsupported: str) -> None:
    """Refuse leaves without Kronecker factors, unless ``on_unsupported='skip'``.

    Args:
        bp: The batch pass (for the leaves' names).
        found: The factors, with why each missing leaf has none.
        on_unsupported: ``"raise"`` or ``"skip"``.

    Raises:
        ValueError: naming each leaf and why, for ``"raise"``.

    Example:
        >>> fn, p = packfunc.functional(torch.nn.Linear(3, 2))
        >>> bp = BatchPass(fn, p, torch.randn(4, 3), torch.tensor([0, 1, 1, 0]),
        ...                torch.nn.CrossEntropyLoss())
        >>> refuse_unsupported(bp, Factors([None, None], {0: "why"}), "skip")
    """
    if found.unsupported and on_unsupported == "raise":
        listing = "; ".join(
            f"{bp.names[leaf]}: {why}" for leaf, why in sorted(found.unsupported.items())
        )
        raise ValueError(
            f"no Kronecker factors for {listing}. Pass on_unsupported='skip' to get None for "
            "these parameters (e.g. to use diag_ggn for them instead)."
        )


def sqrt_factors(
    bp: BatchPass,
    approx: str,
    mc_samples: int | None,
    generator: torch.Generator | None,
    empirical: bool = False,
    *,
    last: bool = False,
) -> Factors:
    """KFLR (``mc_samples=None``) or KFAC factors from square-root columns.

    With ``last`` and one column (KFAC with one sample, the empirical Fisher), the
    factors of a layer used at one call are formed during the backward pass as its
    cotangent arrives, its cotangent and recorded input dropped there.

    Args:
        bp: The batch pass.
        approx: One of :data:`APPROXIMATIONS`.
        mc_samples: Monte-Carlo samples (KFAC) or ``None`` (exact: KFLR).
        generator: Random generator for the samples.
        empirical: Use the loss gradient's one column (the empirical Fisher of the reduced
            loss ``Σ_n ℓ_n / Z``: ``Σ_n ∇ℓ_n ∇ℓ_nᵀ / Z``) instead of the loss Hessian's
            square-root columns.
        last: Nothing uses ``bp`` afterwards but its loss (its records are used up;
            :attr:`Factors.columns` is not kept).

    Returns:
        The :class:`Factors`.

    Example:
        >>> fn, p = packfunc.functional(torch.nn.Linear(3, 2))
        >>> bp = BatchPass(fn, p, torch.randn(4, 3), torch.tensor([0, 1, 1, 0]),
        ...               torch.nn.CrossEntropyLoss())
        >>> [f.shape for f in sqrt_factors(bp, "sum", None, None).per_leaf[1]]
        [torch.Size([2, 2]), torch.Size([3, 3])]
    """
    roots = (
        _gradient_column(bp)
        if empirical
        else hessian_factors(
            bp.loss, bp.record.output, bp.y, mc_samples=mc_samples, generator=generator
        )
    )
    count = roots.count
    length = chunk_length(count, bp.n * bp.column_width(), None)
    outputs: dict[int, Tensor] = {}
    terms: dict[int, Term] = {}
    unsupported = _unsupported(bp)
    columns: ColumnGradients | None = None
    early: _FactorsDuringBackward | None = None
    # a linear weight stored [in, out] reads its factors from the unswapped pair (_raw_layout)
    stream = last and count == 1 and not any(s.call.stores_weight_in_out for s in bp.plan.sites)
    for s in chunks(count, length):
        cotangents = roots.make(s)
        if stream:
            del roots  # the only chunk: what it was made from (sampled probabilities) goes
            early = _FactorsDuringBackward(bp, approx, unsupported, cotangents)
            columns = bp.columns(cotangents, last=True, consume=early)
        else:
            columns = bp.columns(cotangents)
        pulled: dict[int, Tensor] = {}
        summed: dict[int, Tensor] = {}  # per call: the position-summed output factor
        for leaf, found in columns.terms.items():
            if leaf in unsupported or (early and leaf in early.factors):
                continue
            if len(found) != 1 or not found[0].rule.kronecker(found[0].call):
                unsupported[leaf] = _reason(found)
                continue
            if found[0].call.transposed:  # its factors are read from the raw tensors, which
                # the column gradients do not keep: pull the columns back once more
                pulled = pulled or bp.record.pullback_columns(cotangents)
                term = _raw_layout(bp, leaf, found[0], pulled)
                if term is None:
                    unsupported[leaf] = "used by transposed convolutions with different options"
                    continue
            else:
                term = found[0]
            terms[leaf] = term
            factor = _output_factor(term, approx, summed)
            outputs[leaf] = outputs[leaf] + factor if leaf in outputs else factor
    per_leaf: list[list[Tensor] | None] = [None] * len(bp.leaves)
    for leaf, term in terms.items():
        if leaf not in unsupported:
            per_leaf[leaf] = _assemble(term, outputs[leaf], approx)
    for leaf, formed in early.factors.items() if early else ():
        per_leaf[leaf] = formed
    kept = columns if length >= count and not stream else None
    return Factors(per_leaf, unsupported, kept)


class _FactorsDuringBackward:
    """A :data:`~packfunc.engine.batch_record.SiteConsumer` of one column's Kronecker factors.

    A site whose leaves are used there only, by a Kronecker rule, gets their factors from
    its cotangent as it arrives, which is then dropped with the recorded input.
    """

    def __init__(self, bp: BatchPass, approx: str, unsupported: dict[int, str], cotangents: Tensor):
        self.bp, self.approx, self.cotangents = bp, approx, cotangents
        calls = {k: bp.plan.sites[k].call for k in bp.single_call_sites()}
        self.sites = {
            k
            for k, call in calls.items()
            if not call.stores_weight_in_out
            and all(
                leaf not in unsupported and rule_for(call, role).kronecker(call)
                for role, leaf in call.leaves
            )
        }
        self.factors: dict[int, list[Tensor]] = {}

    def __call__(self, k: int, g: Tensor) -> Tensor | None:
        """Site ``k``'s leaves' factors; ``g`` is kept for any other site.

        An input the rule unfolds (a convolution's, a transposed convolution's per output
        position) is unfolded a few samples at a time (the rule's
        ``unfolded_kronecker_factors``): the backward pass's activations are still there.
        """
        if k not in self.sites:
            return g
        summed: dict[int, Tensor] = {}
        for leaf, raw in self.bp.site_terms(k, g[None]):
            param = self.bp.leaves[leaf]
            if raw.rule.kronecker_factors_unfold(raw.x, raw.g, raw.call, param):
                output, inputs = raw.rule.unfolded_kronecker_factors(
                    raw.x, raw.g, raw.call, param, self.approx
                )
                self.factors[leaf] = raw.rule.kronecker_order(output, inputs)
                continue
            term = canonical_term(raw, param)
            output = _output_factor(term, self.approx, summed)
            self.factors[leaf] = _assemble(term, output, self.approx)
        self.bp.record.inputs.pop(k)
        return None


def _output_factor(term: Term, approx: str, summed: dict[int, Tensor]) -> Tensor:
    """The term's output factor; one of a call's parameters computes a shared one, the rest copy.

    Args:
        term: A leaf's only term.
        approx: The position convention.
        summed: Position-summed factors computed so far, by ``id`` of the call (updated).

    Returns:
        A factor the caller owns.
    """
    if term.call.transposed or not term.rule.sums_positions(term.g, approx):
        return term.rule.output_factor(term.g, approx)
    shared = summed.get(id(term.call))
    if shared is not None:
        return shared.clone()
    factor = summed[id(term.call)] = term.rule.output_factor(term.g, approx)
    return factor


def _gradient_column(bp: BatchPass) -> HessianFactors:
    """The empirical Fisher's column: ``√Z · ∂L/∂f``, row ``n`` from sample ``n``'s share.

    With ``L = Σ_n ℓ_n / Z`` (``Z = 1`` for a sum), its squares are ``Z · Σ_n g_n g_nᵀ =
    Σ_n ∇ℓ_n ∇ℓ_nᵀ / Z``: the empirical Fisher of the reduced loss, scaled as the loss is
    (as the GGN's factors are, and curvlinops' ``fisher_type="empirical"``).
    """
    cotangent = bp.record.output_cotangent
    if bp.loss.reduction == "mean":
        normalizer = mean_normalizer(bp.loss, bp.y).to(cotangent.device)
        cotangent = cotangent * normalizer.sqrt().to(cotangent.dtype)
    return HessianFactors(1, lambda s: cotangent.unsqueeze(0))


def _raw_layout(bp: BatchPass, leaf: int, term: Term, pulled: dict[int, Tensor]) -> Term | None:
    """The leaf's term in the rule's Kronecker layout, from each call's input and cotangents.

    The canonical term serves where the rule has no layout of its own; several calls
    of the layer concatenate their positions (``None`` if they cannot).
    """
    sites = [k for k in bp.record.inputs if any(j == leaf for _, j in bp.plan.sites[k].call.leaves)]
    layouts = [
        term.rule.kronecker_layout(
            to_dtype_of(cast(Tensor, bp.record.inputs[k]), bp.leaves[leaf]),
            to_dtype_of(pulled[k], bp.leaves[leaf]),
            bp.plan.sites[k].call,
            bp.leaves[leaf],
        )
        for k in sites
    ]
    present = [layout for layout in layouts if layout is not None]
    if len(present) != len(layouts):
        return term
    calls = [bp.plan.sites[k].call for k in sites]
    merged = (
        present[0]
        if len(present) == 1
        else term.rule.merge(
            [x for x, _ in present], [g for _, g in present], [call.options for call in calls]
        )
    )
    return None if merged is None else Term(term.rule, *merged, term.call)


def _assemble(term: Term, output: Tensor, approx: str) -> list[Tensor]:
    if term.rule.kronecker(term.call) == 1:
        return [output]
    return term.rule.kronecker_order(output, term.rule.input_factor(term.x, approx))


def _unsupported(bp: BatchPass) -> dict[int, str]:
    """Leaves no rule covers, with the reason."""
    used = {leaf for site in bp.plan.sites for _, leaf in site.call.leaves}
    reasons = {
        leaf: f"whole-model path ({bp.plan.reasons[leaf]})"
        if leaf in bp.plan.reasons
        else "used outside a linear or convolution layer"
        for leaf in bp.whole_model
    }
    for site in bp.plan.sites:
        for _, leaf in site.call.leaves if site.call.is_local else ():
            reasons.setdefault(leaf, _no_rule(site.call))
    for leaf in range(len(bp.leaves)):
        if leaf not in used and leaf not in reasons:
            reasons[leaf] = "not used by a linear or convolution layer"
    return reasons


def _reason(terms: list[Term]) -> str:
    if len(terms) != 1:
        return "used by layers of different kinds (e.g. tied weights)"
    return _no_rule(terms[0].call)


def _no_rule(call: SiteCall) -> str:
    """Why a call's parameters have no Kronecker factors.

    Example:
        >>> _no_rule(SiteCall.local(torch.conv2d, [0])).split(" (")[0]
        'used by conv2d with a weight or bias computed from parameters'
    """
    if call.op is None and dict(call.options).get("func") in SIGNATURES:
        return (
            f"used by {call.name} with a weight or bias computed from parameters (weight * "
            "mask, a parametrization): Kronecker factors need the layer's weight and bias to "
            "be parameters themselves"
        )
    if call.op is None:
        return f"used by {call.name} (no Kronecker rule)"
    return f"an {call.op.kind.value} (no Kronecker rule)"


def kfra_factors(bp: BatchPass, curvature: str = "ggn") -> Factors:
    """KFRA factors: propagate the batch-averaged GGN back through a sequential model.

    With a Hessian variant, each elementwise op adds its residual curvature
    ``mod(Σ_n δ_n ⊙ φ''_n)`` to the diagonal of the propagated matrix (BackPACK's
    ``HBP(curv_type, "sum", "average", ...)``).

    Args:
        bp: The batch pass.
        curvature: A key of :data:`CURVATURES`.

    Returns:
        The :class:`Factors`.

    Raises:
        NotSequentialError: if the model is not a chain of ops.
        ValueError: for a Hessian variant and a nonlinearity that is not elementwise.

    Example:
        >>> fn, p = packfunc.functional(torch.nn.Sequential(torch.nn.Linear(3, 4),
        ...                                                 torch.nn.Tanh(),
        ...                                                 torch.nn.Linear(4, 2)))
        >>> bp = BatchPass(fn, p, torch.randn(5, 3), torch.tensor([0, 1, 1, 0, 1]),
        ...               torch.nn.CrossEntropyLoss())
        >>> [f.shape for f in kfra_factors(bp).per_leaf[bp.names.index("0.weight")]]
        [torch.Size([4, 4]), torch.Size([3, 3])]
    """
    bp.check_rerun("KFRA's chain")
    with full_precision():  # a re-run: its activations in the parameters' dtype
        links = trace_chain(bp.model_fn, bp.params, bp.leaves, bp.X)
    modify = CURVATURES[curvature]
    residuals = (
        [None] * len(links) if modify is None else summed_residual_curvature(bp, links, modify)
    )
    roots = hessian_factors(bp.loss, bp.record.output, bp.y).all()
    roots = roots.reshape(-1, bp.record.output[0].numel())  # one row per (column, sample)
    H = roots.T @ roots  # Σ_n H_n, the loss Hessian summed over samples: [D, D]
    per_leaf: list[list[Tensor] | None] = [None] * len(bp.leaves)
    unsupported = _unsupported(bp)
    uses: dict[int, int] = {}
    for link in links:
        for _, leaf in link.call.leaves if link.call else ():
            uses[leaf] = uses.get(leaf, 0) + 1
    remaining = sum(1 for link in links if link.call is not None)
    for link, residual in zip(reversed(links), reversed(residuals)):
        call = link.call
        if call is not None:
            for role, leaf in call.leaves:
                rule = rule_for(call, role)
                if leaf in unsupported or not rule.kronecker(call) or uses[leaf] > 1:
                    unsupported.setdefault(leaf, "shared between layers, or no Kronecker rule")
                    continue
                output = _channel_block(H, link)
                pair = (link.input, link.output.unsqueeze(0), call, bp.leaves[leaf])
                x, _ = rule.kronecker_layout(*pair) or rule.canonical(*pair)
                per_leaf[leaf] = (
                    [output]
                    if rule.kronecker(call) == 1
                    else rule.kronecker_order(output, rule.input_factor(x, "sum"))
                )
            remaining -= 1
        if not remaining:  # nothing upstream needs H
            break
        H = expected_jacobian_sandwich(link, H)
        if residual is not None:
            H.diagonal().add_(residual)
    return Factors(per_leaf, unsupported)


def _channel_block(H: Tensor, link: Link) -> Tensor:
    """Sum ``H`` over positions: ``[C, C]`` for the output channels of a layer."""
    output = link.output
    if link.op is not None and link.op.channels_first:
        channels, positions = output.shape[1], output[0, 0].numel()
        return H.view(channels, positions, channels, positions).sum((1, 3))
    channels, positions = output.shape[-1], output[0].numel() // output.shape[-1]
    return H.view(positions, channels, positions, channels).sum((0, 2))


__all__ = [
    "APPROXIMATIONS",
    "CURVATURES",
    "Factors",
    "NotSequentialError",
    "checked_approx",
    "kfra_factors",
    "sqrt_factors",
]
