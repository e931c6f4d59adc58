"""The interface every rule implements.

A rule works on *columns*: a column ``(k, n)`` is the gradient of parameter
``θ`` pulled back from output cotangent ``k`` of sample ``n``. For first-order
quantities there is one output cotangent (``K = 1``: the loss gradient), for
the generalized Gauss-Newton there are ``K`` (the columns of the loss
Hessian's square root). The column gradient is ``c[k, n]`` (``columns``); every
other method is a reduction of it that a closed form may give more cheaply.

A rule first says, from the recorded call's shapes, where each statistic is
cheapest (:meth:`Rule.route`): straight from the recorded call
(:meth:`Rule.from_call`, e.g. a convolution's per-sample weight gradients as one
grouped convolution), from a closed form on the canonical layout (the default),
or reduced from materialized column gradients. Only the canonical route pays
for :meth:`Rule.canonical` (for a convolution, unfolding the input).
"""

from __future__ import annotations

import math
from enum import Enum
from typing import Any

import torch
from torch import Tensor

from packfunc.engine.memory import is_plain
from packfunc.engine.ops import SiteCall
from packfunc.engine.vocabulary import Statistic


class Route(Enum):
    """Where a rule takes a statistic from."""

    CALL = "call"
    """:meth:`Rule.from_call` on the recorded input and cotangents."""

    CANONICAL = "canonical"
    """The rule's closed form on the canonical pair (``None``: materialized instead)."""

    MATERIALIZED = "materialized"
    """Reduced from column gradients, which are cheaper than any closed form here."""


class Rule:
    """Closed forms for one parameter role (weight or bias) of one kind of layer.

    ``canonical`` receives the op's input ``x: [N, ...]`` and the cotangents of
    its output ``g: [K, N, ...]``; the other methods receive the canonical pair,
    whose sample dim is dim 1, restricted to the samples of interest. Methods
    with no closed form for the given tensors return ``None``; the engine then
    reduces materialized column gradients in chunks.
    """

    merge_dim: int | None = None
    """Dim along which canonical terms of several calls concatenate (``None``: they add up)."""

    kronecker_factors: int = 0
    """Number of Kronecker factors of the parameter's curvature block (0: no Kronecker rule)."""

    closed_form: bool = True
    """Whether the rule has closed forms of its own (``False``: the vjp of the op alone)."""

    fresh_columns: bool = False
    """Whether :meth:`columns` returns a tensor of its own (never a view of ``x`` or ``g``),
    which the column gradients of a leaf's other calls may be added into in place."""

    hessian_from_output_curvature: bool = False
    """Whether, with one position per sample (an output ``[N, O]``), the parameter's Hessian
    diagonal follows from the curvature of the layer's output ``diag(∂²L/∂z²)`` alone: a
    linear layer's weight and bias, which enter ``z = W x + b`` with an input that does not
    depend on them (see ``engine/hessian.py``)."""

    def merge(
        self, xs: list[Tensor], gs: list[Tensor], options: list[tuple[tuple[str, Any], ...]]
    ) -> tuple[Tensor, Tensor] | None:
        """One canonical term for several calls of a layer, or ``None`` if they must add up.

        Args:
            xs: Canonical inputs, one per call.
            gs: Canonical cotangents, one per call.
            options: The calls' options.

        Returns:
            The merged ``(x, g)``: concatenated along :attr:`merge_dim` when the calls agree
            on options and every other dim.
        """
        dim = self.merge_dim
        if dim is None:
            return None
        keys = {(o, x.dtype, x.shape[:dim], g.shape[:dim]) for o, x, g in zip(options, xs, gs)}
        if len(keys) != 1:
            return None
        return torch.cat(xs, dim=dim), torch.cat(gs, dim=dim)

    def canonical_input_size(self, x: Tensor, g: Tensor, call: SiteCall, param: Tensor) -> int:
        """Elements of the canonical input per sample (larger than ``x``'s where unfolded).

        Args:
            x: The op's recorded input ``[N, ...]``.
            g: Cotangents of its output ``[K, N, ...]``.
            call: The op call.
            param: The parameter.

        Returns:
            The count; here ``x``'s own per sample (the canonical input is a view).
        """
        return math.prod(x.shape[1:])

    def unfolds_input(self, x: Tensor, g: Tensor, call: SiteCall, param: Tensor) -> bool:
        """Whether the canonical input is larger than ``x`` (formed anew: an unfolded input).

        Args:
            x: The op's recorded input ``[N, ...]``.
            g: Cotangents of its output ``[K, N, ...]``.
            call: The op call.
            param: The parameter.

        Returns:
            ``canonical_input_size`` above ``x``'s own size per sample.
        """
        return self.canonical_input_size(x, g, call, param) > math.prod(x.shape[1:])

    def kronecker_factors_unfold(self, x: Tensor, g: Tensor, call: SiteCall, param: Tensor) -> bool:
        """Whether the Kronecker factors come from :meth:`unfolded_kronecker_factors`.

        Where :meth:`unfolds_input` (rules with a layout of their own for the factors, a
        transposed convolution's, say so too).

        Args:
            x, g, call, param: As for :meth:`unfolds_input`.

        Returns:
            Whether the raw input and cotangents give the factors, a few samples at a time.

        Example:
            >>> Rule().kronecker_factors_unfold(torch.ones(2, 3), torch.ones(1, 2, 3), None, None)
            False
        """
        return self.unfolds_input(x, g, call, param)

    def unfolded_kronecker_factors(
        self, x: Tensor, g: Tensor, call: SiteCall, param: Tensor, approx: str
    ) -> tuple[Tensor, Tensor]:
        """The output and input factors where :meth:`kronecker_factors_unfold`, in chunks.

        Args:
            x: The op's recorded input ``[N, ...]``.
            g: Cotangents of its output ``[K, N, ...]``.
            call: The op call.
            param: The parameter.
            approx: How positions enter (see :mod:`packfunc.kronecker_factors`).

        Returns:
            ``(output factor, input factor)``.

        Raises:
            NotImplementedError: here; rules whose canonical input is unfolded override it.
        """
        raise NotImplementedError(f"{type(self).__name__} does not unfold its input")

    def kronecker(self, call: SiteCall) -> int:
        """Number of Kronecker factors this rule gives for ``call`` (0: none)."""
        return self.kronecker_factors

    def route(self, stat: Statistic, x: Tensor, g: Tensor, call: SiteCall, param: Tensor) -> Route:
        """Where ``stat`` is cheapest for this call, judged from the shapes alone.

        Args:
            stat: The statistic wanted.
            x: The op's recorded input ``[N, ...]`` (not canonical).
            g: Cotangents of its output ``[K, N, ...]``.
            call: The op call.
            param: The parameter.

        Returns:
            :attr:`Route.CANONICAL` here; rules with a cheaper source override it.

        Example:
            >>> from packfunc.engine.ops import SIGNATURES
            >>> Rule().route(Statistic.COLUMNS, torch.ones(2, 3), torch.ones(1, 2, 4),
            ...              SiteCall(SIGNATURES[F.linear], (), ()), torch.ones(4, 3))
            <Route.CANONICAL: 'canonical'>
        """
        return Route.CANONICAL

    def from_call(
        self, stat: Statistic, x: Tensor, g: Tensor, call: SiteCall, param: Tensor
    ) -> Tensor:
        """A statistic :meth:`route` sends to :attr:`Route.CALL`, from the recorded call.

        Args:
            stat: :attr:`~Statistic.COLUMNS` or :attr:`~Statistic.SUM` (additive over calls),
                or any statistic the rule routes there.
            x: The op's input ``[n, ...]``, restricted to the samples wanted.
            g: Cotangents of its output ``[K, n, ...]``, restricted likewise.
            call: The op call.
            param: The parameter.

        Returns:
            The statistic, shaped as the method of the same name returns it.
        """
        raise NotImplementedError(f"{type(self).__name__} routes nothing to the recorded call")

    def canonical(
        self, x: Tensor, g: Tensor, call: SiteCall, param: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Bring ``(x [N, ...], g [K, N, ...])`` into the layout the other methods expect."""
        return x, g

    def kronecker_layout(
        self, x: Tensor, g: Tensor, call: SiteCall, param: Tensor
    ) -> tuple[Tensor, Tensor] | None:
        """The pair :meth:`input_factor` and :meth:`output_factor` read, if not the canonical one.

        Args:
            x: The op's input ``[N, ...]``.
            g: Cotangents of its output ``[K, N, ...]``.
            call: The op call.
            param: The parameter.

        Returns:
            ``None`` (the canonical pair serves), or the pair to read the factors from.
        """
        return None

    def columns(self, x: Tensor, g: Tensor, call: SiteCall, param: Tensor) -> Tensor:
        """Column gradients ``[K, n, *param.shape]``."""
        raise NotImplementedError

    def add_columns(
        self, total: Tensor, x: Tensor, g: Tensor, call: SiteCall, param: Tensor
    ) -> Tensor:
        """Add this call's column gradients into ``total``: in place where nothing tracks it.

        Args:
            total: Column gradients ``[K, n, *param.shape]`` of the leaf's other calls, a
                tensor of the caller's own.
            x: Canonical input.
            g: Canonical cotangents.
            call: The op call.
            param: The parameter.

        Returns:
            ``total``, with this call's share added.
        """
        found = self.columns(x, g, call, param)
        return total.add_(found) if is_plain(total, found) else total + found

    def column_sum(self, x: Tensor, g: Tensor, call: SiteCall, param: Tensor) -> Tensor:
        """``Σ_{k,n} c[k, n]``."""
        return self.columns(x, g, call, param).sum((0, 1))

    def diagonal(self, x: Tensor, g: Tensor, call: SiteCall, param: Tensor) -> Tensor | None:
        """``Σ_{k,n} c[k, n]²`` in closed form, or ``None``."""
        return None

    def diagonal_per_sample(
        self, x: Tensor, g: Tensor, call: SiteCall, param: Tensor
    ) -> Tensor | None:
        """``Σ_k c[k, n]²`` per sample, ``[n, *param.shape]``, or ``None``."""
        return None

    def squared_norms(self, x: Tensor, g: Tensor, call: SiteCall, param: Tensor) -> Tensor | None:
        """``Σ_k ‖c[k, n]‖²`` per sample, ``[n]``, or ``None``."""
        return None

    def position_terms(self, x: Tensor, g: Tensor, call: SiteCall, param: Tensor) -> Tensor | None:
        """The squared sizes of the terms each sample's gradient sums, ``[n]``, or ``None``.

        A gradient summed over positions (``Σ_l v_l u_lᵀ``) has terms ``Σ_{k,l} ‖v_kl‖²‖u_kl‖²``;
        where its squared norm is far below them (its positions cancel), a contraction over
        the batch rounds it by more than it is (see
        :func:`~packfunc.engine.rules.product.formed_where_cancelled`). ``None``: the rule
        gives no such bound.
        """
        return None

    def takes_closed_form(self, x: Any, call: SiteCall, param: Tensor, rank: int) -> bool:
        """Whether this call's column gradients come from the rule's closed forms.

        Args:
            x: The op's recorded input (a local call's
                :class:`~packfunc.engine.local.LocalInputs`).
            call: The op call.
            param: The parameter.
            rank: Dims of the op's output.

        Returns:
            :attr:`closed_form` here; a rule whose closed form depends on the call's
            arguments (falling back to the op-local vjp otherwise) looks at them.
        """
        return self.closed_form

    def outer_factors(
        self, x: Tensor, g: Tensor, call: SiteCall, param: Tensor
    ) -> tuple[Tensor, Tensor] | None:
        """The call's share of each sample's gradient as outer products over positions.

        Sample ``n``'s share is ``Σ_l a[n, l] b[n, l]ᵀ`` in the parameter's layout: ``a``
        holds its rows (``[n, L, rows]``, or ``[n, L]`` integer indices of one-hot rows),
        ``b`` its columns ``[n, L, cols]``. Calls of several kinds that share a parameter
        (tied weights) get their squared norms in Gram form from these
        (:mod:`packfunc.engine.tied`).

        Args:
            x: The op's recorded input ``[n, ...]`` (not canonical).
            g: Cotangents of its output ``[1, n, ...]``: one column.
            call: The op call.
            param: The parameter, a matrix.

        Returns:
            ``(a, b)``, or ``None`` where the rule has no such form.
        """
        return None

    def sums_positions(self, g: Tensor, approx: str) -> bool:
        """Whether :meth:`output_factor` is ``Σ_{k,n} s sᵀ`` of the position-summed cotangent.

        Such factors of one call agree across its parameters (a layer's weight and
        bias), so they are computed once.

        Args:
            g: Canonical cotangent columns.
            approx: The position convention.

        Returns:
            ``False`` unless the rule says so.
        """
        return False

    def output_factor(self, g: Tensor, approx: str) -> Tensor:
        """Kronecker factor from the cotangent columns (additive over columns).

        Args:
            g: Canonical cotangent columns.
            approx: How positions enter (see :mod:`packfunc.kronecker_factors`).

        Returns:
            The output-side factor, ``[O, O]``.
        """
        raise NotImplementedError

    def input_factor(
        self, x: Tensor, approx: str, *, add_to: Tensor | None = None, samples: int | None = None
    ) -> Tensor:
        """Kronecker factor from the op's (canonical) input, ``[I, I]``.

        Args:
            x: Canonical input.
            approx: How positions enter (see :mod:`packfunc.kronecker_factors`).
            add_to: A factor this one is added into, in place (a batch in chunks).
            samples: The batch size the factor averages over (default: ``x``'s).

        Returns:
            The factor (``add_to`` itself where given).
        """
        raise NotImplementedError

    def kronecker_gradients(self, grads: Tensor, call: SiteCall) -> Tensor:
        """Parameter-shaped gradients ``[M, *p]`` with their axes in the Kronecker factors' order.

        Flattened (row-major) they are vectors in the factors' ``A ⊗ B`` layout.

        Args:
            grads: Gradients ``[M, *param.shape]``.
            call: The op call.

        Returns:
            ``grads`` itself here; rules whose factors are of a rearranged parameter override it.
        """
        return grads

    def kronecker_order(self, output: Tensor, input: Tensor) -> list[Tensor]:
        """The two factors in the order of the parameter's layout (``[out, in]``: output first).

        Args:
            output: The output-side factor.
            input: The input-side factor.

        Returns:
            ``[output, input]``; rules of parameters stored ``[in, out]`` reverse it.

        Example:
            >>> Rule().kronecker_order("A", "B")
            ['A', 'B']
        """
        return [output, input]
