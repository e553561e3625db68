#!/usr/bin/env python
"""Plot the training loss and learning rate of runs side by side: a warmup-stable-decay parent and its decay branches
(tools/branch.py), or any runs.

    python tools/plot_runs.py RUN [RUN ...] --out losses.png [--metric train/loss]

Each RUN is a run directory; its metrics.jsonl gives the curves (the rows a resume replayed are not in it). A decay
branch is labelled with its parent and step (branch.json). Above: the metric by optimizer step; below: train/lr.
Errors are one line (exit 2).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from model import ConfigError
from pretrain.observe.metrics import BRANCH_RECORD, jsonl_rows


def curve(run: str, metric: str) -> dict[int, float]:
    """{step: value} of `metric` in the run directory `run`."""
    path = os.path.join(run, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ConfigError(f"{run} has no metrics.jsonl: pass a run directory of pretrain.train")
    return {row["step"]: row[metric] for row in jsonl_rows(path) if metric in row}


def label(run: str) -> str:
    path = os.path.join(run, BRANCH_RECORD)
    if not os.path.isfile(path):
        return os.path.basename(os.path.normpath(run))
    with open(path) as f:
        record = json.load(f)
    return (f"{os.path.basename(os.path.normpath(run))} (branch of {os.path.basename(record['parent'])} at step "
            f"{record['step']})")


def plot(runs: list[str], metric: str, out: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = {run: (curve(run, metric), curve(run, "train/lr")) for run in runs}
    for run, (values, _) in curves.items():
        if not values:
            raise ConfigError(f"{run}/metrics.jsonl has no {metric!r} rows: pass --metric of one it logs")
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, height_ratios=(3, 1))
    for run, (values, lr) in curves.items():
        steps = sorted(values)
        line, = top.plot(steps, [values[s] for s in steps], label=label(run), linewidth=1.2)
        bottom.plot(sorted(lr), [lr[s] for s in sorted(lr)], color=line.get_color(), linewidth=1.2)
    top.set_ylabel(metric)
    top.legend()
    bottom.set_ylabel("train/lr")
    bottom.set_xlabel("optimizer step")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return f"wrote {out}: {metric} of {len(runs)} runs"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="run directories")
    p.add_argument("--out", required=True, help="the PNG to write")
    p.add_argument("--metric", default="train/loss", help="the metric of the upper panel (default train/loss)")
    args = p.parse_args(argv)
    try:
        print(plot(args.runs, args.metric, args.out))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
