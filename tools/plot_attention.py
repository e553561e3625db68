#!/usr/bin/env python
"""Plot the synthesized maps of every layer and head for a prompt: one PNG grid, rows = layers, columns = heads.

    python tools/plot_attention.py runs/demo --prompt "It is a truth universally acknowledged" --out attention.png

CHECKPOINT: a release directory or any DeepSpeed checkpoint path (run directory, its checkpoints/, a step_* dir).
The prompt is tokenized after an eos (the "new document" context of training, the first row and column).
Panel (i, j) is the weight of key j in query i's output: for softmax mixers A = softmax(S + M), rows sum to 1
(white→dark blue on a square-root scale from 0 to the panel's largest weight below row 0, whose one weight is
always 1); for SGU the causal spatial weights W (no softmax, any sign:
red > 0 > blue). The upper triangle, which causal masking zeroes, is left white. Titles name each layer's mixer.
Errors are one line (exit 2).
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch

from evaluation.cli import UsageError, load, one_line_errors
from evaluation.prompts import prompt_ids

TICK_LABELS_UP_TO = 40   # beyond this many tokens the axis labels would overlap
DEFAULT_PROMPT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, "
                  "must be in want of a wife.")


def layer_names(model) -> list[str]:
    """Each layer's mixer as a title: 'dense', 'random+dot', 'sgu', or 'gmlp' for a whole gMLP block."""
    return ["gmlp" if model.cfg.block == "gmlp" else m for m in model.cfg.layer_mixers()]


def attention_data(model, tokens: torch.Tensor) -> list[tuple[str, bool, np.ndarray]]:
    """Per layer (mixer name, is_softmax, maps (H, n, n) float64) for one sequence tokens (1, n)."""
    maps = model.attention_maps(tokens)                                  # per layer (1, H, n, n)
    return [(name, name not in ("sgu", "gmlp"), A[0].double().numpy()) for name, A in zip(layer_names(model), maps)]


def plot(data, labels: list[str], out: str, title: str = "", dpi: int = 110) -> None:
    """Write the grid PNG; `labels` are the token pieces (axis ticks when short enough)."""
    import matplotlib

    matplotlib.use("Agg")   # files only: no display needed
    import matplotlib.pyplot as plt
    from matplotlib.colors import Normalize, PowerNorm

    n_layers, n_heads, n = len(data), data[0][2].shape[0], data[0][2].shape[-1]
    size = 2.4 if n <= TICK_LABELS_UP_TO // 2 else 3.2
    fig, axes = plt.subplots(n_layers, n_heads, figsize=(size * n_heads + 0.6, size * n_layers + 0.8), squeeze=False)
    above = np.triu(np.ones((n, n), dtype=bool), k=1)                    # the masked, future keys
    for i, (name, softmax, maps) in enumerate(data):
        for h in range(n_heads):
            ax, M = axes[i, h], maps[h]
            if softmax:   # row i spreads 1 over i+1 keys: a square-root scale keeps the long rows visible, and
                # row 0 (one key, weight 1) is left out of the top of the scale so it does not wash out the rest
                cmap, norm = "Blues", PowerNorm(0.5, vmin=0.0, vmax=max(float(M[1:].max()) if n > 1 else 1.0, 1e-12))
            else:
                bound = max(float(np.abs(M).max()), 1e-12)
                cmap, norm = "RdBu_r", Normalize(-bound, bound)
            cmap = matplotlib.colormaps[cmap].with_extremes(bad="white")  # masked cells: the empty upper triangle
            ax.imshow(np.ma.masked_array(M, mask=above), cmap=cmap, norm=norm, interpolation="nearest")
            ax.set_title(f"layer {i} · {name} · head {h}", fontsize=8)
            if n <= TICK_LABELS_UP_TO:
                ax.set_xticks(range(n), labels, rotation=90, fontsize=5)
                ax.set_yticks(range(n), labels, fontsize=5)
            else:
                ax.set_xticks([])
                ax.set_yticks([])
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="release directory or DeepSpeed run / checkpoints / step_* directory")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help=f"text whose maps to plot (default {DEFAULT_PROMPT!r})")
    p.add_argument("--out", default="attention.png", help="PNG file to write (default attention.png)")
    p.add_argument("--tokenizer", metavar="PATH", help="tokenizer.model, if the checkpoint carries none")
    p.add_argument("--dpi", type=int, default=110, help="resolution of the PNG (default 110)")
    return p.parse_args(argv)


@one_line_errors
def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.out.lower().endswith(".png"):
        raise UsageError(f"--out {args.out} must name a .png file")
    model, sp, info = load(args.checkpoint, args.tokenizer)
    ids = prompt_ids(sp, args.prompt)
    L = model.cfg.max_seq_len
    if len(ids) > L:
        raise UsageError(f"the prompt has {len(ids)} tokens (with the leading eos) but the model sees at most "
                         f"max_seq_len={L}: shorten --prompt")
    data = attention_data(model, torch.tensor([ids], dtype=torch.int64))
    labels = [sp.id_to_piece(i) for i in ids]
    plot(data, labels, args.out, f"{info['source']} (step {info['step']}): {len(data)} layers × "
         f"{data[0][2].shape[0]} heads, {len(ids)} tokens", args.dpi)
    print(f"wrote {args.out}: {len(data)} layers × {data[0][2].shape[0]} heads over {len(ids)} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
