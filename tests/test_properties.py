"""Property tests: random convolution options and random MLPs against autograd loops."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import packfunc as pf
from tests.cases import autograd_batch_grad, moments

SETTINGS = settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
CONVS = {
    (1, False): nn.Conv1d,
    (2, False): nn.Conv2d,
    (3, False): nn.Conv3d,
    (1, True): nn.ConvTranspose1d,
    (2, True): nn.ConvTranspose2d,
    (3, True): nn.ConvTranspose3d,
}


@st.composite
def conv_layers(draw):
    dims = draw(st.sampled_from([1, 2, 3]))
    transposed = draw(st.booleans())
    groups = draw(st.sampled_from([1, 2]))
    channels_in = groups * draw(st.integers(1, 2))
    channels_out = groups * draw(st.integers(1, 2))
    kernel = draw(st.integers(1, 3))
    stride = draw(st.integers(1, 2))
    dilation = draw(st.integers(1, 2))
    kwargs = {"stride": stride, "dilation": dilation, "groups": groups, "bias": draw(st.booleans())}
    if transposed:
        kwargs["padding"] = draw(st.integers(0, (kernel - 1) * dilation // 2))
        kwargs["output_padding"] = draw(st.integers(0, max(stride, dilation) - 1))
    else:
        if stride == 1:
            kwargs["padding"] = draw(st.sampled_from([0, 1, "same", "valid"]))
        else:
            kwargs["padding"] = draw(st.integers(0, 1))
        if kwargs["padding"] not in (0, "valid", "same"):
            kwargs["padding_mode"] = draw(st.sampled_from(["zeros", "reflect", "circular"]))
    size = max(draw(st.integers(3, 5)) if dims < 3 else 3, dilation * (kernel - 1) + 1)
    layer = CONVS[(dims, transposed)](channels_in, channels_out, kernel, **kwargs)
    return layer, (channels_in, *[size] * dims)


@SETTINGS
@given(
    conv=conv_layers(),
    n=st.integers(1, 3),
    double=st.booleans(),
    reduction=st.sampled_from(["mean", "sum"]),
)
def test_random_convolutions(conv, n, double, reduction):
    torch.manual_seed(0)
    layer, shape = conv
    with torch.no_grad():
        features = nn.Flatten()(layer(torch.zeros(1, *shape))).shape[1]
    model = nn.Sequential(layer, nn.Tanh(), nn.Flatten(), nn.Linear(features, 3))
    dtype = torch.float64 if double else torch.float32
    model = model.to(dtype)
    X, y = torch.randn(n, *shape, dtype=dtype), torch.randint(0, 3, (n,))
    loss = nn.CrossEntropyLoss(reduction=reduction)
    expected = moments(autograd_batch_grad(model, loss, X, y))
    model_fn, params = pf.functional(model)
    result = pf.compute(model_fn, params, X, y, loss=loss, quantities=pf.FIRST_ORDER)
    tol = {"rtol": 1e-9, "atol": 1e-11} if double else {"rtol": 2e-4, "atol": 1e-5}
    for quantity in pf.FIRST_ORDER:
        for name in params:
            torch.testing.assert_close(
                result[quantity][name],
                expected[quantity][name],
                **tol,
                msg=lambda m, q=quantity, p=name: f"{layer} {q}/{p}: {m}",
            )


ACTIVATIONS = [nn.ReLU, nn.Tanh, nn.Sigmoid, nn.ELU, nn.GELU]


@SETTINGS
@given(
    widths=st.lists(st.integers(1, 5), min_size=2, max_size=4),
    n=st.integers(1, 4),
    activation=st.sampled_from(ACTIVATIONS),
    bias=st.booleans(),
    loss_name=st.sampled_from(["cross_entropy", "mse", "bce_with_logits"]),
    reduction=st.sampled_from(["mean", "sum"]),
    sequence=st.integers(0, 3),
)
def test_random_mlps(widths, n, activation, bias, loss_name, reduction, sequence):
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for fan_in, fan_out in zip(widths, widths[1:]):
        layers += [nn.Linear(fan_in, fan_out, bias=bias), activation()]
    layers.append(nn.Linear(widths[-1], 3, bias=bias))
    if sequence:
        layers.append(nn.Flatten())  # [N, T, 3] -> [N, 3T]: exercises sequence positions
    model = nn.Sequential(*layers).double()
    shape = (sequence, widths[0]) if sequence else (widths[0],)
    X = torch.randn(n, *shape, dtype=torch.float64)
    with torch.no_grad():
        out = model(X)
    loss = {
        "cross_entropy": nn.CrossEntropyLoss,
        "mse": nn.MSELoss,
        "bce_with_logits": nn.BCEWithLogitsLoss,
    }[loss_name](reduction=reduction)
    y = (
        torch.randint(0, out.shape[1], (n,))
        if loss_name == "cross_entropy"
        else torch.rand_like(out).round()
    )
    expected = moments(autograd_batch_grad(model, loss, X, y))
    model_fn, params = pf.functional(model)
    result = pf.compute(model_fn, params, X, y, loss=loss, quantities=pf.FIRST_ORDER)
    for quantity in pf.FIRST_ORDER:
        for name in params:
            torch.testing.assert_close(result[quantity][name], expected[quantity][name])
