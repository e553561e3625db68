"""The memory verdict: whether a planned peak (pretrain/plan/memory.py) fits a GPU, with headroom for what the plan does
not count.

    headroom = CUDA context + NCCL buffers (per communicator the layout opens) + (ALLOCATOR_FACTOR − 1) · peak
    spare    = GPU memory − peak − headroom

    fits           spare ≥ 0: "fits with 12.3 GiB to spare"
    tight          the peak, the CUDA context and NCCL fit, but not the allocator's margin: it fits only if the plan errs
                   less than it did on the records the factor was fitted to
    does not fit   the peak, the CUDA context and NCCL alone exceed the GPU

ALLOCATOR_FACTOR is measured peak ÷ planned peak, at its largest over the GPU records it is fitted to
(benchmarks/allocator_fit.py; the records, the fit and its check on held-out records: docs/benchmarks.md, "The memory
plan"). It is fitted on what the records hold: the caching allocator's max_memory_allocated, and max_memory_reserved
where a record has it (none does yet). Until one does, the factor covers the plan's own error against allocated memory,
not the allocator's reserve above it (fragmentation).

The CUDA context and the NCCL buffers are estimates, not measurements: CUDA_CONTEXT, a CUDA 12 context with torch's
kernels loaded lazily, rounded up; NCCL_PER_COMMUNICATOR, NCCL's default buffer (NCCL_BUFFSIZE, 4 MiB) for each of
its three protocols, in both directions, on each of 32 channels, rounded up. `communicators(layout)` counts those a
rank opens: NCCL opens one per process group on its first collective there.
"""
from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30
ALLOCATOR_FACTOR = 1.089            # fitted: benchmarks/allocator_fit.py --fit H100 (max over the records), tested
CUDA_CONTEXT = 1 * GIB              # estimate, not measured
NCCL_PER_COMMUNICATOR = 768 * 2**20   # estimate: 4 MiB × 3 protocols × 2 directions × 32 channels = 768 MiB


@dataclass(frozen=True)
class Verdict:
    status: str            # "fits", "tight" or "does not fit"
    spare_bytes: int       # GPU memory − peak − headroom (negative unless it fits)
    headroom_bytes: int    # CUDA context + NCCL buffers + the allocator's margin
    text: str


def communicators(layout) -> int:
    """NCCL communicators a rank of `layout` (anything with tp, cp, pp and dp) opens: the world's (the trainer's flags
    and barriers), the data-parallel group's (gradients), the tensor-parallel group's (activations), the
    context-parallel group's (the chunks' gathers), and under pipeline parallelism the two neighbour stages' p2p
    groups and the tied embedding's group. A group of one rank opens none, nor does a group equal to the world."""
    world = layout.tp * layout.cp * layout.pp * layout.dp
    if world == 1:
        return 0
    return 1 + (1 < layout.dp < world) + (1 < layout.tp < world) + (1 < layout.cp < world) + \
        (3 if layout.pp > 1 else 0)


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def verdict(peak_bytes: int, gpu_bytes: int, layout) -> Verdict:
    """Whether a rank's planned peak fits a GPU of `gpu_bytes`, with the headroom above (layout: tp, cp, pp, dp)."""
    n = communicators(layout)
    fixed = CUDA_CONTEXT + n * NCCL_PER_COMMUNICATOR
    margin = int(round((ALLOCATOR_FACTOR - 1) * peak_bytes))
    headroom = fixed + margin
    spare = gpu_bytes - peak_bytes - headroom
    parts = (f"the peak {gib(peak_bytes)} + CUDA context {gib(CUDA_CONTEXT)} + NCCL {gib(n * NCCL_PER_COMMUNICATOR)} "
             f"({n} communicator{'s' * (n != 1)}) + the allocator's margin {gib(margin)} (× {ALLOCATOR_FACTOR:g}) on "
             f"{gib(gpu_bytes)}")
    if spare >= 0:
        return Verdict("fits", spare, headroom, f"fits with {gib(spare)} to spare: {parts}")
    if peak_bytes + fixed <= gpu_bytes:
        return Verdict("tight", spare, headroom, f"tight: {gib(-spare)} short of the allocator's margin, which covers "
                                                 f"the plan's largest error on the GPU records: {parts}")
    return Verdict("does not fit", spare, headroom, f"does not fit: {gib(peak_bytes + fixed - gpu_bytes)} over "
                                                    f"without the allocator's margin: {parts}")
