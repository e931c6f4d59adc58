"""More Hugging Face architectures, from tiny configs: first-order quantities and clipped sums.

Beyond the seven models of ``tests/cases.py`` (which every quantity sees), these cover
what those do not: ALiBi (BLOOM), parallel attention (Falcon), learned positions with an
offset (OPT), disentangled relative attention (DeBERTa-v2), an encoder-decoder classifier
pooling at the EOS token (BART), a mixture of experts with top-2 routing (Mixtral), a
selective state-space scan (Mamba), shifted-window attention (Swin), depthwise
convolutions with layer scale (ConvNeXt), eval-mode batch norm (ResNet), a convolutional
speech front end with group norm, a weight-normed positional convolution and padded frames
zeroed by mask (Wav2Vec2), one layer's weights shared by every depth (ALBERT), tanh-capped
attention scores and logits (Gemma 2), rotary embeddings on half of each head beside a
parallel residual (GPT-NeoX) and sliding-window attention (ModernBERT). Each is checked
in float64 against a per-sample autograd loop: per-sample gradients, their squared norms
and the clipped sum of DP-SGD.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

import packfunc as pf
from tests.cases import assert_trees_close, autograd_batch_grad

hf = pytest.importorskip("transformers")

VOCAB = 20
TOKENS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


class Logits(nn.Module):
    """A model's logits ``[N, C]``: of the last position for causal LMs (with the padding
    mask where ``masked``), as they are for classifiers."""

    def __init__(self, model: nn.Module, last: bool, masked: bool = True) -> None:
        super().__init__()
        self.model, self.last, self.masked = model, last, masked

    def forward(self, x: Tensor) -> Tensor:
        if x.is_floating_point():
            return self.model(x).logits
        mask = {"attention_mask": (x != 0).long()} if self.masked else {}
        logits = self.model(input_ids=x, **mask).logits
        return logits[:, -1] if self.last else logits


def _tokens(n: int, eos: int | None = None) -> Tensor:
    """Tokens ``[n, 5]``; every other sequence ends in padding (after its EOS if given)."""
    tokens = torch.randint(3, VOCAB, (n, 5))
    if eos is not None:
        tokens[:, -1] = eos
        tokens[::2, -3] = eos
    tokens[::2, -2:] = 0
    return tokens


def _resnet() -> nn.Module:
    config = hf.ResNetConfig(
        num_channels=2,
        embedding_size=8,
        hidden_sizes=[8],
        depths=[1],
        layer_type="basic",
        num_labels=3,
    )
    model = hf.ResNetForImageClassification(config)
    with torch.no_grad():  # running statistics other than the initial ones
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.running_mean.uniform_(-0.5, 0.5)
                module.running_var.uniform_(0.5, 1.5)
    return Logits(model, last=False)


class AudioLogits(nn.Module):
    """A speech classifier's logits on raw audio ``[N, T]``, its padding (zeros) masked."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor) -> Tensor:
        return self.model(input_values=x, attention_mask=(x != 0).long()).logits


def _audio(n: int) -> Tensor:
    """Raw audio ``[n, 120]``; every other sample padded with zeros after 70 steps."""
    audio = torch.randn(n, 120)
    audio[::2, 70:] = 0.0
    return audio


def _wav2vec2() -> nn.Module:
    config = hf.Wav2Vec2Config(
        hidden_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=16,
        conv_dim=(4, 4),
        conv_stride=(5, 2),
        conv_kernel=(10, 3),
        num_conv_pos_embeddings=4,
        num_conv_pos_embedding_groups=2,
        feat_extract_norm="group",
        num_labels=3,
        classifier_proj_size=8,
        mask_time_prob=0.0,
    )
    return AudioLogits(hf.Wav2Vec2ForSequenceClassification(config))


SMALL = {"vocab_size": VOCAB, "hidden_size": 8, "num_hidden_layers": 1}
HEADS = {"num_attention_heads": 2, "intermediate_size": 16}

MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[int], Tensor]]] = {
    "bloom": (
        lambda: Logits(
            hf.BloomForCausalLM(
                hf.BloomConfig(vocab_size=VOCAB, hidden_size=8, n_layer=1, n_head=2, **TOKENS)
            ),
            last=True,
        ),
        _tokens,
    ),
    "falcon": (
        lambda: Logits(
            hf.FalconForCausalLM(
                hf.FalconConfig(**SMALL, num_attention_heads=2, max_position_embeddings=8, **TOKENS)
            ),
            last=True,
        ),
        _tokens,
    ),
    "opt": (
        lambda: Logits(
            hf.OPTForCausalLM(
                hf.OPTConfig(
                    **SMALL,
                    ffn_dim=16,
                    num_attention_heads=2,
                    word_embed_proj_dim=8,
                    max_position_embeddings=8,
                    **TOKENS,
                )
            ),
            last=True,
        ),
        _tokens,
    ),
    "deberta_v2": (
        lambda: Logits(
            hf.DebertaV2ForSequenceClassification(
                hf.DebertaV2Config(
                    **SMALL,
                    **HEADS,
                    max_position_embeddings=8,
                    relative_attention=True,
                    position_buckets=4,
                    max_relative_positions=8,
                    pos_att_type=["p2c", "c2p"],
                    pooler_hidden_size=8,
                    num_labels=3,
                    pad_token_id=0,
                )
            ),
            last=False,
        ),
        _tokens,
    ),
    "bart": (
        lambda: Logits(
            hf.BartForSequenceClassification(
                hf.BartConfig(
                    vocab_size=VOCAB,
                    d_model=8,
                    encoder_layers=1,
                    decoder_layers=1,
                    encoder_attention_heads=2,
                    decoder_attention_heads=2,
                    encoder_ffn_dim=16,
                    decoder_ffn_dim=16,
                    max_position_embeddings=8,
                    num_labels=3,
                    decoder_start_token_id=2,
                    **TOKENS,
                )
            ),
            last=False,
        ),
        lambda n: _tokens(n, eos=2),
    ),
    "mixtral": (
        lambda: Logits(
            hf.MixtralForCausalLM(
                hf.MixtralConfig(
                    **SMALL,
                    **HEADS,
                    num_key_value_heads=1,
                    num_local_experts=4,
                    num_experts_per_tok=2,
                    max_position_embeddings=8,
                    experts_implementation="eager",
                    **TOKENS,
                )
            ),
            last=True,
        ),
        _tokens,
    ),
    "mamba": (
        lambda: Logits(
            hf.MambaForCausalLM(
                hf.MambaConfig(
                    vocab_size=VOCAB,
                    hidden_size=8,
                    state_size=4,
                    num_hidden_layers=1,
                    expand=2,
                    conv_kernel=4,
                    time_step_rank=2,
                    use_mambapy=False,
                    **TOKENS,
                )
            ),
            last=True,
            masked=False,
        ),
        _tokens,
    ),
    "swin": (
        lambda: Logits(
            hf.SwinForImageClassification(
                hf.SwinConfig(
                    image_size=8,
                    patch_size=2,
                    num_channels=2,
                    embed_dim=8,
                    depths=[1],
                    num_heads=[2],
                    window_size=2,
                    mlp_ratio=2.0,
                    num_labels=3,
                )
            ),
            last=False,
        ),
        lambda n: torch.randn(n, 2, 8, 8),
    ),
    "convnext": (
        lambda: Logits(
            hf.ConvNextForImageClassification(
                hf.ConvNextConfig(
                    num_channels=2,
                    patch_size=2,
                    hidden_sizes=[8],
                    depths=[1],
                    num_stages=1,
                    image_size=8,
                    num_labels=3,
                    layer_scale_init_value=0.5,
                )
            ),
            last=False,
        ),
        lambda n: torch.randn(n, 2, 8, 8),
    ),
    "resnet": (_resnet, lambda n: torch.randn(n, 2, 16, 16)),
    "wav2vec2": (_wav2vec2, _audio),
    "albert": (
        lambda: Logits(
            hf.AlbertForSequenceClassification(
                hf.AlbertConfig(
                    vocab_size=VOCAB,
                    embedding_size=4,
                    hidden_size=8,
                    num_hidden_layers=3,  # one layer's weights at every depth
                    **HEADS,
                    max_position_embeddings=8,
                    num_labels=3,
                    pad_token_id=0,
                )
            ),
            last=False,
        ),
        _tokens,
    ),
    "gemma2": (
        lambda: Logits(
            hf.Gemma2ForCausalLM(
                hf.Gemma2Config(
                    **SMALL,
                    **HEADS,
                    num_key_value_heads=1,
                    head_dim=4,
                    attn_logit_softcapping=5.0,  # tanh-capped attention scores
                    final_logit_softcapping=3.0,
                    **TOKENS,
                )
            ),
            last=True,
        ),
        _tokens,
    ),
    "gpt_neox": (
        lambda: Logits(
            hf.GPTNeoXForCausalLM(
                hf.GPTNeoXConfig(**SMALL, **HEADS, rotary_pct=0.5, **TOKENS)  # half rotary
            ),
            last=True,
        ),
        _tokens,
    ),
    "modernbert": (
        lambda: Logits(
            hf.ModernBertForSequenceClassification(
                hf.ModernBertConfig(
                    **(SMALL | {"num_hidden_layers": 2}),
                    **HEADS,
                    num_labels=3,
                    global_attn_every_n_layers=2,  # the second layer's attention is local:
                    local_attention=4,  # a sliding window of 2 each side
                    cls_token_id=1,
                    sep_token_id=2,
                    **TOKENS,
                )
            ),
            last=False,
        ),
        _tokens,
    ),
}
"""Name -> (build the model, a batch of ``n`` inputs)."""

TOLERANCES = {"rtol": 1e-5, "atol": 1e-8}
"""Mixtral's RMSNorm computes in float32 and Mamba's head returns float32 logits."""


def _problem(name: str, n: int = 3) -> tuple[nn.Module, Tensor, Tensor]:
    """``(model, X, y)`` in float64 and eval mode, with class targets."""
    torch.manual_seed(0)
    build, inputs = MODELS[name]
    model = build().double().eval()
    X = inputs(n)
    X = X.double() if X.is_floating_point() else X
    with torch.no_grad():
        y = torch.randint(0, model(X).shape[1], (n,))
    return model, X, y


@pytest.mark.parametrize("name", list(MODELS))
def test_per_sample_gradients_norms_and_clipped_sums_match_autograd(name: str) -> None:
    model, X, y = _problem(name)
    loss = nn.CrossEntropyLoss(reduction="sum")
    expected = autograd_batch_grad(model, loss, X, y)
    model_fn, params = pf.functional(model)
    found = pf.compute(
        model_fn, params, X, y, quantities=("batch_grad", "batch_l2_grad"), loss=loss
    )
    assert_trees_close(found["batch_grad"], expected, name, **TOLERANCES)
    norms = sum(g.reshape(len(g), -1).square().sum(1) for g in expected.values())
    assert_trees_close(sum(found["batch_l2_grad"].values()), norms, name, **TOLERANCES)
    max_norm = float(norms.sqrt().median())  # clips one sample of three
    clipped = pf.clipped_grad(model_fn, params, X, y, loss=loss, max_norm=max_norm)
    by_clipping = {k: g.sum(0) for k, g in pf.clip_per_sample(expected, max_norm).items()}
    assert_trees_close(clipped, by_clipping, name, **TOLERANCES)


def test_opt_feed_forward_on_flat_rows_takes_the_closed_forms() -> None:
    """OPT flattens its tokens (``[N·T, d]``) for the feed-forward block's layer norm and two
    linear layers: they run on the rows' source, so no parameter takes the whole-model
    path, and dropout in training mode is that of the batch's own forward."""
    model, X, y = _problem("opt")
    model_fn, params = pf.functional(model)
    paths = pf.explain(model_fn, params, X)
    assert not [name for name, path in paths.items() if path.startswith("whole model")], paths
    torch.manual_seed(0)
    build, _ = MODELS["opt"]
    model = build().double().train()
    for module in model.modules():  # dropout everywhere: 0.1
        if hasattr(module, "dropout") and isinstance(module.dropout, float):
            module.dropout = 0.1
    with torch.no_grad():
        assert not torch.equal(model(X), model(X))  # dropout draws
    model_fn, params = pf.functional(model)
    loss = nn.CrossEntropyLoss(reduction="sum")
    torch.manual_seed(1)
    found = pf.batch_grad(model_fn, params, X, y, loss=loss)
    torch.manual_seed(1)  # the same forward, row by row
    out = model(X)
    for n in range(len(X)):
        rows = torch.autograd.grad(
            loss(out[n : n + 1], y[n : n + 1]),
            list(model.parameters()),
            retain_graph=True,
            allow_unused=True,
        )
        for (name, p), g in zip(model.named_parameters(), rows):
            expected = torch.zeros_like(p) if g is None else g
            torch.testing.assert_close(found[name][n], expected, **TOLERANCES)


def test_wav2vec2s_zeroed_padding_keeps_the_layers_after_it_on_their_closed_forms() -> None:
    """``hidden_states[~mask] = 0`` is a masked fill: no layer runs each sample alone."""
    model, X, _ = _problem("wav2vec2")
    model_fn, params = pf.functional(model)
    paths = pf.explain(model_fn, params, X)
    assert not [name for name, path in paths.items() if path.startswith("whole model")], paths
