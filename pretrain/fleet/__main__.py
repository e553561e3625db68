"""`python -m pretrain.fleet CONFIG [section.key=value ...] [--mb MB] [--repeats N] [--confirm N]`, as every rank
of a launch (e.g. `deepspeed --module pretrain.fleet CONFIG`, or `torchrun --nproc-per-node 8 -m pretrain.fleet
CONFIG` on each node): the check before launch of pretrain/fleet/preflight.py on the config's process groups. Prints one line on rank 0 and
exits 1 when a rank's GEMM or a link is named, 0 when the fleet is even, 2 on a bad config."""
from __future__ import annotations

import argparse
import sys

from model.config import ConfigError
from pretrain import distributed
from pretrain.config import load_config
from pretrain.fleet import preflight


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pretrain.fleet", description=__doc__.split("\n\n")[0])
    p.add_argument("config", help="the training config (YAML) whose launch is checked, e.g. configs/demo-cpu.yaml")
    p.add_argument("overrides", nargs="*", help="section.key=value (fleet.gpu_floor=0.85 …)")
    p.add_argument("--mb", type=float, default=4.0, help="MiB exchanged each way over a link per timing (default 4)")
    p.add_argument("--repeats", type=int, default=10, help="timed runs of each GEMM and exchange; the best counts "
                                                          "(default 10)")
    p.add_argument("--confirm", type=int, default=1, help="passes more when a pass names something; each figure is "
                                                         "its best over the passes (default 1)")
    args = p.parse_args([a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("--local_rank")])
    try:
        cfg = load_config(args.config, args.overrides)
        lay = distributed.init(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        line, slow = preflight.check(lay, cfg.fleet.gpu_floor, cfg.fleet.link_floor, args.mb, args.repeats,
                                        confirm=args.confirm)
        if lay.is_main:
            print(line, flush=True)
        return 1 if slow else 0
    finally:
        distributed.shutdown()


if __name__ == "__main__":
    sys.exit(main())
