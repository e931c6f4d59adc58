"""Benchmark problems: a seeded model, a batch ``(X, y)`` and the loss.

Every contender gets its own :meth:`Problem.model` copy (BackPACK and opacus
install hooks on the modules they are given), all with identical parameters.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

SEED = 0


@dataclass
class Problem:
    """A model with fixed parameters, one batch and a loss.

    ``trainable`` names the parameters every quantity is taken of (``None``:
    all; the rest is a frozen backbone). ``kronecker`` names those that
    Kronecker rows (``kfac``) are restricted to, so that every contender
    computes the same set; ``kfac_approx`` is packfunc's convention for them
    (``"sum"``: BackPACK's; ``"expand"`` where curvlinops is compared).
    ``max_repeats`` caps the timed repeats of an expensive problem.
    """

    name: str
    base: nn.Module
    X: Tensor
    y: Tensor
    make_loss: Callable[[], nn.Module] = field(
        default=lambda: nn.CrossEntropyLoss(reduction="mean")
    )
    trainable: tuple[str, ...] | None = None
    kronecker: tuple[str, ...] | None = None
    kfac_approx: str = "sum"
    max_repeats: int | None = None

    @property
    def n(self) -> int:
        """The batch size."""
        return self.X.shape[0]

    @property
    def device(self) -> torch.device:
        """Where the batch (and the model) live."""
        return self.X.device

    def model(self) -> nn.Module:
        """Return a fresh copy of the model (same parameters, no hooks).

        Parameters outside :attr:`trainable` do not require grad in the copy.
        """
        model = copy.deepcopy(self.base)
        frozen = set(dict(model.named_parameters())) - set(self.parameter_names())
        for name, parameter in model.named_parameters():
            parameter.requires_grad_(name not in frozen)
        return model

    def loss(self) -> nn.Module:
        """Return a fresh loss module."""
        return self.make_loss()

    def parameter_names(self, quantity: str = "") -> tuple[str, ...]:
        """The parameters ``quantity`` is computed for (all contenders alike).

        Args:
            quantity: A row's quantity; Kronecker rows use :attr:`kronecker`.

        Returns:
            Parameter names in the model's order.

        Example:
            >>> tanh_mlp(n=2).parameter_names()[:2]
            ('0.weight', '0.bias')
        """
        names = tuple(name for name, _ in self.base.named_parameters())
        if quantity in KRONECKER_QUANTITIES and self.kronecker is not None:
            return tuple(name for name in names if name in self.kronecker)
        if self.trainable is not None:
            return tuple(name for name in names if name in self.trainable)
        return names

    def to(self, device: str | torch.device) -> Problem:
        """Move the model and the batch to ``device`` (in place); return ``self``."""
        self.base.to(device)
        self.X, self.y = self.X.to(device), self.y.to(device)
        return self


KRONECKER_QUANTITIES = ("kfac", "kflr", "kfra", "ekfac", "ekfac_exact")
"""Quantities restricted to :attr:`Problem.kronecker` where a problem sets it."""


def mlp(n: int = 128) -> Problem:
    torch.manual_seed(SEED)
    model = nn.Sequential(
        nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
    )
    X, y = torch.randn(n, 784), torch.randint(0, 10, (n,))
    return Problem("MLP", model, X, y)


def cnn(n: int = 64) -> Problem:
    torch.manual_seed(SEED)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 8 * 8, 10),
    )
    X, y = torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,))
    return Problem("CNN", model, X, y)


def tanh_mlp(n: int = 32) -> Problem:
    torch.manual_seed(SEED)
    model = nn.Sequential(
        nn.Linear(784, 128), nn.Tanh(), nn.Linear(128, 64), nn.Tanh(), nn.Linear(64, 10)
    )
    X, y = torch.randn(n, 784), torch.randint(0, 10, (n,))
    return Problem("tanh MLP", model, X, y)


# ----------------------------------------------------------------------------- models


class LearnedPosition(nn.Module):
    """Adds a learned position embedding (an ``nn.Parameter`` ``[T, width]``) to ``[N, T, width]``.

    A module of its own, so hook-based peers (opacus) can attribute the parameter.
    """

    def __init__(self, length: int, width: int):
        super().__init__()
        self.weight = nn.Parameter(0.02 * torch.randn(length, width))

    def forward(self, x: Tensor) -> Tensor:
        """``x + weight`` (broadcast over the batch)."""
        return x + self.weight


class TokenLM(nn.Module):
    """Pre-norm Transformer language model; logits come out as ``[N, vocab, T]``."""

    def __init__(self, vocab: int, width: int, length: int, heads: int, hidden: int, layers: int):
        super().__init__()
        self.embedding = nn.Embedding(vocab, width)
        self.position = LearnedPosition(length, width)
        self.layers = nn.Sequential(
            *[
                nn.TransformerEncoderLayer(
                    width, heads, hidden, dropout=0.0, batch_first=True, norm_first=True
                )
                for _ in range(layers)
            ]
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: Tensor) -> Tensor:
        """``[N, T]`` token ids -> ``[N, vocab, T]`` logits."""
        hidden = self.layers(self.position(self.embedding(tokens)))
        return self.head(self.norm(hidden)).permute(0, 2, 1)


Norm = Callable[[int], nn.Module]
"""A normalization layer for a channel count (GroupNorm, BatchNorm2d)."""


class ResidualBlock(nn.Module):
    """``relu(shortcut(x) + norm(conv(relu(norm(conv(x))))))``.

    The shortcut is the identity, or a 1×1 conv + norm where the shape changes.
    """

    def __init__(self, channels: int, norm: Norm, out_channels: int | None = None, stride: int = 1):
        super().__init__()
        out = out_channels or channels
        self.conv1 = nn.Conv2d(channels, out, 3, stride=stride, padding=1, bias=False)
        self.norm1 = norm(out)
        self.conv2 = nn.Conv2d(out, out, 3, padding=1, bias=False)
        self.norm2 = norm(out)
        self.shortcut = (
            nn.Sequential(nn.Conv2d(channels, out, 1, stride=stride, bias=False), norm(out))
            if stride != 1 or out != channels
            else nn.Identity()
        )

    def forward(self, x: Tensor) -> Tensor:
        """The block's output."""
        inner = self.norm2(self.conv2(torch.relu(self.norm1(self.conv1(x)))))
        return torch.relu(self.shortcut(x) + inner)


def _stem(channels: int, norm: Norm) -> nn.Sequential:
    conv = nn.Conv2d(3, channels, 3, padding=1, bias=False)
    return nn.Sequential(conv, norm(channels), nn.ReLU())


def _classifier(channels: int, classes: int = 10) -> nn.Sequential:
    return nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, classes))


def resnet(norm: Norm, width: int = 16) -> nn.Sequential:
    """Stem, two residual blocks of ``width`` channels, stride-2 conv to ``2·width``, head."""
    return nn.Sequential(
        _stem(width, norm),
        ResidualBlock(width, norm),
        ResidualBlock(width, norm),
        nn.Conv2d(width, 2 * width, 3, stride=2, padding=1),
        nn.ReLU(),
        _classifier(2 * width),
    )


def small_resnet(width: int = 8) -> nn.Sequential:
    """Two-block BatchNorm ResNet; ``width=8``: 5,266 parameters.

    Stem conv (3→w) + BN, a block of ``w`` channels, a stride-2 block to ``2w`` with a 1×1
    conv + BN shortcut, pool, linear to 10 classes.
    """
    return nn.Sequential(
        _stem(width, nn.BatchNorm2d),
        ResidualBlock(width, nn.BatchNorm2d),
        ResidualBlock(width, nn.BatchNorm2d, out_channels=2 * width, stride=2),
        _classifier(2 * width),
    )


def with_running_statistics(model: nn.Module, batch: Tensor, rounds: int = 3) -> nn.Module:
    """Give BatchNorm non-trivial running statistics (training forwards), then ``eval()``.

    Args:
        model: A model with BatchNorm layers.
        batch: Inputs for the training-mode forwards; shifted and scaled so that
            the statistics differ from the default ``(0, 1)``.
        rounds: Training-mode forwards.

    Returns:
        ``model``, in eval mode.

    Example:
        >>> bn = with_running_statistics(nn.BatchNorm1d(2), torch.randn(8, 2))
        >>> bool(bn.running_mean.abs().sum() > 0), bn.training
        (True, False)
    """
    with torch.no_grad():
        for _ in range(rounds):
            model.train()(0.5 + 2.0 * batch)
    return model.eval()


class LastStepLSTM(nn.Module):
    """Embedding, one LSTM layer and a linear head on the last step's output."""

    def __init__(self, vocab: int, width: int, hidden: int, classes: int):
        super().__init__()
        self.embedding = nn.Embedding(vocab, width)
        self.lstm = nn.LSTM(width, hidden, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, tokens: Tensor) -> Tensor:
        """``[N, T]`` token ids -> ``[N, classes]`` logits of the last step."""
        out, _ = self.lstm(self.embedding(tokens))
        return self.head(out[:, -1])


def called_layer_parameters(
    model: nn.Module, X: Tensor, kinds: tuple[type[nn.Module], ...] = (nn.Linear, nn.Conv2d)
) -> tuple[str, ...]:
    """Names of the parameters of ``kinds`` layers whose ``forward`` runs on ``X``.

    Kronecker peers (curvlinops) hook module calls; a layer whose weight is used
    without calling it (``MultiheadAttention.out_proj``) has no factors there.

    Args:
        model: The model.
        X: A batch to run it on.
        kinds: Layer types to look for.

    Returns:
        Parameter names, in the model's order.

    Example:
        >>> net = nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 1))
        >>> called_layer_parameters(net, torch.randn(4, 2))
        ('0.weight', '0.bias', '2.weight', '2.bias')
    """
    called: set[str] = set()
    names = {module: name for name, module in model.named_modules()}
    handles = [
        module.register_forward_hook(lambda m, *_: called.add(names[m]))
        for module in names
        if isinstance(module, kinds)
    ]
    try:
        with torch.no_grad():
            model(X)
    finally:
        for handle in handles:
            handle.remove()
    return tuple(name for name, _ in model.named_parameters() if name.rpartition(".")[0] in called)


# ----------------------------------------------------------------------------- new problems


def lm(n: int = 16, length: int = 32, vocab: int = 256, width: int = 64) -> Problem:
    """Two pre-norm Transformer layers (4 heads, MLP 128) on random tokens; ``[N, V, T]`` logits."""
    torch.manual_seed(SEED)
    model = TokenLM(vocab, width, length, heads=4, hidden=2 * width, layers=2)
    X, y = torch.randint(0, vocab, (n, length)), torch.randint(0, vocab, (n, length))
    return Problem(
        "LM", model, X, y, kronecker=called_layer_parameters(model, X), kfac_approx="expand"
    )


def resnet_gn(n: int = 32, width: int = 16, size: int = 32) -> Problem:
    """GroupNorm ResNet (``resnet`` with ``GroupNorm(4, ·)``) on 3×size×size images."""
    torch.manual_seed(SEED)
    model = resnet(lambda channels: nn.GroupNorm(4, channels), width)
    X, y = torch.randn(n, 3, size, size), torch.randint(0, 10, (n,))
    return Problem(
        "ResNet-GN", model, X, y, kronecker=called_layer_parameters(model, X), kfac_approx="expand"
    )


def resnet_bn(n: int = 32, width: int = 16, size: int = 32) -> Problem:
    """BatchNorm ResNet (``resnet`` with ``BatchNorm2d``, eval mode, non-trivial statistics)."""
    torch.manual_seed(SEED)
    model = resnet(nn.BatchNorm2d, width)
    X, y = torch.randn(n, 3, size, size), torch.randint(0, 10, (n,))
    model = with_running_statistics(model, torch.randn(n, 3, size, size))
    return Problem(
        "ResNet-BN", model, X, y, kronecker=called_layer_parameters(model, X), kfac_approx="expand"
    )


def lstm(n: int = 32, length: int = 24, vocab: int = 100) -> Problem:
    """Frozen embedding + LSTM backbone; only the linear head (on the last step) is trainable."""
    torch.manual_seed(SEED)
    model = LastStepLSTM(vocab, 32, 64, 10)
    X, y = torch.randint(0, vocab, (n, length)), torch.randint(0, 10, (n,))
    head = ("head.weight", "head.bias")
    return Problem("LSTM", model, X, y, trainable=head, kronecker=head, kfac_approx="expand")


def resnet_hessian(n: int = 8, width: int = 8, size: int = 8) -> Problem:
    """``small_resnet`` (BatchNorm, eval; 5,266 parameters at ``width=8``) for ``diag_hessian``."""
    torch.manual_seed(SEED)
    model = small_resnet(width)
    X, y = torch.randn(n, 3, size, size), torch.randint(0, 10, (n,))
    model = with_running_statistics(model, torch.randn(n, 3, size, size))
    return Problem("ResNet-BN 5k", model, X, y, max_repeats=2)


# ----------------------------------------------------------------------------- Hugging Face


class HuggingFaceLogits(nn.Module):
    """A ``transformers`` model's logits as one tensor (the loss input).

    Language models give ``[N, V, T]`` (next-token cross-entropy on every position, as
    ``LM``); a classifier gets the padding mask of token id 0 and gives ``[N, C]``.
    """

    def __init__(self, model: nn.Module, masked: bool):
        super().__init__()
        self.model, self.masked = model, masked

    def forward(self, x: Tensor) -> Tensor:
        """The logits of ``x``'s tokens."""
        if self.masked:
            return self.model(input_ids=x, attention_mask=(x != 0).long()).logits
        return self.model(x).logits.transpose(1, 2)


def _hf_config(kind: str, width: int, layers: int, vocab: int, length: int) -> Any:
    """A small ``transformers`` config (random weights: nothing is downloaded)."""
    import transformers as hf

    if kind == "gpt2":
        return hf.GPT2Config(
            vocab_size=vocab,
            n_embd=width,
            n_layer=layers,
            n_head=4,
            n_positions=length,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    common = {
        "vocab_size": vocab,
        "hidden_size": width,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "intermediate_size": 2 * width,
        "max_position_embeddings": length,
    }
    if kind == "llama":
        return hf.LlamaConfig(**common, num_key_value_heads=2, pad_token_id=0)
    return hf.BertConfig(
        **common, num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
    )


def hugging_face(
    kind: str, n: int = 16, length: int = 64, width: int = 128, layers: int = 2, vocab: int = 1000
) -> Problem:
    """GPT-2 or LLaMA (next-token LM) or BERT (classification, padded) from a small config."""
    import transformers as hf

    torch.manual_seed(SEED)
    config = _hf_config(kind, width, layers, vocab, length)
    classes = {"gpt2": hf.GPT2LMHeadModel, "llama": hf.LlamaForCausalLM}
    model = classes.get(kind, hf.BertForSequenceClassification)(config).eval()
    X = torch.randint(1, vocab, (n, length))
    if kind == "bert":
        X[::2, length // 2 :] = 0  # every other sequence is padded to half its length
        y = torch.randint(0, 2, (n,))
    else:
        y = torch.randint(0, vocab, (n, length))
    wrapped = HuggingFaceLogits(model, masked=kind == "bert")
    name = {"gpt2": "GPT-2", "llama": "LLaMA", "bert": "BERT (mask)"}[kind]
    kronecker = called_layer_parameters(wrapped, X)
    return Problem(name, wrapped, X, y, kronecker=kronecker, kfac_approx="expand")


PROBLEMS: list[Callable[[], Problem]] = [
    mlp,
    cnn,
    tanh_mlp,
    lm,
    resnet_gn,
    resnet_bn,
    lstm,
    resnet_hessian,
    partial(hugging_face, "gpt2"),
    partial(hugging_face, "llama"),
    partial(hugging_face, "bert"),
]
"""Problem factories, in table order."""
