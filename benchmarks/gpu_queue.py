"""The GPU measurement queue: parts 0–8, each one short command on a lent GPU (`make gpu-bench PART=k`; ≤ 4 minutes on
an H100, start-up included), and which parts' figures stand at this checkout.

    python benchmarks/bench.py --gpu-queue          each part: stands, changed, partly measured, or never; the next one
    python benchmarks/gpu_queue.py census DIR --commit C --configurations FILE.jsonl
                                                    census.json for a record made without one (lines {part, spec})

The parts (QUEUE): 0 correctness (benchmarks/compile_check.py: compiled = eager, the record's point), 1 the binding
MFU points, 2 engine ÷ plain loop, 3 and 4 half the variants each ÷ dot, 5 memory at n 4096 ÷ 1024, 6 `make
gpu-check`, 7 the convergence check of master weights, 8 FP8.

Invariant: a part's figures stand while the kernel census (benchmarks/kernel_census.py) of every configuration it
measured is unchanged, whatever else changed. Every part writes census.json beside its outputs: {commit, device,
torch (the census's), parts: {part: [key, ...]}, configurations: {key: {spec, census}}}; on a GPU machine without
the counts, which would cost GPU time. The census depends on torch's version (its aten decompositions): a record
counted under another torch than this one's, or not counted, is counted here at the record's commit, in a git
worktree removed afterwards (cached in build/census/). The next part to run is the first
(0, 1, …) whose figures do not stand: never measured, a configuration whose census changed, or one that the part now
plans and no record measured.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile

from benchmarks.kernel_census import census_of, key

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORDS = os.path.join(ROOT, "docs", "gpu")
CACHE = os.path.join(ROOT, "build", "census")
PLANNING_GPU = "NVIDIA H100 80GB HBM3"   # the device the queue is planned for where there is none
TITLES = {0: "correctness: compiled = eager (benchmarks/compile_check.py)", 1: "the binding MFU points",
          2: "engine ÷ plain loop", 3: "variants ÷ dot, first half", 4: "variants ÷ dot, second half",
          5: "memory at n 4096 ÷ 1024", 6: "make gpu-check", 7: "convergence: master weights", 8: "FP8"}
GPU_CHECK = [{"kind": "train", "config": "configs/demo-cpu.yaml", "overrides": ["train.precision=bf16"]}]


def gpu_queue(variants: list[str]) -> dict[int, dict]:
    """{part: {"only": bench parts, "variants": names or None}}: what `bench.py --gpu-part k` measures. Parts 0 and 6
    run a script (compile_check.py; `make gpu-check`), whose configurations `configurations` lists."""
    rest = [v for v in variants if v != "dot"]
    half = (len(rest) + 1) // 2
    return {0: {"only": [], "variants": None}, 1: {"only": ["gpu-binding"], "variants": None},
            2: {"only": ["engine"], "variants": None}, 3: {"only": ["gpu-variants"], "variants": rest[:half]},
            4: {"only": ["gpu-variants"], "variants": rest[half:]}, 5: {"only": ["gpu-memory"], "variants": None},
            6: {"only": ["engine", "gpu"], "variants": None}, 7: {"only": ["convergence"], "variants": None},
            8: {"only": ["fp8"], "variants": None}}


def configurations(part: int, a) -> list[dict]:
    """The training configurations (bench point specs) part `part` measures with a's settings."""
    from benchmarks.bench_runs import full_plan
    from benchmarks.compile_check import PART0_ARGS, configurations as checked

    if part == 0:
        mixers = PART0_ARGS[PART0_ARGS.index("--mixers") + 1].split(",")
        return checked(mixers, 0, harness=True, quick=a.quick)
    specs = [s for s in full_plan(a).points.values() if s["kind"] in ("train", "loop", "run") and s["world"] == 1]
    return (GPU_CHECK if part == 6 else []) + specs


def planning_args(part: int, parse_args):
    """bench.py's settings (`parse_args`: its parser) for part `part` as on a GPU (PLANNING_GPU), to list what it
    measures on any machine."""
    a = parse_args(["--gpu-part", str(part)])
    a.gpu = a.gpu or PLANNING_GPU
    return a


def commit_here(out: str = "") -> str:
    """The commit measured: $GPU_COMMIT, else git's HEAD, else the <date>-<commit> of the output folder's name."""
    if os.environ.get("GPU_COMMIT"):
        return os.environ["GPU_COMMIT"]
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if r.returncode == 0:
        return r.stdout.strip()
    found = re.search(r"\d{4}-\d\d-\d\d-([0-9a-f]{7,40})", os.path.abspath(out))
    return found.group(1) if found else "unknown"


def write_census(out: str, parts: dict[int, list[dict]], commit: str, device: str | None, tree: str = ROOT,
                 count: bool = True) -> str:
    """out/census.json: the census of each part's configurations, counted at `tree` (this checkout, or a worktree
    of `commit`) under this torch. Without `count`, or where the count fails, the configurations are written
    without it (the queue counts them at the commit later) and the reason is kept."""
    import torch

    specs = [s for group in parts.values() for s in group]
    try:
        counted, error = (census_of(specs, tree), None) if count else ({}, "not counted here: on a GPU machine the "
                                                                           "census is left to `make gpu-queue`")
    except RuntimeError as e:
        counted, error = {}, str(e)
    record = {"commit": commit, "device": device, "torch": torch.__version__, "error": error,
              "parts": {str(k): sorted({key(s) for s in group}) for k, group in parts.items()},
              "configurations": {key(s): {"spec": s, "census": counted.get(key(s))} for s in specs}}
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "census.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    return path


def part0_or_census(a) -> int:
    """GPU part 0 (benchmarks/compile_check.py PART0_ARGS into --out), or with --census-only no measurement; then
    the part's census."""
    from benchmarks.compile_check import PART0_ARGS, main as compile_check

    status = 0 if a.census_only else compile_check(PART0_ARGS + (["--quick"] if a.quick else []) + ["--out", a.out])
    write_part_census(a)
    return status


def write_part_census(a) -> None:
    """OUT/census.json of the GPU part a.gpu_part (none without --gpu-part, or with --no-census). On a GPU machine
    its configurations only: their census is counted afterwards by the queue, at the commit, under the CPU's torch
    (the one its comparisons use), and costs no GPU time."""
    if a.gpu_part is None or a.no_census:
        return
    if not a.gpu:
        print(f"kernel census of part {a.gpu_part}'s configurations (one CPU process) ...", flush=True)
    path = write_census(a.out, {a.gpu_part: configurations(a.gpu_part, a)}, commit_here(a.out), a.gpu,
                        count=not a.gpu)
    print(f"wrote {path}")


# ---- which figures stand --------------------------------------------------------------------------------------------
def records(root: str = RECORDS) -> list[tuple[str, dict]]:
    """(folder, census.json) of every record, oldest first: by the folder's date (<date>-<commit>-<device>), then by
    the record's commit in git's history (two records of one day: the later commit is the newer)."""
    paths = glob.glob(os.path.join(root, "*", "census.json")) + glob.glob(os.path.join(root, "*", "*", "census.json"))
    out = []
    for path in paths:
        with open(path) as f:
            out.append((os.path.dirname(path), json.load(f)))
    return sorted(out, key=lambda r: (os.path.relpath(r[0], root)[:10], history_depth(r[1].get("commit")),
                                      os.path.relpath(r[0], root)))


def history_depth(commit: str | None) -> int:
    """How many commits lead to `commit` (git rev-list --count); -1 where git does not know it."""
    r = subprocess.run(["git", "rev-list", "--count", str(commit)], cwd=ROOT, capture_output=True, text=True)
    return int(r.stdout) if commit and r.returncode == 0 and r.stdout.strip().isdigit() else -1


def census_at_commit(record: dict, tree: str = ROOT, count=census_of) -> dict:
    """{key: census} of the record's configurations under this torch: the record's own where it was counted under
    it, else counted here at the record's commit (a temporary git worktree), cached in build/census/."""
    import torch

    confs = record["configurations"]
    if record.get("torch") == torch.__version__ and all(c.get("census") for c in confs.values()):
        return {k: c["census"] for k, c in confs.items()}
    cache = os.path.join(CACHE, f"{record['commit']}-{torch.__version__}.json")
    known = json.load(open(cache)) if os.path.exists(cache) else {}
    missing = [c["spec"] for k, c in confs.items() if k not in known]
    if missing:
        with tempfile.TemporaryDirectory() as tmp:
            worktree = os.path.join(tmp, "tree")
            r = subprocess.run(["git", "worktree", "add", "--detach", worktree, record["commit"]], cwd=tree,
                               capture_output=True, text=True)
            if r.returncode:
                raise RuntimeError(f"no git worktree of the record's commit {record['commit']!r} to count its census "
                                   f"at (name it: GPU_COMMIT=..., or a docs/gpu/<date>-<commit>-<device> folder)")
            try:
                known.update(count(missing, worktree))
            finally:
                subprocess.run(["git", "worktree", "remove", "--force", worktree], cwd=tree, capture_output=True)
        os.makedirs(CACHE, exist_ok=True)
        with open(cache, "w") as f:
            json.dump(known, f)
    return known


def standing(parse_args, parts=range(9), root: str = RECORDS, tree: str = ROOT, count=census_of,
             log=print) -> dict[int, dict]:
    """Per part (`parse_args`: bench.py's parser, for what each part plans; `count`: census_of, the census of
    configurations at a checkout): {"state": stands | changed | partly | never | uncounted, "record", "commit", "changed":
    [keys], "missing": [keys]}, from the newest record of each part and the census of its configurations at `tree`."""
    newest = {}
    for folder, record in records(root):
        for part in record["parts"]:
            newest[int(part)] = (folder, record)
    wanted = {}
    for part in parts:
        if part in newest:
            folder, record = newest[part]
            for k in record["parts"][str(part)]:
                wanted[k] = record["configurations"][k]["spec"]
    log(f"counting the kernel census of {len(wanted)} measured configurations at {tree} ...")
    now = count(list(wanted.values()), tree) if wanted else {}
    out = {}
    for part in parts:
        planned = {key(s) for s in configurations(part, planning_args(part, parse_args))}
        if part not in newest:
            out[part] = {"state": "never", "record": None, "commit": None, "changed": [], "missing": sorted(planned)}
            continue
        folder, record = newest[part]
        keys = record["parts"][str(part)]
        try:
            then = census_at_commit(record, tree, count)
        except RuntimeError as e:
            out[part] = {"state": "uncounted", "record": os.path.relpath(folder, ROOT), "commit": record["commit"],
                         "changed": [], "missing": [], "measured": len(keys), "why": str(e)}
            continue
        changed = [k for k in keys if then.get(k) != now.get(k)]
        missing = sorted(planned - set(keys))
        state = "changed" if changed else "partly" if missing else "stands"
        out[part] = {"state": state, "record": os.path.relpath(folder, ROOT), "commit": record["commit"],
                     "changed": changed, "missing": missing, "measured": len(keys)}
    return out


def describe(spec_key: str) -> str:
    s = json.loads(spec_key)
    return f"{s['kind']} {s['config']} {' '.join(s['overrides'])}"


def report(states: dict[int, dict]) -> str:
    lines = []
    for part, s in states.items():
        head = f"part {part} ({TITLES[part]}): "
        if s["state"] == "never":
            lines.append(head + f"never measured ({len(s['missing'])} configurations planned)")
            continue
        where = f"{s['measured']} configurations measured at {s['commit']} ({s['record']})"
        if s["state"] == "uncounted":
            lines.append(head + f"cannot tell: {where}; {s['why']}")
        elif s["state"] == "stands":
            lines.append(head + f"stands: {where}, their kernel census unchanged")
        elif s["state"] == "changed":
            lines.append(head + f"changed: {where}; census changed for: " + "; ".join(map(describe, s["changed"])))
        else:
            shown = "; ".join(map(describe, s["missing"][:3])) + ("; …" if len(s["missing"]) > 3 else "")
            lines.append(head + f"partly measured: {where}, census unchanged; {len(s['missing'])} planned not "
                         f"measured: {shown}")
    nxt = next((p for p, s in states.items() if s["state"] != "stands"), None)
    lines.append(f"next: part {nxt} (make gpu-bench PART={nxt})" if nxt is not None else
                 "next: none, every part's figures stand")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    c = sub.add_parser("census", help="write census.json into a record made without one")
    c.add_argument("record", help="the record's folder (docs/gpu/<date>-<commit>-<device>)")
    c.add_argument("--commit", required=True, help="the commit the record measured (a git worktree of it counts)")
    c.add_argument("--configurations", required=True, help="JSON lines {\"part\": k, \"spec\": a bench point spec}")
    c.add_argument("--device", help="the GPU the record measured on (default: from census.json's folder name)")
    a = ap.parse_args(argv)
    parts: dict[int, list[dict]] = {}
    with open(a.configurations) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                parts.setdefault(int(row["part"]), []).append(row["spec"])
    with tempfile.TemporaryDirectory() as tmp:
        worktree = os.path.join(tmp, "tree")
        r = subprocess.run(["git", "worktree", "add", "--detach", worktree, a.commit], cwd=ROOT, capture_output=True,
                           text=True)
        if r.returncode:
            print(f"error: no git worktree of {a.commit!r}: {r.stderr.strip().splitlines()[-1]}", file=sys.stderr)
            return 2
        try:
            path = write_census(a.record, parts, a.commit, a.device, worktree)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", worktree], cwd=ROOT, capture_output=True)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
