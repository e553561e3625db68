"""launch/slurm.sbatch as a cluster runs it, per node and per GPU, under the faked SLURM of tests/support/fake_slurm.py
(sbatch reads the script's #SBATCH lines; srun checks the step against the node): the CPUs a task gets, the port two
jobs on one node use, and the ranks a node starts for each way SLURM writes SLURM_GPUS_PER_NODE. The ranks are played
by a launch/pretrain.sh in the submit directory that records what it was given (no training starts); the config check
(`$PYTHON -m pretrain.config … --world-size N --run-dir`) is played by a PYTHON that records its arguments."""
import os
import subprocess
import time

import pytest

from tests.support import fake_slurm
from tests.support.runs import ROOT

SBATCH_SCRIPT = os.path.join(ROOT, "launch", "slurm.sbatch")
RANK = """\
#!/bin/sh
echo "node=$SLURM_NODEID task=$SLURM_PROCID cpus=$SLURM_CPUS_PER_TASK port=$MASTER_PORT rank=${RANK:-} \
local=${LOCAL_RANK:-} world=${WORLD_SIZE:-} nnodes=${NNODES:-} nproc=${NPROC:-} node_rank=${NODE_RANK:-}" >> RECORD
while [ -n "${HOLD:-}" ] && [ ! -e "$HOLD" ]; do sleep 0.05; done
"""


@pytest.fixture
def cluster(tmp_path):
    """(submit directory, environment): sbatch from there runs launch/slurm.sbatch on the faked cluster."""
    submit = tmp_path / "submit"
    (submit / "launch").mkdir(parents=True)
    rank = submit / "launch" / "pretrain.sh"
    rank.write_text(RANK.replace("RECORD", str(tmp_path / "ranks")))
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\necho \"$*\" >> {tmp_path}/python.calls\n"
                      f"case \"$*\" in *--classify*) echo 'the fake verdict'; exit 1 ;;\n"
                      f"  *--world-size*) [ -z \"$CHECK_EXIT\" ] || exit \"$CHECK_EXIT\" ;; esac\n"
                      f"echo {tmp_path}/run\n")
    for path in (rank, python):
        path.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_"))}
    return submit, {**env, **fake_slurm.install(tmp_path), "PYTHON": str(python), "PYTHONPATH": ROOT}


def sbatch(cluster, *options, env=None, wait=True):
    submit, base = cluster
    command = ["sbatch", *options, SBATCH_SCRIPT, os.path.join(ROOT, "configs", "demo-cpu.yaml")]
    p = subprocess.Popen(command, cwd=submit, env={**base, **(env or {})}, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    if not wait:
        return p
    out, err = p.communicate(timeout=60)
    return subprocess.CompletedProcess(command, p.returncode, out, err)


def ranks(tmp_path) -> list[dict]:
    rows = [dict(w.split("=", 1) for w in line.split()) for line in open(tmp_path / "ranks").read().splitlines()]
    os.unlink(tmp_path / "ranks")
    return sorted(rows, key=lambda r: int(r["task"]))


def world_sizes(tmp_path) -> list[int]:
    calls = [line.split() for line in open(tmp_path / "python.calls").read().splitlines() if "--world-size" in line]
    os.unlink(tmp_path / "python.calls")
    return [int(c[c.index("--world-size") + 1]) for c in calls]


def test_the_fake_refuses_what_a_cluster_refuses(cluster, tmp_path):
    """Before it is trusted with the script: more CPUs than a node has, asked of sbatch or of srun, is refused."""
    r = sbatch(cluster, "--ntasks-per-node=8", "--cpus-per-task=64")
    assert r.returncode == 1 and r.stderr.strip() == fake_slurm.NOT_AVAILABLE, r.stderr
    r = subprocess.run(["srun", "--cpus-per-task=48", "true"], env={**cluster[1], "SLURM_JOB_ID": "7",
                       "SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "8", "SLURM_CPUS_ON_NODE": "192"},
                       capture_output=True, text=True)
    assert r.returncode == 1 and "More processors requested than permitted" in r.stderr, r.stderr


def test_each_task_gets_its_share_of_the_node_s_cpus(cluster, tmp_path):
    """One task a GPU: 8 tasks a node share its 192 CPUs, 24 each, passed to srun (which does not read the
    SLURM_CPUS_PER_TASK sbatch set); one task a node: the task has all 192 for the node's launcher and its ranks."""
    r = sbatch(cluster, "--nodes=2", "--ntasks-per-node=8")
    assert r.returncode == 0, r.stdout + r.stderr
    assert [row["cpus"] for row in ranks(tmp_path)] == ["24"] * 16
    r = sbatch(cluster, "--nodes=2")
    assert r.returncode == 0, r.stdout + r.stderr
    assert [row["cpus"] for row in ranks(tmp_path)] == ["192"] * 2


def test_two_jobs_on_one_node_listen_on_different_ports(cluster, tmp_path):
    """Two single-node jobs that share a node (--oversubscribe, or a partition that shares): while the first job's
    ranks run, the second's start, on another port (from the job id)."""
    first = sbatch(cluster, "--oversubscribe", "--gpus-per-node=4", env={"HOLD": str(tmp_path / "release")},
                   wait=False)
    try:
        deadline, held = time.time() + 30, tmp_path / "slurm" / "ports"
        while not (held.exists() and os.listdir(held)):   # the first job's step holds its port
            assert first.poll() is None and time.time() < deadline, first.communicate()
            time.sleep(0.05)
        second = sbatch(cluster, "--oversubscribe", "--gpus-per-node=4")
        assert second.returncode == 0, second.stderr
    finally:
        (tmp_path / "release").touch()
        out, err = first.communicate(timeout=60)
    assert first.returncode == 0, out + err
    ports = {row["port"] for row in ranks(tmp_path)}
    assert len(ports) == 2 and all(10000 <= int(p) < 30000 for p in ports), ports


@pytest.mark.parametrize("per_gpu", [False, True], ids=["one-task-a-node", "one-task-a-gpu"])
def test_every_form_of_slurm_gpus_per_node_gives_8_ranks_a_node(cluster, tmp_path, per_gpu):
    """SLURM_GPUS_PER_NODE as SLURM writes it: `8`, `h100:8` (a type), `gpu:h100:8`; and unset under --gres, where
    SLURM_GPUS_ON_NODE counts them. On 2 nodes each gives 16 ranks, 8 a node: the node's launcher starts 8 (NPROC), or
    srun starts 8 tasks a node."""
    for form in ("--gpus-per-node=8", "--gpus-per-node=h100:8", "--gpus-per-node=gpu:h100:8", "--gres=gpu:h100:8"):
        r = sbatch(cluster, "--nodes=2", form, *(["--ntasks-per-node=8"] if per_gpu else []))
        assert r.returncode == 0, f"{form}: {r.stderr}"
        rows = ranks(tmp_path)
        assert world_sizes(tmp_path) == [16], form   # the config is checked for 16 ranks
        if per_gpu:
            assert [(r["node"], r["rank"], r["local"], r["world"]) for r in rows] == \
                [(str(i // 8), str(i), str(i % 8), "16") for i in range(16)], form
        else:
            assert [(r["node_rank"], r["nnodes"], r["nproc"]) for r in rows] == [("0", "2", "8"), ("1", "2", "8")], form


def test_an_outage_at_the_check_requeues_the_job_and_the_verdict_reads_the_launch_s_mark(cluster, tmp_path):
    """The check before the launch exits 6 (the data's server is out): the job is requeued, no step starts (before:
    exit 2, never requeued). A failed step's verdict reads the records after the mark taken before srun (before: a
    time compared with other nodes' clocks, --since)."""
    r = sbatch(cluster, "--nodes=1", env={"CHECK_EXIT": "6"})
    requeues = open(tmp_path / "slurm" / "scontrol.calls").read()
    assert r.returncode == 6 and "requeue" in requeues and "requeueing" in r.stdout, (r.stdout, r.stderr)
    assert not os.path.exists(tmp_path / "ranks")
    r = sbatch(cluster, "--nodes=1", env={"CHECK_EXIT": "2"})
    assert r.returncode == 2 and "requeue" not in open(tmp_path / "slurm" / "scontrol.calls").read().replace(
        requeues, "", 1)
    os.unlink(tmp_path / "python.calls")
    (tmp_path / "submit" / "launch" / "pretrain.sh").write_text("#!/bin/sh\nexit 3\n")
    r = sbatch(cluster, "--nodes=1")
    calls = open(tmp_path / "python.calls").read().splitlines()
    mark = [c.split()[c.split().index("--mark") + 1] for c in calls if "--mark" in c and "--classify" not in c]
    verdict = [c for c in calls if "--classify" in c]
    assert len(mark) == 1 and len(verdict) == 1 and f"--mark {mark[0]}" in verdict[0] and "--since" not in verdict[0]
