"""Kronecker algebra as pure functions on the curvature pytrees of kfac, kflr, kfra and ekfac.

A *curvature pytree* is shaped like ``params``; each entry is one of

* a list of Kronecker factors, ``[A, B]`` (``A ⊗ B``, a weight) or ``[A]`` (a bias),
  as returned by :func:`packfunc.kfac`, :func:`packfunc.kflr` and :func:`packfunc.kfra`;
* an :class:`Eigen` (``Q diag(λ) Qᵀ`` with ``Q = Q_A ⊗ Q_B``), as returned by
  :func:`packfunc.ekfac` and :func:`eigh`;
* ``None`` (a parameter without a Kronecker rule, ``on_unsupported="skip"``): every
  function here passes it through, so the result has ``None`` there too.

A parameter ``V`` multiplies the entry in the Kronecker layout ``V.reshape(dim A, dim B)``
(row-major: a linear weight ``[out, in]``, a convolution weight ``[C_out, C_in/groups·k…]``).
A transposed convolution's weight ``[C_in, C_out/groups, k…]`` has its factors in the layout
of the convolution it transposes, ``[C_out, C_in/groups·k…]``: each group's channel axes
swapped on their own, ``weight.unflatten(0, (groups, -1)).transpose(1, 2).flatten(0, 1)``
(``weight.transpose(0, 1)`` only for one group), so apply them to that. All factors are
symmetric positive semi-definite; eigenvalues below zero (rounding) are clamped to zero.
Eigendecompositions are batched: equal-shaped factors of all layers are stacked and
decomposed by one ``torch.linalg.eigh``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ForwardRef, NamedTuple, TypeVar, cast

import optree
import torch
from torch import Tensor
from torch._C._functorch import is_functorch_wrapped_tensor

from packfunc.types import Factors, ParamsT, PyTree

T = TypeVar("T")


class Eigen(NamedTuple):
    """A Kronecker-factored eigendecomposition ``(Q_A ⊗ Q_B) diag(vec λ) (Q_A ⊗ Q_B)ᵀ``.

    Attributes:
        eigenvectors: ``[Q_A, Q_B]`` (a weight) or ``[Q_A]`` (a bias), orthogonal columns.
        eigenvalues: ``λ`` shaped ``[dim A, dim B]`` (or ``[dim A]``): ``λ[i, j]`` belongs
            to the eigenvector ``Q_A[:, i] ⊗ Q_B[:, j]``.

    Example:
        >>> e = Eigen([torch.eye(2), torch.eye(3)], torch.ones(2, 3))
        >>> dense(e).shape
        torch.Size([6, 6])
    """

    eigenvectors: list[Tensor]
    eigenvalues: Tensor


Entry = Factors | Eigen
"""One parameter's curvature: Kronecker factors ``[A, B]``/``[A]`` or an :class:`Eigen`."""

if TYPE_CHECKING:
    Curvature = Entry | Mapping[str, "Curvature"] | Sequence["Curvature"] | None
else:  # a forward reference that typing.get_type_hints resolves from any module
    _Curvature = ForwardRef("Curvature", module=__name__)
    Curvature = Entry | Mapping[str, _Curvature] | Sequence[_Curvature] | None
"""A curvature pytree: shaped like ``params``, an :data:`Entry` (or ``None``) per parameter."""


def is_entry(node: object) -> bool:
    """Whether ``node`` is one parameter's entry of a curvature pytree.

    Args:
        node: A node of a curvature pytree.

    Returns:
        ``True`` for ``None``, an :class:`Eigen`, or a list of one or two square matrices.

    Example:
        >>> is_entry([torch.eye(2), torch.eye(3)]), is_entry({"w": None})
        (True, False)
    """
    if node is None or isinstance(node, Eigen):
        return True
    return (
        isinstance(node, list)
        and len(node) in (1, 2)
        and all(isinstance(f, Tensor) and f.dim() == 2 and f.shape[0] == f.shape[1] for f in node)
    )


def eigh(curvature: Curvature) -> Curvature:
    """Eigendecompose every entry: factors ``[A, B]`` become ``Eigen([Q_A, Q_B], λ_A λ_Bᵀ)``.

    A factor's eigenvalues within its rounding of zero (below ``size · eps`` times its
    largest: a rank-deficient factor, from fewer samples than its size) are zero.

    Args:
        curvature: A curvature pytree (entries already :class:`Eigen` are kept).

    Returns:
        The pytree with :class:`Eigen` entries (``None`` kept).

    Example:
        >>> e = eigh({"w": [torch.eye(2) * 2, torch.eye(3)]})["w"]
        >>> e.eigenvalues
        tensor([[2., 2., 2.],
                [2., 2., 2.]])
    """
    entries, spec = _flatten(curvature)
    factors = [f for entry in entries if isinstance(entry, list) for f in entry]
    decomposed = iter(batched_eigh(factors))
    found: list[Any] = []
    for entry in entries:
        if not isinstance(entry, list):
            found.append(entry)
            continue
        pairs = [(_zero_within_rounding(v), q) for v, q in (next(decomposed) for _ in entry)]
        values = pairs[0][0] if len(pairs) == 1 else torch.outer(pairs[0][0], pairs[1][0])
        found.append(Eigen([q for _, q in pairs], values))
    return cast(Curvature, spec.unflatten(found))


def batched_eigh(matrices: list[Tensor]) -> list[tuple[Tensor, Tensor]]:
    """``torch.linalg.eigh`` of symmetric matrices, one call per shape, eigenvalues ≥ 0.

    Equal matrices (a bias shares its layer's output factor) are decomposed once.

    Args:
        matrices: Symmetric positive semi-definite matrices of any sizes.

    Returns:
        ``(eigenvalues, eigenvectors)`` per matrix, in order.

    Example:
        >>> [(values, _)] = batched_eigh([torch.diag(torch.tensor([3.0, -1e-9]))])
        >>> values
        tensor([0., 3.])
    """

    def decompose(stacked: Tensor) -> list[tuple[Tensor, Tensor]]:
        try:
            found = torch.linalg.eigh(_decomposable(stacked))
            values, vectors = (t.to(stacked.dtype) for t in found)
            finite = bool(torch.isfinite(values.sum() + vectors.sum()))  # a NaN or inf anywhere
        except torch.linalg.LinAlgError:  # type: ignore[attr-defined]
            finite = False
        if not finite:
            _refuse_non_finite(stacked)
            # LAPACK's float32 eigh can return NaN on large rank-deficient matrices (seen on
            # one thread for a 2048² factor of rank 64): redo the stack in float64 (also
            # when a sum of huge eigenvalues overflows, which costs time, not accuracy)
            values, vectors = (t.to(stacked.dtype) for t in torch.linalg.eigh(stacked.double()))
        return list(zip(values.clamp_min(0).unbind(0), vectors.unbind(0)))

    return _per_distinct_matrix(matrices, decompose)


def _refuse_non_finite(stacked: Tensor) -> None:
    """Refuse factors holding NaN or inf: no eigendecomposition of theirs means anything.

    Raises:
        ValueError: naming where such values come from (LAPACK's own error before).

    Example:
        >>> _refuse_non_finite(torch.eye(2)[None])
    """
    if not bool(torch.isfinite(stacked).all()):
        raise ValueError(
            "a curvature factor holds NaN or inf (from a NaN or inf in a sample's input, the "
            "model's output or the loss, or values that overflow the dtype), and has no "
            "eigendecomposition. Find the sample (pf.batch_l2_grad reads NaN or inf there) "
            "and drop or fix it before computing the curvature."
        )


def power(curvature: Curvature, exponent: float, damping: float = 0.0) -> Curvature:
    """``(C + damping·I)^exponent`` of every entry, exactly, via its Kronecker eigenbasis.

    Args:
        curvature: A curvature pytree.
        exponent: The power, e.g. ``-1`` (inverse) or ``-0.5`` (inverse square root).
        damping: Added to every eigenvalue; must be positive for a negative exponent.

    Returns:
        The pytree with :class:`Eigen` entries.

    Raises:
        ValueError: for a negative exponent without positive damping.

    Example:
        >>> power({"b": [torch.eye(2) * 3]}, -1, damping=1.0)["b"].eigenvalues
        tensor([0.2500, 0.2500])
    """
    if exponent < 0 and not damping > 0:
        raise ValueError(
            f"a negative power of a positive semi-definite matrix needs damping > 0; got "
            f"damping={damping!r}. Pass e.g. damping=1e-3."
        )
    entries, spec = _flatten(eigh(curvature))
    found = [
        None if e is None else Eigen(e.eigenvectors, (e.eigenvalues + damping).pow(exponent))
        for e in entries
    ]
    return cast(Curvature, spec.unflatten(found))


def inverse(curvature: Curvature, damping: float) -> Curvature:
    """The exactly damped inverse ``(A ⊗ B + damping·I)⁻¹`` of every entry (eigenbasis).

    Args:
        curvature: A curvature pytree.
        damping: Positive damping.

    Returns:
        The pytree with :class:`Eigen` entries.

    Example:
        >>> inverse({"b": [torch.eye(2)]}, 1.0)["b"].eigenvalues
        tensor([0.5000, 0.5000])
    """
    return power(curvature, -1.0, damping)


def inverse_sqrt(curvature: Curvature, damping: float) -> Curvature:
    """The damped inverse square root ``(A ⊗ B + damping·I)^(-1/2)`` of every entry.

    Args:
        curvature: A curvature pytree.
        damping: Positive damping.

    Returns:
        The pytree with :class:`Eigen` entries.

    Example:
        >>> inverse_sqrt({"b": [torch.eye(2) * 3]}, 1.0)["b"].eigenvalues
        tensor([0.5000, 0.5000])
    """
    return power(curvature, -0.5, damping)


def factor_damped_power(curvature: Curvature, damping: float, exponent: float = -1.0) -> Curvature:
    """π-damped factor powers ``[(A + π√d·I)^e, (B + √d/π·I)^e]`` (Martens & Grosse, 2015).

    ``π = √((tr A / dim A) / (tr B / dim B))``; a bias ``[A]`` gets ``[(A + d·I)^e]``. For
    ``e = -1`` the product approximates ``(A ⊗ B + d·I)⁻¹`` at the cost of two factor
    inverses (Cholesky; other powers by ``eigh``). Use :func:`inverse` for the exact damped
    inverse.

    Args:
        curvature: A curvature pytree of factor lists (not :class:`Eigen`).
        damping: Positive damping ``d``.
        exponent: The power ``e`` of each damped factor.

    Returns:
        The pytree of damped factor powers.

    Raises:
        ValueError: for non-positive damping.
        TypeError: for :class:`Eigen` entries (EKFAC's eigenvalues do not factor).

    Example:
        >>> [Ai, Bi] = factor_damped_power({"w": [torch.eye(2), torch.eye(2)]}, 1.0)["w"]
        >>> Ai.diagonal()
        tensor([0.5000, 0.5000])
    """
    if not damping > 0:
        raise ValueError(f"π-damping needs damping > 0; got damping={damping!r}.")
    entries, spec = _flatten(curvature)
    if any(isinstance(e, Eigen) for e in entries):
        raise TypeError(
            "factor_damped_power needs Kronecker factors [A, B]; an Eigen entry (ekfac) has "
            "eigenvalues that do not factor. Use inverse(curvature, damping) instead."
        )
    factors: list[Tensor] = []
    shifts: list[Tensor] = []
    for entry in entries:
        if entry is None:
            continue
        if len(entry) == 1:
            factors.append(entry[0])
            shifts.append(torch.tensor(damping, dtype=entry[0].dtype, device=entry[0].device))
            continue
        A, B = entry
        mean_a, mean_b = A.trace() / A.shape[0], B.trace() / B.shape[0]
        pi = (mean_a / mean_b).sqrt() if bool(mean_a > 0) and bool(mean_b > 0) else A.new_ones(())
        factors += [A, B]
        shifts += [pi * math.sqrt(damping), math.sqrt(damping) / pi]
    powered = iter(_damped_powers(factors, shifts, exponent))
    found = [None if e is None else [next(powered) for _ in e] for e in entries]
    return cast(Curvature, spec.unflatten(found))


def matvec(curvature: Curvature, vector: ParamsT) -> ParamsT:
    """Multiply every entry with the matching leaf of a params-shaped pytree.

    ``[A, B]`` applied to ``V`` is ``A V Bᵀ`` (``V`` as ``[dim A, dim B]``); an
    :class:`Eigen` is ``Q_A ((Q_Aᵀ V Q_B) ⊙ λ) Q_Bᵀ``.

    Args:
        curvature: A curvature pytree.
        vector: A pytree like ``params`` (e.g. a gradient).

    Returns:
        A pytree like ``vector`` (``None`` where the curvature entry is ``None``).

    Raises:
        ValueError: if a leaf's size does not match its entry, or (with two factors) its
            leading dim is not the first factor's: another layout of the same size.

    Example:
        >>> matvec({"w": [torch.eye(2) * 2, torch.eye(3)]}, {"w": torch.ones(2, 3)})["w"]
        tensor([[2., 2., 2.],
                [2., 2., 2.]])
    """
    entries, spec = _flatten(curvature)
    leaves = spec.flatten_up_to(cast(Any, vector))
    return cast(ParamsT, spec.unflatten([_apply(e, v) for e, v in zip(entries, leaves)]))


def logdet(curvature: Curvature, damping: float = 0.0) -> PyTree:
    """``log det(C + damping·I)`` of every entry (one scalar each).

    Undamped factors use ``log det(A ⊗ B) = dim B · log det A + dim A · log det B``. Undamped,
    a factor's eigenvalue within rounding of zero (below ``size · eps`` times its largest: a
    rank-deficient factor, from fewer samples than its size) counts as zero, and the
    log-determinant of that singular matrix is ``-inf``, not the log of rounding noise. An
    :class:`Eigen` entry's fitted eigenvalues (EKFAC's are means of squares, accurate to their
    own size) count as zero below ``(numel · eps)^1.5`` times the largest; :func:`eigh`'s
    (products of its factors', each zeroed within its factor's rounding) as they are. Each
    entry is taken alone.

    Args:
        curvature: A curvature pytree.
        damping: Added to every eigenvalue.

    Returns:
        A pytree of scalars (``None`` kept); add the leaves for the whole model.

    Example:
        >>> logdet({"w": [torch.eye(2) * 2, torch.eye(3)]})["w"]
        tensor(4.1589)
    """
    entries, spec = _flatten(curvature)
    if damping:
        decomposed = _flatten(eigh(curvature))[0]
        found = [None if e is None else (e.eigenvalues + damping).log().sum() for e in decomposed]
    else:
        found = [None if e is None else _undamped_logdet(e) for e in entries]
    return cast(PyTree, spec.unflatten(found))


def trace(curvature: Curvature, damping: float = 0.0) -> PyTree:
    """``tr(C + damping·I)`` of every entry: ``tr A · tr B`` for factors, ``Σ λ`` for Eigen.

    Args:
        curvature: A curvature pytree.
        damping: Added to every eigenvalue.

    Returns:
        A pytree of scalars (``None`` kept).

    Example:
        >>> trace({"w": [torch.eye(2) * 2, torch.eye(3)]}, damping=1.0)["w"]
        tensor(18.)
    """
    entries, spec = _flatten(curvature)
    return cast(
        PyTree, spec.unflatten([None if e is None else _trace(e, damping) for e in entries])
    )


def dense(curvature: Curvature) -> PyTree:
    """The dense matrix of every entry (``torch.kron(A, B)``; ``Q diag(λ) Qᵀ``): for tests.

    Args:
        curvature: A curvature pytree, or a single entry.

    Returns:
        A pytree of ``[P, P]`` matrices (``None`` kept), or one matrix for one entry.

    Example:
        >>> dense([torch.eye(2), 2 * torch.ones(1, 1)])
        tensor([[2., 0.],
                [0., 2.]])
    """
    if isinstance(curvature, Eigen) or (is_entry(curvature) and curvature is not None):
        return _dense(curvature)
    entries, spec = _flatten(curvature)
    return cast(PyTree, spec.unflatten([None if e is None else _dense(e) for e in entries]))


def map_entries(function: Callable[[Entry], T], curvature: Curvature) -> object:
    """Apply ``function`` to every non-``None`` entry of a curvature pytree.

    Args:
        function: Maps an entry (factor list or :class:`Eigen`) to anything.
        curvature: A curvature pytree.

    Returns:
        The pytree of results (``None`` kept).

    Example:
        >>> map_entries(len, {"w": [torch.eye(2), torch.eye(3)], "b": None})
        {'w': 2, 'b': None}
    """
    entries, spec = _flatten(curvature)
    return cast(object, spec.unflatten([None if e is None else function(e) for e in entries]))


def _flatten(curvature: Any) -> tuple[list[Any], optree.PyTreeSpec]:
    """The entries of a curvature pytree and its structure (entries as leaves)."""
    entries, spec = optree.tree_flatten(curvature, is_leaf=is_entry, none_is_leaf=True)
    for entry in entries:
        if not is_entry(entry):
            raise TypeError(
                "a curvature pytree's entries are factor lists [A, B] or [A] of square "
                f"matrices, Eigen, or None; got {type(entry).__name__}."
            )
    return entries, spec


def _damped_powers(factors: list[Tensor], shifts: list[Tensor], exponent: float) -> list[Tensor]:
    """``(F + s·I)^e`` of each positive semi-definite factor ``F`` and its shift ``s > 0``.

    Inverses by Cholesky, one call per shape; other powers, and inverses Cholesky refuses
    (a rank-deficient float32 factor whose rounding exceeds a small shift), from ``F``'s
    eigenvalues clamped at zero (as :func:`inverse` takes them) plus ``s``.

    Example:
        >>> singular = torch.tensor([[1.0, 1.0], [1.0, 1.0 - 1e-6]])  # an eigenvalue < 0
        >>> bool(torch.isfinite(_damped_powers([singular], [torch.tensor(1e-9)], -1.0)[0]).all())
        True
    """
    if exponent == -1:
        inverses = _batched_inverse([_add_identity(f, s) for f, s in zip(factors, shifts)])
        if inverses is not None:
            return inverses
    return [
        (q * (v + s).pow(exponent)) @ q.T
        for (v, q), s in zip(batched_eigh(factors), shifts, strict=True)
    ]


def _batched_inverse(matrices: list[Tensor]) -> list[Tensor] | None:
    """Inverses of symmetric positive definite matrices by Cholesky, one call per shape.

    ``None`` if one is not positive definite in its dtype.
    """

    def invert(stacked: Tensor) -> list[Tensor | None]:
        factor, info = torch.linalg.cholesky_ex(_decomposable(stacked))
        if bool(info.any()):
            return [None] * len(stacked)
        return list(torch.cholesky_inverse(factor).to(stacked.dtype).unbind(0))

    found = _per_distinct_matrix(matrices, invert)
    return None if any(f is None for f in found) else found


def _per_distinct_matrix(
    matrices: list[Tensor], batched: Callable[[Tensor], list[Any]]
) -> list[Any]:
    """Apply ``batched`` to the stack of each shape's distinct matrices; equal ones share a result.

    Args:
        matrices: Square matrices of any sizes.
        batched: Maps a stack ``[k, n, n]`` to ``k`` results.

    Returns:
        One result per matrix, in order.
    """
    found: list[Any] = [None] * len(matrices)
    for indices in _by_shape(matrices).values():
        distinct: list[int] = []
        copy_of: dict[int, int] = {}
        for i in indices:
            same = next((d for d in distinct if _equal(matrices[d], matrices[i])), None)
            if same is None:
                distinct.append(i)
            else:
                copy_of[i] = same
        for i, result in zip(distinct, batched(torch.stack([matrices[d] for d in distinct]))):
            found[i] = result
        for i, same in copy_of.items():
            found[i] = found[same]
    return found


def _equal(a: Tensor, b: Tensor) -> bool:
    """Whether two matrices are one: the same tensor, or equal values no gradient reaches.

    Equal values of another tensor share a result only where nothing differentiates them:
    an identity-initialized layer's input factor equals the next layer's in value, and a
    shared decomposition sent the second's gradient (a Laplace evidence's ``logdet``) into
    the first's graph (a probe: 99 % of a weight's gradient lost).

    Example:
        >>> _equal(torch.eye(2), torch.eye(2)), _equal(torch.eye(2).requires_grad_(), torch.eye(2))
        (True, False)
    """
    if a is b:
        return True
    plain = not any(t.requires_grad or is_functorch_wrapped_tensor(t) for t in (a, b))
    return plain and torch.equal(a, b)


def _by_shape(
    matrices: list[Tensor],
) -> dict[tuple[torch.Size, torch.dtype, torch.device], list[int]]:
    """Indices of the matrices, grouped by shape, dtype and device (to stack them)."""
    groups: dict[tuple[torch.Size, torch.dtype, torch.device], list[int]] = {}
    for i, m in enumerate(matrices):
        groups.setdefault((m.shape, m.dtype, m.device), []).append(i)
    return groups


def _add_identity(matrix: Tensor, shift: Tensor | float) -> Tensor:
    return matrix + shift * torch.eye(matrix.shape[0], dtype=matrix.dtype, device=matrix.device)


def _apply(entry: Any, vector: Any) -> Tensor | None:
    """One entry times one parameter-shaped tensor."""
    if entry is None:
        return None
    eigen = isinstance(entry, Eigen)
    factors = entry.eigenvectors if eigen else entry
    sizes = [f.shape[0] for f in factors]
    if vector.numel() != math.prod(sizes):
        raise ValueError(
            f"a tensor of shape {tuple(vector.shape)} does not match Kronecker factors of sizes "
            f"{sizes}: pass a pytree shaped like the params the curvature was computed for."
        )
    if len(sizes) == 2 and vector.dim() > 1 and vector.shape[0] != sizes[0]:
        # (the right size in another layout: a transposed convolution's own weight layout
        # [C_in, C_out/G, k…], whose factors belong to the kernel with its channels swapped)
        raise ValueError(
            f"a tensor of shape {tuple(vector.shape)} does not lead with the first factor's "
            f"size {sizes[0]}: its layout is not the factors' [{sizes[0]}, {sizes[1]}]. For a "
            "transposed convolution pass weight.unflatten(0, (groups, -1)).transpose(1, 2)"
            ".flatten(0, 1) (weight.transpose(0, 1) for one group), and transpose back."
        )
    if len(factors) == 1:  # a matrix-vector product
        v, (Q,) = vector.reshape(-1), factors
        result: Tensor = Q @ ((Q.T @ v) * entry.eigenvalues.reshape(-1)) if eigen else Q @ v
        return result.view(vector.shape)
    V = vector if vector.shape == (sizes[0], sizes[1]) else vector.reshape(sizes)
    QA, QB = factors
    if eigen:
        rotated = QA.T @ V @ QB
        values = entry.eigenvalues
        result = QA @ (rotated * (values if values.shape == rotated.shape else values.view(sizes)))
        result = result @ QB.T
    else:
        result = QA @ V @ QB.T
    return result if result.shape == vector.shape else result.reshape(vector.shape)


def _decomposable(matrix: Tensor) -> Tensor:
    """``matrix`` in a dtype torch's decompositions take: float16 and bfloat16 as float32.

    ``eigh``, ``cholesky`` and ``slogdet`` have no half-precision kernels (a model with
    bfloat16 parameters has bfloat16 factors); results go back to the factors' dtype.

    Example:
        >>> _decomposable(torch.eye(2, dtype=torch.bfloat16)).dtype
        torch.float32
    """
    return matrix.float() if matrix.dtype in (torch.float16, torch.bfloat16) else matrix


def _factor_logdet(factors: list[Tensor]) -> Tensor:
    sums = [
        _zero_within_rounding(torch.linalg.eigvalsh(_decomposable(f))).log().sum() for f in factors
    ]
    if len(factors) == 1:
        return sums[0].to(factors[0].dtype)
    A, B = factors
    return (B.shape[0] * sums[0] + A.shape[0] * sums[1]).to(A.dtype)


def _undamped_logdet(entry: Any) -> Tensor:
    """``log det`` of one entry: per factor, or ``Σ log λ`` of an :class:`Eigen`'s (see logdet).

    A threshold on the products ``λ_A λ_B`` of a whole pytree (as one was) zeroed genuine
    small products of full-rank float32 factors: ``-inf`` for a curvature with a determinant.
    """
    if not isinstance(entry, Eigen):
        return _factor_logdet(entry)
    values = entry.eigenvalues
    if _factor_products(values):  # eigh's: each factor's were zeroed within its rounding
        kept = _zero_within_rounding(values) if values.dim() == 1 else values
        return kept.log().sum()
    # a null direction's mean square of projections is ~(n·eps)² of the largest; an eigh's
    # rounding n·eps would zero genuine small ones (1e-5 of the largest, in float32)
    rounding = values.max() * (values.numel() * torch.finfo(values.dtype).eps) ** 1.5
    return torch.where(values > rounding, values, 0).log().sum()


def _factor_products(values: Tensor) -> bool:
    """Whether an :class:`Eigen`'s eigenvalues are ``λ_A ⊗ λ_B`` (:func:`eigh`'s), not fitted.

    A rank-one ``[dim A, dim B]`` table to rounding: the column and row through its largest
    entry reproduce it. A bias's ``[dim A]`` are one factor's (or fitted ones, which its
    rounding threshold zeroes where they are null: ``(n·eps)²`` of the largest).

    Example:
        >>> _factor_products(torch.outer(torch.tensor([1.0, 1e-4]), torch.tensor([2.0, 1e-3])))
        True
        >>> _factor_products(torch.tensor([[1.0, 1e-4], [1e-3, 1.0]]))
        False
    """
    if values.dim() == 1:
        return True
    i, j = divmod(int(values.argmax()), values.shape[1])
    if not values[i, j] > 0:
        return False
    outer = torch.outer(values[:, j], values[i, :]) / values[i, j]
    return bool(((outer - values).abs() <= 8 * torch.finfo(values.dtype).eps * values).all())


def _zero_within_rounding(values: Tensor) -> Tensor:
    """A symmetric matrix's eigenvalues, those below ``size · eps`` times the largest zero.

    There they are zero to the matrix's rounding: a rank-deficient factor's come out as
    ±1e-9 or so (their logs were summed into a log-determinant, their roots into powers).

    Example:
        >>> _zero_within_rounding(torch.tensor([4.0, 1e-9]))
        tensor([4., 0.])
    """
    tolerance = values.max() * values.numel() * torch.finfo(values.dtype).eps
    return torch.where(values > tolerance, values, 0)


def _trace(entry: Any, damping: float) -> Tensor:
    if isinstance(entry, Eigen):
        return entry.eigenvalues.sum() + damping * entry.eigenvalues.numel()
    product: int = math.prod(f.shape[0] for f in entry)
    value: Tensor = entry[0].trace() if len(entry) == 1 else entry[0].trace() * entry[1].trace()
    return value + damping * product


def _dense(entry: Any) -> Tensor:
    if isinstance(entry, Eigen):
        Q = _kron(entry.eigenvectors)
        return (Q * entry.eigenvalues.reshape(-1)) @ Q.T
    return _kron(entry)


def _kron(factors: list[Tensor]) -> Tensor:
    return factors[0] if len(factors) == 1 else torch.kron(factors[0], factors[1])


__all__ = [
    "Eigen",
    "batched_eigh",
    "dense",
    "eigh",
    "factor_damped_power",
    "inverse",
    "inverse_sqrt",
    "is_entry",
    "logdet",
    "map_entries",
    "matvec",
    "power",
    "trace",
]
