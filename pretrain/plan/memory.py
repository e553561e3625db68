"""The memory plan of a run: per rank, before any process starts, what a training step will hold at its peak.

    python -m pretrain.config CONFIG --world-size N --memory [--gpu-memory 80GiB]

Per rank of each pipeline stage, in bytes (T trainable and F frozen parameters of the rank: its stage's layers, its
TP slice of the split ones; w the weights' bytes, 4 fp32, 2 bf16/fp16; dp the ranks that average gradients and
partition ZeRO's states: the data-parallel ranks × cp, whose ranks hold the same parameters):

    model states at rest   weights w·(T+F) (ZeRO-3: w/dp of each parameter above DeepSpeed's persistence threshold,
                           whole below it; train.autocast: fp32 weights, w = 4); master weights in fp32 where the
                           weights are not (4·T; ZeRO ≥ 1: 4·T/dp),
                           also for fp32 ZeRO ≥ 1 (DeepSpeed's flat fp32 partition); AdamW's two moments 8·T (/dp for
                           ZeRO ≥ 1); train.master_weights=bf16 halves both (ZeRO-1/2); ZeRO-3 keeps its gradient
                           partition, 4·T/dp
    DeepSpeed's buffers    ZeRO-3's reduce bucket (zero_optimization.reduce_bucket_size elements in w, allocated when
                           the engine is built); ZeRO-1 under PP allocates the same at each step's reduction. On a GPU
                           counted whole; on a CPU only the pages written are resident, about the rank's gradients
                           (ZeRO-1 under PP: the gradients move into them, nothing counted above the gradients).
                           ZeRO-1/2's own reduce bucket is filled and released inside backward, while the loss's
                           buffers are already gone: not counted (the H100 record's backward peak equals its forward
                           peak). ZeRO-3 gathers whole parameters for each layer: at most the stage's weights, capped by
                           stage3_prefetch_bucket_size + the largest layer, counted beside the activations
    activations            model/memory.py, in train.precision's bytes: each layer's terms, the head's, the loss's
                           chunk of logits (train.autocast: and the weights' bf16 copies, 2·T); × the
                           micro-batches a pipeline stage holds at once in 1F1B (pp − stage, at most the micro-batches
                           of a step); under context parallelism (parallel.cp > 1) each rank's n/cp positions
                           on the materialized path, with the tensors it gathers from the earlier chunks and its
                           rows of the maps: pretrain/plan/context_parallel.py
    the step               the optimizer step's gradients and temporaries above the states at rest: ZeRO-0 the
                           gradients w·T (bf16: + their fp32 copy 4·T); ZeRO-1/2 the model's gradients w·T, their
                           averaged flat partition w·T/dp and its fp32 copy 4·T/dp (none with bf16 master weights);
                           ZeRO-3 w·T/dp + 4·T/dp
    host copy              checkpoint.async_save: a copy of the model states in host memory (pinned on a GPU), held
                           from the first save on: on a GPU a row of its own (host memory, not the GPU's); on a CPU,
                           where host memory is the device's, part of the peak
    peak                   states at rest + buffers + max(activations at the end of the forward pass + their largest
                           temporary + the head weight's gradient, the step)

Whether a peak fits a GPU, with headroom for the CUDA context, NCCL and the allocator: pretrain/plan/verdict.py.
How close this comes to what a launch measures: tests/distributed/test_memory_plan.py (CPU, five layouts) and the H100 records
(docs/benchmarks.md).
"""
from __future__ import annotations

import contextlib
import functools
import json
import math
import re
import sys
from dataclasses import dataclass, field

from model import ConfigError, ModelConfig
from model.accounting import parameters
from model.memory import FP32, Activations, Term, activations, bytes_of, per_layer_summary
from pretrain.config import TrainConfig
from pretrain.config.deepspeed_dict import deepspeed_config
from pretrain.plan.context_parallel import cp_activations, layer_terms as cp_layer_terms
from pretrain.plan.memory_table import GIB, gib, table
from pretrain.plan.verdict import verdict

PERSISTENCE, PREFETCH, BUCKET = 100_000, 50_000_000, 500_000_000   # DeepSpeed's ZeRO defaults (elements)


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    zero: int
    cp: int = 1    # context parallelism: each sequence over cp ranks (pretrain/plan/context_parallel.py)

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def shards(self) -> int:
        """The ranks that hold the same parameters and average their gradients (ZeRO partitions over them): dp·cp."""
        return self.dp * self.cp

    def __str__(self) -> str:
        cp = f" × cp {self.cp}" if self.cp > 1 else ""
        return f"tp {self.tp}{cp} × pp {self.pp} × dp {self.dp}, ZeRO-{self.zero}"


@dataclass
class StagePlan:
    """One pipeline stage's rank: named rows in bytes."""
    stage: int
    params: tuple[int, int]                 # (trainable, frozen) on this rank
    states: list[Term]
    buffers: list[Term]                     # DeepSpeed's own, held from the engine's start
    pipe: Term                              # pipeline buffers: activations DeepSpeed keeps, also between steps
    activations: Activations
    in_flight: int
    backward_extra: Term
    step: Term
    breakdown: dict[str, list[Term]]        # one layer's terms, per mixer of the stage
    notes: list[str] = field(default_factory=list)
    host: Term = Term("no host copy (checkpoint.async_save off)", 0)
    host_is_device: bool = False            # a CPU run: the host copy is in the same memory as the rest

    @property
    def states_bytes(self) -> int:
        return sum(t.bytes for t in self.states)

    @property
    def engine_bytes(self) -> int:
        """What the engine's own tensors hold at rest: the model states and DeepSpeed's buffers."""
        return self.states_bytes + sum(t.bytes for t in self.buffers)

    @property
    def activation_peak(self) -> int:
        return self.activations.total * self.in_flight + self.activations.transient.bytes + self.backward_extra.bytes

    @property
    def peak(self) -> int:
        held = self.host.bytes if self.host_is_device else 0
        return self.engine_bytes + self.pipe.bytes + held + max(self.activation_peak, self.step.bytes)


@dataclass
class Plan:
    layout: Layout
    micro_batch: int
    seq_len: int
    precision: str
    checkpointing: int
    device: str
    stages: list[StagePlan]

    @property
    def peak(self) -> int:
        return max(s.peak for s in self.stages)


def stage_layers(cfg: ModelConfig, pp: int, partition: str) -> list[range]:
    """The blocks of each pipeline stage, as DeepSpeed's PipelineModule partitions pretrain/pipeline.py's layer specs
    [token embedding, positions, blocks…, final norm, head]: by trainable parameter counts, or uniformly."""
    return list(_stage_layers(cfg.key(), pp, partition))


@functools.lru_cache(maxsize=256)   # the plans of every layout ask again
def _stage_layers(config: str, pp: int, partition: str) -> tuple[range, ...]:
    cfg = ModelConfig.from_dict(json.loads(config))
    if pp == 1:
        return (range(cfg.n_layers),)
    with contextlib.redirect_stdout(sys.stderr):   # DeepSpeed's import-time log must not mix with the plan
        from deepspeed.runtime import utils as ds_utils

    counts = {}
    for name, p in parameters(cfg).items():
        if p.trainable:
            key = int(name.split(".")[1]) if name.startswith("blocks.") else name.split(".")[0]
            counts[key] = counts.get(key, 0) + math.prod(p.shape)
    weights = [counts.get("wte", 0), counts.get("wpe", 0), *(counts.get(i, 0) for i in range(cfg.n_layers)),
               counts.get("ln_f", 0), counts.get("head", counts.get("wte", 0))]
    parts = (ds_utils.partition_balanced(weights=weights, num_parts=pp) if partition == "parameters"
             else ds_utils.partition_uniform(num_items=len(weights), num_parts=pp))
    blocks = []
    for s in range(pp):   # spec index i ≥ 2 is block i − 2
        lo, hi = int(parts[s]), int(parts[s + 1])
        blocks.append(range(max(lo, 2) - 2, min(hi, cfg.n_layers + 2) - 2) if hi > 2 else range(0))
    return tuple(blocks)


def rank_parameters(cfg: ModelConfig, tp: int, layers: range, first: bool, last: bool) -> list[tuple[int, bool]]:
    """(elements on one TP rank, trainable) of each parameter of a stage."""
    return list(_rank_parameters(cfg.key(), tp, layers.start, layers.stop, first, last))


@functools.lru_cache(maxsize=1024)
def _rank_parameters(config: str, tp: int, start: int, stop: int, first: bool, last: bool) -> tuple:
    cfg, layers = ModelConfig.from_dict(json.loads(config)), range(start, stop)
    out = []
    for name, p in parameters(cfg).items():
        top = name.split(".")[0]
        mine = (int(name.split(".")[1]) in layers if top == "blocks" else
                (first and top in ("wte", "wpe")) or (last and top in ("ln_f", "head", "wte")))
        if mine:
            out.append((math.prod(p.shape) // (tp if p.split_dim is not None else 1), p.trainable))
    return tuple(out)


def model_states(params: list[tuple[int, bool]], lay: Layout, precision: str, master: str) -> list[Term]:
    T = sum(n for n, trainable in params if trainable)
    F = sum(n for n, trainable in params if not trainable)
    w, dp, z = bytes_of(precision), lay.shards, lay.zero
    share = 1 if z == 0 else dp
    if z == 3:
        whole = sum(n for n, _ in params if n < PERSISTENCE)
        weights = Term(f"weights ({w} B each): partitioned over dp {dp}, {whole / 1e6:.2f}M persistent",
                       w * (whole + (T + F - whole) // dp))
    else:
        weights = Term(f"weights ({w} B each, {(T + F) / 1e6:.2f}M)", w * (T + F))
    out = [weights]
    m = 2 if master == "bf16" else FP32
    if w != FP32 or z > 0:
        out.append(Term(f"master weights ({m} B{', /dp' if z else ''})", m * T // share))
    out.append(Term(f"AdamW moments ({2 * m} B{', /dp' if z else ''})", 2 * m * T // share))
    if z == 3:
        out.append(Term("gradient partition (fp32, /dp)", FP32 * T // dp))
    return out


def stage_plan(cfg: TrainConfig, lay: Layout, stage: int, layers: range, micro: int, device: str,
               ds: dict) -> StagePlan:
    m, t = cfg.model, cfg.train
    first, last = stage == 0, stage == lay.pp - 1
    params = rank_parameters(m, lay.tp, layers, first, last)
    T = sum(n for n, trainable in params if trainable)
    w, a, gpu = bytes_of(t.weights_precision()), bytes_of(t.precision), device == "cuda"   # weights, activations
    states = model_states(params, lay, t.weights_precision(), t.master_weights)
    zero = ds.get("zero_optimization", {})
    bucket = int(zero.get("reduce_bucket_size", BUCKET))
    buffers, notes = [], []
    resident = bucket * w if gpu else min(bucket, T) * w   # a CPU keeps only the pages written: the gradients
    cpu_note = "" if gpu else "; on a CPU its written pages only"
    if lay.zero == 3:
        buffers.append(Term(f"ZeRO-3 reduce bucket, {bucket:.3g} elements, built with the engine{cpu_note}",
                            resident))
    elif lay.zero in (1, 2) and lay.pp == 1:
        notes.append("ZeRO-1/2's reduce bucket lives inside backward only, after the loss's buffers are freed: "
                     "not counted")
    micro_batches = t.grad_accum(lay.dp)
    sp = lay.tp if cfg.parallel.sequence_parallel else 1   # the sequence-parallel region holds n/sp positions
    if lay.pp > 1:   # DeepSpeed's 1F1B pipe buffers: each keeps a micro-batch's input and output, also between steps
        held = max(2, min(lay.pp - stage, micro_batches))
        N = micro * m.max_seq_len // lay.cp   # a rank's n/cp positions
        output = w * N * m.vocab_size // lay.tp if last else w * N * m.d_model // sp
        pipe = Term(f"pipeline buffers: inputs and outputs of {held} micro-batches{' (the logits)' if last else ''}",
                    held * (output + (0 if first else w * N * m.d_model // sp)))
    else:
        pipe = Term("no pipeline buffers", 0)
    ck, n = cfg.parallel.activation_checkpointing, m.max_seq_len
    if lay.cp > 1:   # each rank: n/cp positions, and the gathered tensors and map rows of its two chunks
        act = cp_activations(m, micro, n, lay.cp, lay.tp, a, ck, layers, first, last, lay.pp > 1, gpu, sp)
        alone = activations(m, micro, n, lay.tp, a, ck, layers, first, last, pipeline=lay.pp > 1, gpu=gpu, sp=sp)
        notes.append(f"context parallelism: {n // lay.cp} positions a rank, the blocks on the materialized path "
                     f"(pretrain/plan/context_parallel.py); cp 1 on the fused path holds {gib(alone.total)}")
    else:
        act = activations(m, micro, n, lay.tp, a, ck, layers, first, last, pipeline=lay.pp > 1, gpu=gpu, sp=sp)
    if sp > 1 and lay.cp == 1:
        whole = activations(m, micro, m.max_seq_len, lay.tp, a, cfg.parallel.activation_checkpointing, layers,
                            first, last, pipeline=lay.pp > 1, gpu=gpu).total
        notes.append(f"sequence parallelism: norms, dropout masks and residual stream on n/{sp} positions, "
                     f"{gib(whole - act.total)} less activations a micro-batch than without it")
    if t.autocast:   # each weight's bf16 copy, made in forward, saved for backward
        act = Activations(act.kept + [Term("autocast's bf16 copies of the weights, kept for backward", a * T)],
                          act.transient)
    in_flight = max(1, min(lay.pp - stage, micro_batches))
    if lay.zero == 3:
        sizes = sorted(n for n, _ in params)
        gathered = min(sum(sizes), int(zero.get("stage3_prefetch_bucket_size", PREFETCH)) + (sizes[-1] if sizes else 0))
        act = Activations(act.kept + [Term("ZeRO-3: whole parameters gathered for the layers at work", w * gathered)],
                          act.transient)
    vocab = m.vocab_size // lay.tp * m.d_model
    backward_extra = Term("the head weight's gradient, cast", w * vocab if last else 0)
    if lay.zero == 0:
        step = Term("gradients" + (" and their fp32 copy" if w != FP32 else ""), w * T + (FP32 * T if w != FP32 else 0))
    elif lay.zero in (1, 2):
        fp32_copy = FP32 * T // lay.shards if t.master_weights != "bf16" else 0
        step = Term("gradients, their averaged partition" + (" and its fp32 copy" if fp32_copy else ""),
                    w * T + w * T // lay.shards + fp32_copy)
    else:
        step = Term("the gradient partition's copies", (w + FP32) * T // lay.shards)
    if lay.zero == 1 and lay.pp > 1:   # DeepSpeed's ZeRO-1 under PP reduces through a bucket allocated at the step;
        # each gradient is copied into it and becomes a view of it, its own storage freed: on a CPU, where only the
        # written pages are resident, they take the gradients' place (measured: about 3 copies of w·T above rest,
        # not 4)
        where = "" if gpu else "; on a CPU its written pages, in the gradients' place"
        step = Term(step.name + f", and a reduce bucket of {bucket:.3g} elements{where}",
                    step.bytes + (resident if gpu else 0))
    breakdown = per_layer_summary(m, micro, n, lay.tp, a, gpu, layers, sp) if lay.cp == 1 else \
        {mixer: cp_layer_terms(m, m.layer_mixers().index(mixer), micro, n, lay.cp, lay.tp, a, gpu, sp)
         for mixer in dict.fromkeys(m.layer_mixers()[i] for i in layers)}
    host = Term("async saves' copy of the states" + (", pinned" if gpu else ""),
                sum(term.bytes for term in states) if cfg.checkpoint.async_save else 0)
    return StagePlan(stage, (T, sum(n for n, tr in params if not tr)), states, buffers, pipe, act, in_flight,
                     backward_extra, step, breakdown, notes, host, not gpu)


def plan(cfg: TrainConfig, lay: Layout, micro: int | None = None, device: str = "cuda", ds: dict | None = None) -> Plan:
    """The plan of `cfg` at layout `lay` (micro-batch: train.micro_batch_size unless given)."""
    micro = micro or cfg.train.micro_batch_size
    stages = [stage_plan(cfg, lay, s, layers, micro, device, ds or {})
              for s, layers in enumerate(stage_layers(cfg.model, lay.pp, cfg.parallel.partition))]
    precision = cfg.train.precision + (" under autocast, fp32 weights" if cfg.train.autocast else "")
    return Plan(lay, micro, cfg.model.max_seq_len, precision, cfg.parallel.activation_checkpointing,
                device, stages)


def layout_of(cfg: TrainConfig, world: int) -> Layout:
    p = cfg.parallel
    return Layout(p.tp, p.pp, p.dp(world), p.zero_stage, p.cp)


# ---- what fits -------------------------------------------------------------------------------------------------
def parse_size(text: str) -> int:
    """'80GiB', '80GB', '79.6 GiB', '81920MiB' → bytes; ConfigError otherwise."""
    match = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]i?B)\s*", text or "", re.IGNORECASE)
    if not match:
        raise ConfigError(f"--gpu-memory={text!r} is not a size; write e.g. 80GiB, 80GB or 81920MiB")
    unit = match.group(2).upper()
    base = 1024 if "I" in unit else 1000
    return int(float(match.group(1)) * base ** "KMGT".index(unit[0]) * base)


def largest_micro_batch(cfg: TrainConfig, lay: Layout, budget: int, device: str, ds: dict) -> int | None:
    """The largest micro-batch that divides the global batch over dp and fits a GPU of `budget` bytes with headroom
    (pretrain/plan/verdict.py; None: not even 1)."""
    per_dp = cfg.train.global_batch_size // lay.dp
    best = None
    for micro in range(1, per_dp + 1):
        if per_dp % micro == 0 and cfg.train.global_batch_size % (micro * lay.dp) == 0:
            if verdict(plan(cfg, lay, micro, device, ds).peak, budget, lay).status != "fits":
                break
            best = micro
    return best


def layouts(cfg: TrainConfig, world: int) -> list[Layout]:
    """Every (tp, cp, pp, dp, ZeRO) layout of `world` ranks the trainer would accept for this config (cp: 2·cp
    chunks must divide model.max_seq_len)."""
    m, out = cfg.model, []
    for tp in (d for d in range(1, min(world, 8) + 1) if world % d == 0):
        if m.n_heads % tp or m.vocab_size % tp or m.d_ffn % tp:
            continue
        cps = [d for d in range(1, min(world // tp, 8) + 1) if (world // tp) % d == 0 and m.max_seq_len % (2 * d) == 0]
        for cp in cps:
            rest = world // (tp * cp)
            for pp in (d for d in range(1, min(rest, m.n_layers) + 1) if rest % d == 0):
                dp = rest // pp
                if cfg.train.global_batch_size % (cfg.train.micro_batch_size * dp):
                    continue
                for zero in (0, 1, 2, 3):
                    if pp > 1 and zero > 1 or (cfg.train.master_weights == "bf16" and zero not in (1, 2)) or \
                            (cfg.train.autocast and (zero, tp) != (0, 1)):
                        continue
                    out.append(Layout(tp, pp, dp, zero, cp))
    return out


def report(cfg: TrainConfig, world: int, budget: int | None = None, device: str = "cuda") -> str:
    """The whole answer of `--memory`: the plan of the configured layout, with checkpointing on for comparison,
    and with a budget the verdict, the largest micro-batch and the layouts that fit."""
    lay = layout_of(cfg, world)
    ds = deepspeed_config(cfg, lay.dp)
    p = plan(cfg, lay, device=device, ds=ds)
    text = [table(p)]
    if cfg.parallel.activation_checkpointing == 0:
        ck = TrainConfig.from_dict({**cfg.to_dict(), "parallel": {**cfg.to_dict()["parallel"],
                                                                  "activation_checkpointing": 1}})
        other = plan(ck, lay, device=device, ds=ds)
        text.append(f"with parallel.activation_checkpointing=1: activations "
                    f"{gib(max(s.activations.total * s.in_flight + s.activations.transient.bytes for s in other.stages))}"
                    f" (+ one layer recomputed at a time), peak {gib(other.peak)}")
    if budget is not None:
        fitting = []
        for alt in layouts(cfg, world):
            alt_cfg = TrainConfig.from_dict({**cfg.to_dict(), "parallel": {**cfg.to_dict()["parallel"], "tp": alt.tp,
                                                                           "pp": alt.pp, "zero_stage": alt.zero,
                                                                           "cp": alt.cp}})
            try:   # the launch's own checks (train.spike_z with PP, the data streams, …) beside the pre-filter's
                alt_cfg.check_runtime(world, cuda=device == "cuda")
            except ConfigError:
                continue
            peak = plan(alt_cfg, alt, device=device, ds=deepspeed_config(alt_cfg, alt.dp)).peak
            if verdict(peak, budget, alt).status == "fits":
                fitting.append((alt, peak))
        text[0] = table(p, budget, sorted(fitting, key=lambda x: x[1]),
                        largest_micro_batch(cfg, lay, budget, device, ds))
    return "\n".join(text)
