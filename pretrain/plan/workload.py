"""What one rank computes, stores and sends for one micro-batch, read off the real model and the memory plan, and
the engine settings that decide how it is scheduled. No time here: pretrain/plan/step.py prices it.

Per block on a rank (t the TP size, b the micro-batch, n the sequence length, d the width, a the activations' bytes):
    GEMMs           every linear layer of the block as (M, K, N) = (b·n, d_in, d_out) with its TP split: a
                    column-parallel layer keeps d_out/t outputs, a row-parallel one d_in/t inputs
    mixer FLOPs     model/accounting.py's training FLOPs of the block minus its linear layers' (3 × 2·d_in·d_out a
                    token): attention, the synthesizers' own n² work, each variant as its modules count it, ÷ t
    activations     model/memory.py's bytes the block keeps for backward (the memory plan's own terms)
    TP all-reduces  one of b·n·d·a bytes per row-parallel layer in forward (its partial sums) and one per
                    column-parallel input in backward (its gradient), as Megatron's f and g operators pair up
Under context parallelism (cp > 1) a rank holds n/cp positions of each sequence: its GEMMs and the mixers' FLOPs are
those of its tokens (each reads every earlier key: the mixer's n² work divides by cp), its activations
pretrain/plan/context_parallel.py's, and it all-gathers B·s·F·a bytes a layer in each of two rounds.
The first stage adds the vocabulary-parallel embedding's all-reduce; the last the head, a (b·n, d, V/t) GEMM, the
loss's fp32 logits and their gradient written and read (16 bytes a logit), and the all-reduce of the head
input's gradient.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache

import torch.nn as nn

from model.accounting import shape_model
from model.config import ModelConfig
from model.memory import bytes_of, layer_bytes
from model.synthesizers import linear_flops
from pretrain.config import TrainConfig
from pretrain.plan.context_parallel import gathered_bytes, layer_terms as cp_layer_terms
from pretrain.plan.memory import BUCKET, PREFETCH, Layout, rank_parameters, stage_layers

LOSS_BYTES_PER_LOGIT = 16   # fp32 logits and their fp32 gradient, each written once and read once


@dataclass(frozen=True)
class Engine:
    """How the engine schedules a step, where engines differ (this repository's DeepSpeed engine, or the paper's)."""
    name: str
    dp_overlap: bool            # the gradient reduction runs beside backward (DeepSpeed's zero_optimization.overlap_comm)
    reduce_every_micro_batch: bool   # ZeRO ≥ 2: gradients reduced after each micro-batch, not once a step
    p2p_scatter_gather: bool    # a stage's output crosses nodes split over its TP ranks, re-gathered over NVLink
    score_bytes: int            # bytes moved per attention score element (0: flash attention keeps no n² tensor)
    accumulate_bytes: int       # bytes per parameter to add a micro-batch's gradient into the accumulated one
    even_stages: bool = False   # pipeline stages of L/p blocks each (Megatron), not DeepSpeed's balanced partition
    reduce_bucket: float = math.inf   # elements per gradient reduction call (DeepSpeed's reduce_bucket_size)
    gather_bucket: float = math.inf   # elements per weight all-gather call (ZeRO-1/2: allgather_bucket_size;
                                      # ZeRO-3: stage3_prefetch_bucket_size)


def engine_of(cfg: TrainConfig, ds: dict) -> Engine:
    """This repository's engine for `cfg` (pretrain/engine.py, DeepSpeed config `ds`): flash-style attention kernels,
    DeepSpeed's overlap_comm (default on for ZeRO-3 only), ZeRO-2/3 reducing after every micro-batch, its buckets
    (reduce_bucket_size, allgather_bucket_size, stage3_prefetch_bucket_size; DeepSpeed's defaults where unset),
    pipeline stages sending whole activations, gradients accumulated in their own dtype (read, add, write)."""
    stage, zero = cfg.parallel.zero_stage, ds.get("zero_optimization", {})
    overlap = zero.get("overlap_comm")
    gather = zero.get("stage3_prefetch_bucket_size", PREFETCH) if stage == 3 else zero.get("allgather_bucket_size",
                                                                                            BUCKET)
    return Engine("DeepSpeed (this repository)", dp_overlap=stage == 3 if overlap is None else bool(overlap),
                  reduce_every_micro_batch=stage >= 2, p2p_scatter_gather=False, score_bytes=0,
                  accumulate_bytes=3 * bytes_of(cfg.train.weights_precision()),
                  reduce_bucket=float(zero.get("reduce_bucket_size", BUCKET)), gather_bucket=float(gather))


@dataclass(frozen=True)
class LayerWork:
    """One block on one rank, one micro-batch."""
    mixer: str
    gemms: tuple[tuple[int, int, int], ...]   # (M, K, N) of each linear layer on the rank
    mixer_flops: float                        # training FLOPs of everything else in the block, on the rank
    forward_fraction: float                   # of the block's FLOPs, the forward's (recomputation repeats it)
    heads: int                                # heads on the rank (the attention kernels' parallelism)
    activation_bytes: int                     # what the block keeps for backward (model/memory.py)
    tp_all_reduces: int                       # each direction: row-parallel layers in forward, their pairs backward
    cp_gather_bytes: int = 0                  # parallel.cp: what the rank all-gathers a round, B·s·F·a (2 rounds)


@dataclass(frozen=True)
class StageWork:
    """One pipeline stage's rank: its blocks, what the embedding and head add, its trainable parameters."""
    layers: tuple[LayerWork, ...]
    recomputed: tuple[bool, ...]              # parallel.activation_checkpointing: block recomputed in backward
    first: bool
    last: bool
    params: int                               # trainable parameters on this rank (its TP slice of its stage)
    head_gemm: tuple[int, int, int] | None    # (b·n, d, V/t) on the last stage
    logits: int                               # logits on the rank (b·n·V/t) on the last stage
    boundary_bytes: int                       # b·n·d·a: a TP all-reduce or a stage's output sent on


@lru_cache(maxsize=512)
def _layer(config: str, index: int, b: int, tp: int, a: int, gpu: bool, cp: int = 1) -> LayerWork:
    cfg = ModelConfig.from_dict(json.loads(config))
    n = cfg.max_seq_len
    local = n // cp   # the rank's positions: its queries (every key before them is read, gathered)
    block = shape_model(cfg).blocks[index]
    gemms, linear = [], 0
    rows = 0
    for module in block.modules():
        if isinstance(module, nn.Linear):
            d_out, d_in = module.weight.shape   # full shapes: the meta model is built without TP
            split = getattr(module.weight, "partition_dim", None)
            rows += split == 1
            gemms.append((b * local, d_in // tp if split == 1 else d_in, d_out // tp if split == 0 else d_out))
            linear += 3 * linear_flops(module)
    total = block.train_flops(n)
    forward = block.mixer.flops(n) + (block.mlp.flops(n) if block.mlp is not None else 0)
    heads = cfg.n_heads // tp
    if cp == 1:
        return LayerWork(cfg.layer_mixers()[index], tuple(gemms), (total - linear) * b * n / tp, forward / total,
                         heads, layer_bytes(cfg, index, b, n, tp, a, gpu), rows)
    kept = sum(t.bytes for t in cp_layer_terms(cfg, index, b, n, cp, tp, a, gpu))
    return LayerWork(cfg.layer_mixers()[index], tuple(gemms), (total - linear) * b * local / tp, forward / total,
                     heads, kept, rows, gathered_bytes(cfg, index, b, n, cp, tp, a))


def stage_work(cfg: TrainConfig, lay: Layout, micro: int, gpu: bool, even: bool = False) -> list[StageWork]:
    """Every pipeline stage's work on one of its ranks at micro-batch `micro`: the memory plan's layer split, or
    `even`ly L/p blocks a stage."""
    m, t = cfg.model, lay.tp
    a, key, mixers = bytes_of(cfg.train.precision), m.key(), m.layer_mixers()
    every = cfg.parallel.activation_checkpointing
    N, out = micro * m.max_seq_len // lay.cp, []   # a rank's tokens: n/cp positions of each sequence
    per = m.n_layers // lay.pp
    split = ([range(s * per, (s + 1) * per) for s in range(lay.pp)] if even
             else stage_layers(m, lay.pp, cfg.parallel.partition))
    for s, layers in enumerate(split):
        first, last = s == 0, s == lay.pp - 1
        work = tuple(_layer(key, mixers.index(mixers[i]), micro, t, a, gpu, lay.cp) for i in layers)
        params = sum(n for n, trainable in rank_parameters(m, t, layers, first, last) if trainable)
        V = m.vocab_size // t
        out.append(StageWork(work, tuple(bool(every) and i % every == 0 for i in layers), first, last, params,
                             (N, m.d_model, V) if last else None, N * V if last else 0, a * N * m.d_model))
    return out
