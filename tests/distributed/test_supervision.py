"""Operating a cluster job (pretrain/supervision/): failure classes that decide relaunches, read from each rank's
record rather than the launcher's exit status; crash loops; saves and compiles as progress; timeouts that agree with
the watchdog; and SLURM's one task a GPU, faked (srun, scontrol), where a data error on rank 1 is not requeued."""
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pickle

import pytest

from tests.support.runs import PY, ROOT, write_config

# the modules under test are imported inside the tests that use them: the tests of behaviour the code before them
# also had (its supervise, its Watchdog, its process groups) then fail there by what they assert

SUPERVISE = [PY, "-m", "pretrain.supervision"]


def env():
    return {**os.environ, "PYTHONPATH": ROOT}


def fake_launch(tmp_path, body: str) -> list[str]:
    """A launch command that plays the ranks: it writes their records as the trainer would (classes.write, with this
    launch's number) and counts its launches in <tmp>/launches."""
    script = tmp_path / "launch.py"
    script.write_text(textwrap.dedent(f"""\
        import os, sys
        from pretrain.supervision import classes
        restart = int(os.environ["SYNTHFORMER_RESTARTS"])
        with open({str(tmp_path / "launches")!r}, "a") as f:
            f.write(f"{{restart}} {{os.environ.get('SYNTHFORMER_RESTART_CAUSE', '-')}}\\n")
        def end(rank, cls, line, step):
            classes.write({str(tmp_path / "run")!r}, classes.Ending(rank, cls, line, step, restart))
        """) + textwrap.dedent(body))
    return [PY, str(script)]


def supervise(tmp_path, command, max_restarts=3):
    return subprocess.run(SUPERVISE + ["--max-restarts", str(max_restarts), "--backoff", "0.01", "--run-dir",
                                       str(tmp_path / "run"), "--"] + command, cwd=ROOT, capture_output=True,
                          text=True, env=env(), timeout=120)


def launches(tmp_path) -> list[str]:
    return (tmp_path / "launches").read_text().splitlines()


def test_the_launch_class_is_the_cause_not_its_echoes():
    """A data error on rank 3 is what the other ranks' lost peers echo; a hang names the rank the others wait for."""
    from pretrain.supervision import classes
    from pretrain.supervision.classes import Ending, conclude

    t = time.time()
    data = [Ending(0, "lost rank", "lost rank 3 in the middle of a step", 7, time=t),
            Ending(3, "config or data error", "shard s.tar has content hash 1, the manifest 2", 7, time=t + 1),
            Ending(5, "lost rank", "lost rank 3", 7, time=t)]
    v = conclude(data, 1)
    assert (v.cls, v.rank, v.line) == (classes.CONFIG, 3, "shard s.tar has content hash 1, the manifest 2")
    assert not v.cls.relaunch
    entered = {0: 41, 1: 41, 2: 40, 3: 41}   # rank 2 never entered the collective the others wait in
    hung = [Ending(r, "hang", f"rank {r} made no progress", 4, collectives={"0": {"entered": n}})
            for r, n in entered.items()]
    v = conclude(hung, 3)
    assert v.cls is classes.HANG and v.rank == 2 and v.cls.relaunch
    assert v.line.startswith("rank 2 hung; ranks 0, 1, 3 wait for it in a collective (rank 2 entered 40 collectives "
                             "of process group 0, the others 41); rank 2 made no progress"), v.line
    assert conclude([], -9).cls is classes.LOST and conclude([], 2).cls is classes.CONFIG
    assert conclude([Ending(0, "done", "trained to step 9", 9)], 1).cls is classes.LOST   # a rank left none
    assert [c.name for c in classes.PRECEDENCE if c.relaunch] == ["hang", "unknown", "transient", "lost rank"]


def test_a_rank_s_own_echo_after_its_hang_does_not_hide_the_hang(tmp_path):
    """Ranks 2 and 7 write their watchdog's hang, then, while it dumps, the lost peer their main thread saw (as in the
    rehearsal's 8 ranks): read keeps each rank's hang, so the line lists every rank that waits (before, the later echo
    replaced the hang and ranks 2 and 7 were left out of it)."""
    from pretrain.supervision.classes import Ending, conclude, read, write

    t = time.time()
    for r in range(8):
        write(str(tmp_path), Ending(r, "hang", f"rank {r} made no progress", 7, 1, time=t,
                                    collectives={"3": {"entered": 68 if r == 5 else 69}}))
        if r in (2, 7):
            write(str(tmp_path), Ending(r, "lost rank", "lost rank 5", 7, 1, time=t + 1))
    write(str(tmp_path), Ending(0, "done", "trained to step 4", 4, 0, time=t - 100))   # an older launch's
    records = read(str(tmp_path), 1, t)
    assert [(e.rank, e.cls) for e in records] == [(r, "hang") for r in range(8)]
    assert conclude(records, 3).line.startswith("rank 5 hung; ranks 0-4, 6, 7 wait for it in a collective (rank 5 "
                                                "entered 68 collectives of process group 3, the others 69)")


def test_the_table_in_docs_operations_is_the_code():
    """docs/operations.md's failure-class table: each class's exit status and whether it is relaunched, as the code."""
    from pretrain.supervision import classes

    rows = {}
    for line in open(os.path.join(ROOT, "docs", "operations.md")):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0] in classes.BY_NAME:
            rows[cells[0]] = (int(cells[1]), cells[2] == "yes")
    assert rows == {c.name: (c.exit, c.relaunch) for c in classes.PRECEDENCE}


def test_the_supervisor_reads_the_ranks_records_not_the_launchers_exit_status(tmp_path):
    """The launcher exits 1 with rank 0's failed collective; rank 3's record says data error: no relaunch, and the
    line names rank 3, its first error line and its log."""
    from pretrain.supervision import classes

    r = supervise(tmp_path, fake_launch(tmp_path, """\
        end(0, "lost rank", "lost rank 3 (its process is gone) in the middle of a step", 7)
        end(3, "config or data error", "shard /d/s3.tar has content hash 1f, the manifest says 2e", 7)
        print("error: lost rank 3 (its process is gone) in the middle of a step", file=sys.stderr)
        sys.exit(1)
        """))
    assert launches(tmp_path) == ["0 -"], r.stderr
    assert r.returncode == classes.CONFIG.exit, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert lines[-2:] == [
        f"error: rank 3 failed first (config or data error): shard /d/s3.tar has content hash 1f, the manifest says "
        f"2e; its log: {tmp_path / 'run' / 'logs' / 'rank3.log'}",
        "error: not relaunching: a relaunch cannot fix a config or data error (a bad setting, a bad or missing "
        "shard, a hash mismatch (data.bad_shards=fail): the same command fails the same way)"], r.stderr
    history = [json.loads(line) for line in open(tmp_path / "run" / "logs" / "launches.jsonl")]
    assert [(h["class"], h["rank"], h["relaunch"]) for h in history] == [("config or data error", 3, False)]


def test_a_relaunch_that_fails_at_the_same_step_with_the_same_line_stops_early(tmp_path):
    """An unknown error is relaunched; when the relaunch fails the same way at the same step, the supervisor stops
    (a crash loop) with max-restarts to spare. A failure at another step is a new one and is relaunched."""
    from pretrain.supervision import classes

    r = supervise(tmp_path, fake_launch(tmp_path, """\
        step = 12 if restart < 2 else 15   # launches 0 and 1 fail alike; 2 elsewhere, 3 as 2
        end(1, "unknown", "RuntimeError: CUDA error: an illegal memory access was encountered", step)
        end(0, "lost rank", "lost rank 1", step)
        sys.exit(1)
        """), max_restarts=5)
    assert [line.split()[0] for line in launches(tmp_path)] == ["0", "1"], r.stderr
    assert r.returncode == classes.UNKNOWN.exit
    assert r.stderr.strip().splitlines()[-1] == (
        "error: not relaunching: launch 1 failed as launch 0 did, at step 12 with the same first error line: a crash "
        "loop, which a relaunch does not end"), r.stderr
    assert launches(tmp_path)[1] == "1 RuntimeError: CUDA error: an illegal memory access was encountered"


@pytest.mark.parametrize("cls,relaunched", [("training stopped", False), ("hang", True), ("lost rank", True)])
def test_only_the_classes_a_relaunch_can_fix_are_relaunched(tmp_path, cls, relaunched):
    from pretrain.supervision import classes

    r = supervise(tmp_path, fake_launch(tmp_path, f"""\
        end(0, {cls!r}, "the launch's own line", 3 + restart)   # another step each time: no crash loop
        sys.exit(1)
        """), max_restarts=2)
    assert len(launches(tmp_path)) == (3 if relaunched else 1), r.stderr
    assert r.returncode == classes.BY_NAME[cls].exit


SAVES = """\
import os, sys, time
from types import SimpleNamespace
try:
    from pretrain.supervision.rank import supervise
except ImportError:   # the code before pretrain/supervision/
    from pretrain.supervision import supervise
run = sys.argv[1]
from pretrain.checkpoints.checkpointer import OwnFiles
def save(step, chunks, stall):
    os.makedirs(checkpointer.partial_path(step), exist_ok=True)
    checkpointer.own.writing(os.path.join(checkpointer.partial_path(step), "model.pt"))   # this rank's file
    for i in range(chunks):   # a chunk every 0.5 s: moving, though the save outlasts hang_timeout's 1.5 s
        with open(os.path.join(checkpointer.partial_path(step), "model.pt"), "ab") as f:
            f.write(b"x" * 1000)
        time.sleep(0.5)
    time.sleep(stall)         # then nothing written (a stalled save) for this long
    return f"saved {step}"
checkpointer = SimpleNamespace(partial_path=lambda step: os.path.join(run, "checkpoints", f"step_{step}.partial"),
                               own=OwnFiles())
checkpointer.save = save
cfg = SimpleNamespace(train=SimpleNamespace(hang_timeout=1.5, run_dir=run, compile=False, collective_timeout=None))
trainer = SimpleNamespace(step=6, cfg=cfg, layout=SimpleNamespace(rank=0, collective_timeout_s=1800.0),
                          checkpointer=checkpointer,
                          log=SimpleNamespace(info=print, event=None), train_step=print, validate=print,
                          log_samples=print, log_scores=print, train=print)
dog = supervise(trainer)
print(trainer.checkpointer.save(7, 8, 0.0), flush=True)    # 4 s of a moving save
trainer.step = 7
print(trainer.checkpointer.save(8, 2, 30.0), flush=True)   # 1 s of writing, then 30 s of nothing
"""


def test_a_save_is_progress_while_its_bytes_grow(tmp_path):
    """Under hang_timeout 1.5 s: a save that keeps writing for 4 s is not a hang (before, a save counted only when
    it returned); a save that stops writing is one, long before it would return: the rank writes its stacks and
    says the save stopped moving."""
    script = tmp_path / "saves.py"
    script.write_text(SAVES)
    r = subprocess.run([PY, str(script), str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                       env={**env(), "SYNTHFORMER_RESTARTS": "0"}, timeout=120)
    assert r.stdout.splitlines()[-1:] == ["saved 7"], r.stdout + r.stderr   # the moving save ended by itself
    assert r.returncode == 3, (r.returncode, r.stderr)                       # the stalled one did not: HANG_EXIT
    stacks = (tmp_path / "hang" / "rank0.txt").read_text()
    assert "after finishing step 7 in the checkpoint save of step 8, which stopped moving" in stacks, stacks[:400]
    assert " in save\n" in stacks   # the stalled frame
    record = json.loads((tmp_path / "logs" / "rank0.exits.jsonl").read_text().splitlines()[-1])
    assert record["cls"] == "hang" and record["step"] == 7


HUNG = """\
import os, sys, time
import torch, torch.distributed as dist
try:
    from pretrain.supervision.watchdog import Watchdog
except ImportError:   # the code before pretrain/supervision/
    from pretrain.supervision import Watchdog
dist.init_process_group("gloo")
t = torch.ones(2)
dist.all_reduce(t)
rank = dist.get_rank()
Watchdog(2.0, sys.argv[1], rank, lambda: 7).start()
if rank == 1:
    time.sleep(60)   # stuck: it never enters the next collective
dist.all_reduce(t)   # rank 0 waits for it here
"""


def test_a_hung_rank_dumps_its_stacks_and_the_flight_recorder_before_it_exits(tmp_path):
    """Two gloo ranks, rank 1 stuck outside the collective rank 0 waits in: each watchdog writes its stacks, then
    PyTorch's flight recorder (on, as launch/pretrain.sh sets it) into the run, then exits (before, os._exit came with
    no dump); the records name rank 1 as the one rank 0 waits for."""
    script = tmp_path / "hung.py"
    script.write_text(HUNG)
    from tests.support.runs import free_local_port
    shared = {**env(), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_local_port()),
              "TORCH_FR_BUFFER_SIZE": "100", "SYNTHFORMER_RESTARTS": "0"}
    t0 = time.time()
    procs = [subprocess.Popen([PY, str(script), str(tmp_path)], cwd=ROOT, env={**shared, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [3, 3], outs
    hang = tmp_path / "hang"
    assert 'hung.py", line 13 in <module>' in (hang / "rank1.txt").read_text()         # in its sleep
    assert 'hung.py", line 14 in <module>' in (hang / "rank0.txt").read_text()         # in the collective
    dumps = {r: pickle.loads((hang / "flight_recorder" / f"rank_{r}").read_bytes()) for r in (0, 1)}
    seen = {r: [(e["profiling_name"], e["collective_seq_id"]) for e in d["entries"]] for r, d in dumps.items()}
    assert seen == {0: [("gloo:all_reduce", 1), ("gloo:all_reduce", 2)], 1: [("gloo:all_reduce", 1)]}, seen
    assert dumps[0]["pg_config"]["0"]["ranks"] == "[0, 1]"   # the group table, which gloo's recorder leaves empty
    from pretrain.supervision.classes import conclude, read

    verdict = conclude(read(str(tmp_path), 0, t0), 3)
    assert verdict.rank == 1 and verdict.line.startswith("rank 1 hung; rank 0 waits for it in a collective (rank 1 "
                                                         "entered 1 collectives of process group 0, the others 2)")


TIMEOUTS = """\
import sys
import torch
from pretrain import distributed
from pretrain.config import load_config
cfg = load_config(sys.argv[1], ["train.hang_timeout=600", "parallel.tp=2"])
distributed.init(cfg)
from torch.distributed import distributed_c10d as c10d
seconds = {g.group_name: g._get_backend(torch.device("cpu")).options._timeout.total_seconds()
           for g in c10d._world.pg_map}
print(f"rank {torch.distributed.get_rank()}: {len(seconds)} groups, timeouts {sorted(set(seconds.values()))}")
assert set(seconds.values()) == {720.0}, seconds
"""


def test_every_process_group_of_the_launch_waits_the_collective_timeout(tmp_path):
    """distributed.init on 2 gloo ranks with TP 2 and train.hang_timeout 600: the world group (DeepSpeed's own default
    was 10 minutes) and every megatron-core group (30 minutes) wait hang_timeout + 120 = 720 s. (DeepSpeed's
    pipeline groups, made with no timeout, are set once the engine is built: tests/distributed/test_restarts.py checks them.)"""
    from tests.support.runs import spawn

    script = tmp_path / "timeouts.py"
    script.write_text(TIMEOUTS)
    spawn(str(script), [os.path.join(ROOT, "configs", "demo-cpu.yaml")], 2)


def test_the_collective_timeout_must_leave_the_watchdog_time_to_act():
    from model import ConfigError
    from pretrain.config import load_config
    from pretrain.timeouts import collective_timeout

    demo = os.path.join(ROOT, "configs", "demo-cpu.yaml")
    assert collective_timeout(load_config(demo, ["train.hang_timeout=600"]).train) == 720
    assert collective_timeout(load_config(demo).train) == 1800          # no watchdog: torch's gloo default
    assert collective_timeout(load_config(demo, ["train.hang_timeout=600", "train.collective_timeout=900"]).train) \
        == 900
    with pytest.raises(ConfigError, match=r"train.collective_timeout=620.0 is out of range; allowed: null or > 660 s "
                                          r"\(train.hang_timeout=600 \+ 60: the watchdog must act first\)"):
        load_config(demo, ["train.hang_timeout=600", "train.collective_timeout=620"])


@pytest.mark.slow
def test_slurm_one_task_a_gpu_and_a_data_error_that_is_not_requeued(shards, tmp_path):
    """launch/slurm.sbatch with --ntasks-per-node=2 under a faked SLURM (tests/support/fake_slurm.py): srun starts
    both ranks itself (SLURM_PROCID → RANK); rank 1 reads a shard whose content does not match its hash
    (data.bad_shards=fail). The job is not requeued (scontrol requeue is never called), the line names rank 1 and its
    first error, and each rank wrote its own log in the run directory."""
    from tokendata.stream import TokenStream

    from pretrain.config import DataSection

    bad = tmp_path / "shards"
    shutil.copytree(shards, bad)
    first = TokenStream(str(bad), 4, 32, dp_rank=1, dp_world=2, seed=DataSection(shard_dir=str(bad)).seed)
    victim = bad / first.upcoming_shards()[0]
    with open(victim, "r+b") as f:   # the same size, another content
        f.seek(100)
        f.write(bytes(range(200)))
    from tests.support import fake_slurm

    run = tmp_path / "run"
    config = write_config(tmp_path / "c.yaml", str(bad), run, train={"max_steps": 4})
    slurm = {"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "localhost", "SLURM_NNODES": "1", "SLURM_NTASKS": "2",
             "SLURM_NTASKS_PER_NODE": "2", "SLURM_SUBMIT_DIR": ROOT, "SLURM_RESTART_COUNT": "0"}
    from tests.support.runs import free_local_port
    r = subprocess.run(["bash", os.path.join(ROOT, "launch", "slurm.sbatch"), config], cwd=str(tmp_path),
                       capture_output=True, text=True, timeout=600,
                       env={**env(), **slurm, **fake_slurm.install(tmp_path), "PYTHON": PY,
                            "MASTER_PORT": str(free_local_port())})
    assert r.returncode != 0, r.stdout[-2000:] + r.stderr[-3000:]
    calls = (tmp_path / "slurm" / "scontrol.calls").read_text().splitlines()
    assert calls == ["show hostnames localhost"], calls                      # never `requeue 77`
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: rank 1 failed first (config or data error): shard {victim} has content hash "), \
        r.stderr[-3000:]
    assert last.endswith(f"not relaunching: a relaunch cannot fix a config or data error (a bad setting, a bad or "
                         f"missing shard, a hash mismatch (data.bad_shards=fail): the same command fails the same "
                         f"way)"), last
    logs = run / "logs"
    assert f"error: shard {victim} has content hash" in (logs / "rank1.log").read_text()
    assert "rank 1 (pid" in (logs / "rank1.log").read_text().splitlines()[0]
    assert "2 ranks (tp=1, cp=1, pp=1, dp=2)" in (logs / "rank0.log").read_text()   # rank 0's own log holds the trainer's
    assert [json.loads(line)["cls"] for line in open(logs / "rank1.exits.jsonl")] == ["config or data error"]
