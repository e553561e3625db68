"""The nodes of a multi-node run, each with its own supervisor (pretrain/supervision/relaunch.py, nodes.py), played by
small fake launchers on this machine (no training rank: seconds): a failure on one node stops the other node's
launcher and both relaunch together; a rank on a node the supervisor's environment does not reach takes the launch's
number from the run directory; a launch's records are known by their place, not by the clock of the node that wrote
them."""
import json
import os
import signal
import subprocess
import textwrap
import time

import pytest

from tests.support.runs import PY, ROOT, run_py

SUPERVISE = [PY, "-m", "pretrain.supervision"]
SCRUBBED = ("SYNTHFORMER_RESTARTS", "SYNTHFORMER_RESTART_CAUSE", "SLURM_RESTART_COUNT")


def env(**more):
    return {**{k: v for k, v in os.environ.items() if k not in SCRUBBED}, "PYTHONPATH": ROOT, **more}


def script(tmp_path, name, body):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


NODE = """\
    import os, sys, time
    from pretrain.supervision import classes, nodes
    node, run = int(sys.argv[1]), sys.argv[2]
    restart = int(os.environ["SYNTHFORMER_RESTARTS"])
    with open(os.path.join(os.path.dirname(run), f"starts{node}"), "a") as f:
        f.write(f"{restart} {time.time()}\\n")
    if restart == 0 and node == 0:   # rank 1 fails as a rank does: its record, and a line on the run's board
        line = "RuntimeError: CUDA error: an illegal memory access was encountered"
        classes.write(run, classes.Ending(1, "unknown", line, 7, restart))
        nodes.tell(run, restart, "failed", rank=1, cls="unknown", line=line)
        sys.exit(1)
    if restart == 0:                 # node 1's ranks wait for rank 1 in a collective: hang_timeout, 30 minutes
        time.sleep(600)
    for rank in (2 * node, 2 * node + 1):
        classes.write(run, classes.Ending(rank, "done", "trained to step 9", 9, restart))
    """


EARLIER_JOB = [   # an earlier job in the same run directory, killed with SIGKILL (no "closed" lines): its rank 3 failed
    {"restart": 0, "event": "joined", "node": 0, "host": "a", "id": "a.1"},
    {"restart": 0, "event": "joined", "node": 1, "host": "b", "id": "b.1"},
    {"restart": 0, "event": "failed", "rank": 3, "host": "b", "cls": "unknown", "line": "an earlier job's failure"},
    {"restart": 0, "event": "ended", "node": 1, "host": "b", "status": 1, "stopped": False},
    {"restart": 0, "event": "ended", "node": 0, "host": "a", "status": 1, "stopped": True},
]


def ended(run, node):
    lines = (json.loads(line) for line in (run / "logs" / "nodes.jsonl").read_text().splitlines())
    return [line for line in lines if line["event"] == "ended" and line.get("node") == node]


@pytest.mark.parametrize("late", [False, True], ids=["together", "node-1-late"])
def test_a_failure_on_one_node_stops_the_other_node_s_launcher_and_both_relaunch_together(tmp_path, late):
    """Two nodes of 2 ranks, a supervisor each (as launch/pretrain.sh starts them with NNODES=2): rank 1 on node 0
    fails, node 1's ranks would wait in a collective. Node 1's supervisor stops its launcher within its poll and grace,
    both judge the same records (rank 1's error), and launch 1 starts on both within a second of each other. Late: node
    1's supervisor starts only once node 0's first launch has failed and ended, and still reads that failure; neither
    reads the earlier job's lines on the board."""
    run, fake = tmp_path / "run", script(tmp_path, "node.py", NODE)
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "nodes.jsonl").write_text("".join(json.dumps(line) + "\n" for line in EARLIER_JOB))

    def supervise(n):
        return subprocess.Popen(SUPERVISE + ["--max-restarts", "1", "--backoff", "0.5", "--run-dir", str(run),
                                             "--nodes", "2", "--node-rank", str(n), "--stop-grace", "1", "--",
                                             PY, fake, str(n), str(run)],
                                cwd=ROOT, env=env(), stderr=subprocess.PIPE, text=True)

    procs = [supervise(0)]
    deadline = time.time() + 30
    while late and len(ended(run, node=0)) < 2:   # the earlier job's, and this job's first launch on node 0
        assert time.time() < deadline and procs[0].poll() is None
        time.sleep(0.05)
    procs.append(supervise(1))
    try:
        errs = [p.communicate(timeout=60)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], errs
    starts = [dict(line.split() for line in (tmp_path / f"starts{n}").read_text().splitlines()) for n in (0, 1)]
    assert float(starts[1]["1"]) - float(starts[1]["0"]) < 2 + 1 + 0.5 + 3, starts   # poll, grace, backoff, slack
    assert abs(float(starts[0]["1"]) - float(starts[1]["1"])) < 1, starts
    assert "node 1: rank 1 on " in errs[1] and "failed (unknown): RuntimeError: CUDA error" in errs[1], errs[1]
    for err in errs:
        assert ("error: rank 1 failed first (unknown): RuntimeError: CUDA error: an illegal memory access was "
                "encountered" in err), err
        assert "restart 1 of at most 1 in 0.5 s" in err, err
        assert "earlier job" not in err, err
    board = [json.loads(line) for line in (run / "logs" / "nodes.jsonl").read_text().splitlines()]
    assert sorted(line["node"] for line in board if line["event"] == "closed") == [0, 1], board


RANK = """\
    import sys, time
    from types import SimpleNamespace
    from pretrain.supervision import rank as supervised

    class Log:
        def event(self, step, scalars, texts):
            print("event", scalars, texts)

        def info(self, line):
            print(line)

    class Trainer:
        step, stopped_by, stop_reason, layout = 5, None, None, None

        def train(self):   # what supervise() does on global rank 0, then steps until a stop
            supervised.log_restart(Log(), self.step, sys.argv[1])
            supervised.watch_stop(self, sys.argv[1], every=0.05)
            deadline = time.time() + 30
            while self.stop_reason is None and time.time() < deadline:
                time.sleep(0.05)
            self.stopped_by = self.stop_reason

        def close(self):
            pass

    cfg = SimpleNamespace(train=SimpleNamespace(run_dir=sys.argv[1]))
    sys.exit(supervised.run_rank(lambda: cfg, lambda cfg: Trainer()))
    """


def test_a_rank_the_supervisor_s_environment_does_not_reach_takes_the_launch_and_a_stop_from_the_run_dir(tmp_path):
    """DeepSpeed over ssh (HOSTFILE) passes the ranks none of the supervisor's SYNTHFORMER_* variables, and they are
    not its processes. The supervisor's third launch (restart 2, after a hang) runs; it is preempted (SIGTERM): its
    launcher ignores that, and a rank started without those variables, as pdsh starts it, takes launch 2, its cause
    and the stop from the run directory: it stops as preempted, its record read as launch 2's, and all exit 0."""
    run = tmp_path / "run"
    waiter = script(tmp_path, "launcher.py", f"""\
        import os, sys, time
        open({str(tmp_path / "started")!r}, "w").close()
        deadline = time.time() + 60   # the rank on the other node ends
        while not os.path.exists({str(run / "logs" / "rank0.exits.jsonl")!r}) and time.time() < deadline:
            time.sleep(0.05)
        """)
    cause = "rank 3 hung; ranks 0-2 wait for it in a collective"
    supervisor = subprocess.Popen(SUPERVISE + ["--run-dir", str(run), "--", PY, waiter], cwd=ROOT, text=True,
                                  env=env(SYNTHFORMER_RESTARTS="2", SYNTHFORMER_RESTART_CAUSE=cause),
                                  stderr=subprocess.PIPE)
    deadline = time.time() + 60
    while not (tmp_path / "started").exists():
        assert time.time() < deadline and supervisor.poll() is None, supervisor.stderr.read()
        time.sleep(0.05)
    supervisor.send_signal(signal.SIGTERM)
    r = run_py([PY, script(tmp_path, "rank.py", RANK), str(run)], env=env(RANK="0"))
    records = [json.loads(line) for line in (run / "logs" / "rank0.exits.jsonl").read_text().splitlines()]
    assert [(e["restart"], e["cls"]) for e in records] == [(2, "preempted")], r.stdout + r.stderr
    assert records[0]["line"] == "stopped at step 5 (SIGTERM to the supervisor)"
    assert f"restart 2 of this run, resumed at step 5, after: {cause}" in r.stdout, r.stdout
    assert supervisor.wait(timeout=60) == 0, supervisor.stderr.read()   # its launcher went on to the end
    assert not (run / "logs" / "launch.json").exists()   # withdrawn: a rank started later takes no old number


def test_a_launch_s_records_are_known_by_their_place_not_by_the_clock_of_their_node(tmp_path):
    """Node clocks disagree: an earlier run's record (launch 0 too) from a node an hour ahead, then this launch's from
    a node an hour behind. The supervisor reads this launch's (rank 1's error), not the earlier run's, and so does
    --classify after --mark, as a SLURM job would run them around its step."""
    from pretrain.supervision.classes import Ending, write

    run, now = tmp_path / "run", time.time()
    write(str(run), Ending(0, "config or data error", "shard s0.tar is missing", 3, 0, time=now + 3600))
    marked = subprocess.run(SUPERVISE + ["--mark", str(tmp_path / "mark"), "--run-dir", str(run)], cwd=ROOT,
                            env=env(), capture_output=True, text=True)   # what a SLURM job runs before its step
    fake = script(tmp_path, "launch.py", f"""\
        import sys, time
        from pretrain.supervision.classes import Ending, write
        behind = time.time() - 3600
        write({str(run)!r}, Ending(0, "lost rank", "lost rank 1 in the middle of a step", 7, 0, time=behind))
        write({str(run)!r}, Ending(1, "unknown", "RuntimeError: CUDA error: out of memory", 7, 0, time=behind))
        sys.exit(1)
        """)
    r = subprocess.run(SUPERVISE + ["--run-dir", str(run), "--", PY, fake], cwd=ROOT, env=env(), capture_output=True,
                       text=True, timeout=60)
    assert "error: rank 1 failed first (unknown): RuntimeError: CUDA error: out of memory" in r.stderr, r.stderr
    assert r.returncode == 1, r.stderr
    assert marked.returncode == 0, marked.stderr
    r = subprocess.run(SUPERVISE + ["--classify", "--run-dir", str(run), "--restart", "0", "--mark",
                                    str(tmp_path / "mark"), "--exit-status", "1"], cwd=ROOT, env=env(),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("rank 1 failed first (unknown): RuntimeError"), r.stdout + r.stderr
