"""A GPT-style causal language model whose token mixers are Synthesizers — read it top to bottom.

Legend: B batch, n length (m positions t0 … t0+m−1 of it when decoding), d width, V vocabulary, V/TP the vocabulary
slice of this tensor-parallel rank.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import parallel as tp
from .config import ConfigError, ModelConfig
from .context import loss as split_loss, splits   # `from . import context` is not what transformers' loader reads
from .documents import Documents
from .linear_cross_entropy import linear_cross_entropy
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
    x + SGU-Mixer(LN(x)) with the d → d_ffn → d_ffn/2 → d projections inside the mixer and no MLP.
    forward(x (B, m, d) at positions t0…, cache of the positions before t0 when decoding, the window's documents
    under model.document_mask) → (B, m, d)."""

    def __init__(self, cfg: ModelConfig, mixer: str):
        super().__init__()
        scale = 1 / math.sqrt(2 * cfg.n_layers)   # GPT-2: residual projections shrink with depth
        self.ln_1 = tp.layer_norm(cfg.d_model, cfg.norm_eps)
        if cfg.block == "gmlp":
            self.mixer = SpatialGatingMixer(cfg, cfg.d_ffn // 2, scale)
            self.ln_2, self.mlp = None, None
        else:
            self.mixer = (SpatialGatingMixer(cfg, cfg.d_model, scale) if mixer == "sgu"
                          else SynthesizedAttention(cfg, mixer, scale))
            self.ln_2, self.mlp = tp.layer_norm(cfg.d_model, cfg.norm_eps), MLP(cfg, scale)
        self.drop = tp.dropout(cfg.dropout)

    def forward(self, x, t0: int = 0, cache=None, return_map: bool = False, docs: Documents | None = None):
        # the mixer and the MLP see every position (B, m, d); the residual stream, the norms and the dropouts hold
        # this rank's m/TP positions under sequence parallelism (model/sequence_parallel.py), all m without it
        y = self.mixer(tp.gather_sequence(self.ln_1(x)), return_map=return_map, t0=t0, cache=cache, docs=docs)
        y, A = y if return_map else (y, None)
        x = x + self.drop(y)
        if self.mlp is not None:
            x = x + self.drop(self.mlp(tp.gather_sequence(self.ln_2(x))))
        return (x, A) if return_map else x

    def attention_map(self, x, docs: Documents | None = None):
        """(output, map (B, Hl, n, n)) computed on the materialized path."""
        return self(x, return_map=True, docs=docs)

    def train_flops(self, n):
        """Forward + backward FLOPs per token of this block."""
        return self.mixer.train_flops(n) + (3 * self.mlp.flops(n) if self.mlp is not None else 0)


class Embedding(nn.Module):
    """x = dropout(E[tokens] + P[t0 : t0+m]): tokens (B, m) at positions t0 … t0+m−1 → (B, m, d); under the document
    mask P[p] at each token's position in its document (`docs`: model/documents.py).

    E `wte` (V, d): vocabulary-parallel; P `wpe` (L, d): learned positions (`position: learned`, else none).
    A pipeline runs the two halves as two stages (the token half's weight is tied to the head on the last one):
    `Embedding(cfg, positions=False)` takes tokens, `Embedding(cfg, tokens=False)` takes embeddings.
    """

    def __init__(self, cfg: ModelConfig, tokens: bool = True, positions: bool = True):
        super().__init__()
        self.max_seq_len = cfg.max_seq_len
        self.wte = tp.vocab_embedding(cfg.vocab_size, cfg.d_model, cfg.init_std) if tokens else None
        self.wpe = None
        if positions and cfg.position == "learned":
            self.wpe = nn.Embedding(cfg.max_seq_len, cfg.d_model)
            tp.annotate(self.wpe.weight, tp.normal(cfg.init_std))
        self.drop = tp.dropout(cfg.dropout) if positions else None

    def forward(self, x, t0: int = 0, docs: Documents | None = None):
        if self.wte is not None:                                         # token ids (B, m)
            end = t0 + x.shape[1]
            if end > self.max_seq_len:
                raise ValueError(f"sequence length n={end} exceeds model.max_seq_len L={self.max_seq_len}; "
                                 "shorten the input or train a model with a larger max_seq_len")
            x = self.wte(x)                                              # (B, m, d)
        if self.drop is not None:
            if self.wpe is not None:
                x = x + (self.wpe.weight[t0:t0 + x.shape[1]] if docs is None else self.wpe(docs.positions[:, t0:]))
            x = self.drop(tp.scatter_sequence(x))                       # (B, m/TP, d) under sequence parallelism
        return x


class Head(nn.Module):
    """logits = LN(x) Wᵀ (B, n, V/TP), W (V/TP, d) the vocabulary slice of a column-parallel head or of the tied
    token embedding; `loss` the mean cross-entropy, computed on vocabulary shards without gathering them.
    A pipeline runs the final norm (`Head(cfg, projection=False)`) and the projection as two stages."""

    def __init__(self, cfg: ModelConfig, norm: bool = True, projection: bool = True):
        super().__init__()
        self.ln_f = tp.layer_norm(cfg.d_model, cfg.norm_eps) if norm else None
        own = projection and not cfg.tie_embeddings
        self.head = tp.column_linear(cfg.d_model, cfg.vocab_size, False, cfg.init_std) if own else None

    def forward(self, x, tied_weight=None):
        if self.ln_f is not None:
            x = self.ln_f(x)
        weight = self.head.weight if self.head is not None else tied_weight
        return x if weight is None else Head.project(x, weight)

    @staticmethod
    def project(x, weight):
        return tp.copy_to_tp(tp.gather_sequence(x)) @ weight.T          # grads of x summed over TP

    def fused_loss(self, x, targets, tied_weight=None):
        """The mean cross-entropy of LN(x)'s logits, computed chunk by chunk without materializing them
        (model/linear_cross_entropy.py); equal to `loss(forward(x), targets)`."""
        weight = self.head.weight if self.head is not None else tied_weight
        return linear_cross_entropy(tp.gather_sequence(self.ln_f(x)), weight, targets)

    @staticmethod
    def loss(logits, targets, ignore_index: int = -100):
        """Mean over the targets that are not `ignore_index` (Hugging Face labels pad with -100) of
        −log softmax(logits)[target]."""
        keep = targets != ignore_index
        per_token = tp.cross_entropy(logits, targets.masked_fill(~keep, 0))   # (B, n)
        return (per_token * keep).sum() / keep.sum()


class SynthesizerLM(nn.Module):
    """Embedding → blocks → Head.

    forward(tokens (B, n)) → logits (B, n, V/TP); forward(tokens, targets) → the mean cross-entropy (scalar), by the
    fused head and loss (no logits materialized); under context parallelism the mean over this rank's chunks of each
    window (model/context.py `loss`), which the trainer averages over the cp ranks as over data-parallel ones.
    The Embedding's and Head's layers are this module's own (`wte`, `wpe`, `ln_f`, `head`), so that parameters keep
    the names of every checkpoint, release and export; `embed` and `logits` run those classes' forward on them.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg, self.max_seq_len = cfg, cfg.max_seq_len
        tp.split_size(cfg.vocab_size, "model.vocab_size")
        tp.split_size(cfg.n_heads, "model.n_heads")
        tp.split_size(cfg.d_ffn, "model.d_ffn")
        embedding, head = Embedding(cfg), Head(cfg)
        self.wte, self.wpe, self.drop = embedding.wte, embedding.wpe, embedding.drop
        self.blocks = nn.ModuleList(Block(cfg, m) for m in cfg.layer_mixers())
        self.ln_f, self.head = head.ln_f, head.head

    def embed(self, tokens, t0: int = 0, docs: Documents | None = None):
        return Embedding.forward(self, tokens, t0, docs)                 # (B, m, d)

    def documents(self, tokens, fused: bool = True) -> Documents | None:
        """The documents of the windows `tokens` (B, n) under model.document_mask (their masks made for the fused
        path of their device when `fused`), else None."""
        if not self.cfg.document_mask:
            return None
        return Documents.of(tokens, self.cfg.eos_id, fused, self.wte.weight.dtype)

    def logits(self, x):
        return Head.forward(self, x, self.wte.weight)                    # (B, n, V/TP)

    def head_loss(self, x, targets):
        """The mean cross-entropy of the blocks' output x (B, n, d): final LayerNorm, head and loss fused, no
        logits materialized (Head.fused_loss)."""
        return Head.fused_loss(self, x, targets, self.wte.weight)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None):
        if targets is not None and splits(tokens.shape[1]):   # parallel.cp > 1: this rank's chunks alone
            return split_loss(self, tokens, targets)
        docs = self.documents(tokens)
        x = self.embed(tokens, docs=docs)
        for block in self.blocks:
            x = block(x, docs=docs)
        return self.logits(x) if targets is None else self.head_loss(x, targets)

    @torch.no_grad()
    def attention_maps(self, tokens: torch.Tensor) -> list[torch.Tensor]:
        """Per layer, the synthesized maps (B, Hl, n, n) of this rank's heads (SGU: its causal W)."""
        docs = self.documents(tokens, fused=False)
        x, maps = self.embed(tokens, docs=docs), []
        for block in self.blocks:
            x, A = block.attention_map(x, docs)
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
