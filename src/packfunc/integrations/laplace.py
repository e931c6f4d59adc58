"""laplace-torch curvature backends on packfunc's functional core.

``Laplace(model, likelihood, ..., backend=PackfuncGGN)`` (or ``PackfuncEF``) fits
laplace-torch's approximations with packfunc's quantities instead of BackPACK's
extensions, so they work on models the BackPACK backend refuses (residual
connections, LayerNorm, attention, shared weights, custom modules):

* ``diag``: :func:`packfunc.diag_ggn` (GGN, exact or Monte-Carlo) or
  :func:`packfunc.sum_grad_squared` (empirical Fisher);
* ``kron``: :func:`packfunc.kflr` (or :func:`packfunc.kfac` when ``stochastic``; the
  empirical Fisher: ``kfac(fisher_type="empirical")``) in laplace's
  :class:`~laplace.utils.Kron`; a one-dimensional parameter without a Kronecker rule
  (e.g. a LayerNorm weight) gets its exact block from :func:`packfunc.sqrt_ggn` (or
  :func:`packfunc.batch_grad`), as laplace stores biases;
* ``full``: ``Vᵀ V`` from :func:`packfunc.sqrt_ggn` (GGN) or ``Gᵀ G`` from
  :func:`packfunc.batch_grad` (empirical Fisher);
* ``gradients``: :func:`packfunc.batch_grad`; ``jacobians``: per-sample Jacobians
  ``[N, C, P]`` as the square-root columns of ``MSELoss(reduction="sum")``, whose
  Hessian ``2 I`` has the root ``√2 I`` (refused for a model that draws random numbers,
  such as dropout in training mode: the outputs and the Jacobians come from two runs).

laplace's conventions are kept: its loss (``MSELoss``/``CrossEntropyLoss`` with
``reduction="sum"``) and ``factor`` (``1/2`` for regression), parameters that do not
require grad left out, ``last_layer`` (curvature of ``model.last_layer`` on the
features), ``subnetwork_indices`` (indices into the flattened parameters) and the
Kronecker factors' rescaling by batch size over data-set size (of the factor that is a
batch mean: the second, or the first for a weight stored ``[in, out]``).
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any, cast

import torch
from torch import Tensor, nn

try:
    from laplace.curvature import CurvatureInterface, EFInterface, GGNInterface
    from laplace.utils import Kron
except ImportError as error:  # pragma: no cover - exercised without laplace installed
    raise ImportError(
        "packfunc.integrations.laplace needs laplace-torch: pip install laplace-torch"
    ) from error

import packfunc as pf
from packfunc.engine.discovery import in_out_weights
from packfunc.engine.randomness import GeneratorMark, RandomModelError
from packfunc.kronecker_factors import sqrt_factors_and_loss
from packfunc.types import Inputs, ModelFn


class PackfuncInterface(CurvatureInterface):
    """What the GGN and empirical-Fisher backends share: the functional problem and Jacobians."""

    def _problem(
        self, x: Tensor | MutableMapping[str, Any], keep_graph: bool = False
    ) -> tuple[ModelFn, dict[str, Tensor], Inputs]:
        """The curvature's model function, its trainable parameters and the inputs it takes.

        Args:
            x: laplace's input batch (a tensor, or a dict passed to the model as is).
            keep_graph: Keep the last-layer features attached to ``x``'s graph.

        Returns:
            ``(model_fn, params, inputs)``: the whole model on ``x``, or the last layer
            on the features (``last_layer=True``).
        """
        params = {name: p.detach() for name, p in self.params_dict.items()}
        if self.last_layer:
            extractor: Any = self.model  # laplace's FeatureExtractor
            _, features = extractor.forward_with_features(x)
            model_fn = self._model_fn(self._model)
            return model_fn, params, features if keep_graph else features.detach()
        return self._model_fn(self.model), params, (x,) if isinstance(x, MutableMapping) else x

    def _model_fn(self, module: nn.Module) -> ModelFn:
        """``pf.functional(module)``'s model function, made once per module.

        The same function every batch lets packfunc reuse its discovery plan.
        """
        made: dict[int, ModelFn] = self.__dict__.setdefault("_packfunc_model_fns", {})
        if id(module) not in made:
            made[id(module)] = pf.functional(module)[0]
        return made[id(module)]

    def _quantity(
        self, x: Tensor | MutableMapping[str, Any], y: Tensor, name: str, **options: Any
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The batch's loss (detached) and one :func:`packfunc.compute` quantity of it.

        Args:
            x: laplace's input batch.
            y: Targets.
            name: The quantity.
            **options: Further :func:`packfunc.compute` options (e.g. ``mc_samples``).

        Returns:
            ``(loss, quantity)``, the quantity a dict like the params.
        """
        model_fn, params, inputs = self._problem(x)
        out = pf.compute(
            model_fn, params, inputs, y, quantities=(name,), loss=self._loss_module, **options
        )
        return out["loss"].detach(), out[name]

    @property
    def _loss_module(self) -> nn.Module:
        """The loss laplace set: ``MSELoss`` or ``CrossEntropyLoss``, ``reduction="sum"``."""
        return cast(nn.Module, self.lossfunc)

    def _flat(self, tree: dict[str, Tensor], leading: int) -> Tensor:
        """Concatenate a result's leaves in laplace's parameter order, keeping ``leading`` dims.

        Args:
            tree: A packfunc result, dict name -> ``[*lead, *p.shape]``.
            leading: How many leading dims to keep.

        Returns:
            ``[*lead, P]`` restricted to ``subnetwork_indices`` where set.
        """
        flat = torch.cat(
            [tree[name].flatten(start_dim=leading) for name in self.params_dict], dim=-1
        )
        return flat if self.subnetwork_indices is None else flat[..., self.subnetwork_indices]

    def jacobians(
        self, x: Tensor | MutableMapping[str, Any], enable_backprop: bool = False
    ) -> tuple[Tensor, Tensor]:
        """Per-sample Jacobians of the model output w.r.t. the parameters.

        Args:
            x: Input batch.
            enable_backprop: Keep the graph from ``x`` (and the parameters, for ``f``).

        Returns:
            ``(Js, f)``: Jacobians ``[N, C, P]`` and outputs ``[N, C]``.

        Raises:
            RandomModelError: for a model that draws random numbers (dropout in training
                mode): ``f`` and the Jacobians come from two runs of it, which would draw
                two masks. Call ``model.eval()`` (laplace's ``fit`` does).
        """
        mark = GeneratorMark([*self.model.parameters(), *_tensors_of(x)])
        model_fn, params, inputs = self._problem(x, keep_graph=enable_backprop)
        f = self.model(x)
        if mark.moved():
            mark.rewind()  # (the refusal leaves the random stream where it was)
            raise _random_jacobians_error()
        n = f.shape[0]

        def rows(p: dict[str, Tensor], X: Inputs) -> Tensor:
            return model_fn(p, X).reshape(n, -1)

        # MSELoss(sum) has the Hessian 2 I, whose square-root columns are √2 times the
        # Jacobian rows: V[c, n] = √2 ∂f_c(x_n)/∂θ.
        roots = pf.sqrt_ggn(
            rows if f.dim() != 2 else model_fn,
            params,
            inputs,
            torch.zeros_like(f.detach().reshape(n, -1)),
            loss=torch.nn.MSELoss(reduction="sum"),
        )
        Js = self._flat(roots, leading=2).transpose(0, 1) / 2**0.5
        return (Js, f) if enable_backprop else (Js.detach(), f.detach())

    def gradients(self, x: Tensor | MutableMapping[str, Any], y: Tensor) -> tuple[Tensor, Tensor]:
        """Per-sample gradients of laplace's (summed) loss.

        Args:
            x: Input batch.
            y: Targets.

        Returns:
            ``(Gs, loss)``: gradients ``[N, P]`` and the loss (without ``factor``).
        """
        model_fn, params, inputs = self._problem(x)
        out = pf.compute(
            model_fn, params, inputs, y, quantities=("batch_grad",), loss=self._loss_module
        )
        return self._flat(out["batch_grad"], leading=1), out["loss"].detach()

    def kron(
        self, x: Tensor | MutableMapping[str, Any], y: Tensor, N: int, **kwargs: Any
    ) -> tuple[Tensor, Kron]:
        """Kronecker factors in laplace's ``Kron``, times ``factor``.

        GGN: KFLR (KFAC when ``stochastic``); EF: KFAC of the empirical Fisher. Weights
        get packfunc's two factors, the output one summed over the batch and the input
        one its mean, rescaled by ``len(y) / N`` (as laplace's other backends, so that
        batches of any sizes add up to the data set): ``[A (out×out), B (in×in)]``, or
        ``[B (in×in), A (out×out)]`` for a weight stored ``[in, out]`` (``x @ W``,
        GPT-2's ``Conv1D``); biases and other one-dimensional parameters their exact
        (or sampled) block.

        Args:
            x: Input batch.
            y: Targets.
            N: Number of data points in the whole data set.
            **kwargs: Ignored (laplace passes ASDL's options).

        Returns:
            ``(factor · loss, factor · Kron)``.

        Raises:
            ValueError: with ``subnetwork_indices``, or for a parameter of two or more
                dimensions without a Kronecker rule (e.g. an embedding).
        """
        if self.subnetwork_indices is not None:
            raise ValueError(
                "Kronecker factors of a subnetwork are not defined; use "
                "hessian_structure='full' or 'diag' with SubnetLaplace."
            )
        model_fn, params, inputs = self._problem(x)
        factors, loss = self._kron_factors(model_fn, params, inputs, y)
        in_out = in_out_weights(model_fn, params, inputs)  # (the plan those factors cached)
        blocks = self._unsupported_blocks(model_fn, params, inputs, y, factors)
        kfacs: list[Any] = []
        for name in params:
            found = factors[name]
            if found is None:
                kfacs.append([blocks[name]])
            elif len(found) == 2:
                kfacs.append(batch_mean_rescaled(found, len(y), N, in_out=name in in_out))
            else:
                kfacs.append(list(found))
        return self.factor * loss, Kron(kfacs) * self.factor

    def _kron_factors(
        self, model_fn: ModelFn, params: dict[str, Tensor], inputs: Inputs, y: Tensor
    ) -> tuple[dict[str, Any], Tensor]:
        """Kronecker factors per parameter (``None`` where none apply) and the batch's loss."""
        return sqrt_factors_and_loss(
            model_fn,
            params,
            inputs,
            y,
            loss=self._loss_module,
            on_unsupported="skip",
            **self._kron_options,
        )

    @property
    def _kron_options(self) -> dict[str, Any]:
        """:func:`packfunc.kronecker_factors.sqrt_factors_and_loss`'s options of this curvature."""
        raise NotImplementedError

    def _unsupported_blocks(
        self,
        model_fn: ModelFn,
        params: dict[str, Tensor],
        inputs: Inputs,
        y: Tensor,
        factors: dict[str, Any],
    ) -> dict[str, Tensor]:
        """The curvature's blocks of the one-dimensional parameters without factors."""
        missing = {name: params[name] for name, found in factors.items() if found is None}
        if not missing:
            return {}
        wide = [f"{name} {tuple(p.shape)}" for name, p in missing.items() if p.dim() != 1]
        if wide:
            raise ValueError(
                f"No Kronecker factors for {', '.join(wide)}: laplace's Kron needs two "
                "factors for a parameter of two or more dimensions. Use "
                "hessian_structure='diag' or 'full', or subset_of_weights='last_layer'."
            )
        columns = self._block_roots(model_fn, missing, inputs, y)
        return {name: v.T @ v for name, v in columns.items()}

    def _block_roots(
        self, model_fn: ModelFn, params: dict[str, Tensor], inputs: Inputs, y: Tensor
    ) -> dict[str, Tensor]:
        """Rows ``V [M, p]`` per parameter with ``Vᵀ V`` its curvature block."""
        raise NotImplementedError


class PackfuncGGN(PackfuncInterface, GGNInterface):
    """laplace-torch's ``GGNInterface`` on packfunc: exact GGN, or Monte-Carlo Fisher.

    Constructor arguments, as laplace's other GGN backends:
        model: The model (laplace passes a ``FeatureExtractor`` for last-layer Laplace).
        likelihood: ``"classification"`` or ``"regression"``.
        last_layer: Curvature of ``model.last_layer`` only.
        subnetwork_indices: Indices of the flattened parameters to keep.
        stochastic: Monte-Carlo Fisher (``num_samples`` targets drawn per sample from
            the model's predictive distribution) instead of the exact GGN.
        num_samples: Monte-Carlo samples when ``stochastic``.

    Example:
        >>> from laplace import Laplace
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(),
        ...                             torch.nn.Linear(4, 2))
        >>> data = torch.utils.data.TensorDataset(torch.randn(8, 3), torch.randint(0, 2, (8,)))
        >>> la = Laplace(model, "classification", subset_of_weights="all",
        ...              hessian_structure="diag", backend=PackfuncGGN)
        >>> la.fit(torch.utils.data.DataLoader(data, batch_size=4))
        >>> la.H.shape
        torch.Size([26])
    """

    @property
    def _mc_samples(self) -> int | None:
        """The ``mc_samples`` packfunc gets: ``None`` (exact GGN) unless ``stochastic``."""
        return self.num_samples if self.stochastic else None

    @property
    def _kron_options(self) -> dict[str, Any]:
        """KFLR factors, or KFAC with ``num_samples`` when ``stochastic``."""
        return {"mc_samples": self._mc_samples}

    def _block_roots(
        self, model_fn: ModelFn, params: dict[str, Tensor], inputs: Inputs, y: Tensor
    ) -> dict[str, Tensor]:
        """The GGN's (or sampled Fisher's) square-root columns ``[K·N, p]``."""
        roots = pf.sqrt_ggn(
            model_fn, params, inputs, y, loss=self._loss_module, mc_samples=self._mc_samples
        )
        return {name: root.flatten(0, 1) for name, root in roots.items()}

    def diag(
        self, x: Tensor | MutableMapping[str, Any], y: Tensor, **kwargs: Any
    ) -> tuple[Tensor, Tensor]:
        """The GGN diagonal of the batch's loss, times ``factor``.

        Args:
            x: Input batch.
            y: Targets.
            **kwargs: Ignored (laplace passes ``N``).

        Returns:
            ``(factor · loss, factor · diag(GGN))`` with the diagonal ``[P]``.
        """
        loss, diagonal = self._quantity(x, y, "diag_ggn", mc_samples=self._mc_samples)
        return self.factor * loss, self.factor * self._flat(diagonal, 0)

    def full(
        self, x: Tensor | MutableMapping[str, Any], y: Tensor, **kwargs: Any
    ) -> tuple[Tensor, Tensor]:
        """The dense GGN of the batch's loss, ``Vᵀ V`` from its square root, times ``factor``.

        Args:
            x: Input batch.
            y: Targets.
            **kwargs: Ignored (laplace passes ``N``).

        Returns:
            ``(factor · loss, factor · GGN)`` with the GGN ``[P, P]``.
        """
        loss, sqrt_ggn = self._quantity(x, y, "sqrt_ggn", mc_samples=self._mc_samples)
        roots = self._flat(sqrt_ggn, leading=2).flatten(0, 1)  # [K·N, P]
        return self.factor * loss, self.factor * roots.T @ roots


class PackfuncEF(PackfuncInterface, EFInterface):
    """laplace-torch's ``EFInterface`` (empirical Fisher) on packfunc's per-sample gradients.

    ``full`` is laplace's own ``Gᵀ G`` over :meth:`gradients`; ``kron`` is KFAC of the
    empirical Fisher (as laplace's curvlinops and ASDL backends; BackPACK's has none).

    Example:
        >>> from laplace import Laplace
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(),
        ...                             torch.nn.Linear(4, 2))
        >>> data = torch.utils.data.TensorDataset(torch.randn(8, 3), torch.randint(0, 2, (8,)))
        >>> la = Laplace(model, "classification", subset_of_weights="all",
        ...              hessian_structure="full", backend=PackfuncEF)
        >>> la.fit(torch.utils.data.DataLoader(data, batch_size=4))
        >>> la.H.shape
        torch.Size([26, 26])
    """

    def diag(
        self, x: Tensor | MutableMapping[str, Any], y: Tensor, **kwargs: Any
    ) -> tuple[Tensor, Tensor]:
        """The empirical Fisher's diagonal ``Σ_n g_n²`` of the batch, times ``factor``.

        Args:
            x: Input batch.
            y: Targets.
            **kwargs: Ignored (laplace passes ``N``).

        Returns:
            ``(factor · loss, factor · diag(EF))`` with the diagonal ``[P]``.
        """
        loss, squares = self._quantity(x, y, "sum_grad_squared")
        return self.factor * loss, self.factor * self._flat(squares, leading=0)

    @property
    def _kron_options(self) -> dict[str, Any]:
        """:func:`packfunc.kfac` with ``fisher_type="empirical"``."""
        return {"mc_samples": 1, "fisher_type": "empirical"}

    def _block_roots(
        self, model_fn: ModelFn, params: dict[str, Tensor], inputs: Inputs, y: Tensor
    ) -> dict[str, Tensor]:
        """The per-sample gradients ``[N, p]``."""
        grads = pf.batch_grad(model_fn, params, inputs, y, loss=self._loss_module)
        return {name: g.flatten(1) for name, g in grads.items()}


def _tensors_of(x: Tensor | MutableMapping[str, Any]) -> list[Tensor]:
    """The tensors of laplace's input batch (a tensor, or a dict of them and other values)."""
    values = x.values() if isinstance(x, MutableMapping) else [x]
    return [value for value in values if isinstance(value, Tensor)]


def _random_jacobians_error() -> RandomModelError:
    """The refusal of :meth:`PackfuncInterface.jacobians` for a model that draws random numbers.

    Returns:
        The error, naming why and the fix.

    Example:
        >>> "model.eval()" in str(_random_jacobians_error())
        True
    """
    return RandomModelError(
        "the model draws random numbers in its forward pass (e.g. dropout in training "
        "mode), and jacobians runs it twice, for the outputs f and for packfunc's pass that "
        "gives the Jacobians: they would come from different random draws (dropout masks). "
        "Call model.eval() first (laplace's fit does), or use laplace's own "
        "CurvatureInterface.jacobians, which runs the model once."
    )


def batch_mean_rescaled(
    factors: list[Tensor], batch_size: int, data_size: int, *, in_out: bool
) -> list[Tensor]:
    """A weight's two Kronecker factors with the batch-mean factor second, in laplace's scale.

    packfunc's input factor is a mean over the batch, its output factor a sum. laplace adds
    the factors of all batches, and ``KronLaplace.fit(..., override=False)`` reweighs the
    second factor of each pair as the data set's mean: that factor must be the mean one.
    A weight stored ``[out, in]`` (``[out×out, in×in]``) gets its input factor times the
    batch's share ``batch_size / data_size``; one stored ``[in, out]`` (``[in×in,
    out×out]``, input factor first) gets its input factor as the batch's sum and its output
    factor over ``data_size``: the same product, the mean factor second.

    Args:
        factors: ``[out×out, in×in]``, or ``[in×in, out×out]`` when ``in_out``.
        batch_size: The batch's samples.
        data_size: The data set's samples ``N``.
        in_out: Whether the weight is stored ``[in, out]`` (its input factor first).

    Returns:
        The two factors, in their order.

    Example:
        >>> A, B = torch.eye(2), torch.eye(3)
        >>> [f.trace().item() for f in batch_mean_rescaled([A, B], 2, 4, in_out=False)]
        [2.0, 1.5]
        >>> [f.trace().item() for f in batch_mean_rescaled([B, A], 2, 4, in_out=True)]
        [6.0, 0.5]
    """
    first, second = factors
    if in_out:
        return [first * batch_size, second / data_size]
    return [first, second * (batch_size / data_size)]


__all__ = ["PackfuncEF", "PackfuncGGN", "PackfuncInterface"]
