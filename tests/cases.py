"""Shared test cases: models, losses and autograd oracles, reused by every test module."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.functional import hessian, jacobian
from torch.nn.attention import SDPBackend, sdpa_kernel

# ----------------------------------------------------------------------------- models


class Residual(nn.Module):
    """Two linear layers with a skip connection."""

    def __init__(self, width: int = 4):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))

    def forward(self, x: Tensor) -> Tensor:
        return x + self.inner(x)


class SharedLayer(nn.Module):
    """The same Linear applied twice (weight sharing)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(3, 4)
        self.shared = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.shared(torch.tanh(self.inp(x))))
        return self.out(torch.tanh(self.shared(h)))


class SharedSubmodule(nn.Module):
    """One Linear registered at two paths (``Sequential(layer, act, layer)``): one slot."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(3, 4)
        layer = nn.Linear(4, 4)
        self.body = nn.Sequential(layer, nn.Tanh(), layer)
        self.out = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(torch.tanh(self.body(torch.tanh(self.inp(x)))))


class RawParameter(nn.Module):
    """A raw nn.Parameter used in a matmul, plus a Linear."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 4) / 2)
        self.head = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.sigmoid(x @ self.w))


class LinearSolve(nn.Module):
    """``A⁻¹ x`` for a learned matrix ``A`` (``torch.linalg.solve``), then a Linear.

    torch's batching rule of its backward fails under ``vmap`` for one sample's
    right-hand side ``[1, 3, 1]`` (a shape error): packfunc loops there instead.
    """

    def __init__(self):
        super().__init__()
        self.A = nn.Parameter(2 * torch.eye(3) + torch.randn(3, 3) / 4)
        self.head = nn.Linear(3, 2)

    def forward(self, x: Tensor) -> Tensor:
        solved = torch.linalg.solve(self.A, x.unsqueeze(-1)).squeeze(-1)
        return self.head(torch.tanh(solved))


class Scale(nn.Module):
    """A custom module nothing knows about: elementwise scale and shift."""

    def __init__(self, width: int):
        super().__init__()
        self.scale = nn.Parameter(torch.rand(width) + 0.5)
        self.shift = nn.Parameter(torch.randn(width) / 4)

    def forward(self, x: Tensor) -> Tensor:
        return x * self.scale + self.shift**2


class TransposedUse(nn.Module):
    """A Linear weight reused transposed: half tapped, half not (tied autoencoder)."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(torch.tanh(self.enc(x)), self.enc.weight.t())


class TiedEmbedding(nn.Module):
    """Embedding whose weight is reused as the output projection (weight tying)."""

    def __init__(self, vocab: int = 7, width: int = 4):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.mix = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.mix(self.emb(x))).mean(1)
        return F.linear(h, self.emb.weight)


class RecurrentHead(nn.Module):
    """A recurrent layer followed by a linear head on the last time step."""

    def __init__(self, cell: type[nn.RNNBase], **kwargs):
        super().__init__()
        self.rnn = cell(3, 4, batch_first=True, **kwargs)
        width = 4 * (2 if kwargs.get("bidirectional") else 1)
        self.head = nn.Linear(width, 2)

    def forward(self, x: Tensor) -> Tensor:
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


class PackedTagger(nn.Module):
    """Embedded tokens packed by their lengths (token 0 pads the end) for a bidirectional LSTM.

    ``pack_padded_sequence`` in the forward, as RNN code for ragged batches does: the
    packed data has no sample dim and each sample's length is its own.
    """

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(6, 3, padding_idx=0)
        self.rnn = nn.LSTM(3, 4, batch_first=True, bidirectional=True)
        self.head = nn.Linear(8, 3)

    def forward(self, tokens: Tensor) -> Tensor:
        lengths = (tokens != 0).sum(1).cpu()
        packed = nn.utils.rnn.pack_padded_sequence(
            self.embed(tokens), lengths, batch_first=True, enforce_sorted=False
        )
        _, (h, _) = self.rnn(packed)
        return self.head(torch.cat([h[-2], h[-1]], 1))


def ragged_tokens(n: int) -> Tensor:
    tokens = torch.randint(1, 6, (n, 5))
    lengths = 1 + (3 * torch.arange(n)) % 5  # 1, 4, 2, 5, 3, ...
    tokens[torch.arange(5) >= lengths[:, None]] = 0
    return tokens


class LearnedInitialState(nn.Module):
    """A GRU whose initial state is a parameter copied over the batch.

    With ``deep``: a 2-layer bidirectional LSTM whose states ``[L·D, 1, H]`` are copied
    along dim 1, the batch's dim for ``hx`` (each layer's state selected from it); its hidden
    size is 3, not 4 (its dense Hessian oracle is the suite's slowest).
    """

    def __init__(self, deep: bool = False):
        super().__init__()
        self.deep = deep
        self.hidden = 3 if deep else 4
        if deep:
            self.rnn: nn.RNNBase = nn.LSTM(3, 3, num_layers=2, bidirectional=True, batch_first=True)
            self.c0 = nn.Parameter(0.5 * torch.randn(4, 1, 3))
        else:
            self.rnn = nn.GRU(3, 4, batch_first=True)
        self.h0 = nn.Parameter(0.5 * torch.randn(4 if deep else 1, 1, self.hidden))
        self.head = nn.Linear(2 * self.hidden if deep else 4, 2)

    def forward(self, x: Tensor) -> Tensor:
        h0 = self.h0.expand(-1, x.shape[0], self.hidden).contiguous()
        if self.deep:
            out, _ = self.rnn(x, (h0, self.c0.expand(-1, x.shape[0], self.hidden).contiguous()))
        else:
            out, _ = self.rnn(x, h0)
        return self.head(out[:, -1])


class UnrolledCells(nn.Module):
    """``nn.LSTMCell`` unrolled from a zero state, then a ``GRUCell`` and an ``RNNCell`` step."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTMCell(3, 4)
        self.gru = nn.GRUCell(4, 3)
        self.rnn = nn.RNNCell(3, 3, nonlinearity="relu")
        self.head = nn.Linear(3, 2)

    def forward(self, x: Tensor) -> Tensor:
        state = None
        for step in x.unbind(1):
            state = self.lstm(step, state)
        h = self.gru(state[0])
        return self.head(self.rnn(h, h))


class TransformerBlock(nn.Module):
    """Pre-norm self-attention and MLP block with a mean-pooled classifier."""

    def __init__(self, width: int = 8, heads: int = 2, batch_first: bool = True):
        super().__init__()
        self.batch_first = batch_first
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=batch_first)
        self.mlp = nn.Sequential(
            nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)
        )
        self.head = nn.Linear(width, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm1(x)
        if not self.batch_first:
            h = h.transpose(0, 1)
        a, _ = self.attn(h, h, h, need_weights=False)
        if not self.batch_first:
            a = a.transpose(0, 1)
        x = x + a
        x = x + self.mlp(self.norm2(x))
        return self.head(x.mean(1))


class NormsAndScales(nn.Module):
    """InstanceNorm and RMSNorm affine parameters, a learned temperature and a free bias."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(2, 3, 3)
        self.instance = nn.InstanceNorm1d(3, affine=True)
        self.rms = nn.RMSNorm(9)
        self.head = nn.Linear(9, 2)
        self.log_temperature = nn.Parameter(torch.tensor(0.3))
        self.shift = nn.Parameter(torch.randn(2))

    def forward(self, x: Tensor) -> Tensor:
        h = self.rms(self.instance(self.conv(x)).flatten(1))
        return self.head(h) / self.log_temperature.exp() + self.shift


class VisionTransformer(nn.Module):
    """Class token copied over the batch, a sliced positional embedding, a pre-norm encoder."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.embed = nn.Linear(3, width)
        self.cls = nn.Parameter(torch.randn(1, 1, width))
        self.pos = nn.Parameter(torch.randn(10, width) / 2)
        self.encoder = nn.TransformerEncoderLayer(
            width, 2, 16, dropout=0.0, batch_first=True, norm_first=True
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.cat([self.cls.expand(x.shape[0], -1, -1), self.embed(x)], dim=1)
        h = self.encoder(h + self.pos[: x.shape[1] + 1])
        return self.head(self.norm(h[:, 0]))


class MaskedAttention(nn.Module):
    """Sequence-first attention with causal and padding masks and key/value biases, then
    hand-written attention (``F.scaled_dot_product_attention``) on a raw query matrix."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.embed = nn.Embedding(6, width, padding_idx=0)
        self.attn = nn.MultiheadAttention(width, 2, add_bias_kv=True)
        self.query = nn.Parameter(torch.randn(width, width) / width**0.5)
        self.key = nn.Linear(width, width, bias=False)
        self.head = nn.Linear(width, 3)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.embed(tokens)
        length = tokens.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool, device=tokens.device).triu(1)
        seq = h.transpose(0, 1)
        a, _ = self.attn(seq, seq, seq, attn_mask=causal, key_padding_mask=tokens == 0)
        h = h + a.transpose(0, 1)
        q, k = (h @ self.query).unsqueeze(1), self.key(h).unsqueeze(1)
        h = nn.functional.scaled_dot_product_attention(q, k, h.unsqueeze(1), is_causal=True)
        return self.head(h.squeeze(1).mean(1))


def _padded_tokens(n: int) -> Tensor:
    tokens = torch.randint(1, 6, (n, 5))
    tokens[::2, -1] = 0  # padding at the end of every other sequence
    return tokens


@dataclass
class Case:
    """A model with an input generator; ``slow`` marks cases whose dense oracles are heavy."""

    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[int], Tensor]
    classes: int = 2
    spatial: tuple[int, ...] = ()
    slow: bool = False


def _randn(*shape: int) -> Callable[[int], Tensor]:
    return lambda n: torch.randn(n, *shape)


def _tokens(vocab: int, length: int) -> Callable[[int], Tensor]:
    return lambda n: torch.randint(0, vocab, (n, length))


CASES: dict[str, Case] = {
    case.name: case
    for case in [
        Case("mlp", lambda: nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)), _randn(3)),
        Case(
            "conv1d",
            lambda: nn.Sequential(
                nn.Conv1d(2, 4, 3, stride=2, padding=1, dilation=1, groups=2),
                nn.Tanh(),
                nn.Flatten(),
                nn.Linear(4 * 4, 2),
            ),
            _randn(2, 8),
        ),
        Case(
            "conv2d",
            lambda: nn.Sequential(
                nn.Conv2d(2, 4, 3, padding="same", dilation=2),
                nn.ReLU(),
                nn.MaxPool2d(2),
                nn.Flatten(),
                nn.Linear(4 * 2 * 2, 2),
            ),
            _randn(2, 5, 5),
        ),
        Case(
            "conv3d",
            lambda: nn.Sequential(
                nn.Conv3d(1, 2, 2, stride=(1, 2, 1), padding_mode="circular", padding=1),
                nn.Tanh(),
                nn.Flatten(),
                nn.Linear(2 * 4 * 2 * 4, 2),
            ),
            _randn(1, 3, 3, 3),
            slow=True,
        ),
        Case(
            "convtranspose1d",
            lambda: nn.Sequential(
                nn.ConvTranspose1d(4, 2, 3, stride=2, padding=1, output_padding=1, groups=2),
                nn.Tanh(),
                nn.Flatten(),
                nn.Linear(2 * 6, 2),
            ),
            _randn(4, 3),
        ),
        Case(
            "convtranspose2d",
            lambda: nn.Sequential(
                nn.ConvTranspose2d(2, 3, 2, stride=2, dilation=1),
                nn.Sigmoid(),
                nn.Flatten(),
                nn.Linear(3 * 4 * 4, 2),
            ),
            _randn(2, 2, 2),
        ),
        Case(
            "convtranspose3d",
            lambda: nn.Sequential(
                nn.ConvTranspose3d(1, 2, 2, dilation=2, bias=False),
                nn.Tanh(),
                nn.Flatten(),
                nn.Linear(2 * 4 * 4 * 4, 2),
            ),
            _randn(1, 2, 2, 2),
        ),
        Case(
            "embedding",
            lambda: nn.Sequential(
                nn.Embedding(6, 3, padding_idx=1), nn.Flatten(), nn.Linear(3 * 4, 2)
            ),
            _tokens(6, 4),
        ),
        Case("batchnorm_eval", lambda: _eval_batchnorm(), _randn(2, 4, 4)),
        Case(  # a slope per channel, then one for all (torch's nested prelu rules were wrong)
            "prelu",
            lambda: nn.Sequential(
                nn.Linear(3, 4), nn.PReLU(4), nn.Linear(4, 3), nn.PReLU(), nn.Linear(3, 2)
            ),
            _randn(3),
        ),
        Case(
            "layernorm_groupnorm",
            lambda: nn.Sequential(
                nn.Conv1d(2, 4, 3),
                nn.GroupNorm(2, 4),
                nn.Flatten(),
                nn.LayerNorm(12),
                nn.Linear(12, 2),
            ),
            _randn(2, 5),
        ),
        Case(
            "residual",
            lambda: nn.Sequential(nn.Linear(3, 4), Residual(4), nn.Linear(4, 2)),
            _randn(3),
        ),
        Case("shared_layer", SharedLayer, _randn(3)),
        Case("shared_submodule", SharedSubmodule, _randn(3)),
        Case("raw_parameter", RawParameter, _randn(3)),
        Case("linear_solve", LinearSolve, _randn(3)),
        Case(
            "custom_module",
            lambda: nn.Sequential(nn.Linear(3, 4), Scale(4), nn.Tanh(), nn.Linear(4, 2)),
            _randn(3),
        ),
        Case("transposed_use", TransposedUse, _randn(4), classes=4),
        Case("tied_embedding", TiedEmbedding, _tokens(7, 3), classes=7),
        Case("rnn", lambda: RecurrentHead(nn.RNN, num_layers=2), _randn(5, 3)),
        Case("gru", lambda: RecurrentHead(nn.GRU, bidirectional=True), _randn(4, 3), slow=True),
        Case("lstm", lambda: RecurrentHead(nn.LSTM), _randn(4, 3)),
        Case("recurrent_cells", UnrolledCells, _randn(3, 3)),
        Case("packed_sequences", PackedTagger, ragged_tokens, classes=3, slow=True),
        Case("learned_initial_state", LearnedInitialState, _randn(3, 3)),
        Case(
            "learned_initial_state_deep",
            lambda: LearnedInitialState(deep=True),
            _randn(2, 3),
            slow=True,
        ),
        Case("transformer", TransformerBlock, _randn(5, 8), classes=3, slow=True),
        Case(
            "transformer_seq_first",
            lambda: TransformerBlock(batch_first=False),
            _randn(5, 8),
            classes=3,
            slow=True,
        ),
        Case("norms_and_scales", NormsAndScales, _randn(2, 5)),
        Case("vision_transformer", VisionTransformer, _randn(4, 3), classes=3, slow=True),
        Case("masked_attention", MaskedAttention, _padded_tokens, classes=3, slow=True),
        Case(
            "spatial_output",
            lambda: nn.Sequential(nn.Conv2d(2, 3, 3, padding=1)),
            _randn(2, 3, 4),
            classes=3,
            spatial=(3, 4),
        ),
    ]
}
"""Every model, by name: the ``case`` fixture (tests/conftest.py) runs a test on each."""


def _eval_batchnorm() -> nn.Module:
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 2 * 2, 2)
    )
    with torch.no_grad():
        model[1].running_mean.uniform_(-1, 1)
        model[1].running_var.uniform_(0.5, 2)
    return model.eval()


# ----------------------------------------------------------------------------- losses

LOSSES = ["cross_entropy", "nll", "mse", "bce_with_logits"]


def make_loss(name: str, reduction: str) -> nn.Module:
    """A loss module by name."""
    return {
        "cross_entropy": nn.CrossEntropyLoss,
        "nll": nn.NLLLoss,
        "mse": nn.MSELoss,
        "bce_with_logits": nn.BCEWithLogitsLoss,
    }[name](reduction=reduction)


def wrap_for_loss(model: nn.Module, loss_name: str) -> nn.Module:
    """NLLLoss expects log-probabilities: append a LogSoftmax over classes."""
    return nn.Sequential(model, nn.LogSoftmax(dim=1)) if loss_name == "nll" else model


def make_targets(loss_name: str, output: Tensor, classes: int) -> Tensor:
    """Targets matching the loss and the model output."""
    n = output.shape[0]
    if loss_name in ("cross_entropy", "nll"):
        return torch.randint(0, classes, (n, *output.shape[2:]))
    if loss_name == "bce_with_logits":
        return torch.rand_like(output).round()
    return torch.randn_like(output)


def loss_and_targets(
    model: nn.Module, X: Tensor, loss_cls: type, reduction: str
) -> tuple[nn.Module, Tensor]:
    """A ``loss_cls(reduction=...)`` and random targets for ``model``'s output on ``X``.

    Class indices over the output's classes for ``CrossEntropyLoss``, Gaussian
    regression targets shaped like the output otherwise.
    """
    with torch.no_grad():
        out = model(X)
    y = (
        torch.randint(0, out.shape[1], (out.shape[0],))
        if loss_cls is nn.CrossEntropyLoss
        else torch.randn_like(out)
    )
    return loss_cls(reduction=reduction), y


# ----------------------------------------------------------------------------- problems


@dataclass
class Problem:
    """A float64 model, a loss and a batch; ``key`` identifies it for the dense-oracle cache."""

    model: nn.Module
    loss: nn.Module
    X: Tensor
    y: Tensor
    key: tuple | None = None

    def functional(self) -> tuple[Callable, dict[str, Tensor]]:
        """``packfunc.functional`` of the model."""
        import packfunc

        return packfunc.functional(self.model)

    def dense(self) -> Dense:
        """The dense GGN and Hessian (cached per ``key``: read, never modify)."""
        if self.key is None:
            return dense_curvature(self.model, self.loss, self.X, self.y)
        return _cached_dense(self.key)


def make_problem(
    case: Case | str,
    loss_name: str = "cross_entropy",
    reduction: str = "mean",
    n: int = 3,
    seed: int = 0,
) -> Problem:
    """The one setup of every case-based test: ``case``'s model in float64, a loss, a batch.

    ``NLLLoss`` gets a ``LogSoftmax`` appended; regression targets are float64, class
    targets integers. The same arguments always give the same problem.
    """
    case = CASES[case] if isinstance(case, str) else case
    torch.manual_seed(seed)
    model = wrap_for_loss(case.build(), loss_name).double()
    X = case.inputs(n)
    X = X.double() if X.is_floating_point() else X
    with torch.no_grad():
        y = make_targets(loss_name, model(X), case.classes)
    y = y.long() if loss_name in ("cross_entropy", "nll") else y.double()
    return Problem(
        model, make_loss(loss_name, reduction), X, y, key=(case.name, loss_name, reduction, n, seed)
    )


def assert_trees_close(actual, expected, what: str = "", **tolerances) -> None:
    """The comparison helper: equal structure, shapes and values, leaf by leaf.

    ``actual`` and ``expected`` are tensors or (nested) dicts, lists and tuples of
    them; ``tolerances`` go to ``torch.testing.assert_close``.
    """
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys(), what
        for name in expected:
            assert_trees_close(actual[name], expected[name], f"{what}[{name}]", **tolerances)
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), what
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_trees_close(a, e, f"{what}[{i}]", **tolerances)
    else:
        assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
        torch.testing.assert_close(
            actual, expected, **tolerances, msg=lambda message: f"{what}: {message}"
        )


# ----------------------------------------------------------------------------- oracles


def autograd_batch_grad(
    model: nn.Module, loss: nn.Module, X: Tensor, y: Tensor
) -> dict[str, Tensor]:
    """Per-sample gradients by an autograd loop over samples.

    Sample n's share of the reduced loss is obtained by letting only row n of
    the output depend on the parameters (a fresh forward of sample n alone)
    while the other rows are constants; by additivity of the loss over samples
    its gradient is sample n's term's gradient, whatever the reduction and the
    loss options.
    """
    params = dict(model.named_parameters())
    with torch.no_grad():
        full = model(X)
    grads: dict[str, list[Tensor]] = {name: [] for name in params}
    for n in range(X.shape[0]):
        rows = list(full.detach().unbind(0))
        rows[n] = model(X[n : n + 1])[0]
        value = loss(torch.stack(rows), y)
        found = torch.autograd.grad(value, list(params.values()), allow_unused=True)
        for name, g, p in zip(params, found, params.values()):
            grads[name].append(torch.zeros_like(p) if g is None else g)
    return {name: torch.stack(g) for name, g in grads.items()}


def assert_batch_grad_is_a_loop(model_fn, params: dict[str, Tensor], X: Any, y: Tensor) -> None:
    """``pf.batch_grad`` of a summed cross-entropy equals ``torch.func.grad`` of each sample
    alone (a model function of a parameter dict; inputs a tensor or a pytree; float64)."""
    import packfunc as pf
    from packfunc.functionalize import select_samples

    loss = nn.CrossEntropyLoss(reduction="sum")
    found = pf.batch_grad(model_fn, params, X, y, loss=loss)
    for n in range(len(y)):
        one = torch.func.grad(lambda p, x, t: loss(model_fn(p, x), t))(
            params, select_samples(X, slice(n, n + 1)), y[n : n + 1]
        )
        for key in params:
            torch.testing.assert_close(found[key][n], one[key])


def moments(batch: dict[str, Tensor]) -> dict[str, dict[str, Tensor]]:
    """All first-order quantities from per-sample gradients, by their definitions."""
    return {
        "batch_grad": batch,
        "grad": {k: v.sum(0) for k, v in batch.items()},
        "batch_l2_grad": {k: v.reshape(len(v), -1).square().sum(1) for k, v in batch.items()},
        "sum_grad_squared": {k: v.square().sum(0) for k, v in batch.items()},
        "variance": {k: v.square().mean(0) - v.mean(0).square() for k, v in batch.items()},
    }


# ----------------------------------------------------------------------------- dense curvature


@dataclass
class Dense:
    """Dense curvature matrices over all parameters, flattened in ``named_parameters`` order."""

    ggn: Tensor
    sample_ggn: Tensor
    hessian: Tensor
    sample_hessian: Tensor
    names: list[str]
    shapes: list[torch.Size]

    def flatten(self, tree: dict[str, Tensor], leading: int = 0) -> Tensor:
        """Concatenate a result pytree's leaves (with ``leading`` batch dims kept)."""
        parts = [tree[name].reshape(*tree[name].shape[:leading], -1) for name in self.names]
        return torch.cat(parts, dim=-1)


def dense_curvature(model: nn.Module, loss: nn.Module, X: Tensor, y: Tensor) -> Dense:
    """GGN and Hessian of the reduced loss, and of each sample's share, by autograd loops.

    Deliberately not ``torch.func.jacrev``/``hessian``: their vmap-based rows are
    wrong for ``nn.MultiheadAttention`` in torch 2.13 (an asymmetric Hessian that
    finite differences contradict), so the oracle uses one backward pass per row.
    """
    names = [name for name, _ in model.named_parameters()]
    shapes = [p.shape for _, p in model.named_parameters()]
    flat0 = torch.cat([p.detach().reshape(-1) for _, p in model.named_parameters()])

    def unflatten(flat: Tensor) -> dict[str, Tensor]:
        return dict(
            zip(names, [t.view(s) for t, s in zip(flat.split([s.numel() for s in shapes]), shapes)])
        )

    def output(flat: Tensor, inputs: Tensor) -> Tensor:
        return torch.func.functional_call(model, unflatten(flat), (inputs,))

    with torch.no_grad():
        full = output(flat0, X)
    n = X.shape[0]
    jac = jacobian(lambda flat: output(flat, X), flat0, vectorize=False)
    jac = jac.reshape(n, -1, flat0.numel())  # [N, O, P]
    h_out = hessian(lambda o: loss(o, y), full).reshape(n, full[0].numel(), n, -1)
    blocks = torch.stack([h_out[i, :, i] for i in range(n)])  # [N, O, O]
    sample_ggn = torch.einsum("nop,noq,nqr->npr", jac, blocks, jac)

    def share(flat: Tensor, i: int) -> Tensor:
        rows = list(full.unbind(0))
        rows[i] = output(flat, X[i : i + 1])[0]
        return loss(torch.stack(rows), y)

    with sdpa_kernel([SDPBackend.MATH]):  # CPU flash attention has no second derivatives
        sample_hessian = torch.stack(
            [hessian(lambda flat, i=i: share(flat, i), flat0) for i in range(n)]
        )
    # the reduced loss is the sum of the samples' shares (each row a function of its sample
    # alone, the others held), so its Hessian is theirs summed: one pass per parameter less
    full_hessian = sample_hessian.sum(0)
    return Dense(sample_ggn.sum(0), sample_ggn, full_hessian, sample_hessian, names, shapes)


@functools.cache
def _cached_dense(key: tuple) -> Dense:
    """Dense curvature of ``make_problem(*key)``: several tests share the heavy oracles.

    A mean's is the sum's scaled by the ratio of the two losses at the model's output:
    every PyTorch loss's mean is its sum over a count fixed by the targets (samples,
    elements, the weights of the targets' classes), so its curvature is the sum's times
    that ratio, and the problem (model, batch, targets) does not depend on the reduction.
    """
    case, loss_name, reduction, n, seed = key
    with torch.random.fork_rng():  # a cache hit or miss leaves the caller's random stream alone
        problem = make_problem(*key)
        if reduction != "mean":
            return dense_curvature(problem.model, problem.loss, problem.X, problem.y)
        summed = _cached_dense((case, loss_name, "sum", n, seed))
        with torch.no_grad():
            output = problem.model(problem.X)
            total = make_loss(loss_name, "sum")(output, problem.y)
            scale = problem.loss(output, problem.y) / total
        assert total.abs() > 1e-6, "the loss ratio needs a sum away from zero"
        return Dense(
            summed.ggn * scale,
            summed.sample_ggn * scale,
            summed.hessian * scale,
            summed.sample_hessian * scale,
            summed.names,
            summed.shapes,
        )


# ----------------------------------------------------------------------------- BackPACK runs


def run_backward_with(
    package, extensions: list, model: nn.Module, loss: nn.Module, X: Tensor, y: Tensor
) -> nn.Module:
    """Extend copies of ``model`` and ``loss`` with ``package`` (``backpack`` or
    ``packfunc.compat``), run one backward under ``extensions``; return the model copy."""
    model, loss = _unextended_copy(model), _unextended_copy(loss)
    model, loss = package.extend(model), package.extend(loss)
    default = torch.get_default_dtype()
    torch.set_default_dtype(X.dtype if X.is_floating_point() else default)  # BackPACK samples
    try:  # Monte-Carlo targets in this dtype
        value = loss(model(X), y)
        with package.backpack(*extensions):
            value.backward()
    finally:
        torch.set_default_dtype(default)
    return model


def _unextended_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` without the hooks ``packfunc.compat.extend`` installed."""
    module = copy.deepcopy(module)
    for sub in module.modules():
        if sub.__dict__.pop("_packfunc_extended", False):
            for hooks in (sub._forward_pre_hooks, sub._forward_hooks):
                for key in [
                    k
                    for k, h in hooks.items()
                    if getattr(h, "__module__", "").startswith("packfunc.compat")
                ]:
                    del hooks[key]
    return module


# ----------------------------------------------------------------------------- datasets

DATASET_LOSSES = ["cross_entropy", "mse"]


def make_dataset(loss_name: str, reduction: str, n: int = 11, seed: int = 0) -> Problem:
    """A float64 three-class Tanh MLP and ``n`` samples for whole-dataset tests.

    ``"cross_entropy"``: class weights, and targets that hit ``ignore_index``
    (so the mean normalizer is ``Σ weight[y]`` over the rest); ``"mse"``: plain MSE.
    """
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    X = torch.randn(n, 3, dtype=torch.float64)
    if loss_name == "cross_entropy":
        y = torch.randint(0, 3, (n,))
        y[::4] = -1
        weight = torch.tensor([0.5, 2.0, 1.0], dtype=torch.float64)
        return Problem(
            model, nn.CrossEntropyLoss(weight, ignore_index=-1, reduction=reduction), X, y
        )
    return Problem(
        model, nn.MSELoss(reduction=reduction), X, torch.randn(n, 3, dtype=torch.float64)
    )


# ----------------------------------------------------------------------------- Hugging Face


class Logits(nn.Module):
    """A Hugging Face model's logits as a tensor (of the last position for language models).

    Hugging Face models return a ``ModelOutput``; BackPACK-style code and packfunc's
    model functions take the tensor the loss is applied to. ``kind``: ``"masked"``
    passes the padding mask of token id 0 (BERT, RoBERTa), ``"decoder"`` feeds the
    first two tokens to the decoder (T5), ``"last"`` takes the last position (GPT-2,
    LLaMA), ``"plain"`` the logits as they are (ViT).
    """

    def __init__(self, model: nn.Module, kind: str):
        super().__init__()
        self.model = model
        self.kind = kind

    def forward(self, x: Tensor) -> Tensor:
        if self.kind == "masked":
            return self.model(input_ids=x, attention_mask=(x != 0).long()).logits
        if self.kind == "decoder":
            return self.model(input_ids=x, decoder_input_ids=x[:, :2]).logits[:, -1]
        logits = self.model(x).logits
        return logits[:, -1] if self.kind == "last" else logits


def pooled_convolution() -> nn.Module:
    """Max pooling before a convolution, averaged into a head: its kernel sets the conv's input."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.MaxPool2d(2),
        nn.Conv2d(2, 3, 3),
        nn.Tanh(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(3, 2),
    ).double()


def tiny_t5_config(**options: Any) -> Any:
    """A T5 configuration of one layer, width 8 and 20 tokens (``options`` override it)."""
    import transformers as hf

    tiny = {"vocab_size": 20, "d_model": 8, "d_kv": 4, "d_ff": 16, "num_layers": 1}
    tiny |= {"num_heads": 2, "dropout_rate": 0.0, "decoder_start_token_id": 0}
    return hf.T5Config(**(tiny | {"pad_token_id": 0, "eos_token_id": 1} | options))


def _hugging_face(name: str, dropout: float) -> nn.Module:
    """A tiny randomly initialized Hugging Face model (configs only: nothing is downloaded)."""
    import transformers as hf

    small = {"vocab_size": 20, "hidden_size": 8, "num_hidden_layers": 1}
    heads = {"num_attention_heads": 2, "intermediate_size": 16}
    encoder = {"hidden_dropout_prob": dropout, "attention_probs_dropout_prob": dropout}
    tokens = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
    if name == "bert":
        config = hf.BertConfig(**small, **heads, **encoder, max_position_embeddings=8, num_labels=3)
        return Logits(hf.BertForSequenceClassification(config), "masked")
    if name == "roberta":
        config = hf.RobertaConfig(
            **small, **heads, **encoder, **tokens, max_position_embeddings=8, num_labels=3
        )
        return Logits(hf.RobertaForSequenceClassification(config), "masked")
    if name == "gpt2":
        drop = {"resid_pdrop": dropout, "embd_pdrop": dropout, "attn_pdrop": dropout}
        config = hf.GPT2Config(vocab_size=20, n_embd=8, n_layer=1, n_head=2, n_positions=8, **drop)
        return Logits(hf.GPT2LMHeadModel(config), "last")
    if name == "llama":
        config = hf.LlamaConfig(
            **small, **heads, **tokens, num_key_value_heads=1, attention_dropout=dropout
        )
        return Logits(hf.LlamaForCausalLM(config), "last")
    if name == "mistral":
        config = hf.MistralConfig(
            **small,
            **heads,
            **tokens,
            num_key_value_heads=1,
            sliding_window=3,
            attention_dropout=dropout,
        )
        return Logits(hf.MistralForCausalLM(config), "last")
    if name == "t5":
        config = tiny_t5_config(dropout_rate=dropout, **tokens)
        return Logits(hf.T5ForConditionalGeneration(config), "decoder")
    config = hf.ViTConfig(
        image_size=4, patch_size=2, num_channels=2, **small, **heads, **encoder, num_labels=3
    )
    return Logits(hf.ViTForImageClassification(config), "plain")


HUGGING_FACE: dict[str, Callable[[float], nn.Module]] = {
    name: functools.partial(_hugging_face, name)
    for name in ("bert", "roberta", "gpt2", "llama", "mistral", "t5", "vit")
}
"""Name -> ``build(dropout)``: BERT and RoBERTa (with padding masks), GPT-2, LLaMA, Mistral,
T5 and ViT from tiny configs."""


def hugging_face_inputs(name: str, n: int) -> Tensor:
    """A batch for :data:`HUGGING_FACE`'s model ``name``: tokens (some padded), or images."""
    if name == "vit":
        return torch.randn(n, 2, 4, 4)
    tokens = torch.randint(1, 20, (n, 5))
    tokens[::2, -2:] = 0  # every other sequence ends in padding
    return tokens


def hugging_face_problem(name: str, n: int = 3) -> tuple[nn.Module, Tensor, Tensor]:
    """``(model, X, y)``: :data:`HUGGING_FACE`'s model ``name`` in float64 and eval mode,
    a batch and class targets."""
    torch.manual_seed(0)
    model = HUGGING_FACE[name](0.0).double().eval()
    X = hugging_face_inputs(name, n)
    X = X.double() if X.is_floating_point() else X
    with torch.no_grad():
        y = torch.randint(0, model(X).shape[1], (n,))
    return model, X, y
