"""Contenders: one builder per library, each taking the quantity name.

A builder ``build(problem, quantity)`` returns a zero-argument closure that
runs the *whole* computation (forward, backward, reduction) from
``problem.X, problem.y`` and returns ``{param name: tensor}``, or ``None``
when the contender does not offer that quantity. It raises
:class:`Unavailable` when the library is not installed; libraries are
imported lazily so a missing peer only blanks its column.

Everything outside the returned closure (model copies, ``extend``, wrapping
in ``GradSampleModule``, building ``vmap(grad(...))``) is setup and not timed.

To add a quantity (e.g. ``diag_ggn_exact``, ``kfac``): add it to
:data:`BACKPACK_EXTENSIONS`, make :func:`packfunc_builder` find it, and add
it to ``QUANTITIES`` in ``run.py``. To add a contender (e.g. the BackPACK
shim): write one more builder and register it in :data:`BUILDERS`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch
from torch import Tensor

from problems import Problem

Result = dict[str, Tensor]
Closure = Callable[[], Result]
Builder = Callable[[Problem, str], Closure | None]


class Unavailable(Exception):
    """The contender's library is not installed."""


BACKPACK_EXTENSIONS = {
    "batch_grad": "BatchGrad",
    "batch_l2_grad": "BatchL2Grad",
    "sum_grad_squared": "SumGradSquared",
    "variance": "Variance",
    "diag_ggn": "DiagGGNExact",
    "diag_ggn_mc": "DiagGGNMC",
    "batch_diag_ggn": "BatchDiagGGNExact",
    "batch_diag_ggn_mc": "BatchDiagGGNMC",
    "diag_hessian": "DiagHessian",
    "kfac": "KFAC",
    "kflr": "KFLR",
    "kfra": "KFRA",
}
"""Quantity name -> class name in ``backpack.extensions``."""


def from_per_sample(quantity: str, g: Tensor) -> Tensor:
    """Reduce per-sample gradients ``g`` (``[N, *p]``, BackPACK scaling) to ``quantity``."""
    if quantity == "batch_grad":
        return g
    if quantity == "batch_l2_grad":  # a norm kernel: ~10x faster than square().sum(1)
        return torch.linalg.vector_norm(g.flatten(1), dim=1).square()
    if quantity == "sum_grad_squared":
        return g.square().sum(0)
    if quantity == "variance":
        return g.square().mean(0) - g.mean(0).square()
    raise KeyError(quantity)


PER_SAMPLE_QUANTITIES = ("batch_grad", "batch_l2_grad", "sum_grad_squared", "variance")
"""Quantities that :func:`from_per_sample` derives from per-sample gradients."""


# ----------------------------------------------------------------------------- builders


def packfunc_builder(problem: Problem, quantity: str) -> Closure | None:
    try:
        import packfunc as pf
    except ImportError as error:
        raise Unavailable(str(error)) from error
    model_fn, params = pf.functional(problem.model())
    lossfunc, X, y = problem.loss(), problem.X, problem.y
    if quantity == "grad":
        return lambda: pf.compute(model_fn, params, X, y, quantities=("grad",), loss=lossfunc)[
            "grad"
        ]
    base, sampled = _split_mc(quantity)
    function = getattr(pf, base, None)
    if function is None:
        return None
    if sampled:
        generator = torch.Generator().manual_seed(0)
        return lambda: function(
            model_fn, params, X, y, loss=lossfunc, mc_samples=1, generator=generator
        )
    return lambda: function(model_fn, params, X, y, loss=lossfunc)


def _split_mc(quantity: str) -> tuple[str, bool]:
    """``"diag_ggn_mc"`` -> ``("diag_ggn", True)``: Monte-Carlo rows use one sample."""
    if quantity.endswith("_mc"):
        return quantity[: -len("_mc")], True
    return quantity, False


def curvlinops_builder(problem: Problem, quantity: str) -> Closure | None:
    """Curvlinops' ``KFACLinearOperator`` (hooks, one backward): its Kronecker factors.

    Factors are computed as in the operator's constructor; the result uses
    curvlinops' own layout and normalization, so it is timed but not checked.
    """
    fisher_types = {"kfac": "mc", "kflr": "type-2"}
    if quantity not in fisher_types:
        return None
    try:
        from curvlinops import KFACLinearOperator
    except ImportError as error:
        raise Unavailable(str(error)) from error
    model, lossfunc = problem.model(), problem.loss()
    operator = KFACLinearOperator(
        model,
        lossfunc,
        list(model.parameters()),
        [(problem.X, problem.y)],
        check_deterministic=False,
        fisher_type=fisher_types[quantity],
        mc_samples=1,
    )

    def run() -> Result:
        operator.compute_kronecker_factors()
        return {}

    return run


GGN_DIAGONALS = ("diag_ggn", "diag_ggn_mc", "batch_diag_ggn", "batch_diag_ggn_mc")
"""Rows the naive torch.func contender computes."""


def naive_builder(problem: Problem, quantity: str) -> Closure | None:
    """GGN diagonals the way a torch.func user (or curvlinops) writes them.

    A ``vmap`` over samples of a ``vmap`` over the loss Hessian's square-root
    columns of a ``vjp``: one full gradient per (sample, column) pair, squared.
    """
    if quantity not in GGN_DIAGONALS:
        return None
    from torch.func import functional_call, vjp, vmap

    model, X = problem.model(), problem.X
    params = {name: p.detach() for name, p in model.named_parameters()}
    base, sampled = _split_mc(quantity)
    generator = torch.Generator().manual_seed(0)

    def sample_columns(ps: dict[str, Tensor], x: Tensor, roots: Tensor) -> dict[str, Tensor]:
        _, pullback = vjp(lambda q: functional_call(model, q, (x.unsqueeze(0),))[0], ps)
        return vmap(lambda column: pullback(column)[0])(roots)

    columns = vmap(sample_columns, in_dims=(None, 0, 0))

    def run() -> Result:
        with torch.no_grad():
            probs = torch.softmax(functional_call(model, params, (X,)), 1)
        if sampled:  # (p − onehot(sample)) / √N, one sample
            draws = torch.multinomial(probs, 1, generator=generator)[:, 0]
            roots = (probs - torch.nn.functional.one_hot(draws, probs.shape[1])).unsqueeze(1)
        else:  # columns k of diag(√p) − p√pᵀ: √p_k (e_k − p), per sample
            tau = probs.sqrt()
            roots = tau.unsqueeze(2) * (torch.eye(probs.shape[1]) - probs.unsqueeze(1))
        squares = {
            k: v.square().sum(1) for k, v in columns(params, X, roots / problem.n**0.5).items()
        }
        return squares if base == "batch_diag_ggn" else {k: v.sum(0) for k, v in squares.items()}

    return run


def backpack_builder(problem: Problem, quantity: str, package: str = "backpack") -> Closure | None:
    """BackPACK (or its packfunc shim); for ``grad`` a plain ``loss.backward()``."""
    model, lossfunc, X, y = problem.model(), problem.loss(), problem.X, problem.y
    params = dict(model.named_parameters())
    if quantity == "grad":  # plain autograd, no BackPACK involved

        def plain() -> Result:
            for p in params.values():
                p.grad = None
            lossfunc(model(X), y).backward()
            return {name: p.grad for name, p in params.items()}

        return plain
    if quantity not in BACKPACK_EXTENSIONS:
        return None
    try:
        backpack_module = importlib.import_module(package)
        extensions = importlib.import_module(f"{package}.extensions")
    except ImportError as error:
        raise Unavailable(str(error)) from error
    backpack, extend = backpack_module.backpack, backpack_module.extend
    extension = getattr(extensions, BACKPACK_EXTENSIONS[quantity])()
    model, lossfunc = extend(model), extend(lossfunc)

    def run() -> Result:
        for p in params.values():
            p.grad = None
        loss = lossfunc(model(X), y)
        with backpack(extension):
            loss.backward()
        return {name: getattr(p, extension.savefield) for name, p in params.items()}

    return run


def shim_builder(problem: Problem, quantity: str) -> Closure | None:
    """The packfunc shim: BackPACK's code with the import prefix ``packfunc.compat``."""
    if quantity not in SHIM_QUANTITIES:
        return None
    return backpack_builder(problem, quantity, package="packfunc.compat")


SHIM_QUANTITIES = ("batch_grad", "diag_ggn")
"""Rows where the shim is timed (forward + backward under the extension)."""


def opacus_builder(problem: Problem, quantity: str) -> Closure | None:
    """Opacus ``GradSampleModule`` per-sample gradients, then the reduction."""
    if quantity not in PER_SAMPLE_QUANTITIES:
        return None
    try:
        from opacus import GradSampleModule
    except ImportError as error:
        raise Unavailable(str(error)) from error
    model, lossfunc, X, y = problem.model(), problem.loss(), problem.X, problem.y
    params = dict(model.named_parameters())
    # loss_reduction="sum": opacus keeps the 1/N of the mean loss in grad_sample,
    # i.e. BackPACK's scaling (with "mean" it would rescale by N).
    wrapped = GradSampleModule(model, loss_reduction="sum")

    def run() -> Result:
        wrapped.zero_grad(set_to_none=True)  # also sets p.grad_sample = None
        lossfunc(wrapped(X), y).backward()
        return {name: from_per_sample(quantity, p.grad_sample) for name, p in params.items()}

    return run


def vmap_builder(problem: Problem, quantity: str) -> Closure | None:
    """Hand-written ``torch.func.vmap(torch.func.grad(per_sample_loss))``."""
    from torch.func import functional_call, grad, vmap

    model, lossfunc, X, y = problem.model(), problem.loss(), problem.X, problem.y
    params = {name: p.detach() for name, p in model.named_parameters()}
    if quantity == "grad":
        mean_loss = grad(lambda ps: lossfunc(functional_call(model, ps, (X,)), y))
        return lambda: mean_loss(params)
    if quantity not in PER_SAMPLE_QUANTITIES:
        return None
    n = problem.n

    def per_sample_loss(ps: dict[str, Tensor], x: Tensor, t: Tensor) -> Tensor:
        out = functional_call(model, ps, (x.unsqueeze(0),))
        return lossfunc(out, t.unsqueeze(0)) / n  # the sample's term of the 'mean' loss

    per_sample_grads = vmap(grad(per_sample_loss), in_dims=(None, 0, 0))

    def run() -> Result:
        g = per_sample_grads(params, X, y)
        return {name: from_per_sample(quantity, value) for name, value in g.items()}

    return run


BUILDERS: dict[str, Builder] = {
    "packfunc": packfunc_builder,
    "BackPACK": backpack_builder,
    "opacus": opacus_builder,
    "vmap(grad)": vmap_builder,
    "naive torch.func": naive_builder,
    "curvlinops": curvlinops_builder,
    "packfunc.compat": shim_builder,
}
"""Contender name -> builder; the order gives the table's columns."""

SUBJECT = "packfunc"
"""The contender compared with the best of the others."""

SHIM = "packfunc.compat"
"""packfunc's BackPACK shim: not a peer; its own ratio to BackPACK is shown."""

REFERENCE = "BackPACK"
"""The contender whose result the subject is checked against."""

UNCHECKED = frozenset({"curvlinops"})
"""Contenders whose results come in another layout: timed, not compared."""


def build_all(problem: Problem, quantity: str) -> tuple[dict[str, Closure], dict[str, str]]:
    """Build every registered contender for one row.

    Returns:
        ``(closures, notes)``: closures of the available contenders, and for the
        others a short reason (``"not installed: ..."``, ``"n/a"``).
    """
    closures: dict[str, Closure] = {}
    notes: dict[str, str] = {}
    for name, builder in BUILDERS.items():
        try:
            closure = builder(problem, quantity)
        except Unavailable as error:
            notes[name] = f"not installed ({error})"
            continue
        if closure is None:
            notes[name] = "n/a"
        else:
            closures[name] = closure
    return closures, notes
