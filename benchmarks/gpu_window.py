#!/usr/bin/env python
"""One command a GPU window: the next parts of the GPU queue that fit, results written as they come, stopping
cleanly before a deadline.

    python benchmarks/gpu_window.py --dry-run [--device NAME] [--deadline-s 480]   on a CPU, before the window
    python benchmarks/gpu_window.py [--deadline-s 480] [--out DIR]                 on the GPU machine
    make gpu-window [DEADLINE_S=480] [DRY_RUN=1]

--dry-run (on a CPU with git, before the tree is copied): which points stand (benchmarks/gpu_queue.py: the kernel
census of every measured configuration at its commit against this checkout's, counted here), the plan of what the
window will run, each point with its estimated seconds (benchmarks/gpu_part.py estimate_s), and the stamp
(.gpu-window.json in the tree's root: the commit, the code's digest and these census verdicts), which the GPU
machine reads where the tree arrives without .git: the commit measured, and which points stand there without a
census count.

On the GPU machine: the wheels of .whl/ installed (as docs/gpu/README.md's recipe does; skipped where there are
none), then each part whose points do not all stand, in the queue's order, as `benchmarks/bench.py --gpu-part k
--deadline-s LEFT --out OUT/part<k>` (each point written with its census entry as it finishes), until the next
point's estimate does not fit before the deadline (--deadline-s from the start; default 480: a 10-minute command
keeps two minutes for the machine's start and the copy back). OUT (default docs/gpu/<date>-<commit>-<device>/)
gets window.json (the plan, each part's exit status) and window.log.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time

from benchmarks import gpu_records
from benchmarks.gpu_part import local_judge, plan_lines
from benchmarks.gpu_queue import PLANNING_GPU, counted_judge, part_plan, planning_args, standing, verdict_judge
from benchmarks.gpu_records import (RECORDS, ROOT, default_out, machine, measurements, now_iso, tree_state,
                                    write_stamp)
from benchmarks.kernel_census import census_of

BENCH = os.path.join(ROOT, "benchmarks", "bench.py")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="on a CPU: print the plan with each point's estimated "
                    "seconds, and write the stamp the GPU machine reads (the commit, the census verdicts)")
    ap.add_argument("--deadline-s", type=float, default=480.0, help="seconds from the start by which the window "
                                                                     "has stopped (default 480)")
    ap.add_argument("--device", help="--dry-run: the GPU to plan for (default an H100: NVIDIA H100 80GB HBM3)")
    ap.add_argument("--parts", default="0,1,2,3,4,5,6,7,8", help="the queue's parts to consider, in order")
    ap.add_argument("--out", help="the record's folder (default docs/gpu/<date>-<commit>-<device>/)")
    ap.add_argument("--records", default=RECORDS, help="the folder of the GPU records (default docs/gpu)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds a point may take at most (default 300)")
    ap.add_argument("--no-install", action="store_true", help="do not install the wheels of .whl/")
    return ap


def plan_text(states: dict, device: str | None, budget_s: float) -> tuple[list[str], list[int]]:
    """The plan's lines and the parts it runs (the last of them may stop midway)."""
    lines, spent, runs, fits = [], 0.0, [], True
    for part, s in states.items():
        if s["state"] == "stands":
            lines.append(f"part {part}: stands ({len(s['points'])} configurations)")
            continue
        body, spent, whole = plan_lines(part, s, device, budget_s if fits else -1, spent)
        lines += [f"part {part}: {s['state']}, {len(body)} to measure"] + body
        if fits and body and not body[0].lstrip().startswith("[next window]"):
            runs.append(part)
        fits = fits and whole
    lines.append(f"estimated: {spent:.0f} s of {budget_s:.0f} s; parts to run: {', '.join(map(str, runs)) or 'none'}")
    return lines, runs


def dry_run(a, parse_args, count=census_of, log=print) -> int:
    """The plan on this CPU for a.device, and the stamp (module docstring)."""
    device = a.device or PLANNING_GPU
    tree = tree_state()
    measured = measurements(a.records)
    planned = {k for p in a.parts for k in part_plan(p, planning_args(p, parse_args, device))["specs"]}
    every = {(m["folder"], m["key"]): m for k in planned for m in measured.get(k, [])}
    judged = counted_judge(ROOT, count, log)(list(every.values())) if every else {}
    verdicts = {}
    for (folder, k), verdict in judged.items():
        verdicts.setdefault(os.path.relpath(folder, ROOT), {})[k] = list(verdict)
    states = standing(parse_args, a.parts, root=a.records, machine={"device": device},
                      judge=verdict_judge(verdicts, tree["digest"]), log=log)
    lines, _ = plan_text(states, device, a.deadline_s)
    log(f"the window's plan on {device} at {tree['commit']}{' (uncommitted changes)' if tree['dirty'] else ''}, "
        f"deadline {a.deadline_s:.0f} s (torch, triton and the environment are compared on the machine):")
    log("\n".join(lines))
    if tree["source"] != "git":
        log("no stamp written: no git here to name the commit")
        return 0
    stamp = write_stamp(ROOT, verdicts=verdicts, planned_for=device)
    log(f"wrote {os.path.relpath(os.path.join(ROOT, gpu_records.STAMP), ROOT)} (commit {stamp['commit']}, "
        f"{len(stamp['files'])} files, {sum(map(len, verdicts.values()))} census verdicts): copy it with the tree")
    return 0


def install_wheels(log=print) -> None:
    wheels = sorted(glob.glob(os.path.join(ROOT, ".whl", "*.whl")))
    if wheels:
        log(f"installing {len(wheels)} wheels of .whl/ ...")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        *wheels], check=True)


def run_window(a, log=print) -> int:
    """The window on this GPU machine (module docstring): 0, or 1 where a part failed, 2 without a GPU."""
    t0 = time.time()
    if not a.no_install:
        install_wheels(log)
    from benchmarks.bench import parse_args   # after the wheels: the bench's imports need them

    here, tree = machine(), tree_state()
    if here["device"] is None:
        log("error: no CUDA device here; on a CPU: --dry-run")
        return 2
    out = a.out or default_out(tree, here["device"])
    os.makedirs(out, exist_ok=True)
    states = standing(parse_args, a.parts, root=a.records, machine=here, judge=local_judge(tree), log=log)
    lines, _ = plan_text(states, here["device"], a.deadline_s - (time.time() - t0))
    log("\n".join([f"window on {here['device']} at {tree['commit']} (code {tree['source']}), out {out}:"] + lines))
    window = {"started": now_iso(), "machine": here, "tree": tree, "plan": lines, "parts": {}}
    status = 0
    for part in a.parts:   # in order; a part that stops at the deadline stops the window
        left = a.deadline_s - (time.time() - t0)
        body, _, _ = plan_lines(part, states[part], here["device"], left)
        if not body:
            continue
        if body[0].lstrip().startswith("[next window]"):
            log(f"--- stopping: part {part}'s next point does not fit into the {left:.0f} s left")
            break
        command = [sys.executable, BENCH, "--gpu-part", str(part), "--out", os.path.join(out, f"part{part}"),
                   "--deadline-s", f"{left:.0f}", "--records", a.records, "--timeout", f"{a.timeout:g}"]
        log(f"--- part {part}: {left:.0f} s left")
        rc = tee(command, os.path.join(out, "window.log"), left + 60)
        ended = os.path.join(out, f"part{part}", "part.json")
        stopped = json.load(open(ended)).get("stopped") if os.path.exists(ended) else None
        window["parts"][str(part)] = {"exit": rc, "seconds": round(time.time() - t0, 1), "stopped": stopped}
        with open(os.path.join(out, "window.json"), "w") as f:
            json.dump(window, f, indent=1)
        status = status or (rc not in (0, None))
        if stopped or rc is None:
            break
    log(f"window done after {time.time() - t0:.0f} s: parts {', '.join(window['parts']) or 'none'} run; "
        f"outputs in {out} (commit them with a README naming the device)")
    return 1 if status else 0


def tee(command: list[str], log_path: str, timeout: float) -> int | None:
    """Run `command`, its output to stdout and appended to `log_path`; None where it outran `timeout` (killed)."""
    import threading

    with open(log_path, "a") as log:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "PYTHONPATH": ROOT, "PYTHONUNBUFFERED": "1"})
        timer = threading.Timer(timeout, proc.kill)
        timer.start()
        for line in proc.stdout:
            sys.stdout.write(line)
            log.write(line)
        proc.wait()
        outran = not timer.is_alive()
        timer.cancel()
        return None if outran else proc.returncode


def main(argv=None, count=census_of) -> int:
    a = build_parser().parse_args(argv)
    try:
        a.parts = [int(p) for p in a.parts.split(",") if p.strip()]
    except ValueError:
        print(f"error: --parts={a.parts!r}: comma-separated part numbers 0–8", file=sys.stderr)
        return 2
    if a.dry_run:
        from benchmarks.bench import parse_args

        return dry_run(a, parse_args, count)
    return run_window(a)


if __name__ == "__main__":
    sys.exit(main())
