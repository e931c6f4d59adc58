"""Loss options: every supported option gives per-sample gradients of the reduced loss."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import packfunc as pf
from packfunc.losses import mean_normalizer
from tests.cases import assert_trees_close, autograd_batch_grad, moments

CLASSES = 4


def _model(final: nn.Module | None = None) -> nn.Module:
    layers = [nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, CLASSES)]
    return nn.Sequential(*layers, *([final] if final else [])).double()


def _class_targets(n: int) -> torch.Tensor:
    return torch.tensor([0, 2, 1, 3, 2, 1][:n])


LOSS_CASES = {
    "ce_weight": (
        lambda: nn.CrossEntropyLoss(weight=torch.rand(CLASSES).double() + 0.1),
        None,
        _class_targets,
    ),
    "ce_ignore_index": (lambda: nn.CrossEntropyLoss(ignore_index=2), None, _class_targets),
    "ce_label_smoothing_weight_ignore": (
        lambda: nn.CrossEntropyLoss(
            label_smoothing=0.2, ignore_index=1, weight=torch.rand(CLASSES).double() + 0.1
        ),
        None,
        _class_targets,
    ),
    "ce_probabilities": (
        lambda: nn.CrossEntropyLoss(label_smoothing=0.1),
        None,
        lambda n: torch.softmax(torch.randn(n, CLASSES), 1).double(),
    ),
    "nll_weight_ignore": (
        lambda: nn.NLLLoss(weight=torch.rand(CLASSES).double(), ignore_index=0),
        nn.LogSoftmax(1),
        _class_targets,
    ),
    "bce_pos_weight_weight": (
        lambda: nn.BCEWithLogitsLoss(
            pos_weight=torch.rand(CLASSES).double() + 0.5, weight=torch.rand(CLASSES).double()
        ),
        None,
        lambda n: torch.rand(n, CLASSES).round().double(),
    ),
    "bce_probabilities": (nn.BCELoss, nn.Sigmoid(), lambda n: torch.rand(n, CLASSES).double()),
    "l1": (nn.L1Loss, None, lambda n: torch.randn(n, CLASSES).double()),
    "smooth_l1": (
        lambda: nn.SmoothL1Loss(beta=0.5),
        None,
        lambda n: torch.randn(n, CLASSES).double(),
    ),
    "huber": (lambda: nn.HuberLoss(delta=0.3), None, lambda n: torch.randn(n, CLASSES).double()),
}


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", list(LOSS_CASES))
def test_loss_options_match_autograd(name: str, reduction: str):
    torch.manual_seed(0)
    make, final, targets = LOSS_CASES[name]
    loss = make()
    loss.reduction = reduction
    model = _model(final)
    X, y = torch.randn(6, 3, dtype=torch.float64), targets(6)
    expected = moments(autograd_batch_grad(model, loss, X, y))
    model_fn, params = pf.functional(model)
    result = pf.compute(model_fn, params, X, y, loss=loss, quantities=pf.FIRST_ORDER)
    torch.testing.assert_close(result["loss"], loss(model(X), y))
    for quantity in pf.FIRST_ORDER:
        for param in params:
            torch.testing.assert_close(
                result[quantity][param],
                expected[quantity][param],
                msg=lambda m, q=quantity, p=param: f"{q}/{p}: {m}",
            )


def test_ignored_sample_has_zero_gradient():
    torch.manual_seed(0)
    model = _model()
    X, y = torch.randn(4, 3, dtype=torch.float64), torch.tensor([0, 2, 2, 1])
    model_fn, params = pf.functional(model)
    l2 = pf.batch_l2_grad(model_fn, params, X, y, loss=nn.CrossEntropyLoss(ignore_index=2))
    for value in l2.values():
        assert torch.all(value[1:3] == 0) and torch.all(value[[0, 3]] > 0)


def test_mean_scaling_is_one_over_n_of_sum():
    torch.manual_seed(0)
    model = _model()
    X, y = torch.randn(5, 3, dtype=torch.float64), _class_targets(5)
    model_fn, params = pf.functional(model)
    mean = pf.batch_grad(model_fn, params, X, y, loss=nn.CrossEntropyLoss())
    total = pf.batch_grad(model_fn, params, X, y, loss=nn.CrossEntropyLoss(reduction="sum"))
    for name in params:
        torch.testing.assert_close(mean[name] * 5, total[name])


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_given_output_gradient_gives_the_losss_first_order_quantities(reduction: str):
    """A loss known by its output gradient gives that loss's per-sample gradients and norms."""
    torch.manual_seed(0)
    model = _model()
    model_fn, params = pf.functional(model)
    X, y = torch.randn(6, 3).double(), _class_targets(6)
    loss = nn.CrossEntropyLoss(reduction=reduction)
    output = model(X).detach().requires_grad_()
    (G,) = torch.autograd.grad(loss(output, y), output)
    given = pf.losses.GivenOutputGradient(G)
    for name in ("batch_grad", "batch_l2_grad", "sum_grad_squared"):
        expected = getattr(pf, name)(model_fn, params, X, y, loss=loss)
        found = getattr(pf, name)(model_fn, params, X, G, loss=given)
        for key in expected:
            torch.testing.assert_close(found[key], expected[key])


def test_given_output_gradient_has_no_curvature():
    model_fn, params = pf.functional(_model())
    G = torch.randn(3, CLASSES).double()
    with pytest.raises(ValueError, match="no curvature"):
        pf.diag_ggn(
            model_fn, params, torch.randn(3, 3).double(), G, loss=pf.losses.GivenOutputGradient(G)
        )


class _FocalLoss(nn.CrossEntropyLoss):
    """A loss of the user's own, written as a subclass of a supported one."""

    def forward(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(output, 1).gather(1, target[:, None]).squeeze(1)
        return (-((1 - logp.exp()) ** 2) * logp).sum()


class _NamedCrossEntropy(nn.CrossEntropyLoss):
    """A subclass that keeps the parent's forward (only a new attribute)."""

    label = "ce"


def test_a_subclass_overriding_forward_is_refused_and_its_gradient_can_be_given():
    """A subclass with its own forward read the parent's closed forms: its GGN diagonal was
    CrossEntropyLoss's, silently. It is refused; its output gradient gives its first-order
    quantities (against a per-sample loop); a subclass keeping the forward still works."""
    torch.manual_seed(0)
    model = _model()
    model_fn, params = pf.functional(model)
    X, y = torch.randn(6, 3).double(), _class_targets(6)
    for name in ("diag_ggn", "batch_grad"):
        with pytest.raises(TypeError, match="_FocalLoss overrides the forward of torch.nn.Cross"):
            getattr(pf, name)(model_fn, params, X, y, loss=_FocalLoss(reduction="sum"))
    output = model(X).detach().requires_grad_()
    (G,) = torch.autograd.grad(_FocalLoss(reduction="sum")(output, y), output)
    found = pf.batch_grad(model_fn, params, X, G, loss=pf.losses.GivenOutputGradient(G))
    expected = autograd_batch_grad(model, _FocalLoss(reduction="sum"), X, y)
    for key in expected:
        torch.testing.assert_close(found[key], expected[key])
    named = pf.diag_ggn(model_fn, params, X, y, loss=_NamedCrossEntropy(reduction="sum"))
    plain = pf.diag_ggn(model_fn, params, X, y, loss=nn.CrossEntropyLoss(reduction="sum"))
    for key in plain:
        torch.testing.assert_close(named[key], plain[key])


def _flat_model(
    model: nn.Module, X: torch.Tensor
) -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor, list[str], list[torch.Size]]:
    """The model's output as a function of one flat float64 parameter vector, and that vector."""
    names = [name for name, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    flat0 = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def output(flat: torch.Tensor) -> torch.Tensor:
        leaves = flat.split([s.numel() for s in shapes])
        params = {n: t.view(s) for n, t, s in zip(names, leaves, shapes)}
        return torch.func.functional_call(model, params, (X,))

    return output, flat0, names, shapes


def _autograd_diagonals(
    model: nn.Module, loss: nn.Module, X: torch.Tensor, y: torch.Tensor
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """GGN ``Jᵀ (∂²L/∂f²) J`` and Hessian diagonals per parameter, by plain autograd."""
    output, flat0, names, shapes = _flat_model(model, X)
    out = output(flat0).detach()
    h_out = torch.autograd.functional.hessian(lambda f: loss(f, y), out)
    jac = torch.autograd.functional.jacobian(output, flat0).reshape(out.numel(), -1)
    ggn = jac.T @ h_out.reshape(out.numel(), out.numel()) @ jac
    hessian = torch.autograd.functional.hessian(lambda flat: loss(output(flat), y), flat0)
    sizes = [s.numel() for s in shapes]

    def per_param(diagonal: torch.Tensor) -> dict[str, torch.Tensor]:
        return {n: d.view(s) for n, d, s in zip(names, diagonal.split(sizes), shapes)}

    return per_param(ggn.diagonal()), per_param(hessian.diagonal())


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize(
    ("options", "n"),
    [
        ({"weight": torch.tensor([1.0, 2.0, 3.0]).double()}, 3),  # N == C: the mask took all
        ({"weight": torch.tensor([1.0, 2.0, 3.0]).double(), "ignore_index": 2}, 3),
        ({"weight": torch.tensor([0.5, 2.0, 3.0]).double()}, 4),  # N != C: an IndexError
    ],
)
def test_uint8_class_targets_index_class_weights(options: dict, n: int, reduction: str):
    """uint8 targets indexed the class weights as a boolean mask: with N == C and no target
    0 every class's weight was taken (sample n got weight[n], not weight[y_n]), silently;
    other batch sizes failed with an IndexError. GGN/Hessian diagonals against autograd."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    model_fn, params = pf.functional(model)
    X = torch.randn(n, 2, dtype=torch.float64)
    y = torch.tensor([1, 2, 1, 2][:n], dtype=torch.uint8)
    loss = nn.CrossEntropyLoss(reduction=reduction, **options)
    ggn, hessian = _autograd_diagonals(model, loss, X, y.long())
    assert_trees_close(pf.diag_ggn(model_fn, params, X, y, loss=loss), ggn)
    assert_trees_close(pf.diag_hessian(model_fn, params, X, y, loss=loss), hessian)
    assert_trees_close(
        pf.diag_ggn(model_fn, params, data=[(X[:2], y[:2]), (X[2:], y[2:])], loss=loss), ggn
    )
    torch.testing.assert_close(mean_normalizer(loss, y), mean_normalizer(loss, y.long()))


def test_every_target_ignored_has_zero_curvature():
    """``reduction='mean'`` with every target ignored: PyTorch's loss is 0/0 = NaN, but its
    gradient and Hessian are 0. The second-order quantities were NaN (0/0 in the scale) and
    the Monte-Carlo ones failed with an IndexError; they are autograd's zeros."""
    torch.manual_seed(0)
    model = _model()
    model_fn, params = pf.functional(model)
    X, y = torch.randn(4, 3, dtype=torch.float64), torch.full((4,), -100)
    loss = nn.CrossEntropyLoss()
    ggn, hessian = _autograd_diagonals(model, loss, X, y)
    assert all(bool((d == 0).all()) for d in (*ggn.values(), *hessian.values()))
    assert_trees_close(pf.diag_ggn(model_fn, params, X, y, loss=loss), ggn)
    assert_trees_close(pf.diag_hessian(model_fn, params, X, y, loss=loss), hessian)
    assert_trees_close(pf.diag_ggn(model_fn, params, X, y, loss=loss, mc_samples=2), ggn)
    assert_trees_close(
        pf.batch_diag_ggn(model_fn, params, X, y, loss=loss)["2.weight"].sum(0), ggn["2.weight"]
    )
    for kronecker in (pf.kflr, pf.kfac):
        factors = kronecker(model_fn, params, X, y, loss=loss)
        for name in params:  # a zero output-side factor: the Kronecker GGN is the zero GGN
            torch.testing.assert_close(factors[name][0], torch.zeros_like(factors[name][0]))


@pytest.mark.parametrize(
    ("loss", "y"),
    [
        (  # class probabilities with a negative entry: the second row's mass is -0.2
            nn.CrossEntropyLoss(reduction="sum"),
            torch.tensor([[0.2, 0.3, 0.5], [-0.5, 0.2, 0.1]]).double(),
        ),
        (
            nn.CrossEntropyLoss(weight=torch.tensor([1.0, -0.5, 2.0]).double(), reduction="sum"),
            torch.tensor([0, 1]),
        ),
        (  # mean: the divisor Σ w[y] = 0.5 > 0 keeps the negative weight negative
            nn.CrossEntropyLoss(weight=torch.tensor([1.0, -0.5, 2.0]).double()),
            torch.tensor([0, 1]),
        ),
    ],
)
def test_cross_entropy_with_negative_mass_is_refused(loss: nn.Module, y: torch.Tensor):
    """A negative target mass makes that position's loss Hessian negative definite: its square
    root was NaN (exact factors) or an IndexError (sampled); it is refused like the
    elementwise losses' negative curvature."""
    torch.manual_seed(0)
    model = nn.Linear(2, 3).double()
    model_fn, params = pf.functional(model)
    X = torch.randn(2, 2, dtype=torch.float64)
    h_out = torch.autograd.functional.hessian(lambda f: loss(f, y), model(X).detach())
    assert torch.linalg.eigvalsh(h_out.reshape(6, 6)).min() < -1e-3  # the oracle: not PSD
    for options in ({}, {"mc_samples": 1}):
        with pytest.raises(ValueError, match="negative curvature"):
            pf.diag_ggn(model_fn, params, X, y, loss=loss, **options)


def test_negative_class_weights_with_a_negative_mean_divisor_are_convex():
    """All-negative class weights with ``reduction='mean'`` divide by a negative sum: the
    loss is a positive weighted mean again, convex, and its GGN diagonal is autograd's."""
    torch.manual_seed(0)
    model = _model()
    model_fn, params = pf.functional(model)
    X, y = torch.randn(5, 3, dtype=torch.float64), _class_targets(5)
    loss = nn.CrossEntropyLoss(weight=-torch.rand(CLASSES).double() - 0.1)
    ggn, _ = _autograd_diagonals(model, loss, X, y)
    assert_trees_close(pf.diag_ggn(model_fn, params, X, y, loss=loss), ggn)


@pytest.mark.parametrize(
    "setting", ["negative weight", "negative pos_weight", "target beyond [0, 1]", "tiny weight"]
)
def test_negative_weights_of_binary_losses_are_refused_for_curvature(setting: str) -> None:
    """BCEWithLogitsLoss's closed-form curvature took the square root of a negative weight:
    NaN in every curvature quantity, silently; BCELoss's small negative weights (1e-7) fell
    under the autodiff path's absolute rounding floor and were clamped to 0 (0.95 off; both
    found by a probe). Refused, as negative cross-entropy weights are."""
    torch.manual_seed(0)
    model_fn, params = pf.functional(nn.Linear(4, 3).double())
    X, y = torch.randn(5, 4, dtype=torch.float64), torch.rand(5, 3, dtype=torch.float64)
    signs = torch.tensor([1.0, -1.0, 1.0], dtype=torch.float64)
    if setting == "negative weight":
        loss: nn.Module = nn.BCEWithLogitsLoss(weight=signs)
    elif setting == "negative pos_weight":
        loss = nn.BCEWithLogitsLoss(pos_weight=signs)
    elif setting == "target beyond [0, 1]":
        loss, y = nn.BCEWithLogitsLoss(pos_weight=torch.full((3,), 0.5).double()), 3 * y + 2.5
    else:
        model_fn, params = pf.functional(nn.Sequential(nn.Linear(4, 3), nn.Sigmoid()).double())
        loss = nn.BCELoss(weight=1e-7 * signs, reduction="sum")
    for quantity in (pf.diag_ggn, pf.diag_hessian, pf.kflr):
        with pytest.raises(ValueError, match="negative"):
            quantity(model_fn, params, X, y, loss=loss)


def test_uint8_class_targets_of_k_dimensional_outputs_are_refused_naming_long() -> None:
    """torch's cross-entropy takes uint8 class indices for [N, C] outputs only; for
    [N, C, d...] (segmentation masks) it raised its own "expected scalar type Long"."""
    model_fn, params = pf.functional(nn.Conv2d(2, 3, 1))
    X, y = torch.randn(2, 2, 3, 3), torch.randint(0, 3, (2, 3, 3), dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"y\.long\(\)"):
        pf.batch_grad(model_fn, params, X, y, loss=nn.CrossEntropyLoss())


@pytest.mark.parametrize("loss", [nn.CrossEntropyLoss(), nn.BCEWithLogitsLoss()])
def test_monte_carlo_draws_of_a_nan_output_read_nan_as_the_exact_path(loss: nn.Module) -> None:
    """A NaN in a sample's input: the categorical draw's inverse cdf found no class (an index
    out of bounds) and Bernoulli's refused its probability (both torch's internal errors; a
    probe); the exact path returns NaN, as autograd. The draws now read NaN too."""
    torch.manual_seed(0)
    model_fn, params = pf.functional(nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 3)))
    X = torch.randn(5, 4)
    X[1, 0] = float("nan")
    y = torch.randint(0, 3, (5,)) if isinstance(loss, nn.CrossEntropyLoss) else torch.rand(5, 3)
    exact = pf.diag_ggn(model_fn, params, X, y, loss=loss)
    drawn = pf.diag_ggn(model_fn, params, X, y, loss=loss, mc_samples=2)
    for name in params:
        assert torch.equal(drawn[name].isnan(), exact[name].isnan())


@pytest.mark.parametrize("mc_samples", [0, True, 2.0])
def test_mc_samples_must_be_a_positive_integer(mc_samples: object) -> None:
    """``True`` was taken as one sample (a probe; the estimators refuse bools)."""
    model_fn, params = pf.functional(nn.Linear(3, 2))
    X, y = torch.randn(4, 3), torch.randint(0, 2, (4,))
    with pytest.raises(ValueError, match="mc_samples must be a positive integer"):
        pf.diag_ggn(model_fn, params, X, y, mc_samples=mc_samples)
