#!/usr/bin/env python
"""Plot the synthesized maps of every layer and head for a prompt: one PNG grid, rows = layers, columns = heads.

    python tools/plot_attention.py runs/demo --out attention.png     # prompt: the opening of a validation document

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

import torch

from cli import UsageError, one_line_errors
from evaluation.loading import load
from evaluation.prompts import default_prompt, prompt_ids
from pretrain.observe.metrics import attention_figure, layer_maps

def plot(data, labels: list[str], out: str, title: str = "", dpi: int = 110) -> None:
    """Write the grid PNG (pretrain.observe.metrics.attention_figure, as TensorBoard shows it); `labels`: the token pieces."""
    import matplotlib.pyplot as plt

    fig = attention_figure(data, labels, title)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="release directory or DeepSpeed run / checkpoints / step_* directory")
    p.add_argument("--prompt", default=None, help="text whose maps to plot (default: the opening words of a "
                                                  "validation document of the run's shards, else a generic prompt)")
    p.add_argument("--out", default="attention.png", help="PNG file to write (default attention.png)")
    p.add_argument("--tokenizer", metavar="PATH",
                   help="tokenizer.model or tokenizer.json, if the checkpoint carries none")
    p.add_argument("--dpi", type=int, default=110, help="resolution of the PNG (default 110)")
    return p.parse_args(argv)


@one_line_errors
def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.out.lower().endswith(".png"):
        raise UsageError(f"--out {args.out} must name a .png file")
    model, sp, info = load(args.checkpoint, args.tokenizer)
    if args.prompt is None:
        args.prompt, where = default_prompt(info, sp)
        print(f"prompt {args.prompt!r}: {where}", file=sys.stderr)
    ids = prompt_ids(sp, args.prompt)
    L = model.cfg.max_seq_len
    if len(ids) > L:
        raise UsageError(f"the prompt has {len(ids)} tokens (with the leading eos) but the model sees at most "
                         f"max_seq_len={L}: shorten --prompt")
    with torch.no_grad():
        data = layer_maps(model.cfg, model.attention_maps(torch.tensor([ids], dtype=torch.int64)))
    labels = [sp.id_to_piece(i) for i in ids]
    plot(data, labels, args.out, f"{info['source']} (step {info['step']}): {len(data)} layers × "
         f"{data[0][3].shape[0]} heads, {len(ids)} tokens", args.dpi)
    print(f"wrote {args.out}: {len(data)} layers × {data[0][3].shape[0]} heads over {len(ids)} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
