"""A model that moves the batch's rows along dim 0 before a layer (a sort, an index, a flip).

Discovery runs one sample, where any reordering of the batch is the identity; the batch
pass took row ``n`` of such a layer's input as sample ``n``'s and gave each row's results
to another sample (per-sample gradients off by 0.27 of 0.18, the DP clipping of the wrong
samples), although every output row is its own sample's.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tests.cases import assert_batch_grad_is_a_loop, autograd_batch_grad
from torch import Tensor, nn

import packfunc as pf
from packfunc.compat import backpack, extend
from packfunc.compat.extensions import BatchGrad

Reorder = tuple[
    Callable[[Tensor], Tensor], Callable[[Tensor, Tensor], Tensor], Callable[..., Tensor]
]


def _unsorted(order: Tensor) -> Tensor:
    return order.argsort()


REORDERINGS: dict[str, Reorder] = {
    "argsort index": (
        lambda h: h[:, 0].argsort(),
        lambda h, o: h[o],
        lambda z, o: z[_unsorted(o)],
    ),
    "index_select": (
        lambda h: h[:, 0].argsort(),
        lambda h, o: h.index_select(0, o),
        lambda z, o: z.index_select(0, _unsorted(o)),
    ),
    "flip": (lambda h: h, lambda h, o: h.flip(0), lambda z, o: z.flip(0)),
    "roll": (lambda h: h, lambda h, o: h.roll(1, 0), lambda z, o: z.roll(-1, 0)),
    "gather": (
        lambda h: h[:, 0].argsort(),
        lambda h, o: h.gather(0, o[:, None].expand_as(h)),
        lambda z, o: z.gather(0, _unsorted(o)[:, None].expand_as(z)),
    ),
    "index_copy back": (
        lambda h: h[:, 0].argsort(),
        lambda h, o: h[o],
        lambda z, o: torch.zeros_like(z).index_copy(0, o, z),
    ),
    "topk": (
        lambda h: h[:, 0].topk(h.shape[0]).indices,
        lambda h, o: h[o],
        lambda z, o: z[_unsorted(o)],
    ),
    # one sample cannot tell these from the identity either (found by a probe)
    "reversed arange": (
        lambda h: torch.arange(h.shape[0] - 1, -1, -1),
        lambda h, o: h[o],
        lambda z, o: z.flip(0),
    ),
    "numpy index": (
        lambda h: h,
        lambda h, o: h[np.arange(h.shape[0])[::-1].copy()],
        lambda z, o: z.flip(0),
    ),
    "cat of slices": (
        lambda h: h,
        lambda h, o: torch.cat([h[1:], h[:1]]),
        lambda z, o: torch.cat([z[-1:], z[:-1]]),
    ),
    "unbind and stack": (
        lambda h: h,
        lambda h, o: torch.stack(h.unbind(0)[::-1]),
        lambda z, o: z.flip(0),
    ),
}


class Reordering(nn.Module):
    """A layer run on the batch's rows in another order, put back afterwards (MoE dispatch)."""

    def __init__(self, reorder: Reorder):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 3)
        self.order, self.moved, self.back = reorder

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.a(x))
        order = self.order(h)
        return self.c(self.back(torch.tanh(self.b(self.moved(h, order))), order))


def _problem(name: str) -> tuple[nn.Module, Tensor, Tensor]:
    torch.manual_seed(0)
    model = Reordering(REORDERINGS[name]).double()
    return model, torch.randn(6, 3, dtype=torch.float64), torch.randint(0, 3, (6,))


@pytest.mark.parametrize("name", list(REORDERINGS))
def test_layers_on_moved_rows_take_the_whole_model_path_and_are_per_sample(name):
    model, X, y = _problem(name)
    model_fn, params = pf.functional(model)
    paths = pf.explain(model_fn, params, X)
    assert "moved along its dim" in paths["b.weight"], paths
    assert paths["a.weight"].startswith("closed form"), paths  # before the move
    assert_batch_grad_is_a_loop(model_fn, params, X, y)


def _assert_clipped_sums_and_the_shim_are_the_loops(
    model: nn.Module, X: Tensor, y: Tensor
) -> dict[str, Tensor]:
    """``clipped_grad`` and the shim's ``BatchGrad`` against a loop of autograd; its result."""
    loss, n = nn.CrossEntropyLoss(reduction="sum"), len(y)
    expected = autograd_batch_grad(model, loss, X, y)
    norms = torch.cat([g.reshape(n, -1) for g in expected.values()], 1).square().sum(1).sqrt()
    factors = (0.1 / (norms + 1e-6)).clamp(max=1.0)
    model_fn, params = pf.functional(model)
    clipped = pf.clipped_grad(model_fn, params, X, y, loss=loss, max_norm=0.1)
    for name, g in expected.items():
        torch.testing.assert_close(clipped[name], torch.einsum("n,n...->...", factors, g))
    extended, lossfunc = extend(model), extend(loss)
    with backpack(BatchGrad()):
        lossfunc(extended(X), y).backward()
    for name, param in extended.named_parameters():
        torch.testing.assert_close(param.grad_batch, expected[name])
    return expected


def test_clipped_sums_and_the_shim_on_moved_rows_are_the_loops():
    _assert_clipped_sums_and_the_shim_are_the_loops(*_problem("argsort index"))


def test_the_samples_own_rows_picked_by_arange_keep_the_closed_forms():
    """``h[torch.arange(N), lengths]`` (Hugging Face's sequence heads and masks) leaves
    every row where it is: the layers after it stay on their closed forms."""

    class LastToken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.head = nn.Linear(2, 4), nn.Linear(4, 3)

        def forward(self, x: Tensor) -> Tensor:
            h = torch.tanh(self.embed(x))  # [N, T, 4]
            rows = torch.arange(x.shape[0])
            return self.head(h[rows, x[:, :, 0].argmax(-1)])

    torch.manual_seed(0)
    model = LastToken().double()
    model_fn, params = pf.functional(model)
    X, y = torch.randn(5, 4, 2, dtype=torch.float64), torch.randint(0, 3, (5,))
    paths = pf.explain(model_fn, params, X)
    assert all(path.startswith("closed form") for path in paths.values()), paths
    assert_batch_grad_is_a_loop(model_fn, params, X, y)


@pytest.mark.parametrize("write", ["setitem", "index_put_", "setitem of another sample"])
def test_a_write_by_boolean_mask_of_a_constant_keeps_the_closed_forms(write):
    """``h[~mask] = 0`` (Wav2Vec2, HuBERT: the padded frames zeroed) is a masked fill: no
    entry moves to another row. The layers after it took the whole-model path (41 of
    Wav2Vec2's 49 parameters ran each sample alone). A value that carries samples
    (``h[mask] = other[mask]``) may still move them: it keeps the whole-model path."""

    class MaskedWrite(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.head = nn.Linear(3, 4), nn.Linear(4, 2)

        def forward(self, x: Tensor, mask: Tensor) -> Tensor:
            h = self.embed(x)
            if write == "setitem":
                h[~mask] = 0.0
            elif write == "index_put_":
                h.index_put_((~mask,), torch.tensor(0.0, dtype=h.dtype))
            else:
                h[~mask] = h.flip(0)[~mask]
            return self.head(torch.tanh(h)).sum(1)

    torch.manual_seed(0)
    model = MaskedWrite().double()
    model_fn, params = pf.functional(model)
    X = torch.randn(4, 5, 3, dtype=torch.float64)
    mask = torch.ones(4, 5, dtype=torch.bool)
    mask[1, 3:], mask[3, 2:] = False, False
    paths = pf.explain(model_fn, params, (X, mask))
    closed = all(path.startswith("closed form") for path in paths.values())
    assert closed == (write != "setitem of another sample"), paths
    if closed:
        assert_batch_grad_is_a_loop(model_fn, params, (X, mask), torch.tensor([0, 1, 1, 0]))


def test_a_mixture_of_experts_on_its_tokens_runs_each_sample_alone():
    """Each expert on the rows routed to it (``torch.where(idx == e)[0]``, possibly none) and
    added back by ``index_add``: vmap cannot batch ``nonzero`` (torch's raw error before);
    the samples run one at a time."""

    class Experts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.router, self.out = nn.Linear(3, 2), nn.Linear(3, 3)
            self.experts = nn.ModuleList([nn.Linear(3, 3) for _ in range(2)])

        def forward(self, x: Tensor) -> Tensor:
            weight, chosen = self.router(x).softmax(-1).max(-1, keepdim=True)
            out = torch.zeros_like(x)
            for e, expert in enumerate(self.experts):
                rows = torch.where(chosen[:, 0] == e)[0]
                out = out.index_add(0, rows, expert(x[rows]) * weight[rows])
            return self.out(torch.tanh(out))

    torch.manual_seed(0)
    model_fn, params = pf.functional(Experts().double())
    X, y = torch.randn(6, 3, dtype=torch.float64), torch.randint(0, 3, (6,))
    assert_batch_grad_is_a_loop(model_fn, params, X, y)


SEQUENCE_FIRST_MOVES: dict[str, Callable[[Tensor], Tensor]] = {
    "reversed arange": lambda h: h[:, torch.arange(h.shape[1]).flip(0)],
    "flip": lambda h: h.flip(1),
    "roll": lambda h: h.roll(2, 1),  # of 4 samples: its own inverse
    "index_select": lambda h: h.index_select(1, torch.arange(h.shape[1] - 1, -1, -1)),
    "gather": lambda h: h.gather(1, torch.arange(h.shape[1]).flip(0)[None, :, None].expand_as(h)),
    "index after an ellipsis": lambda h: h[..., torch.arange(h.shape[1]).flip(0), :],
}
"""Moves of 4 samples along dim 1 of a sequence-first ``[T, N, d]`` tensor, each its own
inverse."""


class SequenceFirst(nn.Module):
    """The batch at dim 1 (``nn.LSTM``'s and ``nn.MultiheadAttention``'s default layout),
    moved there before a layer and put back after it (``move`` twice): a per-sample model."""

    def __init__(self, move: Callable[[Tensor], Tensor], layer: str):
        super().__init__()
        self.move, self.layer = move, layer
        self.inner = (
            nn.LSTM(3, 3)
            if layer == "lstm"
            else nn.MultiheadAttention(3, 1)
            if layer == "attention"
            else nn.Linear(3, 3)
        )
        self.head = nn.Linear(3, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = self.move(x.transpose(0, 1))  # [T, N, 3], the batch moved
        if self.layer == "lstm":
            h = self.inner(h)[0]
        elif self.layer == "attention":
            h = self.inner(h, h, h, need_weights=False)[0]
        else:
            h = torch.tanh(self.inner(h))
        return self.head(self.move(h)[-1])  # the batch put back, the last step


@pytest.mark.parametrize("layer", ["linear", "lstm", "attention"])
@pytest.mark.parametrize("move", list(SEQUENCE_FIRST_MOVES))
def test_moves_along_a_batch_dim_after_a_transpose_are_seen(move, layer):
    """Discovery's sample is ``[T, 1, d]`` there: a move along a dim of one element may move
    the batch (the per-sample gradients were each another sample's: off by 4.8, 0.30 for
    the LSTM)."""
    torch.manual_seed(0)
    model = SequenceFirst(SEQUENCE_FIRST_MOVES[move], layer).double()
    model_fn, params = pf.functional(model)
    X, y = torch.randn(4, 5, 3, dtype=torch.float64), torch.randint(0, 2, (4,))
    inner = next(name for name in params if name.startswith("inner."))
    assert pf.explain(model_fn, params, X)[inner].startswith("whole model")
    assert_batch_grad_is_a_loop(model_fn, params, X, y)


@pytest.mark.parametrize("layer", ["linear", "lstm", "attention"])
def test_sequence_first_models_that_keep_their_rows_keep_their_paths(layer):
    """Sequence-first layers whose batch stays where it is keep the paths they had (features
    permuted along the last dim: no move of the batch)."""
    torch.manual_seed(0)
    model = SequenceFirst(lambda h: h[:, :, torch.tensor([2, 0, 1])], layer).double()
    model_fn, params = pf.functional(model)
    X, y = torch.randn(4, 5, 3, dtype=torch.float64), torch.randint(0, 2, (4,))
    paths = pf.explain(model_fn, params, X)
    assert not any("moved" in path for path in paths.values()), paths
    assert_batch_grad_is_a_loop(model_fn, params, X, y)


def _permutation(h: Tensor) -> Tensor:
    return torch.eye(h.shape[0], dtype=h.dtype).flip(0)


MORE_MOVES: dict[str, Callable[[Tensor], Tensor]] = {
    "reversed": lambda h: torch.stack(list(reversed(h))),
    "stack of h[i]": lambda h: torch.stack([h[i] for i in range(h.shape[0] - 1, -1, -1)]),
    "stack of select": lambda h: torch.stack(
        [h.select(0, i) for i in range(h.shape[0] - 1, -1, -1)]
    ),
    "cat of vsplit": lambda h: torch.cat(torch.vsplit(h, h.shape[0])[::-1]),
    "rot90": lambda h: torch.rot90(h, 2).flip(1),
    "fliplr of the transpose": lambda h: torch.fliplr(h.T).T,
    "embedding of the rows": lambda h: F.embedding(torch.arange(h.shape[0]).flip(0), h),
    "permutation matrix": lambda h: _permutation(h) @ h,
    "einsum with a permutation": lambda h: torch.einsum("mn,nd->md", _permutation(h), h),
    # found by a second probe: a new leading dim of one element, other products
    "reshape to [1, N, d]": lambda h: h.reshape(1, -1, h.shape[1]).flip(1).squeeze(0),
    "unflatten": lambda h: h.unflatten(0, (1, -1)).flip(1).squeeze(0),
    "expand": lambda h: h.expand(1, -1, -1).flip(1).squeeze(0),
    "broadcast with [1, 1, d]": lambda h: (h + h.new_zeros(1, 1, h.shape[1])).flip(1)[0],
    "matmul with [1, d, d]": lambda h: (h @ torch.eye(h.shape[1], dtype=h.dtype)[None]).flip(1)[0],
    "new_zeros and index_copy": lambda h: (
        h.new_zeros(1, *h.shape).index_copy(1, torch.arange(h.shape[0]).flip(0), h[None]).squeeze(0)
    ),
    "addmm": lambda h: torch.addmm(h.new_zeros(1), _permutation(h), h),
    "tensordot": lambda h: torch.tensordot(_permutation(h), h, dims=1),
    "linear of the transpose": lambda h: F.linear(h.T, _permutation(h)).T,
    "einsum with an ellipsis": lambda h: torch.einsum("nm,m...->n...", _permutation(h), h),
    "baddbmm": lambda h: torch.baddbmm(h.new_zeros(1), _permutation(h)[None], h[None])[0],
    "multi_dot": lambda h: torch.linalg.multi_dot([_permutation(h), h]),
}
"""Reversals of the batch found by a probe that no listed move made (off by 0.33)."""


@pytest.mark.parametrize("move", list(MORE_MOVES))
def test_moves_by_other_calls_are_seen(move):
    torch.manual_seed(0)
    reorder: Reorder = (lambda h: h, lambda h, o: MORE_MOVES[move](h), lambda z, o: z.flip(0))
    model = Reordering(reorder).double()
    model_fn, params = pf.functional(model)
    X, y = torch.randn(4, 3, dtype=torch.float64), torch.randint(0, 3, (4,))
    assert pf.explain(model_fn, params, X)["b.weight"].startswith("whole model")
    assert_batch_grad_is_a_loop(model_fn, params, X, y)


MORE_SEQUENCE_FIRST_MOVES: dict[str, Callable[[Tensor], Tensor]] = {
    "fliplr": torch.fliplr,
    "rot90": lambda h: torch.rot90(h, 2, (1, 2)).flip(2),
    "stack of h[:, i]": lambda h: torch.stack([h[:, i] for i in range(h.shape[1])][::-1], 1),
    "stack of select": lambda h: torch.stack([h.select(1, i) for i in range(h.shape[1])][::-1], 1),
    "cat of hsplit": lambda h: torch.cat(torch.hsplit(h, h.shape[1])[::-1], 1),
}


@pytest.mark.parametrize("move", list(MORE_SEQUENCE_FIRST_MOVES))
def test_other_moves_of_a_sequence_first_batch_are_seen(move):
    torch.manual_seed(0)
    model = SequenceFirst(MORE_SEQUENCE_FIRST_MOVES[move], "lstm").double()
    model_fn, params = pf.functional(model)
    X, y = torch.randn(4, 5, 3, dtype=torch.float64), torch.randint(0, 2, (4,))
    assert pf.explain(model_fn, params, X)["inner.weight_ih_l0"].startswith("whole model")
    assert_batch_grad_is_a_loop(model_fn, params, X, y)


class _Gray(nn.Module):
    """One channel repeated to three along dim 1 (``x[:, [0, 0, 0]]``)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.head = nn.Conv2d(3, 2, 3), nn.Linear(2, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.conv(x[:, [0, 0, 0]])).mean((2, 3)))


class _StepLoop(nn.Module):
    """A GRU cell run over ``x.unbind(1)`` (one step)."""

    def __init__(self) -> None:
        super().__init__()
        self.cell, self.head = nn.GRUCell(3, 4), nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.zeros(x.shape[0], 4, dtype=x.dtype)
        for step in x.unbind(1):
            h = self.cell(step, h)
        return self.head(h)


class _TopOne(nn.Module):
    """``topk(1)`` of a one-column score, and a table of fixed rows indexed per sample."""

    def __init__(self) -> None:
        super().__init__()
        self.score, self.head = nn.Linear(3, 1), nn.Linear(4, 3)
        self.register_buffer("table", torch.randn(5, 4))

    def forward(self, x: Tensor) -> Tensor:
        picked = self.score(x).topk(1, dim=-1).values
        return self.head(self.table[x.argmax(-1)] * picked)


@pytest.mark.parametrize(
    "make, shape",
    [(_Gray, (3, 1, 5, 5)), (_StepLoop, (3, 1, 3)), (_TopOne, (3, 3))],
    ids=["one channel repeated", "a loop over one step", "topk of one and a table lookup"],
)
def test_picks_along_dims_that_do_not_carry_the_batch_keep_the_closed_forms(make, shape):
    """Dims of one element that are not the batch's (a channel, a step): the inputs' batch
    dim is followed through the calls, so picks along these do not send the layers after
    them to the whole-model path (they did, for a day)."""
    torch.manual_seed(0)
    model_fn, params = pf.functional(make().double())
    X, y = torch.randn(*shape, dtype=torch.float64), torch.tensor([0, 1, 2])
    paths = pf.explain(model_fn, params, X)
    assert not any(path.startswith("whole model") for path in paths.values()), paths
    assert_batch_grad_is_a_loop(model_fn, params, X, y)


class _SequenceFirstHeads(nn.Module):
    """Attention written by hand on a sequence-first batch, its heads split by ``reshape``."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.head = nn.Linear(8, 24), nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = x.transpose(0, 1)  # [T, N, 8]
        T, N = h.shape[:2]
        q, k, v = (t.reshape(T, N, 2, 4) for t in self.proj(h).chunk(3, -1))
        a = torch.einsum("tnhd,snhd->nhts", q, k).softmax(-1)
        return self.head(torch.einsum("nhts,snhd->nthd", a, v).reshape(N, T, 8).mean(1))


class _OneHot(nn.Module):
    """A one-hot of each sample's strongest position, built by ``scatter_`` (one position)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.head = nn.Linear(3, 8), nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.proj(x))  # [N, T, 8]
        index = h[..., 0].argmax(-1, keepdim=True)
        onehot = torch.zeros(x.shape[0], x.shape[1], dtype=h.dtype).scatter_(1, index, 1.0)
        return self.head((h * onehot[..., None]).sum(1))


@pytest.mark.parametrize(
    "make, shape",
    [(_SequenceFirstHeads, (3, 4, 8)), (_SequenceFirstHeads, (3, 1, 8)), (_OneHot, (3, 1, 3))],
    ids=["sequence-first heads", "sequence-first heads of one step", "one-hot of one position"],
)
def test_batch_dims_followed_through_reshapes_and_writes_keep_the_closed_forms(make, shape):
    torch.manual_seed(0)
    model_fn, params = pf.functional(make().double())
    X, y = torch.randn(*shape, dtype=torch.float64), torch.tensor([0, 1, 2])
    paths = pf.explain(model_fn, params, X)
    assert not any("moved" in path for path in paths.values()), paths
    assert paths["head.weight"].startswith("closed form"), paths
    assert_batch_grad_is_a_loop(model_fn, params, X, y)


class ReorderingForBatches(Reordering):
    """:class:`Reordering` whose move happens for more than one sample only (``if len(x) >
    1``: a sort by length that a single sample skips): discovery's sample cannot show it."""

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[0] == 1:
            return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))
        return super().forward(x)


@pytest.mark.parametrize("name", list(REORDERINGS))
def test_rows_moved_for_batches_only_take_the_whole_model_path(name):
    """The batch pass compares each layer's first and last input rows with those samples'
    inputs alone: the layers on moved rows run each sample alone (their per-sample
    gradients were other samples', off by up to 0.6 in float64, sums right)."""
    torch.manual_seed(0)
    model = ReorderingForBatches(REORDERINGS[name]).double()
    model_fn, params = pf.functional(model)
    X, y = torch.randn(6, 3, dtype=torch.float64), torch.randint(0, 3, (6,))
    for _ in range(2):  # discovered, then the plan kept with its layer on the whole model
        assert_batch_grad_is_a_loop(model_fn, params, X, y)


def test_rows_moved_for_batches_only_are_per_sample_in_every_quantity():
    torch.manual_seed(0)
    model = ReorderingForBatches(REORDERINGS["flip"]).double()
    X, y = torch.randn(6, 3, dtype=torch.float64), torch.randint(0, 3, (6,))
    loss = nn.CrossEntropyLoss(reduction="sum")
    model_fn, params = pf.functional(model)
    squared = pf.batch_l2_grad(model_fn, params, X, y, loss=loss)
    diagonals = pf.batch_diag_ggn(pf.functional(model)[0], params, X, y, loss=loss)
    for n in range(6):
        one = pf.diag_ggn(pf.functional(model)[0], params, X[n : n + 1], y[n : n + 1], loss=loss)
        for name in params:
            torch.testing.assert_close(diagonals[name][n], one[name])
    expected = _assert_clipped_sums_and_the_shim_are_the_loops(model, X, y)
    for name, g in expected.items():
        torch.testing.assert_close(squared[name], g.reshape(6, -1).square().sum(1))


def test_token_rows_moved_for_batches_only_take_the_whole_model_path():
    """An embedding's input is its indices: compared exactly, not to rounding."""

    class Tokens(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.head = nn.Embedding(7, 4), nn.Linear(4, 3)

        def forward(self, tokens: Tensor) -> Tensor:
            moved = tokens.flip(0) if len(tokens) > 1 else tokens
            h = self.embed(moved).mean(1)
            return self.head(torch.tanh(h.flip(0) if len(tokens) > 1 else h))

    torch.manual_seed(0)
    model_fn, params = pf.functional(Tokens().double())
    tokens, y = torch.randint(0, 7, (5, 3)), torch.randint(0, 3, (5,))
    assert_batch_grad_is_a_loop(model_fn, params, tokens, y)


def test_local_sites_on_rows_moved_for_batches_only_take_the_whole_model_path():
    """A layer norm and a learned scale (``h * scale``) between the moves: their calls are
    local sites, whose arguments with a row per sample are compared too (their per-sample
    gradients were other samples', off by 0.45)."""

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.norm, self.head = nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2)
            self.scale = nn.Parameter(torch.rand(4) + 0.5)

        def forward(self, x: Tensor) -> Tensor:
            h = torch.tanh(self.embed(x))
            h = h.flip(0) if len(x) > 1 else h
            h = torch.tanh(self.norm(h) * self.scale)
            return self.head(h.flip(0) if len(x) > 1 else h)

    torch.manual_seed(0)
    model_fn, params = pf.functional(Scaled().double())
    X, y = torch.randn(5, 3, dtype=torch.float64), torch.randint(0, 2, (5,))
    assert_batch_grad_is_a_loop(model_fn, params, X, y)
