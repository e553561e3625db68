"""The parts of benchmarks/bench.py planned beyond benchmarks/bench_points.py: MFU at gradient accumulation 8 (part
`gpu-accum`, GPU part 3), and real training runs: the convergence check that settles master weights fairly (part
`convergence`, GPU part 7) and FP8 training (part `fp8`, GPU part 8). A run is a point of kind "run": the trainer
(pretrain/train.py, as launch/pretrain.sh starts one rank) on the demo shards in its measuring process, its metrics
read back (`run_training`); the GPU's FP8 throughput points are ordinary "train" points.

gpu-accum    synth-1.3b's dot twin and the flagship, 1 GPU, compiled blocks, bf16 master weights and train.autocast,
             at gradient accumulation ACCUM (8 micro-batches of 4 × 2048 a step): MFU against GOAL_MFU (H100: dot ≥
             55%, the flagship ≥ 45%; H200: 58%, 48%), the accumulation-1 points beside them (part 1's), no goal.

convergence  synth-125m's widths (d 768, 12 layers, 12 heads, its mixer dense+dot) on the demo shards (n 128,
             vocabulary 4096), global batch 64 (one micro-batch), 600 steps at a real schedule (warm-up 60, peak lr
             6e-4, cosine to 6e-5: ≈ 4.9M tokens), bf16, one GPU, eager, under each setting of SETTINGS: fp32 master
             weights (ZeRO-1), train.autocast (fp32 weights, ZeRO-0) and bf16 master weights (ZeRO-1). Figure: each
             one's validation loss at the end (data.val_batches 2: 128 of the 164 validation samples, the same ones
             every time) ÷ fp32 master's; goal ≤ 1.01 (a setting more than 1% worse is documented, and is not a
             default). --quick: d 64, 2 layers, 8 sequences a step, 6 steps.
fp8          torchao's float8 training (train.fp8, pretrain/float8.py), tensorwise and rowwise, compiled blocks, on
             synth-1.3b's dot twin and the flagship under train.autocast: tokens/s ÷ the same engine without FP8
             (bf16-equivalent throughput, not MFU; goal for dot ≥ 1.3), and the convergence run under train.autocast
             with FP8 (compiled) ÷ without: validation loss within 1% (goal ≤ 1.01). Needs CUDA (capability ≥ 8.9).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time

from benchmarks.bench_points import ACCUM, AUTOCAST, BIG, GOAL_MFU, Plan, big_model, peak_entry, plan

CONVERGENCE = "configs/synth-125m.yaml"
SHARDS = "build/demo/shards"
SETTINGS = {   # the master-weight settings of the convergence check, fp32 master first (the reference)
    "fp32-master": ["parallel.zero_stage=1"],
    "autocast": ["parallel.zero_stage=0", "train.autocast=true"],
    "bf16-master": ["parallel.zero_stage=1", "train.master_weights=bf16"],
}
GOAL_LOSS = 1.01          # a setting's validation loss ÷ fp32 master's
GOAL_FP8 = {"dot": 1.3}   # FP8 tokens/s ÷ bf16's
RECIPES = ("tensorwise", "rowwise")


def convergence_run(quick: bool) -> list[str]:
    """Overrides of configs/synth-125m.yaml for the convergence check (module docstring)."""
    steps, warmup, batch = (6, 2, 8) if quick else (600, 60, 64)
    shape = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4"] if quick else []
    return [*shape, "model.vocab_size=4096", "model.max_seq_len=128", f"data.shard_dir={SHARDS}",
            "data.num_workers=2", "data.val_batches=2", "data.canonical_streams=8", "parallel.tp=1",
            f"train.global_batch_size={batch}", f"train.micro_batch_size={batch}", f"train.max_steps={steps}",
            "train.max_tokens=null", f"train.warmup_steps={warmup}", "train.lr=6e-4", "train.min_lr=6e-5",
            "train.decay=cosine", "train.precision=bf16", "train.hang_timeout=null", f"checkpoint.every={steps}",
            "checkpoint.keep=1", "checkpoint.resume=none", f"logging.every={max(1, steps // 12)}",
            f"logging.val_every={max(1, steps // 6)}", "logging.image_every=0"]


def full_plan(a) -> Plan:
    """benchmarks/bench_points.py's plan of a's parts, and the parts planned here (gpu-accum, convergence, fp8) where
    a.only names them."""
    p = plan(a)
    for part, plan_part in (("gpu-accum", plan_gpu_accum), ("convergence", plan_convergence), ("fp8", plan_fp8)):
        if part in a.only:
            plan_part(a, p)
    return p


def goal_mfu(mixer: str, device: str | None) -> float | None:
    """GOAL_MFU of `mixer` at accumulation ACCUM on `device` (an H100 or an H200, by name), else None."""
    goals = GOAL_MFU.get(mixer, {})
    return next((g for kind, g in goals.items() if device and kind in device), None)


def plan_gpu_accum(a, p: Plan, device: str | None = None) -> None:
    """GPU part 3: dot and the flagship at gradient accumulation ACCUM under the compiled settings of part 1 (bf16
    master weights; fp32 master under train.autocast), against GOAL_MFU on this device; each one's accumulation-1
    point (part 1's) beside it, without a goal."""
    from pretrain.config import load_config

    to_peak, name = peak_entry(a, p, "gpu-accum", device)
    if name is None:
        return
    micro = 1 if a.quick else load_config(BIG).train.micro_batch_size
    for m in dict.fromkeys(["dot", load_config(BIG).model.mixer]):
        for how, extra in (("bf16-master", ["train.master_weights=bf16"]), ("autocast", AUTOCAST)):
            for accum in (ACCUM, 1):   # accumulation 1: part 1's point, the same configuration
                over = big_model(a, m) + extra + ([f"train.global_batch_size={accum * micro}"] if accum > 1 else [])
                p.entry(f"gpu-accum:{m}:{how}:accum{accum}", "gpu-accum", f"synth-1.3b ({m}), {how}, compiled, "
                        f"accumulation {accum}", p.point("train", BIG, over, compile=True), "tflops", "TFLOP/s",
                        to_peak, goal_min=goal_mfu(m, name) if accum > 1 and to_peak else None)


def plan_convergence(a, p) -> None:
    """The convergence part's runs and entries (module docstring). The demo shards must be built (`make
    build/demo/shards/manifest.json`; make gpu-bench does): a run without them fails with the trainer's error. On a
    CPU only at --quick sizes (the full runs take ≤ 1 minute each on an H100, days on 2 CPU cores)."""
    if not (a.gpu or a.quick):
        p.entry("convergence", "convergence", "synth-125m widths", None, "val_loss", "",
                skipped="no CUDA device: the convergence runs need a GPU at these sizes (on a CPU: --quick)")
        return
    for name, over in SETTINGS.items():
        run = p.point("run", CONVERGENCE, convergence_run(a.quick) + over, reps=1, warmup=0)
        p.entry(f"convergence:{name}", "convergence", f"synth-125m widths, {name}", run, "val_loss", "",
                None if name == "fp32-master" else "convergence:fp32-master",
                goal_max=None if name == "fp32-master" else GOAL_LOSS)


def plan_fp8(a, p) -> None:
    """The FP8 part's throughput points (each recipe ÷ no FP8, compiled, under train.autocast) and its convergence
    runs (module docstring); without CUDA one skipped entry."""
    if not a.gpu:
        p.entry("fp8", "fp8", "dot, dense+dot", None, "rate", "tokens/s",
                skipped="no CUDA device (torch.cuda.is_available() is False): FP8 needs a GPU of capability ≥ 8.9")
        return
    for m in ("dot", "dense+dot"):
        base = big_model(a, m) + AUTOCAST
        p.entry(f"fp8:{m}:bf16", "fp8 throughput", f"synth-1.3b ({m}), bf16, compiled",
                p.point("train", BIG, base, compile=True), "rate", "tokens/s")
        for recipe in RECIPES:
            p.entry(f"fp8:{m}:{recipe}", "fp8 throughput", f"synth-1.3b ({m}), FP8 {recipe}, compiled",
                    p.point("train", BIG, base + [f"train.fp8={recipe}"], compile=True), "rate", "tokens/s",
                    f"fp8:{m}:bf16", goal_min=GOAL_FP8.get(m))
    run = convergence_run(a.quick) + SETTINGS["autocast"] + ["train.compile=true"]
    p.entry("fp8:convergence:bf16", "fp8 loss", "synth-125m widths, train.autocast, compiled",
            p.point("run", CONVERGENCE, run, reps=1, warmup=0), "val_loss", "")
    for recipe in RECIPES:
        p.entry(f"fp8:convergence:{recipe}", "fp8 loss", f"synth-125m widths, train.autocast, FP8 {recipe}",
                p.point("run", CONVERGENCE, run + [f"train.fp8={recipe}"], reps=1, warmup=0), "val_loss", "",
                "fp8:convergence:bf16", goal_max=GOAL_LOSS)


# ---- inside the measuring process ---------------------------------------------------------------------------------
def run_training(spec: dict) -> dict:
    """One run of the trainer (this process is its only rank), in a temporary run directory removed afterwards:
    its validation loss at the end (`val_loss`), the last logged training loss, tokens/s over the whole run (start-up
    and validation included), and its metrics rows (validation and every logged step)."""
    from pretrain.config import load_config
    from pretrain.train import main as train

    run_dir = tempfile.mkdtemp(prefix="bench-run-")
    try:
        t0 = time.time()
        status = train([spec["config"], *spec["overrides"], f"train.run_dir={run_dir}"])
        seconds = time.time() - t0
        path = os.path.join(run_dir, "metrics.jsonl")
        rows = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    val = [r for r in rows if "val/loss" in r]
    if status or not val:
        return {"error": f"the trainer exited with status {status}" + ("" if val else ", no validation loss"),
                "rank": 0}
    train_rows = [r for r in rows if "train/loss" in r]
    last = max(r["step"] for r in rows)
    cfg = load_config(spec["config"], spec["overrides"])
    keep = ("step", "val/loss", "train/loss", "train/lr", "train/grad_norm")
    return {"val_loss": [val[-1]["val/loss"]], "val_step": val[-1]["step"], "loss": [train_rows[-1]["train/loss"]],
            "rate": [last * cfg.tokens_per_step / seconds], "seconds": round(seconds, 1), "steps": last,
            "metrics": [{k: r[k] for k in keep if k in r} for r in rows], "rank": 0}
