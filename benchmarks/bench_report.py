"""What benchmarks/bench.py does in the parent process with the points its children measure: the served processes it
alternates (ServedPoint), summary statistics over repetitions (or over the steps of a point timed in one
repetition: its median, (max − min) / median and interquartile range), ratios with their range, the entries read
off the points (`finish`), the machine's description and the markdown table."""
from __future__ import annotations

import json
import os
import platform
import queue
import signal
import statistics
import subprocess
import threading
import time

from benchmarks.bench_lib import READY_MARK, REP_MARK, RESULT_MARK
from benchmarks.bench_points import FLOP_SLACK, Plan


def machine_info() -> dict:
    import torch

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), cpu)
    except OSError:
        pass
    versions = {}
    for name in ("deepspeed", "transformers"):
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            versions[name] = None
    return {"platform": platform.platform(), "python": platform.python_version(), "cpu": cpu,
            "cpu_count": os.cpu_count(), "torch": torch.__version__, **versions,
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


class PointFailed(RuntimeError):
    pass


class ServedPoint:
    """A world-1 measuring process (`benchmarks/bench.py _one SPEC` with spec["serve"]) kept alive between repetitions,
    so the parent can alternate the repetitions of two points: the machine's drift (10–30% over minutes on a shared
    VM, measured) then hits both alike. Its output is read by a thread (no pipe fills up); `timeout` bounds each wait."""

    def __init__(self, command: list[str], env: dict, cwd: str, timeout: float):
        self.timeout, self.lines, self.tail, self.failure = timeout, queue.Queue(), [], None
        self.proc = subprocess.Popen(command, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        threading.Thread(target=self._pump, daemon=True).start()
        self._read(READY_MARK)

    def _pump(self):
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)   # end of output: the child exited

    def _read(self, mark: str) -> str:
        while self.failure is None:
            try:
                line = self.lines.get(timeout=self.timeout)
            except queue.Empty:
                line, self.failure = None, f"timeout after {self.timeout:g} s"
            if line is None:
                self.failure = self.failure or (self.tail or ["failed without output"])[-1].strip()[-300:]
                break
            if line.startswith(mark):
                return line[len(mark):]
            self.tail = (self.tail + [line])[-20:]
        self.kill()
        raise PointFailed(self.failure)

    def _send(self, command: str) -> None:
        try:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass   # the child died: _read reports its last line

    def rep(self) -> float:
        """One repetition (spec's steps) in the child; its rate."""
        self._send("rep")
        return json.loads(self._read(REP_MARK))["rate"]

    def finish(self) -> dict:
        """The child's result (every repetition it ran), after which it exits."""
        self._send("done")
        out = json.loads(self._read(RESULT_MARK))
        self.proc.wait()
        return out

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def paired_ratio(reps, paired, ref_reps, ref_paired) -> tuple[float, list[float]]:
    """Ratio of two points measured alternately with one reference process, and its range: each point's
    repetitions are divided by the reference's repetition next to them (the reference's own: all 1), the ratio is
    of the medians of those, its range of their extremes."""
    a = [x / y for x, y in zip(reps, paired)]
    b = [x / y for x, y in zip(ref_reps, ref_paired)]
    return statistics.median(a) / statistics.median(b), [min(a) / max(b), max(a) / min(b)]


def summary(reps: list[float]) -> tuple[float, float]:
    """(median, relative spread (max − min) / median) over the repetitions."""
    med = statistics.median(reps)
    return med, (max(reps) - min(reps)) / med if med else 0.0


def quartiles(values: list[float]) -> dict:
    """{n, min, q1, median, q3, max} of the values."""
    q1, med, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
    return {"n": len(values), "min": min(values), "q1": q1, "median": med, "q3": q3, "max": max(values)}


def iqr(values: list[float]) -> float:
    """Interquartile range ÷ median."""
    q = quartiles(values)
    return (q["q3"] - q["q1"]) / q["median"] if q["median"] else 0.0


def per_step(res: dict, field: str) -> list[float] | None:
    """A point timed in one repetition of several steps: the field's value at each step (rate, TFLOP/s or seconds),
    else None (its repetitions are the figure's values)."""
    each = res.get("step_each") or []
    if len(res.get("rate") or []) != 1 or len(each) < 2 or field not in ("rate", "tflops", "step_s") or \
            res.get("error"):
        return None
    if field == "step_s":
        return list(each)
    tokens = res["rate"][0] * res["step_s"][0]   # per step: rate × seconds a step
    rates = [tokens / s for s in each]
    return rates if field == "rate" else [r * res["train_flops_per_token"] / 1e12 for r in rates]


def finish(p: Plan, results: dict, machine: dict) -> list[dict]:
    """Values, spreads, ratios and goals of the entries, from the points' results."""
    out, by_id = [], {}
    for e in p.entries:
        point = e.pop("point")
        res = results.get(point, {})
        reps = e.pop("reps", None)
        steps = per_step(res, e["field"])
        if point and res.get("not_measured"):   # a point a GPU part left for its next run
            e["skipped"] = res["not_measured"]
        if reps is None and e.get("skipped") is None and not res.get("error") and res:
            reps = steps or (res.get(e["field"]) if e["field"] != "tflops" else
                             [r * res["train_flops_per_token"] / 1e12 for r in res["rate"]])
            if e["field"] == "uncontended_step_s":   # less the longest any rank waited for a CPU while runnable
                reps = [s - max(r["runqueue_s"][i] for r in res.get("by_rank", [res]))
                        for i, s in enumerate(res["step_s"])]
        e.update(value=None, spread=None, ratio=None, ratio_range=None, status=None, machine=machine,
                 error=res.get("error"), reps=reps, paired_reps=None, skipped=e.get("skipped"))
        if reps:
            e["value"], e["spread"] = summary(reps)
        if steps and reps is steps:   # one repetition of many steps: its spread is the steps'
            e["iqr"], e["step_ms"] = iqr(steps), quartiles([1e3 * s for s in res["step_each"]])
        if res.get("measured_in"):
            e["measured_in"] = res["measured_in"]
        for k in ("params", "train_flops_per_token", "tokens_per_step", "device", "after_init_mb",
                  "after_engine_mb", "at_rest_mb", "peak_mb", "phase_mb", "cuda_memory", "val_step", "seconds",
                  "requests", "fetched", "streams", "shard_mb", "shards"):
            if k in res:
                e[k] = res[k]
        if reps and e["field"] == "rate" and (point == p.reference or res.get("paired_rate")):
            e["paired_reps"] = reps if point == p.reference else res["paired_rate"]   # dot's, next to each rep
        if e["field"] == "total_mb" and res.get("step_mb"):
            e["step_mb"] = summary(res["step_mb"])[0]   # above the engine at rest: no parameters, optimizer states
        by_id[e["id"]] = e
        out.append(e)
    for e in out:
        ref = by_id.get(e["ratio_to"])
        if e["value"] is not None and ref and ref["value"]:
            if e.get("paired_reps") and ref.get("paired_reps"):   # both alternated with dot: drift cancels
                e["ratio"], e["ratio_range"] = paired_ratio(e["reps"], e["paired_reps"], ref["reps"],
                                                            ref["paired_reps"])
            else:
                e["ratio"] = e["value"] / ref["value"]
                e["ratio_range"] = [min(e["reps"]) / max(ref["reps"]), max(e["reps"]) / min(ref["reps"])]
        if e["name"] == "throughput" and e.get("train_flops_per_token") and by_id["throughput:dot"]["value"]:
            e["flop_ratio"] = by_id["throughput:dot"]["train_flops_per_token"] / e["train_flops_per_token"]
            if e["variant"] != "dot":
                e["goal_min"] = FLOP_SLACK * e["flop_ratio"]
        lo, hi = e.pop("goal_min", None), e.pop("goal_max", None)
        e["goal"] = f"{lo:.3g}–{hi:.3g}" if lo is not None and hi is not None else f"≥ {lo:.3g}" if lo is not None \
            else f"≤ {hi:.3g}" if hi is not None else None
        if e["goal"] and e["ratio"] is not None:
            e["status"] = "ok" if (lo is None or e["ratio"] >= lo) and (hi is None or e["ratio"] <= hi) else "MISSED"
    return out


def fmt_value(value, unit: str) -> str:
    if value is None:
        return "-"
    if unit in ("tokens/s",):
        return f"{value:,.0f} tok/s"
    return f"{value:,.3g} {unit}" if abs(value) < 100 else f"{value:,.0f} {unit}"


def markdown(entries: list[dict], machine: dict, title: str) -> str:
    gpu = f", GPU {machine['gpu']}" if machine["gpu"] else ", no GPU"
    lines = [f"# {title}", "",
             f"{machine['platform']}, {machine['cpu']} ({machine['cpu_count']} CPUs){gpu}; torch {machine['torch']}, "
             f"deepspeed {machine['deepspeed']}, transformers {machine['transformers']}", "",
             "| measurement | variant | n | value (median) | spread | ratio [range] | to | goal | status |",
             "|---|---|---|---|---|---|---|---|---|"]
    for e in entries:
        n = e.get("n", "")
        if e["value"] is None:
            why = e.get("skipped") or e.get("error") or "no value"
            lines.append(f"| {e['name']} | {e['variant']} | {n} | - | | | | {e.get('goal') or ''} | {why} |")
            continue
        ratio = f"{e['ratio']:.3f} [{e['ratio_range'][0]:.3f}–{e['ratio_range'][1]:.3f}]" if e["ratio"] else ""
        spread = f"{100 * e['spread']:.1f}%" + (f", IQR {100 * e['iqr']:.1f}% of {e['step_ms']['n']} steps "
                                                 f"({e['step_ms']['min']:.1f}–{e['step_ms']['max']:.1f} ms)"
                                                 if e.get("step_ms") else "")
        lines.append(f"| {e['name']} | {e['variant']} | {n} | {fmt_value(e['value'], e['unit'])} | "
                     f"{spread} | {ratio} | {e['ratio_to'] or ''} | {e.get('goal') or ''} | "
                     f"{e.get('status') or ''} |")
    notes = [f"- {e['id']}: {e['note']}" for e in entries if e.get("note")]
    notes += [f"- {e['id']}: measured earlier, {e['measured_in']}" for e in entries if e.get("measured_in")]
    notes += [f"- {e['id']}: peak above rest by phase: " + ", ".join(f"{k} {v:,.0f} MB" for k, v in e["phase_mb"].items())
              for e in entries if e["name"] == "memory" and e.get("phase_mb") and e.get("goal")]
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def write_report(a, p: Plan, results: dict, t0: float, machine: dict, out: str, **extra) -> list[str]:
    """OUT/results.json and OUT/results.md of a run's entries (and `extra` in the JSON, e.g. the points a GPU part
    left for its next run); printed; the ids of the entries whose point failed."""
    entries = finish(p, results, machine)
    settings = {k: getattr(a, k) for k in ("quick", "only", "reps", "steps", "warmup", "d_model", "layers", "heads",
                                           "seq_len", "lengths", "batch", "vocab", "precision", "mem_budget_gb",
                                           "threads")}
    report = {"machine": machine, "settings": settings, "elapsed_s": round(time.time() - t0, 1), "results": entries,
              **extra}
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(report, f, indent=1)
    table = markdown(entries, machine, f"Synthformer benchmarks ({'--quick' if a.quick else 'default sizes'}, "
                                       f"{report['elapsed_s']:.0f} s)")
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(table)
    print(table)
    status = [e["status"] for e in entries]
    failed = [e["id"] for e in entries if e["error"]]
    print(f"goals: {status.count('ok')} ok, {status.count('MISSED')} MISSED; {len(failed)} failed"
          + (f" ({', '.join(failed)})" if failed else "") + f"; wrote {os.path.join(out, 'results.json')} and .md")
    return failed
