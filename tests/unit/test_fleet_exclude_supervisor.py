"""fleet.exclude acted on: the trainer's rank 0 asks for a move off a node named long enough (pretrain/fleet/watch.py),
every rank's record says `exclude`, and the supervisor (pretrain/supervision/exclude.py, relaunch.py) drops the node
from its launch command, or ends its own node's part, and keeps an excluded node out of later launches. The end to
end move (real ranks, a relayout, the same global batches) is the rehearsal's claim 9 (tools/rehearsal.py)."""
import os
import subprocess
import sys
import textwrap
import time

import torch

from pretrain.config import load_config
from pretrain.distributed import Layout
from pretrain.fleet import exclusion
from pretrain.fleet.watch import FleetWatch
from pretrain.supervision import classes, exclude, relaunch
from tests.support.runs import ROOT

EVEN = {"data_wait": 0.001, "compute": 0.010, "backward": 0.02, "optimizer": 0.005, "collective": 0.004}


class Log:
    def __init__(self):
        self.lines = []

    def scalars(self, step, values):
        pass

    def info(self, line):
        self.lines.append(line)


def watch(run, after_s):
    cfg = load_config(os.path.join(ROOT, "configs", "demo-cpu.yaml"),
                      [f"train.run_dir={run}", "fleet.exclude=true", f"fleet.exclude_after_s={after_s}",
                       "fleet.windows=2", "fleet.every=1", "train.global_batch_size=16", "train.micro_batch_size=2"])
    lay = Layout(rank=0, world=4, dp_rank=0, dp=4, tp=1, pp=1, grad_accum=2, device=torch.device("cpu"),
                 peers=(("n0", 1), ("n0", 2), ("n1", 3), ("n1", 4)))
    return FleetWatch(cfg, lay, None)


def table(slow_rank=None, factor=3.0):
    return [{**EVEN, "compute": EVEN["compute"] * (factor if r == slow_rank else 1)} for r in range(4)]


def test_a_node_named_for_exclude_after_s_is_asked_to_leave_and_not_before(tmp_path):
    w, log = watch(tmp_path, 300), Log()
    said = [w.judge(step, table(2), log) for step in (1, 2, 3)]   # warm-up, late, late: rank 2 named at step 3
    assert said == [None, None, None] and exclusion.asked(str(tmp_path)) is None   # named, but not for 300 s yet
    assert list(w.named_since) == ["n1"]
    assert w.move_off(w.named_since["n1"] + 299, log) is None
    why = w.move_off(w.named_since["n1"] + 300, log)
    assert why.startswith("fleet.exclude: node n1 leaves (rank 2 named for slow compute for 300 s")
    move, hosts = exclusion.asked(str(tmp_path))
    assert hosts == ["n0", "n1"] and (move.host, move.hosts, move.world, move.dp, move.micro_batch) == \
        ("n1", ("n0",), 2, 2, 2)
    assert log.lines[-1].startswith("fleet.exclude: node n1 leaves") and "every rank stops after the next step" in \
        log.lines[-1]


def test_a_node_that_recovers_is_not_moved_off_and_the_rendezvous_node_never_is(tmp_path):
    w, log = watch(tmp_path, 0), Log()
    for step in (1, 2, 3):
        assert w.judge(step, table(2), log) == ("fleet.exclude: node n1 leaves (rank 2 named for slow compute for "
                                                "0 s, fleet.exclude_after_s=0)" if step == 3 else None)
    w, log = watch(tmp_path / "b", 60), Log()
    for step in (1, 2, 3, 4):   # named at step 3, even at step 4: the clock starts again
        w.judge(step, table(2 if step < 4 else None), log)
    assert w.named_since == {} and w.move_off(time.time() + 3600, log) is None
    w, log = watch(tmp_path / "c", 0), Log()
    said = [w.judge(step, table(0), log) for step in (1, 2, 3, 4, 5)]   # rank 0 on n0: the rendezvous's node
    assert said == [None] * 5 and exclusion.asked(str(tmp_path / "c")) is None
    assert [line for line in log.lines if "stays: it holds the launch's rendezvous" in line] == \
        ["fleet.exclude: node n0 stays: it holds the launch's rendezvous (MASTER_ADDR, the first node); move the job "
         "off it by hand (docs/operations.md, Slow jobs)"]


def test_rank_0s_exclude_record_names_the_launch_over_the_others_preempted_ones():
    ends = [classes.Ending(0, "exclude", "stopped at step 7 (fleet.exclude: node n1 leaves (…))", 7)] + \
        [classes.Ending(r, "preempted", "stopped at step 7 (a signal on another rank)", 7) for r in (1, 2, 3)]
    verdict = classes.conclude(ends, 0)
    assert verdict.cls is classes.EXCLUDE and verdict.rank == 0 and not verdict.cls.exit
    assert classes.conclude(ends, 137).cls is classes.LOST   # a failed launch: a rank died, whatever rank 0 asked


def test_the_launch_command_for_the_kept_nodes(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("node0 slots=4\nnode1 slots=4\nnode2 slots=4\n")
    ds = ["py", "-m", "deepspeed.launcher.runner", "--master_addr", "10.0.0.1", "--master_port", "29500",
          "--hostfile", str(hosts), "--no_ssh", "--node_rank", "2", "--module", "pretrain.train", "c.yaml",
          "checkpoint.relayout=false", "train.lr=1e-3"]
    new = exclude.rewrite(ds, 2, 1, 2)
    assert new[:8] + new[9:] == ds[:8] + ["--no_ssh", "--node_rank", "1", "--module", "pretrain.train", "c.yaml",
                                          "train.lr=1e-3", "checkpoint.relayout=true", "train.micro_batch_size=2"]
    assert open(new[8]).read() == "node0 slots=4\nnode1 slots=4\n" and hosts.read_text().count("\n") == 3
    tr = ["py", "-m", "torch.distributed.run", "--nproc-per-node", "4", "--nnodes", "3", "--node-rank", "2",
          "-m", "pretrain.train", "c.yaml"]
    assert exclude.rewrite(tr, 2, 1, 4) == tr[:5] + ["--nnodes", "2", "--node-rank", "1", "-m", "pretrain.train",
                                                     "c.yaml", "checkpoint.relayout=true", "train.micro_batch_size=4"]


def test_an_excluded_host_stays_out_of_every_later_launch_over_ssh(tmp_path):
    run, hostfile = str(tmp_path / "run"), tmp_path / "hostfile"
    hostfile.write_text("n0 slots=8\nn1 slots=8\n# spare\nn2 slots=8\n")
    ds = ["py", "-m", "deepspeed.launcher.runner", "--hostfile", str(hostfile), "--module", "pretrain.train", "c"]
    assert exclude.honour(ds, run) == ds   # nothing excluded yet
    exclusion.record(run, exclusion.plan("n1", ["n0", "n1", "n2"], 8, 1, 1, 64, 4, "slow"))
    out = exclude.honour(ds, run)
    assert out[4] == os.path.join(run, "fleet", "hostfile") and out[:4] + out[5:] == ds[:4] + ds[5:]
    assert open(out[4]).read() == "n0 slots=8\nn2 slots=8\n"


LAUNCH = """\
    import os, sys
    from pretrain.fleet import exclusion
    from pretrain.supervision import classes, nodes
    run = sys.argv[1]
    restart = int(os.environ["SYNTHFORMER_RESTARTS"])
    open(os.path.join(os.path.dirname(run), "launched"), "a").write(f"{restart}\\n")
    move = exclusion.plan("n1", ["n0", "n1"], 2, 1, 1, 16, 2, "rank 2 named for slow compute for 0 s")
    exclusion.ask(run, move, ["n0", "n1"])
    classes.write(run, classes.Ending(0, "exclude", "stopped at step 7 (fleet.exclude: node n1 leaves)", 7, restart))
    for rank in (1, 2, 3):
        classes.write(run, classes.Ending(rank, "preempted", "stopped at step 7", 7, restart))
    nodes.tell(run, restart, "ended", node=0, status=0, stopped=False)   # node 0's supervisor, as it would
    """


def supervise(tmp_path, name, *more):
    fake = tmp_path / "launch.py"
    fake.write_text(textwrap.dedent(LAUNCH))
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SYNTHFORMER_")}, "PYTHONPATH": ROOT,
           "SYNTHFORMER_NODE": name}
    return subprocess.run([sys.executable, "-m", "pretrain.supervision", "--max-restarts", "0", "--run-dir",
                           str(tmp_path / "run"), "--nodes", "2", "--node-rank", "1", *more, "--",
                           sys.executable, str(fake), str(tmp_path / "run")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


def test_the_node_that_leaves_ends_its_part_and_is_kept_out_of_later_launches(tmp_path):
    r = supervise(tmp_path, "n1")
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    assert "fleet.exclude: node n1 leaves (rank 2 named for slow compute for 0 s); relaunching on 1 nodes, 2 ranks, " \
           "data parallel 2, micro-batch 2, the same global batch" in lines
    assert any(line.startswith("node n1 leaves the job (fleet.exclude;") for line in lines), lines
    assert (tmp_path / "launched").read_text() == "0\n"   # once: no relaunch on the node that left
    run = str(tmp_path / "run")
    assert not exclusion.excluded(run)   # node 0 (the first kept) writes the file: here, by hand
    exclusion.record(run, exclusion.asked(run)[0])
    again = supervise(tmp_path, "n1")
    assert again.returncode == 0 and (tmp_path / "launched").read_text() == "0\n", again.stderr
    assert f"node n1 is excluded from this run ({run}/fleet/excluded_nodes): not launching here; delete its line " \
           f"there to let it back" in again.stderr
    assert relaunch.previous(run, 1)["class"] == "exclude"
