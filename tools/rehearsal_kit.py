"""The pieces of the rehearsal (tools/rehearsal.py, tools/rehearsal_cases.py): its data and shard server, its
configs and runs, the launchers of its "nodes", and the comparisons of what its runs logged."""
from __future__ import annotations

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

    def __init__(self, out: str, name: str, config: str, nodes: int, per_node: int, *args, env=None, named=False):
        """args: the launcher's options (--max-restarts N) and the config's overrides (key=value), in any order.
        named: each node's ranks and supervisor go by the name node<i> (SYNTHFORMER_NODE), not the machine's."""
        options = [a for a in args if "=" not in a or a.startswith("-")]
        overrides = [a for a in args if "=" in a and not a.startswith("-")]
        port = free_port()
        self.procs, self.errs = [], []
        for node in range(nodes):
            err = open(os.path.join(out, f"{name}.node{node}.err"), "w+")
            log = open(os.path.join(out, f"{name}.node{node}.out"), "w")
            environ = {**os.environ, "PYTHON": PY, "NNODES": str(nodes), "NODE_RANK": str(node),
                       "NPROC": str(per_node), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "RESTART_BACKOFF": "1", "OMP_NUM_THREADS": "1", **(env or {}),
                       **({"SYNTHFORMER_NODE": f"node{node}"} if named else {})}   # its name: pretrain/node.py
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

    def processes(self) -> list:
        """Every process of the job: each node's supervisor (launch/pretrain.sh execs it), its launcher, the ranks and
        their DataLoader workers."""
        import psutil

        found = []
        for proc in self.procs:
            try:
                root = psutil.Process(proc.pid)
                found += [root] + root.children(recursive=True)
            except psutil.Error:
                pass
        return found

    def signal_all(self, signum: int) -> int:
        """`signum` to every process of the job, once each (as SLURM signals every process of a job step); how many."""
        import psutil

        sent = 0
        for p in self.processes():
            try:
                p.send_signal(signum)
                sent += 1
            except psutil.Error:
                pass
        return sent

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




class Shards:
    """The local HTTP server of the shard sets, which can go down (its socket closed: connections are refused) and
    come back on the same port."""

    def __init__(self, data: str):
        from tools.serve_shards import serve

        self.serve, self.data, self.server = serve, data, None
        self.start(0)
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self, port: int) -> None:
        self.server = self.serve(self.data, port=port)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    def restart(self) -> None:
        self.start(self.port)


def fork_run(run: str, to: str, step: int) -> str:
    """A copy of run `run` as it was after the checkpoint of `step`: its checkpoints up to it, `latest` naming it, no
    metrics, sample ids, logs, hang dumps or fault markers (a run of its own that resumes there)."""
    shutil.rmtree(to, ignore_errors=True)
    shutil.copytree(run, to, ignore=shutil.ignore_patterns("hang", "logs", "tensorboard", "faults", "sample_ids",
                                                           "metrics*.jsonl"))
    for name in os.listdir(os.path.join(to, "checkpoints")):
        if name.startswith("step_") and (not name[5:13].isdigit() or int(name[5:13]) > step):
            shutil.rmtree(os.path.join(to, "checkpoints", name))
    with open(os.path.join(to, "checkpoints", "latest"), "w") as f:
        f.write(f"step_{step:08d}")
    return to


def losses(run: str) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in jsonl(os.path.join(run, "metrics.jsonl")) if "train/loss" in r}


def same_as(run: str, reference: str, steps: range, ranks: int) -> tuple[bool, str]:
    """Whether the steps of `run` gave `reference`'s losses, bit for bit, and read its global batches."""
    mine, theirs = losses(run), losses(reference)
    ids, ref_ids = ids_by_step(run, range(ranks)), ids_by_step(reference, range(ranks))
    differ = [s for s in steps if s not in mine or mine[s] != theirs.get(s)]
    other = [s for s in steps if not ids.get(s) or ids.get(s) != ref_ids.get(s)]
    if differ or other:
        return False, f"steps {differ} gave other losses (or none), steps {other} read other samples"
    return True, (f"steps {steps[0]}-{steps[-1]}: the losses of the uninterrupted pass, bit for bit, and its global "
                  f"batches")


def last_records(run: str, ranks: int) -> dict[int, dict]:
    """{rank: its last failure record} (classes.py), of the ranks that left one."""
    out = {}
    for k in range(ranks):
        rows = jsonl(os.path.join(run, "logs", f"rank{k}.exits.jsonl"))
        if rows:
            out[k] = rows[-1]
    return out


def board(run: str) -> list[dict]:
    """The lines of the run's board (pretrain/supervision/nodes.py): failures and ended launches, of every node."""
    return whole_lines(os.path.join(run, "logs", "nodes.jsonl"))


def verdicts(run: str) -> list[dict]:
    """The run's history: every node's verdict on each launch (logs/launches.jsonl)."""
    return whole_lines(os.path.join(run, "logs", "launches.jsonl"))


def whole_lines(path: str) -> list[dict]:
    """The JSON lines of a file that others append to as it is read: a line not yet whole is left for later."""
    if not os.path.exists(path):
        return []
    with open(path, "rb") as f:
        data = f.read()
    out = []
    for line in data[:data.rfind(b"\n") + 1].decode(errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out
