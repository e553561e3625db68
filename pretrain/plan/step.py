"""One optimizer step's predicted time for a config, a layout and a cluster: pretrain/plan/workload.py's work priced
by pretrain/plan/terms.py's formulas (docs/DESIGN.md "The time model").

Per micro-batch on pipeline stage s (t, c, p, d the TP, CP, PP and DP sizes, m = global batch ÷ (micro-batch · d);
under CP a rank's work is that of n/c positions, pretrain/plan/workload.py):
    compute     Σ GEMMs at e·P·u, the mixers' own FLOPs at e·r_v·P·u_attn (r_v: the variant's measured efficiency
                relative to dot, u_attn the wave utilization of one tile per 128 queries of each local head),
                recomputed blocks' forward again; on a CPU also the host's time a micro-batch (calibrated)
    memory      4 × the activation bytes each block keeps (written, read, their gradient written and read; a
                recomputed block writes them again), the n² scores where the engine materializes them, the loss's
                logits, and from the second micro-batch on the gradient accumulation, at W
    TP          the blocks' all-reduces (forward, backward, recomputation) over t ranks, never overlapped
    CP          each block's two all-gathers of the chunks' values, keys, LN(Z2) over c ranks in forward (and in
                recomputation), and the reduce-scatter of their gradients in backward, never overlapped
    PP sends    the stage's output forward and its gradient backward, one message each (split over the TP ranks
                where the engine scatters and gathers, re-gathered over NVLink)
    ZeRO-2      the gradients' reduce-scatter after each micro-batch; ZeRO-3 also gathers the stage's weights in
                forward and in backward (and in recomputation), overlapped with the micro-batch's compute
Per step: the 1F1B schedule of the stages (the bubble); the data-parallel reduction over d·c ranks (the CP ranks
hold the same parameters; ZeRO-0 all-reduce, ZeRO-1
reduce-scatter, each ≥ 1 also all-gathers the updated weights), overlapped with the last backward where the engine
overlaps; the optimizer, AdamW's bytes per parameter of the rank's partition at W (on a CPU with the host's time a
step, calibrated).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from model.accounting import train_flops_per_token
from model.memory import bytes_of
from pretrain.config import TrainConfig
from pretrain.plan.memory import Layout
from pretrain.plan import terms
from pretrain.plan.cluster import Cluster
from pretrain.plan.workload import LOSS_BYTES_PER_LOGIT, Engine, LayerWork, stage_work

ACTIVATION_PASSES = 4   # a kept byte: written in forward, read in backward, its gradient written and read


@dataclass(frozen=True)
class Efficiency:
    """The calibrated part (pretrain/plan/calibration.py): e, r_v per variant measured (else 1: dot's), and the host's
    own time where it does not hide behind the device (a CPU: every op is dispatched and then run by the same thread):
    per micro-batch on each stage, and per step (the engine's and optimizer's bookkeeping). On a GPU the host runs
    ahead of the device asynchronously: both 0."""
    compute: float
    relative: dict = field(default_factory=dict)    # mixer name → r_v
    source: str = ""
    host_micro_batch: float = 0.0                  # seconds a micro-batch on a stage
    host_step: float = 0.0                         # seconds a step

    def of(self, mixer: str) -> float:
        return self.compute * self.relative.get(mixer, 1.0)


@dataclass
class Prediction:
    layout: Layout
    micro: int
    checkpointing: int
    micro_batches: int
    terms: dict[str, float]          # seconds a step: compute, memory, tp, cp, pp, bubble, dp, optimizer, host (sum)
    tokens_per_step: int
    flops_per_step: float            # the project's count (model/accounting.py), without recomputation
    peak: float                      # FLOP/s of one GPU at the run's precision
    notes: list[str] = field(default_factory=list)

    @property
    def step_s(self) -> float:
        return sum(self.terms.values())

    @property
    def gpus(self) -> int:
        return self.layout.world

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_step / self.step_s / self.gpus

    @property
    def mfu(self) -> float:
        return self.flops_per_step / self.step_s / self.gpus / self.peak

    def dominant(self, k: int = 2) -> list[tuple[str, float]]:
        """The k largest terms with their share of the step."""
        top = sorted(self.terms.items(), key=lambda kv: -kv[1])[:k]
        return [(name, value / self.step_s) for name, value in top if value > 0]


@lru_cache(maxsize=4096)
def layer_compute(w: LayerWork, recomputed: bool, gpu: terms.Rate, b: int, n: int) -> float:
    """One block's training compute on its rank: its linear layers' GEMMs, the mixer's own FLOPs at the wave
    utilization of one tile per 128 queries of each local head, and the forward again where it is recomputed."""
    gemms = sum(terms.train_gemms_time(M, K, N, gpu) for M, K, N in w.gemms)
    u = terms.wave_utilization(b * w.heads * n, terms.TILE, gpu.sms)
    mixer = w.mixer_flops / (gpu.flops * u)
    forward = sum(terms.gemm_time(M, K, N, gpu) for M, K, N in w.gemms) + mixer * w.forward_fraction
    return gemms + mixer + (forward if recomputed else 0.0)


def layer_memory_bytes(w: LayerWork, recomputed: bool, engine: Engine, b: int, n: int, cp: int = 1) -> float:
    """Bytes the memory-bound kernels of one block move: ACTIVATION_PASSES over what it keeps (one more write where
    it is recomputed), and the n² scores where the engine materializes them (under cp a rank's n/cp rows)."""
    scores = engine.score_bytes * b * w.heads * n * n // cp
    return (ACTIVATION_PASSES + recomputed) * w.activation_bytes + scores


def optimizer_bytes_per_param(cfg: TrainConfig) -> int:
    """Bytes the optimizer step moves per parameter of the rank's partition (g the gradients' bytes, M the master
    weights' and moments', w the model weights'): AdamW reads the gradient, master weight and both moments and writes
    the three back (7·M), after reading the gradient once for the norm that clipping needs (M). Where the weights are
    not the master copy (ZeRO, or bf16 weights), the gradients are first copied into a flat partition (2·g) and cast
    to the master dtype (g + M where they differ), and the master weights are cast back into the model's (M + w)."""
    t = cfg.train
    w = bytes_of(t.weights_precision())
    master = 2 if t.master_weights == "bf16" else 4
    if cfg.parallel.zero_stage == 0 and w == master:   # fp32 weights are the master (train.autocast, fp32 runs)
        return 8 * master
    return 2 * w + (w + master if w != master else 0) + 8 * master + master + w


def predict(cfg: TrainConfig, lay: Layout, cluster: Cluster, eff: Efficiency, engine: Engine,
            micro: int | None = None, gpu: bool = True, flops_per_token: float | None = None) -> Prediction:
    """The predicted optimizer step of `cfg` on `lay` at micro-batch `micro` (default the config's); `gpu`: the
    GPU path's kernels in the memory terms (model/kernels.py), False on a CPU."""
    b = micro or cfg.train.micro_batch_size
    n, t, p, d, c = cfg.model.max_seq_len, lay.tp, lay.pp, lay.dp, lay.cp
    g = lay.shards   # d·c ranks average the gradients (and partition ZeRO's states)
    m = cfg.train.global_batch_size // (b * d)
    W = cluster.gpu.hbm_gbps * 1e9
    a = bytes_of(cfg.train.precision)
    rate = terms.Rate(cluster.gpu.peak(cfg.train.precision), cluster.gpu.sms, W, a)
    # ranks are numbered TP fastest, then CP, then DP, then pipeline stages (megatron-core's and DeepSpeed's grids)
    tp_link, cp_link, dp_link = cluster.group_link(t, 1), cluster.group_link(c, t), cluster.group_link(g, t)
    # stages t·c·d ranks apart: once they span nodes, some boundary crosses one (one GPU's NIC), and paces the rest
    pp_link = cluster.intra_node if lay.world <= cluster.gpus_per_node else cluster.group_link(2, cluster.gpus_per_node)
    grad = bytes_of(cfg.train.weights_precision())   # gradients and weights travel in the weights' dtype
    stages = stage_work(cfg, lay, b, gpu, engine.even_stages)
    parts = []   # per stage, one micro-batch: compute, memory, TP, CP, PP sends, ZeRO-2/3's collectives, host
    for st in stages:
        compute = sum(layer_compute(w, r, rate.scaled(eff.of(w.mixer)), b, n // c)
                      for w, r in zip(st.layers, st.recomputed))
        memory = sum(layer_memory_bytes(w, r, engine, b, n, c) for w, r in zip(st.layers, st.recomputed))
        # two rounds a block: forward (and recomputation) all-gathers, backward reduce-scatters the gradients
        cp = sum(2 * (2 + r) * terms.reduce_scatter_time(c * w.cp_gather_bytes, c, cp_link)
                 for w, r in zip(st.layers, st.recomputed))
        if st.head_gemm:
            compute += terms.train_gemms_time(*st.head_gemm, rate.scaled(eff.compute))
            memory += LOSS_BYTES_PER_LOGIT * st.logits
        if cfg.train.autocast:   # each forward casts the fp32 weights to bf16 (read 4, write 2)
            memory += 6 * st.params
        if m > 1:   # each micro-batch after the first adds its gradient into the accumulated one
            memory += engine.accumulate_bytes * st.params / (g if engine.reduce_every_micro_batch else 1) * (m - 1) / m
        reduces = sum(w.tp_all_reduces * (2 + r) for w, r in zip(st.layers, st.recomputed)) + st.first + st.last
        tp = reduces * terms.all_reduce_time(st.boundary_bytes, t, tp_link) + 3 * st.last * tp_link.latency_s * (t > 1)
        if engine.p2p_scatter_gather and t > 1 and pp_link is not cluster.intra_node:   # 1/t each, then gathered
            one = terms.send_time(st.boundary_bytes / t, pp_link) + \
                terms.reduce_scatter_time(st.boundary_bytes, t, cluster.intra_node)
        else:
            one = terms.send_time(st.boundary_bytes, pp_link)
        pp = 2 * ((not st.first) + (not st.last)) * one if p > 1 else 0.0   # each boundary: activation, gradient
        zero, P = 0.0, st.params
        if lay.zero >= 2 and g > 1:   # ZeRO-2/3 reduce-scatter each micro-batch's gradients
            zero += terms.reduce_scatter_time(grad * P, g, dp_link, terms.buckets(P, engine.reduce_bucket))
        if lay.zero == 3 and g > 1:   # and ZeRO-3 gathers the weights for forward, backward (and recomputation)
            gather = terms.reduce_scatter_time(grad * P, g, dp_link, terms.buckets(P, engine.gather_bucket))
            zero += (2 + any(st.recomputed)) * gather
        if engine.dp_overlap:
            zero = terms.exposed(zero, compute + memory / W)
        parts.append((compute, memory / W, tp, pp, zero, eff.host_micro_batch, cp))
    stage_times = [sum(x) for x in parts]
    _, bubble = terms.pipeline_time(stage_times, m)
    slow = parts[stage_times.index(max(stage_times))]
    busiest = max(st.params for st in stages)
    dp = 0.0   # the step's own reduction: ZeRO-0 all-reduces, ZeRO-1 reduce-scatters; ZeRO-1/2 gather the weights
    if g > 1:
        calls = terms.buckets(busiest, engine.reduce_bucket)
        if lay.zero == 0:
            dp = terms.all_reduce_time(grad * busiest, g, dp_link, calls)
        elif lay.zero == 1:
            dp = terms.reduce_scatter_time(grad * busiest, g, dp_link, calls)
        if lay.zero in (1, 2):
            dp += terms.reduce_scatter_time(grad * busiest, g, dp_link, terms.buckets(busiest, engine.gather_bucket))
        if engine.dp_overlap:   # beside the last micro-batch's backward, ⅔ of its compute
            dp = terms.exposed(dp, 2 / 3 * (slow[0] + slow[1]))
    optimizer = terms.memory_time(optimizer_bytes_per_param(cfg) * busiest / (g if lay.zero >= 1 else 1), W)
    notes = [f"{mixer}: its efficiency relative to dot is not measured on a GPU; dot's is assumed"
             for mixer in dict.fromkeys(cfg.model.layer_mixers()) if mixer != "dot" and mixer not in eff.relative]
    per_token = flops_per_token or train_flops_per_token(cfg.model)
    return Prediction(lay, b, cfg.parallel.activation_checkpointing, m,
                      {"compute": m * slow[0], "memory": m * slow[1], "tp": m * slow[2], "cp": m * slow[6],
                       "pp": m * slow[3],
                       "bubble": bubble, "dp": m * slow[4] + dp, "optimizer": optimizer,
                       "host": m * slow[5] + eff.host_step},
                      cfg.tokens_per_step, per_token * cfg.tokens_per_step, rate.flops, notes)
