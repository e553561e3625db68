"""A faked SLURM on this machine for launch/slurm.sbatch: `sbatch`, `srun`, `scontrol` and `scancel` on PATH
(`install(tmp)` writes them and returns the environment), over a cluster of CLUSTER's nodes. It rejects what a real
cluster rejects, so that the script's arithmetic is checked as a scheduler would check it:

- sbatch reads the script's `#SBATCH` lines (up to its first command) and then the command line's options, which win
  (`--oversubscribe` undoes `--exclusive`); it refuses a job whose CPUs per task × tasks per node exceed a node's
  CPUs, or that asks for more nodes or GPUs than a node has ("Requested node configuration is not available"); then it
  sets the variables sbatch sets (SLURM_JOB_ID from a counter, SLURM_CPUS_ON_NODE: the whole node with --exclusive,
  else tasks × CPUs per task; SLURM_GPUS_PER_NODE as given; SLURM_GPUS_ON_NODE the count) and runs the script at once,
  in the foreground, its output to sbatch's own (a real sbatch queues it and writes --output). There is no queue:
  every job gets the first nodes of the cluster, as jobs that share nodes do.
- srun starts SLURM_NTASKS tasks (SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID, SLURMD_NODENAME); each task gets the
  CPUs of `--cpus-per-task`, else SRUN_CPUS_PER_TASK, else 1, in its SLURM_CPUS_PER_TASK: Slurm ≥ 22.05 does not
  read the SLURM_CPUS_PER_TASK that sbatch set. It refuses a step whose CPUs per task × tasks per node exceed
  SLURM_CPUS_ON_NODE, and one whose MASTER_PORT another job's step holds on the same node (MASTER_ADDR) while it runs:
  the second job's rendezvous would fail to bind. With --kill-on-bad-exit=1, when one task fails the others are ended
  (SIGTERM, then SIGKILL 5 s later) and srun exits with its status.
- scontrol `show hostnames LIST` expands node[1-2]; every call is appended to <state>/scontrol.calls.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import subprocess
import sys
import time

CLUSTER = {"nodes": 4, "cpus": 192, "gpus": 8, "gpu_type": "h100"}   # 4 nodes of 8 H100 and 192 CPUs
NOT_AVAILABLE = "sbatch: error: Batch job submission failed: Requested node configuration is not available"


class Rejected(Exception):
    """What SLURM answers a request it cannot grant (one line)."""


def install(tmp, first_job: int = 4242) -> dict:
    """Write the fakes into <tmp>/slurm/bin; the environment that puts them first on PATH."""
    state = os.path.join(str(tmp), "slurm")
    os.makedirs(os.path.join(state, "bin"), exist_ok=True)
    with open(os.path.join(state, "next_job_id"), "w") as f:
        f.write(f"{first_job}\n")
    for tool in ("sbatch", "srun", "scontrol", "scancel"):
        path = os.path.join(state, "bin", tool)
        with open(path, "w") as f:
            f.write(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(os.path.abspath(__file__))} {tool} "
                    f"\"$@\"\n")
        os.chmod(path, 0o755)
    return {"PATH": f"{state}/bin:{os.environ['PATH']}", "FAKE_SLURM_STATE": state}


# ---- sbatch ----------------------------------------------------------------------------------------------------------
class Parser(argparse.ArgumentParser):
    def error(self, message):
        raise Rejected(f"sbatch: error: {message}")


def sbatch_parser() -> argparse.ArgumentParser:
    p = Parser(prog="sbatch", allow_abbrev=False, exit_on_error=False, add_help=False)
    for flags, kw in [(("-J", "--job-name"), {}), (("-N", "--nodes"), {"type": int}),
                      (("-n", "--ntasks"), {"type": int}), (("--ntasks-per-node",), {"type": int}),
                      (("-c", "--cpus-per-task"), {"type": int}),
                      (("--gpus-per-node",), {}), (("--gres",), {}), (("-t", "--time"), {}), (("--signal",), {}),
                      (("--open-mode",), {"choices": ["append", "truncate"]}), (("-o", "--output"), {}),
                      (("-e", "--error"), {}), (("-p", "--partition"), {}), (("-A", "--account"), {}),
                      (("--mem",), {}), (("-D", "--chdir"), {}), (("--export",), {})]:
        p.add_argument(*flags, **kw)
    p.add_argument("--exclusive", dest="shared", nargs="?", const="exclusive")
    p.add_argument("-s", "--oversubscribe", dest="shared", action="store_const", const="oversubscribe")
    p.add_argument("--requeue", dest="requeue", action="store_const", const=True)
    p.add_argument("--no-requeue", dest="requeue", action="store_const", const=False)
    return p


def parse_options(words: list[str], script: bool) -> tuple[dict, list[str]]:
    """(the options given, as {dest: value}; the script and its arguments, on the command line)."""
    p = sbatch_parser()
    if not script:
        p.add_argument("script")
        p.add_argument("args", nargs=argparse.REMAINDER)
    try:
        ns = p.parse_args(words)
    except argparse.ArgumentError as e:
        raise Rejected(f"sbatch: error: {e}") from None
    given = {k: v for k, v in vars(ns).items() if v is not None and k not in ("script", "args")}
    return given, ([ns.script, *ns.args] if not script else [])


def sbatch_lines(path: str) -> list[str]:
    """The options of the script's #SBATCH lines, up to its first command."""
    words = []
    for line in open(path).read().splitlines()[1:]:
        text = line.strip()
        if text.startswith("#SBATCH"):
            words += shlex.split(text[len("#SBATCH"):], comments=True)
        elif text and not text.startswith("#"):
            break
    return words


def request(argv: list[str], cwd: str = ".") -> tuple[dict, list[str]]:
    """The job `sbatch ARGV` (run in `cwd`) asks for (the script's #SBATCH options, the command line's winning) and
    the script with its arguments."""
    given, script = parse_options(argv, script=False)
    path = os.path.join(cwd, script[0])
    if not os.path.isfile(path):
        raise Rejected(f"sbatch: error: Unable to open file {script[0]}")
    options, _ = parse_options(sbatch_lines(path), script=True)
    return {**options, **given}, script


def gpu_count(value: str, option: str) -> int:
    """`[type:]count` (--gpus-per-node) or `gpu[:type]:count` (--gres) of the cluster's GPUs."""
    *kind, count = value.split(":")
    if not count.isdigit() or any(k not in ("gpu", CLUSTER["gpu_type"]) for k in kind) or \
            (option == "--gres" and kind[:1] != ["gpu"]):
        raise Rejected(f"sbatch: error: Invalid generic resource (gres) specification: {option}={value}")
    return int(count)


def allocate(job: dict, job_id: int) -> dict:
    """The SLURM_* variables of the job's batch script; Rejected where the cluster cannot grant it."""
    nodes = job.get("nodes", 1)
    per_node = job.get("ntasks_per_node") or -(-job.get("ntasks", nodes) // nodes)
    cpus_per_task = job.get("cpus_per_task", 1)
    gpus = gpu_count(job["gpus_per_node"], "--gpus-per-node") if "gpus_per_node" in job else \
        gpu_count(job["gres"], "--gres") if "gres" in job else 0
    if nodes > CLUSTER["nodes"] or gpus > CLUSTER["gpus"] or per_node * cpus_per_task > CLUSTER["cpus"]:
        raise Rejected(NOT_AVAILABLE)
    cpus_on_node = CLUSTER["cpus"] if job.get("shared") == "exclusive" else per_node * cpus_per_task
    names = f"node[1-{nodes}]" if nodes > 1 else "node1"
    env = {"SLURM_JOB_ID": str(job_id), "SLURM_JOBID": str(job_id), "SLURM_JOB_NAME": job.get("job_name", "sbatch"),
           "SLURM_JOB_NODELIST": names, "SLURM_NODELIST": names, "SLURM_NNODES": str(nodes),
           "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_NTASKS": str(nodes * per_node),
           "SLURM_TASKS_PER_NODE": f"{per_node}(x{nodes})" if nodes > 1 else str(per_node),
           "SLURM_CPUS_ON_NODE": str(cpus_on_node),
           "SLURM_JOB_CPUS_PER_NODE": f"{cpus_on_node}(x{nodes})" if nodes > 1 else str(cpus_on_node),
           "SLURM_SUBMIT_DIR": os.getcwd(), "SLURMD_NODENAME": "node1"}
    if "ntasks_per_node" in job:
        env["SLURM_NTASKS_PER_NODE"] = str(per_node)
    if "cpus_per_task" in job:
        env["SLURM_CPUS_PER_TASK"] = str(cpus_per_task)
    if "gpus_per_node" in job:
        env["SLURM_GPUS_PER_NODE"] = job["gpus_per_node"]
    if gpus:
        env["SLURM_GPUS_ON_NODE"] = str(gpus)
    return env


def sbatch(argv: list[str]) -> int:
    try:
        job, script = request(argv)
        state = os.environ["FAKE_SLURM_STATE"]
        job_id = int(open(os.path.join(state, "next_job_id")).read())
        with open(os.path.join(state, "next_job_id"), "w") as f:
            f.write(f"{job_id + 1}\n")
        env = allocate(job, job_id)
    except Rejected as e:
        print(e, file=sys.stderr)
        return 1
    print(f"Submitted batch job {job_id}", flush=True)
    return subprocess.run(["bash", *script], env={**os.environ, **env}).returncode


# ---- srun ------------------------------------------------------------------------------------------------------------
def srun(argv: list[str]) -> int:
    options = {}
    while argv and argv[0].startswith("-"):
        word = argv.pop(0)
        key, eq, value = word.lstrip("-").partition("=")
        options[key] = value if eq else argv.pop(0) if key in ("cpus-per-task", "ntasks", "ntasks-per-node") else "1"
    env = os.environ
    job = env["SLURM_JOB_ID"]
    n = int(options.get("ntasks", env["SLURM_NTASKS"]))
    per_node = int(options.get("ntasks-per-node", env.get("SLURM_NTASKS_PER_NODE", 1)))
    cpus = int(options.get("cpus-per-task", env.get("SRUN_CPUS_PER_TASK", 1)))
    on_node = int(env.get("SLURM_CPUS_ON_NODE", 0))
    if on_node and cpus * per_node > on_node:
        print(f"srun: error: Unable to create step for job {job}: More processors requested than permitted "
              f"({per_node} tasks × {cpus} CPUs on a node of {on_node})", file=sys.stderr)
        return 1
    held = hold_port(job, env.get("MASTER_ADDR", "node1"), env.get("MASTER_PORT"))
    if held is False:
        return 1
    try:
        return run_tasks(argv, n, per_node, cpus, options.get("kill-on-bad-exit") == "1")
    finally:
        if held:
            os.unlink(held)


def hold_port(job: str, node: str, port: str | None):
    """The file that holds `port` on `node` for this job's step (None: no port; False: another job holds it)."""
    if not port:
        return None
    ports = os.path.join(os.environ["FAKE_SLURM_STATE"], "ports")
    os.makedirs(ports, exist_ok=True)
    path = os.path.join(ports, f"{node}:{port}")
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        print(f"srun: error: job {job}: MASTER_PORT {port} on {node} is held by job {open(path).read()}'s step: the "
              f"rendezvous cannot bind it (Address already in use)", file=sys.stderr)
        return False
    os.write(fd, job.encode())
    os.close(fd)
    return path


def run_tasks(command: list[str], n: int, per_node: int, cpus: int, kill_on_bad_exit: bool) -> int:
    procs = [subprocess.Popen(command, env={**os.environ, "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i % per_node),
                                            "SLURM_NODEID": str(i // per_node), "SLURM_CPUS_PER_TASK": str(cpus),
                                            "SLURMD_NODENAME": f"node{i // per_node + 1}"}, start_new_session=True)
             for i in range(n)]
    status = 0
    while any(p.poll() is None for p in procs) and not (status and kill_on_bad_exit):
        status = next((p.returncode for p in procs if p.returncode), 0)
        time.sleep(0.05)
    status = status or next((p.returncode for p in procs if p.returncode), 0)
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.time() + 5
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
    return status


# ---- scontrol, scancel -----------------------------------------------------------------------------------------------
def hostnames(names: str) -> list[str]:
    out = []
    for prefix, ranges, single in re.findall(r"([^,\[]+)\[([^\]]+)\]|([^,]+)", names):
        if single:
            out.append(single)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            out += [f"{prefix}{i:0{len(lo)}d}" for i in range(int(lo), int(hi or lo) + 1)]
    return out


def scontrol(argv: list[str]) -> int:
    with open(os.path.join(os.environ["FAKE_SLURM_STATE"], "scontrol.calls"), "a") as f:
        f.write(" ".join(argv) + "\n")
    if argv[:2] == ["show", "hostnames"]:
        print("\n".join(hostnames(argv[2])))
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)   # `scontrol show hostnames … | head -n 1`, as a real one
    tool, args = sys.argv[1], sys.argv[2:]
    sys.exit({"sbatch": sbatch, "srun": srun, "scontrol": scontrol, "scancel": lambda _: 0}[tool](args))
