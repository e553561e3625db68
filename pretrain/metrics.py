"""What the run reports: console lines, TensorBoard (scalars, attention-map images, text) and metrics.jsonl.

Only global rank 0 writes; every other rank gets a Logger whose methods do nothing, so the training loop
calls it unconditionally.
"""
from __future__ import annotations

import json
import os
import resource
import sys
import time

import torch


def memory_mb(device: torch.device, peak: bool = True) -> float:
    """This process's memory in MB — CUDA: the caching allocator's live tensors; CPU: the resident set — at its
    highest since the start or the last `reset_peak_memory` (`peak`), or now. The one reader of the trainer's log,
    tools/bench.py and tools/bench_mixer.py."""
    if device.type == "cuda":
        return (torch.cuda.max_memory_allocated if peak else torch.cuda.memory_allocated)(device) / 2**20
    if peak:   # the kernel's high-water mark (VmHWM), which reset_peak_memory lowers to now
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak: CUDA's counters, or on CPU the kernel's VmHWM (/proc/self/clear_refs "5"); where that is
    refused, the CPU peak stays the process's highest so far."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def attention_grid(maps: list[torch.Tensor], max_heads: int = 4) -> list[torch.Tensor]:
    """Per layer, the first heads' maps (n, n) side by side as one image (1, n, heads·n) in [0, 1].

    Each row is scaled by its maximum so that a flat distribution is still visible; the upper triangle stays 0.
    """
    images = []
    for A in maps:                                          # (B, Hl, n, n)
        heads = A[0, :max_heads].float()
        heads = heads / heads.amax(dim=-1, keepdim=True).clamp_min(1e-12)
        images.append(torch.cat(list(heads), dim=-1).unsqueeze(0).cpu())
    return images


def keep_rows_up_to(path: str, step: int) -> None:
    """A run resumed at `step` replays the steps after it: their rows in the JSON-lines file `path` (metrics.jsonl,
    a rank's sample ids) move to `<name>.replayed.jsonl` beside it, so that the file holds each step once, as the
    uninterrupted run's would, and the replaced rows stay at hand for comparison."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    keep = [line for line in lines if json.loads(line)["step"] <= step]
    if len(keep) == len(lines):
        return
    with open(path.removesuffix(".jsonl") + ".replayed.jsonl", "a") as f:
        f.writelines(line for line in lines if json.loads(line)["step"] > step)
    with open(path + ".tmp", "w") as f:
        f.writelines(keep)
    os.replace(path + ".tmp", path)


class Logger:
    def __init__(self, enabled: bool, tensorboard_dir: str, run_dir: str):
        self.enabled = enabled
        self.writer = None
        self.jsonl = None
        self.jsonl_path = os.path.join(run_dir, "metrics.jsonl")
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            os.makedirs(run_dir, exist_ok=True)
            self.writer = SummaryWriter(tensorboard_dir)
            self.jsonl = open(self.jsonl_path, "a")
        self.t0 = time.time()

    def resume_at(self, step: int) -> None:
        """metrics.jsonl without the rows of the steps after `step`, which the resumed run writes again."""
        if self.enabled:
            self.jsonl.close()
            keep_rows_up_to(self.jsonl_path, step)
            self.jsonl = open(self.jsonl_path, "a")

    def info(self, msg: str) -> None:
        if self.enabled:
            print(f"[{time.time() - self.t0:7.1f}s] {msg}", flush=True, file=sys.stdout)

    def scalars(self, step: int, values: dict) -> None:
        if not self.enabled:
            return
        for tag, v in values.items():
            self.writer.add_scalar(tag, v, step)
        self.jsonl.write(json.dumps({"step": step, **values}) + "\n")
        self.jsonl.flush()
        self.writer.flush()

    def images(self, step: int, tag: str, images: list[torch.Tensor]) -> None:
        if self.enabled:
            for i, img in enumerate(images):
                self.writer.add_image(f"{tag}/layer_{i:02d}", img, step, dataformats="CHW")
            self.writer.flush()

    def text(self, step: int, tag: str, text: str) -> None:
        if self.enabled:
            self.writer.add_text(tag, text, step)
            self.writer.flush()

    def close(self) -> None:
        if self.enabled:
            self.writer.close()
            self.jsonl.close()
