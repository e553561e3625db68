#!/usr/bin/env python
"""Parameters and training FLOPs of a config's model, per layer and in total, counted on the real modules.

    python tools/model_stats.py --config configs/demo-cpu.yaml [model.mixer=random] [--seq-len N] [--json]

Columns: trainable and frozen parameters; "table1" = the synthesizing function's own trainable parameters as in
Table 1 of Tay et al. 2020 (without value/output projections and biases); training FLOPs per token (forward +
backward = 3 × forward, 2 per multiply-add, full n² terms at the sequence length).
"""
from __future__ import annotations

import argparse
import json
import sys

from model import ConfigError, ModelConfig
from model.accounting import model_stats


def load_model_config(path: str, overrides: list[str]) -> ModelConfig:
    from pretrain.config import load_config

    return load_config(path, overrides).model


def human(x: int) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= size:
            return f"{x / size:.2f}{unit}"
    return str(x)


def print_table(stats: dict) -> None:
    print(f"{'layer':>5}  {'mixer':<28} {'trainable':>10} {'frozen':>10} {'table1':>10} {'train FLOPs/token':>18}")
    for row in stats["layers"]:
        print(f"{row['layer']:>5}  {row['mixer']:<28} {human(row['trainable']):>10} {human(row['frozen']):>10} "
              f"{human(row['table1']):>10} {human(row['train_flops_per_token']):>18}")
    o = stats["embeddings_and_head"]
    print(f"{'':>5}  {'embeddings, final norm, head':<28} {human(o['trainable']):>10} {human(o['frozen']):>10} "
          f"{'':>10} {human(o['train_flops_per_token']):>18}")
    t = stats["total"]
    print(f"{'total':>5}  {'':<28} {human(t['trainable']):>10} {human(t['frozen']):>10} {human(t['table1']):>10} "
          f"{human(t['train_flops_per_token']):>18}")
    print(f"(exact: trainable={t['trainable']} frozen={t['frozen']} table1={t['table1']} "
          f"train_flops_per_token={t['train_flops_per_token']} at n={stats['seq_len']})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="training YAML (its model: section is used)")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.mixer=random+dot")
    ap.add_argument("--seq-len", type=int, default=None, help="n for the n² FLOP terms (default max_seq_len)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = ap.parse_args(argv)
    try:
        cfg = load_model_config(args.config, args.overrides)
        if args.seq_len is not None and not 0 < args.seq_len <= cfg.max_seq_len:
            raise ConfigError(f"--seq-len={args.seq_len} must be in [1, model.max_seq_len={cfg.max_seq_len}]")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    stats = model_stats(cfg, args.seq_len)
    stats["config"] = args.config
    if args.json:
        print(json.dumps(stats, indent=2))
    else:
        print_table(stats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
