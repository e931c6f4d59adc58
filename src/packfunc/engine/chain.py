"""Sequential models as chains of ops, and KFRA's backward recursion over them.

:func:`trace_chain` runs the model once and records every op applied to the
*chain tensor* — the input, then each op's output in turn. A model is
sequential when every op takes the current chain tensor once and nothing
else ever reads an earlier one (no residual connections, no reuse); otherwise
a clear error is raised.

KFRA (Botev et al., 2017) propagates one batch-averaged matrix ``H`` (the
GGN w.r.t. the current chain tensor) from the output back to the input:
``H ← E_n[J_nᵀ H J_n]`` per op, with ``J_n`` the op's Jacobian at sample ``n``.
A linear or convolution layer reads its Kronecker factors off ``H`` on the way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import grad, vmap

from packfunc.engine.autodiff import jvp, vjp
from packfunc.engine.memory import DEFAULT_BUDGET, chunks, is_plain, new_output
from packfunc.engine.modes import FunctionalMode, LeafIndex, is_metadata_query
from packfunc.engine.ops import OpSignature, TapCall, make_call
from packfunc.engine.persample import Backprop
from packfunc.losses import hessian_factors

ELEMENTWISE = frozenset(
    {
        torch.relu,
        F.relu,
        torch.tanh,
        torch.sigmoid,
        F.elu,
        F.leaky_relu,
        F.gelu,
        F.silu,
        F.softplus,
        F.selu,
        F.celu,
        F.hardtanh,
        F.relu6,
        F.logsigmoid,
        F.hardswish,
        F.mish,
        torch.exp,
        Tensor.relu,
        Tensor.tanh,
        Tensor.sigmoid,
        F.dropout,
    }
)
"""Ops known to act elementwise: their Jacobian is diagonal."""

RESHAPES = frozenset({Tensor.view, Tensor.reshape, torch.reshape, torch.flatten, Tensor.flatten})
"""Ops that keep the row-major order of a sample's entries: ``H`` passes unchanged."""


@dataclass
class Link:
    """One op of the chain.

    Attributes:
        func: The function called.
        args: Its positional arguments.
        kwargs: Its keyword arguments (``inplace`` switched off).
        position: Index of the chain tensor among ``args`` then ``kwargs`` values.
        input: The chain tensor the op received (a copy, if the op was in place).
        output: The op's output.
        call: For a linear or convolution op with a parameter weight, its description.
    """

    func: Callable
    args: tuple
    kwargs: dict
    position: int
    input: Tensor
    output: Tensor
    call: TapCall | None = None

    def apply(self, chain: Tensor) -> Tensor:
        """The op as a function of the chain tensor, every other argument fixed."""
        return self.with_argument(self.position, chain)

    def with_argument(self, position: int | str, value: Any) -> Any:
        """Call the op with one argument (an index, or a keyword) replaced."""
        args, kwargs = list(self.args), dict(self.kwargs)
        if isinstance(position, str):
            kwargs[position] = value
        elif position < len(args):
            args[position] = value
        else:
            kwargs[list(kwargs)[position - len(args)]] = value
        return self.func(*args, **kwargs)


class NotSequentialError(ValueError):
    """The model is not a chain of ops."""


class _ChainMode(FunctionalMode):
    leaf_of: LeafIndex

    def __init__(self, leaf_of: LeafIndex, start: Tensor):
        super().__init__()
        self.leaf_of, self.current = leaf_of, start
        self.links: list[Link] = []
        self.seen: set[int] = set()

    def _tapped(
        self, func: Callable, sig: OpSignature, bound: dict[str, Any], run: Callable[[], Tensor]
    ) -> Tensor:
        call = make_call(sig, bound, self.leaf_of)
        return self._follow(func, (), bound, run, call)

    def _other(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        if is_metadata_query(func):
            return func(*args, **kwargs)
        return self._follow(func, args, kwargs, lambda: func(*args, **kwargs), None)

    def _follow(
        self,
        func: Callable,
        args: tuple,
        kwargs: dict,
        run: Callable[[], Any],
        call: TapCall | None,
    ) -> Any:
        arguments = list(args) + list(kwargs.values())
        positions = [i for i, a in enumerate(arguments) if a is self.current]
        stale = [a for a in arguments if isinstance(a, Tensor) and id(a) in self.seen]
        if stale or len(positions) > 1:
            raise NotSequentialError(
                f"{getattr(func, '__name__', func)} reads an earlier activation or the current "
                "one twice (a residual connection or reuse); KFRA's recursion is only defined "
                "for sequential networks. Use kflr or kfac instead."
            )
        if not positions:
            return run()
        name = getattr(func, "__name__", "")
        if name.endswith("_") and not name.startswith("__"):
            raise NotSequentialError(
                f"{name} changes an activation in place; write the model with "
                "out-of-place ops (e.g. nn.ReLU() rather than nn.ReLU(inplace=True)) for KFRA."
            )
        saved = self.current.clone() if kwargs.get("inplace") else self.current
        out = run()
        if "inplace" in kwargs:
            kwargs = {**kwargs, "inplace": False}
        self.links.append(Link(func, args, kwargs, positions[0], saved, out, call))
        if out is not self.current:
            self.seen.add(id(self.current))
        self.current = out
        return out


def trace_chain(model_fn: Callable, params: Any, leaves: list[Tensor], X: Tensor) -> list[Link]:
    """Record the ops of a sequential model applied to ``X``.

    Args:
        model_fn: ``model_fn(params, X)``.
        params: The parameter pytree.
        leaves: Its flattened leaves.
        X: The inputs, one tensor.

    Returns:
        The links, in the order the ops ran.

    Raises:
        NotSequentialError: if an op reads an earlier activation (residual connections,
            reused activations) or the output is not the end of the chain.

    Example:
        >>> fn, p = packfunc.functional(torch.nn.Sequential(torch.nn.Linear(3, 2),
        ...                                                 torch.nn.ReLU()))
        >>> [link.func.__name__ for link in trace_chain(fn, p, list(p.values()),
        ...                                             torch.ones(4, 3))]
        ['linear', 'relu']
    """
    if not isinstance(X, Tensor):
        raise NotSequentialError("KFRA needs a single input tensor X.")
    mode = _ChainMode(LeafIndex(leaves), X)
    with torch.no_grad(), mode:
        output = model_fn(params, X)
    if output is not mode.current:
        raise NotSequentialError(
            "the model output is not the last op applied to its input; KFRA's recursion is "
            "only defined for sequential networks. Use kflr or kfac instead."
        )
    return mode.links


def expected_jacobian_sandwich(link: Link, H: Tensor) -> Tensor:
    """``E_n[J_nᵀ H J_n]`` for one op, ``H`` over a sample's output entries.

    Reshapes keep ``H``; elementwise ops scale it by ``E_n[φ'_n φ'_nᵀ]``; a linear
    layer gives ``Wᵀ H W`` per position pair; a convolution has one Jacobian for all
    samples; every other op is averaged over the samples.

    Args:
        link: The op.
        H: ``[D_out, D_out]``.

    Returns:
        ``[D_in, D_in]``.
    """
    if link.func in RESHAPES:
        return H
    n = link.input.shape[0]
    if link.func in ELEMENTWISE:
        _, slope = jvp(link.apply, (link.input,), (torch.ones_like(link.input),))
        return _masked_gram(slope.reshape(n, -1), lambda rows: H[rows], H)
    if link.call is not None and link.func is F.linear:
        weight = link.kwargs["weight"]
        positions = link.output[0].numel() // weight.shape[0]
        blocks = H.view(positions, weight.shape[0], positions, weight.shape[0])
        return torch.einsum("oi,xoyp,pj->xiyj", weight, blocks, weight).reshape(
            positions * weight.shape[1], -1
        )
    if link.call is not None or link.func in SAMPLE_INDEPENDENT:
        return _sandwich(link.apply, link.input[:1], H)
    selection = _selection(link) if link.func in PIECEWISE_LINEAR else None
    if selection is not None:
        return _selection_sandwich(*selection, H, link.input[0].numel())
    total = _sandwich(link.apply, link.input[:1], H)
    for sample in range(1, n):  # one sample at a time: each term is [D_in, D_in]
        total = total + _sandwich(link.apply, link.input[sample : sample + 1], H)
    return total / n


def _selection(link: Link) -> tuple[Tensor, Tensor] | None:
    """``(source, slope)`` if every output entry is one scaled input entry, else ``None``.

    Max pooling, dropout and padding pick, per sample, one input entry (or none)
    for each output entry: ``J_n[a] = slope[n, a] · e_{source[n, a]}``. Three
    forward-mode products in float64 find and verify that: with tangents ``1``,
    ``i`` and ``i²`` (``i`` the entry's index), a one-hot row gives ``s``, ``s·i``
    and ``s·i²``; any other row fails the check.

    Args:
        link: A piecewise-linear op of the chain.

    Returns:
        ``source`` (int64) and ``slope``, both ``[N, D_out]``; ``None`` for other ops.
    """
    x = link.input.double()
    n = x.shape[0]
    index = torch.arange(x[0].numel(), dtype=x.dtype, device=x.device).expand(n, -1)
    try:
        slope, first, second = (
            jvp(link.apply, (x,), (t.reshape(x.shape),))[1].reshape(n, -1)
            for t in (torch.ones_like(index), index, index.square())
        )
    except RuntimeError:  # the op does not take a float64 copy of its input
        return None
    source = torch.where(slope != 0, first / slope.where(slope != 0, 1), 0).round()
    if not torch.allclose(second, slope * source.square(), rtol=1e-9, atol=1e-6):
        return None
    return source.long(), slope.to(link.input.dtype)


def _selection_sandwich(source: Tensor, slope: Tensor, H: Tensor, d_in: int) -> Tensor:
    """``E_n[J_nᵀ H J_n]`` for the scaled selections of :func:`_selection`.

    When each input entry is picked by at most one output entry (non-overlapping
    pools, dropout, padding), the result is ``H[owner, owner] ⊙ MᵀM / N``, with
    ``owner[i]`` that output entry and ``M[n, i]`` the slope with which sample ``n``
    picks ``i``: a gather and one matrix product for the whole batch. Otherwise the
    samples' blocks are scattered into the result one at a time.

    Args:
        source: ``[N, D_out]`` picked input entries.
        slope: ``[N, D_out]`` their factors (0 where nothing is picked).
        H: ``[D_out, D_out]``.
        d_in: Entries of one sample's input.

    Returns:
        ``[D_in, D_in]``.
    """
    n, d_out = source.shape
    picked = slope != 0
    owner = torch.full((d_in,), -1, dtype=torch.long, device=H.device)
    outputs = torch.arange(d_out, device=H.device).expand(n, -1)
    owner[source[picked]] = outputs[picked]
    if not torch.equal(owner[source[picked]], outputs[picked]):  # shared inputs
        total = H.new_zeros(d_in, d_in)
        for src, s in zip(source, slope):
            total.index_put_((src[:, None], src[None, :]), H * torch.outer(s, s), accumulate=True)
        return total / n
    M = H.new_zeros(n, d_in).scatter_add_(1, source, slope)
    owner = owner.clamp_min(0)  # inputs nobody picks have zero rows and columns in MᵀM
    return _masked_gram(M, lambda rows: H.index_select(0, owner[rows]).index_select(1, owner), H)


def _masked_gram(M: Tensor, factor: Callable[[slice], Tensor], H: Tensor) -> Tensor:
    """``F ⊙ MᵀM / N`` for ``M [N, D]``, with ``F[rows] = factor(rows)`` computed from ``H``.

    Built a block of rows at a time, in place and in huge pages where nothing is
    traced (the ``[D, D]`` results of KFRA reach gigabytes).
    """
    n, d = M.shape
    if not is_plain(M, H):
        return factor(slice(0, d)) * (M.T @ M) / n
    result = new_output((d, d), M)
    torch.matmul(M.T, M, out=result)
    for rows in chunks(d, max(1, DEFAULT_BUDGET // d)):
        result[rows] *= factor(rows)
    return result.div_(n)


def _sandwich(apply: Callable[[Tensor], Tensor], x: Tensor, H: Tensor) -> Tensor:
    """``Jᵀ H J`` for the Jacobian ``J`` of ``apply`` at one sample ``x`` (``[1, ...]``).

    Rows of ``H`` and then columns of ``H J`` are pulled back in slices that keep
    the pulled-back block within the memory budget.
    """
    out, pullback = vjp(apply, x)

    def pull(rows: Tensor) -> Tensor:
        slices = chunks(rows.shape[0], max(1, DEFAULT_BUDGET // x.numel()))
        return torch.cat(
            [
                vmap(lambda row: pullback(row.view(out.shape))[0].reshape(-1))(rows[s])
                for s in slices
            ]
        )

    return pull(pull(H).T)  # Jᵀ (H J)


PIECEWISE_LINEAR = frozenset(
    {
        F.max_pool1d,
        F.max_pool2d,
        F.max_pool3d,
        F.adaptive_max_pool1d,
        F.adaptive_max_pool2d,
        F.adaptive_max_pool3d,
        F.avg_pool1d,
        F.avg_pool2d,
        F.avg_pool3d,
        F.adaptive_avg_pool1d,
        F.adaptive_avg_pool2d,
        F.adaptive_avg_pool3d,
        F.pad,
        F.dropout,
    }
)
"""Ops whose second derivative vanishes almost everywhere: no curvature of their own."""

SAMPLE_INDEPENDENT = frozenset(
    {
        F.avg_pool1d,
        F.avg_pool2d,
        F.avg_pool3d,
        F.adaptive_avg_pool1d,
        F.adaptive_avg_pool2d,
        F.adaptive_avg_pool3d,
        F.pad,
    }
)
"""Affine ops whose Jacobian is the same at every sample: one sandwich serves the batch."""


def pch_block_product(bp: Backprop, leaf: int, mats: Tensor, modify: str) -> Tensor:
    """Positive-curvature Hessian block of one layer parameter times ``mats [V, *p]``.

    Tangents are pushed from the parameter forward through the chain (``jvp``),
    the loss Hessian and each elementwise op's modified curvature
    ``mod(δ ⊙ φ'')`` are applied, and the result is pulled back (``vjp``).

    Args:
        bp: The batch pass of a sequential model.
        leaf: Index of a weight or bias of one linear or convolution layer.
        mats: ``[V, *param.shape]``.
        modify: ``"clip"``, ``"abs"`` or ``"none"`` (the exact Hessian block).

    Returns:
        ``[V, *param.shape]``.

    Raises:
        NotSequentialError: for a non-sequential model, or the parameter not in one layer.
        ValueError: for a nonlinearity that is neither elementwise nor piecewise linear.
    """
    links = trace_chain(bp.model_fn, bp.params, bp.leaves, bp.X)
    owners = [
        i
        for i, link in enumerate(links)
        if link.call and any(j == leaf for _, j in link.call.leaves)
    ]
    if len(owners) != 1:
        raise NotSequentialError(
            f"{bp.names[leaf]} is not the weight or bias of exactly one linear or convolution "
            "layer of the chain; the PCH block product is defined for such parameters."
        )
    start = owners[0]
    owner = links[start].call
    assert owner is not None  # an owner is a layer call
    role = next(r for r, j in owner.leaves if j == leaf)
    downstream = links[start + 1 :]
    for link in downstream:
        if not _passes_recursions(link):
            raise ValueError(
                f"{getattr(link.func, '__name__', link.func)} is not elementwise; the "
                "positive-curvature Hessian only modifies elementwise nonlinearities."
            )
    curvature = _modified_curvature(bp, downstream, modify)
    loss_hessian = loss_hessian_product(bp.loss, bp.record.output, bp.y)

    def through_layer(value: Tensor) -> Tensor:
        return links[start].with_argument(role, value)

    def one(m: Tensor) -> Tensor:
        t = jvp(through_layer, (bp.leaves[leaf],), (m,))[1]
        tangents = []
        for link in downstream:
            tangents.append(t)
            t = jvp(link.apply, (link.input,), (t,))[1]
        c = loss_hessian(t)
        for link, t_in, r in zip(reversed(downstream), reversed(tangents), reversed(curvature)):
            c = vjp(link.apply, link.input)[1](c)[0]
            if r is not None:
                c = c + r * t_in
        return vjp(through_layer, bp.leaves[leaf])[1](c)[0]

    return vmap(one)(mats)


def loss_hessian_product(loss: nn.Module, output: Tensor, y: Any) -> Callable[[Tensor], Tensor]:
    """``t -> (∇²_f L) t``: the loss Hessian w.r.t. the model output times a tangent.

    Reverse-over-reverse: the Hessian is symmetric, so pulling ``t`` back through the
    loss gradient gives the product. Forward mode through a loss's backward is not
    reliable in torch (``MSELoss(reduction='mean')`` fails on an immutable ZeroTensor
    for the target's tangent, ``HuberLoss`` has no forward-mode formula).

    Args:
        loss: The loss module.
        output: The model output ``[N, ...]``.
        y: The targets.

    Returns:
        A function of a tangent shaped like ``output`` (``vmap``-able).

    Example:
        >>> product = loss_hessian_product(torch.nn.MSELoss(), torch.zeros(2, 3), torch.ones(2, 3))
        >>> product(torch.ones(2, 3))[0]
        tensor([0.3333, 0.3333, 0.3333])
    """

    def loss_of(out: Tensor) -> Tensor:
        return loss(out, y)

    _, pullback = vjp(grad(loss_of), output)
    return lambda t: pullback(t)[0]


def _second_derivative(apply: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """``φ''(x)`` of an elementwise op, by forward-over-forward differentiation."""
    ones = torch.ones_like(x)
    return jvp(lambda z: jvp(apply, (z,), (ones,))[1], (x,), (ones,))[1]


def _modified_curvature(bp: Backprop, links: list[Link], modify: str) -> list[Tensor | None]:
    """``mod(δ ⊙ φ'')`` at the input of each elementwise link (``None`` for the others)."""
    delta = bp.record.output_cotangent
    found: list[Tensor | None] = []
    for link in reversed(links):
        r = None
        if link.func in ELEMENTWISE:
            r = delta * _second_derivative(link.apply, link.input)
            r = {"clip": r.clamp_min(0), "abs": r.abs()}.get(modify, r)
        found.append(r)
        delta = vjp(link.apply, link.input)[1](delta)[0]
    return found[::-1]


RESIDUAL_MODIFICATIONS = {
    "none": lambda r: r,
    "clip": lambda r: r.clamp_min(0),
    "abs": lambda r: r.abs(),
}
"""How the Hessian variants treat the activations' residual curvature: keep, clip, abs."""


def summed_residual_curvature(bp: Backprop, links: list[Link], modify: str) -> list[Tensor | None]:
    """``mod(Σ_n δ_n ⊙ φ''_n)`` at the input of each elementwise link of the whole chain.

    The diagonal that the Hessian variants of KFRA add to the batch-averaged curvature
    at an elementwise op (BackPACK's HBP residual: summed over samples, then modified).

    Args:
        bp: The batch pass of a sequential model.
        links: Its chain, from :func:`trace_chain`.
        modify: A key of :data:`RESIDUAL_MODIFICATIONS`.

    Returns:
        Per link, ``[D_in]`` for elementwise ops, ``None`` for the others.

    Raises:
        ValueError: for an op that is neither a layer, elementwise, a reshape nor
            piecewise linear (its curvature is not diagonal).
    """
    for link in links:
        if not _passes_recursions(link):
            raise ValueError(
                f"{getattr(link.func, '__name__', link.func)} is neither a layer, elementwise, a "
                "reshape nor piecewise linear; the residual curvature the Hessian variants add "
                "is only defined (diagonal) for elementwise nonlinearities."
            )
    per_sample = _modified_curvature(bp, links, "none")
    return [
        None if r is None else RESIDUAL_MODIFICATIONS[modify](r.sum(0).reshape(-1))
        for r in per_sample
    ]


def layer_output_curvature(bp: Backprop, sites: list[int]) -> dict[int, Tensor] | None:
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
    try:
        links = trace_chain(bp.model_fn, bp.params, bp.leaves, bp.X)
    except NotSequentialError:
        return None
    layers = [i for i, link in enumerate(links) if link.call is not None]
    called = [link.call.leaves for link in links if link.call is not None]
    tapped = [k for k, site in enumerate(bp.plan.sites) if site.call.family != "local"]
    if called != [bp.plan.sites[k].call.leaves for k in tapped]:
        return None
    wanted = {layers[tapped.index(k)]: k for k in sites}
    start = min(wanted)
    if not all(_passes_recursions(link) for link in links[start:]):
        return None
    residual = _modified_curvature(bp, links[start + 1 :], "none")
    roots = hessian_factors(bp.loss, bp.record.output, bp.y).all()
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


def _passes_recursions(link: Link) -> bool:
    """Whether the chain recursions handle the op (layers, elementwise, reshapes, pooling)."""
    return bool(
        link.call
        or link.func in ELEMENTWISE
        or link.func in RESHAPES
        or link.func in PIECEWISE_LINEAR
    )


def _is_matrix_product(link: Link) -> bool:
    """Whether the link is ``F.linear`` on ``[N, features]`` inputs."""
    return link.func is F.linear and link.input.dim() == 2


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
