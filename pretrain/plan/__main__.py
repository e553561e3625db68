"""`python -m pretrain.plan calibration | published FILE`: the time model's fit on the GPU records with its held-out
error, or its orders against a published figure set (tests/data/megatron_2021_layouts.yaml). The ranked layouts of a
config: `python -m pretrain.config CONFIG --world-size N --plan`."""
import argparse
import sys

from model.config import ConfigError
from pretrain.plan import calibration, published as paper


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pretrain.plan", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("calibration", help="the compute efficiency fitted on pretrain/plan/calibration.yaml, each record "
                                       "predicted with it fitted on the others, and the H200 points from the H100's")
    published = sub.add_parser("published", help="each figure's published and predicted layout order")
    published.add_argument("file", help="the figures' rows, e.g. tests/data/megatron_2021_layouts.yaml")
    args = p.parse_args(argv)
    try:
        print(calibration.report() if args.command == "calibration" else paper.report(args.file))
    except (ConfigError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


sys.exit(main())
