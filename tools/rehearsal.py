#!/usr/bin/env python
"""A cluster in miniature, on this machine (`make rehearsal`; not in CI): 8 gloo ranks as 2 "nodes" of 4, each node its
own launch/pretrain.sh under its own supervisor (NNODES=2, NODE_RANK, no ssh), a tiny model, data.num_workers 0, two
blended sources over a local HTTP server. It shows, in order:

  1. a kill -9 of one rank → an automatic relaunch → a bit-exact resume (the replayed steps' losses and samples equal
     the first pass's, every rank);
  2. a hang on rank 5 (SYNTHFORMER_FAULTS stall@8@5) → the stacks and flight-recorder dumps of all 8 ranks, and one
     line that names rank 5, then a relaunch that finishes the run;
  3. a relayout from 8 to 4 ranks (checkpoint.relayout=true from step 6) → the same global batches, step for step;
  4. a data error (source b's shards damaged on the server, same sizes, other content) → no relaunch, exit 2.

    python tools/rehearsal.py [--out build/rehearsal] [--hang-timeout 30]

It prints what it does, a PASS or FAIL per claim, the time taken and the peak resident memory of every process it
started (the budget: 10 minutes and 12 GiB on 2 cores); exit status 0 when all four pass.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
T0 = time.time()


def say(text: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {text}", flush=True)


def tool(name: str, *args) -> None:
    subprocess.run([PY, os.path.join(ROOT, "tools", name), *map(str, args)], check=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": ROOT}, stdout=subprocess.DEVNULL)


def build_data(out: str) -> str:
    """Two shard sets (a: the first 100 kB of Austen, b: the next 60 kB) with one tokenizer; their parent folder."""
    data = os.path.join(out, "data")
    if os.path.exists(os.path.join(data, "b", "manifest.json")):
        return data
    os.makedirs(data, exist_ok=True)
    with gzip.open(os.path.join(ROOT, "data", "austen.txt.gz"), "rt", encoding="utf-8") as f:
        text = f.read(160_000)
    for name, part in (("a", text[:100_000]), ("b", text[100_000:])):
        with open(os.path.join(data, f"{name}.txt"), "w", encoding="utf-8") as f:
            f.write(part)
    tool("train_tokenizer.py", "--input", os.path.join(data, "a.txt"), "--vocab-size", 512, "--out",
         os.path.join(data, "tokenizer.model"), "--quiet")
    for name in ("a", "b"):
        tool("make_shards.py", "--input", os.path.join(data, f"{name}.txt"), "--tokenizer",
             os.path.join(data, "tokenizer.model"), "--out", os.path.join(data, name), "--seq-len", 32,
             "--samples-per-shard", 4, "--val-fraction", 0.05, "--quiet")
    return data


def write_config(path: str, run_dir: str, url: str, hang_timeout: float) -> str:
    import yaml

    cfg = {"model": {"vocab_size": 512, "d_model": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 32,
                     "mixer": "random+dot"},
           "data": {"sources": [{"name": "a", "path": f"{url}/a", "weight": 0.6},
                                {"name": "b", "path": f"{url}/b", "weight": 0.4}], "num_workers": 0, "val_batches": 1},
           "parallel": {"zero_stage": 1},
           "train": {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 3, "global_batch_size": 16, "micro_batch_size": 2,
                     "max_steps": 12, "run_dir": run_dir, "grad_clip": 1.0, "hang_timeout": hang_timeout},
           "checkpoint": {"every": 3, "keep": 10},
           "logging": {"every": 1, "val_every": 0, "image_every": 0, "sample_ids": True}}
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


class Memory:
    """The peak, over time, of the summed resident memory of this process and everything under it."""

    def __init__(self):
        import psutil

        self.psutil, self.peak, self.stop = psutil, 0, False
        self.thread = threading.Thread(target=self.watch, daemon=True)
        self.thread.start()

    def watch(self):
        me = self.psutil.Process()
        while not self.stop:
            total = 0
            for p in [me] + me.children(recursive=True):
                try:
                    total += p.memory_info().rss
                except self.psutil.Error:
                    pass
            self.peak = max(self.peak, total)
            time.sleep(0.5)


class Nodes:
    """The launchers of a job: one launch/pretrain.sh a node, each in its own session, its stderr kept."""

    def __init__(self, out: str, name: str, config: str, nodes: int, per_node: int, *args, env=None):
        """args: the launcher's options (--max-restarts N) and the config's overrides (key=value), in any order."""
        options = [a for a in args if "=" not in a or a.startswith("-")]
        overrides = [a for a in args if "=" in a and not a.startswith("-")]
        port = free_port()
        self.procs, self.errs = [], []
        for node in range(nodes):
            err = open(os.path.join(out, f"{name}.node{node}.err"), "w+")
            log = open(os.path.join(out, f"{name}.node{node}.out"), "w")
            environ = {**os.environ, "PYTHON": PY, "NNODES": str(nodes), "NODE_RANK": str(node),
                       "NPROC": str(per_node), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "RESTART_BACKOFF": "1", "OMP_NUM_THREADS": "1", **(env or {})}
            self.procs.append(subprocess.Popen([os.path.join(ROOT, "launch", "pretrain.sh"), *options, config,
                                               *overrides],
                                               cwd=ROOT, env=environ, stdout=log, stderr=err, text=True,
                                               start_new_session=True))
            self.errs.append(err)

    def rank(self, node: int, local: int):
        """The process of local rank `local` of node `node` (`--local_rank=` of DeepSpeed's launcher)."""
        import psutil

        for p in psutil.Process(self.procs[node].pid).children(recursive=True):
            try:
                args = p.cmdline()
            except psutil.Error:
                continue
            if f"--local_rank={local}" in args and "pretrain.train" in args:
                return p
        return None

    def wait(self, timeout: float) -> list[int]:
        deadline = time.time() + timeout
        for p in self.procs:
            try:
                p.wait(max(1.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        return [p.returncode for p in self.procs]

    def stderr(self) -> list[str]:
        lines = []
        for err in self.errs:
            err.seek(0)
            lines += err.read().splitlines()
        return lines


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def jsonl(path: str) -> list[dict]:
    return [json.loads(line) for line in open(path) if line.strip()] if os.path.exists(path) else []


def logged_step(run: str) -> int:
    return max((r["step"] for r in jsonl(os.path.join(run, "metrics.jsonl")) if "train/loss" in r), default=0)


def replays_agree(run: str, ranks: int) -> tuple[bool, str]:
    """Whether every replayed step gave the first pass's loss and every rank's samples, bit for bit: a resume moves the
    rows of the steps it replays to *.replayed.jsonl, and the replay writes them again."""
    values: dict[int, set] = {}
    for name in ("metrics.replayed.jsonl", "metrics.jsonl"):
        for row in jsonl(os.path.join(run, name)):
            if "train/loss" in row:
                values.setdefault(row["step"], set()).add(row["train/loss"])
    replayed = sorted({r["step"] for r in jsonl(os.path.join(run, "metrics.replayed.jsonl")) if "train/loss" in r})
    differ = [s for s, v in values.items() if len(v) > 1]
    if differ:
        return False, f"steps {differ} gave another loss when replayed"
    for k in range(ranks):
        now, before = ids_by_step(run, [k]), ids_by_step(run, [k], replayed=True)
        for step, ids in before.items():
            passes = len(ids) // max(1, len(now.get(step, [])))
            if sorted(now.get(step, []) * passes) != ids:
                return False, f"rank {k} read other samples when step {step} was replayed"
    return bool(replayed), (f"steps {replayed[0]}-{replayed[-1]} replayed ({len(replayed)}), each with the first "
                            f"pass's loss and the same samples on all {ranks} ranks" if replayed else "nothing replayed")


def ids_by_step(run: str, ranks, replayed: bool = False) -> dict[int, list[str]]:
    """{step: the sorted sample ids the ranks read}: of all ranks, the step's global batch."""
    out: dict[int, list[str]] = {}
    for k in ranks:
        for row in jsonl(os.path.join(run, "sample_ids", f"rank{k}{'.replayed' if replayed else ''}.jsonl")):
            out.setdefault(row["step"], []).extend(row["ids"])
    return {s: sorted(ids) for s, ids in out.items()}


def damage(folder: str) -> int:
    """Overwrite 200 bytes inside every training shard of a shard set: the same sizes, another content."""
    manifest = json.load(open(os.path.join(folder, "manifest.json")))
    names = [s["name"] for s in manifest["splits"]["train"]["shards"]]
    for name in names:
        with open(os.path.join(folder, name), "r+b") as f:
            f.seek(100)
            f.write(bytes(range(200)))
    return len(names)


def wait_until(what, timeout: float, nodes: Nodes, why: str) -> None:
    deadline = time.time() + timeout
    while not what():
        if any(p.poll() is not None for p in nodes.procs):
            raise SystemExit(f"error: a node's launcher ended while waiting for {why}: see its .err file")
        if time.time() > deadline:
            raise SystemExit(f"error: waited {timeout:.0f} s for {why}")
        time.sleep(0.2)


def rehearse(out: str, hang_timeout: float) -> dict[str, tuple[bool, str]]:
    from tools.serve_shards import serve

    data = build_data(out)
    server = serve(data)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    say(f"two sources (a 0.6, b 0.4) served from {data} at {url}")
    results = {}

    # 1 and 2: kill -9 of rank 6, relaunch; rank 5 stalls at step 8, all watchdogs expire, relaunch; done at 12
    run = os.path.join(out, "run")
    config = write_config(os.path.join(out, "run.yaml"), run, url, hang_timeout)
    say("launch: 8 ranks as 2 nodes of 4 (launch/pretrain.sh --max-restarts 3 on each), rank 5 set to stall at step 8")
    job = Nodes(out, "run", config, 2, 4, "--max-restarts", "3", env={"SYNTHFORMER_FAULTS": "stall@8@5"})
    wait_until(lambda: logged_step(run) >= 4, 600, job, "step 4")
    victim = job.rank(1, 2)
    say(f"kill -9 of rank 6 (node 1, local rank 2, pid {victim.pid}) after step {logged_step(run)}")
    victim.send_signal(signal.SIGKILL)
    wait_until(lambda: os.path.exists(os.path.join(run, "hang", "rank5.txt")), 900, job, "rank 5's hang")
    say(f"rank 5 stalled; every rank's watchdog expired after train.hang_timeout={hang_timeout:g} s")
    codes = job.wait(900)
    lines = job.stderr()
    say(f"both nodes' launchers ended: exit statuses {codes}")
    for line in lines:
        if line.startswith(("error: rank 5 hung", "restart ", "error: rank ", "error: the launch")) and \
                "made no progress" not in line.split(";")[0]:
            print(f"    {line[:400]}")
    history = jsonl(os.path.join(run, "logs", "launches.jsonl"))
    relaunched = [h for h in history if h["relaunch"]]
    ok = codes == [0, 0] and any(h["class"] == "lost rank" for h in relaunched)
    agree, words = replays_agree(run, 8)
    results["kill -9 → automatic relaunch → bit-exact resume"] = (ok and agree, words)
    stacks = [k for k in range(8) if os.path.exists(os.path.join(run, "hang", f"rank{k}.txt"))]
    dumps = [k for k in range(8) if os.path.exists(os.path.join(run, "hang", "flight_recorder", f"rank_{k}"))]
    named = sorted({line for line in lines if line.startswith("error: rank 5 hung; ranks 0-4, 6, 7 wait for it")})
    results["hang on rank 5 → stacks of all 8 ranks, one line naming rank 5"] = (
        stacks == dumps == list(range(8)) and len(named) == 1,
        f"stacks of ranks {stacks}, flight-recorder dumps of ranks {dumps}; the line: {named[0][:160] if named else '-'}…")

    # 3: the run's checkpoint of step 6 on 4 ranks (1 node), relaid out: the global batches of steps 7-12
    relaid = os.path.join(out, "relayout")
    shutil.rmtree(relaid, ignore_errors=True)
    shutil.copytree(run, relaid, ignore=shutil.ignore_patterns("hang", "logs", "tensorboard", "faults"))
    for name in os.listdir(os.path.join(relaid, "checkpoints")):
        if name.startswith("step_") and int(name[5:13]) > 6:
            shutil.rmtree(os.path.join(relaid, "checkpoints", name))
    with open(os.path.join(relaid, "checkpoints", "latest"), "w") as f:
        f.write("step_00000006")
    for name in ("metrics.jsonl", "metrics.replayed.jsonl"):
        if os.path.exists(os.path.join(relaid, name)):
            os.remove(os.path.join(relaid, name))
    shutil.rmtree(os.path.join(relaid, "sample_ids"))
    config4 = write_config(os.path.join(out, "relayout.yaml"), relaid, url, hang_timeout)
    say("relayout: the checkpoint of step 6 on 4 ranks (checkpoint.relayout=true), steps 7-12")
    four = Nodes(out, "relayout", config4, 1, 4, "checkpoint.relayout=true")
    codes4 = four.wait(900)
    eight, four_ids = ids_by_step(run, range(8)), ids_by_step(relaid, range(4))
    same = [s for s in range(7, 13) if eight.get(s) and eight.get(s) == four_ids.get(s)]
    losses8 = {r["step"]: r["train/loss"] for r in jsonl(os.path.join(run, "metrics.jsonl")) if "train/loss" in r}
    losses4 = {r["step"]: r["train/loss"] for r in jsonl(os.path.join(relaid, "metrics.jsonl")) if "train/loss" in r}
    worst = max((abs(losses4[s] - losses8[s]) / abs(losses8[s]) for s in same if s in losses4), default=float("nan"))
    results["relayout 8 → 4 ranks → the same global batches"] = (
        codes4 == [0] and same == list(range(7, 13)),
        f"steps {same[0] if same else '-'}-{same[-1] if same else '-'}: the same {len(eight.get(7, []))} samples a "
        f"step on 4 ranks as on 8; losses within {worst:.1e} (relative) of the 8-rank run's")

    # 4: source b's shards damaged on the server: the run continued to step 16 meets them, on some rank
    backup = os.path.join(out, "b-backup")
    shutil.rmtree(backup, ignore_errors=True)
    shutil.copytree(os.path.join(data, "b"), backup)
    try:
        say(f"data error: {damage(os.path.join(data, 'b'))} shards of source b damaged on the server (same sizes); "
            f"the run continued to step 16 with --max-restarts 3")
        bad = Nodes(out, "data-error", config, 2, 4, "--max-restarts", "3", "train.max_steps=16")
        codes_bad = bad.wait(900)
        bad_lines = bad.stderr()
    finally:
        shutil.rmtree(os.path.join(data, "b"))
        shutil.move(backup, os.path.join(data, "b"))
    failed = [line for line in bad_lines if "failed first (config or data error)" in line]
    for line in failed[:1] + [line for line in bad_lines if line.startswith("error: not relaunching")][:1]:
        print(f"    {line[:400]}")
    restarts = [line for line in bad_lines if line.startswith("restart ")]
    results["data error → no relaunch"] = (
        codes_bad == [2, 2] and failed and not restarts,
        f"exit statuses {codes_bad}, {len(restarts)} relaunches")
    server.shutdown()
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(ROOT, "build", "rehearsal"), help="its folder (default "
                                                                                  "build/rehearsal, emptied first)")
    p.add_argument("--hang-timeout", type=float, default=30.0, help="train.hang_timeout of the run (default 30 s)")
    args = p.parse_args(argv)
    for name in os.listdir(args.out) if os.path.isdir(args.out) else []:
        if name != "data":
            path = os.path.join(args.out, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    os.makedirs(args.out, exist_ok=True)
    memory = Memory()
    results = rehearse(args.out, args.hang_timeout)
    memory.stop = True
    print()
    for claim, (ok, words) in results.items():
        print(f"{'PASS' if ok else 'FAIL'}  {claim}: {words}")
    elapsed = time.time() - T0
    print(f"rehearsal: {elapsed / 60:.1f} minutes (budget 10), peak resident memory of all its processes "
          f"{memory.peak / 2**30:.1f} GiB (budget 12); outputs in {args.out}")
    return 0 if all(ok for ok, _ in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
