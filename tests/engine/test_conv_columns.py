"""Convolution weight gradients from one grouped convolution, and lazy canonicalization.

Oracles: per-sample autograd loops (one backward per sample and cotangent column)
and the dense per-sample GGN of ``tests.cases.dense_curvature``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tests.cases import autograd_batch_grad, dense_curvature
from torch import Tensor, nn

import packfunc as pf
from packfunc.engine.ops import SIGNATURES, SiteCall
from packfunc.engine.rules import conv as conv_rules
from packfunc.engine.rules.base import Route
from packfunc.engine.rules.conv import ConvWeight, per_sample_weight_gradients, weight_gradient
from packfunc.engine.vocabulary import Statistic

CONVS = (F.conv1d, F.conv2d, F.conv3d)
TRANSPOSED = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)
SIZES = (9, 7, 5)

# (dims, transposed, kernel, stride, padding, dilation, groups)
OPTIONS = [
    (1, False, 3, 1, 0, 1, 1),
    (1, False, 2, 1, "same", 1, 1),  # even kernel: asymmetric 'same' padding
    (1, False, 3, 2, 1, 2, 2),
    (2, False, 3, 1, "same", 2, 1),
    (2, False, 2, 1, "same", 3, 2),  # asymmetric 'same' with dilation and groups
    (2, False, 3, 2, (1, 0), (1, 2), 2),
    (2, False, 1, 1, "valid", 1, 1),
    (3, False, 2, 1, 1, 1, 2),
    (3, False, 3, 2, "valid", 1, 1),
    (1, True, 3, 2, 1, 1, 2),
    (2, True, 2, 2, 0, 2, 1),
    (3, True, 3, 1, 1, 1, 2),
]


def _conv(options: tuple, dtype: torch.dtype) -> tuple[Tensor, Tensor, SiteCall, object]:
    """A random input, weight, the call and the op ``(x, w) -> y`` for ``options``."""
    dims, transposed, kernel, stride, padding, dilation, groups = options
    c_in, c_out = 2 * groups, 3 * groups
    x = torch.randn(4, c_in, *SIZES[:dims], dtype=dtype)
    if transposed:
        output_padding = 1 if stride > 1 else 0
        weight = torch.randn(c_in, c_out // groups, *[kernel] * dims, dtype=dtype)
        settings = {"stride": stride, "padding": padding, "output_padding": output_padding}
        settings |= {"groups": groups, "dilation": dilation}

        def op(inputs: Tensor, w: Tensor) -> Tensor:
            return TRANSPOSED[dims - 1](inputs, w, None, **settings)
    else:
        weight = torch.randn(c_out, c_in // groups, *[kernel] * dims, dtype=dtype)
        settings = {"stride": stride, "padding": padding, "dilation": dilation, "groups": groups}

        def op(inputs: Tensor, w: Tensor) -> Tensor:
            return CONVS[dims - 1](inputs, w, None, **settings)

    sig = SIGNATURES[(TRANSPOSED if transposed else CONVS)[dims - 1]]
    return x, weight, SiteCall(sig, (), tuple(settings.items())), op


def _looped_weight_gradients(x: Tensor, g: Tensor, weight: Tensor, op) -> Tensor:
    """Oracle: ``[K, N, *weight.shape]`` by one autograd backward per column and sample."""
    w = weight.clone().requires_grad_()
    return torch.stack(
        [
            torch.stack(
                [torch.autograd.grad(op(x[n : n + 1], w), w, g[k, n : n + 1])[0] for n in range(N)]
            )
            for k, N in [(k, x.shape[0]) for k in range(g.shape[0])]
        ]
    )


@pytest.mark.parametrize("options", OPTIONS, ids=str)
@pytest.mark.parametrize("columns", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_grouped_convolution_matches_autograd_loop(options, columns, dtype):
    torch.manual_seed(0)
    x, weight, call, op = _conv(options, dtype)
    g = torch.randn(columns, *op(x, weight).shape, dtype=dtype)
    expected = _looped_weight_gradients(x, g, weight, op)
    tol = {} if dtype is torch.float64 else {"rtol": 1e-4, "atol": 1e-5}
    torch.testing.assert_close(per_sample_weight_gradients(x, g, call, weight), expected, **tol)
    torch.testing.assert_close(
        weight_gradient(x, g.sum(0), call, weight.shape), expected.sum((0, 1)), **tol
    )
    one = per_sample_weight_gradients(x[:1], g[:, :1], call, weight)  # N = 1
    torch.testing.assert_close(one, expected[:, :1], **tol)


def test_empty_batch_gives_empty_columns():
    x, weight, call, op = _conv(OPTIONS[0], torch.float64)
    g = torch.randn(2, *op(x, weight).shape, dtype=torch.float64)
    assert per_sample_weight_gradients(x[:0], g[:, :0], call, weight).shape == (2, 0, 3, 2, 3)


def _net(bias: bool, dims: int = 2) -> nn.Module:
    conv = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[dims - 1]
    size = 4 if dims == 3 else 6
    torch.manual_seed(0)
    return nn.Sequential(
        conv(2, 4, 2, padding="same", dilation=2, bias=bias),
        nn.Tanh(),
        conv(4, 4, 3, stride=2, padding=1, groups=2, bias=bias),
        nn.ReLU(),
        nn.Flatten(),
        nn.LazyLinear(3, bias=bias),
    ), (2, *[size] * dims)


def _assert_first_order_matches_the_loop(model: nn.Module, loss: nn.Module, X, y) -> None:
    """``batch_grad`` and ``batch_l2_grad`` against a per-sample autograd loop."""
    expected = autograd_batch_grad(model, loss, X, y)
    model_fn, params = pf.functional(model)
    grads = pf.batch_grad(model_fn, params, X, y, loss=loss)
    norms = pf.batch_l2_grad(model_fn, params, X, y, loss=loss)
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad)
        torch.testing.assert_close(norms[name], grad.flatten(1).square().sum(1))


@pytest.fixture
def no_unfold(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail if a convolution's input is unfolded; the grouped convolution for any channels."""

    def refuse(*args, **kwargs):
        raise AssertionError("the input was unfolded")

    monkeypatch.setattr(conv_rules, "unfold", refuse)
    monkeypatch.setattr(conv_rules, "GROUPED_MIN_CHANNELS", 1)


@pytest.mark.parametrize("dims", [1, 2, 3])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("n", [1, 5])
def test_first_order_without_unfolding(dims, bias, n, no_unfold):
    model, shape = _net(bias, dims)
    X, y = torch.randn(n, *shape), torch.randint(0, 3, (n,))
    model(X)  # materialize the lazy linear layer
    model = model.double()
    X = X.double()
    loss = nn.CrossEntropyLoss()
    _assert_first_order_matches_the_loop(model, loss, X, y)


def test_ggn_columns_and_diagonals_of_a_conv_net():
    """``K = classes`` columns (from one unfolded input): the GGN's root and diagonals."""
    model, shape = _net(True)
    X = torch.randn(3, *shape)
    model(X)
    model, X = model.double(), X.double()
    y = torch.randint(0, 3, (3,))
    loss = nn.CrossEntropyLoss()
    dense = dense_curvature(model, loss, X, y)
    model_fn, params = pf.functional(model)
    roots = pf.sqrt_ggn(model_fn, params, X, y, loss=loss)
    flat = dense.flatten(roots, leading=2)  # [K, N, P]
    torch.testing.assert_close(torch.einsum("knp,knq->npq", flat, flat), dense.sample_ggn)
    diagonals = dense.flatten(pf.batch_diag_ggn(model_fn, params, X, y, loss=loss), leading=1)
    torch.testing.assert_close(diagonals, dense.sample_ggn.diagonal(dim1=1, dim2=2))


def test_shared_convolution_adds_its_calls():
    """One conv applied twice: columns add up over calls, squared norms do not."""
    torch.manual_seed(0)
    conv = nn.Conv2d(2, 2, 3, padding=1)
    model = nn.Sequential(conv, nn.Tanh(), conv, nn.Flatten(), nn.Linear(2 * 25, 3)).double()
    X, y = torch.randn(4, 2, 5, 5, dtype=torch.float64), torch.randint(0, 3, (4,))
    loss = nn.CrossEntropyLoss(reduction="sum")
    _assert_first_order_matches_the_loop(model, loss, X, y)


def test_squared_norms_take_the_cheaper_route():
    """Gram form for few positions and many channels; materialized columns otherwise."""
    rule, call = ConvWeight(), SiteCall(SIGNATURES[torch.conv2d], (), (("groups", 1),))
    wide = torch.empty(64, 64, 3, 3)
    few = rule.route(
        Statistic.SQUARED_NORMS, torch.empty(2, 64, 4, 4), torch.empty(1, 2, 64, 2, 2), call, wide
    )
    narrow = torch.empty(16, 16, 3, 3)
    many = rule.route(
        Statistic.SQUARED_NORMS,
        torch.empty(2, 16, 32, 32),
        torch.empty(1, 2, 16, 32, 32),
        call,
        narrow,
    )
    assert (few, many) == (Route.CANONICAL, Route.MATERIALIZED)


def test_columns_come_from_the_grouped_convolution_for_one_column_and_enough_channels():
    rule, call = ConvWeight(), SiteCall(SIGNATURES[torch.conv2d], (), (("groups", 1),))
    x, one, three = torch.empty(2, 8, 6, 6), torch.empty(1, 2, 8, 6, 6), torch.empty(3, 2, 8, 6, 6)
    routes = [
        rule.route(Statistic.COLUMNS, x, one, call, torch.empty(8, 8, 3, 3)),
        rule.route(Statistic.COLUMNS, x[:, :3], one, call, torch.empty(8, 3, 3, 3)),  # RGB stem
        rule.route(Statistic.COLUMNS, x, three, call, torch.empty(8, 8, 3, 3)),  # K = 3
        rule.route(Statistic.SUM, x, three, call, torch.empty(8, 8, 3, 3)),
    ]
    assert routes == [Route.CALL, Route.CANONICAL, Route.CANONICAL, Route.CALL]


def test_an_rgb_stem_takes_the_grouped_convolution_once_its_unfolded_input_is_large():
    """Past the CPU limit the stem's columns come from the grouped convolution, not unfolding."""
    rule, call = ConvWeight(), SiteCall(SIGNATURES[torch.conv2d], (), (("groups", 1),))
    stem = torch.empty(16, 3, 3, 3)

    def stem_route(n: int) -> Route:
        x, g = torch.empty(n, 3, 32, 32), torch.empty(1, n, 16, 32, 32)
        return rule.route(Statistic.COLUMNS, x, g, call, stem)

    # 27 · 1024 float32 elements unfolded per sample: 108 KiB; 32 MiB at N = 303.4
    assert (stem_route(303), stem_route(304)) == (Route.CANONICAL, Route.CALL)
    transposed = SiteCall(SIGNATURES[torch.conv_transpose2d], (), (("groups", 1),))
    x, g = torch.empty(4096, 3, 32, 32), torch.empty(1, 4096, 3, 34, 34)
    assert rule.route(Statistic.COLUMNS, x, g, transposed, stem) == Route.CANONICAL


def test_a_large_stem_matches_the_loop_without_unfolding(no_unfold, monkeypatch):
    """The grouped route for few channels, chosen by size alone, against the autograd loop."""
    monkeypatch.setattr(conv_rules, "GROUPED_MIN_CHANNELS", 8)
    monkeypatch.setattr(conv_rules, "UNFOLD_CPU_LIMIT_BYTES", 0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Flatten(), nn.Linear(4 * 25, 3))
    X, y = torch.randn(4, 3, 5, 5, dtype=torch.float64), torch.randint(0, 3, (4,))
    _assert_first_order_matches_the_loop(model.double(), nn.CrossEntropyLoss(), X, y)


def test_gram_route_matches_autograd_loop():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(16, 16, 3), nn.Flatten(), nn.Linear(16 * 4, 3)).double()
    X, y = torch.randn(3, 16, 4, 4, dtype=torch.float64), torch.randint(0, 3, (3,))
    loss = nn.CrossEntropyLoss()
    expected = autograd_batch_grad(model, loss, X, y)
    model_fn, params = pf.functional(model)
    norms = pf.batch_l2_grad(model_fn, params, X, y, loss=loss)
    torch.testing.assert_close(norms["0.weight"], expected["0.weight"].flatten(1).square().sum(1))


@pytest.mark.parametrize("options", [o for o in OPTIONS if o[1] or o[2] > 1], ids=str)
@pytest.mark.parametrize("approx", ["sum", "expand", "reduce"])
@pytest.mark.parametrize("samples", [1, 4])
@pytest.mark.parametrize("im2col", [False, True])
def test_kronecker_factors_unfolded_in_chunks_equal_those_of_the_whole_unfolded_input(
    options, approx, samples, im2col, monkeypatch
):
    """KFAC's factors of a convolution (issue 23): the input unfolded a few samples at a
    time (with one group straight into one product's layout ``[C·k, samples·L]``; one
    sample by ``F.unfold`` where that is faster, on a GPU) and the output factor taken
    once give the factors of the input unfolded at once; a transposed convolution's, its
    input unfolded per output position in chunks, those of its whole ``kronecker_layout``."""
    torch.manual_seed(0)
    monkeypatch.setattr(conv_rules, "im2col_is_faster", lambda x: im2col)
    x, weight, call, op = _conv(options, torch.float64)
    x = x[:samples]
    g = torch.randn(2, *op(x, weight).shape, dtype=torch.float64)
    rule = ConvWeight()
    assert rule.kronecker_factors_unfold(x, g, call, weight)
    layout = rule.kronecker_layout(x, g, call, weight) or rule.canonical(x, g, call, weight)
    output, inputs = rule.unfolded_kronecker_factors(x, g, call, weight, approx)
    torch.testing.assert_close(output, rule.output_factor(layout[1], approx))
    torch.testing.assert_close(inputs, rule.input_factor(layout[0], approx))


def test_the_kronecker_factors_of_a_convolution_unfold_a_few_samples_at_a_time(monkeypatch):
    """The chunks hold no more of the unfolded input than the input's own size, and with
    one group each is one copy into the product's layout (no per-sample products)."""
    x, weight, call, op = _conv(OPTIONS[3], torch.float64)  # 2-d, one group, 3×3 kernel
    x = x.repeat(8, 1, 1, 1)  # 32 samples: 3 make up the input's size once unfolded
    g = torch.randn(1, *op(x, weight).shape, dtype=torch.float64)
    unfolded_sizes: list[int] = []
    unfold = conv_rules.unfold

    def spy(*args, **kwargs):
        found = unfold(*args, **kwargs)
        unfolded_sizes.append(found.numel())
        assert found.dim() == 2  # [C·k, samples·L]
        return found

    monkeypatch.setattr(conv_rules, "unfold", spy)
    ConvWeight().unfolded_kronecker_factors(x, g, call, weight, "sum")
    assert len(unfolded_sizes) == 11  # ceil(32 / 3)
    assert max(unfolded_sizes) <= x.numel()


@pytest.mark.parametrize("options", [o for o in OPTIONS if not o[1]], ids=str)
def test_one_sample_unfolded_by_im2col_equals_the_strided_unfold(options):
    """``F.unfold`` of one sample (one launch on a GPU) gives :func:`unfold`'s ``[C·K, L]``
    for 2-D convolutions with symmetric padding, and is not taken for the others."""
    x, weight, call, op = _conv(options, torch.float64)
    one = x[:1]
    found = conv_rules.one_sample_unfolded(one, call, weight)
    expected = conv_rules._unfold_for(
        one, call, weight, list(op(one, weight).shape[2:]), samples_inner=True
    )
    if options[0] != 2 or (options[4] == "same" and options[2] % 2 == 0):  # (odd d·(k-1))
        assert found is None
    else:
        torch.testing.assert_close(found, expected, rtol=0, atol=0)
    assert conv_rules.one_sample_unfolded(x[:2], call, weight) is None


def test_kfac_of_a_transposed_convolution_unfolds_a_few_samples_at_a_time(monkeypatch):
    """Issue 23: KFAC of a transposed convolution held its whole batch's input unfolded per
    output position (at N=256 a peak of 196 MiB against a plain backward's 22.5: 144 entries
    per output position of a 16-channel 3×3 stride-2 layer); now no more samples at a time
    than make up the input's own size (here one: a sample's 2,916 entries against the batch's
    1,600), with the factors of the whole layout (above) and BackPACK's
    (tests/test_kronecker.py)."""
    torch.manual_seed(0)
    layer = nn.ConvTranspose2d(4, 3, 3, stride=2, padding=1)
    model = nn.Sequential(layer, nn.ReLU(), nn.Flatten(), nn.Linear(3 * 9 * 9, 2)).double()
    X, y = torch.randn(16, 4, 5, 5, dtype=torch.float64), torch.randint(0, 2, (16,))
    samples: list[int] = []
    unfold_transposed = conv_rules.unfold_transposed

    def spy(x, *args, **kwargs):
        samples.append(x.shape[0])
        return unfold_transposed(x, *args, **kwargs)

    monkeypatch.setattr(conv_rules, "unfold_transposed", spy)
    model_fn, params = pf.functional(model)
    pf.kfac(model_fn, params, X, y, loss=nn.CrossEntropyLoss())
    assert samples == [1] * 16
