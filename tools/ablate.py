#!/usr/bin/env python
"""The variant study: train every mixer with the same config and token budget, evaluate each, write a table and a plot.

    python tools/ablate.py                                   # the 8 variants below, demo-cpu config, ~30 min on 2 CPUs
    python tools/ablate.py --variants dot,random --steps 100 --config configs/demo-cpu.yaml --out runs/ablate

For each variant: `launch/pretrain.sh CONFIG model.mixer=<variant>` (same data, seed, schedule and token budget; only
the mixer differs), then on its final checkpoint: validation perplexity and bits-per-byte on the held-out shard split
(tools/evaluate.py) and the accuracies of the local lm-eval tasks (tasks/: LAMBADA-style cloze, 4-way continuation).
Writes `<out>/results.md` (params, Table-1 synthesizer params, tokens/s, val ppl, bits/byte, task accuracies),
`<out>/results.json` and `<out>/loss_curves.png`. A variant whose run finished is not trained again (delete its
directory to redo it), so an interrupted study continues where it stopped.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")   # the tasks are local files: never reach for the Hub
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tqdm import tqdm

from model import ConfigError
from model.accounting import model_stats
from pretrain.config import load_config

VARIANTS = "dot,dense,random,random_fixed,factorized_dense,factorized_random,random+dot,dense+dot"
TASKS = "austen_cloze,austen_mc4"


def train(variant: str, args, run_dir: str, warmup: int) -> None:
    """One launcher run of the variant; its console output goes to <run_dir>/train.log."""
    if os.path.exists(os.path.join(run_dir, "done.json")):
        return
    os.makedirs(run_dir, exist_ok=True)
    overrides = [f"model.mixer={variant}", f"train.run_dir={run_dir}", f"train.max_steps={args.steps}",
                 f"train.warmup_steps={min(warmup, args.steps // 10)}", f"checkpoint.every={args.steps}",
                 "checkpoint.keep=1", "logging.image_every=0", *args.overrides]
    env = {"PYTHON": sys.executable, **os.environ, "NPROC": str(args.nproc)}   # the trainers run in this Python
    t0 = time.time()
    with open(os.path.join(run_dir, "train.log"), "w") as log:
        r = subprocess.run([os.path.join(ROOT, "launch", "pretrain.sh"), args.config, *overrides], cwd=ROOT, env=env,
                           stdout=log, stderr=subprocess.STDOUT)
    if r.returncode:
        raise ConfigError(f"training {variant} failed (exit {r.returncode}); see {run_dir}/train.log")
    with open(os.path.join(run_dir, "done.json"), "w") as f:
        json.dump({"variant": variant, "seconds": time.time() - t0}, f)


def metrics(run_dir: str) -> tuple[dict, dict]:
    """(train loss by step, mean training tokens/s over the run's logged windows) from metrics.jsonl."""
    loss, speed = {}, []
    for line in open(os.path.join(run_dir, "metrics.jsonl")):
        row = json.loads(line)
        if "train/loss" in row:
            loss[row["step"]] = row["train/loss"]
            speed.append(row["perf/tokens_per_s"])
    speed = speed[1:] or speed            # the first window includes start-up
    return loss, {"tokens_per_s": sum(speed) / len(speed)}


def evaluate(variant: str, args, run_dir: str, shard_dir: str) -> dict:
    """Parameters (Table 1 too), validation ppl and bits/byte of the final checkpoint, lm-eval task accuracies."""
    from evaluation.cli import load
    from evaluation.perplexity import evaluate_shards

    cfg = load_config(args.config, [*args.overrides, f"model.mixer={variant}"]).model
    stats = model_stats(cfg)["total"]
    model, _, _ = load(run_dir, need_tokenizer=False)
    val = evaluate_shards(model, shard_dir, "val", batch_size=16)
    row = {"variant": variant, "params": stats["trainable"] + stats["frozen"], "trainable": stats["trainable"],
           "synth_params": stats["table1"], "val_ppl": val["ppl"], "bits_per_byte": val["bits_per_byte"]}
    if args.tasks:
        import lm_eval
        from lm_eval.tasks import TaskManager

        import evaluation.lm_eval_adapter  # noqa: F401 -- registers the "synthformer" model

        tasks = args.tasks.split(",")
        out = lm_eval.simple_evaluate(model="synthformer", model_args=f"path={run_dir},batch_size=32",
                                      tasks=tasks, device="cpu", verbosity="ERROR",
                                      task_manager=TaskManager(include_path=os.path.join(ROOT, "tasks")))
        row.update({f"{t} acc": out["results"][t]["acc,none"] for t in tasks})
    return row


def write_results(rows: list[dict], curves: dict, out: str, args) -> None:
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"config": args.config, "steps": args.steps, "rows": rows}, f, indent=2)
    task_cols = [k for k in rows[0] if k.endswith(" acc")]
    head = ["variant", "params", "synth params (Table 1)", "tokens/s", "val ppl", "bits/byte", *task_cols]
    lines = [f"# Variant study: {args.config}, {args.steps} steps each, {args.nproc} processes", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["variant"], f"{r['params'] / 1e6:.2f}M", f"{r['synth_params'] / 1e3:.1f}k",
                 f"{r['tokens_per_s']:,.0f}", f"{r['val_ppl']:.2f}", f"{r['bits_per_byte']:.3f}",
                 *[f"{r[c]:.3f}" for c in task_cols]]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "![loss curves](loss_curves.png)", ""]
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write("\n".join(lines))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for variant, loss in curves.items():
        steps = sorted(loss)
        ax.plot(steps, [loss[s] for s in steps], label=variant, linewidth=1.2)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (nats/token)")
    ax.set_title(f"Synthesizer variants, {args.config}")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "loss_curves.png"), dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default=VARIANTS, help=f"comma-separated mixers (default {VARIANTS})")
    p.add_argument("--config", default="configs/demo-cpu.yaml", help="training config shared by all variants")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps per variant (the token budget)")
    p.add_argument("--nproc", type=int, default=2, help="processes per training run")
    p.add_argument("--tasks", default=TASKS, help="lm-eval tasks from tasks/ ('' to skip)")
    p.add_argument("--out", default="runs/ablate", help="study directory (one run directory per variant)")
    p.add_argument("overrides", nargs="*", help="config overrides for every variant, section.key=value")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        variants = [v for v in args.variants.split(",") if v]
        for v in variants:
            load_config(args.config, [*args.overrides, f"model.mixer={v}"])   # a bad name fails before training
        os.makedirs(args.out, exist_ok=True)
        rows, curves = [], {}
        for v in tqdm(variants, desc="variants"):
            run_dir = os.path.join(os.path.abspath(args.out), v.replace("+", "_"))
            train(v, args, run_dir, cfg.train.warmup_steps)
            curves[v], speed = metrics(run_dir)
            rows.append({**evaluate(v, args, run_dir, cfg.data.shard_dir), **speed})
            tqdm.write(f"{v}: val ppl {rows[-1]['val_ppl']:.2f}, {rows[-1]['tokens_per_s']:,.0f} tokens/s")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_results(rows, curves, args.out, args)
    print(f"wrote {args.out}/results.md, results.json and loss_curves.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
