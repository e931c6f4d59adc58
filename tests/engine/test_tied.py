"""Squared norms of tied weights (an embedding and its head, W and Wᵀ) in Gram form."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.cases import assert_trees_close, autograd_batch_grad
from tests.test_properties import SETTINGS
from torch import Tensor, nn

import packfunc as pf
from packfunc.engine import batch_pass, tied
from packfunc.engine.rules import embedding


class TiedLM(nn.Module):
    """Tokens -> embedding (with a padding row) -> mixing -> the embedding's matrix as the head."""

    def __init__(self, vocab: int = 200, width: int = 6):
        super().__init__()
        self.emb = nn.Embedding(vocab, width, padding_idx=0)
        self.mix = nn.Linear(width, width)

    def forward(self, tokens: Tensor) -> Tensor:
        h = torch.tanh(self.mix(self.emb(tokens)))
        return F.linear(h, self.emb.weight).permute(0, 2, 1)  # [N, V, T] logits


class TiedAutoencoder(nn.Module):
    """``W`` encodes (``F.linear``) and decodes (``h @ W``, the weight stored ``[in, out]``)."""

    def __init__(self, width: int = 30, code: int = 20):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(code, width) / 5)
        self.head = nn.Linear(width, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(torch.tanh(F.linear(x, self.weight)) @ self.weight).mean(1))


def _tied_lm_problem(n: int):
    torch.manual_seed(0)
    model = TiedLM().double()
    tokens = torch.randint(0, 200, (n, 5))
    tokens[:, 1] = tokens[:, 3]  # a row met twice within a sample
    tokens[0, 4] = 0  # the padding row
    return model, tokens, torch.randint(0, 200, (n, 5))


def _autoencoder_problem(n: int):
    torch.manual_seed(0)
    return (
        TiedAutoencoder().double(),
        torch.randn(n, 2, 30, dtype=torch.float64),
        torch.randint(0, 3, (n,)),
    )


@pytest.fixture
def spied(monkeypatch):
    """Counts the Gram forms taken; refuses forming an embedding's per-sample gradients."""
    taken = []
    gram = tied.tied_squared_norms

    def counted(*args, **kwargs):
        taken.append(True)
        return gram(*args, **kwargs)

    def refused(*args, **kwargs):
        raise AssertionError("the tied weight's per-sample gradients were formed")

    monkeypatch.setattr(batch_pass, "tied_squared_norms", counted)
    monkeypatch.setattr(embedding.EmbeddingWeight, "columns", refused)
    return taken


@pytest.mark.parametrize("n", [1, 4])
@pytest.mark.parametrize("problem", [_tied_lm_problem, _autoencoder_problem])
def test_tied_weights_have_exact_norms_without_per_sample_gradients(spied, problem, n):
    model, X, y = problem(n)
    summed = nn.CrossEntropyLoss(reduction="sum")
    model_fn, params = pf.functional(model)
    expected = autograd_batch_grad(model, summed, X, y)
    norms = {k: g.flatten(1).square().sum(1) for k, g in expected.items()}
    found = pf.batch_l2_grad(model_fn, params, X, y, loss=summed)
    assert_trees_close(found, norms, "batch_l2_grad")
    clipped = pf.clipped_grad(model_fn, params, X, y, loss=summed, max_norm=0.5)
    per_sample = pf.clip_per_sample(expected, 0.5)
    assert_trees_close(clipped, {k: g.sum(0) for k, g in per_sample.items()}, "clipped_grad")
    assert spied


def test_few_rows_form_the_gradients_instead():
    # a vocabulary of 3 rows: forming [n, 3, D] costs less than the positions' Gram matrices
    ids, delta = torch.randint(0, 3, (2, 8)), torch.randn(2, 8, 4)
    v, u = torch.randn(2, 8, 3), torch.randn(2, 8, 4)
    assert not tied.tied_gram_is_cheaper([(ids, delta), (v, u)], rows=3)


@settings(SETTINGS, max_examples=25)
@given(
    n=st.integers(1, 3),
    lengths=st.lists(st.integers(1, 4), min_size=2, max_size=3),
    one_hot=st.lists(st.booleans(), min_size=3, max_size=3),
    rows=st.integers(30, 60),
)
def test_tied_squared_norms_equal_the_formed_gradients(n, lengths, one_hot, rows):
    torch.manual_seed(0)
    cols = 3
    factors, formed = [], torch.zeros(n, rows, cols, dtype=torch.float64)
    for length, hot in zip(lengths, one_hot):
        b = torch.randn(n, length, cols, dtype=torch.float64)
        if hot:
            a = torch.randint(0, 4, (n, length))  # few rows: repeated within and across calls
            a_dense = F.one_hot(a, rows).to(b.dtype)
        else:
            a = a_dense = torch.randn(n, length, rows, dtype=torch.float64)
        factors.append((a, b))
        formed += a_dense.mT @ b
    found = tied.tied_squared_norms(factors, rows)
    torch.testing.assert_close(found, formed.square().sum((1, 2)))
    # where positions cancel, the gradients are formed instead: the same ones
    torch.testing.assert_close(tied._gradients(factors, torch.arange(n), rows), formed)


class GPT2Sequence(nn.Module):
    """Hugging Face GPT-2 (its embedding tied to the head) with ``[N, V, T]`` logits."""

    def __init__(self, vocab: int = 300):
        super().__init__()
        import transformers as hf

        # eval mode: no dropout
        config = hf.GPT2Config(vocab_size=vocab, n_embd=8, n_layer=1, n_head=2, n_positions=8)
        self.model = hf.GPT2LMHeadModel(config)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.model(tokens).logits.permute(0, 2, 1)


@pytest.mark.parametrize("n", [1, 3])
def test_hugging_face_gpt2_with_ignored_targets_takes_the_gram_form(spied, n):
    torch.manual_seed(0)
    model = GPT2Sequence().double().eval()
    X, y = torch.randint(0, 300, (n, 6)), torch.randint(0, 300, (n, 6))
    y[:, :2] = -100  # a prompt whose tokens are not predicted
    summed = nn.CrossEntropyLoss(reduction="sum", ignore_index=-100)
    model_fn, params = pf.functional(model)
    expected = autograd_batch_grad(model, summed, X, y)
    norms = {k: g.flatten(1).square().sum(1) for k, g in expected.items()}
    assert_trees_close(pf.batch_l2_grad(model_fn, params, X, y, loss=summed), norms, "norms")
    clipped = pf.clipped_grad(model_fn, params, X, y, loss=summed, max_norm=0.5)
    per_sample = pf.clip_per_sample(expected, 0.5)
    assert_trees_close(clipped, {k: g.sum(0) for k, g in per_sample.items()}, "clipped_grad")
    assert spied
