"""The time model's terms, each one formula in seconds (docs/DESIGN.md "The time model" lists them together).

Legend: P the GPU's peak FLOP/s at the run's precision, e the calibrated compute efficiency (a fraction of P), S
its streaming multiprocessors, W its memory bandwidth (bytes/s); a link of bandwidth β (bytes/s per GPU and
direction) and latency α (s); t, p, d the tensor-, pipeline- and data-parallel sizes, m the micro-batches of a
step, b the micro-batch, n the sequence length, h the width.

    GEMM            max(2·M·K·N / (e·P·u(M, N)), a·(M·K + K·N + M·N) / W)   the roofline of one GEMM (a bytes an
                    element); u: the last wave of 128×128 output tiles is partly empty,
                    u = tiles / (⌈tiles / S⌉·S), tiles = ⌈M/128⌉·⌈N/128⌉
    memory-bound    bytes / W                 elementwise work, gradient accumulation, the optimizer
    all-reduce      2·(r − 1)·(c·α + bytes/(r·β))   a ring of r ranks: reduce-scatter then all-gather, each r − 1
                    steps that move bytes/r per rank; a step ends when its slowest hop does (α: NCCL's ring
                    latency per step over that hop); c calls (buckets) share the bytes, each pays the latency
    reduce-scatter  (r − 1)·(c·α + bytes/(r·β))     and all-gather alike (NCCL's ring, the algorithm it takes
                    for large messages over few nodes; its trees, for many nodes, are not modeled)
    send            α + bytes/β               a point-to-point message between pipeline stages
    1F1B schedule   (m − 1)·max_s T_s + Σ_s T_s   T_s one micro-batch's forward + backward on stage s: the first
                    micro-batch crosses every stage, the slowest stage paces the rest; the bubble is
                    Σ_s T_s − max_s T_s, (p − 1)/m of the step's work for equal stages
    overlap         max(0, comm − window)     communication running beside computation shows only where it outlasts
                    the computation it hides behind
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from pretrain.plan.cluster import Link

TILE = 128   # the output tile of a tensor-core GEMM (cuBLAS/CUTLASS bf16 kernels use 128×128 and larger)


@dataclass(frozen=True)
class Rate:
    """What prices compute on one GPU: e·P (FLOP/s, the efficiency applied), S, W (bytes/s), a (bytes an element)."""
    flops: float
    sms: int
    bandwidth: float
    element_bytes: int

    def scaled(self, factor: float) -> "Rate":
        return Rate(self.flops * factor, self.sms, self.bandwidth, self.element_bytes)


def wave_utilization(rows: int, cols: int, sms: int) -> float:
    """u(M, N): the share of the GPU's multiprocessors busy over a GEMM whose output is rows × cols, one 128×128
    tile per multiprocessor at a time (a CPU: sms = 1, always 1)."""
    tiles = math.ceil(rows / TILE) * math.ceil(cols / TILE)
    return tiles / (math.ceil(tiles / sms) * sms)


def gemm_time(M: int, K: int, N: int, gpu: Rate) -> float:
    """One GEMM (M × K)·(K × N): 2·M·K·N FLOPs at e·P scaled by the wave utilization of its M × N output, or its
    operands read and its output written at W, whichever takes longer (the roofline)."""
    compute = 2 * M * K * N / (gpu.flops * wave_utilization(M, N, gpu.sms))
    return max(compute, gpu.element_bytes * (M * K + K * N + M * N) / gpu.bandwidth)


def train_gemms_time(M: int, K: int, N: int, gpu: Rate) -> float:
    """A linear layer's three training GEMMs: forward Y = X·W (M × N), input gradient ∂X = ∂Y·Wᵀ (M × K), weight
    gradient ∂W = Xᵀ·∂Y (K × N), each with its own output's wave utilization."""
    return gemm_time(M, K, N, gpu) + gemm_time(M, N, K, gpu) + gemm_time(K, M, N, gpu)


def memory_time(nbytes: float, bandwidth: float) -> float:
    """Memory-bound work: every byte read or written once at the device's bandwidth W."""
    return nbytes / bandwidth


def all_reduce_time(nbytes: float, ranks: int, link: Link, calls: int = 1) -> float:
    """Ring all-reduce of `nbytes` over `ranks` in `calls` buckets: 2·(r − 1)·(c·α + bytes/(r·β)) (0 for one rank)."""
    return 2 * reduce_scatter_time(nbytes, ranks, link, calls)


def reduce_scatter_time(nbytes: float, ranks: int, link: Link, calls: int = 1) -> float:
    """Ring reduce-scatter (or all-gather) of `nbytes` in all over `ranks`, in `calls` buckets:
    (r − 1)·(c·α + bytes/(r·β))."""
    if ranks <= 1:
        return 0.0
    return (ranks - 1) * (calls * link.latency_s + nbytes / ranks / link.bytes_per_s)


def buckets(elements: float, bucket: float) -> int:
    """The collective calls a bucketed reduction or gather of `elements` makes (buckets of `bucket` elements)."""
    return max(1, math.ceil(elements / bucket))


def send_time(nbytes: float, link: Link) -> float:
    """One point-to-point message: α + bytes/β."""
    return link.latency_s + nbytes / link.bytes_per_s


def pipeline_time(stage_times: list[float], micro_batches: int) -> tuple[float, float]:
    """(the step's time, its bubble) under 1F1B: (m − 1)·max_s T_s + Σ_s T_s; bubble Σ_s T_s − max_s T_s."""
    slowest, total = max(stage_times), sum(stage_times)
    return (micro_batches - 1) * slowest + total, total - slowest


def exposed(comm: float, window: float) -> float:
    """Communication overlapped with `window` seconds of computation: only what outlasts it costs time."""
    return max(0.0, comm - window)
