"""One part of the GPU queue (`benchmarks/bench.py --gpu-part k`, `make gpu-bench PART=k`; benchmarks/gpu_window.py
runs the next parts that fit a window): only the points that do not stand (benchmarks/gpu_queue.py standing, on
this machine), in the plan's order, each appended to OUT/points.jsonl with its census entry (OUT/census.json) as it
finishes, so a part killed midway keeps what it measured and its next run measures only the rest; the points that
stand are read back from their records into the part's report (results.md: "measured earlier").

With --deadline-s S no point starts that its estimate (`estimate_s`: the newest wall time a record kept for it on
this kind of device, else ESTIMATE's guesses) does not fit into what is left of S, and a point still running at the
deadline is stopped and not recorded. Parts 0 and 6 (WHOLE) are one script each (benchmarks/compile_check.py;
`make gpu-check`): they run whole or not at all, and their configurations are recorded when the script ends.

On the GPU machine the census is never counted: a point measured on code of this tree's digest stands as it is, any
other by the verdicts the window's dry run judged on a CPU (the stamp, benchmarks/gpu_records.py), else it is
measured again.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from benchmarks import bench_proc
from benchmarks.bench_report import machine_info, write_report
from benchmarks.bench_runs import full_plan
from benchmarks.gpu_queue import WHOLE, describe, standing, verdict_judge
from benchmarks.gpu_records import (ROOT, append_row, default_out, machine, now_iso, read_stamp, result_of,
                                    short_device, tree_state)
from benchmarks.kernel_census import key

# Seconds a point takes on an H100 where no record has timed it (each record keeps its points' wall_s, which replace
# these): start-up (process, engine, compilation) and seconds a micro-batch. Guesses from the H200 records of
# 2026-11-27 (two part-1 points a device call at 2 × 3 steps); not measured as such.
ESTIMATE = {"start": {"big": 60.0, "big compiled": 150.0, "small": 40.0, "small compiled": 90.0, "run": 90.0},
            "micro_batch_s": {"big": 0.3, "small": 0.15}, "part": {0: 300.0, 6: 420.0}}
SCRIPTS = {0: "benchmarks/compile_check.py", 6: "make gpu-check"}
clock = time.time   # the deadline's clock (a test's stand-in points advance their own)


def estimate_s(spec: dict, walls: list[float] | None = None) -> float:
    """Seconds to measure `spec` here: 1.1 × the newest wall time kept for it (`walls`, newest first), else a guess
    from ESTIMATE by its size, compilation and steps."""
    if walls:
        return 1.1 * walls[0]
    if spec["kind"] == "run":
        return ESTIMATE["start"]["run"]
    size = "big" if spec["config"].endswith("synth-1.3b.yaml") else "small"
    start = ESTIMATE["start"][size + (" compiled" if spec.get("compile") else "")]
    over = dict(o.split("=", 1) for o in spec["overrides"] if "=" in o)
    micro = max(1, int(over.get("train.global_batch_size", 4)) // int(over.get("train.micro_batch_size", 4)))
    steps = spec.get("warmup", 0) + spec.get("reps", 1) * spec.get("steps", 1)
    return start + steps * micro * ESTIMATE["micro_batch_s"][size]


def walls_of(state: dict, device: str | None) -> list[float]:
    """Wall times kept for a point on this kind of device, newest first."""
    m = state.get("measurement")
    found = [m] if m else []
    return [x["wall_s"] for x in found if x.get("wall_s") and short_device(x["machine"].get("device")) ==
            short_device(device)]


def local_judge(tree: dict):
    """On a machine that does not count the census: this code's digest, and the stamp's verdicts where the stamp
    describes this tree."""
    stamp = read_stamp(ROOT)
    usable = stamp and stamp.get("digest") == tree.get("digest")
    return verdict_judge(stamp.get("verdicts", {}) if usable else {}, tree.get("digest"))


def part_out(a, tree: dict) -> str:
    return a.out or os.path.join(default_out(tree, a.gpu), f"part{a.gpu_part}")


def run_gpu_part(a, parse_args, log=print) -> int:
    """`bench.py --gpu-part k` (module docstring): 0, or 1 where a point (or the script) failed."""
    started, t0 = time.time(), clock()
    deadline = t0 + a.deadline_s if a.deadline_s else None
    here, tree = machine(a.gpu), tree_state()
    out = part_out(a, tree)
    if tree["dirty"]:
        log(f"note: the tree differs from {tree['commit']} (uncommitted changes): the record names that commit")
    state = standing(parse_args, [a.gpu_part], root=a.records, machine=here, judge=local_judge(tree),
                     args=lambda part: a, log=log)[a.gpu_part]
    todo = list(state["specs"]) if a.all_points else [k for k, s in state["points"].items() if s["state"] != "stands"]
    log(f"part {a.gpu_part}: {len(state['points']) - len(todo)} of {len(state['points'])} configurations stand"
        + (f"; to measure {len(todo)} into {os.path.relpath(out, ROOT)}" if todo else ": nothing to measure"))
    if not todo:
        return 0
    row = {"part": a.gpu_part, "machine": here, "tree": tree}
    if a.gpu_part in WHOLE:
        return run_script(a, out, state, todo, row, deadline, log)
    if a.gpu_part in (7, 8):
        demo_shards()
    p = full_plan(a)
    results = {}
    for pk, spec in p.points.items():
        s = state["points"].get(key(spec))
        if s and key(spec) not in todo:
            results[pk] = {**(result_of(s["measurement"]) or {}), "measured_in": f"{s['commit']} ({s['record']})"}
    stopped = None
    for pk, spec in p.points.items():
        if key(spec) not in todo or pk in results:
            continue
        left = deadline - clock() if deadline else None
        need = estimate_s(spec, walls_of(state["points"][key(spec)], a.gpu))
        if left is not None and need > left:
            stopped = f"stopped before the deadline: the next point needs ~{need:.0f} s, {left:.0f} s are left"
            break
        t1 = clock()
        result = bench_proc.run_point(spec, min(a.timeout, left) if left is not None else a.timeout)
        if deadline and clock() >= deadline - 1 and str(result.get("error", "")).startswith("timeout"):
            stopped = "stopped at the deadline: the point running then is not recorded"
            break
        results[pk] = result
        append_row(out, {**row, "key": key(spec), "spec": spec, "result": result, "wall_s": round(clock() - t1, 1),
                         "at": now_iso()})
        log(progress(spec, result, clock() - t1))
    left = [key(s) for pk, s in p.points.items() if pk not in results]
    for pk in p.points:
        results.setdefault(pk, {"not_measured": "not measured: left for the next run of the part"})
    if stopped:
        log(f"{stopped}; {len(left)} configurations left for the next run of part {a.gpu_part}")
    failed = write_report(a, p, results, started, machine_info(), out, left=left, stopped=stopped)
    ended(out, a.gpu_part, stopped)
    return 1 if failed else 0


def ended(out: str, part: int, stopped: str | None) -> None:
    """OUT/part.json: whether the part stopped at its deadline with points left (the window then stops too)."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "part.json"), "w") as f:
        json.dump({"part": part, "stopped": stopped, "at": now_iso()}, f)


def progress(spec: dict, result: dict, wall: float) -> str:
    """One line per measured point: its median step and spread over the timed steps."""
    from benchmarks.bench_report import quartiles

    what = f"{spec['kind']} {os.path.basename(spec['config'])} {' '.join(spec['overrides'][2:6])}" + \
        (" (compiled)" if spec.get("compile") else "")
    if result.get("error"):
        return f"  {what}: failed ({result['error'][-200:]}), {wall:.0f} s"
    each = result.get("step_each") or result.get("step_s") or []
    if not each:
        return f"  {what}: done, {wall:.0f} s"
    q = quartiles([1e3 * s for s in each])
    return (f"  {what}: step {q['median']:.1f} ms median of {q['n']} [{q['min']:.1f}–{q['max']:.1f}, IQR "
            f"{q['q1']:.1f}–{q['q3']:.1f}], {wall:.0f} s")


def demo_shards() -> None:
    """The demo shards parts 7 and 8 train on (make gpu-shards: seconds, from data/austen.txt.gz)."""
    if not os.path.exists(os.path.join(ROOT, "build", "demo", "shards", "manifest.json")):
        subprocess.run(["make", "-s", "gpu-shards", f"GPY={sys.executable}"], cwd=ROOT, check=True)


def run_script(a, out: str, state: dict, todo: list[str], row: dict, deadline: float | None, log) -> int:
    """Parts 0 and 6: the script whole, its output in OUT/part<k>.log, then one row per configuration (its exit
    status: 0 measured, else failed)."""
    left = deadline - clock() if deadline else None
    need = ESTIMATE["part"][a.gpu_part]
    if left is not None and need > left:
        log(f"stopped before the deadline: part {a.gpu_part} needs ~{need:.0f} s, {left:.0f} s are left")
        return 0   # nothing written: the part did not start
    os.makedirs(out, exist_ok=True)
    command = [sys.executable, os.path.join(ROOT, SCRIPTS[0])] + part0_args(a, out) if a.gpu_part == 0 else \
        ["make", "gpu-check", f"GPY={sys.executable}"]
    t1 = clock()
    with open(os.path.join(out, f"part{a.gpu_part}.log"), "a") as logfile:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=logfile, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONPATH": ROOT})
        try:
            status = proc.wait(timeout=left)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            log(f"stopped at the deadline: part {a.gpu_part} ({SCRIPTS[a.gpu_part]}) not finished, not recorded")
            ended(out, a.gpu_part, "stopped at the deadline")
            return 0
    wall = round(clock() - t1, 1)
    result = {"script": SCRIPTS[a.gpu_part], "returncode": status} | ({} if status == 0 else
                                                                      {"error": f"exit status {status}"})
    for k in todo:
        append_row(out, {**row, "key": k, "spec": state["specs"][k], "result": result, "wall_s": wall,
                         "at": now_iso()})
    log(f"part {a.gpu_part}: {SCRIPTS[a.gpu_part]} exited with {status} after {wall:.0f} s "
        f"(log: {os.path.relpath(os.path.join(out, f'part{a.gpu_part}.log'), ROOT)})")
    return 0 if status == 0 else 1


def part0_args(a, out: str) -> list[str]:
    from benchmarks.compile_check import PART0_ARGS

    return PART0_ARGS + (["--quick"] if a.quick else []) + ["--out", out]


def plan_lines(part: int, state: dict, device: str | None, budget_s: float | None,
               spent: float = 0.0) -> tuple[list[str], float, bool]:
    """(lines, seconds, whole part fits): each point of a part that does not stand (a WHOLE part: its script), with
    its estimated seconds, marked where it would not fit into `budget_s` after `spent` (the parts before it): in
    order, nothing after the first point that does not fit."""
    todo = [k for k, s in state["points"].items() if s["state"] != "stands"]
    if part in WHOLE:
        todo = [(f"{SCRIPTS[part]} ({len(todo)} configurations: {state['points'][todo[0]]['why']})",
                 ESTIMATE["part"][part])] if todo else []
    else:
        todo = [(f"{describe(k)}  [{state['points'][k]['why']}]",
                 estimate_s(state["specs"][k], walls_of(state["points"][k], device))) for k in todo]
    lines, total, fits = [], spent, True
    for what, need in todo:
        fits = fits and (budget_s is None or total + need <= budget_s)
        total += need if fits else 0
        lines.append(f"  {'' if fits else '[next window] '}~{need:.0f} s  {what}")
    return lines, total, fits
