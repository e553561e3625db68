"""Pipeline parallelism: the Synthesizer LM as a DeepSpeed `PipelineModule` of layer specs.

    [tied token embedding] → [positions + dropout] → block 0 … block N−1 → [final norm] → [tied head | head]

The stages are the LM's own parts (model/lm.py: the two halves of `Embedding`, the blocks, the two of `Head`). The
token embedding and the output head share one weight across the first and last stage (`TiedLayerSpec`;
DeepSpeed all-reduces its gradient between them). Every stage's parameters are drawn from the same seed under
their *canonical* names (those of `model.SynthesizerLM`: `wte.weight`, `blocks.3.mixer…`), so any (TP, PP)
layout starts from the TP=1, PP=1 model. This adapter lives here, not in model/: the model knows no pipeline.

Under model.document_mask the document ids g (B, n) of the window (model/documents.py) travel with the activations:
the first stage finds them in the tokens and every stage passes (x, g) on, in the same point-to-point send as x (an
integer tensor, which DeepSpeed sends no gradient for); each block makes its mask from g. No new collective.

Under context parallelism (parallel.cp > 1, model/context.py) every stage holds this rank's two chunks of positions:
the first stage embeds the rank's tokens (`context.split`, n/cp of each window's n) at their positions, the stages
pass x (B, n/cp, d) (and g (B, n), the whole window's ids, under the document mask), each block runs its first chunk
then its second with its own `ContextCache` (`context.block_chunks`, as the whole model's `context.loss` does), and
the last stage's loss covers the rank's chunks' targets: the mean over the dp × cp ranks (DeepSpeed's data axis,
dp × cp wide, is megatron's data-parallel group with cp) is the windows' loss.
"""
from __future__ import annotations

import re
from functools import partial

import torch

from model import ModelConfig
from model import context
from model import parallel as tp
from model.documents import Documents, document_ids
from model.lm import Block, Embedding, Head
from model.ranks import cp_group, cp_rank, cp_world


def tied_head(embedding: Embedding, x):
    """Last stage, tied: logits (B, n, V/TP) with the token embedding's weight."""
    return Head.project(x, embedding.wte.weight)


class TokensAndDocuments(Embedding):
    """First stage under the document mask: tokens → (E[tokens] (B, n, d), document ids g (B, n)). A module of its
    own, not a `forward_fn` of the tied spec: DeepSpeed saves and loads only the stage entries that are modules."""

    def __init__(self, cfg: ModelConfig, **kwargs):
        super().__init__(cfg, **kwargs)
        self.eos = cfg.eos_id

    def forward(self, tokens):
        return super().forward(tokens), document_ids(tokens, self.eos)


class PositionsInDocuments(Embedding):
    """(x, g) → (x + P[p], g): learned positions at each token's position in its document."""

    def forward(self, inputs):
        x, ids = inputs
        return super().forward(x, docs=Documents(ids, fused=False)), ids


class BlockInDocuments(Block):
    """(x, g) → (Block(x) under the document mask of g, g)."""

    def forward(self, inputs):
        x, ids = inputs
        return super().forward(x, docs=Documents(ids, dtype=self.ln_1.weight.dtype)), ids


class NormOfDocuments(Head):
    """(x, g) → LN(x): the last stage needs no documents (under cp without the mask: x → LN(x))."""

    def forward(self, inputs):
        return super().forward(unpack(inputs)[0])


def unpack(inputs) -> tuple:
    """A stage's input under context parallelism: x alone, or (x, g) under the document mask → (x, g or None)."""
    return inputs if isinstance(inputs, tuple) else (inputs, None)


def chunk_documents(ids, cp: int, rank: int, **kwargs) -> list:
    """Each of this rank's chunks' documents: those of the window's prefix up to the chunk's end (None without g)."""
    if ids is None:
        return [None, None]
    return [Documents(ids[:, :t1], fused=False, **kwargs) for _, t1 in context.chunks(ids.shape[1], cp, rank)]


class TokenChunks(Embedding):
    """First stage under cp: tokens (B, n) → E[this rank's chunks' tokens] (B, n/cp, d), and under the document mask
    the window's document ids g (B, n) with it."""

    def __init__(self, cfg: ModelConfig, **kwargs):
        super().__init__(cfg, **kwargs)
        self.eos = cfg.eos_id if cfg.document_mask else None

    def forward(self, tokens):
        x = super().forward(context.split(tokens, cp_world(), cp_rank()))
        return x if self.eos is None else (x, document_ids(tokens, self.eos))


class PositionChunks(Embedding):
    """x (B, n/cp, d) [, g] → x + P at each chunk's positions (in its document under the mask) [, g]."""

    def forward(self, inputs):
        x, ids = unpack(inputs)
        cp, rank = cp_world(), cp_rank()
        spans = context.chunks(x.shape[1] * cp, cp, rank)
        parts = x.split(x.shape[1] // 2, dim=1)
        docs = chunk_documents(ids, cp, rank)
        x = torch.cat([super(PositionChunks, self).forward(h, t0, d) for h, (t0, _), d in zip(parts, spans, docs)], 1)
        return x if ids is None else (x, ids)


class BlockChunks(Block):
    """x (B, n/cp, d) [, g] → the block on this rank's two chunks (`context.block_chunks`) [, g]."""

    def forward(self, inputs):
        x, ids = unpack(inputs)
        docs = chunk_documents(ids, cp_world(), cp_rank(), dtype=self.ln_1.weight.dtype)
        x = context.block_chunks(super().forward, x, cp_group(), docs)
        return x if ids is None else (x, ids)


def chunk_loss(logits, targets):
    """Last stage under cp: the mean cross-entropy of logits (B, n/cp, V/TP) against this rank's chunks of the
    window's targets (B, n), in the logits' order (`context.split_targets`: another under sequence parallelism)."""
    return Head.loss(logits, context.split_targets(targets, cp_world(), cp_rank()))


def stage_prefixes(cfg: ModelConfig) -> list[str]:
    """Per layer spec, the canonical name prefix of its parameters: the token and position embeddings, the
    blocks, the final norm and the head (the tied embedding's names come from its own spec)."""
    return ["", ""] + [f"blocks.{i}." for i in range(cfg.n_layers)] + ["", ""]


def layer_specs(cfg: ModelConfig, cp: int = 1) -> list:
    """[token embedding (tied) | positions + dropout | block 0 … block N−1 | final norm | head (tied or own)]; their
    context-parallel forms where `cp` > 1."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    embedding = TokensAndDocuments if cfg.document_mask else Embedding
    embedding = TokenChunks if cp > 1 else embedding
    embed = partial(TiedLayerSpec, "embed", embedding, cfg, positions=False, tied_weight_attr="wte.weight")
    if cp > 1:   # the same modules (the same parameter names) on this rank's chunks of positions
        specs = [embed(), LayerSpec(PositionChunks, cfg, tokens=False)]
        specs += [LayerSpec(BlockChunks, cfg, mixer) for mixer in cfg.layer_mixers()]
        specs.append(LayerSpec(NormOfDocuments, cfg, projection=False))
    elif cfg.document_mask:   # the same modules (the same parameter names), passing the document ids along
        specs = [embed(), LayerSpec(PositionsInDocuments, cfg, tokens=False)]
        specs += [LayerSpec(BlockInDocuments, cfg, mixer) for mixer in cfg.layer_mixers()]
        specs.append(LayerSpec(NormOfDocuments, cfg, projection=False))
    else:
        specs = [embed(), LayerSpec(Embedding, cfg, tokens=False)]
        specs += [LayerSpec(Block, cfg, mixer) for mixer in cfg.layer_mixers()]
        specs.append(LayerSpec(Head, cfg, projection=False))
    specs.append(embed(forward_fn=tied_head) if cfg.tie_embeddings else LayerSpec(Head, cfg, norm=False))
    return specs


def canonical_name(name: str, prefixes: list[str]) -> str:
    """'tied_modules.embed.wte.weight' → 'wte.weight'; '5.mixer.value.weight' → 'blocks.3.mixer.value.weight'."""
    if name.startswith("tied_modules.embed."):
        return name[len("tied_modules.embed."):]
    m = re.match(r"(\d+)\.(.*)", name)
    return prefixes[int(m.group(1))] + m.group(2)


def build_pipeline(cfg: ModelConfig, tp_size: int, pp_size: int, dp_size: int, partition: str, cp_size: int = 1):
    """The PipelineModule of this rank's stage, initialised from cfg.seed under canonical names. DeepSpeed's data axis
    is dp × cp wide: megatron's data-parallel group with cp (its rank order tp, cp, dp, pp is the topology's model,
    data, pipe), over which gradients are averaged as they are without a pipeline."""
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    topology = PipeModelDataParallelTopology(num_pp=pp_size, num_mp=tp_size, num_dp=dp_size * cp_size)
    # partition "parameters" balances parameter counts over stages; "uniform" balances layer counts. Built without
    # autograd: PipelineModule broadcasts the tied embedding (a Parameter) between the first and last stage, and
    # c10d's broadcast in grad mode warns on every rank that it has no autograd kernel (a copy, nothing to backprop).
    with torch.no_grad():
        module = PipelineModule(layers=layer_specs(cfg, cp_size), topology=topology,
                                loss_fn=chunk_loss if cp_size > 1 else Head.loss,
                                partition_method=partition, activation_checkpoint_interval=0)
    module.canonical_name = partial(canonical_name, prefixes=stage_prefixes(cfg))   # stage names → canonical
    tp.init_from_seed(module, cfg.seed, rename=module.canonical_name)
    return module
