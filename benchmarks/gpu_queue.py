"""The GPU measurement queue: parts 0–8, each measured point by point on a lent GPU (`make gpu-window`, or one part:
`make gpu-bench PART=k`), and which points and parts stand at this checkout.

    python benchmarks/bench.py --gpu-queue          each part: stands, changed, partly measured, or never; the next one
    python benchmarks/gpu_queue.py census DIR --commit C --configurations FILE.jsonl
                                                    census.json for a record made without one (lines {part, spec})

The parts (QUEUE): 0 correctness (benchmarks/compile_check.py: compiled = eager, the record's point), 1 the binding
MFU points (accumulation 1), 2 engine ÷ plain loop, 3 accumulation 8 (the MFU goals), 4 the variants ÷ dot, 5 memory
at n 4096 ÷ 1024, 6 `make gpu-check`, 7 the convergence check of master weights, 8 FP8.

Invariant: a point (one configuration: kind, config, overrides, compiled or not; benchmarks/kernel_census.py key)
stands while (a) the kernel census of its configuration is unchanged, its `beside` record included (what is compiled,
the compiler's settings, SDPA's signatures, the Triton sources launched, the ops' dtypes), and (b) the machine that
would measure it now has the device, torch, CUDA, triton and DeepSpeed versions and the steering environment of the
one that did (benchmarks/gpu_records.py; not compared where no machine is named, or a record kept none; parts
DEVICE_FREE compare all but the device). A point measured by any bench part stands for every bench part that plans
it (a WHOLE part's script records no figure of a point: its points stand for itself only). A ratio's
two points (and all of a WHOLE part's) stand only together, from one run (one machine session): otherwise all of
them are measured again, side by side. The next part to run is the first whose points do not all stand.

Where a record was counted under another torch than this one's, or not counted (on a GPU machine the census is never
counted: it costs no GPU time here), its census is counted here at the record's commit, in a git worktree removed
afterwards (cached in build/census/). A point measured on code of the same digest as this tree's needs no count.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from benchmarks.gpu_records import COMPARED, RECORDS, differences, measurements, tree_state
from benchmarks.kernel_census import CENSUS_VERSION, census_of, key

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(ROOT, "build", "census")
PLANNING_GPU = "NVIDIA H100 80GB HBM3"   # the device the queue is planned for where there is none
TITLES = {0: "correctness: compiled = eager (benchmarks/compile_check.py)", 1: "the binding MFU points",
          2: "engine ÷ plain loop", 3: "accumulation 8", 4: "variants ÷ dot", 5: "memory at n 4096 ÷ 1024",
          6: "make gpu-check", 7: "convergence: master weights", 8: "FP8"}
GPU_CHECK = [{"kind": "train", "config": "configs/demo-cpu.yaml", "overrides": ["train.precision=bf16"]}]
WHOLE = (0, 6)          # one script each: its configurations stand, or run, together
DEVICE_FREE = (0, 7)    # correctness and convergence: the same on any Hopper; compared without the device


def gpu_queue(variants: list[str]) -> dict[int, dict]:
    """{part: {"only": bench parts, "variants": names or None}}: what `bench.py --gpu-part k` measures. Parts 0 and 6
    run a script (compile_check.py; `make gpu-check`), whose configurations `configurations` lists."""
    return {0: {"only": [], "variants": None}, 1: {"only": ["gpu-binding"], "variants": None},
            2: {"only": ["engine"], "variants": None}, 3: {"only": ["gpu-accum"], "variants": None},
            4: {"only": ["gpu-variants"], "variants": list(variants)}, 5: {"only": ["gpu-memory"], "variants": None},
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


def planning_args(part: int, parse_args, device: str | None = None):
    """bench.py's settings (`parse_args`: its parser) for part `part` as on `device` (default: this machine's GPU,
    else PLANNING_GPU), to list what it measures on any machine."""
    a = parse_args(["--gpu-part", str(part)])
    a.gpu = device or a.gpu or PLANNING_GPU
    return a


def part_plan(part: int, a) -> dict:
    """{"specs": {key: spec} in the order measured, "groups": [[key, ...]]: points that stand only together (a
    ratio's two; all of a WHOLE part's)}."""
    from benchmarks.bench_runs import full_plan

    specs = {key(s): s for s in configurations(part, a)}
    if part in WHOLE:
        return {"specs": specs, "groups": [list(specs)]}
    p = full_plan(a)
    by_id = {e["id"]: e for e in p.entries}
    groups = []
    for e in p.entries:
        other = by_id.get(e.get("ratio_to"))
        if e.get("point") and other and other.get("point"):
            pair = sorted({key(p.points[e["point"]]), key(p.points[other["point"]])})
            if len(pair) == 2 and pair not in groups:
                groups.append(pair)
    return {"specs": specs, "groups": groups}


# ---- judging a measurement's census against today's ----------------------------------------------------------------
def census_at_commit(record: dict, tree: str = ROOT, count=census_of) -> dict:
    """{key: census} of the record's configurations under this torch: the record's own where it was counted under
    it (this census version), else counted here at the record's commit (a temporary git worktree), cached in
    build/census/."""
    import torch

    confs = {key(c["spec"]): c for c in record["configurations"].values()}
    if record.get("torch") == torch.__version__ and record.get("census_version") == CENSUS_VERSION and \
            all(c.get("census") for c in confs.values()):
        return {k: c["census"] for k, c in confs.items()}
    cache = os.path.join(CACHE, f"{record['commit']}-{torch.__version__}-v{CENSUS_VERSION}.json")
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


def census_diff(then: dict | None, now: dict | None) -> list[str]:
    """What differs between two censuses of one configuration: a phase's ops, or an entry of `beside`."""
    if not then or not now:
        return ["not counted" if not then else "cannot be counted today"]
    out = [f"{phase} ops" for phase in sorted(set(then) | set(now)) if phase != "beside" and
           then.get(phase) != now.get(phase)]
    a, b = then.get("beside") or {}, now.get("beside") or {}
    return out + [name for name in sorted(set(a) | set(b)) if a.get(name) != b.get(name)]


def counted_judge(tree: str = ROOT, count=census_of, log=print):
    """judge(measurements) → {(folder, key): (stands: bool | None, why)}: the census at each record's commit against
    today's (`count`: census_of, the census of configurations at a checkout); a measurement of this tree's own code
    (its digest) stands without a count."""
    here = tree_state(tree)["digest"]

    def judge(ms: list[dict]) -> dict:
        out, rest = {}, []
        for m in ms:
            if here and m["digest"] == here:
                out[(m["folder"], m["key"])] = (True, "measured on this code")
            else:
                rest.append(m)
        if not rest:
            return out
        specs = {m["key"]: m["spec"] for m in rest}
        log(f"counting the kernel census of {len(specs)} measured configurations at {tree} ...")
        now = count(list(specs.values()), tree)
        for folder in dict.fromkeys(m["folder"] for m in rest):
            group = [m for m in rest if m["folder"] == folder]
            try:
                then = census_at_commit(group[0]["record"], tree, count)
            except RuntimeError as e:
                out.update({(folder, m["key"]): (None, str(e)) for m in group})
                continue
            for m in group:
                diff = census_diff(then.get(m["key"]), now.get(m["key"]))
                out[(folder, m["key"])] = (not diff, "census changed: " + ", ".join(diff) if diff else
                                           f"census unchanged since {m['commit']}")
        return out
    return judge


def verdict_judge(verdicts: dict, here: str | None):
    """judge() from verdicts judged before (the stamp's, written on a CPU by the window's dry run: {folder relative to
    the repository: {key: [stands, why]}}); a measurement of this code's digest stands, any other unjudged does not."""
    def judge(ms: list[dict]) -> dict:
        out = {}
        for m in ms:
            given = verdicts.get(os.path.relpath(m["folder"], ROOT), {}).get(m["key"])
            out[(m["folder"], m["key"])] = (True, "measured on this code") if here and m["digest"] == here else \
                tuple(given) if given else (None, "not judged: no census of it at this code (run the window's dry "
                                                  "run on a CPU before copying the tree)")
        return out
    return judge


# ---- which points stand ---------------------------------------------------------------------------------------------
def standing(parse_args, parts=range(9), root: str = RECORDS, tree: str = ROOT, count=census_of, machine=None,
             judge=None, args=None, log=print) -> dict[int, dict]:
    """Per part (`parse_args`: bench.py's parser, for what each part plans, or `args(part)`: the settings it runs
    with; `machine`: the one that would measure, benchmarks/gpu_records.machine, or None to compare no machine;
    `judge`: counted_judge(tree, count) unless given):
    {"state": stands | changed | partly | never | uncounted, "points": {key: {"state": stands | changed | missing |
    unknown, "why", "record", "commit", "run", "measurement"}}, "specs", "stands", "changed", "missing" (keys)}."""
    measured = measurements(root)
    device = (machine or {}).get("device")
    plans = {p: part_plan(p, args(p) if args else planning_args(p, parse_args, device)) for p in parts}
    picks = {}
    for p in parts:
        compare = tuple(c for c in COMPARED if p not in DEVICE_FREE or c != "device")
        for k in plans[p]["specs"]:   # a script's part (WHOLE) has no figure of a point: its own only, no other's
            found = [m for m in measured.get(k, []) if (m["part"] == p if p in WHOLE else m["part"] not in WHOLE)]
            pick = next((m for m in found if not differences(m["machine"], machine, compare)), None)
            picks[(p, k)] = (pick, "never measured" if not found else None if pick else
                             "measured elsewhere: " + "; ".join(differences(found[0]["machine"], machine, compare)))
    unique = {(m["folder"], m["key"]): m for m, _ in picks.values() if m}
    verdicts = (judge or counted_judge(tree, count, log))(list(unique.values())) if unique else {}
    out = {}
    for p in parts:
        points = {}
        for k in plans[p]["specs"]:
            m, why = picks[(p, k)]
            if m is None:
                points[k] = {"state": "missing", "why": why, "record": None, "commit": None, "run": None}
                continue
            ok, why = verdicts[(m["folder"], k)]
            points[k] = {"state": {True: "stands", False: "changed", None: "unknown"}[ok], "why": why,
                         "record": os.path.relpath(m["folder"], ROOT), "commit": m["commit"], "run": m["run"],
                         "measurement": m}
        tie(points, plans[p]["groups"], (machine or {}).get("boot"))
        out[p] = summarize(points, plans[p]["specs"])
    return out


def tie(points: dict, groups: list[list[str]], this_run: str | None = None) -> None:
    """A group's standing points are measured again unless all of it stands from one run, or they were measured in
    `this_run` (this machine's session, where the rest of the group is about to be measured)."""
    moved = True
    while moved:
        moved = False
        for group in groups:
            states = [points[k] for k in group if k in points]
            if all(s["state"] == "stands" for s in states) and len({s["run"] for s in states}) <= 1:
                continue
            for s in states:
                if s["state"] == "stands" and not (this_run and s["run"] == this_run):
                    s.update(state="missing", why="measured again beside the points it is compared with (one run)")
                    moved = True


def summarize(points: dict, specs: dict) -> dict:
    by = {state: [k for k, s in points.items() if s["state"] == state] for state in ("stands", "changed", "missing",
                                                                                       "unknown")}
    never = all(s["why"] == "never measured" for s in points.values())
    state = "stands" if len(by["stands"]) == len(points) else "changed" if by["changed"] else \
        "uncounted" if by["unknown"] else "never" if never else "partly"
    return {"state": state, "points": points, "specs": specs, "stands": by["stands"], "changed": by["changed"],
            "missing": by["missing"] + by["unknown"]}


def describe(spec_key: str) -> str:
    s = json.loads(spec_key)
    return f"{s['kind']} {s['config']} {' '.join(s['overrides'])}" + (" (compiled)" if s.get("compile") else "")


def report(states: dict[int, dict]) -> str:
    lines = []
    for part, s in states.items():
        head, n = f"part {part} ({TITLES[part]}): ", len(s["points"])
        records = sorted({f"{p['commit']} ({p['record']})" for p in s["points"].values() if p["record"]})
        where = f"measured at {', '.join(records)}" if records else ""
        if s["state"] == "never":
            lines.append(head + f"never measured ({n} configurations planned)")
        elif s["state"] == "stands":
            lines.append(head + f"stands: {n} configurations {where}, census and machine unchanged")
        else:
            shown = [f"{describe(k)} [{s['points'][k]['why']}]" for k in s["changed"] + s["missing"]]
            lines.append(head + f"{s['state']}: {len(s['stands'])} of {n} stand ({where or 'none measured'}); "
                         f"to measure: " + "; ".join(shown[:3]) + ("; …" if len(shown) > 3 else ""))
    nxt = next((p for p, s in states.items() if s["state"] != "stands"), None)
    lines.append(f"next: part {nxt} (make gpu-bench PART={nxt}, or make gpu-window)" if nxt is not None else
                 "next: none, every part's figures stand")
    return "\n".join(lines)


# ---- a census.json for a record made without one --------------------------------------------------------------------
def write_census(out: str, parts: dict[int, list[dict]], commit: str, device: str | None, tree: str = ROOT) -> str:
    """out/census.json: the census of each part's configurations, counted at `tree` (a worktree of `commit`) under
    this torch; where the count fails, the configurations are written without it and the reason is kept."""
    import torch

    specs = [s for group in parts.values() for s in group]
    try:
        counted, error = census_of(specs, tree), None
    except RuntimeError as e:
        counted, error = {}, str(e)
    record = {"commit": commit, "device": device, "torch": torch.__version__, "census_version": CENSUS_VERSION,
              "error": error, "parts": {str(k): sorted({key(s) for s in group}) for k, group in parts.items()},
              "configurations": {key(s): {"spec": s, "census": counted.get(key(s))} for s in specs}}
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "census.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    return path


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
