"""``run_attention`` against PyTorch, and attention's parameters through packfunc's taps.

Oracles: ``F.multi_head_attention_forward`` itself (outputs and attention weights), per-sample
autograd loops for per-sample gradients, and ``Jᵀ H J`` from a dense autograd Jacobian (one
backward pass per row: ``vectorize=False``, as vmapped rows are unreliable for attention in
torch 2.13, see tests/cases.py) and the loss Hessian for the GGN diagonal.
"""

import inspect

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.cases import assert_trees_close, autograd_batch_grad
from torch import Tensor, nn
from torch.autograd.functional import hessian, jacobian
from torch.func import functional_call
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

import packfunc as pf
from packfunc.compat.watch import ForwardRecorder
from packfunc.engine import attention
from packfunc.engine.attention import ATTENTION_OPS, run_attention, supports_attention
from packfunc.engine.batch_pass import BatchPass
from packfunc.engine.modes import functional_mode
from packfunc.engine.whole_model import column_grads
from packfunc.functionalize import flatten_params

MASKS = ["none", "bool2d", "float2d", "bool3d", "float3d", "causal"]


class AttentionMode(TorchFunctionMode):
    """Route F.multi_head_attention_forward to run_attention; count how often that happens."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in ATTENTION_OPS:
            assert supports_attention(args, kwargs)
            self.calls += 1
            with self:
                return run_attention(args, kwargs)
        return func(*args, **kwargs)


class FunctionSpy(TorchFunctionMode):
    """Record every function a forward pass calls, and the input shape of each F.linear."""

    def __init__(self):
        super().__init__()
        self.funcs, self.linear_inputs = set(), []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.funcs.add(func)
        if func is F.linear:
            self.linear_inputs.append(tuple(args[0].shape))
        return func(*args, **(kwargs or {}))


def attention_mask(kind: str, batch: int, heads: int, length: int, source: int) -> Tensor | None:
    """An attn_mask of the given kind; source position 0 is never masked (no all-masked rows)."""
    if kind == "none":
        return None
    if kind == "causal":
        return torch.ones(length, source, dtype=torch.bool).tril().logical_not()
    shape = (length, source) if kind.endswith("2d") else (batch * heads, length, source)
    if kind.startswith("float"):
        return torch.randn(shape, dtype=torch.float64)
    mask = torch.rand(shape) < 0.4
    mask[..., 0] = False
    return mask


def padding_mask(kind: str, batch: int, source: int, batched: bool) -> Tensor | None:
    """A key_padding_mask of the given kind; source position 0 is never masked."""
    if kind == "none":
        return None
    mask = torch.rand(batch, source) < 0.4
    mask[:, 0] = False
    mask = mask if batched else mask[0]
    return mask if kind == "bool" else torch.randn(mask.shape, dtype=torch.float64)


@settings(max_examples=40, deadline=None)
@given(
    kdim=st.sampled_from([None, 4, 3]),
    bias=st.booleans(),
    bias_kv=st.booleans(),
    zero_attn=st.booleans(),
    inputs=st.sampled_from(["self", "shared_kv", "distinct"]),
    mask=st.sampled_from(MASKS),
    padding=st.sampled_from(["none", "bool", "float"]),
    need_weights=st.booleans(),
    average=st.booleans(),
    batched=st.booleans(),
    batch_first=st.booleans(),
    dropout=st.sampled_from([0.0, 0.5]),
    seed=st.integers(0, 2**16),
)
def test_matches_pytorch(
    kdim,
    bias,
    bias_kv,
    zero_attn,
    inputs,
    mask,
    padding,
    need_weights,
    average,
    batched,
    batch_first,
    dropout,
    seed,
):
    """Outputs and weights equal PyTorch's; dropout with the same seed draws the same masks."""
    torch.manual_seed(seed)
    embed, heads, batch, length = 4, 2, 2, 3
    separate = kdim is not None and kdim != embed
    if separate and inputs == "self":
        inputs = "distinct"
    source = length if inputs == "self" else 5
    module = nn.MultiheadAttention(
        embed,
        heads,
        dropout=dropout,
        bias=bias,
        add_bias_kv=bias_kv,
        add_zero_attn=zero_attn,
        kdim=kdim,
        vdim=kdim,
        batch_first=batch_first,
    ).double()
    module.train(dropout > 0)

    def sequence(steps: int, width: int) -> Tensor:
        shape = (batch, steps, width) if batch_first else (steps, batch, width)
        return torch.randn(shape if batched else (steps, width), dtype=torch.float64)

    query = sequence(length, embed)
    key = query if inputs == "self" else sequence(source, kdim or embed)
    value = key if inputs != "distinct" else sequence(source, kdim or embed)
    options = dict(
        attn_mask=attention_mask(mask, batch if batched else 1, heads, length, source),
        key_padding_mask=padding_mask(padding, batch, source, batched),
        need_weights=need_weights,
        average_attn_weights=average,
        is_causal=mask == "causal",
    )

    torch.manual_seed(seed)
    expected = module(query, key, value, **options)
    torch.manual_seed(seed)
    mode = AttentionMode()
    with mode:
        actual = module(query, key, value, **options)

    assert mode.calls == 1
    assert_trees_close(actual[0], expected[0], rtol=1e-12, atol=1e-12)
    if need_weights:
        assert_trees_close(actual[1], expected[1], rtol=1e-12, atol=1e-12)
    else:
        assert actual[1] is None


@pytest.mark.parametrize("inputs", ["self", "shared_kv", "distinct"])
def test_one_linear_per_weight_with_samples_first(inputs):
    """Packed weights: one F.linear over the distinct inputs; every call keeps N at dim 0."""
    module = nn.MultiheadAttention(4, 2).double()
    x = torch.randn(3, 2, 4, dtype=torch.float64)
    key = x if inputs == "self" else torch.randn(5, 2, 4, dtype=torch.float64)
    value = key if inputs != "distinct" else torch.randn(5, 2, 4, dtype=torch.float64)
    spy = FunctionSpy()
    with spy, functional_mode():
        module(x, key, value)
    in_length = {"self": 3, "shared_kv": 3 + 5, "distinct": 3 + 5 + 5}[inputs]
    assert spy.linear_inputs == [(2, in_length, 4), (2, 3, 4)]


def test_static_keys_fall_back_to_pytorch():
    """static_k/static_v are not reproduced: the original function runs (and is not tapped)."""
    module = nn.MultiheadAttention(4, 2).double()
    x = torch.randn(3, 2, 4, dtype=torch.float64)
    static = torch.randn(2 * 2, 5, 2, dtype=torch.float64)
    args = (x, x, x, 4, 2, module.in_proj_weight, module.in_proj_bias, None, None, False, 0.0)
    args += (module.out_proj.weight, module.out_proj.bias)
    kwargs = {"static_k": static, "static_v": static}
    assert not supports_attention(args, kwargs)
    with pytest.raises(ValueError, match="call the function itself"):
        run_attention(args, kwargs)
    with functional_mode():
        actual = F.multi_head_attention_forward(*args, **kwargs)
    assert_trees_close(actual, F.multi_head_attention_forward(*args, **kwargs))


@pytest.mark.parametrize("layer", ["encoder", "mha"])
def test_no_fast_path_under_a_mode(layer):
    """In eval mode without grad, the C++ fast paths are skipped under any TorchFunctionMode."""
    torch.manual_seed(0)
    if layer == "encoder":
        module = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True).eval()
    else:
        module = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    x = torch.randn(2, 3, 8)

    def run() -> Tensor:
        return module(x) if layer == "encoder" else module(x, x, x)[0]

    with torch.no_grad():
        expected = run()  # the fast path, outside any mode
        spy = FunctionSpy()
        with spy:
            run()
        with functional_mode():
            actual = run()
    assert F.multi_head_attention_forward in spy.funcs
    assert not spy.funcs & {
        torch._transformer_encoder_layer_fwd,
        torch._native_multi_head_attention,
    }
    torch.testing.assert_close(actual, expected)


def test_watched_forward_is_not_reused():
    """The shim's watched forward ran PyTorch's attention, not the decomposition: unusable."""
    module = nn.MultiheadAttention(4, 2).double()
    x = torch.randn(3, 2, 4, dtype=torch.float64)
    with ForwardRecorder(list(module.parameters()), x) as recorder:
        module(x, x, x)
    assert not recorder.usable


# ----------------------------------------------------------------------------- per-sample models


class SelfAttention(nn.Module):
    """Multi-head self- or cross-attention with a padding mask, pooled into a classifier.

    With ``head_weights``, the per-head attention weights enter the output too.
    """

    def __init__(self, cross=False, batch_first=True, head_weights=False, **options):
        super().__init__()
        self.cross, self.batch_first, self.head_weights = cross, batch_first, head_weights
        self.attn = nn.MultiheadAttention(4, 2, batch_first=batch_first, **options)
        self.head = nn.Linear(4, 3)

    def forward(self, x: Tensor, memory: Tensor, padding: Tensor) -> Tensor:
        source = memory if self.cross else x
        if not self.batch_first:
            x, source = x.transpose(0, 1), source.transpose(0, 1)
        out, weights = self.attn(
            x, source, source, key_padding_mask=padding, average_attn_weights=not self.head_weights
        )
        logits = self.head(out.mean(1 if self.batch_first else 0))
        if self.head_weights:
            logits = logits + weights.square().sum((1, 2, 3)).unsqueeze(1)
        return logits


class CausalLM(nn.Module):
    """Embedding + learned positions + causal encoder layer + linear head: logits [N, V, T]."""

    def __init__(self, vocab: int = 5, width: int = 4, steps: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.randn(steps, width) / 2)
        self.block = nn.TransformerEncoderLayer(width, 2, 8, dropout=0.0, batch_first=True)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: Tensor) -> Tensor:
        steps = tokens.shape[1]
        causal = nn.Transformer.generate_square_subsequent_mask(steps, dtype=torch.float64)
        h = self.block(self.embed(tokens) + self.position[:steps], src_mask=causal, is_causal=True)
        return self.head(h).transpose(1, 2)


CE = nn.CrossEntropyLoss()


def _sequences(n: int, steps: int, width: int) -> Tensor:
    return torch.randn(n, steps, width, dtype=torch.float64)


def _problem(name: str) -> tuple[nn.Module, tuple, Tensor, nn.Module]:
    """Model, input tuple, targets and loss of a named per-sample problem (float64, N=3)."""
    n = 3
    padding = torch.tensor([[False, False, True, True], [False] * 4, [False, True, False, True]])
    if name.startswith("mha"):
        options = {
            "mha": {},
            "mha_cross": {"cross": True},
            "mha_kdim": {"cross": True, "kdim": 5, "vdim": 5, "add_bias_kv": True},
            "mha_zero_attn": {"add_zero_attn": True, "bias": False},
            "mha_seq_first": {"cross": True, "batch_first": False, "head_weights": True},
        }[name]
        width = options.get("kdim", 4)
        inputs = (_sequences(n, 4, 4), _sequences(n, 4, width), padding)
        return SelfAttention(**options).double(), inputs, torch.randint(0, 3, (n,)), CE
    if name.startswith("encoder"):
        model = nn.TransformerEncoderLayer(
            4, 2, 8, dropout=0.0, batch_first=True, norm_first=name.endswith("norm_first")
        )
        inputs = (_sequences(n, 3, 4),)
        return model.double(), inputs, _sequences(n, 3, 4), nn.MSELoss()
    if name.startswith("decoder"):
        batch_first = name == "decoder"
        model = _Decoder(batch_first)
        inputs = (_sequences(n, 2, 4), _sequences(n, 3, 4))
        return model.double(), inputs, _sequences(n, 2, 4), nn.MSELoss(reduction="sum")
    model = CausalLM()
    tokens = torch.randint(0, 5, (n, 4))
    return model.double(), (tokens,), torch.randint(0, 5, (n, 4)), CE


class _Decoder(nn.Module):
    """A causal TransformerDecoderLayer on (target, memory), in either layout."""

    def __init__(self, batch_first: bool):
        super().__init__()
        self.batch_first = batch_first
        self.layer = nn.TransformerDecoderLayer(4, 2, 8, dropout=0.0, batch_first=batch_first)

    def forward(self, target: Tensor, memory: Tensor) -> Tensor:
        steps = target.shape[1]
        causal = nn.Transformer.generate_square_subsequent_mask(steps, dtype=torch.float64)
        if not self.batch_first:
            target, memory = target.transpose(0, 1), memory.transpose(0, 1)
        out = self.layer(target, memory, tgt_mask=causal, tgt_is_causal=True)
        return out if self.batch_first else out.transpose(0, 1)


PROBLEMS = [
    "mha",
    "mha_cross",
    "mha_kdim",
    "mha_zero_attn",
    "mha_seq_first",
    "encoder",
    "encoder_norm_first",
    "decoder",
    "decoder_seq_first",
    "causal_lm",
]


def per_sample_gradients(model, inputs, y, loss) -> dict[str, Tensor]:
    """The oracle: loop over samples, autograd of each sample's term of the reduced loss.

    A term is the sample's summed loss divided by the reduction's divisor: the number of
    targets (cross-entropy) or of output entries (MSE) of the whole batch for 'mean', 1 for 'sum'.
    """
    params = dict(model.named_parameters())
    summed = type(loss)(reduction="sum")
    if loss.reduction == "sum":
        divisor = 1
    else:
        divisor = y.numel() if isinstance(loss, nn.CrossEntropyLoss) else model(*inputs).numel()
    grads = []
    for n in range(y.shape[0]):
        term = summed(model(*(x[n : n + 1] for x in inputs)), y[n : n + 1]) / divisor
        grads.append(torch.autograd.grad(term, list(params.values()), allow_unused=True))
    return {
        name: torch.stack([g[i] if g[i] is not None else torch.zeros_like(p) for g in grads])
        for i, (name, p) in enumerate(params.items())
    }


def ggn_diagonal(model, inputs, y, loss) -> dict[str, Tensor]:
    """The oracle: diag(Jᵀ H J) from a dense Jacobian and the loss Hessian in the output."""
    names, shapes = zip(*[(k, p.shape) for k, p in model.named_parameters()])
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def output(vector: Tensor) -> Tensor:
        parts = vector.split([s.numel() for s in shapes])
        params = {k: t.view(s) for k, t, s in zip(names, parts, shapes)}
        return functional_call(model, params, inputs)

    out = output(flat).detach()
    jac = jacobian(output, flat, vectorize=False).reshape(out.numel(), -1)
    h_out = hessian(lambda o: loss(o, y), out, vectorize=True).reshape(out.numel(), -1)
    diagonal = torch.einsum("op,oq,qp->p", jac, h_out, jac)
    return {
        k: t.view(s) for k, t, s in zip(names, diagonal.split([s.numel() for s in shapes]), shapes)
    }


@pytest.mark.parametrize("name", PROBLEMS)
def test_batch_grad_and_diag_ggn(name):
    """Per-sample gradients and the GGN diagonal of every parameter, against autograd."""
    torch.manual_seed(0)
    model, inputs, y, loss = _problem(name)
    model_fn, params = pf.functional(model)
    batch_grad = pf.batch_grad(model_fn, params, inputs, y, loss=loss)
    assert_trees_close(batch_grad, per_sample_gradients(model, inputs, y, loss), name)
    diag_ggn = pf.diag_ggn(model_fn, params, inputs, y, loss=loss)
    assert_trees_close(diag_ggn, ggn_diagonal(model, inputs, y, loss), name)


def test_diag_hessian():
    """The Hessian diagonal of cross-attention, against a dense autograd Hessian."""
    name = "mha_cross"
    torch.manual_seed(0)
    model, inputs, y, loss = _problem(name)
    model_fn, params = pf.functional(model)
    names, shapes = zip(*[(k, p.shape) for k, p in model.named_parameters()])
    sizes = [s.numel() for s in shapes]

    def total_loss(vector: Tensor) -> Tensor:
        params = {k: t.view(s) for k, t, s in zip(names, vector.split(sizes), shapes)}
        return loss(functional_call(model, params, inputs), y)

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    with sdpa_kernel([SDPBackend.MATH]):
        diagonal = hessian(total_loss, flat, vectorize=False).diagonal()
    expected = {k: t.view(s) for k, t, s in zip(names, diagonal.split(sizes), shapes)}
    actual = pf.diag_hessian(model_fn, params, inputs, y, loss=loss)
    assert_trees_close(actual, expected, name)


@pytest.mark.parametrize("name", PROBLEMS)
def test_projection_weights_are_tapped(name):
    """Every projection weight and bias is a tapped leaf: none takes the generic path."""
    torch.manual_seed(0)
    model, inputs, y, loss = _problem(name)
    model_fn, params = pf.functional(model)
    backprop = BatchPass(model_fn, params, inputs, y, loss)
    tapped = {backprop.names[leaf] for site in backprop.plan.sites for _, leaf in site.call.leaves}
    projections = {
        k for k in params if k.rsplit(".", 1)[-1].endswith(("proj_weight", "proj_bias"))
    } | {k for k in params if ".out_proj." in k}
    assert projections
    assert projections <= tapped - {backprop.names[leaf] for leaf in backprop.whole_model}


@pytest.mark.parametrize("name", ["mha", "mha_kdim", "causal_lm"])
def test_generic_path_vmaps_the_decomposition(name):
    """The whole-model path (vmap over samples, batch of one each) runs run_attention too."""
    torch.manual_seed(0)
    model, inputs, y, loss = _problem(name)
    model_fn, params = pf.functional(model)
    leaves, treespec, names = flatten_params(params)
    output = model(*inputs).detach().requires_grad_()
    (cotangent,) = torch.autograd.grad(loss(output, y), output)
    columns = column_grads(
        model_fn, leaves, treespec, list(range(len(leaves))), inputs, cotangent[None], slice(None)
    )
    actual = {k: g[0] for k, g in zip(names, columns)}
    assert_trees_close(actual, per_sample_gradients(model, inputs, y, loss), name)


def test_arguments_bind_as_inspect_binds_them():
    names = attention._NAMES
    values = {name: object() for name in names}
    positional = tuple(values[name] for name in names[:5])
    keywords = {name: values[name] for name in names[5:13]}
    bound = attention._bind(positional, keywords)
    expected = inspect.signature(F.multi_head_attention_forward).bind(*positional, **keywords)
    expected.apply_defaults()
    assert bound == dict(expected.arguments)
    with pytest.raises(TypeError):  # one argument twice
        attention._bind(positional, {names[0]: 1, **keywords})
    with pytest.raises(TypeError):  # a required one missing, an unknown one given
        attention._bind(positional[:4], {"unknown": 1, **keywords})


def test_kflr_of_the_packed_projection_is_the_ggn_block_for_one_token():
    """``u = norm(x); mha(u, u, u)`` passes one tensor thrice: one input, each token counted
    once in the packed weight's input factor, so KFLR is the exact GGN block for one sample
    and one token."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.attention = (
                nn.LayerNorm(4),
                nn.MultiheadAttention(4, 2, batch_first=True),
            )
            self.head = nn.Linear(4, 3)

        def forward(self, x: Tensor) -> Tensor:
            u = self.norm(x)
            return self.head(self.attention(u, u, u, need_weights=False)[0][:, 0])

    torch.manual_seed(0)
    model = Block().double()
    model_fn, params = pf.functional(model)
    X, y = torch.randn(1, 1, 4, dtype=torch.float64), torch.tensor([1])
    factors = pf.kflr(model_fn, params, X, y, on_unsupported="skip")
    A, B = factors["attention.in_proj_weight"]
    weight = params["attention.in_proj_weight"]

    def output(w: Tensor) -> Tensor:
        return model_fn({**params, "attention.in_proj_weight": w}, X)

    J = jacobian(output, weight).reshape(3, -1)
    out = output(weight).detach()
    H = hessian(lambda o: F.cross_entropy(o, y), out).reshape(3, 3)
    torch.testing.assert_close(torch.kron(A, B), J.T @ H @ J)


class _EqualInputs(nn.Module):
    """Attention whose query, key and value are other tensors of equal values: separate
    pre-norms (equal at initialization), a detached key and value, or ``h + pos`` for query
    and key with a learned position initialized to zero (DETR)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.embed, self.head = nn.Linear(4, 4), nn.Linear(4, 3)
        self.norm_q, self.norm_kv = nn.LayerNorm(4), nn.LayerNorm(4)
        self.position = nn.Parameter(torch.zeros(3, 4))
        self.attention = nn.MultiheadAttention(4, 2, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x)
        if self.kind == "two norms":
            q, k = self.norm_q(h), self.norm_kv(h)
            v = k
        elif self.kind == "detached":
            q, k, v = h, h.detach(), h.detach()
        else:
            q = k = h + self.position
            v = h
        return self.head(self.attention(q, k, v, need_weights=False)[0]).transpose(1, 2)


@pytest.mark.parametrize("kind", ["two norms", "detached", "zero position"])
def test_inputs_of_equal_values_are_other_inputs(kind):
    """The packed projection took query, key and value of equal values as one input, so
    the key's and value's cotangents went to the query's tensor: a key/value norm's
    gradient read zero, a detached key's went to the embedding, a zero position's read
    3.6× (a probe). They are apart now, as torch's projection keeps them."""
    torch.manual_seed(0)
    model = _EqualInputs(kind).double()
    X = torch.randn(3, 3, 4, dtype=torch.float64)
    y = torch.tensor([[0, 1, 2], [2, 1, 0], [1, 1, 0]])
    loss = nn.CrossEntropyLoss(reduction="sum")
    expected = autograd_batch_grad(model, loss, X, y)
    model_fn, params = pf.functional(model)
    assert_trees_close(pf.batch_grad(model_fn, params, X, y, loss=loss), expected, kind)
    norms = sum(g.reshape(3, -1).square().sum(1) for g in expected.values())
    max_norm = float(norms.sqrt().median())
    clipped = pf.clipped_grad(model_fn, params, X, y, loss=loss, max_norm=max_norm)
    by_clipping = {k: g.sum(0) for k, g in pf.clip_per_sample(expected, max_norm).items()}
    assert_trees_close(clipped, by_clipping, kind)


@pytest.mark.parametrize("weight", ["q_proj_weight", "k_proj_weight", "v_proj_weight"])
def test_a_separate_projection_weight_alone_is_tapped(weight):
    """Alone (no packed projection, bias or out_proj followed), a kdim attention's weight does
    not make ``F.multi_head_attention_forward`` dispatch to a tensor subclass: the tapped
    batch pass saw its ``F.linear`` on ``[L, N, E]`` rows, and KFLR refused it with a wrong
    reason ("used outside a linear layer", "rows moved"; found by a probe). Such a plan runs
    in the mode: the weight is tapped, exact, its factors those with every parameter."""
    torch.manual_seed(0)
    model, inputs, y, loss = _problem("mha_kdim")
    model_fn, params = pf.functional(model)
    name = next(k for k in params if k.endswith(weight))
    alone = {name: params[name]}
    with_alone = lambda p, X: model_fn({**params, **p}, X)  # noqa: E731
    backprop = BatchPass(with_alone, alone, inputs, y, loss)
    assert not backprop.whole_model
    found = pf.batch_grad(with_alone, alone, inputs, y, loss=loss)
    assert_trees_close(found, {name: per_sample_gradients(model, inputs, y, loss)[name]}, name)
    every = pf.kflr(model_fn, params, inputs, y, loss=loss, on_unsupported="skip")[name]
    for factor, expected in zip(pf.kflr(with_alone, alone, inputs, y, loss=loss)[name], every):
        torch.testing.assert_close(factor, expected)
