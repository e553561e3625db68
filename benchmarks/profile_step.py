#!/usr/bin/env python
"""Where one training step's time goes: torch.profiler over a few steps of a config, after a warm-up.

    python benchmarks/profile_step.py configs/synth-1.3b.yaml parallel.tp=1 train.global_batch_size=4 model.mixer=dot
    python benchmarks/profile_step.py CONFIG [OVERRIDES...] --kind loop --compile --top 25

--kind train (default) is our DeepSpeed engine (pretrain.engine.build_engine), `loop` the plain PyTorch loop that
benchmarks/bench.py compares it with, `peer` Hugging Face GPT-2 under the same engine. One process, on CUDA when there is
a GPU (else the CPU), random tokens. Prints, per step: the wall time, the kernels by total device time (the top
--top, with calls and share), the kernel launches, the host waits (synchronizations and device-to-host copies) and
the calls of the per-tensor ops that betray per-parameter loops (isfinite, abs, copy_, add_, mul_).
--trace FILE also writes a Chrome trace (open it in chrome://tracing or Perfetto).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter


# What makes the host wait for the device (CUDA runtime calls seen by the profiler's CPU side; of the copies
# (cudaMemcpyAsync) those to the host wait, and each .item() shows as one aten::_local_scalar_dense)
HOST_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
TELLTALE_OPS = ("aten::isfinite", "aten::abs", "aten::copy_", "aten::add_", "aten::mul_", "aten::_local_scalar_dense")


def report(prof, steps: int, step_s: float, top: int) -> str:
    from torch.autograd import DeviceType

    kernels, launches, waits, ops = Counter(), 0, Counter(), Counter()
    calls = Counter()
    for e in prof.events():
        if e.device_type == DeviceType.CUDA and getattr(e, "is_user_annotation", False):
            continue   # a labelled range on the GPU's timeline (Optimizer.step#…), not a kernel: it spans kernels
        if e.device_type == DeviceType.CUDA:
            kernels[e.name] += e.device_time_total
            calls[e.name] += 1
            launches += 1
        elif e.name in HOST_WAITS or e.name == "cudaMemcpyAsync":
            waits[e.name] += 1
        elif e.name in TELLTALE_OPS:
            ops[e.name] += 1
    busy = sum(kernels.values()) / 1e3 / steps
    lines = [f"step {step_s * 1e3:.1f} ms wall; device busy {busy:.1f} ms a step "
             f"({100 * busy / (step_s * 1e3):.0f}%); {launches / steps:.0f} kernel launches a step",
             "host waits a step: " + (", ".join(f"{k} {v / steps:g}" for k, v in waits.items()) or "none seen"),
             "per-tensor ops a step: " + ", ".join(f"{k.split('::')[1]} {ops[k] / steps:g}" for k in TELLTALE_OPS),
             f"{'ms/step':>8} {'share':>6} {'calls':>6}  kernel"]
    total = sum(kernels.values()) or 1.0
    for name, us in kernels.most_common(top):
        lines.append(f"{us / 1e3 / steps:8.2f} {100 * us / total:5.1f}% {calls[name] / steps:6g}  {name[:110]}")
    if not kernels:
        lines.append("(no device kernels: a CPU run; see the CPU ops below)")
        lines.append(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("config", help="a YAML config (configs/...)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides, as the trainer takes them")
    ap.add_argument("--kind", choices=("train", "loop", "peer"), default="train",
                    help="our DeepSpeed engine (default), the plain PyTorch loop, or GPT-2 under the engine")
    ap.add_argument("--compile", action="store_true", help="engine.compile() / torch.compile first")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    ap.add_argument("--steps", type=int, default=3, help="profiled steps (default 3)")
    ap.add_argument("--top", type=int, default=20, help="kernels listed (default 20)")
    ap.add_argument("--trace", help="also write a Chrome trace to this file")
    a = ap.parse_args(argv)
    if not os.path.exists(a.config):
        print(f"error: no config file {a.config}", file=sys.stderr)
        return 2
    from model import ConfigError
    from pretrain.config import load_config

    try:   # the config's own one-line errors, before any process group starts
        load_config(a.config, a.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from benchmarks.bench import rank_env   # a one-rank world's environment, as the launcher sets it

    os.environ.update({k: v for k, v in rank_env({"world": 1, "env": {}})[0].items() if k not in os.environ})
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.bench_lib import training_step

    spec = dict(config=a.config, overrides=a.overrides, kind=a.kind, compile=a.compile)
    step, sync, engine, cfg, lay, _ = training_step(spec)
    print(f"profiling {a.kind}{' (compiled)' if a.compile else ''} of {a.config} on {lay.device}: "
          f"{a.warmup} warm-up steps, then {a.steps}", flush=True)
    for _ in range(a.warmup):
        step()
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if lay.device.type == "cuda" else [])
    with profile(activities=activities, record_shapes=False) as prof:
        t0 = time.perf_counter()
        for _ in range(a.steps):
            step()
        sync()
        step_s = (time.perf_counter() - t0) / a.steps
    print(report(prof, a.steps, step_s, a.top))
    if a.trace:
        prof.export_chrome_trace(a.trace)
        print(f"trace: {a.trace}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
