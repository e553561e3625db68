"""A GPT-style causal language model whose token mixers are Synthesizers — read it top to bottom.

Legend: B batch, n length, d width, V vocabulary, V/TP the vocabulary slice of this tensor-parallel rank.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from . import parallel as tp
from .config import ConfigError, ModelConfig
from .mixers import SpatialGatingMixer, SynthesizedAttention
from .synthesizers import linear_flops


class MLP(nn.Module):
    """MLP(x) = GELU(x W_1 + b_1) W_2 + b_2; W_1: d → d_ffn column-parallel, W_2: d_ffn → d row-parallel."""

    def __init__(self, cfg: ModelConfig, n_layers_scale: float):
        super().__init__()
        self.fc = tp.column_linear(cfg.d_model, cfg.d_ffn, cfg.bias, cfg.init_std)
        self.proj = tp.row_linear(cfg.d_ffn, cfg.d_model, cfg.bias, cfg.init_std * n_layers_scale)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))

    def flops(self, n):
        return linear_flops(self.fc) + linear_flops(self.proj)


class Block(nn.Module):
    """Pre-norm block: x + Mixer(LN(x)), then x + MLP(LN(x)) — or, with `block: gmlp`, the gMLP block
    x + SGU-Mixer(LN(x)) with the d → d_ffn → d_ffn/2 → d projections inside the mixer and no MLP."""

    def __init__(self, cfg: ModelConfig, mixer: str, checkpoint: bool = False):
        super().__init__()
        self.checkpoint = checkpoint   # activation checkpointing: keep only the input, recompute in backward
        scale = 1 / math.sqrt(2 * cfg.n_layers)   # GPT-2: residual projections shrink with depth
        self.ln_1 = tp.layer_norm(cfg.d_model, cfg.norm_eps)
        if cfg.block == "gmlp":
            self.mixer = SpatialGatingMixer(cfg, cfg.d_ffn // 2, scale)
            self.ln_2, self.mlp = None, None
        else:
            self.mixer = (SpatialGatingMixer(cfg, cfg.d_model, scale) if mixer == "sgu"
                          else SynthesizedAttention(cfg, mixer, scale))
            self.ln_2, self.mlp = tp.layer_norm(cfg.d_model, cfg.norm_eps), MLP(cfg, scale)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        if self.checkpoint and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)

    def _forward(self, x):
        x = x + self.drop(self.mixer(self.ln_1(x)))
        if self.mlp is not None:
            x = x + self.drop(self.mlp(self.ln_2(x)))
        return x

    def attention_map(self, x):
        """(output, map (B, Hl, n, n)) computed on the materialized path."""
        y, A = self.mixer(self.ln_1(x), return_map=True)
        x = x + self.drop(y)
        if self.mlp is not None:
            x = x + self.drop(self.mlp(self.ln_2(x)))
        return x, A

    def train_flops(self, n):
        """Forward + backward FLOPs per token of this block."""
        return self.mixer.train_flops(n) + (3 * self.mlp.flops(n) if self.mlp is not None else 0)


class SynthesizerLM(nn.Module):
    """Token embedding (vocab-parallel) [+ learned positions] → blocks → LN → output head (vocab-parallel).

    forward(tokens (B, n)) → logits (B, n, V/TP); forward(tokens, targets) → mean cross-entropy (scalar),
    computed by vocab_parallel_cross_entropy without gathering the vocabulary.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        d, V, L = cfg.d_model, cfg.vocab_size, cfg.max_seq_len
        tp.split_size(V, "model.vocab_size")
        tp.split_size(cfg.n_heads, "model.n_heads")
        tp.split_size(cfg.d_ffn, "model.d_ffn")
        self.wte = tp.vocab_embedding(V, d, cfg.init_std)
        self.wpe = None
        if cfg.position == "learned":
            self.wpe = nn.Embedding(L, d)
            tp.annotate(self.wpe.weight, tp.normal(cfg.init_std))
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, m) for m in cfg.layer_mixers())
        self.ln_f = tp.layer_norm(d, cfg.norm_eps)
        self.head = None if cfg.tie_embeddings else tp.column_linear(d, V, False, cfg.init_std)

    def embed(self, tokens):
        n = tokens.shape[1]
        if n > self.cfg.max_seq_len:
            raise ValueError(f"sequence length n={n} exceeds model.max_seq_len L={self.cfg.max_seq_len}; "
                             "shorten the input or train a model with a larger max_seq_len")
        x = self.wte(tokens)                                             # (B, n, d)
        if self.wpe is not None:
            x = x + self.wpe.weight[:n]
        return self.drop(x)

    def logits(self, x):
        x = tp.copy_to_tp(self.ln_f(x))                                  # (B, n, d), grads all-reduced over TP
        weight = self.wte.weight if self.head is None else self.head.weight   # (V/TP, d)
        return x @ weight.T                                              # (B, n, V/TP)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        logits = self.logits(x)
        if targets is None:
            return logits
        return tp.cross_entropy(logits, targets).mean()

    @torch.no_grad()
    def attention_maps(self, tokens: torch.Tensor) -> list[torch.Tensor]:
        """Per layer, the synthesized maps (B, Hl, n, n) of this rank's heads (SGU: its causal W)."""
        x, maps = self.embed(tokens), []
        for block in self.blocks:
            x, A = block.attention_map(x)
            maps.append(A)
        return maps

    def train_flops_per_token(self, n: int) -> dict:
        """Forward + backward FLOPs per token (2 per multiply-add, full n² terms) per layer and for the head."""
        d, V = self.cfg.d_model, self.cfg.vocab_size
        return {"layers": [b.train_flops(n) for b in self.blocks], "head": 3 * 2 * d * V}


def build_model(cfg: ModelConfig, seed: int | None = None) -> SynthesizerLM:
    """The model for this TP rank (TP=1 without a process group), initialised from `seed` (default cfg.seed)."""
    if not isinstance(cfg, ModelConfig):
        raise ConfigError(f"build_model needs a ModelConfig, got {type(cfg).__name__}")
    model = SynthesizerLM(cfg)
    tp.init_from_seed(model, cfg.seed if seed is None else seed)
    return model
