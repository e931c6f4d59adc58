"""Bad input gets a clear error that names the fix."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import packfunc as pf
from packfunc.compat import backpack, extend
from packfunc.compat.extensions import BatchGrad
from packfunc.engine import discovery
from tests.cases import assert_trees_close, autograd_batch_grad


def _mlp():
    torch.manual_seed(0)
    return pf.functional(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)))


_DATA = torch.Generator().manual_seed(0)
X, Y = torch.randn(5, 3, generator=_DATA), torch.randint(0, 2, (5,), generator=_DATA)


def test_reduction_none_is_refused():
    model_fn, params = _mlp()
    with pytest.raises(ValueError, match="reduction='mean' or reduction='sum'"):
        pf.batch_grad(model_fn, params, X, Y, loss=nn.CrossEntropyLoss(reduction="none"))


@pytest.mark.parametrize("loss", [nn.KLDivLoss(), nn.CosineEmbeddingLoss()])
def test_unsupported_loss_lists_the_supported_ones(loss):
    model_fn, params = _mlp()
    with pytest.raises(TypeError, match="CrossEntropyLoss.*MSELoss"):
        pf.batch_grad(model_fn, params, X, Y, loss=loss)


def test_loss_must_be_a_module_not_a_function():
    model_fn, params = _mlp()
    with pytest.raises(TypeError, match="not supported"):
        pf.batch_grad(model_fn, params, X, Y, loss=nn.functional.cross_entropy)


def test_mse_target_that_would_broadcast_is_refused():
    model_fn, params = _mlp()
    with pytest.raises(ValueError, match="broadcast"):
        pf.batch_grad(model_fn, params, X, torch.randn(5, 1), loss=nn.MSELoss())


def test_cross_entropy_float_targets_of_wrong_shape():
    model_fn, params = _mlp()
    with pytest.raises(ValueError, match="integer class targets of shape"):
        pf.batch_grad(model_fn, params, X, torch.rand(5))


def test_target_batch_size_mismatch():
    model_fn, params = _mlp()
    with pytest.raises(ValueError, match="one entry per sample"):
        pf.batch_grad(model_fn, params, X, Y[:4])


def test_inputs_with_different_batch_sizes():
    model_fn, params = _mlp()
    with pytest.raises(ValueError, match="leading batch dimension"):
        pf.batch_grad(lambda p, X: model_fn(p, X[0]), params, (X, X[:2]), Y)


def test_output_without_batch_dimension():
    model_fn, params = _mlp()
    with pytest.raises(ValueError, match="leading dimension is the batch"):
        pf.batch_grad(lambda p, X: model_fn(p, X).sum(0), params, X, Y)


class _SharedPositions(nn.Module):
    """Tokens ``[N, T]`` and positions ``[T]`` shared by the batch (not batched: a misuse)."""

    def __init__(self, length: int = 4):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(10, 3), nn.Embedding(length, 3)
        self.head = nn.Linear(3, 2)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.tokens(tokens) + self.positions(positions)).mean(1))


@pytest.mark.parametrize("zero_table", [False, True])
@pytest.mark.parametrize(
    "quantity", [pf.batch_grad, pf.diag_ggn, pf.kfac, pf.sum_grad_squared, pf.variance]
)
def test_a_shared_input_as_long_as_the_batch_is_refused_not_mis_sliced(quantity, zero_table):
    """It passes every shape check, and the first sample's output alone equals its row where
    the position table is still zero (a probe: per-sample gradients 104 % off, clipped sums
    29 %): discovery refuses the broadcast that lines the samples up with the positions."""
    torch.manual_seed(0)
    model = _SharedPositions()
    if zero_table:
        nn.init.zeros_(model.positions.weight)
    model_fn, params = pf.functional(model)
    tokens, labels = torch.randint(0, 10, (4, 4)), torch.tensor([0, 1, 1, 0])
    before = {k: v.clone() for k, v in params.items()}
    with pytest.raises(ValueError, match=r"line up with that dim.*positions\[None\]\.expand"):
        quantity(model_fn, params, (tokens, torch.arange(4)), labels)
    assert all(torch.equal(before[k], params[k]) for k in params)
    # expanded, it is batched: per-sample gradients match the loop
    expanded = (tokens, torch.arange(4).expand(4, 4))
    found = pf.batch_grad(model_fn, params, expanded, labels)
    for n in range(4):
        model.zero_grad()
        (
            nn.functional.cross_entropy(
                model(tokens[n : n + 1], torch.arange(4)), labels[n : n + 1]
            )
            / 4
        ).backward()
        for name, p in model.named_parameters():
            torch.testing.assert_close(found[name][n], p.grad)


class _Centered(nn.Module):
    """Subtracts (a share of) the batch mean: every sample's output depends on the others."""

    def __init__(self, share: float = 1.0):
        super().__init__()
        self.inner, self.head = nn.Linear(3, 4), nn.Linear(4, 2)
        self.share = share

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inner(x)
        return self.head(torch.tanh(h - self.share * h.mean(0)))


@pytest.mark.parametrize("share", [1.0, 0.04])
def test_a_layer_that_mixes_samples_is_refused(share):
    """Also weakly, in float32 (the rounding tolerance was 5 % of the largest entry)."""
    model_fn, params = pf.functional(_Centered(share))
    with pytest.raises(ValueError, match="mixes samples"):
        pf.batch_grad(model_fn, params, X, Y)


class _GatedMixing(nn.Module):
    """Adds ``alpha`` times the batch mean: no mixing while the parameter ``alpha`` is zero."""

    def __init__(self, mean: str) -> None:
        super().__init__()
        self.inner, self.head = nn.Linear(3, 4), nn.Linear(4, 2)
        self.alpha = nn.Parameter(torch.zeros(()))
        self.mean = mean

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inner(x))
        if self.mean == "matmul":
            n = x.shape[0]
            return self.head(h + self.alpha * ((torch.ones(n, n) / n) @ h))
        return self.head(h + self.alpha * h.mean(0, keepdim=True))


@pytest.mark.parametrize("mean", ["mean", "matmul"])
def test_a_mixing_gated_by_a_parameter_still_zero_is_checked_on_every_batch(mean):
    """``alpha = 0`` passes the rows check (nothing mixes) and the plan was kept: with
    ``alpha`` trained away from zero the per-sample gradients came from the mixing batch,
    silently. A reduction over the batch that reaches the output keeps the check on."""
    model = _GatedMixing(mean)
    model_fn, params = pf.functional(model)
    found = pf.batch_grad(model_fn, params, X, Y)
    assert_trees_close(found, autograd_batch_grad(model, nn.CrossEntropyLoss(), X, Y))
    trained = {**params, "alpha": torch.tensor(0.5)}
    with pytest.raises(ValueError, match="mixes samples"):
        pf.batch_grad(model_fn, trained, X, Y)


def test_a_batch_of_one_sample_does_not_pass_the_mixing_check_for_later_batches():
    """With one sample the check compares a row with itself; the plan was kept as checked,
    and a batch of 8 through a mixing layer then returned wrong values (off by 0.68). A
    size-1 batch is no rarity: Poisson sampling draws them."""
    model_fn, params = pf.functional(_Centered())
    pf.batch_l2_grad(model_fn, params, X[:1], Y[:1])  # (a centred sample: 0 alone and in batch)
    with pytest.raises(ValueError, match="mixes samples"):
        pf.batch_grad(model_fn, params, X, Y)


def test_a_refused_plan_stays_refused_under_vmap():
    """A plan refused outside ``vmap`` served silently under it afterwards (the rows check
    cannot compare values there; per-sample gradient norms 1.27 where each is 0)."""
    model_fn, params = pf.functional(_Centered())
    with pytest.raises(ValueError, match="mixes samples"):
        pf.batch_grad(model_fn, params, X, Y)
    stacked = {k: torch.stack([v, v]) for k, v in params.items()}
    with pytest.raises(ValueError, match="mixes samples"):
        torch.func.vmap(lambda p: pf.batch_grad(model_fn, p, X, Y))(stacked)


def test_batches_of_one_sample_reuse_their_plan_and_a_larger_batch_is_still_checked(monkeypatch):
    """Each call on a batch of one discovered its plan again (unchecked plans were dropped: a
    small LM's KFAC took 23 ms a call against 7.7 ms cached); they are kept for batches of
    one alone, and the next larger batch discovers again and is checked."""
    discoveries = []
    discover = discovery.discover
    monkeypatch.setattr(
        discovery, "discover", lambda *args: discoveries.append(1) or discover(*args)
    )
    model = _Centered()
    model_fn, params = pf.functional(model)
    for n in range(3):
        found = pf.batch_grad(model_fn, params, X[n : n + 1], Y[n : n + 1])
        expected = autograd_batch_grad(model, nn.CrossEntropyLoss(), X[n : n + 1], Y[n : n + 1])
        assert_trees_close(found, expected)
    assert len(discoveries) == 1
    with pytest.raises(ValueError, match="mixes samples"):
        pf.batch_grad(model_fn, params, X, Y)
    assert len(discoveries) == 2


def test_a_loop_over_the_samples_is_refused_with_the_fix():
    """A parameter used once per sample: as many calls as samples, not discovery's one."""

    class PerSample(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale, self.head = nn.Parameter(torch.ones(3)), nn.Linear(3, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.stack([torch.dot(row, self.scale) * row for row in x]))

    model_fn, params = pf.functional(PerSample())
    with pytest.raises(RuntimeError, match="a Python loop over the samples"):
        pf.batch_grad(model_fn, params, torch.randn(3, 3), torch.tensor([0, 1, 0]))


@pytest.mark.parametrize("transform", ["vmap", "grad"])
def test_a_parameter_inside_a_transform_of_the_forward_is_refused(transform):
    """``torch.vmap(lambda row: tanh(row @ P))(h)`` in the forward: P was taken as unused and
    every per-sample quantity of it was zero (batch_grad 0.53 off), silently."""

    class InsideTransform(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner, self.P, self.head = (
                nn.Linear(3, 4),
                nn.Parameter(torch.randn(4, 4)),
                nn.Linear(4, 2),
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            def row(h: torch.Tensor) -> torch.Tensor:
                return torch.tanh(h @ self.P)

            def energy(h: torch.Tensor) -> torch.Tensor:
                return row(h).sum()

            per_row = torch.func.grad(energy) if transform == "grad" else row
            return self.head(torch.vmap(per_row)(self.inner(x)))

    model_fn, params = pf.functional(InsideTransform())
    with pytest.raises(ValueError, match="inside a torch.func transform of its own forward"):
        pf.batch_grad(model_fn, params, torch.randn(3, 3), torch.tensor([0, 1, 0]))


def _energy_gradient_model(inner: str):
    """``model(p, X) = (∂E/∂x)(X) W₃`` with ``E = tanh(x W₁ + b₁) w₂``, the derivative in ``x``
    taken by ``torch.func.grad`` (reverse mode) or ``jacfwd`` (forward mode)."""

    def model_fn(p: dict[str, torch.Tensor], X: torch.Tensor) -> torch.Tensor:
        def energy(x: torch.Tensor) -> torch.Tensor:
            return (torch.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]).sum()

        derivative = torch.func.grad(energy) if inner == "grad" else torch.func.jacfwd(energy)
        return torch.vmap(derivative)(X) @ p["w3"]

    return model_fn


@pytest.mark.parametrize("inner", ["grad", "jacfwd"])
def test_products_through_a_reverse_mode_transform_in_the_forward_are_refused(inner):
    """An energy model's (a PINN's) ``torch.func.grad`` in ``x`` inside its forward: the
    first-order quantities refused it, the GGN and Hessian products returned a zero block for
    the parameters used there (1.0 off; found by a probe). Refused; a forward-mode
    derivative there stays exact (against torch.func on the same function)."""
    torch.manual_seed(0)
    X, y = torch.randn(3, 3, dtype=torch.float64), torch.tensor([0, 2, 1])
    shapes = {"w1": (3, 4), "b1": (4,), "w2": (4,), "w3": (3, 3)}
    params = {k: torch.randn(*s, dtype=torch.float64) / 2 for k, s in shapes.items()}
    v = {k: torch.randn_like(p) for k, p in params.items()}
    model_fn, loss = _energy_gradient_model(inner), nn.CrossEntropyLoss(reduction="sum")
    if inner == "grad":
        for product in (pf.ggn_vector_product, pf.hessian_vector_product):
            with pytest.raises(ValueError, match="reverse-mode torch.func transform"):
                product(model_fn, params, X, y, v, loss=loss)
        return
    total = lambda p: loss(model_fn(p, X), y)  # noqa: E731
    expected = torch.func.jvp(torch.func.grad(total), (params,), (v,))[1]
    found = pf.hessian_vector_product(model_fn, params, X, y, v, loss=loss)
    for name in params:
        torch.testing.assert_close(found[name], expected[name])


def test_a_maml_step_in_the_forward_names_the_transform():
    """A torch.func.grad of the forward's own, with the parameters themselves wrapped by it
    (a MAML inner step on a fixed support set): the refusal said the rows mix samples."""

    class InnerStep(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(3, 2)
            self.register_buffer("support", torch.randn(5, 3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            params = dict(self.body.named_parameters())

            def support_loss(q: dict[str, torch.Tensor]) -> torch.Tensor:
                return torch.func.functional_call(self.body, q, (self.support,)).square().sum()

            step = torch.func.grad(support_loss)(params)
            adapted = {k: params[k] - 0.1 * step[k] for k in params}
            return torch.func.functional_call(self.body, adapted, (x,))

    model_fn, params = pf.functional(InnerStep())
    with pytest.raises(ValueError, match="inside a torch.func transform of its own forward"):
        pf.batch_grad(model_fn, params, torch.randn(4, 3), torch.tensor([0, 1, 0, 1]))


def test_a_contrastive_similarity_of_the_batch_is_refused_as_such():
    """CLIP's ``logits_per_image``: ``x @ z.T`` scaled by a parameter; the refusal blamed
    layers called in another order (a Python loop, a mixture of experts)."""

    class Contrastive(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(5, 4), nn.Linear(6, 4)
            self.scale = nn.Parameter(torch.tensor(0.5))

        def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
            return self.a(x) @ self.b(z).T * self.scale.exp()

    model_fn, params = pf.functional(Contrastive())
    X = (torch.randn(4, 5), torch.randn(4, 6))
    with pytest.raises(RuntimeError, match="grows with the batch size"):
        pf.batch_grad(model_fn, params, X, torch.arange(4))


class _Cube(torch.autograd.Function):
    """``x · w³`` with its own backward, batched by torch's generated vmap rule."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * w**3

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, w = ctx.saved_tensors
        gw = g * x * 3 * w**2
        return g * w**3, gw.sum(0) if gw.dim() > w.dim() else gw


@pytest.mark.parametrize("quantity", ["diag_hessian", "batch_diag_hessian"])
def test_a_parameter_inside_a_custom_function_names_it_for_hessians(quantity):
    """Its first-order quantities and GGN take the whole-model path; Hessian diagonals were
    refused with the message about per-sample loops, which the model does not have."""

    class WithCustomFunction(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner, self.w, self.head = (
                nn.Linear(3, 4),
                nn.Parameter(torch.rand(4)),
                nn.Linear(4, 2),
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.tanh(_Cube.apply(self.inner(x), self.w)))

    model = WithCustomFunction().double()
    model_fn, params = pf.functional(model)
    X, y = torch.randn(3, 3, dtype=torch.float64), torch.tensor([0, 1, 0])
    loss = nn.CrossEntropyLoss(reduction="sum")
    found = pf.batch_grad(model_fn, params, X, y, loss=loss)["w"]
    for n in range(3):
        expected = torch.autograd.grad(loss(model(X[n : n + 1]), y[n : n + 1]), model.w)[0]
        torch.testing.assert_close(found[n], expected)
    with pytest.raises(ValueError, match="custom torch.autograd.Function _Cube"):
        getattr(pf, quantity)(model_fn, params, X, y, loss=loss)


def test_a_custom_function_under_the_callers_vmap_is_refused_naming_the_vmap():
    """An ensemble's vmap around batch_grad: the refusal spoke of second derivatives alone."""

    class WithCustomFunction(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner, self.w = nn.Linear(3, 2), nn.Parameter(torch.rand(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return _Cube.apply(self.inner(x), self.w)

    members = [WithCustomFunction(), WithCustomFunction()]
    stacked, _ = torch.func.stack_module_state(members)
    base = copy.deepcopy(members[0]).to("meta")

    def model_fn(params, X):
        return torch.func.functional_call(base, params, (X,))

    X, y = torch.randn(3, 3), torch.tensor([0, 1, 0])
    with pytest.raises(ValueError, match="vmap/grad around the packfunc call"):
        torch.func.vmap(lambda p: pf.batch_grad(model_fn, p, X, y))(stacked)


def test_the_last_sample_alone_is_compared_too():
    """A shared input as long as the batch whose use leaves the first sample its own value
    (``s.max()`` with the largest entry first) passed the first sample's comparison."""
    model_fn, params = pf.functional(nn.Linear(3, 2))

    def scaled(p, inputs):
        x, s = inputs  # s [N]: shared by the batch (a misuse)
        return model_fn(p, x * s.max())

    s = torch.tensor([3.0, 1.0, 2.0, 0.5, 1.5])
    with pytest.raises(ValueError, match="last sample alone"):
        pf.batch_grad(scaled, params, (X, s), Y)


def test_a_refused_batch_is_refused_again():
    """The plan a refusal found is cached: calling again must not skip the check (it did)."""
    model_fn, params = pf.functional(_Centered())
    for quantity in (pf.batch_grad, pf.batch_grad, pf.sum_grad_squared):
        with pytest.raises(ValueError, match="first sample alone"):
            quantity(model_fn, params, X[:4], torch.tensor([0, 1, 1, 0]))


def test_a_plan_found_under_vmap_is_checked_by_the_next_plain_call():
    """Under vmap values cannot decide the check: that plan was cached unchecked, and a plain
    call after it returned wrong per-sample gradients silently."""
    model_fn, params = pf.functional(_Centered())
    batch, labels = X[:4], torch.tensor([0, 1, 1, 0])
    ensemble = {name: torch.stack([p, p]) for name, p in params.items()}
    torch.func.vmap(lambda p: pf.batch_grad(model_fn, p, batch, labels))(ensemble)
    with pytest.raises(ValueError, match="first sample alone"):
        pf.batch_grad(model_fn, params, batch, labels)


def test_the_first_sample_check_runs_under_grad():
    """``grad`` of a quantity (a penalty) is checked: values decide there."""
    model_fn, params = pf.functional(_Centered())
    batch, labels = X[:4], torch.tensor([0, 1, 1, 0])

    def penalty(p):
        norms = pf.batch_l2_grad(model_fn, p, batch, labels)
        return sum(n.sum() for n in norms.values())

    with pytest.raises(ValueError, match="first sample alone"):
        torch.func.grad(penalty)(params)


def test_a_batch_of_one_and_dropout_pass_the_first_sample_check():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.5), nn.Tanh(), nn.Linear(4, 2)).train()
    model_fn, params = pf.functional(model)
    assert pf.batch_grad(model_fn, params, X, Y)["0.weight"].shape == (len(X), 4, 3)
    assert pf.batch_grad(*_mlp(), X[:1], Y[:1])["0.weight"].shape[0] == 1


class _ScalesItsInput(nn.Module):
    """Doubles its input in place before a Linear (``x.mul_(2)``: preprocessing in the model)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.tanh(x.mul_(2)))


def test_a_model_that_changes_its_input_changes_it_once_and_is_exact():
    """Discovery runs on a copy: the batch is changed once, as by a plain forward."""
    torch.manual_seed(0)
    model = _ScalesItsInput().double()
    model_fn, params = pf.functional(model)
    inputs, labels = torch.randn(4, 3, dtype=torch.float64), torch.tensor([0, 1, 0, 1])
    original = inputs.clone()
    found = pf.batch_grad(model_fn, params, inputs, labels)
    assert torch.equal(inputs, 2 * original)
    for n in range(4):
        model.zero_grad()
        row = original[n : n + 1].clone()
        (nn.functional.cross_entropy(model(row), labels[n : n + 1]) / 4).backward()
        torch.testing.assert_close(found["lin.weight"][n], model.lin.weight.grad)


def test_the_shim_on_a_model_that_changes_its_input_is_exact():
    """The user's forward changed the batch before discovery copies the first sample."""
    import packfunc.compat as compat

    torch.manual_seed(0)
    model = _ScalesItsInput().double()
    inputs, labels = torch.randn(4, 3, dtype=torch.float64), torch.tensor([0, 1, 0, 1])
    original, expected = inputs.clone(), []
    for n in range(4):
        model.zero_grad()
        row = original[n : n + 1].clone()
        (nn.functional.cross_entropy(model(row), labels[n : n + 1]) / 4).backward()
        expected.append(model.lin.weight.grad.clone())
    model.zero_grad()
    extended, loss = compat.extend(model), compat.extend(nn.CrossEntropyLoss())
    value = loss(extended(inputs), labels)
    with compat.backpack(compat.extensions.BatchGrad()):
        value.backward()
    assert torch.equal(inputs, 2 * original)
    torch.testing.assert_close(model.lin.weight.grad_batch, torch.stack(expected))


def test_a_model_that_changes_its_input_is_not_run_again():
    model_fn, params = pf.functional(_ScalesItsInput())
    with pytest.raises(ValueError, match=r"changes its input in place.*x\.mul_\(2\)"):
        pf.kfra(model_fn, params, X.clone(), Y)


class _ChangesItsWeight(nn.Module):
    """Changes its weight in the forward (decays it, zeroes a row, clamps it), or a copy of it."""

    def __init__(self, how: str):
        super().__init__()
        self.lin, self.how = nn.Linear(3, 2), how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.lin.weight
        with torch.no_grad():
            if self.how == "decay":
                weight.mul_(0.5)
            elif self.how == "setitem":
                weight[0] = 0.0
            elif self.how == "data":  # through .data, which is no view (no _base)
                weight.data.clamp_(-0.1, 0.1)
            elif self.how == "detached":
                weight.detach()[1].zero_()
            elif self.how == "set data":
                weight.data = weight.data * 0.5
            else:  # a copy of it, changed in place: the parameter stays
                scaled = weight * 1.0
                scaled.mul_(2.0)
        return self.lin(x)


_IN_PLACE_WRITES = [
    ("decay", "mul_"),
    ("setitem", "__setitem__"),
    ("data", "clamp_"),
    ("detached", "zero_"),
    ("set data", "data ="),
]


@pytest.mark.parametrize(("how", "name"), _IN_PLACE_WRITES)
def test_a_model_that_changes_a_parameter_in_its_forward_is_refused_unchanged(how, name):
    model = _ChangesItsWeight(how)
    weight = model.lin.weight.detach().clone()
    model_fn, params = pf.functional(model)
    with pytest.raises(ValueError, match=rf"changes a parameter in place .*\({name}\)"):
        pf.batch_grad(model_fn, params, X, Y)
    assert torch.equal(model.lin.weight, weight)


@pytest.mark.parametrize(("how", "name"), _IN_PLACE_WRITES)
def test_the_shim_refuses_a_model_that_changes_a_parameter_in_its_forward(how, name):
    import packfunc.compat as compat

    model = compat.extend(_ChangesItsWeight(how))
    value = compat.extend(nn.CrossEntropyLoss())(model(X), Y)  # the user's forward changes it
    weight = model.lin.weight.detach().clone()
    with (
        pytest.raises(ValueError, match=rf"changes a parameter in place .*\({name}\)"),
        compat.backpack(compat.extensions.BatchGrad()),
    ):
        value.backward()
    assert torch.equal(model.lin.weight, weight)  # packfunc changed it no further


def test_a_write_next_to_a_parameter_in_shared_memory_is_fine():
    """A tensor beside the parameters in one allocation (a flat buffer) may be written."""

    class BesideItsWeight(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            flat = torch.randn(2 * 3 + 4)
            self.weight = nn.Parameter(flat[:6].view(2, 3))
            self.register_buffer("scratch", flat[6:])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.scratch.add_(1.0)
            return x @ self.weight.T

    model = BesideItsWeight()
    model_fn, params = pf.functional(model)
    assert pf.batch_grad(model_fn, params, X, Y)["weight"].shape == (len(X), 2, 3)


def test_a_copy_of_a_parameter_changed_in_place_is_fine():
    model_fn, params = pf.functional(_ChangesItsWeight("copy"))
    assert pf.batch_grad(model_fn, params, X, Y)["lin.weight"].shape == (len(X), 2, 3)


def test_integer_params_are_refused():
    model_fn, params = _mlp()
    params = dict(params, step=torch.tensor(3))
    with pytest.raises(TypeError, match="floating-point params"):
        pf.batch_grad(model_fn, params, X, Y)


def test_batchnorm_in_training_mode_is_refused():
    model_fn, params = pf.functional(
        nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).train()
    )
    with pytest.raises(ValueError, match=r"model\.eval\(\)"):
        pf.batch_grad(model_fn, params, X, Y)


def test_batchnorm_without_running_statistics_names_why_eval_does_not_help():
    """``track_running_stats=False`` normalizes with batch statistics in eval mode too: the
    message told to call ``model.eval()``, which it already was."""
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4, track_running_stats=False))
    model_fn, params = pf.functional(model.eval())
    with pytest.raises(ValueError, match="track_running_stats=False uses batch statistics"):
        pf.batch_grad(model_fn, params, X, Y)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"max_norm": 1.0}, "max_norm"), ({"scale_grad_by_freq": True}, "couples samples")],
)
def test_embedding_options_that_break_purity_or_independence(kwargs, match):
    model_fn, params = pf.functional(
        nn.Sequential(nn.Embedding(5, 3, **kwargs), nn.Flatten(), nn.Linear(6, 2))
    )
    with pytest.raises(ValueError, match=match):
        pf.batch_grad(model_fn, params, torch.randint(0, 5, (4, 2)), Y[:4])


@pytest.mark.parametrize("quantity", ["batch_grad", "diag_ggn"])
def test_an_embedding_bag_with_max_norm_is_refused_before_it_renormalizes(quantity):
    """EmbeddingBag(max_norm=...) renormalizes the rows it looks up in place: packfunc's
    discovery ran it on the user's weight (rows of norm 5 left at 0.5), then torch's vmap
    error."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.EmbeddingBag(7, 3, mode="mean", max_norm=0.5), nn.Linear(3, 2))
    before = model[0].weight.detach().clone()
    model_fn, params = pf.functional(model)
    with pytest.raises(ValueError, match="changes a parameter in place.*embedding_bag"):
        getattr(pf, quantity)(model_fn, params, torch.randint(0, 7, (4, 3)), Y[:4])
    assert torch.equal(model[0].weight, before)


def test_embedding_bag_options_and_sparse_gradients_are_refused_in_packfunc_words():
    """EmbeddingBag(scale_grad_by_freq=True) couples samples (it was caught only by the sum
    check, blaming torch's batching rule); sparse gradients failed with torch's "Could not run
    'aten::view' ... 'SparseCPU' backend". Embedding(sparse=True)'s first order runs."""
    torch.manual_seed(0)
    ids, y = torch.randint(0, 7, (4, 3)), Y[:4]
    bag = nn.Sequential(nn.EmbeddingBag(7, 3, scale_grad_by_freq=True), nn.Linear(3, 2))
    with pytest.raises(ValueError, match="EmbeddingBag\\(scale_grad_by_freq=True\\).*couples"):
        pf.batch_grad(*pf.functional(bag), ids, y)
    sparse_bag = nn.Sequential(nn.EmbeddingBag(7, 3, sparse=True), nn.Linear(3, 2))
    with pytest.raises(ValueError, match="sparse gradients.*sparse=False"):
        pf.batch_grad(*pf.functional(sparse_bag), ids, y)
    sparse = nn.Sequential(
        nn.Embedding(7, 3, sparse=True), nn.Tanh(), nn.Flatten(), nn.Linear(9, 2)
    )
    with pytest.raises(ValueError, match="sparse gradients.*sparse=False"):
        pf.diag_hessian(*pf.functional(sparse), ids, y)
    loss = nn.CrossEntropyLoss(reduction="sum")
    found = pf.batch_grad(*pf.functional(sparse), ids, y, loss=loss)
    expected = autograd_batch_grad(sparse, loss, ids, y)
    for name in expected:
        torch.testing.assert_close(found[name], expected[name].to_dense())


def test_unknown_quantity_name():
    model_fn, params = _mlp()
    with pytest.raises(ValueError, match="unknown quantities"):
        pf.compute(model_fn, params, X, Y, quantities=("batch_grads",))


def test_bad_chunk_size():
    model_fn, params = _mlp()
    with pytest.raises(ValueError, match="chunk_size"):
        pf.sum_grad_squared(model_fn, params, X, Y, chunk_size=0)


def test_subsampling_out_of_range():
    model_fn, params = _mlp()
    with pytest.raises(ValueError, match="subsampling"):
        pf.batch_grad(model_fn, params, X, Y, subsampling=[0, 5])


def test_subsampling_takes_a_slice_of_the_batch():
    """``subsampling=slice(1, 3)`` raised torch's 'Could not infer dtype of slice'."""
    model_fn, params = _mlp()
    found = pf.batch_grad(model_fn, params, X, Y, subsampling=slice(1, 3))
    expected = pf.batch_grad(model_fn, params, X, Y, subsampling=[1, 2])
    for name in params:
        torch.testing.assert_close(found[name], expected[name])


@pytest.mark.parametrize("extension", ["DiagGGNExact", "KFAC", "DiagHessian", "BatchGrad"])
def test_the_shim_refuses_an_empty_batch_by_name(extension):
    """The second-order extensions raised torch's 'cannot reshape tensor of 0 elements'."""
    from packfunc.compat import backpack, extend
    from packfunc.compat import extensions as ours

    model = extend(nn.Sequential(nn.Linear(3, 2)))
    lossfunc = extend(nn.CrossEntropyLoss(reduction="sum"))
    with backpack(getattr(ours, extension)()), pytest.raises(ValueError, match="empty batch"):
        lossfunc(model(torch.randn(0, 3)), torch.zeros(0, dtype=torch.long)).backward()


def test_a_model_that_packs_its_batch_under_the_callers_vmap():
    """Over an ensemble's stacked parameters each member's results are its own; over stacked
    batches (each its own lengths) it is refused naming the fix (the message said the
    samples would run one by one)."""
    from tests.cases import PackedTagger, ragged_tokens

    model_fn, params = pf.functional(PackedTagger().double())
    stacked = {k: torch.stack([v, 2 * v]) for k, v in params.items()}
    tokens, y = ragged_tokens(3), torch.tensor([0, 1, 2])
    norms = torch.func.vmap(lambda p: pf.batch_l2_grad(model_fn, p, tokens, y)["head.bias"])
    for member, found in enumerate(norms(stacked)):
        alone = {k: v[member] for k, v in stacked.items()}
        torch.testing.assert_close(found, pf.batch_l2_grad(model_fn, alone, tokens, y)["head.bias"])
    batches, targets = torch.stack([tokens, tokens.flip(0)]), torch.stack([y, y.flip(0)])
    with pytest.raises(ValueError, match="once per batch"):
        torch.func.vmap(lambda X, t: pf.batch_l2_grad(model_fn, params, X, t)["head.bias"])(
            batches, targets
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reduced_precision_works(dtype):
    """Half types work on CPU (torch 2.13): same dtype, float64 values to their precision."""
    model_fn, params = _mlp()
    params = {k: v.to(dtype) for k, v in params.items()}
    result = pf.batch_grad(model_fn, params, X.to(dtype), Y)
    reference = pf.batch_grad(
        model_fn, {k: v.double() for k, v in params.items()}, X.to(dtype).double(), Y
    )  # the same rounded inputs
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for name in params:
        assert result[name].dtype == dtype
        scale = float(reference[name].abs().max())
        torch.testing.assert_close(
            result[name].double(), reference[name], rtol=tol, atol=tol * scale
        )


@pytest.mark.parametrize(
    ("quantity", "keyword", "hint"),
    [
        ("clipped_grad", "noise_multiplier", None),
        ("clipped_grad", "max_nrom", "max_norm"),
        ("batch_grad", "chunksize", "chunk_size"),
        ("diag_ggn", "mc_sample", "mc_samples"),
    ],
)
def test_an_unknown_keyword_is_refused_not_ignored(quantity, keyword, hint):
    """An ignored keyword changes nothing silently (``noise_multiplier=`` would add no noise)."""
    model_fn, params = _mlp()
    loss = nn.CrossEntropyLoss(reduction="sum")
    options = {"max_norm": 1.0} if quantity == "clipped_grad" else {}
    message = f"unexpected keyword arguments \\['{keyword}'\\]" + (
        f".*did you mean '{hint}'" if hint else ""
    )
    for batch in ({"X": X, "y": Y}, {"data": [(X, Y)]}):
        with pytest.raises(TypeError, match=message):
            getattr(pf, quantity)(model_fn, params, **batch, loss=loss, **options, **{keyword: 1})


@pytest.mark.parametrize("quantity", [pf.batch_grad, pf.diag_ggn])
def test_a_refusal_after_the_batch_pass_puts_the_buffers_back(quantity):
    """Spectral norm in training mode: the batch pass advanced its power iteration, then the
    whole-model path refused to run it again, and the refused call had changed the buffers."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.utils.parametrizations.spectral_norm(nn.Linear(3, 4)), nn.Tanh(), nn.Linear(4, 2)
    )
    before = {name: value.clone() for name, value in model.state_dict().items()}
    model_fn, params = pf.functional(model)
    with pytest.raises(ValueError, match="changes its buffer"):
        quantity(model_fn, params, X, Y)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


class _Symmetric(nn.Module):
    def forward(self, X: torch.Tensor) -> torch.Tensor:
        return X.triu() + X.triu(1).T


@pytest.mark.parametrize("quantity", ["batch_grad", "diag_ggn", "hessian_vector_product"])
def test_a_parametrized_model_inside_parametrize_cached_is_refused_unchanged(quantity):
    """Inside ``parametrize.cached()`` the weight is computed once: ``original``'s per-sample
    quantities came out zero, silently, and a pass of packfunc's own left its weight in the
    cache, so the caller's next backward gave ``original`` no gradient."""
    from torch.nn.utils import parametrize

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3))
    parametrize.register_parametrization(model[0], "weight", _Symmetric())
    model_fn, params = pf.functional(model)
    X, y = torch.randn(2, 3), torch.tensor([0, 2])
    extra = (params,) if quantity == "hessian_vector_product" else ()
    with parametrize.cached():
        with pytest.raises(ValueError, match="parametrize.cached"):
            getattr(pf, quantity)(model_fn, params, X, y, *extra)
        nn.CrossEntropyLoss()(model(X), y).backward()
    assert model[0].parametrizations.weight.original.grad is not None
    plain = pf.functional(nn.Linear(3, 2))
    with parametrize.cached():  # a model without parametrizations is fine there
        pf.batch_grad(*plain, X, torch.tensor([0, 1]))


@pytest.mark.parametrize("quantity", ["diag_hessian", "batch_diag_hessian"])
def test_a_hessian_through_an_op_without_second_derivative_names_the_ggn(quantity):
    """``torch.cdist``'s backward has no derivative in torch: torch's bare message, now
    with what packfunc can compute instead (its GGN quantities are exact)."""

    class Prototypes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.prototypes = nn.Parameter(torch.randn(2, 3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return -torch.cdist(x, self.prototypes)

    model_fn, params = pf.functional(Prototypes())
    X, y = torch.randn(3, 3), torch.tensor([0, 1, 0])
    assert pf.diag_ggn(model_fn, params, X, y)["prototypes"].shape == (2, 3)
    with pytest.raises(NotImplementedError, match="use the GGN quantities"):
        getattr(pf, quantity)(model_fn, params, X, y)


def test_a_parameter_without_elements_is_refused_by_name_and_can_be_left_out():
    """``nn.Linear(d, 0)``: torch's reshape error ("cannot reshape tensor of 0 elements")
    from deep in the layer rules, in every quantity and the shim; now a refusal naming the
    leaf, and leaving it out of params (or freezing it in the shim) works."""

    class WithEmptyHead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head, self.empty = nn.Linear(3, 2), nn.Linear(3, 0)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.cat([self.head(x), self.empty(x)], -1)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: initializing zero-element tensors
        model = WithEmptyHead()
    model_fn, params = pf.functional(model)
    X, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
    for quantity in ("batch_grad", "diag_ggn", "kfac"):
        with pytest.raises(ValueError, match="'empty.(weight|bias)' has no elements.*Leave it out"):
            getattr(pf, quantity)(model_fn, params, X, y)
    kept = {name: p for name, p in params.items() if p.numel()}
    expected = autograd_batch_grad(model, nn.CrossEntropyLoss(), X, y)
    assert_trees_close(pf.batch_grad(model_fn, kept, X, y), {k: expected[k] for k in kept})
    extended, lossfunc = extend(model), extend(nn.CrossEntropyLoss())
    with pytest.raises(ValueError, match="has no elements"), backpack(BatchGrad()):
        lossfunc(extended(X), y).backward()
    extended.empty.requires_grad_(False)
    with backpack(BatchGrad()):
        lossfunc(extended(X), y).backward()
    torch.testing.assert_close(model.head.weight.grad_batch, expected["head.weight"])


def test_parameters_on_the_meta_device_are_refused_by_name():
    """A model built on ``meta`` (shapes, no values) gave torch's ``aten::equal`` message."""
    model_fn, params = pf.functional(nn.Linear(3, 2, device="meta"))
    X, y = torch.randn(4, 3, device="meta"), torch.randint(0, 2, (4,), device="meta")
    with pytest.raises(ValueError, match="'bias' is on the meta device.*to_empty"):
        pf.batch_grad(model_fn, params, X, y)


def test_channels_last_where_torch_func_cannot_run_it_names_the_layout():
    """A channels-last model: GGN products raised torch's "view size is not compatible"
    (group norm's forward-mode rule), Hessian diagonals its "NYI: querying is_contiguous
    inside of vmap" (max pooling); refused, naming the contiguous layout, which works."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.GroupNorm(2, 4), nn.Tanh(), nn.Flatten(), nn.Linear(64, 2)
    ).to(memory_format=torch.channels_last)
    X = torch.randn(2, 3, 6, 6).contiguous(memory_format=torch.channels_last)
    y = torch.tensor([0, 1])
    model_fn, params = pf.functional(model)
    assert pf.diag_ggn(model_fn, params, X, y)["0.weight"].shape == (4, 3, 3, 3)
    v = {k: torch.ones_like(p) for k, p in params.items()}
    with pytest.raises(ValueError, match="channels-last.*contiguous_format"):
        pf.ggn_vector_product(model_fn, params, X, y, v)
    model = model.to(memory_format=torch.contiguous_format)
    pf.ggn_vector_product(*pf.functional(model), X.contiguous(), y, v)


def _gradient(model_fn, params, X, y):
    """The gradient alone (its own path: one forward and one backward, nothing recorded)."""
    return pf.compute(model_fn, params, X, y, quantities=("grad",))["grad"]


def test_a_batch_size_mismatch_is_refused_before_the_model_runs():
    """y's batch size was compared with X's only after discovery ran the model on ``X[0:1]``:
    a graph batch (12 nodes in X, 4 graphs in y) failed with torch's IndexError inside the
    model, a sequence-first LSTM input ``[T, N, d]`` with a PlanMismatch blaming Python loops.
    Both are refused first, saying that dim 0 of every input must be the sample."""
    torch.manual_seed(0)
    graph = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 3, 3])  # the graph of each node
    runs = []

    def gnn(p, nodes):
        runs.append(nodes.shape)
        h = torch.tanh(nodes @ p["w1"].T)
        return torch.zeros(4, 8).index_add(0, graph, h) @ p["w2"].T  # pooled per graph

    params = {"w1": torch.randn(8, 3), "w2": torch.randn(2, 8)}
    nodes, y = torch.randn(12, 3), torch.randint(0, 2, (4,))
    for quantity in (pf.batch_grad, _gradient, pf.diag_ggn):
        with pytest.raises(ValueError, match=r"\(4,\) but the batch has 12 .*dim 0 of every"):
            quantity(gnn, params, nodes, y)
    assert runs == []

    class SequenceFirst(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn, self.head = nn.LSTM(3, 5), nn.Linear(5, 2)

        def forward(self, x):  # x: [T, N, d]
            return self.head(self.rnn(x)[0][-1])

    model_fn, params = pf.functional(SequenceFirst())
    with pytest.raises(ValueError, match=r"\(1,\) but the batch has 3 samples.*batch_first=True"):
        pf.batch_grad(model_fn, params, torch.randn(3, 1, 3), torch.tensor([1]))


@pytest.mark.filterwarnings("ignore:.*(nested tensors|Sparse CSR).*:UserWarning")
@pytest.mark.parametrize("kind", ["coo", "csr", "jagged", "strided"])
def test_sparse_and_nested_inputs_are_refused_naming_the_dense_tensor(kind):
    """A sparse COO X on nn.Linear was refused as a layer's sparse gradients (nn.Embedding),
    a CSR one ended in torch's "Sparse CSR tensors do not have strides", a torch.nested one
    in torch's internal errors; every quantity refuses them, naming the dense tensor."""
    model_fn, params = _mlp()
    if kind in ("coo", "csr"):
        inputs = X[:4].to_sparse() if kind == "coo" else X[:4].to_sparse_csr()
        fix = r"sparse tensor.*X\['x'\]\.to_dense\(\)"
    else:
        rows = [X[:length] for length in (2, 3, 1, 4)]
        layout = torch.jagged if kind == "jagged" else torch.strided
        inputs = torch.nested.nested_tensor(rows, layout=layout)
        fix = r"nested tensor.*to_padded_tensor\(X\['x'\], 0\.0\).*mask"
    wrapped = lambda p, X: model_fn(p, X["x"])  # noqa: E731
    for quantity in (pf.batch_grad, _gradient, pf.kfac):
        with pytest.raises(ValueError, match=fix):
            quantity(wrapped, params, {"x": inputs}, Y[:4])
    v = {k: torch.ones_like(p) for k, p in params.items()}
    with pytest.raises(ValueError, match=fix):  # (before the model runs, as the others)
        pf.ggn_vector_product(wrapped, params, {"x": inputs}, Y[:4], v)


def test_an_output_without_the_batch_names_its_likely_cause():
    """A per-sample Python list in a dict X is not sliced, so the one sample discovery runs
    saw the whole batch's: "model_fn returned (4, 2) for a batch of one sample" now names the
    list and the fix; a model_fn returning a tuple or dict ("returned tuple for a batch of one
    sample") is told to return one tensor, and how."""
    model_fn, params = _mlp()

    def scaled(p, X):
        return model_fn(p, X["x"]) * torch.as_tensor(X["scale"])[:, None]

    inputs = {"x": X[:4], "scale": [1.0, 2.0, 3.0, 4.0]}
    with pytest.raises(ValueError, match=r"Python values at X\['scale'\].*Make each a"):
        pf.batch_grad(scaled, params, inputs, Y[:4])
    inputs["scale"] = torch.tensor(inputs["scale"])  # the fix
    found = pf.batch_grad(scaled, params, inputs, Y[:4])
    assert found["0.weight"].shape == (4, 4, 3)
    pair, named = (lambda p, X: (model_fn(p, X), X)), (lambda p, X: {"logits": model_fn(p, X)})
    for wrapped, kind in ((pair, "tuple"), (named, "dict")):
        for quantity in (pf.batch_grad, _gradient):
            with pytest.raises((ValueError, TypeError), match=rf"{kind}.*one tensor.*\)\[0\]"):
                quantity(wrapped, params, X, Y)


def test_inputs_of_another_leading_size_are_named_with_the_fix():
    """Position ids ``[1, T]`` shared by the batch: the message gave the sizes alone."""
    model_fn, params = pf.functional(torch.nn.Linear(3, 2))
    X = {"x": torch.randn(4, 3), "position_ids": torch.arange(5)[None]}
    with pytest.raises(ValueError, match=r"X\['position_ids'\]: 1.*closed over in model_fn"):
        pf.batch_grad(lambda p, X: model_fn(p, X["x"]), params, X, torch.tensor([0, 1, 1, 0]))


def test_curvature_products_refuse_targets_of_another_batch_size_before_the_model_runs():
    """The products ran a forward of the whole batch first (a hook logging forwards saw it)."""
    model = nn.Linear(3, 2)
    calls = []
    model.register_forward_hook(lambda module, args, out: calls.append(1))
    model_fn, params = pf.functional(model)
    v = {k: torch.ones_like(p) for k, p in params.items()}
    X, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0, 1])
    for product in (pf.ggn_vector_product, pf.hessian_vector_product):
        with pytest.raises(ValueError, match="targets have shape"):
            product(model_fn, params, X, y, v)
    assert not calls


def test_an_element_weight_of_another_batch_is_named_with_data():
    """``BCEWithLogitsLoss(weight=[N, 1])`` (one row per sample of the whole set) with
    ``data=`` met torch's raw broadcasting error in the first smaller batch (a probe); it is
    named now. A weight per output entry serves every batch."""
    fn, params = pf.functional(nn.Sequential(nn.Linear(3, 2)))
    X, y = torch.randn(4, 3), torch.rand(4, 2).round()
    batches = [(X[:2], y[:2]), (X[2:], y[2:])]
    per_sample = nn.BCEWithLogitsLoss(weight=torch.rand(4, 1))
    with pytest.raises(ValueError, match=r"weight=...\) has shape \(4, 1\).*\(2, 2\)"):
        pf.diag_ggn(fn, params, data=batches, loss=per_sample)
    per_entry = nn.BCEWithLogitsLoss(weight=torch.rand(2))
    whole = pf.diag_ggn(fn, params, X, y, loss=per_entry)
    split = pf.diag_ggn(fn, params, data=batches, loss=per_entry)
    for name in whole:
        torch.testing.assert_close(split[name], whole[name])


def _forces(params: dict, X: torch.Tensor) -> torch.Tensor:
    """Forces ``-∂E/∂x`` of an energy network, by ``torch.autograd.grad`` in the forward."""
    x = X if X.requires_grad else X.detach().requires_grad_()
    with torch.enable_grad():
        energy = (torch.tanh(x @ params["W1"] + params["b1"]) @ params["W2"]).sum()
        return -torch.autograd.grad(energy, x, create_graph=True)[0]


def test_a_forward_that_differentiates_inside_is_refused():
    """A force field's forward takes ``torch.autograd.grad`` of its energy: the weights' uses
    in that inner backward pass were not seen, and ``W2``'s per-sample gradients came out
    zero (errors up to 2.2; ``batch_grad.sum(0)`` not the batch gradient; a probe). It is
    refused, naming the inner backward pass."""
    torch.manual_seed(0)
    params = {"W1": torch.randn(3, 6), "b1": torch.randn(6), "W2": torch.randn(6, 1)}
    X, y = torch.randn(5, 3), torch.randn(5, 3)
    for quantity in (pf.batch_grad, pf.diag_ggn):
        with pytest.raises(ValueError, match="differentiates inside its forward"):
            quantity(_forces, params, X, y, loss=nn.MSELoss(reduction="sum"))


def test_a_params_name_the_model_does_not_read_is_refused():
    """A misspelled key, or the plain ``weight`` that ``prune`` computes in a forward
    pre-hook after ``pf.functional`` ran: every quantity of it was zero, silently (a probe)."""
    import torch.nn.utils.prune as prune

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3))
    X, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    model_fn, params = pf.functional(model)
    misspelled = {("0.wieght" if k == "0.weight" else k): v for k, v in params.items()}
    with pytest.raises(ValueError, match="'0.wieght', which is no parameter"):
        pf.batch_grad(model_fn, misspelled, X, y)
    prune.l1_unstructured(model[0], "weight", 0.3)
    with pytest.raises(ValueError, match="'0.weight', an attribute the model's forward overwrites"):
        pf.clipped_grad(model_fn, params, X, y, max_norm=1.0)
    model_fn, params = pf.functional(model)  # weight_orig: computed
    assert pf.batch_grad(model_fn, params, X, y)["0.weight_orig"].abs().sum() > 0


class _MeanOverPositions(nn.Module):
    """``[N, T, d]`` features averaged over positions."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(1)


@pytest.mark.parametrize("layer", ["conv", "linear over positions"])
def test_float16_factors_and_squares_of_many_samples_stay_in_range(layer: str) -> None:
    """float16, N=2048, a mean: the input factor of a layer over positions summed its
    ``N·L`` outer products before dividing (``inf`` where the average is 32), and the
    squares of the mean's per-sample gradients (``~1e-8``) flushed to zero where their sum
    (``~1e-5``) does not (``sum_grad_squared`` read all zeros; a probe). Products are
    scaled before their sum, and squares of float16 taken in float32."""
    torch.manual_seed(0)
    n = 2048
    if layer == "conv":
        model: nn.Module = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(8 * 16, 5)
        )
        X = torch.randn(n, 3, 4, 4) + 1.0
    else:
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), _MeanOverPositions(), nn.Linear(8, 5))
        X = torch.randn(n, 16, 4) + 1.0
    y = torch.randint(0, 5, (n,))
    reference = pf.compute(
        *pf.functional(copy.deepcopy(model).double()),
        X.double(),
        y,
        quantities=("sum_grad_squared",),
    )["sum_grad_squared"]
    factors = pf.kflr(*pf.functional(copy.deepcopy(model).double()), X.double(), y)
    model_fn, params = pf.functional(model.half())
    half_factors = pf.kflr(model_fn, params, X.half(), y)
    squares = pf.sum_grad_squared(model_fn, params, X.half(), y)
    for name in params:
        assert squares[name].dtype == torch.float16
        torch.testing.assert_close(squares[name].double(), reference[name], rtol=2e-2, atol=1e-7)
    for found, expected in zip(half_factors["0.weight"], factors["0.weight"]):
        assert bool(found.isfinite().all())
        torch.testing.assert_close(found.double(), expected, rtol=1e-2, atol=1e-2)


class _Branching(nn.Module):
    """A linear layer, then ``torch.cond`` on its output (a higher-order operator)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.scale = nn.Parameter(torch.ones(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return torch.cond(h.sum() > 0, lambda a: a * self.scale, lambda a: a - self.scale, (h,))


def test_a_higher_order_operator_is_refused_by_name() -> None:
    """``torch.cond`` (as while_loop, scan, flex_attention) reached discovery's dispatch mode
    as one operator and ended in torch's internal NotImplementedError about a mode's
    ``supports_higher_order_operators`` (a probe). Refused naming the operator and the fix."""
    model_fn, params = pf.functional(_Branching())
    X, y = torch.randn(4, 3), torch.randint(0, 2, (4,))
    for quantity in (pf.batch_grad, pf.diag_ggn):
        with pytest.raises(ValueError, match="higher-order operator cond.*in Python"):
            quantity(model_fn, params, X, y)


@pytest.mark.parametrize(
    "call",
    [
        lambda fn, p, X, y, g: pf.kfac(fn, p, X, y, generator=g),
        lambda fn, p, X, y, g: pf.ekfac(fn, p, X, y, generator=g),
        lambda fn, p, X, y, g: pf.diag_ggn(fn, p, X, y, mc_samples=1, generator=g),
        lambda fn, p, X, y, g: pf.sqrt_ggn(fn, p, X, y, mc_samples=1, generator=g),
        lambda fn, p, X, y, g: pf.hutchinson_trace(fn, p, X, y, generator=g),
        lambda fn, p, X, y, g: pf.privacy.add_noise(p, 1.0, 1.0, generator=g),
        lambda fn, p, X, y, g: pf.privacy.PoissonBatches(10, 0.5, generator=g),
        lambda fn, p, X, y, g: pf.optim.scale_by_kfac(fn, generator=g),
        lambda fn, p, X, y, g: pf.optim.KFAC(nn.Linear(3, 2), generator=g),
    ],
    ids=[
        "kfac",
        "ekfac",
        "diag_ggn",
        "sqrt_ggn",
        "hutchinson",
        "noise",
        "poisson",
        "transform",
        "optimizer",
    ],
)
def test_a_seed_given_as_generator_is_refused_naming_torch_generator(call) -> None:
    """A seed passed as ``generator=`` met torch's own argument errors (some only at an
    optimizer's first step, ekfac's an AttributeError): refused where it is given."""
    fn, p = pf.functional(nn.Linear(3, 2))
    X, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
    with pytest.raises(TypeError, match=r"torch.Generator\(\).manual_seed\(3\)"):
        call(fn, p, X, y, 3)
