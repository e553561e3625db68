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
"""
from __future__ import annotations

import re
from functools import partial

import torch

from model import ModelConfig
from model import parallel as tp
from model.documents import Documents, document_ids
from model.lm import Block, Embedding, Head


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
    """(x, g) → LN(x): the last stage needs no documents."""

    def forward(self, inputs):
        return super().forward(inputs[0])


def stage_prefixes(cfg: ModelConfig) -> list[str]:
    """Per layer spec, the canonical name prefix of its parameters: the token and position embeddings, the
    blocks, the final norm and the head (the tied embedding's names come from its own spec)."""
    return ["", ""] + [f"blocks.{i}." for i in range(cfg.n_layers)] + ["", ""]


def layer_specs(cfg: ModelConfig) -> list:
    """[token embedding (tied) | positions + dropout | block 0 … block N−1 | final norm | head (tied or own)]."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    embedding = TokensAndDocuments if cfg.document_mask else Embedding
    embed = partial(TiedLayerSpec, "embed", embedding, cfg, positions=False, tied_weight_attr="wte.weight")
    if cfg.document_mask:   # the same modules (the same parameter names), passing the document ids along
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


def build_pipeline(cfg: ModelConfig, tp_size: int, pp_size: int, dp_size: int, partition: str):
    """The PipelineModule of this rank's stage, initialised from cfg.seed under canonical names."""
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    topology = PipeModelDataParallelTopology(num_pp=pp_size, num_mp=tp_size, num_dp=dp_size)
    # partition "parameters" balances parameter counts over stages; "uniform" balances layer counts. Built without
    # autograd: PipelineModule broadcasts the tied embedding (a Parameter) between the first and last stage, and
    # c10d's broadcast in grad mode warns on every rank that it has no autograd kernel (a copy, nothing to backprop).
    with torch.no_grad():
        module = PipelineModule(layers=layer_specs(cfg), topology=topology, loss_fn=Head.loss,
                                partition_method=partition, activation_checkpoint_interval=0)
    module.canonical_name = partial(canonical_name, prefixes=stage_prefixes(cfg))   # stage names → canonical
    tp.init_from_seed(module, cfg.seed, rename=module.canonical_name)
    return module
