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
  gpu-binding (CUDA only) the binding goals as configured: synth-1.3b's dot twin (MFU ≥ 55%) and the flagship
              dense+dot (≥ 40%) under the engine with bf16 master weights and compiled blocks, each beside its
              fp32-master eager run; the bf16-master loss over the bench steps within 1% of the fp32-master one.
  gpu         (CUDA only) MFU of configs/synth-1.3b.yaml and its dot twin, bf16, 1 GPU, under the engine and in the
              plain loop: measured tokens/s × train FLOPs/token (model/accounting.py) ÷ the device's dense bf16 peak
              (pretrain/observe/device_peaks.py PEAK_TFLOPS: H100/H200 989, A100 312 TFLOP/s). Goals: the engine on dot ≥ 55%,
              on dense+dot ≥ 40%.
  gpu-variants (CUDA only) every variant's tokens/s ÷ dot's (d 2048, 16 heads, 8 layers, n 2048, batch 4, bf16)
              under the engine, eager and with compiled blocks, goals GPU_GOALS (benchmarks/bench_points.py).
  gpu-memory  (CUDA only) every variant's training memory at n 4096 ÷ 1024 (d 1024, 4 layers), goals ≤ 3 (≤ 5 for
              random, random+dot).
  convergence the convergence check of master weights (synth-125m's widths on the demo shards, 600 steps, fp32
              master, train.autocast, bf16 master: validation loss ÷ fp32 master's); fp8: FP8 tokens/s ÷ bf16 and its
              validation loss over that run (benchmarks/bench_runs.py).
The GPU parts form a queue of short commands for a lent GPU (--gpu-part k, make gpu-bench PART=k; --gpu-queue says
which parts' figures stand and which runs next; benchmarks/gpu_queue.py): 0 benchmarks/compile_check.py, 1
gpu-binding, 2 engine, 3 and 4 gpu-variants (half the variants each), 5 gpu-memory, 6 make gpu-check, 7 convergence,
8 fp8. Each writes census.json, the kernel census of the configurations it measured (benchmarks/kernel_census.py).
Each figure: the median over --reps repetitions of --steps timed steps (after --warmup), its spread (max − min) /
median, and for a ratio its range (extreme repetitions). The throughput and peer points run alternately with one
live process of our `dot` model (ABBA: each repetition next to one of dot's, `paired_reps` in the JSON), and their
ratios are medians of those side-by-side ratios: a shared VM's speed drifts 10–30% over minutes, which otherwise
decides ±10% goals by chance. Written to OUT/results.json and OUT/results.md; each point's raw result, as it is
measured, to OUT/points.jsonl (what a run cut short keeps).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from benchmarks.bench_lib import RESULT_MARK
from benchmarks.bench_points import FLOP_SLACK, PARTS, PRESETS, Plan, variant_configs
from benchmarks.bench_runs import full_plan
from benchmarks.gpu_queue import gpu_queue, part0_or_census, report as queue_report, standing, write_part_census
from benchmarks.bench_report import PointFailed, ServedPoint, machine_info, markdown, paired_ratio, summary

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

def rank_env(spec: dict) -> list[dict]:
    """The launcher's environment of each rank of spec's world (a free local port for the process group)."""
    from pretrain.distributed import free_local_port

    port = free_local_port()
    world = spec["world"]
    env = {**os.environ, "PYTHONPATH": ROOT, "WORLD_SIZE": str(world), "LOCAL_SIZE": str(world),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **spec["env"]}
    return [{**env, "RANK": str(r), "LOCAL_RANK": str(r)} for r in range(world)]


def one(spec: dict) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), "_one", json.dumps(spec)]


PORT_TAKEN = "EADDRINUSE"   # the rendezvous port was taken between its pick and its listen (by another job's socket)


def retried_on_port_race(start, attempts: int = 3):
    """start() (which picks a fresh free port each time) again when the process group could not listen on its port:
    a free port is only free when picked, and the host's other processes may bind it before the rank does."""
    for attempt in range(1, attempts + 1):
        try:
            result = start()
        except PointFailed as e:
            if PORT_TAKEN in str(e) and attempt < attempts:
                continue
            raise
        if PORT_TAKEN in str(result.get("error") if isinstance(result, dict) else "") and attempt < attempts:
            continue
        return result


def run_point(spec: dict, timeout: float) -> dict:
    """Start spec's world of `_one` processes (one rank each, the launcher's environment) and read rank 0's result;
    again with another port if the first was taken."""
    return retried_on_port_race(lambda: run_point_once(spec, timeout))


def run_point_once(spec: dict, timeout: float) -> dict:
    envs = rank_env(spec)
    logs = [tempfile.TemporaryFile("w+") for _ in envs]   # files, not pipes: no rank blocks on a full pipe
    procs = [subprocess.Popen(one(spec), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True) for env, log in zip(envs, logs)]
    deadline, error = time.time() + timeout, None
    try:
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        error = f"timeout after {timeout:g} s"
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    texts = []
    for log in logs:
        log.seek(0)
        texts.append(log.read())
    results = [next((json.loads(line[len(RESULT_MARK):]) for line in reversed(text.splitlines())
                     if line.startswith(RESULT_MARK)), None) for text in texts]
    if results[0] is not None and error is None:
        return {**results[0], "by_rank": results} if len(results) > 1 else results[0]
    failed = next((t for p, t in zip(procs, texts) if p.returncode), texts[0])
    return {"error": error or (failed.strip().splitlines() or ["failed without output"])[-1][-300:]}


def run_paired(reference: dict, others: list[tuple[str, dict]], timeout: float, done) -> dict:
    """Measure each of `others` in turn alternately with one live process of `reference`: repetition r of a point
    runs next to one of the reference (ABBA order: the reference first on even r), so both see the same machine.
    {key: result, "reference": result}; a paired point's result has `paired_rate`, the reference's rates next to
    its repetitions. `done(key)` after each point (progress)."""
    def serve(spec):
        return retried_on_port_race(lambda: ServedPoint(one({**spec, "serve": True}), rank_env(spec)[0], ROOT, timeout))

    try:
        ref = serve(reference)
    except PointFailed as e:
        return {key: {"error": f"the reference (dot) point failed: {e}"} for key, _ in others + [("reference", 0)]}
    results = {}
    for key, spec in others:
        other = None
        try:
            other, paired = serve(spec), []
            for r in range(spec["reps"]):
                pair = (ref, other) if r % 2 == 0 else (other, ref)
                rates = [point.rep() for point in pair]
                paired.append(rates[0] if r % 2 == 0 else rates[1])
            results[key] = {**other.finish(), "paired_rate": paired}
        except PointFailed as e:
            results[key] = {"error": str(e)}
            if other is not None:
                other.kill()
        done(key)
    try:
        for _ in range(0 if others else reference["reps"]):
            ref.rep()
        results["reference"] = ref.finish()
    except PointFailed as e:
        results["reference"] = {"error": str(e)}
    return results


def finish(p: Plan, results: dict, machine: dict) -> list[dict]:
    """Values, spreads, ratios and goals of the entries, from the points' results."""
    out, by_id = [], {}
    for e in p.entries:
        point = e.pop("point")
        res = results.get(point, {})
        reps = e.pop("reps", None)
        if reps is None and e.get("skipped") is None and not res.get("error"):
            reps = res.get(e["field"]) if e["field"] != "tflops" else \
                [r * res["train_flops_per_token"] / 1e12 for r in res["rate"]]
            if e["field"] == "uncontended_step_s":   # less the longest any rank waited for a CPU while runnable
                reps = [s - max(r["runqueue_s"][i] for r in res.get("by_rank", [res]))
                        for i, s in enumerate(res["step_s"])]
        e.update(value=None, spread=None, ratio=None, ratio_range=None, status=None, machine=machine,
                 error=res.get("error"), reps=reps, paired_reps=None, skipped=e.get("skipped"))
        if reps:
            e["value"], e["spread"] = summary(reps)
        for k in ("params", "train_flops_per_token", "tokens_per_step", "device", "after_init_mb",
                  "after_engine_mb", "at_rest_mb", "peak_mb", "phase_mb", "cuda_memory", "val_step", "seconds",
                  "requests", "fetched", "streams", "shard_mb", "shards"):
            if k in res:
                e[k] = res[k]
        if reps and e["field"] == "rate" and (point == p.reference or res.get("paired_rate")):
            e["paired_reps"] = reps if point == p.reference else res["paired_rate"]   # dot's, next to each rep
        if e["field"] == "total_mb" and res.get("step_mb"):
            e["step_mb"] = summary(res["step_mb"])[0]   # above the engine at rest: no parameters, optimizer states
        by_id[e["id"]] = e
        out.append(e)
    for e in out:
        ref = by_id.get(e["ratio_to"])
        if e["value"] is not None and ref and ref["value"]:
            if e.get("paired_reps") and ref.get("paired_reps"):   # both alternated with dot: drift cancels
                e["ratio"], e["ratio_range"] = paired_ratio(e["reps"], e["paired_reps"], ref["reps"],
                                                            ref["paired_reps"])
            else:
                e["ratio"] = e["value"] / ref["value"]
                e["ratio_range"] = [min(e["reps"]) / max(ref["reps"]), max(e["reps"]) / min(ref["reps"])]
        if e["name"] == "throughput" and e.get("train_flops_per_token") and by_id["throughput:dot"]["value"]:
            e["flop_ratio"] = by_id["throughput:dot"]["train_flops_per_token"] / e["train_flops_per_token"]
            if e["variant"] != "dot":
                e["goal_min"] = FLOP_SLACK * e["flop_ratio"]
        lo, hi = e.pop("goal_min", None), e.pop("goal_max", None)
        e["goal"] = f"{lo:.3g}–{hi:.3g}" if lo is not None and hi is not None else f"≥ {lo:.3g}" if lo is not None \
            else f"≤ {hi:.3g}" if hi is not None else None
        if e["goal"] and e["ratio"] is not None:
            e["status"] = "ok" if (lo is None or e["ratio"] >= lo) and (hi is None or e["ratio"] <= hi) else "MISSED"
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes (d=64, 2 layers, n=64/128/256, 2 reps, 1 thread) "
                                                         "for tests")
    ap.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts to run (default all): "
                                                             f"{', '.join(PARTS)}")
    ap.add_argument("--gpu-part", type=int, choices=range(0, 9), help="one part of the GPU measurement queue "
                    "(make gpu-bench PART=k): 0 the compile check (benchmarks/compile_check.py), 1 the binding MFU "
                    "points, 2 engine ÷ loop, 3 and 4 the variants' halves, 5 memory, 6 gpu-check's bench points, 7 "
                    "convergence, 8 FP8; sets --only and --variants, and writes OUT/census.json")
    ap.add_argument("--gpu-queue", action="store_true", help="print, per GPU part, whether its figures stand at this "
                    "checkout (the kernel census of what it measured unchanged) and which part runs next")
    ap.add_argument("--census-only", action="store_true",
                    help="with --gpu-part: write OUT/census.json, measure nothing")
    ap.add_argument("--no-census", action="store_true", help="with --gpu-part: write no census.json")
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
    ap.add_argument("--out", default=os.path.join(ROOT, "bench"), help="directory of results.json and results.md")
    return ap


def parse_args(argv) -> argparse.Namespace:
    """Options with the preset's values filled in; ValueError (one line) for a bad --only or --variants."""
    a = build_parser().parse_args(argv)
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
        print(queue_report(standing(parse_args)))
        return 0
    if a.gpu_part is not None and (a.gpu_part == 0 or a.census_only):
        return part0_or_census(a)
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
    os.makedirs(a.out, exist_ok=True)
    open(os.path.join(a.out, "points.jsonl"), "w").close()
    for key, spec in p.points.items():
        if key not in results:
            bar.set_postfix_str(f"{spec['kind']} {os.path.basename(spec['config'])} "
                                f"{' '.join(spec['overrides'][1:5])}"[:80])
            results[key] = run_point(spec, a.timeout)
            with open(os.path.join(a.out, "points.jsonl"), "a") as f:   # kept if the run is cut short
                f.write(json.dumps({"spec": spec, "result": results[key]}) + "\n")
            bar.update()
    bar.close()
    entries = finish(p, results, machine)
    settings = {k: getattr(a, k) for k in ("quick", "only", "reps", "steps", "warmup", "d_model", "layers", "heads",
                                           "seq_len", "lengths", "batch", "vocab", "precision", "mem_budget_gb",
                                           "threads")}
    report = {"machine": machine, "settings": settings, "elapsed_s": round(time.time() - t0, 1), "results": entries}
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(report, f, indent=1)
    table = markdown(entries, machine, f"Synthformer benchmarks ({'--quick' if a.quick else 'default sizes'}, "
                                       f"{report['elapsed_s']:.0f} s)")
    with open(os.path.join(a.out, "results.md"), "w") as f:
        f.write(table)
    print(table)
    status = [e["status"] for e in entries]
    failed = [e["id"] for e in entries if e["error"]]
    print(f"goals: {status.count('ok')} ok, {status.count('MISSED')} MISSED; {len(failed)} failed"
          + (f" ({', '.join(failed)})" if failed else "") + f"; wrote {os.path.join(a.out, 'results.json')} and .md")
    write_part_census(a)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
