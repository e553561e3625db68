"""Fit the memory verdict's allocator factor (pretrain/plan/verdict.py ALLOCATOR_FACTOR) on some GPU records and
check it on the others.

    python benchmarks/allocator_fit.py [--fit H100] [--records docs/gpu]

Each engine point of docs/gpu/*/*.jsonl (kind "train", with its spec: config, overrides, world) is planned again with
today's pretrain/plan/memory.py and set beside what it measured: max_memory_reserved where the record has it
(`reserved_mb`, `max_reserved_mb`), else max_memory_allocated (`peak_mb`). The device is the one the record's folder
README names in its title (H100, H200). The factor is the largest measured ÷ planned on the fitted device (the
smallest factor under which no fitted record exceeds its margin), rounded up to 3 decimals; on the held-out records
each error is (factor × planned − measured) ÷ measured: positive where the margin covers the measurement.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 2**20


def device_of(folder: str) -> str | None:
    """H100, H200, … as the folder's README titles it."""
    readme = os.path.join(folder, "README.md")
    if not os.path.exists(readme):
        return None
    match = re.search(r"\b([HAB]\d{2,3})\b", open(readme).readline())
    return match.group(1) if match else None


def measured(result: dict) -> tuple[float, str] | None:
    """(bytes, which) of a record: reserved where recorded, else allocated."""
    for key, which in (("max_reserved_mb", "reserved"), ("reserved_mb", "reserved"), ("peak_mb", "allocated")):
        if result.get(key):
            return result[key] * MIB, which
    return None


def records(root: str) -> list[dict]:
    """The engine points of the GPU records, each once (a point measured twice, alike, in one folder counts once)."""
    out, seen = [], set()
    for path in sorted(glob.glob(os.path.join(root, "*", "*.jsonl"))):
        folder = os.path.dirname(path)
        for line in open(path):
            row = json.loads(line) if line.strip() else {}
            spec, result = row.get("spec"), row.get("result") or {}
            if not spec or spec.get("kind") != "train" or not measured(result):
                continue
            key = (folder, json.dumps(spec, sort_keys=True), result.get("peak_mb"))
            if key in seen:
                continue
            seen.add(key)
            out.append({"folder": os.path.basename(folder), "device": device_of(folder), "spec": spec,
                        "measured": measured(result)})
    return out


def planned(spec: dict) -> int:
    """Today's plan of a record's point, as benchmarks/bench_lib.py ran it."""
    from pretrain.plan import memory as memory_plan
    from pretrain.config import load_config
    from pretrain.config.deepspeed_dict import deepspeed_config

    cfg = load_config(os.path.join(ROOT, spec["config"]), spec["overrides"] +
                      (["train.compile=true"] if spec.get("compile") else []))
    lay = memory_plan.layout_of(cfg, spec["world"])
    return memory_plan.plan(cfg, lay, device="cuda", ds=deepspeed_config(cfg, lay.dp)).peak


def fit(root: str, device: str) -> dict:
    """{factor, fitted: [...], held_out: [...]}: each row the record and its planned, measured and error."""
    rows = []
    for r in records(root):
        plan = planned(r["spec"])
        rows.append({**r, "planned": plan, "ratio": r["measured"][0] / plan})
    fitted = [r for r in rows if r["device"] == device]
    if not fitted:
        raise SystemExit(f"error: no record of a {device} under {root}: pick one of "
                         f"{sorted({r['device'] for r in rows if r['device']})}")
    factor = math.ceil(max(r["ratio"] for r in fitted) * 1000) / 1000
    for r in rows:
        r["error"] = (factor * r["planned"] - r["measured"][0]) / r["measured"][0]
    return {"factor": factor, "fitted": fitted, "held_out": [r for r in rows if r["device"] != device]}


def describe(r: dict) -> str:
    over = " ".join(o for o in r["spec"]["overrides"] if not o.startswith(("parallel.tp=1", "train.global_batch")))
    return f"{r['folder']}: {os.path.basename(r['spec']['config'])} {over}{' compiled' if r['spec'].get('compile') else ''}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fit", default="H100", help="the device whose records fit the factor (default H100)")
    p.add_argument("--records", default=os.path.join(ROOT, "docs", "gpu"), help="the records' folder")
    args = p.parse_args(argv)
    result = fit(args.records, args.fit)
    print(f"allocator factor {result['factor']:.3f}: the largest measured ÷ planned peak of the {args.fit} records")
    for title, rows in (("fitted", result["fitted"]), ("held out", result["held_out"])):
        if not rows:
            continue
        errors = [r["error"] for r in rows]
        print(f"{title} ({len(rows)} records): factor × planned − measured, ÷ measured: from {min(errors):+.1%} to "
              f"{max(errors):+.1%}, mean {sum(errors) / len(errors):+.1%}; {sum(e >= 0 for e in errors)} of "
              f"{len(rows)} covered")
        for r in rows:
            print(f"  {r['device']} {r['measured'][1]:>9} {r['measured'][0] / MIB:9,.0f} MiB  planned "
                  f"{r['planned'] / MIB:9,.0f}  ratio {r['ratio']:.3f}  error {r['error']:+.1%}  {describe(r)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
