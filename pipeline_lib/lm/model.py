"""The classic PyTorch Transformer language model, laid out as a flat ``nn.Sequential``.

A pipeline cuts a model into consecutive stages, which is trivial when the model is a
list of modules that each take one tensor and return one tensor: any cut between two
children is a valid split. So the embedding, every transformer block and the output
projection are separate top-level children, and each block builds its own causal mask
instead of receiving one as a second argument.
"""

from __future__ import annotations

import math
from typing import Container

import torch
from torch import nn

PRESETS: dict[str, dict[str, float]] = {
    # ~0.25 s per 20 x 35 batch on 2 CPU cores with the mini data's 12k-word vocabulary
    # (~250 steps a minute); the output layer dominates, so the full 29k vocabulary is ~2x.
    "cpu": dict(d_model=128, nhead=4, d_hid=256, nlayers=4, dropout=0.2),
    # The "Training Transformer models using Pipeline Parallelism" tutorial's model:
    # ~1.4 billion parameters with WikiText-2's vocabulary, meant for >= 2 GPUs.
    "tutorial": dict(d_model=4096, nhead=16, d_hid=4096, nlayers=12, dropout=0.2),
}
_INIT_RANGE = 0.1  # the tutorial's uniform init range for the embedding weights


class Embedding(nn.Module):
    """Token ids ``[B, T]`` -> vectors ``[B, T, d_model]`` with positions mixed in.

    Embeddings are scaled by ``sqrt(d_model)`` so that, at the tutorial's small init, they
    are not drowned out by the unit-amplitude sinusoidal position signal.
    """

    def __init__(self, vocab_size: int, d_model: int, dropout: float, max_len: int = 5000) -> None:
        super().__init__()
        self.d_model = d_model
        self.tokens = nn.Embedding(vocab_size, d_model)
        self.dropout = nn.Dropout(dropout)
        position = torch.arange(max_len, dtype=torch.float).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2).float() * (-math.log(10000.0) / d_model))
        pe = torch.zeros(max_len, d_model)
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        # Not persistent: it is a fixed function of the shape, so it stays out of checkpoints.
        self.register_buffer("pe", pe, persistent=False)
        nn.init.uniform_(self.tokens.weight, -_INIT_RANGE, _INIT_RANGE)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        seq_len = ids.size(1)
        if seq_len > self.pe.size(0):
            raise ValueError(
                f"Sequence length {seq_len} exceeds the positional table ({self.pe.size(0)}); "
                "build the model with a larger max_len or use a shorter bptt."
            )
        x = self.tokens(ids) * math.sqrt(self.d_model) + self.pe[:seq_len]
        return self.dropout(x)


class CausalBlock(nn.Module):
    """One ``nn.TransformerEncoderLayer`` that may only look at earlier positions.

    The mask is rebuilt from the input's length on every call rather than cached: it is a
    tiny ``T x T`` tensor, and keeping no state means the block behaves the same on any
    device, under ``torch.device("meta")`` and when traced for pipeline splitting.
    """

    def __init__(self, d_model: int, nhead: int, d_hid: int, dropout: float) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(d_model, nhead, d_hid, dropout, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(
            x.size(1), device=x.device, dtype=x.dtype
        )
        return self.layer(x, src_mask=mask, is_causal=True)


class Decoder(nn.Module):
    """Vectors ``[B, T, d_model]`` -> next-token logits ``[B, T, vocab_size]``.

    Its input comes out of a LayerNorm, unit variance per feature, so a logit's standard
    deviation is the weights' times ``sqrt(d_model)``. The weights are uniform in
    ``+-1/sqrt(d_model)`` (``nn.Linear``'s own default bound), which keeps every logit's
    std at 1/sqrt(3) whatever the width: an untrained model's loss is then close to
    ln(vocab_size), a uniform guess, at width 128 as at the tutorial's 4096. The
    tutorial's fixed +-0.1 gave logits of std 3.7 at width 4096 and a first loss
    about 6.5 nats above a uniform guess (notebook 03, bug 4).
    """

    def __init__(self, vocab_size: int, d_model: int) -> None:
        super().__init__()
        self.linear = nn.Linear(d_model, vocab_size)
        bound = 1 / math.sqrt(d_model)
        nn.init.uniform_(self.linear.weight, -bound, bound)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def transformer_lm(vocab_size: int, preset: str = "cpu", *,
                   layers: Container[int] | None = None, **overrides: float) -> nn.Sequential:
    """Build ``Sequential(Embedding, CausalBlock x nlayers, Decoder)``: ids -> logits.

    ``preset`` picks a row of :data:`PRESETS`; keyword ``overrides`` (``d_model``,
    ``nhead``, ``d_hid``, ``nlayers``, ``dropout``, ``max_len``) replace single values,
    e.g. ``transformer_lm(v, dropout=0.0)``. To size the big preset without allocating
    it, build under ``with torch.device("meta"):`` (which draws no random number).

    ``layers``: the indices of the layers to keep (a pipeline rank's stages); the others
    end on the meta device, shapes without memory. Each layer is built in turn, kept or
    not, so the random generator goes through the same draws as for the whole model:
    a kept layer holds the weights the whole model built from the same seed gives it,
    and the generator ends in the same state. At most one layer that is not kept is
    held at a time.
    """
    if preset not in PRESETS:
        raise ValueError(f"Unknown preset {preset!r}; choose one of {sorted(PRESETS)}.")
    allowed = set(PRESETS[preset]) | {"max_len"}
    unknown = set(overrides) - allowed
    if unknown:
        raise TypeError(f"Unknown option(s) {sorted(unknown)}; allowed: {sorted(allowed)}.")
    cfg = {**PRESETS[preset], **overrides}
    if layers is not None and (isinstance(layers, (int, str)) or not isinstance(layers, Container)):
        raise TypeError(
            f"layers= takes the indices of the layers to keep (e.g. range(0, 3)), got {layers!r}; "
            "to set how many Transformer layers the model has, pass nlayers= instead.")
    d_model, nhead, nlayers = int(cfg["d_model"]), int(cfg["nhead"]), int(cfg["nlayers"])
    if vocab_size < 1 or nlayers < 1:
        raise ValueError(f"vocab_size and nlayers must be >= 1, got {vocab_size} and {nlayers}.")
    if d_model % nhead or d_model % 2:
        raise ValueError(
            f"d_model ({d_model}) must be even and divisible by nhead ({nhead}) so the "
            "attention heads and the sin/cos position table split it evenly."
        )
    makers = [lambda: Embedding(vocab_size, d_model, cfg["dropout"], int(cfg.get("max_len", 5000))),
              *[lambda: CausalBlock(d_model, nhead, int(cfg["d_hid"]), cfg["dropout"])] * nlayers,
              lambda: Decoder(vocab_size, d_model)]
    return nn.Sequential(*(make() if layers is None or i in layers else make().to("meta")
                           for i, make in enumerate(makers)))
