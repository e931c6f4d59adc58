"""Contenders: one builder per library, each taking the quantity name.

A builder ``build(problem, quantity)`` returns a zero-argument closure that
runs the *whole* computation (forward, backward, reduction) from
``problem.X, problem.y`` and returns ``{param name: tensor}``, or ``None``
when the contender does not offer that quantity. It raises
:class:`Unavailable` when the library is not installed (libraries are
imported lazily so a missing peer only blanks its column) and
:class:`Unsupported` when the library refuses the model (BackPACK on
LayerNorm/GroupNorm/residual graphs, opacus on BatchNorm or attention): the
cell shows ``—`` and the reason is printed under the table. Every contender
computes the quantity for the same parameters,
:meth:`Problem.parameter_names` (a frozen backbone, the Linear/Conv2d layers
of Kronecker rows).

Everything outside the returned closure (model copies, ``extend``, wrapping
in ``GradSampleModule``, building ``vmap(grad(...))``, BackPACK's trial run)
is setup and not timed.

A closure leaves no state: what hook-based peers put on the parameters (``.grad``,
``grad_batch``, ``grad_sample``) or in an operator's caches is released once the result is
taken, so every contender's call starts from the same memory. (On CUDA the peak is taken
above the memory allocated before the call: a peer's last results, still attached and then
freed during the call, would hide up to their own size from its peak.)

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


class Unsupported(Exception):
    """The contender refuses this model (or returns incomplete results): its cell is ``—``."""


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


def split_parameters(
    model: torch.nn.Module, names: tuple[str, ...]
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Detached parameters of ``model``: those in ``names``, and the frozen rest.

    Args:
        model: The model.
        names: The parameters a quantity is taken of.

    Returns:
        ``(parameters, frozen)``, two name -> tensor dicts.

    Example:
        >>> parameters, frozen = split_parameters(torch.nn.Linear(2, 3), ("bias",))
        >>> list(parameters), list(frozen)
        (['bias'], ['weight'])
    """
    parameters, frozen = {}, {}
    for name, p in model.named_parameters():
        (parameters if name in names else frozen)[name] = p.detach()
    return parameters, frozen


def generator_on(device: torch.device) -> torch.Generator:
    """A generator seeded with 0 on ``device`` (Monte-Carlo rows)."""
    return torch.Generator(device=device).manual_seed(0)


# ----------------------------------------------------------------------------- builders


def packfunc_builder(problem: Problem, quantity: str) -> Closure | None:
    """The functional API of packfunc; a frozen backbone is left out of ``params``.

    ``pf.functional``'s model function takes the trainable parameters alone and reads
    the others from the module (where ``Problem.model`` froze them).
    """
    try:
        import packfunc as pf
    except ImportError as error:
        raise Unavailable(str(error)) from error
    model_fn, all_params = pf.functional(problem.model())
    params = {name: all_params[name] for name in problem.parameter_names(quantity)}

    lossfunc, X, y = problem.loss(), problem.X, problem.y
    if quantity == "grad":
        return lambda: pf.compute(model_fn, params, X, y, quantities=("grad",), loss=lossfunc)[
            "grad"
        ]
    if quantity in EKFAC_QUANTITIES:
        mc_samples = 1 if quantity == "ekfac" else None
        generator = generator_on(problem.device)

        def fit() -> Result:
            eigen = pf.ekfac(
                model_fn,
                params,
                X,
                y,
                loss=lossfunc,
                mc_samples=mc_samples,
                generator=generator,
                kfac_approx="expand",
            )
            return {name: [e.eigenvalues, *e.eigenvectors] for name, e in eigen.items()}

        return fit
    base, sampled = _split_mc(quantity)
    function = getattr(pf, base, None)
    if function is None:
        return None
    options: dict[str, object] = {}
    if sampled or base == "kfac":
        options.update(mc_samples=1, generator=generator_on(problem.device))
    if base in ("kfac", "kflr"):  # kfra has no position convention
        options["kfac_approx"] = problem.kfac_approx
    return lambda: function(model_fn, params, X, y, loss=lossfunc, **options)


def _split_mc(quantity: str) -> tuple[str, bool]:
    """``"diag_ggn_mc"`` -> ``("diag_ggn", True)``: Monte-Carlo rows use one sample."""
    if quantity.endswith("_mc"):
        return quantity[: -len("_mc")], True
    return quantity, False


EKFAC_QUANTITIES = ("ekfac", "ekfac_exact")
"""EKFAC rows: one Monte-Carlo sample (``ekfac``) or the exact square-root columns.

Their results have the layout ``{name: [λ, Q_A, Q_B]}`` (a bias ``[λ, Q_A]``), in
curvlinops' ``"expand"`` convention for weight-sharing layers."""


def curvlinops_builder(problem: Problem, quantity: str) -> Closure | None:
    """Curvlinops' ``KFACLinearOperator`` (hooks, one backward): its Kronecker factors.

    Factors are computed as in the operator's constructor and returned in
    packfunc's (BackPACK's) layout, ``{weight: [A, B], bias: [A]}``; curvlinops'
    normalization and position convention (``"expand"``) differ from BackPACK's,
    so they are compared by shape.
    """
    if quantity in EKFAC_QUANTITIES:
        return curvlinops_ekfac_builder(problem, quantity)
    fisher_types = {"kfac": "mc", "kflr": "type-2"}
    if quantity not in fisher_types:
        return None
    try:
        from curvlinops import KFACLinearOperator
    except ImportError as error:
        raise Unavailable(str(error)) from error
    model, lossfunc = problem.model(), problem.loss()
    names = problem.parameter_names(quantity)
    named = dict(model.named_parameters())
    operator = KFACLinearOperator(
        model,
        lossfunc,
        [named[name] for name in names],
        [(problem.X, problem.y)],
        check_deterministic=False,
        fisher_type=fisher_types[quantity],
        mc_samples=1,
    )

    def run() -> Result:
        operator.compute_kronecker_factors()
        result = kronecker_layout(
            operator._input_covariances, operator._gradient_covariances, names
        )
        operator._input_covariances.clear()  # it adds to them; leaves no state
        operator._gradient_covariances.clear()
        return result

    return run


class FlatLogits(torch.nn.Module):
    """``[N, C, d...]`` logits as ``[N·d..., C]`` rows (curvlinops' EKFAC takes 2d outputs only).

    The wrapped model's layers still see the batch dimension ``N`` first, so
    curvlinops' per-example gradients stay per sequence.
    """

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: Tensor) -> Tensor:
        """The logits, one row per position."""
        logits = self.model(x)
        return logits.movedim(1, -1).reshape(-1, logits.shape[1])


def curvlinops_ekfac_builder(problem: Problem, quantity: str) -> Closure:
    """Curvlinops' ``EKFACLinearOperator``, computed eagerly as its first product would.

    Kronecker factors, their eigenvectors (``eigh``) and the eigenvalue correction.

    The operator accumulates into its caches, so each run clears them first. Sequence
    outputs (``[N, C, T]``) go through :class:`FlatLogits`; for them only the Monte-Carlo
    row is offered: curvlinops backpropagates each exact square-root column for all ``T``
    positions of a sequence at once, which adds cross-position terms to the eigenvalues.
    """
    try:
        from curvlinops import EKFACLinearOperator
    except ImportError as error:
        raise Unavailable(str(error)) from error
    model, X, y = problem.model(), problem.X, problem.y
    names = problem.parameter_names(quantity)
    named = dict(model.named_parameters())
    if y.dim() > 1:
        if quantity != "ekfac":
            raise Unsupported(
                "exact EKFAC of sequence outputs: curvlinops backpropagates a square-root "
                "column for all positions at once (cross-position terms)"
            )
        model, y = FlatLogits(model), y.flatten()
    operator = EKFACLinearOperator(
        model,
        problem.loss(),
        [named[name] for name in names],
        [(X, y)],
        check_deterministic=False,
        fisher_type="mc" if quantity == "ekfac" else "type-2",
        mc_samples=1,
        kfac_approx="expand",
    )
    caches = (
        operator._input_covariances,
        operator._gradient_covariances,
        operator._input_covariances_eigenvectors,
        operator._gradient_covariances_eigenvectors,
        operator._corrected_eigenvalues,
    )

    def run() -> Result:
        operator.compute_kronecker_factors()
        operator.compute_eigenvalue_correction()
        result = eigen_layout(operator, names)
        for cache in caches:  # it adds to them; leaves no state
            cache.clear()
        return result

    return run


def eigen_layout(operator: object, names: tuple[str, ...]) -> Result:
    """A computed ``EKFACLinearOperator`` in the EKFAC rows' layout ``{name: [λ, *Q]}``."""
    layout = {}
    for module, positions in operator._mapping.items():  # type: ignore[attr-defined]
        values = operator._corrected_eigenvalues[module]  # type: ignore[attr-defined]
        outputs = operator._gradient_covariances_eigenvectors[module]  # type: ignore[attr-defined]
        inputs = operator._input_covariances_eigenvectors.get(module)  # type: ignore[attr-defined]
        for kind, position in positions.items():
            vectors = [outputs, inputs] if kind == "weight" else [outputs]
            layout[names[position]] = [values[position], *vectors]
    return layout


def kronecker_layout(
    inputs: dict[str, Tensor], gradients: dict[str, Tensor], names: tuple[str, ...]
) -> dict[str, list[Tensor]]:
    """Per-module factors (curvlinops) -> per-parameter lists in BackPACK's order.

    Args:
        inputs: Module name -> input covariance ``B``.
        gradients: Module name -> output-gradient covariance ``A``.
        names: Parameter names (``module.weight``, ``module.bias``).

    Returns:
        ``{module.weight: [A, B], module.bias: [A]}`` for every name whose module has factors.

    Example:
        >>> A, B = torch.eye(3), torch.eye(2)
        >>> layout = kronecker_layout({"0": B}, {"0": A}, ("0.weight", "0.bias"))
        >>> [f.shape[0] for f in layout["0.weight"]], len(layout["0.bias"])
        ([3, 2], 1)
    """
    layout = {}
    for name in names:
        module, _, kind = name.rpartition(".")
        if module not in gradients:
            continue
        layout[name] = [gradients[module]] + ([inputs[module]] if kind == "weight" else [])
    return layout


GGN_DIAGONALS = ("diag_ggn", "diag_ggn_mc", "batch_diag_ggn", "batch_diag_ggn_mc")
"""Rows the naive torch.func contender computes."""


def naive_builder(problem: Problem, quantity: str) -> Closure | None:
    """GGN diagonals the way a torch.func user (or curvlinops) writes them.

    A ``vmap`` over samples of a ``vmap`` over the loss Hessian's square-root
    columns of a ``vjp``: one full gradient per (sample, column) pair, squared.
    Written for ``[N, C]`` outputs (class-index targets ``[N]``).
    """
    if quantity not in GGN_DIAGONALS or problem.y.dim() != 1:
        return None
    from torch.func import functional_call, vjp, vmap

    model, X = problem.model(), problem.X
    params, frozen = split_parameters(model, problem.parameter_names(quantity))
    base, sampled = _split_mc(quantity)
    generator = generator_on(problem.device)

    def sample_columns(ps: dict[str, Tensor], x: Tensor, roots: Tensor) -> dict[str, Tensor]:
        _, pullback = vjp(
            lambda q: functional_call(model, {**frozen, **q}, (x.unsqueeze(0),))[0], ps
        )
        return vmap(lambda column: pullback(column)[0])(roots)

    columns = vmap(sample_columns, in_dims=(None, 0, 0))

    def run() -> Result:
        with torch.no_grad():
            probs = torch.softmax(functional_call(model, {**frozen, **params}, (X,)), 1)
        if sampled:  # (p − onehot(sample)) / √N, one sample
            draws = torch.multinomial(probs, 1, generator=generator)[:, 0]
            roots = (probs - torch.nn.functional.one_hot(draws, probs.shape[1])).unsqueeze(1)
        else:  # columns k of diag(√p) − p√pᵀ: √p_k (e_k − p), per sample
            tau = probs.sqrt()
            eye = torch.eye(probs.shape[1], device=probs.device)
            roots = tau.unsqueeze(2) * (eye - probs.unsqueeze(1))
        squares = {
            k: v.square().sum(1) for k, v in columns(params, X, roots / problem.n**0.5).items()
        }
        return squares if base == "batch_diag_ggn" else {k: v.sum(0) for k, v in squares.items()}

    return run


def backpack_builder(problem: Problem, quantity: str, package: str = "backpack") -> Closure | None:
    """BackPACK (or its packfunc shim); for ``grad`` a plain ``loss.backward()``.

    One untimed trial run at setup: where BackPACK refuses the model (no
    extension for a layer, a non-sequential graph for second order) or leaves
    parameters without a result, it raises :class:`Unsupported`.
    """
    model, lossfunc, X, y = problem.model(), problem.loss(), problem.X, problem.y
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    if quantity == "grad":  # plain autograd, no BackPACK involved
        return plain_builder(problem, quantity)
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
        loss = lossfunc(model(X), y)
        with backpack(extension):
            loss.backward()
        result = {name: getattr(p, extension.savefield) for name, p in params.items()}
        for p in params.values():  # leaves no state (module docstring)
            p.grad = None
            delattr(p, extension.savefield)
        return result

    try:
        run()
    except (NotImplementedError, AssertionError) as error:
        raise Unsupported(f"{type(error).__name__}: {_first_line(error)}") from error
    except AttributeError as error:  # a parameter without the savefield
        missing = [n for n, p in params.items() if not hasattr(p, extension.savefield)]
        raise Unsupported(
            f"incomplete: no result for {len(missing)} of {len(params)} parameters "
            f"(e.g. {missing[0]}: no extension for its module)"
        ) from error
    return run


def _first_line(error: BaseException, limit: int = 120) -> str:
    """The first line of an error message, cut to ``limit`` characters."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return text if len(text) <= limit else text[: limit - 1] + "…"


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
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    # loss_reduction="sum": opacus keeps the 1/N of the mean loss in grad_sample,
    # i.e. BackPACK's scaling (with "mean" it would rescale by N).
    wrapped = _opacus_wrap(GradSampleModule, model)

    def run() -> Result:
        lossfunc(wrapped(X), y).backward()
        result = {name: from_per_sample(quantity, p.grad_sample) for name, p in params.items()}
        wrapped.zero_grad(set_to_none=True)  # also p.grad_sample: leaves no state
        return result

    return run


def _opacus_wrap(
    wrapper: Callable[..., torch.nn.Module], model: torch.nn.Module
) -> torch.nn.Module:
    """Wrap ``model`` with ``loss_reduction="sum"``; opacus' refusals become :class:`Unsupported`.

    ``nn.MultiheadAttention`` is refused up front: opacus' functorch fallback calls
    a module with its first input only, and opacus' answer is another module
    (``DPMultiheadAttention``, other parameter names), i.e. another model.
    """
    if any(isinstance(m, torch.nn.MultiheadAttention) for m in model.modules()):
        raise Unsupported(
            "nn.MultiheadAttention needs opacus' DPMultiheadAttention (another model)"
        )
    try:
        return wrapper(model, loss_reduction="sum")
    except NotImplementedError as error:  # e.g. BatchNorm: "a trainable layer with buffers"
        raise Unsupported(f"refuses the model: {_first_line(error)}") from error


def opacus_ghost_builder(problem: Problem, quantity: str) -> Closure | None:
    """Opacus ghost clipping: the per-sample gradient norms it computes for clipping.

    ``GradSampleModuleFastGradientClipping`` stores each parameter's per-sample
    norms in ``p._norm_sample`` during the backward (ghost norms for Linear,
    Conv and Embedding; per-sample gradients, then norms, for other layers). The
    timed region is that first forward + backward, not the second, clipped one.
    """
    if quantity != "batch_l2_grad":
        return None
    try:
        from opacus.grad_sample import GradSampleModuleFastGradientClipping
    except ImportError as error:
        raise Unavailable(str(error)) from error
    model, lossfunc, X, y = problem.model(), problem.loss(), problem.X, problem.y
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    wrapped = _opacus_wrap(GradSampleModuleFastGradientClipping, model)

    def run() -> Result:
        lossfunc(wrapped(X), y).backward()
        result = {name: p._norm_sample.square() for name, p in params.items()}
        wrapped.zero_grad(set_to_none=True)  # leaves no state (module docstring)
        return result

    return run


def vmap_builder(problem: Problem, quantity: str) -> Closure | None:
    """Hand-written ``torch.func.vmap(torch.func.grad(per_sample_loss))``.

    For ``diag_ggn_mc``: the same per-sample gradients at targets drawn from the
    model's predictive distribution (one draw per loss term), squared and summed.
    """
    from torch.func import functional_call, grad, vmap

    model, lossfunc, X, y = problem.model(), problem.loss(), problem.X, problem.y
    params, frozen = split_parameters(model, problem.parameter_names(quantity))
    if quantity == "grad":
        mean_loss = grad(lambda ps: lossfunc(functional_call(model, {**frozen, **ps}, (X,)), y))
        return lambda: mean_loss(params)
    if quantity not in (*PER_SAMPLE_QUANTITIES, "diag_ggn_mc"):
        return None
    n = problem.n

    def per_sample_loss(ps: dict[str, Tensor], x: Tensor, t: Tensor) -> Tensor:
        out = functional_call(model, {**frozen, **ps}, (x.unsqueeze(0),))
        return lossfunc(out, t.unsqueeze(0)) / n  # the sample's term of the 'mean' loss

    per_sample_grads = vmap(grad(per_sample_loss), in_dims=(None, 0, 0))
    if quantity == "diag_ggn_mc":
        if not isinstance(lossfunc, torch.nn.CrossEntropyLoss) or y.is_floating_point():
            return None
        generator = generator_on(problem.device)

        def sampled() -> Result:
            with torch.no_grad():
                logits = functional_call(model, {**frozen, **params}, (X,))
            draws = sample_classes(logits, generator)
            g = per_sample_grads(params, X, draws)
            # GGN = Σ_n J_nᵀ (∇²ℓ_n / M) J_n, and E[(∇ℓ_n at a draw)²] = diag ∇²ℓ_n for the
            # sum ℓ_n over sample n's loss terms; g = ∇ℓ_n / M, so the estimate is M·Σ_n g².
            terms = draws.numel()
            return {name: terms * value.square().sum(0) for name, value in g.items()}

        return sampled

    def run() -> Result:
        g = per_sample_grads(params, X, y)
        return {name: from_per_sample(quantity, value) for name, value in g.items()}

    return run


def sample_classes(logits: Tensor, generator: torch.Generator) -> Tensor:
    """One class per position, drawn from ``softmax(logits)`` over dim 1.

    ``[N, C, d...]`` logits give ``[N, d...]`` targets.

    Args:
        logits: Class scores, classes in dim 1.
        generator: The random source.

    Returns:
        Class indices shaped like the targets of ``CrossEntropyLoss``.

    Example:
        >>> sample_classes(torch.tensor([[0.0, 50.0]]), torch.Generator()).tolist()
        [1]
    """
    classes = logits.shape[1]
    flat = logits.movedim(1, -1).reshape(-1, classes)
    draws = torch.multinomial(torch.softmax(flat, -1), 1, generator=generator)
    return draws.reshape(logits.movedim(1, -1).shape[:-1])


BRUTE_FORCE_LIMIT = 20_000
"""The most parameters the brute-force Hessian diagonal is run for."""


def brute_force_builder(problem: Problem, quantity: str, chunk: int = 512) -> Closure | None:
    """Hessian diagonal of the loss from one Hessian-vector product per coordinate.

    Forward-over-reverse products ``jvp(grad(loss), e_i)`` are ``vmap``-ed over
    ``chunk`` unit vectors at a time; entry ``i`` of product ``i`` is kept.
    """
    if quantity != "diag_hessian":
        return None
    from torch.func import functional_call, grad, jvp, vmap

    model, lossfunc, X, y = problem.model(), problem.loss(), problem.X, problem.y
    params, frozen = split_parameters(model, problem.parameter_names(quantity))
    sizes = [p.numel() for p in params.values()]
    if sum(sizes) > BRUTE_FORCE_LIMIT:
        raise Unsupported(
            f"{sum(sizes):,} parameters: one Hessian-vector product each is too slow "
            f"(limit {BRUTE_FORCE_LIMIT:,})"
        )
    flat = torch.cat([p.flatten() for p in params.values()])

    def unflatten(vector: Tensor) -> dict[str, Tensor]:
        pieces = vector.split(sizes)
        return {name: piece.view_as(p) for (name, p), piece in zip(params.items(), pieces)}

    def loss_at(vector: Tensor) -> Tensor:
        return lossfunc(functional_call(model, {**frozen, **unflatten(vector)}, (X,)), y)

    gradient = grad(loss_at)
    products = vmap(lambda v: jvp(gradient, (flat,), (v,))[1])

    def run() -> Result:
        diagonal = torch.empty_like(flat)
        for start in range(0, flat.numel(), chunk):
            index = torch.arange(start, min(start + chunk, flat.numel()), device=flat.device)
            rows = torch.arange(index.numel(), device=flat.device)
            units = torch.zeros(index.numel(), flat.numel(), device=flat.device)
            units[rows, index] = 1.0
            diagonal[index] = products(units)[rows, index]
        return unflatten(diagonal)

    return run


def plain_builder(problem: Problem, quantity: str) -> Closure | None:
    """A plain forward + ``loss.backward()`` (of the trainable parameters): the scale of a row."""
    model, lossfunc, X, y = problem.model(), problem.loss(), problem.X, problem.y
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}

    def run() -> Result:
        lossfunc(model(X), y).backward()
        result = {name: p.grad for name, p in params.items()}
        for p in params.values():  # leaves no state (module docstring)
            p.grad = None
        return result

    return run


BUILDERS: dict[str, Builder] = {
    "packfunc": packfunc_builder,
    "BackPACK": backpack_builder,
    "opacus": opacus_builder,
    "opacus ghost": opacus_ghost_builder,
    "vmap(grad)": vmap_builder,
    "naive torch.func": naive_builder,
    "curvlinops": curvlinops_builder,
    "brute force": brute_force_builder,
    "packfunc.compat": shim_builder,
    "plain fwd+bwd": plain_builder,
}
"""Contender name -> builder; the order gives the table's columns."""

SUBJECT = "packfunc"
"""The contender compared with the best of the others."""

SHIM = "packfunc.compat"
"""packfunc's BackPACK shim: not a peer; its own ratio to BackPACK is shown."""

PLAIN = "plain fwd+bwd"
"""A plain forward + backward: not a peer, the scale of each row."""

NOT_PEERS = frozenset({SUBJECT, SHIM, PLAIN})
"""Contenders left out of "best peer"."""

REFERENCES = ("BackPACK", "vmap(grad)", "brute force", "opacus", "curvlinops", "naive torch.func")
"""Candidates for a row's reference result, in order: the first that ran is used."""

SHAPES_ONLY = frozenset({"curvlinops"})
"""Contenders whose results use other conventions (Kronecker normalization, positions):
compared by shape."""

UNCHECKED = frozenset({PLAIN})
"""Contenders that compute something else (the plain gradient): timed, not compared."""


def _failing(error: Exception) -> Closure:
    """A closure that raises ``error`` (a setup failure, reported as the contender's error)."""

    def run() -> Result:
        raise error

    return run


def build_all(problem: Problem, quantity: str) -> tuple[dict[str, Closure], dict[str, str]]:
    """Build every registered contender for one row.

    Returns:
        ``(closures, notes)``: closures of the available contenders, and for the
        others a short reason (``"not installed: ..."``, ``"refused: ..."``, ``"n/a"``).
    """
    closures: dict[str, Closure] = {}
    notes: dict[str, str] = {}
    for name, builder in BUILDERS.items():
        try:
            closure = builder(problem, quantity)
        except Unavailable as error:
            notes[name] = f"not installed ({error})"
            continue
        except Unsupported as error:
            notes[name] = f"refused: {error}"
            continue
        except Exception as error:  # a contender failing at setup must not stop the table
            closure = _failing(error)
        if closure is None:
            notes[name] = "n/a"
        else:
            closures[name] = closure
    return closures, notes
