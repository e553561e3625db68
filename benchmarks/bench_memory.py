"""Memory readings inside one measurement process of benchmarks/bench.py (benchmarks/bench_lib.py measure): the live
tensors an engine holds at rest, and the peak memory of a process by phase of a step (CPU: resident set size; CUDA:
the caching allocator's counters and the driver's free memory)."""
from __future__ import annotations

from pretrain.observe.metrics import memory_mb, reset_peak_memory


def tensor_mb() -> float:
    """MB held by the live tensors of this process that Python reaches and autograd did not make (parameters,
    optimizer states, ZeRO's flat buffers and partitions, gradients; not the outputs a pipeline keeps), each storage
    counted once: what an engine holds at rest, read off its tensors rather than off the allocator."""
    import gc

    import torch

    seen = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.device.type != "meta" and obj.grad_fn is None:
                storage = obj.untyped_storage()
                seen[(obj.device, storage.data_ptr())] = storage.nbytes()
        except (RuntimeError, ReferenceError):   # a tensor without storage (sparse, a freed weakref proxy)
            continue
    return sum(seen.values()) / 2**20


class Memory:
    """Peak memory of this process, in MB. CUDA: the caching allocator's counters. CPU: resident set size, with the
    kernel's high-water mark (VmHWM) reset before each repetition (/proc/self/clear_refs "5"), so each repetition has
    its own peak; where that reset is refused, every repetition reports the peak so far (ru_maxrss).
    Readings: after imports (`after_init`), once the engine is built (`after_engine`), and at rest between steps after
    the warm-up (`at_rest`: parameters and optimizer states, Adam's being created by the first step). `phase(name)`
    closes a phase of a step: its peak is kept (the highest over a repetition's steps) and the next phase's begins.
    On CUDA each reading also keeps the allocator's and the driver's view (`cuda`): max_memory_allocated,
    max_memory_reserved (the caching allocator's segments: what the process holds) and torch.cuda.mem_get_info
    (free and total on the device, other processes included), in MB, for memory verdicts against the device."""

    def __init__(self, device):
        self.device = device
        self.reserved = 0.0   # the highest max_memory_reserved over the phases since reset_peak
        self.after_init = self.now()   # after imports and the process group's start
        self.after_engine = self.at_rest = self.tensors_at_rest = None
        self.cuda = {"after_engine": None, "at_rest": None, "reps": []}
        self.phases = {}

    def cuda_reading(self, allocated_mb: float | None = None) -> dict | None:
        """{max_allocated_mb, max_reserved_mb, free_mb, total_mb} now (since reset_peak; `allocated_mb`: the peak
        over the phases), or None off CUDA."""
        if self.device.type != "cuda":
            return None
        import torch

        free, total = torch.cuda.mem_get_info(self.device)
        reserved = max(self.reserved, torch.cuda.max_memory_reserved(self.device) / 2**20)
        return {"max_allocated_mb": allocated_mb if allocated_mb is not None else memory_mb(self.device),
                "max_reserved_mb": reserved, "free_mb": free / 2**20, "total_mb": total / 2**20}

    def now(self) -> float:
        return memory_mb(self.device, peak=False)

    def engine_built(self) -> None:
        self.after_engine = self.now()
        self.cuda["after_engine"] = self.cuda_reading()

    def rest(self) -> None:
        self.at_rest = self.now()
        self.tensors_at_rest = tensor_mb()
        self.cuda["at_rest"] = self.cuda_reading()

    def reset_peak(self) -> None:
        self.phases, self.reserved = {}, 0.0
        reset_peak_memory(self.device)

    def phase(self, name: str) -> None:
        self.phases[name] = max(self.phases.get(name, 0.0), memory_mb(self.device))
        if self.device.type == "cuda":
            import torch

            self.reserved = max(self.reserved, torch.cuda.max_memory_reserved(self.device) / 2**20)
        reset_peak_memory(self.device)

    def peak(self) -> float:
        """Since reset_peak(): the highest of the phases' peaks and of what came after the last phase."""
        return max([memory_mb(self.device), *self.phases.values()])
