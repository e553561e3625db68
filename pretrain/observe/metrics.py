"""What the run reports: console lines, TensorBoard (scalars, attention-map images, text) and metrics.jsonl, and
the same to Weights & Biases where logging.wandb is set (pretrain/observe/monitor.py).

Only global rank 0 writes; every other rank gets a Logger whose methods do nothing, so the training loop
calls it unconditionally.
"""
from __future__ import annotations

import json
import os
import resource
import sys
import time
from typing import TYPE_CHECKING

import torch

from pretrain.observe.monitor import WandbRun

if TYPE_CHECKING:
    from pretrain.config.sections import WandbSection


def memory_mb(device: torch.device, peak: bool = True) -> float:
    """This process's memory in MB — CUDA: the caching allocator's live tensors; CPU: the resident set — at its
    highest since the start or the last `reset_peak_memory` (`peak`), or now. The one reader of the trainer's log,
    benchmarks/bench.py and benchmarks/bench_mixer.py."""
    if device.type == "cuda":
        return (torch.cuda.max_memory_allocated if peak else torch.cuda.memory_allocated)(device) / 2**20
    if peak:   # the kernel's high-water mark (VmHWM), which reset_peak_memory lowers to now
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak: CUDA's counters, or on CPU the kernel's VmHWM (/proc/self/clear_refs "5"); where that is
    refused, the CPU peak stays the process's highest so far."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


TICK_LABELS_UP_TO = 40   # beyond this many tokens the axis labels of a map would overlap


def attention_figure(layers, labels: list[str] | None = None, title: str = ""):
    """A matplotlib figure of synthesized maps: rows = layers, columns = heads, each panel titled "layer i · mixer ·
    head h". `layers`: per layer (its index, its mixer, whether rows are softmax distributions, maps (H, n, n) as
    numpy); `labels`: token pieces for the axes (when n is small). Softmax maps shade 0 → the panel's largest weight
    below row 0 (whose one weight is always 1) white → dark blue on a square-root scale; SGU's weights W (any sign)
    red > 0 > blue. The masked upper triangle is left white."""
    import matplotlib

    matplotlib.use("Agg")   # files and TensorBoard only: no display needed
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import Normalize, PowerNorm

    n_heads, n = layers[0][3].shape[0], layers[0][3].shape[-1]
    size = 2.4 if n <= TICK_LABELS_UP_TO // 2 else 3.2
    fig, axes = plt.subplots(len(layers), n_heads, figsize=(size * n_heads + 0.6, size * len(layers) + 0.8),
                             squeeze=False)
    above = np.triu(np.ones((n, n), dtype=bool), k=1)                    # the masked, future keys
    for row, (index, name, softmax, maps) in enumerate(layers):
        for h in range(n_heads):
            ax, M = axes[row, h], maps[h]
            if softmax:   # row i spreads 1 over i+1 keys: a square-root scale keeps the long rows visible, and
                # row 0 (one key, weight 1) is left out of the top of the scale so it does not wash out the rest
                cmap, norm = "Blues", PowerNorm(0.5, vmin=0.0, vmax=max(float(M[1:].max()) if n > 1 else 1.0, 1e-12))
            else:
                bound = max(float(np.abs(M).max()), 1e-12)
                cmap, norm = "RdBu_r", Normalize(-bound, bound)
            cmap = matplotlib.colormaps[cmap].with_extremes(bad="white")  # masked cells: the empty upper triangle
            ax.imshow(np.ma.masked_array(M, mask=above), cmap=cmap, norm=norm, interpolation="nearest")
            ax.set_title(f"layer {index} · {name} · head {h}", fontsize=8)
            if labels is not None and n <= TICK_LABELS_UP_TO:
                ax.set_xticks(range(n), labels, rotation=90, fontsize=5)
                ax.set_yticks(range(n), labels, fontsize=5)
            else:
                ax.set_xticks([])
                ax.set_yticks([])
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def layer_maps(cfg, maps: list[torch.Tensor]) -> list[tuple]:
    """(index, mixer name, is softmax, maps (H, n, n) float64 numpy) of each layer, from a model's attention_maps of
    one sequence (per layer (1, H, n, n)): what attention_figure draws."""
    names = ["gmlp" if cfg.block == "gmlp" else m for m in cfg.layer_mixers()]
    return [(i, name, name not in ("sgu", "gmlp"), A[0].double().cpu().numpy())
            for i, (name, A) in enumerate(zip(names, maps))]


BRANCH_RECORD = "branch.json"   # in a decay branch's run directory (tools/branch.py): its parent, step and changes


def jsonl_rows(path: str) -> list[dict]:
    """The rows of a JSON-lines file (none where there is no file)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def keep_rows_up_to(path: str, step: int) -> None:
    """A run resumed at `step` replays the steps after it: their rows in the JSON-lines file `path` (metrics.jsonl,
    a rank's sample ids) move to `<name>.replayed.jsonl` beside it, so that the file holds each step once, as the
    uninterrupted run's would, and the replaced rows stay at hand for comparison."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    keep = [line for line in lines if json.loads(line)["step"] <= step]
    if len(keep) == len(lines):
        return
    with open(path.removesuffix(".jsonl") + ".replayed.jsonl", "a") as f:
        f.writelines(line for line in lines if json.loads(line)["step"] > step)
    with open(path + ".tmp", "w") as f:
        f.writelines(keep)
    os.replace(path + ".tmp", path)


class Logger:
    def __init__(self, enabled: bool, tensorboard_dir: str, run_dir: str, wandb: WandbSection | None = None,
                 config: dict | None = None):
        self.enabled = enabled
        self.writer = None
        self.jsonl = None
        self.wandb, self.wandb_settings, self.config = None, wandb, config   # logging.wandb: opened by resume_at
        self.run_dir = run_dir
        self.jsonl_path = os.path.join(run_dir, "metrics.jsonl")
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            os.makedirs(run_dir, exist_ok=True)
            self.writer = SummaryWriter(tensorboard_dir)
            self.jsonl = open(self.jsonl_path, "a")
        self.t0 = time.time()

    def resume_at(self, step: int, rewind: bool = False) -> None:
        """metrics.jsonl without the rows of the steps after `step`, which the resumed run writes again: replayed
        bit for bit, or, after a `rewind` to an older checkpoint than a relaunch would resume, trained anew."""
        if self.enabled:
            self.jsonl.close()
            logged = max((row["step"] for row in jsonl_rows(self.jsonl_path)), default=None)
            keep_rows_up_to(self.jsonl_path, step)
            self.jsonl = open(self.jsonl_path, "a")
            if self.wandb_settings:   # W&B: the steps up to `logged` were sent (pretrain/observe/monitor.py)
                anew = rewind and logged is not None and step < logged   # sent again: W&B's rewind, or a new run
                self.wandb = WandbRun.open(self.wandb_settings, self.run_dir, self.config or {},
                                           step if anew else logged, step if anew else None)

    def branch(self, step: int) -> None:
        """A decay branch (its run directory holds branch.json, tools/branch.py) names its parent run and step: a
        console line at every start, and at the branch's first step the TensorBoard text `branch/parent` and a
        metrics.jsonl row (`branch/parent_step`, `branch/parent`)."""
        path = os.path.join(self.run_dir, BRANCH_RECORD)
        if not self.enabled or not os.path.exists(path):
            return
        with open(path) as f:
            record = json.load(f)
        line = (f"a decay branch of {record['parent']} at step {record['step']}: decay over {record['decay_steps']} "
                f"steps ({record['decay_shape']}) to step {record['max_steps']}; data: {record['data']}")
        self.info(line)
        if step == record["step"] and not any("branch/parent" in row for row in jsonl_rows(self.jsonl_path)):
            self.event(step, {"branch/parent_step": record["step"]}, {"branch/parent": line})

    def info(self, msg: str | None) -> None:
        """Rank 0 prints msg; nothing for an empty one (None, "", False: a line that does not apply)."""
        if self.enabled and msg:
            print(f"[{time.time() - self.t0:7.1f}s] {msg}", flush=True, file=sys.stdout)

    def scalars(self, step: int, values: dict, descriptions: dict | None = None) -> None:
        """Each value in TensorBoard and one row of metrics.jsonl; `descriptions` (per tag) are shown beside the
        tag's chart (TensorBoard takes a tag's description from its first point)."""
        if not self.enabled:
            return
        for tag, v in values.items():
            if descriptions and tag in descriptions:   # add_scalar's own summary, with a description
                from torch.utils.tensorboard.summary import scalar

                summary = scalar(tag, float(v), new_style=True)
                summary.value[0].metadata.summary_description = descriptions[tag]
                self.writer.file_writer.add_summary(summary, step)
            else:
                self.writer.add_scalar(tag, v, step)
        self.jsonl.write(json.dumps({"step": step, **values}) + "\n")
        self.jsonl.flush()
        self.writer.flush()
        if self.wandb:
            self.wandb.scalars(step, values)

    def event(self, step: int, values: dict, texts: dict) -> None:
        """Something that happened to the run (a restart): `values` as scalars and `texts` (tag: text) as text, in
        TensorBoard and W&B, all in one row of metrics.jsonl."""
        if self.enabled:
            for tag, v in values.items():
                self.writer.add_scalar(tag, v, step)
            for tag, text in texts.items():
                self.writer.add_text(tag, text, step)
            self.jsonl.write(json.dumps({"step": step, **values, **texts}) + "\n")
            self.jsonl.flush()
            self.writer.flush()
            if self.wandb:
                self.wandb.scalars(step, values, event=True)
                for tag, text in texts.items():
                    self.wandb.text(step, tag, text, event=True)

    def attention(self, step: int, layers: list[tuple]) -> None:
        """One image per layer, `attention/layer_NN`: every head's map, labelled (attention_figure)."""
        if self.enabled:
            for layer in layers:
                tag, fig = f"attention/layer_{layer[0]:02d}", attention_figure([layer])
                if self.wandb:
                    self.wandb.figure(step, tag, fig)
                self.writer.add_figure(tag, fig, step)
            self.writer.flush()

    def text(self, step: int, tag: str, text: str) -> None:
        if self.enabled:
            self.writer.add_text(tag, text, step)
            self.writer.flush()
            if self.wandb:
                self.wandb.text(step, tag, text)

    def close(self) -> None:
        if self.enabled:
            self.writer.close()
            self.jsonl.close()
            if self.wandb:
                self.wandb.close()
