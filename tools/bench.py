#!/usr/bin/env python
"""Whole-model benchmarks, each figure measured in this one run on this machine and reported as a ratio.

    python tools/bench.py [--quick] [--only throughput,peer,memory,data,parallel,gpu] [--reps 3] [--out bench]
    make bench [BENCH_ARGS=--quick]

Parts (a full training step = forward, backward and the optimizer step of a DeepSpeed engine, ZeRO-1, 1 process,
on random tokens; each point runs in a fresh process, `tools/bench.py _one SPEC`, so no two share allocator state):
  throughput  tokens/s of every variant in configs/variants/ at n = --seq-len, ÷ that of `dot`.
              Goal: ≥ 0.9 × the FLOP ratio (train FLOPs/token of dot ÷ of the variant, from model_stats).
  peer        the same step for Hugging Face GPT-2 (attn_implementation="sdpa") of equal d, layers, heads, n, vocabulary
              and MLP, under the same DeepSpeed config; ours ÷ GPT-2. Goal: dot ≥ 1.0, random ≥ 1.15.
  memory      peak training memory at each of --lengths (L = n), ÷ that at the first, and the same for GPT-2 (no goal:
              a reference). Memory = the step's peak above the process before the engine: parameters, optimizer
              states, gradients, activations, temporaries (CUDA: the allocator's counters; CPU: resident set size with
              malloc returning every freed block over 64 kB, parallel.cpu_keep_freed_memory=false). The JSON also
              has `step_mb`, the peak above the engine at rest between steps (Adam's states exist from the first
              step on), and `phase_mb`, that of each phase (forward, backward, optimizer step; the table's notes).
              Variants whose model would not fit in --mem-budget-gb at the longest n get fewer layers (noted).
              Goal at 4 × the first n: ≤ 3 for dot, dense, factorized_random, dense+dot; ≤ 5 for random, random+dot.
  data        tokens/s that pretrain.data.TokenStream delivers from the demo shards (batches of 8 × 128, 2 workers)
              ÷ the tokens/s a configs/demo-cpu.yaml train step consumes (measured here, 1 CPU process). Goal: ≥ 20.
  parallel    step time of the throughput part's `dot` model with TP=2 and with DP=2 (2 gloo processes on the CPU)
              ÷ 1 process, equal global batch (--batch). Goal: TP=2 ≤ 1.3.
  engine      our DeepSpeed engine's step ÷ the step of the plain PyTorch loop a user would write for the same model
              (fp32 master weights, torch.autocast at train.precision, torch's fused AdamW, clipping), in the same
              mode: eager with eager, and on CUDA compiled with compiled (engine.compile(), torch.compile). CPU: the
              throughput part's dot model; CUDA: synth-1.3b's dot twin, bf16, 1 GPU. Goal: ≤ 1.05.
  gpu         (CUDA only) MFU of configs/synth-1.3b.yaml and its dot twin, bf16, 1 GPU, under the engine and in the
              plain loop: measured tokens/s × train FLOPs/token (model/accounting.py) ÷ the device's dense bf16 peak
              (pretrain/engine.py PEAK_TFLOPS: H100/H200 989, A100 312 TFLOP/s). Goals: the engine on dot ≥ 55%,
              on dense+dot ≥ 40%. Every variant's tokens/s ÷ dot's (d 2048, 16 heads, 8 layers, n 2048, batch 4,
              bf16) in the plain loop and under the engine, goals GPU_GOALS; memory at n 4096 ÷ 1024 (d 1024, 4
              layers), goals ≤ 3 (≤ 5 for random, random+dot).
Each figure: the median over --reps repetitions of --steps timed steps (after --warmup), its spread (max − min) /
median, and for a ratio its range (extreme repetitions). The throughput and peer points run alternately with one
live process of our `dot` model (ABBA: each repetition next to one of dot's, `paired_reps` in the JSON), and their
ratios are medians of those side-by-side ratios: a shared VM's speed drifts 10–30% over minutes, which otherwise
decides ±10% goals by chance. Written to OUT/results.json and OUT/results.md.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from tools.bench_lib import (GOAL_MEM, RESULT_MARK, PointFailed, ServedPoint, machine_info, markdown, paired_ratio,
                             summary)

PARTS = ("throughput", "peer", "memory", "data", "parallel", "engine", "gpu")
DEMO, BIG, SHARDS = "configs/demo-cpu.yaml", "configs/synth-1.3b.yaml", "build/demo/shards"
PRESETS = {   # the sizes, and tiny ones for tests
    "default": dict(d_model=512, layers=8, heads=8, seq_len=1024, lengths="1024,2048,4096", batch=4, vocab=4096,
                    reps=3, steps=3, warmup=2, data_batches=100),
    "quick": dict(d_model=64, layers=2, heads=4, seq_len=64, lengths="64,128,256", batch=2, vocab=512,
                  reps=2, steps=2, warmup=1, data_batches=20, threads=1),
}
QUICK_BIG = ["model.n_layers=2", "model.max_seq_len=512", "train.micro_batch_size=1"]   # gpu part under --quick
FLOP_SLACK, GOAL_PEER, GOAL_DATA, GOAL_TP = 0.9, {"dot": 1.0, "random": 1.15}, 20.0, 1.3
GOAL_ENGINE, GOAL_MFU = 1.05, 0.55   # engine step ÷ plain-loop step; MFU of synth-1.3b dot under the engine
# On a GPU (the GPU-kernels issue): every variant's whole-model throughput ÷ dot's, at d 2048, 16 heads, 8 layers,
# n 2048, batch 4, vocabulary 32000, bf16, in the plain loop and under the engine; memory at n 4096 ÷ 1024 (d 1024,
# 4 layers); the MFU of the flagship synth-1.3b (dense+dot) under the engine.
GPU_THROUGHPUT = dict(d=2048, layers=8, heads=16, n=2048, batch=4, vocab=32000, precision="bf16")
GPU_THROUGHPUT_QUICK = dict(d=256, layers=2, heads=4, n=256, batch=2, vocab=4096, precision="bf16")
GPU_GOALS = {"dense": 1.0, "random": 1.10, "random_fixed": 1.10, "factorized_random": 1.05,
             "factorized_dense": 0.95, "sgu": 1.0, "gmlp": 1.3, "random+dot": 0.90, "dense+dot": 0.80}
GPU_MEMORY = dict(d=1024, layers=4, heads=16, batch=4, vocab=32000, precision="bf16")
GPU_GOAL_MEM = {"dot": 3, "dense": 3, "factorized_random": 3, "dense+dot": 3, "factorized_dense": 3, "random": 5,
                "random+dot": 5}
GOAL_MFU_FLAGSHIP = 0.40
# Memory points measure live tensors, as CUDA's allocator counters do: on the CPU malloc returns freed blocks instead
# of keeping them resident with what the heap fragments (the trainer's faster default), and a fixed mmap threshold
# (glibc's own would rise up to 32 MB) serves every block over 64 kB from its own pages, returned when freed.
LIVE_MEMORY = ["parallel.cpu_keep_freed_memory=false"]
LIVE_MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}
CPU = {"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}   # the demo's runs and gloo TP/DP stay on the CPU
BYTES_PER_PARAM = 20   # fp32 ZeRO-1, 1 process: weight 4 + fp32 partition copy 4 + Adam 8 + gradient 4


def variant_configs() -> dict[str, str]:
    """{variant label: config path} of configs/variants/, `dot` first; the label is the mixer name (gMLP: 'gmlp')."""
    from pretrain.config import load_config

    out = {}
    for path in sorted(glob.glob(os.path.join(ROOT, "configs", "variants", "*.yaml"))):
        m = load_config(path).model
        out["gmlp" if m.block == "gmlp" else m.mixer] = os.path.relpath(path, ROOT)
    return dict(sorted(out.items(), key=lambda kv: kv[0] != "dot"))


def shape(a, n: int, layers: int) -> list[str]:
    """Overrides that turn a variant config into the benchmark's model, one micro-batch per 1-process ZeRO-1 step."""
    return sized(a.d_model, layers, a.heads, n, a.batch, a.vocab, a.precision)


def sized(d: int, layers: int, heads: int, n: int, batch: int, vocab: int, precision: str) -> list[str]:
    return [f"model.vocab_size={vocab}", f"model.d_model={d}", f"model.n_layers={layers}", f"model.n_heads={heads}",
            f"model.max_seq_len={n}", f"train.micro_batch_size={batch}", f"train.global_batch_size={batch}",
            "parallel.zero_stage=1", "parallel.tp=1", f"train.precision={precision}"]


class Plan:
    """The points to measure (deduplicated: one process each) and the entries read off them."""

    def __init__(self, a):
        self.a, self.points, self.entries = a, {}, []
        self.reference = None   # the point every `paired` point alternates its repetitions with (our dot)

    def point(self, kind: str, config: str, overrides=(), world: int = 1, env=None, **extra) -> str:
        a = self.a
        spec = dict(kind=kind, config=config, overrides=list(overrides), world=world, env=env or {},
                    warmup=a.warmup, reps=a.reps, steps=a.steps, threads=a.threads, compile=False)
        spec.update(extra)
        key = json.dumps(spec, sort_keys=True)
        self.points.setdefault(key, spec)
        return key

    def entry(self, id: str, name: str, variant: str, point: str | None, field: str, unit: str, ratio_to=None,
              **extra) -> dict:
        e = dict(id=id, name=name, variant=variant, point=point, field=field, unit=unit, ratio_to=ratio_to, **extra)
        self.entries.append(e)
        return e


def fitting_layers(a, config: str) -> tuple[int, str | None]:
    """The most layers (≤ --layers) whose training state at the longest n fits in --mem-budget-gb: parameters ×
    BYTES_PER_PARAM (frozen ones × 4) plus a rough activation estimate, 4 bytes × (16·B·n·d + H·n²) a layer and
    3·B·n·V for the logits (about 2× what `dot` was measured to take at d=512, n=4096 on CPU: a safe side)."""
    from model.accounting import model_stats
    from pretrain.config import load_config

    n = max(a.lengths)

    def state_bytes(layers):
        total = model_stats(load_config(config, shape(a, n, layers)).model)["total"]
        trainable, frozen = total["trainable"], total["frozen"]
        act = 4 * (layers * (16 * a.batch * n * a.d_model + a.heads * n * n) + 3 * a.batch * n * a.vocab)
        return BYTES_PER_PARAM * trainable + 4 * frozen + act

    one, two = state_bytes(1), state_bytes(2)
    budget = a.mem_budget_gb * 2**30
    layers = min(a.layers, int((budget - one) // (two - one)) + 1) if budget >= one else 0
    if layers == a.layers:
        return layers, None
    return layers, (f"{layers} of {a.layers} layers: the {a.layers}-layer model at n={n} needs ≈ "
                    f"{(one + (a.layers - 1) * (two - one)) / 2**30:.1f} GB > --mem-budget-gb={a.mem_budget_gb:g}")


def plan(a) -> Plan:
    p, V = Plan(a), a.variant_paths

    def ours(v):   # the throughput point of variant v, shared by the throughput and peer parts
        return p.point("train", a.all_variants[v], shape(a, a.seq_len, a.layers), paired=True)

    if "throughput" in a.only or "peer" in a.only:
        p.reference = ours("dot")

    if "throughput" in a.only:
        for v in V:
            p.entry(f"throughput:{v}", "throughput", v, ours(v), "rate", "tokens/s",
                    None if v == "dot" else "throughput:dot", n=a.seq_len, layers=a.layers)
    if "peer" in a.only:
        gpt2 = p.point("peer", a.all_variants["dot"], shape(a, a.seq_len, a.layers), paired=True)
        p.entry("peer:gpt2", "peer", "gpt2-sdpa", gpt2, "rate", "tokens/s", n=a.seq_len, layers=a.layers)
        for v, goal in GOAL_PEER.items():
            p.entry(f"peer:{v}", "peer", v, ours(v), "rate", "tokens/s", "peer:gpt2", goal_min=goal, n=a.seq_len)
    if "memory" in a.only:   # one step per repetition: its peak is the figure; GPT-2 as a reference, no goal
        first = a.lengths[0]
        for v, (kind, config) in [*((v, ("train", c)) for v, c in V.items()), ("gpt2-sdpa", ("peer", V["dot"]))]:
            layers, note = fitting_layers(a, config)
            for n in a.lengths:
                ok = layers > 0
                point = p.point(kind, config, shape(a, n, layers) + LIVE_MEMORY, env=LIVE_MEMORY_ENV,
                                steps=1) if ok else None
                p.entry(f"memory:{v}:n={n}", "memory", v, point,
                        "total_mb", "MB", None if n == first else f"memory:{v}:n={first}", n=n, layers=layers,
                        goal_max=GOAL_MEM.get(v) if n == 4 * first else None, note=note if n == first else None,
                        skipped=None if ok else note)
    if "data" in a.only:
        have = os.path.exists(os.path.join(ROOT, SHARDS, "manifest.json"))
        why = None if have else f"no shards in {SHARDS}: build them with `make {SHARDS}/manifest.json` (or make demo)"
        # 10 warm-up batches: the workers' start and the DataLoader's prefetch queue (2 per worker) are not timed
        loader = p.point("data", DEMO, shard_dir=SHARDS, batch=8, workers=2, steps=a.data_batches,
                         warmup=max(a.warmup, 10)) if have else None
        p.entry("data:loader", "data", "TokenStream (2 workers)", loader, "rate", "tokens/s", "data:demo-train",
                goal_min=GOAL_DATA, skipped=why)
        p.entry("data:demo-train", "data", "demo-cpu train step", p.point("train", DEMO, [], env=CPU), "rate",
                "tokens/s", note="configs/demo-cpu.yaml (ZeRO-2, fp32, global batch 16) in 1 process on the CPU")
    if "parallel" in a.only:   # the throughput part's dot model and global batch, split over 2 gloo processes
        model = shape(a, a.seq_len, a.layers)
        one = p.point("train", a.all_variants["dot"], model, env=CPU)
        p.entry("parallel:1proc", "parallel", "1 process", one, "step_s", "s", n=a.seq_len, layers=a.layers)
        tp2 = p.point("train", a.all_variants["dot"], model + ["parallel.tp=2"], 2, CPU)
        p.entry("parallel:tp2", "parallel", "TP=2", tp2, "step_s", "s", "parallel:1proc", goal_max=GOAL_TP,
                n=a.seq_len, layers=a.layers)
        half = [f"train.micro_batch_size={max(1, a.batch // 2)}"]                # 2 ranks × half the batch
        dp2 = p.point("train", a.all_variants["dot"], model + half, 2, CPU)
        p.entry("parallel:dp2", "parallel", "DP=2", dp2, "step_s", "s", "parallel:1proc", n=a.seq_len, layers=a.layers)
    if "engine" in a.only:
        plan_engine(a, p)
    if "gpu" in a.only:
        plan_gpu(a, p)
    return p


def big_model(a, mixer: str) -> list[str]:
    """Overrides of configs/synth-1.3b.yaml for one GPU: no TP, one micro-batch a step, bf16, the given mixer."""
    from pretrain.config import load_config

    micro = 1 if a.quick else load_config(BIG).train.micro_batch_size
    return ["parallel.tp=1", f"train.global_batch_size={micro}", f"model.mixer={mixer}", "train.precision=bf16",
            *(QUICK_BIG if a.quick else [])]


def modes() -> list[bool]:
    """Compiled or not: eager everywhere, compiled too on CUDA (on the CPU a compile takes minutes for little)."""
    import torch

    return [False, True] if torch.cuda.is_available() else [False]


def plan_engine(a, p: Plan) -> None:
    import torch

    cuda = torch.cuda.is_available()
    config, over = (BIG, big_model(a, "dot")) if cuda else (a.all_variants["dot"], shape(a, a.seq_len, a.layers))
    for compiled in modes():
        mode = "compiled" if compiled else "eager"
        loop, engine = (p.point(kind, config, over, compile=compiled) for kind in ("loop", "train"))
        p.entry(f"engine:loop:{mode}", "engine", f"plain loop ({mode})", loop, "step_s", "s")
        p.entry(f"engine:{mode}", "engine", f"DeepSpeed engine ({mode})", engine, "step_s", "s",
                f"engine:loop:{mode}", goal_max=GOAL_ENGINE)


def plan_gpu(a, p: Plan) -> None:
    import torch

    from pretrain.config import load_config
    from pretrain.engine import peak_tflops_of

    if not torch.cuda.is_available():
        p.entry("gpu:mfu", "gpu", "synth-1.3b", None, "tflops", "TFLOP/s",
                skipped="no CUDA device (torch.cuda.is_available() is False): MFU needs a GPU")
        return
    name = torch.cuda.get_device_name(0)
    peak = peak_tflops_of(name, "bf16")   # the trainer's table (pretrain/engine.py)
    p.entry("gpu:peak", "gpu", name, None, "tflops", "TFLOP/s", reps=[peak] if peak else None,
            skipped=None if peak else f"no peak TFLOP/s known for {name!r} (pretrain/engine.py PEAK_TFLOPS)")
    to_peak = "gpu:peak" if peak else None
    mixer = load_config(BIG).model.mixer
    for m in dict.fromkeys([mixer, "dot"]):   # the config's mixer and its dot twin, 1 GPU, no TP
        goal = (GOAL_MFU if m == "dot" else GOAL_MFU_FLAGSHIP) if peak else None
        p.entry(f"gpu:{m}", "gpu", f"synth-1.3b ({m})", p.point("train", BIG, big_model(a, m)), "tflops", "TFLOP/s",
                to_peak, goal_min=goal)
    plan_gpu_variants(a, p)
    for compiled in modes():   # the same dot model in the plain loop, and compiled under both
        mode = "compiled" if compiled else "eager"
        p.entry(f"gpu:loop:{mode}", "gpu", f"synth-1.3b (dot), plain loop, {mode}",
                p.point("loop", BIG, big_model(a, "dot"), compile=compiled), "tflops", "TFLOP/s", to_peak)
        if compiled:
            p.entry("gpu:dot:compiled", "gpu", "synth-1.3b (dot), compiled",
                    p.point("train", BIG, big_model(a, "dot"), compile=True), "tflops", "TFLOP/s", to_peak)


def plan_gpu_variants(a, p: Plan) -> None:
    """Every variant ÷ dot on the GPU, in the plain loop and under the engine; memory at n 4096 ÷ 1024."""
    t = GPU_THROUGHPUT_QUICK if a.quick else GPU_THROUGHPUT
    for kind, label in (("loop", "plain loop"), ("train", "engine")):
        for v, config in a.variant_paths.items():
            over = sized(t["d"], t["layers"], t["heads"], t["n"], t["batch"], t["vocab"], t["precision"])
            p.entry(f"gpu:{kind}:{v}", f"gpu throughput ({label})", v, p.point(kind, config, over), "rate",
                    "tokens/s", None if v == "dot" else f"gpu:{kind}:dot", goal_min=GPU_GOALS.get(v), n=t["n"])
    m, lengths = GPU_MEMORY, ((128, 512) if a.quick else (1024, 4096))
    for v, config in a.variant_paths.items():
        for n in lengths:
            over = sized(m["d"], m["layers"], m["heads"], n, m["batch"], m["vocab"], m["precision"])
            p.entry(f"gpu:memory:{v}:n={n}", "gpu memory", v, p.point("train", config, over, steps=1), "total_mb",
                    "MB", None if n == lengths[0] else f"gpu:memory:{v}:n={lengths[0]}", n=n,
                    goal_max=GPU_GOAL_MEM.get(v) if n == lengths[1] else None)


def rank_env(spec: dict) -> list[dict]:
    """The launcher's environment of each rank of spec's world (a free local port for the process group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world = spec["world"]
    env = {**os.environ, "PYTHONPATH": ROOT, "WORLD_SIZE": str(world), "LOCAL_SIZE": str(world),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **spec["env"]}
    return [{**env, "RANK": str(r), "LOCAL_RANK": str(r)} for r in range(world)]


def one(spec: dict) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), "_one", json.dumps(spec)]


def run_point(spec: dict, timeout: float) -> dict:
    """Start spec's world of `_one` processes (one rank each, the launcher's environment) and read rank 0's result."""
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
    for line in reversed(texts[0].splitlines()):
        if line.startswith(RESULT_MARK) and error is None:
            return json.loads(line[len(RESULT_MARK):])
    failed = next((t for p, t in zip(procs, texts) if p.returncode), texts[0])
    return {"error": error or (failed.strip().splitlines() or ["failed without output"])[-1][-300:]}


def run_paired(reference: dict, others: list[tuple[str, dict]], timeout: float, done) -> dict:
    """Measure each of `others` in turn alternately with one live process of `reference`: repetition r of a point
    runs next to one of the reference (ABBA order: the reference first on even r), so both see the same machine.
    {key: result, "reference": result}; a paired point's result has `paired_rate`, the reference's rates next to
    its repetitions. `done(key)` after each point (progress)."""
    def serve(spec):
        return ServedPoint(one({**spec, "serve": True}), rank_env(spec)[0], ROOT, timeout)

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
        e.update(value=None, spread=None, ratio=None, ratio_range=None, status=None, machine=machine,
                 error=res.get("error"), reps=reps, paired_reps=None, skipped=e.get("skipped"))
        if reps:
            e["value"], e["spread"] = summary(reps)
        for k in ("params", "train_flops_per_token", "tokens_per_step", "device", "after_init_mb",
                  "after_engine_mb", "at_rest_mb", "peak_mb", "phase_mb"):
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
        e["goal"] = f"≥ {lo:.3g}" if lo is not None else f"≤ {hi:.3g}" if hi is not None else None
        if e["goal"] and e["ratio"] is not None:
            e["status"] = "ok" if (lo is None or e["ratio"] >= lo) and (hi is None or e["ratio"] <= hi) else "MISSED"
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes (d=64, 2 layers, n=64/128/256, 2 reps, 1 thread) "
                                                         "for tests")
    ap.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts to run (default all): "
                                                             f"{', '.join(PARTS)}")
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
    bad = [s for s in a.only if s not in PARTS]
    if bad or not a.only:
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
        from tools.bench_lib import run_point as measure_here

        measure_here(json.loads(argv[1]))
        return 0
    try:
        a = parse_args(argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from tqdm import tqdm

    t0, machine = time.time(), machine_info()
    p = plan(a)
    results, paired = {}, [(k, s) for k, s in p.points.items() if s.get("paired") and k != p.reference]
    bar = tqdm(total=len(p.points), desc="bench", unit="point")
    if p.reference:   # the throughput and peer points, each alternated with our dot's live process
        bar.set_postfix_str("throughput and peer points, alternated with dot")
        measured = run_paired(p.points[p.reference], paired, a.timeout, lambda key: bar.update())
        results[p.reference] = measured.pop("reference")
        results.update(measured)
        bar.update()
    for key, spec in p.points.items():
        if key not in results:
            bar.set_postfix_str(f"{spec['kind']} {os.path.basename(spec['config'])} "
                                f"{' '.join(spec['overrides'][1:5])}"[:80])
            results[key] = run_point(spec, a.timeout)
            bar.update()
    bar.close()
    entries = finish(p, results, machine)
    settings = {k: getattr(a, k) for k in ("quick", "only", "reps", "steps", "warmup", "d_model", "layers", "heads",
                                           "seq_len", "lengths", "batch", "vocab", "precision", "mem_budget_gb",
                                           "threads")}
    report = {"machine": machine, "settings": settings, "elapsed_s": round(time.time() - t0, 1), "results": entries}
    os.makedirs(a.out, exist_ok=True)
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
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
