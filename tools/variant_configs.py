#!/usr/bin/env python
"""Write configs/variants/: one config per variant of the study (model/variants.py, subset "study"), each the CPU demo
with only the model's mixer changed. tests/unit/test_config.py checks that the files are what this writes.

    python tools/variant_configs.py [--check]
"""
from __future__ import annotations

import argparse
import os
import sys

from model import variants

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIRECTORY = os.path.join(ROOT, "configs", "variants")


def file_name(label: str) -> str:
    """random+dot -> random_dot.yaml"""
    return label.replace("+", "_") + ".yaml"


def text(label: str) -> str:
    """The config of one study variant."""
    if label == variants.GMLP:
        what = "gMLP blocks (Liu et al. 2021) whose spatial gating unit is the mixer."
    else:
        what = "the CPU demo with only the mixer changed (docs/DESIGN.md §1)."
    model = "".join(f"  {key}: {value}\n" for key, value in sorted(variants.model_fields(label).items()))
    return (f"# Mixer study, variant '{label}': {what}\nbase: ../demo-cpu.yaml\nmodel:\n{model}"
            f"train:\n  run_dir: runs/variants/{file_name(label)[:-len('.yaml')]}\n")


def expected() -> dict[str, str]:
    """{file name: its text} of every study variant."""
    return {file_name(label): text(label) for label in variants.subset("study")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="only say which files differ (exit 1 if any)")
    a = ap.parse_args(argv)
    want = expected()
    have = {name for name in os.listdir(DIRECTORY) if name.endswith(".yaml")}
    stale = sorted(have - set(want))
    differ = sorted(n for n, t in want.items() if not os.path.exists(os.path.join(DIRECTORY, n))
                    or open(os.path.join(DIRECTORY, n)).read() != t)
    if a.check:
        for name in stale + differ:
            print(f"configs/variants/{name}: {'not a study variant' if name in stale else 'differs from the registry'}")
        return 1 if stale or differ else 0
    for name in stale:
        os.remove(os.path.join(DIRECTORY, name))
    for name in differ:
        with open(os.path.join(DIRECTORY, name), "w") as f:
            f.write(want[name])
    print(f"configs/variants/: {len(differ)} written, {len(stale)} removed, {len(want)} in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
