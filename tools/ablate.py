#!/usr/bin/env python
"""The variant study: train each mixer with the same config and token budget, several seeds each, evaluate every run,
write a table with the spread over seeds, a ranking that says where the seeds cannot tell two variants apart, a plot.

    python tools/ablate.py                           # the CPU study preset: configs/studies/cpu.yaml
    python tools/ablate.py --quick                   # the short single-seed run: configs/studies/quick.yaml
    python tools/ablate.py --preset configs/studies/cpu.yaml --variants dot,random --steps 100 --seeds 3

A preset (configs/studies/*.yaml) has these keys, and the flag of the same name overrides each:

    config     the training config every run starts from (configs/demo-cpu.yaml)
    variants   the mixers, a YAML list: [dot, dense, random+dot]
    steps      optimizer steps of each run: the token budget
    seeds      runs per variant
    nproc      processes per run
    tasks      lm-eval tasks from tasks/, comma-separated ("" for none)
    out        the study directory: a run directory per variant and seed, results.md, results.json, the plot
    overrides  optional: section.key=value for every run, before the command line's own

For each variant and seed k: `launch/pretrain.sh CONFIG model.mixer=<variant>` with model.seed,
data.seed and train.seed all offset by k (init and data order change; everything else is the same), then on its
final checkpoint: validation perplexity and bits-per-byte on the held-out shard split (tools/evaluate.py) and the
accuracies of the local lm-eval tasks (tasks/). Writes `<out>/results.md` (per column the mean over seeds and its
[min, max]; the ranking), `<out>/results.json` and `<out>/loss_curves.png` (mean and [min, max] band per variant).
A (variant, seed) run that finished is not trained again (delete its directory to redo it), so an interrupted study
continues where it stopped.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")   # the tasks are local files: never reach for the Hub
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tqdm import tqdm

from model import ConfigError
from model.fields import check_keys
from model.accounting import model_stats
from pretrain.config import load_config
from pretrain.distributed import free_local_port

STUDIES = os.path.join(ROOT, "configs", "studies")
PRESET_KEYS = ["config", "variants", "steps", "seeds", "nproc", "tasks", "out", "overrides"]   # the docstring's list
# The paper's LM1B perplexities (Tay et al. 2020, Table 3): another corpus, model size and budget than any study here
PAPER_LM1B = {"dot": 38.21, "dense": 40.88, "random": 40.60, "random+dot": 40.05}


def spread(values: list[float]) -> tuple[float, float, float]:
    """(mean, min, max) of one metric over the seeds."""
    return sum(values) / len(values), min(values), max(values)


def ranking(ppl: dict[str, list[float]]) -> list[tuple[str, str, bool]]:
    """(a, b, ranked) for every pair, a before b by mean perplexity (lower is better): a is ranked above b only where
    a's worst seed beats b's best seed, max(a) < min(b); otherwise, or with one seed (no spread to judge by), the
    seeds cannot tell them apart."""
    order = sorted(ppl, key=lambda v: spread(ppl[v])[0])
    return [(a, b, min(len(ppl[a]), len(ppl[b])) > 1 and max(ppl[a]) < min(ppl[b]))
            for i, a in enumerate(order) for b in order[i + 1:]]


def seed_overrides(cfg, k: int) -> list[str]:
    """Seed k of a study: init (model.seed), data order (data.seed) and dropout (train.seed) offset by k."""
    return [f"model.seed={cfg.model.seed + k}", f"data.seed={cfg.data.seed + k}", f"train.seed={cfg.train.seed + k}"]


def train(variant: str, args, run_dir: str, warmup: int, seeds: list[str]) -> None:
    """One launcher run of the variant at one seed; its console output goes to <run_dir>/train.log."""
    if os.path.exists(os.path.join(run_dir, "done.json")):
        return
    os.makedirs(run_dir, exist_ok=True)
    overrides = [f"model.mixer={variant}", f"train.run_dir={run_dir}", f"train.max_steps={args.steps}",
                 f"train.warmup_steps={min(warmup, args.steps // 10)}", f"checkpoint.every={args.steps}",
                 "checkpoint.keep=1", "logging.image_every=0", *seeds, *args.overrides]
    # the trainers run in this Python, on a free port: another run on the machine may hold the launcher's default
    env = {"PYTHON": sys.executable, "MASTER_PORT": str(free_local_port()), **os.environ, "NPROC": str(args.nproc)}
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
    from evaluation.loading import load
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


COLUMNS = [("tokens/s", "tokens_per_s", "{:,.0f}"), ("val ppl", "val_ppl", "{:.2f}"),
           ("bits/byte", "bits_per_byte", "{:.3f}")]


def cell(values: list[float], fmt: str) -> str:
    """'mean [min, max]' over the seeds ('mean' alone for one seed)."""
    mean, lo, hi = spread(values)
    return fmt.format(mean) + (f" [{fmt.format(lo)}, {fmt.format(hi)}]" if len(values) > 1 else "")


def write_results(runs: dict[str, list[dict]], curves: dict[str, list[dict]], out: str, args, cfg) -> None:
    """results.json (every run), results.md (the budget, the table, the ranking) and loss_curves.png."""
    tokens = args.steps * cfg.tokens_per_step
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"config": args.config, "steps": args.steps, "tokens": tokens, "seeds": args.seeds,
                   "data": cfg.data.shard_dir, "runs": runs}, f, indent=2)
    first = next(iter(runs.values()))[0]
    columns = COLUMNS + [(k, k, "{:.3f}") for k in first if k.endswith(" acc")]
    head = ["variant", "params", "synth params (Table 1)", *[c[0] for c in columns], "paper, LM1B ppl"]
    lines = [f"# Variant study: {args.config}", "",
             f"Budget: {args.steps} steps × {cfg.tokens_per_step:,} tokens = {tokens / 1e6:.2f}M tokens per run, "
             f"{args.nproc} processes. Seeds: {args.seeds} per variant (model.seed, data.seed and train.seed + 0 … "
             f"{args.seeds - 1}); each cell is the mean over the seeds and its [min, max]. Data: "
             f"{cfg.data.shard_dir} (validation split). The paper's column is LM1B (Tay et al. 2020, Table 3): "
             f"another corpus, a larger model and budget, for orientation only.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for v, rows in runs.items():
        lines.append("| " + " | ".join([v, f"{rows[0]['params'] / 1e6:.2f}M", f"{rows[0]['synth_params'] / 1e3:.1f}k",
                                        *[cell([r[key] for r in rows], fmt) for _, key, fmt in columns],
                                        str(PAPER_LM1B.get(v, "—"))]) + " |")
    lines += ["", "Ranking by validation perplexity: A is ranked above B only where A's worst seed beats B's best "
                  "seed.", ""]
    for a, b, ranked in ranking({v: [r["val_ppl"] for r in rows] for v, rows in runs.items()}):
        lines.append(f"- {a} {'<' if ranked else '≈'} {b}" + ("" if ranked else ": indistinguishable"))
    lines += ["", "![loss curves](loss_curves.png)", ""]
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write("\n".join(lines))
    plot(curves, os.path.join(out, "loss_curves.png"), args)


def plot(curves: dict[str, list[dict]], path: str, args) -> None:
    """Training loss per variant: the mean over seeds, and the [min, max] band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for variant, losses in curves.items():
        steps = sorted(set.intersection(*(set(loss) for loss in losses)))
        lo, hi = ([f([loss[s] for loss in losses]) for s in steps] for f in (min, max))
        line, = ax.plot(steps, [spread([loss[s] for loss in losses])[0] for s in steps], label=variant, linewidth=1.2)
        ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.2, linewidth=0)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (nats/token)")
    ax.set_title(f"Synthesizer variants, {args.config}, {args.seeds} seeds (band: min-max)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def study_settings(argv=None):
    """The preset (--quick: configs/studies/quick.yaml) with the flags given on top of it."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default=os.path.join(STUDIES, "cpu.yaml"), help="study preset YAML (default: the "
                   "CPU study, configs/studies/cpu.yaml)")
    p.add_argument("--quick", action="store_true", help="the short single-seed study (configs/studies/quick.yaml)")
    p.add_argument("--variants", help="comma-separated mixers")
    p.add_argument("--config", help="training config shared by all variants")
    p.add_argument("--steps", type=int, help="optimizer steps per run (the token budget)")
    p.add_argument("--seeds", type=int, help="runs per variant, each with other init and data-order seeds")
    p.add_argument("--nproc", type=int, help="processes per training run")
    p.add_argument("--tasks", help="lm-eval tasks from tasks/ ('' to skip)")
    p.add_argument("--out", help="study directory (a run directory per variant and seed)")
    p.add_argument("overrides", nargs="*", help="config overrides for every run, section.key=value")
    args = p.parse_args(argv)
    preset_path = os.path.join(STUDIES, "quick.yaml") if args.quick else args.preset
    if not os.path.isfile(preset_path):
        raise ConfigError(f"study preset {preset_path} not found; use one of configs/studies/*.yaml")
    with open(preset_path) as f:
        preset = yaml.safe_load(f) or {}
    check_keys(preset, "study", PRESET_KEYS, preset_path)   # a misspelt key is named, not ignored
    for key in ("variants", "config", "steps", "seeds", "nproc", "tasks", "out"):
        if getattr(args, key) is None:
            if key not in preset:
                raise ConfigError(f"{preset_path} has no '{key}': add it, or pass --{key}")
            setattr(args, key, ",".join(preset[key]) if key == "variants" else preset[key])
    args.overrides = [*preset.get("overrides", []), *args.overrides]
    if args.seeds < 1 or args.steps < 1:
        raise ConfigError(f"--seeds and --steps must be ≥ 1, got {args.seeds} and {args.steps}")
    return args


def main(argv=None) -> int:
    try:
        args = study_settings(argv)
        cfg = load_config(args.config, args.overrides)
        variants = [v for v in args.variants.split(",") if v]
        for v in variants:
            load_config(args.config, [*args.overrides, f"model.mixer={v}"])   # a bad name fails before training
        os.makedirs(args.out, exist_ok=True)
        runs, curves = {}, {}
        for v, k in tqdm([(v, k) for v in variants for k in range(args.seeds)], desc="runs"):
            run_dir = os.path.join(os.path.abspath(args.out), v.replace("+", "_"), f"seed{k}")
            train(v, args, run_dir, cfg.train.warmup_steps, seed_overrides(cfg, k))
            loss, speed = metrics(run_dir)
            row = {**evaluate(v, args, run_dir, cfg.data.shard_dir), **speed, "seed": k}
            runs.setdefault(v, []).append(row)
            curves.setdefault(v, []).append(loss)
            tqdm.write(f"{v}, seed {k}: val ppl {row['val_ppl']:.2f}, {row['tokens_per_s']:,.0f} tokens/s")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_results(runs, curves, args.out, args, cfg)
    print(f"wrote {args.out}/results.md, results.json and loss_curves.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
