"""Hessian diagonals at the outputs of a chain's linear layers, by a backward recursion.

BackPACK's DiagHessian recursion over signed square-root columns plus a
diagonal: a layer pulls the columns back, an elementwise op ``φ`` scales them by
``φ'`` and adds ``diag(δ ⊙ φ'')``. ``engine/hessian.py`` uses it for single-use
linear layers of sequential models.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.func import vmap

from packfunc.engine.autodiff import jvp, vjp
from packfunc.engine.batch_pass import BatchPass
from packfunc.engine.chain import Link, NotSequentialError, passes_recursions, trace_chain
from packfunc.engine.memory import DEFAULT_BUDGET
from packfunc.engine.ops import ELEMENTWISE, RESHAPES
from packfunc.engine.pch import modified_curvature
from packfunc.engine.precision import to_dtype_of
from packfunc.losses import hessian_factors


def layer_output_curvature(bp: BatchPass, sites: list[int]) -> dict[int, Tensor] | None:
    """``diag(∂²L/∂z_n²)`` at the outputs of the given single-position linear sites.

    For a sequential model whose ops are layers, elementwise nonlinearities,
    reshapes and piecewise-linear ops, the loss Hessian w.r.t. each chain tensor
    is carried backward as signed square-root columns ``Σ_k ±c_k c_kᵀ`` plus a
    diagonal (BackPACK's DiagHessian recursion): a layer pulls the columns back,
    an elementwise op ``φ`` scales them by ``φ'`` and adds ``diag(δ ⊙ φ'')``, which
    becomes ``2·D`` new columns (positive and negative parts) before the next
    pull-back — unless only the first site's diagonal is left to find, which a
    matrix product gives directly. Far fewer products than one Hessian-vector
    product per unit.

    Args:
        bp: The batch pass.
        sites: Indices of single-position linear sites (``[N, O]`` outputs).

    Returns:
        ``[N, O]`` per site, or ``None`` if the model is not such a chain or the
        columns would not fit the memory budget (callers fall back).
    """
    bp.check_rerun("the Hessian's recursion through the chain")
    try:
        links = trace_chain(bp.model_fn, bp.params, bp.leaves, bp.X)
    except NotSequentialError:
        return None
    layers = [i for i, link in enumerate(links) if link.call is not None]
    called = [link.call.leaves for link in links if link.call is not None]
    tapped = [k for k, site in enumerate(bp.plan.sites) if not site.call.is_local]
    if called != [bp.plan.sites[k].call.leaves for k in tapped]:
        return None
    wanted = {layers[tapped.index(k)]: k for k in sites}
    start = min(wanted)
    if not all(passes_recursions(link) for link in links[start:]):
        return None
    residual = modified_curvature(bp, links[start + 1 :], "none")
    # (the chain re-runs in full precision; under autocast the recorded output is bfloat16)
    output = to_dtype_of(bp.record.output, links[-1].output)
    roots = hessian_factors(bp.loss, output, bp.y).all()
    columns, signs, diagonal = roots, roots.new_ones(roots.shape[0]), None
    found: dict[int, Tensor] = {}
    for i in range(len(links) - 1, start - 1, -1):
        link = links[i]
        if i in wanted:
            squares = signs.view(-1, 1, 1) * columns.reshape(*columns.shape[:2], -1).square()
            found[wanted[i]] = squares.sum(0) + (
                0 if diagonal is None else diagonal.reshape(bp.n, -1)
            )
        if i == start:
            break
        if link.func in ELEMENTWISE:
            ones = torch.ones_like(link.input)
            slope = jvp(link.apply, (link.input,), (ones,))[1]
            columns = columns * slope
            curvature = residual[i - start - 1]
            diagonal = curvature if diagonal is None else diagonal * slope.square() + curvature
        elif link.func in RESHAPES:
            columns = columns.reshape(columns.shape[0], *link.input.shape)
            diagonal = None if diagonal is None else diagonal.reshape(link.input.shape)
        else:
            last_pullback = all(
                other.func in ELEMENTWISE or other.func in RESHAPES
                for other in links[start + 1 : i]
            )
            if diagonal is not None and last_pullback and _is_matrix_product(link):
                # only the diagonal at the first site is left to find: diag(Wᵀ diag(d) W)
                diagonal = diagonal @ link.kwargs["weight"].square()
            elif diagonal is not None:
                expanded = _diagonal_columns(diagonal)
                if expanded is None:
                    return None
                columns = torch.cat([columns, expanded[0]])
                signs = torch.cat([signs, expanded[1]])
                diagonal = None
            pullback = vjp(link.apply, link.input)[1]
            columns = vmap(lambda c, pull=pullback: pull(c)[0])(columns)
    return found


def _is_matrix_product(link: Link) -> bool:
    """Whether the link is ``x Wᵀ (+ b)`` (``F.linear``) on ``[N, features]`` inputs."""
    return link.op is not None and link.op.input_jacobian_is_weight and link.input.dim() == 2


def _diagonal_columns(diagonal: Tensor) -> tuple[Tensor, Tensor] | None:
    """Signed columns for ``diag(d)`` per sample: ``√d⁺ e_j`` (+1) and ``√d⁻ e_j`` (−1)."""
    n, width = diagonal.shape[0], diagonal[0].numel()
    if 2 * width * n * width > DEFAULT_BUDGET:
        return None
    flat = diagonal.reshape(n, width)
    eye = torch.eye(width, dtype=flat.dtype, device=flat.device).unsqueeze(1)  # [D, 1, D]
    positive = eye * flat.clamp_min(0).sqrt()
    negative = eye * (-flat).clamp_min(0).sqrt()
    columns = torch.cat([positive, negative]).reshape(2 * width, *diagonal.shape)
    signs = torch.cat([flat.new_ones(width), -flat.new_ones(width)])
    return columns, signs
