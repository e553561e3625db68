"""The parent's side of a benchmarks/bench.py point: each point's world of `bench.py _one SPEC` processes (one rank
each, the launcher's environment), started afresh so that no two points share allocator state, and rank 0's result
read back (`run_point`); the throughput and peer points alternated with one live process of our dot model
(`run_paired`)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from benchmarks.bench_lib import RESULT_MARK
from benchmarks.bench_report import PointFailed, ServedPoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks", "bench.py")


def rank_env(spec: dict) -> list[dict]:
    """The launcher's environment of each rank of spec's world (a free local port for the process group)."""
    from pretrain.distributed import free_local_port

    port = free_local_port()
    world = spec["world"]
    env = {**os.environ, "PYTHONPATH": ROOT, "WORLD_SIZE": str(world), "LOCAL_SIZE": str(world),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **spec["env"]}
    return [{**env, "RANK": str(r), "LOCAL_RANK": str(r)} for r in range(world)]


def one(spec: dict) -> list[str]:
    return [sys.executable, BENCH, "_one", json.dumps(spec)]


PORT_TAKEN = "EADDRINUSE"   # the rendezvous port was taken between its pick and its listen (by another job's socket)


def retried_on_port_race(start, attempts: int = 3):
    """start() (which picks a fresh free port each time) again when the process group could not listen on its port:
    a free port is only free when picked, and the host's other processes may bind it before the rank does."""
    for attempt in range(1, attempts + 1):
        try:
            result = start()
        except PointFailed as e:
            if PORT_TAKEN in str(e) and attempt < attempts:
                continue
            raise
        if PORT_TAKEN in str(result.get("error") if isinstance(result, dict) else "") and attempt < attempts:
            continue
        return result


def run_point(spec: dict, timeout: float) -> dict:
    """Start spec's world of `_one` processes (one rank each, the launcher's environment) and read rank 0's result;
    again with another port if the first was taken."""
    return retried_on_port_race(lambda: run_point_once(spec, timeout))


def run_point_once(spec: dict, timeout: float) -> dict:
    envs = rank_env(spec)
    logs = [tempfile.TemporaryFile("w+") for _ in envs]   # files, not pipes: no rank blocks on a full pipe
    procs = [subprocess.Popen(one(spec), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True) for env, log in zip(envs, logs)]
    deadline, error = time.time() + timeout, None
    try:
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        error = f"timeout after {timeout:g} s"
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    texts = []
    for log in logs:
        log.seek(0)
        texts.append(log.read())
    results = [next((json.loads(line[len(RESULT_MARK):]) for line in reversed(text.splitlines())
                     if line.startswith(RESULT_MARK)), None) for text in texts]
    if results[0] is not None and error is None:
        return {**results[0], "by_rank": results} if len(results) > 1 else results[0]
    failed = next((t for p, t in zip(procs, texts) if p.returncode), texts[0])
    return {"error": error or (failed.strip().splitlines() or ["failed without output"])[-1][-300:]}


def run_paired(reference: dict, others: list[tuple[str, dict]], timeout: float, done) -> dict:
    """Measure each of `others` in turn alternately with one live process of `reference`: repetition r of a point
    runs next to one of the reference (ABBA order: the reference first on even r), so both see the same machine.
    {key: result, "reference": result}; a paired point's result has `paired_rate`, the reference's rates next to
    its repetitions. `done(key)` after each point (progress)."""
    def serve(spec):
        return retried_on_port_race(lambda: ServedPoint(one({**spec, "serve": True}), rank_env(spec)[0], ROOT, timeout))

    try:
        ref = serve(reference)
    except PointFailed as e:
        return {key: {"error": f"the reference (dot) point failed: {e}"} for key, _ in others + [("reference", 0)]}
    results = {}
    for key, spec in others:
        other = None
        try:
            other, paired = serve(spec), []
            for r in range(spec["reps"]):
                pair = (ref, other) if r % 2 == 0 else (other, ref)
                rates = [point.rep() for point in pair]
                paired.append(rates[0] if r % 2 == 0 else rates[1])
            results[key] = {**other.finish(), "paired_rate": paired}
        except PointFailed as e:
            results[key] = {"error": str(e)}
            if other is not None:
                other.kill()
        done(key)
    try:
        for _ in range(0 if others else reference["reps"]):
            ref.rep()
        results["reference"] = ref.finish()
    except PointFailed as e:
        results["reference"] = {"error": str(e)}
    return results
