"""Pipeline parallelism: the Synthesizer LM as a DeepSpeed `PipelineModule` of layer specs.

    [tied token embedding] → [positions + dropout] → block 0 … block N−1 → [final norm] → [tied head | head]

The token embedding and the output head share one weight across the first and last stage (`TiedLayerSpec`;
DeepSpeed all-reduces its gradient between them). Every stage's parameters are drawn from the same seed under
their *canonical* names (those of `model.SynthesizerLM`: `wte.weight`, `blocks.3.mixer…`), so any (TP, PP)
layout starts from the TP=1, PP=1 model. This adapter lives here, not in model/: the model knows no pipeline.
"""
from __future__ import annotations

import re
from functools import partial

import torch.nn as nn

from model import ModelConfig
from model import parallel as tp
from model.lm import Block


class TokenEmbedding(nn.Module):
    """Stage 0: tokens (B, n) → embeddings (B, n, d); its weight (V/TP, d) is also the tied output head."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.max_seq_len = cfg.max_seq_len
        self.wte = tp.vocab_embedding(cfg.vocab_size, cfg.d_model, cfg.init_std)

    def forward(self, tokens):
        if tokens.shape[1] > self.max_seq_len:
            raise ValueError(f"sequence length n={tokens.shape[1]} exceeds model.max_seq_len L={self.max_seq_len}")
        return self.wte(tokens)


def tied_head(embedding: TokenEmbedding, x):
    """Last stage: logits (B, n, V/TP) = x Wᵀ with the embedding's weight; gradients of x all-reduced over TP."""
    return tp.copy_to_tp(x) @ embedding.wte.weight.T


class Positions(nn.Module):
    """Learned absolute positions (if configured) and embedding dropout."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.wpe = None
        if cfg.position == "learned":
            self.wpe = nn.Embedding(cfg.max_seq_len, cfg.d_model)
            tp.annotate(self.wpe.weight, tp.normal(cfg.init_std))
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        if self.wpe is not None:
            x = x + self.wpe.weight[: x.shape[1]]
        return self.drop(x)


class FinalNorm(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln_f = tp.layer_norm(cfg.d_model, cfg.norm_eps)

    def forward(self, x):
        return self.ln_f(x)


class Head(nn.Module):
    """Untied output head: logits (B, n, V/TP) through a column-parallel d → V projection."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head = tp.column_linear(cfg.d_model, cfg.vocab_size, False, cfg.init_std)

    def forward(self, x):
        return tp.copy_to_tp(x) @ self.head.weight.T


def lm_loss(logits, targets):
    return tp.cross_entropy(logits, targets).mean()


def layer_specs(cfg: ModelConfig, checkpoint_every: int) -> tuple[list, list[str]]:
    """The layer specs and, per spec index, the canonical name prefix of its parameters."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    specs = [TiedLayerSpec("embed", TokenEmbedding, cfg, tied_weight_attr="wte.weight"), LayerSpec(Positions, cfg)]
    prefixes = ["", ""]
    for i, mixer in enumerate(cfg.layer_mixers()):
        checkpoint = checkpoint_every > 0 and i % checkpoint_every == 0
        specs.append(LayerSpec(Block, cfg, mixer, checkpoint))
        prefixes.append(f"blocks.{i}.")
    specs.append(LayerSpec(FinalNorm, cfg))
    prefixes.append("")
    if cfg.tie_embeddings:
        specs.append(TiedLayerSpec("embed", TokenEmbedding, cfg, forward_fn=tied_head, tied_weight_attr="wte.weight"))
    else:
        specs.append(LayerSpec(Head, cfg))
    prefixes.append("")
    return specs, prefixes


def canonical_name(name: str, prefixes: list[str]) -> str:
    """'tied_modules.embed.wte.weight' → 'wte.weight'; '5.mixer.value.weight' → 'blocks.3.mixer.value.weight'."""
    if name.startswith("tied_modules.embed."):
        return name[len("tied_modules.embed."):]
    m = re.match(r"(\d+)\.(.*)", name)
    return prefixes[int(m.group(1))] + m.group(2)


def build_pipeline(cfg: ModelConfig, tp_size: int, pp_size: int, dp_size: int, partition: str,
                   checkpoint_every: int):
    """The PipelineModule of this rank's stage, initialised from cfg.seed under canonical names."""
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    specs, prefixes = layer_specs(cfg, checkpoint_every)
    topology = PipeModelDataParallelTopology(num_pp=pp_size, num_mp=tp_size, num_dp=dp_size)
    # partition "parameters" balances parameter counts over stages; "uniform" balances layer counts.
    module = PipelineModule(layers=specs, topology=topology, loss_fn=lm_loss, partition_method=partition,
                            activation_checkpoint_interval=0)
    module.canonical_name = partial(canonical_name, prefixes=prefixes)   # stage names → SynthesizerLM names
    tp.init_from_seed(module, cfg.seed, rename=module.canonical_name)
    return module
