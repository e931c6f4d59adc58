"""The batch pass: tapped leaves for plans that call the leaves only, the mode for any other."""

import collections
import dataclasses
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.cases import RecurrentHead, assert_batch_grad_is_a_loop
from torch import nn

import packfunc as pf
from packfunc.engine import batch_record, discovery
from packfunc.engine.batch_record import PlanMismatch
from packfunc.engine.discovery import Plan, discover
from packfunc.functionalize import flatten_params


class SelfAttention(nn.Module):
    """One multi-head self-attention."""

    def __init__(self):
        super().__init__()
        self.attention = nn.MultiheadAttention(4, 2, batch_first=True)

    def forward(self, x):
        return self.attention(x, x, x, need_weights=False)[0]


class Encoder(nn.Module):
    """A learned position added by hand, a pre-norm Transformer layer and a head: local calls
    (the addition, the layer norms) and attention beside the tapped ones."""

    def __init__(self):
        super().__init__()
        self.position = nn.Parameter(torch.randn(3, 4))
        self.layer = nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0, batch_first=True)
        self.layer.norm_first = True
        self.head = nn.Linear(12, 3)

    def forward(self, x):
        return self.head(self.layer(x + self.position).flatten(1))


class DerivedPositions(nn.Module):
    """Positions derived from parameters before they meet the samples: a table's lookup of
    ``arange(T)`` (Hugging Face's ``wpe(arange(T))``) and a slice of a longer table."""

    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(5, 4)
        self.longer = nn.Parameter(torch.randn(6, 4))
        self.head = nn.Linear(12, 3)

    def forward(self, x):
        length = x.shape[1]
        positions = self.table(torch.arange(length)) + self.longer[:length]
        return self.head(torch.tanh(x + positions).flatten(1))


class FlatRowsLayers(nn.Module):
    """Hugging Face's ``Conv1D`` twice: ``torch.addmm(b, x.view(-1, d), W)``, ``W`` stored
    ``[in, out]``; the second on rows whose base is laid out ``[N, T, H, d]`` but shaped
    ``[N, H, T, d]`` (GPT-2's attention output after ``transpose(1, 2)``)."""

    def __init__(self):
        super().__init__()
        self.w1, self.b1 = nn.Parameter(torch.randn(4, 6)), nn.Parameter(torch.randn(6))
        self.w2, self.b2 = nn.Parameter(torch.randn(6, 3)), nn.Parameter(torch.randn(3))
        self.head = nn.Linear(9, 3)

    def forward(self, x):
        n, t, d = x.shape
        h = torch.addmm(self.b1, x.reshape(-1, d), self.w1).view(n, t, 6)
        heads = torch.tanh(h.view(n, t, 2, 3).transpose(1, 2))  # strides of [N, T, 2, 3]
        merged = heads.transpose(1, 2).reshape(n, t, 6)  # a view of it
        out = torch.addmm(self.b2, merged.view(-1, 6), self.w2).view(n, t, 3)
        return self.head(out.flatten(1))


class TransposedWeight(nn.Module):
    """``x @ w.T`` by hand: a product with a tensor derived from the parameter."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 12))

    def forward(self, x):
        return torch.tanh(x.flatten(1)) @ self.w.T


def _models():
    """``(name, model_fn, params, X, y)``: an MLP, an LSTM's head, a CNN, a Transformer layer,
    positions derived from parameters, linear layers on flat rows, a transposed weight."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(6, 5), nn.ReLU(inplace=True), nn.Linear(5, 4))
    lstm = RecurrentHead(nn.LSTM)
    cnn = nn.Sequential(nn.Conv2d(2, 3, 3), nn.Tanh(), nn.Flatten(), nn.Linear(12, 4))
    found = []
    for name, model, X, classes in (
        ("mlp", mlp, torch.randn(8, 6), 4),
        ("lstm head", lstm, torch.randn(8, 6, 3), 2),
        ("cnn", cnn, torch.randn(8, 2, 4, 4), 4),
        ("encoder", Encoder(), torch.randn(8, 3, 4), 3),
        ("derived positions", DerivedPositions(), torch.randn(8, 3, 4), 3),
        ("flat rows", FlatRowsLayers(), torch.randn(8, 3, 4), 3),
        ("transposed weight", TransposedWeight(), torch.randn(8, 3, 4), 3),
    ):
        model_fn, params = pf.functional(model)
        if name == "lstm head":
            params = {k: params[k] for k in ("head.weight", "head.bias")}
        found.append((name, model_fn, params, X, torch.randint(0, classes, (8,))))
    return found


def _plan(model_fn, params, X) -> Plan:
    leaves, _, _ = flatten_params(params)
    return discover(model_fn, params, leaves, X[:1])


def test_which_plans_call_the_leaves_only():
    for _, model_fn, params, X, _ in _models():
        assert _plan(model_fn, params, X).leaf_calls_only
    lstm_fn, lstm_params = pf.functional(RecurrentHead(nn.LSTM))
    whole = _plan(lstm_fn, lstm_params, torch.randn(2, 6, 3))  # the LSTM's weights: decomposed
    assert whole.rewritten and not whole.leaf_calls_only
    attention_fn, attention_params = pf.functional(SelfAttention())
    x = torch.randn(2, 3, 4)
    attention = _plan(attention_fn, attention_params, x)
    assert attention.rewritten and attention.leaf_calls_only  # decomposed on the leaves too
    norm_fn, norm_params = pf.functional(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)))
    assert _plan(norm_fn, norm_params, x).leaf_calls_only  # a local call of the leaves
    batch_norm = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).eval()
    bn_fn, bn_params = pf.functional(batch_norm)
    assert not _plan(bn_fn, bn_params, torch.randn(2, 4)).leaf_calls_only  # rewritten

    def derived(p, X):  # a product with a tensor derived from the leaf: a local call
        return X @ p["w"].T

    assert _plan(derived, {"w": torch.randn(3, 4)}, torch.randn(2, 4)).leaf_calls_only


@pytest.mark.parametrize(
    "name",
    ["mlp", "lstm head", "cnn", "encoder", "derived positions", "flat rows", "transposed weight"],
)
def test_tapped_leaves_give_the_results_of_the_mode(name, monkeypatch):
    _, model_fn, params, X, y = next(m for m in _models() if m[0] == name)
    passes = []
    forward = batch_record._tapped_leaves_forward

    def counted(*args):
        passes.append(forward(*args))
        return passes[-1]

    monkeypatch.setattr(batch_record, "_tapped_leaves_forward", counted)

    def everything():
        out = pf.compute(
            model_fn, params, X, y, quantities=("batch_grad", "batch_l2_grad", "diag_ggn")
        )
        out["kfac"] = pf.kfac(
            model_fn,
            params,
            X,
            y,
            generator=torch.Generator().manual_seed(0),
            on_unsupported="skip",  # (the norms', the position's)
        )
        return out

    on_tapped_leaves = everything()
    assert len(passes) == 2 and None not in passes  # one batch pass each, to its end
    monkeypatch.setattr(Plan, "leaf_calls_only", property(lambda plan: False))
    in_mode = everything()
    assert passes[2:] == [None, None]
    torch.testing.assert_close(on_tapped_leaves, in_mode, rtol=0, atol=0)


def test_a_use_the_plan_lacks_is_refused():
    w = torch.randn(3, 4)

    def extra_use(p, X):
        out = F.linear(X, p["w"])
        return out * p["w"].sum() if X.shape[0] > 1 else out  # not seen on one sample

    def extra_call(p, X):
        out = F.linear(X, p["w"])
        return out + F.linear(X, p["w"]) if X.shape[0] > 1 else out

    for model_fn in (extra_use, extra_call):
        assert _plan(model_fn, {"w": w}, torch.randn(2, 4)).leaf_calls_only
        with pytest.raises(PlanMismatch):
            pf.batch_grad(model_fn, {"w": w}, torch.randn(5, 4), torch.randint(0, 3, (5,)))


def test_a_tapped_leaf_kept_by_the_model_acts_as_a_plain_tensor():
    kept = []
    w = torch.randn(3, 4)

    def model_fn(p, X):
        kept.append(p["w"])
        return F.linear(X, p["w"])

    X, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    pf.batch_grad(model_fn, {"w": w}, X, y)
    # (discovery's forward, the batch pass, the check's forward of the last sample)
    (alias,) = [t for t in kept if isinstance(t, batch_record._TappedLeaf)]
    doubled = alias * 2
    assert type(doubled) is torch.Tensor and torch.equal(doubled, 2 * w)


def test_a_model_that_reaches_its_parameters_not_through_params_falls_back_to_the_mode():
    w = torch.randn(3, 4)
    params = {"w": w}

    def closes_over(p, X):  # reads the params it was built with, not its argument
        return F.linear(X, params["w"])

    X, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    expected = torch.func.vmap(
        torch.func.grad(lambda v, x, t: F.cross_entropy(F.linear(x[None], v), t[None]) / 5),
        in_dims=(None, 0, 0),
    )(w, X, y)
    for _ in range(2):  # discovery, then the cached plan
        found = pf.batch_grad(closes_over, params, X, y)["w"]
        torch.testing.assert_close(found, expected)


def _dropped_per_sample_grads(w: torch.Tensor, X: torch.Tensor, y: torch.Tensor, seed: int):
    """The autograd loop's per-sample gradients of ``linear(dropout(X), w)`` (masks of ``seed``),
    and the CPU generator's state after that one forward's draws."""
    torch.manual_seed(seed)
    dropped = F.dropout(X, 0.5, training=True)
    after = torch.get_rng_state()
    rows = []
    for x, t in zip(dropped, y):
        v = w.clone().requires_grad_()
        (g,) = torch.autograd.grad(F.cross_entropy(F.linear(x[None], v), t[None]) / len(X), v)
        rows.append(g)
    return torch.stack(rows), after


def test_a_pass_that_stops_part_way_runs_again_on_the_same_random_numbers():
    """The aliased pass of a model that reaches its weight not through ``params`` stops after
    its dropout drew a mask; the mode's pass then draws that mask again, not the next one: the
    values are those of one forward pass, and the generator advances by one pass."""
    w = torch.randn(3, 4)
    params = {"w": w}

    def closes_over(p, X):
        return F.linear(F.dropout(X, 0.5, training=True), params["w"])

    X, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    pf.batch_grad(closes_over, params, X, y)  # discovery, then the plan is cached
    assert _plan(closes_over, params, X).leaf_calls_only
    expected, after = _dropped_per_sample_grads(w, X, y, seed=1)
    torch.manual_seed(1)
    found = pf.batch_grad(closes_over, params, X, y)["w"]
    torch.testing.assert_close(found, expected)
    assert torch.equal(torch.get_rng_state(), after)


def test_a_stale_plan_is_replaced_and_run_on_the_same_random_numbers():
    """A cached plan the code no longer follows (same shapes, another path after the dropout)
    is discovered again, and the new pass draws the masks the stopped one drew."""
    w = torch.randn(3, 4)
    twice = [False]

    def switching(p, X):
        h = F.linear(F.dropout(X, 0.5, training=True), p["w"])
        return h + F.linear(torch.zeros_like(X), p["w"]) if twice[0] else h

    X, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    pf.batch_grad(switching, {"w": w}, X, y)  # the plan of one call of w
    twice[0] = True  # the second call adds w's bias-free output of zeros: the same gradients
    expected, after = _dropped_per_sample_grads(w, X, y, seed=2)
    torch.manual_seed(2)
    found = pf.batch_grad(switching, {"w": w}, X, y)["w"]
    torch.testing.assert_close(found, expected)
    assert torch.equal(torch.get_rng_state(), after)


def test_passes_on_tapped_leaves_in_two_threads_give_the_results_of_one():
    # a pure model function: pf.functional's model_fn swaps the module's parameters during a
    # call (torch.func.functional_call), which two threads must not do to one module at once
    from concurrent.futures import ThreadPoolExecutor

    def two_layers(p, X):
        return F.linear(torch.tanh(F.linear(X, p["w1"], p["b1"])), p["w2"])

    torch.manual_seed(0)
    params = {"w1": torch.randn(5, 6), "b1": torch.randn(5), "w2": torch.randn(4, 5)}
    X, y = torch.randn(8, 6), torch.randint(0, 4, (8,))
    expected = pf.batch_grad(two_layers, params, X, y)

    def run(_):
        return [pf.batch_grad(two_layers, params, X, y) for _ in range(50)]

    with ThreadPoolExecutor(2) as pool:
        for results in pool.map(run, range(2)):
            for found in results:
                torch.testing.assert_close(found, expected, rtol=0, atol=0)


def test_sites_stream_when_the_graph_starts_at_a_frozen_layer(monkeypatch):
    """A frozen first layer (not in ``params``) roots the graph outside the record: the
    lowest site is captured and the others still reach the consumer during the backward."""
    from packfunc.engine import statistics

    torch.manual_seed(0)
    layers = [nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 5), nn.Tanh()]
    model = nn.Sequential(*layers, nn.Linear(5, 3)).double()
    model_fn, all_params = pf.functional(model)
    params = {k: v for k, v in all_params.items() if not k.startswith("0.")}
    X, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    during: list[bool] = []
    consume = statistics._NormsDuringBackward.__call__

    def spy(self, k, g):
        during.append(torch._C._current_graph_task_id() != -1)
        return consume(self, k, g)

    monkeypatch.setattr(statistics._NormsDuringBackward, "__call__", spy)
    loss = nn.CrossEntropyLoss(reduction="sum")
    found = pf.clipped_grad(model_fn, params, X, y, loss=loss, max_norm=0.2)
    # the head gets the output cotangent itself; the middle layer's cotangent arrives during
    # the backward; the lowest layer's is captured at its end
    assert during == [False, True, False]
    batch = pf.batch_grad(model_fn, params, X, y, loss=loss)
    expected = {k: g.sum(0) for k, g in pf.clip_per_sample(batch, 0.2).items()}
    torch.testing.assert_close(found, expected)


def test_kfac_lets_the_output_go_before_its_backward(monkeypatch):
    """KFAC pulls back sampled cotangents, never ``∂L/∂output``: the model output (the
    logits, often the largest activation) is freed before that backward, not after it;
    the loss is reported where it is asked for (not by ``kfac``, which does not take it),
    and the unsampled gradient can no longer be read."""
    import weakref

    from packfunc.engine import layer_factors
    from packfunc.engine.batch_record import BatchRecord
    from packfunc.kronecker_factors import sqrt_factors_and_loss

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5)).double()
    model_fn, params = pf.functional(model)
    X, y = torch.randn(7, 4, dtype=torch.float64), torch.randint(0, 5, (7,))
    outputs: list[weakref.ref] = []
    alive_during: list[bool] = []
    records: list[BatchRecord] = []
    release = BatchRecord.release_output
    consume = layer_factors._FactorsDuringBackward.__call__

    def remember(self, **options):
        outputs.append(weakref.ref(self.output))
        records.append(self)
        release(self, **options)

    def spy(self, k, g):
        alive_during.append(outputs[0]() is not None)
        return consume(self, k, g)

    monkeypatch.setattr(BatchRecord, "release_output", remember)
    monkeypatch.setattr(layer_factors._FactorsDuringBackward, "__call__", spy)
    loss = nn.CrossEntropyLoss()
    factors = pf.kfac(model_fn, params, X, y, loss=loss, generator=torch.Generator().manual_seed(0))
    assert alive_during and not any(alive_during)
    assert set(factors) == set(params)
    with pytest.raises(RuntimeError, match="loss was not taken"):
        _ = records[0].loss
    with pytest.raises(RuntimeError, match="not taken before"):
        _ = records[0].output_cotangent
    outputs.clear()
    alive_during.clear()
    factors, value = sqrt_factors_and_loss(
        model_fn, params, X, y, loss=loss, mc_samples=1, generator=torch.Generator().manual_seed(0)
    )
    assert alive_during and not any(alive_during)
    torch.testing.assert_close(value, loss(model(X), y))
    torch.testing.assert_close(records[1].loss, value)


def test_released_output_is_kept_on_the_meta_device_once():
    """A second release (per-sample gradients release before and at the pullback) keeps the
    meta stand-in: ``empty_like`` of a meta tensor runs in Python (about 30 µs a call)."""
    from packfunc.engine.batch_pass import BatchPass

    model_fn, params = pf.functional(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)))
    X, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
    bp = BatchPass(model_fn, params, X, y, nn.CrossEntropyLoss(reduction="sum"))
    bp.record.release_output()
    stand_in = bp.record.output
    assert stand_in.is_meta and stand_in.shape == (5, 2)
    bp.record.release_output(gradient=False)
    assert bp.record.output is stand_in
    expected = torch.func.vmap(
        torch.func.grad(
            lambda p, x, t: F.cross_entropy(model_fn(p, x[None]), t[None], reduction="sum")
        ),
        in_dims=(None, 0, 0),
    )(params, X, y)
    found = pf.batch_grad(model_fn, params, X, y, loss=nn.CrossEntropyLoss(reduction="sum"))
    torch.testing.assert_close(found, expected)


def test_flat_rows_in_another_order_than_the_samples_are_not_read_as_samples():
    """``Conv1D``-like rows laid out position-major (``[T, N, d]``, ``T = N``): their memory
    does not hold each sample's rows together, so no pass takes them for a layer on the
    samples; the per-sample gradients equal a loop over samples."""
    torch.manual_seed(0)
    params = {"w": torch.randn(4, 3, dtype=torch.float64), "b": torch.randn(3, dtype=torch.float64)}

    def position_major(p, X):
        n, t, d = X.shape
        rows = X.transpose(0, 1).contiguous().view(-1, d)
        return torch.addmm(p["b"], rows, p["w"]).view(t, n, 3).transpose(0, 1).sum(1)

    X, y = torch.randn(3, 3, 4, dtype=torch.float64), torch.tensor([0, 2, 1])
    assert_batch_grad_is_a_loop(position_major, params, X, y)


def test_flat_rows_out_of_a_linear_layer_stored_in_out_carry_samples():
    """``Conv1D``'s flat output times a parameter before the view back: discovery must see
    those rows depend on the samples (the flat output came from the mode's rewrite, out of
    its sight, and was taken for a tensor of the parameters alone: ``scale`` read as unused,
    its per-sample gradients zero)."""
    torch.manual_seed(0)
    params = {
        "w": torch.randn(4, 5, dtype=torch.float64),
        "b": torch.randn(5, dtype=torch.float64),
        "scale": torch.randn(5, dtype=torch.float64),
    }

    def scaled_rows(p, X):
        n, t, d = X.shape
        rows = torch.addmm(p["b"], X.view(-1, d), p["w"]) * p["scale"]
        return rows.view(n, t, 5).sum(1)

    X, y = torch.randn(3, 2, 4, dtype=torch.float64), torch.tensor([0, 3, 1])
    assert_batch_grad_is_a_loop(scaled_rows, params, X, y)
    assert pf.explain(scaled_rows, params, X)["scale"].startswith("whole model")


def _dilated(options: dict[str, int]):
    """A conv whose padding and dilation come from ``options`` (the output keeps its shape)."""

    def model_fn(p, x):
        h = F.conv2d(x, p["w"], padding=options["dilation"], dilation=options["dilation"])
        return torch.tanh(h).flatten(1) @ p["v"]

    return model_fn


@pytest.mark.parametrize("quantity", ["batch_grad", "diag_ggn", "kflr"])
def test_a_cached_plan_is_not_used_with_other_layer_options(quantity):
    """Another dilation with the same output shape took the cached plan's (a probe found
    per-sample gradients off by 150 %); the options are part of what a plan must match."""
    torch.manual_seed(0)
    X, y = torch.randn(3, 2, 5, 5, dtype=torch.float64), torch.randint(0, 3, (3,))
    params = {"w": torch.randn(3, 2, 3, 3, dtype=torch.float64), "v": torch.randn(75, 3).double()}
    options = {"dilation": 1}
    model_fn = _dilated(options)
    call = getattr(pf, quantity)
    call(model_fn, params, X, y)
    options["dilation"] = 2
    found = call(model_fn, params, X, y)
    expected = call(_dilated({"dilation": 2}), params, X, y)  # a fresh plan
    assert torch.allclose(
        found["w"] if quantity != "kflr" else found["w"][1],
        expected["w"] if quantity != "kflr" else expected["w"][1],
    )
    if quantity == "batch_grad":
        assert_batch_grad_is_a_loop(model_fn, params, X, y)


def test_the_shim_follows_a_layer_whose_options_changed_between_backward_passes():
    from packfunc.compat import backpack, extend
    from packfunc.compat.extensions import BatchGrad

    torch.manual_seed(0)
    model = extend(
        nn.Sequential(
            nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(75, 3)
        ).double()
    )
    lossfunc = extend(nn.CrossEntropyLoss(reduction="sum"))
    X, y = torch.randn(3, 2, 5, 5, dtype=torch.float64), torch.randint(0, 3, (3,))
    for dilation in (1, 2):
        model[0].dilation, model[0].padding = (dilation, dilation), (dilation, dilation)
        model.zero_grad()
        with backpack(BatchGrad()):
            lossfunc(model(X), y).backward()
        weight = model[0].weight
        assert torch.allclose(weight.grad_batch.sum(0), weight.grad)


def test_a_setting_changed_after_the_first_call_makes_the_plan_again():
    """``batch_first`` switched off after a first call makes attention run across the
    batch: the cached plan's first check of rows never ran again and per-sample gradients
    came out 0.03 off, silently. A module's plain attributes are part of the plan's key:
    the new plan is checked, and refused."""
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(4, 2, batch_first=True).double()

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention, self.head = attention, nn.Linear(4, 2).double()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.attention(x, x, x, need_weights=False)[0].mean(1))

    model = Model()
    model_fn, params = pf.functional(model)
    X, y = torch.randn(3, 3, 4, dtype=torch.float64), torch.tensor([0, 1, 1])
    pf.batch_grad(model_fn, params, X, y)
    attention.batch_first = False
    with pytest.raises(ValueError, match="must depend on that sample alone"):
        pf.batch_grad(model_fn, params, X, y)


def test_private_and_enum_settings_changed_make_the_plan_again():
    """A forward that starts moving rows (``lin(x.flip(0)).flip(0)``) when a private or an
    enum attribute changes: the cached plan (closed forms) was kept, and per-sample
    gradients went to other samples (off by 3 to 6)."""
    import enum

    class Order(enum.Enum):
        KEPT = 0
        FLIPPED = 1

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer, self.head = nn.Linear(3, 4), nn.Linear(4, 2)
            self._flipped, self.order = False, Order.KEPT

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self._flipped or self.order is Order.FLIPPED:
                return self.head(torch.tanh(self.layer(x.flip(0)).flip(0)))
            return self.head(torch.tanh(self.layer(x)))

    torch.manual_seed(0)
    X, y = torch.randn(5, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 0, 1])
    for switch in ("private", "enum"):
        model = Model().double()
        model_fn, params = pf.functional(model)
        pf.batch_grad(model_fn, params, X, y)
        if switch == "private":
            model._flipped = True
        else:
            model.order = Order.FLIPPED
        assert_batch_grad_is_a_loop(model_fn, params, X, y)


@pytest.mark.parametrize(
    "off, on",
    [
        (np.bool_(False), np.bool_(True)),
        (torch.Size([0]), torch.Size([1])),
        (((0,),), ((1,),)),
        (frozenset({0}), frozenset({1})),
        ({"flip": False}, {"flip": True}),
        (types.SimpleNamespace(flip=False), types.SimpleNamespace(flip=True)),
    ],
    ids=["numpy bool", "torch.Size", "nested tuple", "frozenset", "dict", "config object"],
)
def test_settings_of_other_plain_kinds_make_the_plan_again(off, on):
    """Flags a user takes for plain (a numpy bool, ``torch.Size``, a dict of options, a
    config object as Hugging Face's ``config``) were not part of the plan's key: a switch to
    moving rows kept the closed forms (off by 0.74)."""

    def flipped(flag: object) -> bool:
        if isinstance(flag, dict):
            return flag["flip"]
        if isinstance(flag, types.SimpleNamespace):
            return flag.flip
        return bool(flag) and flag not in (torch.Size([0]), ((0,),), frozenset({0}))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer, self.head, self.flag = nn.Linear(3, 4), nn.Linear(4, 2), off

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if flipped(self.flag):
                return self.head(torch.tanh(self.layer(x.flip(0)).flip(0)))
            return self.head(torch.tanh(self.layer(x)))

    torch.manual_seed(0)
    X, y = torch.randn(5, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 0, 1])
    model = Model().double()
    model_fn, params = pf.functional(model)
    pf.batch_grad(model_fn, params, X, y)
    if isinstance(on, types.SimpleNamespace):
        model.flag.flip = True  # the same object, changed
    elif isinstance(on, dict):
        model.flag["flip"] = True
    else:
        model.flag = on
    assert_batch_grad_is_a_loop(model_fn, params, X, y)


@dataclasses.dataclass(slots=True)
class _SlottedConfig:
    center: bool = False


class _Centering(nn.Module):
    """Centers its hidden layer over the batch once an option, a function or a hook says so."""

    def __init__(self) -> None:
        super().__init__()
        self.layer, self.head = nn.Linear(3, 4).double(), nn.Linear(4, 2).double()
        self.act, self.flag, self.config = torch.tanh, [False], _SlottedConfig()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.layer(x))
        if self.flag[0] or self.config.center:
            h = h - h.mean(0)
        return self.head(h)


def _centered_tanh(h: torch.Tensor) -> torch.Tensor:
    return torch.tanh(h) - torch.tanh(h).mean(0)


_CENTERING = {
    "slotted dataclass": lambda m: setattr(m.config, "center", True),
    "list of options": lambda m: m.flag.__setitem__(0, True),
    "function attribute": lambda m: setattr(m, "act", _centered_tanh),
    "forward hook": lambda m: m.layer.register_forward_hook(lambda _, __, out: out - out.mean(0)),
}


@pytest.mark.parametrize("change", list(_CENTERING))
def test_options_functions_and_hooks_changed_make_the_plan_again(change):
    """A slotted dataclass's field, a list of options, a function held as an attribute or a
    forward hook registered after a first call that make a layer mix samples: the cached
    plan kept serving and per-sample gradients came out 0.35 to 1.2 off (each sample's own
    is 0), where a fresh model function is refused. They are part of the plan's key now."""
    torch.manual_seed(0)
    X, y = torch.randn(4, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 0])
    model = _Centering()
    model_fn, params = pf.functional(model)
    pf.batch_grad(model_fn, params, X, y)
    _CENTERING[change](model)
    with pytest.raises(ValueError, match="must depend on that sample alone"):
        pf.batch_grad(model_fn, params, X, y)


class _TwoContainers(nn.Module):
    """A softmax over dim -2 in one of two containers: per sample on ``[N, T, D]`` in ``a``,
    over the batch on ``[N, D]`` in ``b``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Sequential(nn.Softmax(dim=-2)), nn.Sequential()
        self.lin1, self.lin2 = nn.Linear(4, 4).double(), nn.Linear(4, 3).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(self.b(self.a(self.lin1(x)).mean(1)))


_MOVES = {
    "to another container": lambda m: m.b.append(m.a.pop(0)),
    "one level up": lambda m: setattr(m, "b", nn.Sequential(nn.Sequential(), m.a.pop(0))),
}


@pytest.mark.parametrize("move", list(_MOVES))
def test_a_module_moved_in_the_tree_makes_the_plan_again(move):
    """A parameterless softmax moved from one container to another (or up a level) between
    two calls, where it mixes samples: a plan key of the modules in a walk's order alone
    (the same for both trees) kept the first tree's plan (1.9e-2 off, found by a probe); the
    key has each module's children by name now, and the moved model is refused as a fresh one."""
    torch.manual_seed(0)
    X, y = torch.randn(5, 3, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    model = _TwoContainers()
    model_fn, params = pf.functional(model)
    assert_batch_grad_is_a_loop(model_fn, params, X, y)
    _MOVES[move](model)
    with pytest.raises(ValueError, match="must depend on that sample alone"):
        pf.batch_grad(model_fn, params, X, y)


class _MethodModel(nn.Module):
    """A model whose model function is its own method (``functional_call`` on itself)."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.act = nn.Linear(3, 4).double(), nn.Softmax(dim=1)
        self.l2 = nn.Linear(4, 2).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.act(self.l1(x)))

    def model_fn(self, p: dict, x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(self, p, (x,))


def _mixing_hook(_module, _inputs, out):
    return out.softmax(0)


_REPLACED = {
    "child of a bound-method model function": lambda m: setattr(m, "act", nn.Softmax(dim=0)),
    "hook removed and another registered": lambda m: (
        m.hook.remove(),
        m.l1.register_forward_hook(_mixing_hook),
    ),
    "global forward hook": lambda m: setattr(
        m,
        "global_hook",
        nn.modules.module.register_module_forward_hook(
            lambda module, i, out: _mixing_hook(module, i, out) if module is m.l1 else out
        ),
    ),
}


@pytest.mark.parametrize("change", list(_REPLACED))
def test_what_a_key_of_ids_or_closures_missed_makes_the_plan_again(change):
    """Found by a probe: a model function that is a method of the model (its module was not
    seen: no tree in the key, 0.25 off), a hook removed and another registered that got the
    freed id (0.08 off), and a global forward hook (0.08 off) kept a stale plan after the model
    came to mix samples. A method's object counts as read now, hooks and functions are held
    in the key by identity, and global hooks are in the key."""
    torch.manual_seed(0)
    X, y = torch.randn(6, 3, dtype=torch.float64), torch.randint(0, 2, (6,))
    model = _MethodModel()
    model.hook = model.l1.register_forward_hook(lambda module, i, out: out)
    params = {k: t.detach() for k, t in model.named_parameters()}
    model_fn = model.model_fn
    assert_batch_grad_is_a_loop(model_fn, params, X, y)
    _REPLACED[change](model)
    try:
        with pytest.raises(ValueError, match="must depend on that sample alone"):
            pf.batch_grad(model_fn, params, X, y)
    finally:
        if hasattr(model, "global_hook"):
            model.global_hook.remove()


_OPTIONS = {"center": False}


def test_a_dict_of_options_a_model_function_reads_makes_the_plan_again():
    """A hand-written model function reading a global dict of options: a switch to centering
    over the batch kept the cached plan (1.03 off)."""

    def model_fn(p, X):
        h = torch.tanh(X @ p["a"])
        return (h - h.mean(0) if _OPTIONS["center"] else h) @ p["b"]

    torch.manual_seed(0)
    params = {"a": torch.randn(3, 4, dtype=torch.float64), "b": torch.randn(4, 2).double()}
    X, y = torch.randn(4, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 0])
    pf.batch_grad(model_fn, params, X, y)
    _OPTIONS["center"] = True
    try:
        with pytest.raises(ValueError, match="must depend on that sample alone"):
            pf.batch_grad(model_fn, params, X, y)
    finally:
        _OPTIONS["center"] = False


def _below_by_search(node, targets) -> bool:
    """Oracle: whether any of ``targets`` is a strict descendant of ``node`` (full search)."""
    stack, seen = [node], set()
    while stack:
        for child, _ in stack.pop().next_functions:
            if child is not None and child not in seen:
                if child in targets:
                    return True
                seen.add(child)
                stack.append(child)
    return False


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 1000), st.integers(0, 1000), st.booleans()),
        min_size=1,
        max_size=12,
    )
)
def test_lowest_sites_are_those_with_no_site_below(steps):
    """Random graphs of sums and products of earlier tensors: the sites a search that stops at
    the first site below finds (each node visited once for the lowest ones) are those a full
    search of every site's descendants finds."""
    leaf = torch.ones(2, requires_grad=True)
    tensors = [leaf * 1.0, leaf * 2.0]
    sites = {}
    for i, (a, b, is_site) in enumerate(steps):
        tensors.append(tensors[a % len(tensors)] * tensors[b % len(tensors)] + i)
        if is_site:
            sites[i] = tensors[-1].grad_fn
    nodes = set(sites.values())
    expected = [k for k, node in sites.items() if not _below_by_search(node, nodes - {node})]
    assert batch_record.lowest_sites(sites) == expected


def test_a_branch_fed_by_a_closed_over_tensor_that_requires_grad_is_pulled_back():
    """``X @ w1 + tanh(X @ F) @ w2`` with ``F`` closed over and requiring grad (a frozen
    encoder's weight, an ``nn.Parameter`` not in ``params``): the second product was streamed
    from a hook on its node, which the pullback to the first product's output never ran:
    ``w2``'s per-sample gradients came back zero (0.996 off), its clipped sum and Kronecker
    output factor too."""
    torch.manual_seed(0)
    frozen = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)

    def model_fn(p, X):
        return X @ p["w1"] + torch.tanh(X @ frozen) @ p["w2"]

    params = {k: torch.randn(4, 3, dtype=torch.float64) for k in ("w1", "w2")}
    X, y = torch.randn(4, 4, dtype=torch.float64), torch.tensor([0, 1, 2, 0])
    loss = nn.CrossEntropyLoss(reduction="sum")

    def sample_loss(p, x, t):
        return loss(model_fn(p, x[None]), t[None])

    expected = torch.func.vmap(torch.func.grad(sample_loss), in_dims=(None, 0, 0))(params, X, y)
    found = pf.batch_grad(model_fn, params, X, y, loss=loss)
    for name in params:
        torch.testing.assert_close(found[name], expected[name])
    norms = torch.sqrt(sum(g.flatten(1).square().sum(1) for g in expected.values()))
    factors = (0.5 / (norms + 1e-6)).clamp(max=1.0)
    clipped = pf.clipped_grad(model_fn, params, X, y, loss=loss, max_norm=0.5)
    for name in params:
        weighted = torch.einsum("n,nij->ij", factors, expected[name])
        torch.testing.assert_close(clipped[name], weighted)
    outer = pf.kflr(model_fn, params, X, y, loss=loss)["w2"]
    assert all(factor.norm() > 0.1 for factor in outer)


class _Trainer:
    """An object that is not a module, holding the model; its method is the model function."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.steps = model, 0

    def model_fn(self, p: dict, x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(self.model, p, (x,))


class _ListHeld(nn.Module):
    """A softmax kept in a plain list attribute (not an ``nn.ModuleList``)."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(3, 4).double(), nn.Linear(4, 2).double()
        self.acts = [nn.Softmax(dim=1)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.acts[0](self.l1(x)))


_HELD = {
    "a trainer's model, child swapped": (
        lambda m: (_Trainer(m).model_fn, m),
        lambda m: setattr(m, "act", nn.Softmax(dim=0)),
    ),
    "a trainer's model, option changed": (
        lambda m: (_Trainer(m).model_fn, m),
        lambda m: setattr(m.act, "dim", 0),
    ),
    "a module in a plain list, swapped": (
        lambda _: (lambda model: (pf.functional(model)[0], model))(_ListHeld()),
        lambda m: m.acts.__setitem__(0, nn.Softmax(dim=0)),
    ),
    "a module in a plain list, option changed": (
        lambda _: (lambda model: (pf.functional(model)[0], model))(_ListHeld()),
        lambda m: setattr(m.acts[0], "dim", 0),
    ),
}


@pytest.mark.parametrize("case", list(_HELD))
def test_modules_held_outside_the_tree_are_in_the_plans_key(case):
    """Found by a probe: a model held by an object that is not a module (``fn =
    trainer.model_fn``, kept) and a module in a plain list attribute were not in the plan's
    key: made to mix samples between two calls, they kept the stale plan (0.09 to 0.17 off),
    where a fresh model function is refused. Both are walked as children now."""
    torch.manual_seed(0)
    X, y = torch.randn(6, 3, dtype=torch.float64), torch.randint(0, 2, (6,))
    build, change = _HELD[case]
    model_fn, model = build(_MethodModel())
    params = {k: t.detach() for k, t in model.named_parameters()}
    assert_batch_grad_is_a_loop(model_fn, params, X, y)
    change(model)
    with pytest.raises(ValueError, match="must depend on that sample alone"):
        pf.batch_grad(model_fn, params, X, y)


class _CountingBuffer(nn.Module):
    """Counts its forwards in a plain attribute and in a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.register_buffer("n", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.n += 1
        return x


class _CountingHolder(nn.Module):
    """A linear layer whose output goes through a counter kept in a plain list or dict."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.lin, counter = nn.Linear(3, 2).double(), _CountingBuffer()
        self.held = [counter] if kind == "list" else {"counter": counter}

    @property
    def counter(self) -> _CountingBuffer:
        return self.held[0] if isinstance(self.held, list) else self.held["counter"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.counter(self.lin(x))


@pytest.mark.parametrize("holder", ["list", "dict", "trainer"])
@pytest.mark.parametrize("quantity", [pf.batch_grad, pf.diag_hessian, pf.kfac])
def test_modules_held_outside_the_tree_count_one_forward_per_call(holder, quantity):
    """A counter kept in a plain list or dict of the model (or in a model held by a trainer)
    counted packfunc's own passes too: 3 forwards for batch_grad's first call, 2 for
    diag_hessian, where a registered child counts 1. They are put back as a child's are."""
    torch.manual_seed(0)
    if holder == "trainer":
        counter = _CountingBuffer()
        model: nn.Module = nn.Sequential(nn.Linear(3, 2).double(), counter)
        model_fn = _Trainer(model).model_fn
    else:
        model = _CountingHolder(holder)
        counter, model_fn = model.counter, pf.functional(model)[0]
    params = {k: t.detach() for k, t in model.named_parameters()}
    X, y = torch.randn(5, 3, dtype=torch.float64), torch.randint(0, 2, (5,))
    quantity(model_fn, params, X, y)
    assert counter.calls == 1


class _Held(nn.Module):
    """A softmax over dim 1 kept outside the registered children, in one of several ways."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(3, 4).double(), nn.Linear(4, 2).double()
        act = nn.Softmax(dim=1)
        if kind == "tuple":
            self.held = (act,)
        elif kind == "direct":
            object.__setattr__(self, "held", act)
        elif kind == "ordered dict":
            self.held = collections.OrderedDict(act=act)
        elif kind == "list of 17":
            self.held = [nn.Identity() for _ in range(16)] + [act]
        elif kind == "nested":
            self.held = [[act]]
        else:  # a dict of an option and a module
            self.held = {"scale": 1.0, "act": act}
        self.kind = kind

    @property
    def act(self) -> nn.Module:
        held = self.held
        if self.kind in ("tuple", "list of 17", "nested"):
            return held[-1][0] if self.kind == "nested" else held[-1]
        return held if self.kind == "direct" else held["act"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.held["scale"] if self.kind == "mixed dict" else 1.0
        return self.l2(scale * self.act(self.l1(x)))


_HELD_KINDS = ["tuple", "direct", "ordered dict", "list of 17", "nested", "mixed dict"]


@pytest.mark.parametrize("kind", _HELD_KINDS)
def test_modules_held_in_any_plain_container_are_in_the_plans_key(kind):
    """Found by a probe of the first fix: a module in an OrderedDict, in a list of 17, in a
    nested list, or a dict's option beside a module, kept a stale plan (0.17-0.61 off) after
    the held softmax was switched to mix samples; each is refused as a fresh model is."""
    torch.manual_seed(0)
    X, y = torch.randn(6, 3, dtype=torch.float64), torch.randint(0, 2, (6,))
    model = _Held(kind)
    model_fn, params = pf.functional(model)
    assert_batch_grad_is_a_loop(model_fn, params, X, y)
    model.act.dim = 0
    with pytest.raises(ValueError, match="must depend on that sample alone"):
        pf.batch_grad(model_fn, params, X, y)


class _TupleHolder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.held = nn.Linear(3, 2).double(), (_CountingBuffer(),)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.held[0](self.lin(x))


@pytest.mark.parametrize("quantity", [pf.batch_grad, pf.diag_hessian, pf.kfac])
def test_a_tuple_held_module_and_its_buffers_count_one_forward_per_call(quantity):
    """A counter and a buffer in a module kept in a tuple counted packfunc's own passes
    (3 to 4 forwards; in a list, the buffer too): they are put back as a child's are."""
    torch.manual_seed(0)
    model = _TupleHolder()
    model_fn, params = pf.functional(model)
    X, y = torch.randn(5, 3, dtype=torch.float64), torch.randint(0, 2, (5,))
    quantity(model_fn, params, X, y)
    assert model.held[0].calls == 1 and model.held[0].n.item() == 1


class _SlottedTrainer:
    __slots__ = ("model", "ema", "dim")

    def __init__(self, model: nn.Module) -> None:
        self.model, self.ema, self.dim = model, _CountingBuffer(), 1

    def model_fn(self, p: dict, x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(self.model, p, (x,)).softmax(self.dim)


def _trainer_problem(kind: type) -> tuple:
    """A ``_MethodModel`` held by a trainer of ``kind``, its parameters and a float64 batch."""
    torch.manual_seed(0)
    X, y = torch.randn(6, 3, dtype=torch.float64), torch.randint(0, 2, (6,))
    model = _MethodModel()
    params = {k: t.detach() for k, t in model.named_parameters()}
    return model, kind(model), params, X, y


def test_a_slotted_trainer_its_read_attributes_and_not_its_others():
    """A trainer with ``__slots__`` was not looked into (a stale plan 0.51 off); a plain
    attribute its method reads (``self.dim``) was not in the key (0.21 off); a module it
    holds but the method never names (an EMA copy) made a plan per call when it changed."""
    model, trainer, params, X, y = _trainer_problem(_SlottedTrainer)
    model_fn = trainer.model_fn
    assert_batch_grad_is_a_loop(model_fn, params, X, y)
    plan = discovery._PLANS[model_fn][1]
    trainer.ema.calls += 1  # an unread module changed: the plan stays
    pf.batch_grad(model_fn, params, X, y)
    assert discovery._PLANS[model_fn][1] is plan
    trainer.dim = 0  # the output is now normalized over the batch
    with pytest.raises(ValueError, match="must depend on that sample alone"):
        pf.batch_grad(model_fn, params, X, y)
    trainer.dim = 1
    model.act = nn.Softmax(dim=0)  # the model it reads, changed
    with pytest.raises(ValueError, match="must depend on that sample alone"):
        pf.batch_grad(model_fn, params, X, y)


@pytest.mark.parametrize("quantity", ["batch_grad", "kfac", "clipped_grad"])
def test_a_batch_pass_leaves_no_reference_cycle(quantity):
    """A pass's pullback was a closure that called itself: every call left a reference cycle
    (its autograd nodes, edges and shapes: 20 objects on an MLP, 47 on an LM) for the
    garbage collector, whose collections then ran during later calls."""
    import gc

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    model_fn, params = pf.functional(model)
    X, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    loss = nn.CrossEntropyLoss(reduction="sum")
    options = {"max_norm": 1.0} if quantity == "clipped_grad" else {}

    def call():
        return getattr(pf, quantity)(model_fn, params, X, y, loss=loss, **options)

    call()  # (a first call makes the plan)
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        call()
        gc.collect()
        left = list(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert left == [], [type(o).__name__ + ":" + repr(o)[:80] for o in left][:20]


class _TrainerWithHelper:
    """A trainer whose model function reads its model and option through helper methods."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.dim = model, 1

    def model_fn(self, p: dict, x: torch.Tensor) -> torch.Tensor:
        return self._normalized(self._logits(p, x))

    def _logits(self, p: dict, x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(self.model, p, (x,))

    def _normalized(self, z: torch.Tensor) -> torch.Tensor:
        return z.softmax(self.dim)


class _TrainerWithProperty(_TrainerWithHelper):
    """A trainer whose helper reads its model through a property."""

    def __init__(self, model: nn.Module) -> None:
        self._model, self.dim = model, 1

    @property
    def model(self) -> nn.Module:
        return self._model


@pytest.mark.parametrize("kind", [_TrainerWithHelper, _TrainerWithProperty])
def test_a_trainer_read_through_its_helper_methods(kind):
    """A module and an option the model function reads through the trainer's own helper
    methods (``self._logits`` reading ``self.model``) were not in the plan's key: changed
    to mix samples, they kept the stale plan where a fresh model function is refused."""
    model, trainer, params, X, y = _trainer_problem(kind)
    model_fn = trainer.model_fn
    assert_batch_grad_is_a_loop(model_fn, params, X, y)
    model.act = nn.Softmax(dim=0)  # the model the helper reads, changed
    with pytest.raises(ValueError, match="must depend on that sample alone"):
        pf.batch_grad(model_fn, params, X, y)
    model.act = nn.Softmax(dim=1)
    assert_batch_grad_is_a_loop(model_fn, params, X, y)
    trainer.dim = 0  # the option the other helper reads
    with pytest.raises(ValueError, match="must depend on that sample alone"):
        pf.batch_grad(model_fn, params, X, y)


def test_packfuncs_passes_through_a_helper_method_are_put_back():
    """A counter read through the trainer's helper method counted packfunc's own passes."""
    torch.manual_seed(0)
    counter = _CountingBuffer()
    model = nn.Sequential(counter, nn.Linear(3, 2).double())
    model_fn = _TrainerWithHelper(model).model_fn
    params = {k: t.detach() for k, t in model.named_parameters()}
    X, y = torch.randn(6, 3, dtype=torch.float64), torch.randint(0, 2, (6,))
    pf.batch_grad(model_fn, params, X, y)
    assert (counter.calls, float(counter.n)) == (1, 1.0)  # the user's forward, once
