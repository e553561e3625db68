"""What benchmarks/bench.py does in the parent process with the points its children measure: the served processes it
alternates (ServedPoint), summary statistics over repetitions, ratios with their range, the machine's description
and the markdown table."""
from __future__ import annotations

import json
import os
import platform
import queue
import signal
import statistics
import subprocess
import threading

from benchmarks.bench_lib import READY_MARK, REP_MARK, RESULT_MARK


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
        lines.append(f"| {e['name']} | {e['variant']} | {n} | {fmt_value(e['value'], e['unit'])} | "
                     f"{100 * e['spread']:.1f}% | {ratio} | {e['ratio_to'] or ''} | {e.get('goal') or ''} | "
                     f"{e.get('status') or ''} |")
    notes = [f"- {e['id']}: {e['note']}" for e in entries if e.get("note")]
    notes += [f"- {e['id']}: peak above rest by phase: " + ", ".join(f"{k} {v:,.0f} MB" for k, v in e["phase_mb"].items())
              for e in entries if e["name"] == "memory" and e.get("phase_mb") and e.get("goal")]
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"
