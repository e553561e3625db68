"""A GPU part of benchmarks/bench.py run on a CPU with tiny stand-in points (tests/unit/test_gpu_window.py): torch
names an H100 as CUDA device 0 for planning, and each point's process is replaced by an instant result (a short
sleep), recorded in `RUN`. Run as a script it measures one part so, in a process a test may kill:

    python tests/support/fake_gpu.py SLEEP_S HANG_AFTER [bench.py arguments]
        each point takes SLEEP_S; the point after HANG_AFTER measured ones never ends (0: none hangs)
"""
from __future__ import annotations

import sys
import time

DEVICE = "NVIDIA H100 80GB HBM3"
RUN: list[dict] = []   # the specs measured, in order


def fake_point(spec: dict, timeout: float, sleep_s: float = 0.0, hang_after: int = 0, on_point=None) -> dict:
    RUN.append({**spec, "timeout": timeout})
    if on_point:
        on_point()
    if hang_after and len(RUN) > hang_after:
        time.sleep(3600)
    time.sleep(sleep_s)
    steps = [0.150 + 0.001 * (i % 5) for i in range(spec["steps"] * spec["reps"])]
    return {"rate": [8192 / (sum(steps) / len(steps))], "step_s": [sum(steps) / len(steps)], "step_each": steps,
            "loss": [10.5], "train_flops_per_token": 8.849e9, "tokens_per_step": 8192, "val_loss": [5.0],
            "total_mb": [100.0], "rank": 0}


def install(monkeypatch=None, sleep_s: float = 0.0, hang_after: int = 0, on_point=None) -> None:
    """The fake device and points, by monkeypatch (a test) or for good (this script's process); `on_point()` is
    called as each point starts (e.g. to advance a test's clock)."""
    import torch

    from benchmarks import bench_proc

    def point(spec, timeout):
        return fake_point(spec, timeout, sleep_s, hang_after, on_point)
    memory = type("Properties", (), {"total_memory": 80 * 2**30})()
    patches = [(torch.cuda, "is_available", lambda: True), (torch.cuda, "get_device_name", lambda i=0: DEVICE),
               (torch.cuda, "get_device_properties", lambda i=0: memory), (bench_proc, "run_point", point)]
    for owner, name, value in patches:
        monkeypatch.setattr(owner, name, value) if monkeypatch else setattr(owner, name, value)


if __name__ == "__main__":
    install(sleep_s=float(sys.argv[1]), hang_after=int(sys.argv[2]))
    from benchmarks.bench import main

    sys.exit(main(sys.argv[3:]))
