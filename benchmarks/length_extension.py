#!/usr/bin/env python
"""The length-extension study (docs/study/length-extension.md; not in CI): a model trained at a short length, grown
with `tools/convert.py extend-length` and trained on at the long one, against a model trained at the long length from
the start, with the same tokens and the same LR schedule.

    python benchmarks/length_extension.py                       # dense, 300 steps, 200 of them at 128
    python benchmarks/length_extension.py --mixer random --steps 150 --short-steps 100 --out runs/length-random

One shard set of the long length N (built here from data/austen.txt.gz with the demo's tokenizer settings, or
--shards) feeds every run: the short runs read its samples cut in two (tokendata/lengths.py), so both models see the
same text and the validation split is one held-out set of N-token windows. Every step is 2,048 tokens: 16 samples of
128 or 8 of 256. Runs, one process each (configs/demo-cpu.yaml, 1 rank, ZeRO 0):
    short     --short-steps at n = 128 of a --steps cosine schedule (train.stop_after_steps), released
    extended  `extend-length --to 256` of it, trained on from its step to --steps at 256 (fresh AdamW moments)
    long      --steps at 256 from the start
Then the validation loss (nats a token, every val sample once) of each at 256, of the extended release before any
training at 256, and of the short and long models at 128 (the val windows cut in two). Writes <out>/results.json and
prints a Markdown table.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

from pretrain.distributed import free_local_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHORT, LONG, TOKENS_PER_STEP = 128, 256, 2048


def sh(*cmd, log=None, env=None):
    """Run a command from the repository root; its output to `log` (a file), a one-line error where it fails."""
    with open(log, "w") if log else open(os.devnull, "w") as out:
        r = subprocess.run([str(c) for c in cmd], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT, **(env or {})},
                           stdout=out,
                           stderr=subprocess.STDOUT if log else None)
    if r.returncode:
        sys.exit(f"error: {' '.join(map(str, cmd[:3]))} … failed (exit {r.returncode}); see {log}")


def shards(args) -> str:
    path = args.shards or os.path.join(args.out, "shards")
    if not os.path.isfile(os.path.join(path, "manifest.json")):
        tok = os.path.join(args.out, "tokenizer.model")
        sh(sys.executable, "tools/train_tokenizer.py", "--input", "data/austen.txt.gz", "--vocab-size", 4096,
           "--out", tok)
        sh(sys.executable, "tools/make_shards.py", "--input", "data/austen.txt.gz", "--tokenizer", tok, "--out", path,
           "--seq-len", LONG, "--samples-per-shard", 100, "--val-fraction", 0.02, "--force", "--quiet")
    return path


def train(args, name, data, L, *overrides) -> str:
    """One run of configs/demo-cpu.yaml at length L, 2,048 tokens a step; its run directory."""
    run = os.path.join(args.out, name)
    if not os.path.isfile(os.path.join(run, "done")):
        G = TOKENS_PER_STEP // L
        t0 = time.time()
        print(f"training {name} at n={L} …", flush=True)
        sh("launch/pretrain.sh", "configs/demo-cpu.yaml", f"data.shard_dir={data}", f"model.max_seq_len={L}",
           f"model.mixer={args.mixer}", f"train.global_batch_size={G}", f"train.micro_batch_size={min(G, 8)}",
           f"train.max_steps={args.steps}", f"train.run_dir={run}", "parallel.zero_stage=0", "data.num_workers=0",
           "checkpoint.every=100000", "logging.val_every=0", "logging.image_every=0", "logging.every=25",
           f"train.warmup_steps={min(30, args.steps // 10)}", "checkpoint.resume=none", *overrides, log=f"{run}.log", env={"NPROC": "1", "OMP_NUM_THREADS": "1", "PYTHON": sys.executable,
                                               "MASTER_PORT": str(free_local_port())})
        os.makedirs(run, exist_ok=True)
        with open(os.path.join(run, "done"), "w") as f:
            f.write(f"{time.time() - t0:.0f}\n")
    release = f"{run}-release"
    if not os.path.isdir(release):
        sh(sys.executable, "tools/convert.py", "to-release", run, release, log=f"{release}.log")
    return release


def val_loss(release, data, L) -> float:
    """Mean cross-entropy (nats a token) of a release over every validation sample of `data` read at length L."""
    import torch

    from model.release import load_model
    from tokendata.stream import TokenStream

    torch.set_num_threads(1)   # a shared machine: threads that spin-wait for each other only slow it down
    model = load_model(release).eval()
    samples = sum(n for _, n in TokenStream(data, 1, L).model_samples(TokenStream(data, 1, L).shards[0]["val"]))
    B = max(b for b in range(1, 17) if samples % b == 0)   # batches of B cover the split once, none wrapping round
    total = 0.0
    with torch.no_grad():
        for batch in TokenStream(data, B, L).val_batches():
            tokens = batch["tokens"]
            total += float(model(tokens[:, :-1], tokens[:, 1:])) * B
    return total / samples


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mixer", default="dense", help="model.mixer of every run (default: the demo's dense)")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps of each run's schedule (2,048 tokens each)")
    p.add_argument("--short-steps", type=int, default=200, help="of them, the steps at n=128 before the extension")
    p.add_argument("--shards", help="a shard set of seq_len 256 (default: built under --out)")
    p.add_argument("--out", default="runs/length-extension", help="the study directory")
    args = p.parse_args(argv)
    if not 0 < args.short_steps < args.steps:
        p.error(f"--short-steps={args.short_steps} must be between 0 and --steps={args.steps}")
    os.makedirs(args.out, exist_ok=True)
    data = shards(args)
    short = train(args, "short", data, SHORT, f"train.stop_after_steps={args.short_steps}")
    grown = f"{short}-{LONG}"
    if not os.path.isdir(grown):
        sh(sys.executable, "tools/convert.py", "extend-length", short, grown, "--to", LONG, log=f"{grown}.log")
    extended = train(args, "extended", data, LONG, f"train.init_from={os.path.abspath(grown)}")
    long = train(args, "long", data, LONG)
    rows = {"short (128), extended, not trained at 256": (grown, None),
            f"short → extended at step {args.short_steps} → trained at 256": (extended, "extended"),
            "long: 256 from the start": (long, "long"),
            f"short, at its own 128 ({args.short_steps} steps)": (short, "short")}
    results = {"mixer": args.mixer, "steps": args.steps, "short_steps": args.short_steps,
               "tokens": args.steps * TOKENS_PER_STEP, "runs": {}}
    for label, (release, run) in rows.items():
        at = [SHORT] if label.startswith("short,") else [LONG, SHORT]
        losses = {L: val_loss(release, data, L) for L in at}
        seconds = float(open(os.path.join(args.out, run, "done")).read()) if run else None
        results["runs"][label] = {"val_loss": losses, "train_seconds": seconds}
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"| {args.mixer}, {args.steps} steps × 2,048 tokens | val loss at 256 (ppl) | at 128 (ppl) | train s |")
    print("|---|---|---|---|")
    for label, r in results["runs"].items():
        cell = {L: f"{v:.4f} ({math.exp(v):.1f})" for L, v in r["val_loss"].items()}
        print(f"| {label} | {cell.get(LONG, '—')} | {cell.get(SHORT, '—')} | {r['train_seconds'] or '—'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
