#!/usr/bin/env python
"""Whole-model benchmarks, each figure measured in this one run on this machine and reported as a ratio.

    python benchmarks/bench.py [--quick] [--only throughput,peer,memory,data,parallel,layouts,engine,documents,gpu,
                          gpu-variants,gpu-memory]
                          [--reps 3] [--out bench]
    make bench [BENCH_ARGS=--quick]

Parts (a full training step = forward, backward and the optimizer step of a DeepSpeed engine, ZeRO-1, 1 process,
on random tokens; each point runs in a fresh process, `benchmarks/bench.py _one SPEC`, so no two share allocator state):
  throughput  tokens/s of every variant in configs/variants/ at n = --seq-len, ÷ that of `dot`.
              Goal: ≥ 0.9 × the FLOP ratio (train FLOPs/token of dot ÷ of the variant, from model_stats).
  peer        the same step for Hugging Face GPT-2 (attn_implementation="sdpa") of equal d, layers, heads, n, vocabulary
              and MLP, under the same DeepSpeed config; ours ÷ GPT-2. Goal: dot ≥ 1.0, random ≥ 1.15.
  memory      peak training memory at each of --lengths (L = n), ÷ that at the first, and the same for GPT-2 (no goal:
              a reference). Memory = the step's peak above the process before the engine: parameters, optimizer
              states, gradients, activations, temporaries (CUDA: the allocator's counters; CPU: resident set size less
              the pages of mapped files, the libraries' code, of which the page cache's state decides how many a step
              maps: bench_memory.cpu_memory_mb; with malloc returning every freed block over 64 kB,
              parallel.cpu_keep_freed_memory=false). The JSON also
              has `step_mb`, the peak above the engine at rest between steps (Adam's states exist from the first
              step on), and `phase_mb`, that of each phase (forward, backward, optimizer step; the table's notes).
              Variants whose model would not fit in --mem-budget-gb at the longest n get fewer layers (noted).
              Goal at 4 × the first n: ≤ 3 for dot, dense, factorized_random, dense+dot; ≤ 5 for random, random+dot.
  data        tokens/s that tokendata.stream.TokenStream delivers from the demo shards (batches of 8 × 128, 2 workers), read
              from disk, over HTTP (tools/serve_shards.py on 127.0.0.1, no cache), and from three HTTP sources blended
              0.5/0.3/0.2 (data.sources, a server each), each ÷ the tokens/s a configs/demo-cpu.yaml train step
              consumes (measured here, 1 CPU process). Goal: ≥ 20 for all three. Also a rank's reader memory (one
              rank, three sources, the default order at global batch 1024: its peak resident memory while it reads,
              and the most shards it holds at once) and the seconds from starting the demo trainer to its first step
              with 100,000 shards behind HTTP (benchmarks/bench_data.py: synthetic shards, a counting server).
  parallel    step time of the throughput part's `dot` model with TP=2 and with DP=2 (2 gloo processes on the CPU)
              ÷ 1 process, equal global batch (--batch). Goal: TP=2 ≤ 1.3.
  layouts     one optimizer step of the demo model (configs/demo-cpu.yaml) in each of LAYOUTS (bench_points.py) at 2
              gloo ranks on the CPU, ÷ the demo's own layout's: each repetition in the real-time class (root only;
              a pause after each lets the machine's other processes catch up), less the longest time a rank still
              waited for a CPU while runnable (Linux's /proc/self/schedstat): the steps the time model must order
              (measured once, kept in pretrain/plan/calibration.yaml; tests/unit/test_time_model.py checks it). No goal.
  engine      our DeepSpeed engine's step ÷ the step of the plain PyTorch loop a user would write for the same model
              (fp32 master weights, torch.autocast at train.precision, torch's fused AdamW, clipping), in the same
              mode: eager with eager, and on CUDA compiled with compiled (train.compile's compiled blocks;
              torch.compile of the loop's model). CPU: the throughput part's dot model; CUDA: synth-1.3b's dot
              twin, bf16, 1 GPU. Goal: ≤ 1.05.
  documents   every variant's tokens/s under model.document_mask ÷ without (benchmarks/bench_points.py DOCUMENTS), on
              the same random tokens with an eos at each position with probability 1/95 (the demo corpus's mean
              document length), both points beside dot's. No goal: the cost of the mask (docs/DESIGN.md §1).
  gpu-binding (CUDA only) the binding settings at accumulation 1: synth-1.3b's dot twin and the flagship dense+dot
              under the engine with bf16 master weights and compiled blocks, and with fp32 master weights under
              train.autocast and compiled blocks, each beside its fp32-master eager run (MFU, no goal: the goals are
              at accumulation 8, gpu-accum); the bf16-master loss over the bench steps within 1% of the fp32-master
              one.
  gpu-accum   (CUDA only) the same compiled points at gradient accumulation 8 (benchmarks/bench_runs.py): MFU goals
              dot ≥ 55%, dense+dot ≥ 45% on an H100 (58%, 48% on an H200), accumulation 1 beside them.
  gpu         (CUDA only) MFU of configs/synth-1.3b.yaml and its dot twin, bf16, 1 GPU, under the engine and in the
              plain loop: measured tokens/s × train FLOPs/token (model/accounting.py) ÷ the device's dense bf16 peak
              (pretrain/observe/device_peaks.py PEAK_TFLOPS: H100/H200 989, A100 312 TFLOP/s). No goal (accumulation 1).
  gpu-variants (CUDA only) every variant's tokens/s ÷ dot's (d 2048, 16 heads, 8 layers, n 2048, batch 4, bf16)
              under the engine, eager and with compiled blocks, goals GPU_GOALS (benchmarks/bench_points.py).
  gpu-memory  (CUDA only) every variant's training memory at n 4096 ÷ 1024 (d 1024, 4 layers), goals ≤ 3 (≤ 5 for
              random, random+dot).
  convergence the convergence check of master weights (synth-125m's widths on the demo shards, 600 steps, fp32
              master, train.autocast, bf16 master: validation loss ÷ fp32 master's); fp8: FP8 tokens/s ÷ bf16 and its
              validation loss over that run (benchmarks/bench_runs.py).
The GPU parts form a queue for a lent GPU (--gpu-part k, make gpu-bench PART=k; make gpu-window runs the next
parts that fit a window; --gpu-queue says which parts' figures stand and which runs next; benchmarks/gpu_queue.py):
0 benchmarks/compile_check.py, 1 gpu-binding, 2 engine, 3 gpu-accum, 4 gpu-variants, 5 gpu-memory, 6 make
gpu-check, 7 convergence, 8 fp8. A part measures only its points that do not stand, each written to points.jsonl
with its census entry (census.json) as it finishes (benchmarks/gpu_part.py).
Each figure: the median over --reps repetitions of --steps timed steps (after --warmup), its spread (max − min) /
median, and for a ratio its range (extreme repetitions); a point timed in one repetition (a GPU part's: 20 steps)
has the median, spread and interquartile range of its steps' own times. The throughput and peer points run
alternately with one live process of our `dot` model (ABBA: each repetition next to one of dot's, `paired_reps` in the
JSON), and their ratios are medians of those side-by-side ratios: a shared VM's speed drifts 10–30% over minutes,
which otherwise decides ±10% goals by chance. Written to OUT/results.json and OUT/results.md; each point's raw result, as it is
measured, to OUT/points.jsonl (what a run cut short keeps).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from benchmarks.bench_points import PARTS, PRESETS, variant_configs
from benchmarks.bench_proc import PointFailed, rank_env, retried_on_port_race, run_paired, run_point  # noqa: F401
from benchmarks.bench_report import machine_info, write_report
from benchmarks.bench_runs import full_plan
from benchmarks.gpu_queue import gpu_queue, report as queue_report, standing
from benchmarks.gpu_records import RECORDS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_TIMING = dict(reps=1, steps=20, warmup=3)   # a GPU part's point: one process, 20 timed steps, their spread

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes (d=64, 2 layers, n=64/128/256, 2 reps, 1 thread) "
                                                         "for tests")
    ap.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts to run (default all): "
                                                             f"{', '.join(PARTS)}")
    ap.add_argument("--gpu-part", type=int, choices=range(0, 9), help="one part of the GPU measurement queue "
                    "(make gpu-bench PART=k): 0 the compile check (benchmarks/compile_check.py), 1 the binding MFU "
                    "points, 2 engine ÷ loop, 3 accumulation 8, 4 the variants, 5 memory, 6 make gpu-check, 7 "
                    "convergence, 8 FP8; sets --only and --variants; measures only the points that do not stand, "
                    "each written with its census entry as it finishes (benchmarks/gpu_part.py); timing default "
                    f"{GPU_TIMING['reps']} × {GPU_TIMING['steps']} steps after {GPU_TIMING['warmup']}")
    ap.add_argument("--gpu-queue", action="store_true", help="print, per GPU part, whether its figures stand at this "
                    "checkout (the kernel census of what it measured unchanged) and which part runs next")
    ap.add_argument("--all-points", action="store_true", help="with --gpu-part: measure every point of the part, "
                                                               "standing or not")
    ap.add_argument("--deadline-s", type=float, help="with --gpu-part: start no point whose estimated seconds do not "
                    "fit before this many seconds from now, and stop one still running then")
    ap.add_argument("--records", default=RECORDS, help="with --gpu-part or --gpu-queue: the folder of the GPU records "
                                                       "(default docs/gpu)")
    ap.add_argument("--variants", default=None, help="comma-separated variant names for throughput and memory "
                                                     "(default: every config in configs/variants/)")
    ap.add_argument("--reps", type=int, help="repetitions per figure (default 3; --quick 2)")
    ap.add_argument("--steps", type=int, help="timed training steps per repetition, after warm-up (default 3; "
                                              "--quick 2; memory points: 1)")
    ap.add_argument("--warmup", type=int, help="untimed steps before the first repetition (default 2: after only one, "
                                               "the first repetition ran up to 25%% slower; --quick 1)")
    ap.add_argument("--d-model", type=int, help="model width d (default 512)")
    ap.add_argument("--layers", type=int, help="blocks (default 8)")
    ap.add_argument("--heads", type=int, help="heads (default 8)")
    ap.add_argument("--seq-len", type=int, help="n of the throughput and peer parts (default 1024)")
    ap.add_argument("--lengths", help="comma-separated n of the memory part; ratios to the first (default "
                                      "1024,2048,4096)")
    ap.add_argument("--batch", type=int, help="micro-batch = global batch of the 1-process steps (default 4)")
    ap.add_argument("--vocab", type=int, help="vocabulary size (default 4096, the demo tokenizer's)")
    ap.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto",
                    help="of the throughput, peer and memory steps; auto = bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--data-batches", type=int, help="loader batches per repetition of the data part (default 100)")
    ap.add_argument("--mem-budget-gb", type=float, help="memory part: fewer layers where the model would not fit "
                                                        "(default: 70%% of the free RAM, or 80%% of the GPU's memory)")
    ap.add_argument("--threads", type=int, help="torch threads per measuring process (default: the trainer's "
                                                "choice, CPU count ÷ processes on the host; --quick: 1). On a machine "
                                                "shared with other work, 2+ OpenMP threads can stall each other")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per measured point (default 3600)")
    ap.add_argument("--out", help="directory of results.json and results.md (default bench; with --gpu-part "
                                  "docs/gpu/<date>-<commit>-<device>/part<k>)")
    return ap


def parse_args(argv) -> argparse.Namespace:
    """Options with the preset's values filled in; ValueError (one line) for a bad --only or --variants."""
    a = build_parser().parse_args(argv)
    for k, v in (GPU_TIMING.items() if a.gpu_part is not None else ()):
        if getattr(a, k) is None:
            setattr(a, k, v)
    for k, v in PRESETS["quick" if a.quick else "default"].items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.only = [s.strip() for s in a.only.split(",") if s.strip()]
    if a.gpu_part is not None:
        queued = gpu_queue(list(variant_configs()))[a.gpu_part]
        a.only, a.variants = queued["only"], ",".join(queued["variants"]) if queued["variants"] else a.variants
    bad = [s for s in a.only if s not in PARTS]
    if bad or not (a.only or a.gpu_part == 0):
        raise ValueError(f"--only: unknown part {', '.join(map(repr, bad)) or '(none given)'}; valid parts: "
                         f"{', '.join(PARTS)}")
    try:
        a.lengths = [int(n) for n in str(a.lengths).split(",")]
    except ValueError:
        raise ValueError(f"--lengths={a.lengths!r} must be comma-separated integers, e.g. 1024,2048,4096") from None
    a.all_variants = variant_configs()
    names = a.all_variants if a.variants is None else [v.strip() for v in a.variants.split(",")]
    unknown = [v for v in names if v not in a.all_variants]
    if unknown:
        raise ValueError(f"--variants: unknown variant {', '.join(unknown)}; valid: {', '.join(a.all_variants)}")
    a.variant_paths = {v: a.all_variants[v] for v in a.all_variants if v in names or v == "dot"}
    import torch

    cuda = torch.cuda.is_available()
    a.gpu = torch.cuda.get_device_name(0) if cuda else None   # the GPU parts are planned for it
    a.precision = ("bf16" if cuda else "fp32") if a.precision == "auto" else a.precision
    if a.mem_budget_gb is None:
        import psutil

        free = 0.8 * torch.cuda.get_device_properties(0).total_memory if cuda else \
            0.7 * psutil.virtual_memory().available
        a.mem_budget_gb = round(free / 2**30, 1)
    return a


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_one"]:   # hidden: measure one point in this fresh process (see run_point)
        from benchmarks.bench_lib import run_point as measure_here

        measure_here(json.loads(argv[1]))
        return 0
    try:
        a = parse_args(argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.gpu_queue:
        print(queue_report(standing(parse_args, root=a.records)))
        return 0
    if a.gpu_part is not None:
        from benchmarks.gpu_part import run_gpu_part

        return run_gpu_part(a, parse_args)
    from tqdm import tqdm

    t0, machine = time.time(), machine_info()
    p = full_plan(a)
    results, paired = {}, [(k, s) for k, s in p.points.items() if s.get("paired") and k != p.reference]
    bar = tqdm(total=len(p.points), desc="bench", unit="point")
    if p.reference:   # the throughput and peer points, each alternated with our dot's live process
        bar.set_postfix_str("throughput and peer points, alternated with dot")
        measured = run_paired(p.points[p.reference], paired, a.timeout, lambda key: bar.update())
        results[p.reference] = measured.pop("reference")
        results.update(measured)
        bar.update()
    out = a.out or os.path.join(ROOT, "bench")
    os.makedirs(out, exist_ok=True)
    open(os.path.join(out, "points.jsonl"), "w").close()
    for key, spec in p.points.items():
        if key not in results:
            bar.set_postfix_str(f"{spec['kind']} {os.path.basename(spec['config'])} "
                                f"{' '.join(spec['overrides'][1:5])}"[:80])
            results[key] = run_point(spec, a.timeout)
            with open(os.path.join(out, "points.jsonl"), "a") as f:   # kept if the run is cut short
                f.write(json.dumps({"spec": spec, "result": results[key]}) + "\n")
            bar.update()
    bar.close()
    return 1 if write_report(a, p, results, t0, machine, out) else 0

if __name__ == "__main__":
    sys.exit(main())
