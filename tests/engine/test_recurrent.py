import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.cases import PackedTagger, ragged_tokens
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.nn.utils.rnn import pack_padded_sequence, pack_sequence
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import packfunc as pf
from packfunc.engine import whole_model
from packfunc.engine.recurrent import CELL_OPS, RECURRENT_OPS, run_cell, run_recurrent

KINDS = ["tanh", "relu", "gru", "lstm"]


class RecurrentMode(TorchFunctionMode):
    """Route the fused recurrent kernels to run_recurrent; count how often that happens."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in RECURRENT_OPS:
            self.calls += 1
            return run_recurrent(func, args, kwargs)
        return func(*args, **kwargs)


class LinearSpy(TorchFunctionMode):
    """Record the input and output shapes of every F.linear call."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is F.linear:
            self.shapes.append((tuple(args[0].shape), tuple(out.shape)))
        return out


class MutationSpy(TorchDispatchMode):
    """Record every aten op that mutates one of its arguments."""

    def __init__(self):
        super().__init__()
        self.mutating = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.is_mutable:
            self.mutating.append(str(func))
        return func(*args, **(kwargs or {}))


def make_module(kind, input_size, hidden, proj=0, **kw):
    if kind == "lstm":
        return nn.LSTM(input_size, hidden, proj_size=proj, **kw).double()
    if kind == "gru":
        return nn.GRU(input_size, hidden, **kw).double()
    return nn.RNN(input_size, hidden, nonlinearity=kind, **kw).double()


def initial_state(kind, module, batch, proj):
    dirs = 2 if module.bidirectional else 1
    shape = (module.num_layers * dirs, batch, module.hidden_size)
    h0 = torch.randn(shape[:2] + (proj or module.hidden_size,), dtype=torch.float64)
    return (h0, torch.randn(shape, dtype=torch.float64)) if kind == "lstm" else h0


@settings(max_examples=25, deadline=None)
@given(
    kind=st.sampled_from(KINDS),
    sizes=st.tuples(st.integers(1, 4), st.integers(1, 4), st.integers(1, 3), st.integers(2, 5)),
    layers=st.integers(1, 3),
    bidirectional=st.booleans(),
    batch_first=st.booleans(),
    bias=st.booleans(),
    proj=st.integers(0, 4),
    given_state=st.booleans(),
    training=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_matches_pytorch_modules(
    kind, sizes, layers, bidirectional, batch_first, bias, proj, given_state, training, seed
):
    batch, steps, input_size, hidden = sizes
    proj = proj if kind == "lstm" and proj < hidden else 0
    torch.manual_seed(seed)
    # dropout is inert in eval mode, and with p=0 in training mode: both must match exactly
    module = make_module(
        kind,
        input_size,
        hidden,
        proj,
        num_layers=layers,
        bidirectional=bidirectional,
        batch_first=batch_first,
        bias=bias,
        dropout=0.5 if layers > 1 and not training else 0.0,
    ).train(training)
    shape = (batch, steps) if batch_first else (steps, batch)
    x = torch.randn(*shape, input_size, dtype=torch.float64)
    args = (x, initial_state(kind, module, batch, proj)) if given_state else (x,)

    expected = module(*args)
    mode = RecurrentMode()
    with mode:
        actual = module(*args)

    assert mode.calls == 1
    torch.testing.assert_close(actual, expected)
    assert actual[0].is_contiguous()


@pytest.mark.parametrize("batch_first", [False, True])
def test_direct_call_with_kwargs_linear_layout_and_no_mutation(batch_first):
    batch, steps, layers, dirs = 3, 4, 2, 2
    module = make_module("lstm", 2, 5, 3, num_layers=layers, bidirectional=True)
    x = torch.randn(steps, batch, 2, dtype=torch.float64)
    x = x.transpose(0, 1) if batch_first else x
    hx = initial_state("lstm", module, batch, 3)
    kwargs = dict(has_biases=True, num_layers=layers, dropout=0.0, train=False)
    kwargs.update(bidirectional=True, batch_first=batch_first)

    linears, mutations = LinearSpy(), MutationSpy()
    with linears, mutations:
        actual = run_recurrent(torch.lstm, (x, hx, module._flat_weights), kwargs)
    expected = torch.lstm(x, hx, module._flat_weights, **kwargs)

    torch.testing.assert_close(actual, expected)
    assert mutations.mutating == []
    # per layer-direction: one input projection, one hidden product and one projection per step
    assert len(linears.shapes) == layers * dirs * (1 + 2 * steps)
    input_projections = [s for s in linears.shapes if len(s[0]) == 3]
    assert len(input_projections) == layers * dirs
    assert all(s[0][:2] == (batch, steps) for s in input_projections)
    assert all(inp[0] == out[0] == batch for inp, out in linears.shapes)


@pytest.mark.parametrize(
    "kind, proj, layers, bidirectional, batch_first, unbatched",
    [
        ("tanh", 0, 1, False, True, False),
        ("relu", 0, 2, True, False, False),
        ("gru", 0, 2, True, False, False),
        ("gru", 0, 1, False, True, True),
        ("lstm", 2, 2, True, False, False),
        ("lstm", 0, 1, True, True, True),
    ],
)
def test_vmap_of_grad_matches_per_sample_autograd(
    kind, proj, layers, bidirectional, batch_first, unbatched
):
    torch.manual_seed(0)
    batch, steps, input_size = 4, 3, 2
    module = make_module(
        kind,
        input_size,
        3,
        proj,
        num_layers=layers,
        bidirectional=bidirectional,
        batch_first=batch_first,
    )
    params = {k: v.detach() for k, v in module.named_parameters()}
    xs = torch.randn(batch, steps, input_size, dtype=torch.float64)
    ys = torch.randn(batch, dtype=torch.float64)

    def loss(params, x, y):  # x: one sample [T, in]
        if not unbatched:
            x = x.unsqueeze(0 if batch_first else 1)
        out, state = functional_call(module, params, (x,))
        pred = out.tanh().sum() + sum(s.sum() for s in tree_leaves(state))
        return (pred - y) ** 2

    mode = RecurrentMode()
    with mode:
        per_sample = vmap(grad(loss), in_dims=(None, 0, 0))(params, xs, ys)
    assert mode.calls > 0

    for n in range(batch):
        leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
        grads = torch.autograd.grad(loss(leaves, xs[n], ys[n]), list(leaves.values()))
        for name, g in zip(leaves, grads, strict=True):
            torch.testing.assert_close(per_sample[name][n], g)


@pytest.mark.parametrize("kind", KINDS)
def test_unbatched_input_through_module(kind):
    module = make_module(kind, 3, 4, num_layers=2, bidirectional=True)
    x = torch.randn(5, 3, dtype=torch.float64)
    expected = module(x)
    with RecurrentMode():
        actual = module(x)
    assert actual[0].shape == (5, 8)
    torch.testing.assert_close(actual, expected)


def test_training_dropout_runs_and_is_differentiable():
    torch.manual_seed(0)
    module = make_module("lstm", 3, 4, 2, num_layers=3, dropout=0.5, batch_first=True).train()
    x = torch.randn(2, 6, 3, dtype=torch.float64)
    expected = module(x)
    with RecurrentMode():
        actual = module(x)
    assert [t.shape for t in tree_leaves(actual)] == [t.shape for t in tree_leaves(expected)]
    with torch.no_grad(), RecurrentMode():
        assert not torch.allclose(actual[0], module.eval()(x)[0])  # dropout was applied
    actual[0].sum().backward()
    assert all(p.grad is not None and p.grad.isfinite().all() for p in module.parameters())


def test_training_dropout_one_is_deterministic_and_exact():
    # p=1 zeroes every layer output but the last: deterministic, so it must match exactly
    module = make_module("gru", 3, 4, num_layers=2, dropout=1.0, bidirectional=True).train()
    x = torch.randn(5, 2, 3, dtype=torch.float64)
    expected = module(x)
    with RecurrentMode():
        actual = module(x)
    torch.testing.assert_close(actual, expected)


@settings(max_examples=25, deadline=None)
@given(
    kind=st.sampled_from(KINDS),
    lengths=st.lists(st.integers(1, 5), min_size=1, max_size=4),
    layers=st.integers(1, 2),
    bidirectional=st.booleans(),
    proj=st.sampled_from([0, 2]),
)
def test_packed_sequences_match_the_fused_kernels(kind, lengths, layers, bidirectional, proj):
    """The packed overload ``(data, batch_sizes, ...)``: outputs and final states, the
    initial state given, as torch's own kernel computes them (it was refused)."""
    proj = proj if kind == "lstm" else 0
    module = make_module(kind, 3, 4, proj, num_layers=layers, bidirectional=bidirectional)
    x = torch.randn(len(lengths), 5, 3, dtype=torch.float64)
    packed = pack_padded_sequence(x, torch.tensor(lengths), True, enforce_sorted=False)
    hx = initial_state(kind, module, len(lengths), proj)
    expected = module(packed, hx)
    with RecurrentMode() as mode:
        actual = module(packed, hx)
    assert mode.calls == 1
    torch.testing.assert_close(actual[0].data, expected[0].data)
    torch.testing.assert_close(tree_leaves(actual[1]), tree_leaves(expected[1]))


def test_rejects_unknown_op_and_bad_weights():
    x, h = torch.randn(2, 1, 3), torch.zeros(1, 1, 4)
    with pytest.raises(ValueError, match="recurrent"):
        run_recurrent(torch.add, (x, h), {})
    weights = nn.GRU(3, 4)._flat_weights[:3]
    with pytest.raises(ValueError, match="flat weights"):
        run_recurrent(torch.gru, (x, h, weights, True, 1, 0.0, False, False, False), {})


def test_modes_skip_cudnn_weight_layout():
    """On CUDA, a forward whose weights were swapped calls cuDNN's weight re-layout, which
    re-points the weights' storage; packfunc's modes skip it (here it would raise on CPU)."""
    from packfunc.engine.modes import FunctionalMode

    weights = [torch.randn(4, 3), torch.randn(4, 4)]
    before = [w.clone() for w in weights]
    pointers = [w.data_ptr() for w in weights]
    with FunctionalMode():
        out = torch._cudnn_rnn_flatten_weight(weights, 2, 3, 0, 4, 0, 1, True, False)
    assert out is None
    assert [w.data_ptr() for w in weights] == pointers
    for w, b in zip(weights, before):
        assert torch.equal(w, b)


def test_modes_give_torch_func_wrappers_a_null_data_pointer():
    """``nn.RNNBase.flatten_parameters`` (CUDA) reads the weights' data pointers, which
    ``torch.func``'s wrappers lack: under packfunc's modes they read 0 (aliased: no re-layout)."""
    from packfunc.engine.modes import FunctionalMode

    def pointer(x):
        assert x.data_ptr() == 0
        return x

    with FunctionalMode():
        torch.func.vmap(pointer)(torch.ones(2, 3))
        assert torch.ones(2).data_ptr() != 0


CELLS = {
    torch.lstm_cell: lambda: nn.LSTMCell(3, 4),
    torch.gru_cell: lambda: nn.GRUCell(3, 4),
    torch.rnn_tanh_cell: lambda: nn.RNNCell(3, 4),
    torch.rnn_relu_cell: lambda: nn.RNNCell(3, 4, nonlinearity="relu"),
}


@pytest.mark.parametrize("func", list(CELLS), ids=lambda f: f.__name__)
@pytest.mark.parametrize("bias", [True, False])
def test_run_cell_is_the_fused_cell_out_of_place(func, bias):
    """Same values and gradients as torch's cell op, with no in-place op, and vmap batches it."""
    assert set(CELLS) == set(CELL_OPS)
    torch.manual_seed(0)
    module = CELLS[func]().double()
    weights = [module.weight_ih, module.weight_hh]
    weights += [module.bias_ih, module.bias_hh] if bias else []
    x = torch.randn(2, 3, dtype=torch.float64)
    h = torch.randn(2, 4, dtype=torch.float64)
    hx = (h, torch.randn_like(h)) if func is torch.lstm_cell else h
    expected = func(x, hx, *weights)
    spy = MutationSpy()
    with spy:
        found = run_cell(func, x, hx, *weights)
    assert spy.mutating == []
    for a, b in zip(tree_leaves(found), tree_leaves(expected), strict=True):
        torch.testing.assert_close(a, b)
    grads = torch.autograd.grad(sum(t.sum() for t in tree_leaves(found)), weights)
    wanted = torch.autograd.grad(sum(t.sum() for t in tree_leaves(expected)), weights)
    torch.testing.assert_close(grads, wanted)
    # a zero state shared by every sample (what nn.LSTMCell makes for hx=None) under vmap
    zero = torch.zeros(4, dtype=torch.float64)
    state = (zero, zero) if func is torch.lstm_cell else zero
    rows = torch.randn(5, 3, dtype=torch.float64)
    batched = vmap(lambda r: run_cell(func, r, state, *weights))(rows)
    states = tuple(s.expand(5, 4) for s in tree_leaves(state))
    whole = func(rows, states if func is torch.lstm_cell else states[0], *weights)
    for a, b in zip(tree_leaves(batched), tree_leaves(whole), strict=True):
        torch.testing.assert_close(a, b)


def test_a_packed_batch_longer_than_the_samples_discovery_tries_computes():
    """Only sample 5 has the batch's length: the batch steps five times, the samples
    discovery ran on (0, then 11, 1, 3, ...) fewer, and the calls of the packed scan did not
    follow their plans (refused); they are out of the plan now."""
    from tests.cases import PackedTagger

    import packfunc as pf

    torch.manual_seed(0)
    model = PackedTagger().double()
    tokens = torch.randint(1, 6, (12, 5))
    lengths = torch.tensor([2, 1, 3, 2, 1, 5, 3, 1, 2, 3, 1, 2])
    tokens[torch.arange(5) >= lengths[:, None]] = 0
    y = torch.randint(0, 3, (12,))
    model_fn, params = pf.functional(model)
    found = pf.batch_grad(model_fn, params, tokens, y)
    loss = nn.CrossEntropyLoss()
    for name, param in model.named_parameters():
        rows = [
            torch.autograd.grad(loss(model(tokens[n : n + 1]), y[n : n + 1]), param)[0]
            for n in range(12)
        ]
        torch.testing.assert_close(found[name], torch.stack(rows) / 12)


def test_a_packed_batch_runs_torchs_kernels_a_sample_at_a_time(monkeypatch):
    """Where packfunc would vmap over samples, a packed batch ran each sample through the
    decomposed scan under torch.func (2.5× a per-sample loop of plain autograd): it runs
    torch's fused kernel with plain autograd now; its gradients stay the loop's."""
    looped = []
    original = whole_model._looped_with_autograd
    monkeypatch.setattr(
        whole_model, "_looped_with_autograd", lambda *a: looped.append(1) or original(*a)
    )
    decomposed = []
    monkeypatch.setattr(
        "packfunc.engine.modes.run_recurrent", lambda *a: decomposed.append(1) or run_recurrent(*a)
    )
    torch.manual_seed(0)
    model_fn, params = pf.functional(PackedTagger().double())
    pf.batch_grad(model_fn, params, ragged_tokens(4), torch.tensor([0, 1, 2, 0]))
    assert looped and not decomposed


class _OnPackedInput(nn.Module):
    """A GRU on the ``PackedSequence`` it is given (``collate_fn`` packs), and a side input."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(3, 4, batch_first=True, bidirectional=True)
        self.head = nn.Linear(8 + 2, 2)

    def forward(self, packed, side):
        _, h = self.rnn(packed)
        return self.head(torch.cat([h[-2], h[-1], side], 1))


def _sequences_and_loop(model, n=5):
    torch.manual_seed(0)
    sequences = [torch.randn(length, 3, dtype=torch.float64) for length in (3, 5, 1, 4, 2)[:n]]
    side, y = torch.randn(n, 2, dtype=torch.float64), torch.randint(0, 2, (n,))
    loss = nn.CrossEntropyLoss(reduction="sum")
    params = list(model.parameters())
    rows = [
        torch.autograd.grad(loss(model(pack_sequence([s]), side[i : i + 1]), y[i : i + 1]), params)
        for i, s in enumerate(sequences)
    ]
    expected = {
        name: torch.stack([row[k] for row in rows])
        for k, (name, _) in enumerate(model.named_parameters())
    }
    return sequences, side, y, loss, expected


def test_a_packed_sequence_among_the_inputs_is_passed_padded():
    """``X = (pack_sequence(..., enforce_sorted=False), side)``: refused before (no batch
    along dim 0); padded in the batch's order and packed again for the model, each sample's
    gradient is its loop's, and ``explain`` runs."""
    model = _OnPackedInput().double()
    sequences, side, y, loss, expected = _sequences_and_loop(model)
    model_fn, params = pf.functional(model)
    X = (pack_sequence(sequences, enforce_sorted=False), side)
    found = pf.batch_grad(model_fn, params, X, y, loss=loss)
    for name in params:
        torch.testing.assert_close(found[name], expected[name])
    assert set(pf.explain(model_fn, params, X)) == set(params)


def test_a_data_loader_that_packs_its_batches_computes():
    """``collate_fn`` packing each batch: the dataset's statistics and per-batch results are
    the loop's."""
    model = _OnPackedInput().double()
    sequences, side, y, loss, expected = _sequences_and_loop(model)
    items = list(zip(sequences, side, y))

    def collate(batch):
        seqs, sides, ys = zip(*batch)
        return (pack_sequence(list(seqs), enforce_sorted=False), torch.stack(sides)), torch.stack(
            ys
        )

    loader = torch.utils.data.DataLoader(items, batch_size=2, collate_fn=collate)
    model_fn, params = pf.functional(model)
    found = pf.sum_grad_squared(model_fn, params, loss=loss, data=loader)
    batches = list(pf.per_batch(pf.batch_grad, model_fn, params, loss=loss, data=loader))
    per_sample = {name: torch.cat([g[name] for g in batches]) for name in params}
    for name in params:
        torch.testing.assert_close(found[name], expected[name].square().sum(0))
        torch.testing.assert_close(per_sample[name], expected[name])


def test_curvature_products_of_a_model_that_packs_its_batch_are_the_dense_ones():
    """``ggn_vector_product`` and ``hessian_vector_product`` map over vectors, not samples:
    packing ran under that vmap and was refused as if the samples were mapped."""
    torch.manual_seed(0)
    model = PackedTagger().double()
    tokens, y = ragged_tokens(4), torch.tensor([0, 1, 2, 0])
    model_fn, params = pf.functional(model)
    names, flat = list(params), torch.cat([p.flatten() for p in params.values()])

    def unflat(vector):
        sizes = [p.numel() for p in params.values()]
        parts = vector.split(sizes)
        return {k: part.view_as(params[k]) for k, part in zip(names, parts)}

    def output(vector):
        return functional_call(model, unflat(vector), (tokens,))

    loss = nn.CrossEntropyLoss()
    J = torch.autograd.functional.jacobian(output, flat)
    probs = output(flat).softmax(1)
    ggn = sum(
        J[n].T @ ((torch.diag(probs[n]) - torch.outer(probs[n], probs[n])) / 4) @ J[n]
        for n in range(4)
    )
    hessian = torch.autograd.functional.hessian(lambda w: loss(output(w), y), flat)
    v = {k: torch.randn_like(p) for k, p in params.items()}
    vector = torch.cat([v[k].flatten() for k in names])
    for found, dense in (
        (pf.ggn_vector_product(model_fn, params, tokens, y, v=v), ggn),
        (pf.hessian_vector_product(model_fn, params, tokens, y, v=v), hessian),
    ):
        torch.testing.assert_close(torch.cat([found[k].flatten() for k in names]), dense @ vector)
