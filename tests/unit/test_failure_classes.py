"""What ended a launch, from records written by hand as the ranks write them (pretrain/supervision/classes.py,
relaunch.py; issue 52): an outage is its own class, relaunched after a longer wait; the first cause wins over the
hangs it leaves behind, and a rank's later record never replaces its first; the ranks that left no record are named;
crash loops are found through the numbers that change by the second, and for kills, by the newest checkpoint."""
import json
import multiprocessing
import os
import sys
import time
from types import SimpleNamespace

from pretrain.supervision import classes, relaunch
from pretrain.supervision.classes import Ending, conclude, read, write

CUDA = "RuntimeError: CUDA error: an illegal memory access was encountered"


def hang_line(run, r, idle, step=7):
    return (f"rank {r} made no progress for {idle} s (train.hang_timeout=1800) after finishing step {step}: stopped; "
            f"the stacks of its threads are in {run}/hang/rank{r}.txt")


def hangs(run, restart, t, idle, entered, skip=(), **world):
    """Every rank's watchdog record of one hang: rank r entered entered[r] collectives of process group 0."""
    for r, n in enumerate(entered):
        if r not in skip:
            write(run, Ending(r, "hang", hang_line(run, r, idle), 7, restart, time=t,
                              collectives={"0": {"entered": n}}, **world))


def test_an_error_before_the_others_hang_names_its_rank_not_the_hang(tmp_path):
    """Rank 3 hits a CUDA error; the ranks of the other node wait in NCCL until hang_timeout and record hangs, and
    rank 3 itself, blocked in its teardown, gets a hang record after its own (before: "hang, rank 8", rank 3's
    unknown replaced by its hang)."""
    run, t = str(tmp_path), time.time()
    write(run, Ending(3, "unknown", CUDA, 7, 1, time=t))
    hangs(run, 1, t + 1800, 1801, [41] * 16)   # rank 3's too, after its own
    records = read(run, 1, t - 1)
    assert [(e.rank, e.cls) for e in records if e.rank == 3] == [(3, "unknown")]
    v = conclude(records, 1)
    assert (v.cls, v.rank, v.line) == (classes.UNKNOWN, 3, CUDA)
    # an outage on rank 5 before the hangs it leaves: transient, rank 5, relaunched
    write(run, Ending(5, "transient", "shard http://s/x.tar: HTTP 503, still after 6 retries", 7, 2, time=t))
    hangs(run, 2, t + 1800, 1800, [41] * 16, skip={5})
    v = conclude(read(run, 2, t - 1), 3)
    assert (v.cls.name, v.rank, v.cls.relaunch) == ("transient", 5, True)


def test_a_hang_names_the_rank_the_others_wait_for_whatever_they_recorded():
    """Rank 0 stalls; rank 1, waiting for it in a collective, sees it exit before its own watchdog expires and records
    a lost rank (its watchdog stopped before its record): its collectives still name rank 0 (before: only the hang
    records were compared, and the line said no rank stands out)."""
    t = time.time()
    records = [Ending(0, "hang", "rank 0 made no progress for 16 s", 7, time=t, collectives={"0": {"entered": 40}}),
               Ending(1, "lost rank", "lost rank 0", 7, time=t + 1, collectives={"0": {"entered": 41}})]
    v = conclude(records, 1)
    assert (v.cls, v.rank) == (classes.HANG, 0) and v.line.startswith(
        "rank 0 hung; rank 1 waits for it in a collective (rank 0 entered 40 collectives"), v.line


def test_the_ranks_that_left_no_record_are_named(tmp_path):
    """Rank 6 of 8 was killed (the OOM killer): the others recorded lost ranks, or all hang in NCCL; the verdict's line
    names rank 6. A failed launch whose records all say done names the silent rank (its log is the one to read)."""
    t = time.time()
    lost = [Ending(r, "lost rank", "lost rank 6 (its process is gone) in the middle of a step", 7, time=t + r, world=8)
            for r in range(8) if r != 6]
    v = conclude(lost, 1)
    assert v.cls is classes.LOST and v.line == (
        "lost rank 6 (its process is gone) in the middle of a step; rank 6 left no record (killed: kill -9, the OOM "
        "killer, a node lost?)"), v.line
    run = str(tmp_path)
    hangs(run, 0, t, 1801, [41] * 8, skip={6}, world=8)
    v = conclude(read(run, 0, t - 1), 3)
    assert v.cls is classes.HANG and "rank 6 left no record" in v.line, v.line
    done = [Ending(r, "done", "trained to step 9", 9, world=4) for r in (0, 1, 3)]
    v = conclude(done, 1)
    assert (v.cls, v.rank) == (classes.LOST, 2) and v.line.startswith("rank 2 left no record"), v.line


def test_the_same_hang_twice_is_a_crash_loop(tmp_path):
    """Launch 1 hangs as launch 0 did, at step 7, the same rank stuck: its watchdog saw 1800 s without progress where
    launch 0's saw 1801, and having resumed from a checkpoint it entered fewer collectives since it started."""
    run, t = str(tmp_path), time.time()
    hangs(run, 0, t, 1801, [41, 41, 40, 41])
    verdict, stop = relaunch.judge(run, 0, t - 1, 3, [])
    assert (verdict.cls, verdict.rank, stop) == (classes.HANG, 2, None)
    hangs(run, 1, t + 10, 1800, [21, 21, 20, 21])
    verdict, stop = relaunch.judge(run, 1, t + 9, 3, [])
    assert stop is not None and "crash loop" in stop, (verdict, stop)
    key = classes.steady   # what stays: the class's words, ranks, steps, settings; what goes: what varies by launch
    assert key("Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1234, OpType=ALLREDUCE, "
               "Timeout(ms)=1920000) ran for 1920043 milliseconds before timing out (pid 4242 on 10.0.0.7:29500, "
               "at 0x7f3a2c) after 3.21 GiB [2025-01-02 10:11:12,345]") == \
        key("Watchdog caught collective operation timeout: WorkNCCL(SeqNum=99, OpType=ALLREDUCE, "
            "Timeout(ms)=1920000) ran for 1920002 milliseconds before timing out (pid 17 on 10.0.0.9:41234, "
            "at 0x55e1) after 3.19 GiB [2025-01-03 09:01:02,007]")
    assert key(hang_line(run, 2, 1800)) != key(hang_line(run, 3, 1800)) != key(hang_line(run, 3, 1800, step=8))
    assert key("OpType=ALLREDUCE timed out") != key("OpType=ALLGATHER timed out")


def checkpoint(run, step, complete=True):
    tag = os.path.join(run, "checkpoints", f"step_{step:08d}" + ("" if complete else ".partial"))
    os.makedirs(tag)
    if complete:
        with open(os.path.join(tag, "complete.json"), "w") as f:
            json.dump({"step": step, "files": {}}, f)


def test_two_kills_at_the_same_newest_checkpoint_are_a_crash_loop(tmp_path):
    """kill -9 or the OOM killer leave no record (step None, before: no loop check ever): the newest complete
    checkpoint's step stands in. Two kills that resume from step 6 are a loop; a kill after step 12 was saved is not."""
    run, t = str(tmp_path), time.time()
    checkpoint(run, 6)
    checkpoint(run, 9, complete=False)   # a save cut short by the kill
    verdict, stop = relaunch.judge(run, 0, t, 137, [])
    assert (verdict.cls, verdict.step, stop) == (classes.LOST, 6, None)
    verdict, stop = relaunch.judge(run, 1, t, 137, [])
    assert stop is not None and "crash loop" in stop and verdict.step == 6, (verdict, stop)
    checkpoint(run, 12)
    assert relaunch.judge(run, 2, t, 137, [])[1] is None


def test_an_outage_is_relaunched_after_a_longer_bounded_wait_and_is_no_crash_loop(tmp_path):
    """The transient class: relaunched, its own exit status; the same outage twice is not a loop (it passes by
    itself); the supervisor waits longer before its relaunch, doubling, bounded."""
    t = classes.TRANSIENT
    assert t.relaunch and t.exit not in {c.exit for c in classes.PRECEDENCE if c is not t}
    assert classes.of_exit_status(t.exit) is t
    run, now = str(tmp_path), time.time()
    for restart in (0, 1):
        write(run, Ending(0, "transient", "shard http://s/x.tar: HTTP 503, still after 6 retries", 7, restart))
        assert relaunch.judge(run, restart, now - 1, t.exit, [])[1] is None
    waits = [relaunch.wait_s(t, 10, k) for k in range(12)]
    assert waits[0] > relaunch.wait_s(classes.UNKNOWN, 10, 0) and waits == sorted(waits)
    assert waits[-1] == relaunch.TRANSIENT_MAX_S >= relaunch.MAX_BACKOFF_S
    # the supervisor itself, around a launch whose rank records an outage each time
    record = {"rank": 0, "cls": "transient", "line": "shard http://s/x.tar: HTTP 503", "step": 7}
    script = (f"import json, os, time; r = int(os.environ['SYNTHFORMER_RESTARTS']); os.makedirs({run!r} + '/logs', "
              f"exist_ok=True); open({run!r} + '/logs/rank0.exits.jsonl', 'a').write(json.dumps(dict({record!r}, "
              f"restart=r, time=time.time())) + '\\n'); raise SystemExit({t.exit})")
    slept = []
    real_sleep = time.sleep
    try:
        relaunch.time.sleep = lambda s: slept.append(s)
        status = relaunch.relaunch([sys.executable, "-c", script], 2, 0.5, run)
    finally:
        relaunch.time.sleep = real_sleep
    assert status == t.exit and slept == [relaunch.wait_s(t, 0.5, 0), relaunch.wait_s(t, 0.5, 1)], slept


def test_a_fetch_that_failed_is_transient_and_wrong_content_a_data_error():
    from pretrain.supervision.rank import classify
    from tokendata.remote import DataError, FetchFailed

    outage = FetchFailed("shard http://s/x.tar: HTTP 503 Service Unavailable, still after 6 retries")
    assert classify(outage, None) == (classes.TRANSIENT, str(outage))
    wrong = DataError("shard http://s/x.tar has content hash xxh3_128:1 but manifest.json says xxh3_128:2")
    assert classify(wrong, None) == (classes.CONFIG, str(wrong))
    from_worker = FetchFailed("Caught FetchFailed in DataLoader worker process 0.\nOriginal Traceback (most recent "
                              "call last):\n  ...\ntokendata.remote.FetchFailed: shard http://s/x.tar: HTTP 503")
    assert classify(from_worker, None) == (classes.TRANSIENT, "shard http://s/x.tar: HTTP 503")


def test_the_raise_fault_is_an_unknown_error_of_its_rank_before_its_step_once_a_run(tmp_path):
    import pytest

    from pretrain.faults import Faults
    from pretrain.supervision.rank import classify

    Faults("raise@5@3", rank=2, run_dir=str(tmp_path)).before_step(5)   # another rank's: nothing
    faults = Faults("raise@5@3", rank=3, run_dir=str(tmp_path))
    faults.before_step(4)
    with pytest.raises(RuntimeError, match="raise@5@3") as raised:
        faults.before_step(5)
    assert classify(raised.value, None)[0] is classes.UNKNOWN
    Faults("raise@5@3", rank=3, run_dir=str(tmp_path)).before_step(5)   # a relaunch of the run: fired already


def a_rank_whose_teardown_blocks(run_dir):
    """run_rank around a trainer that fails with a CUDA error, then blocks in its close (W&B's finish, NCCL's teardown)
    for four times its watchdog's hang_timeout."""
    os.environ.update(RANK="3", WORLD_SIZE="4")
    from pretrain.supervision import rank
    from pretrain.supervision.watchdog import Watchdog

    class Trainer:
        step, layout = 7, None

        def __init__(self):
            self.watchdog = Watchdog(0.25, run_dir, 3, lambda: self.step)
            self.watchdog.start()

        def train(self):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        def close(self):
            time.sleep(1.0)

    rank.run_rank(lambda: SimpleNamespace(train=SimpleNamespace(run_dir=run_dir)), lambda cfg: Trainer())


def test_the_watchdog_is_stopped_before_a_rank_s_final_record(tmp_path):
    """Before: the watchdog, never stopped, expired in the teardown and appended a hang record (which read kept over
    the CUDA error) and ended the rank with the hang's exit status."""
    proc = multiprocessing.get_context("fork").Process(target=a_rank_whose_teardown_blocks, args=(str(tmp_path),))
    proc.start()
    proc.join(60)
    records = [json.loads(line) for line in open(tmp_path / "logs" / "rank3.exits.jsonl")]
    assert [(r["cls"], r["line"]) for r in records] == [("unknown", CUDA)], records
    # no stacks of a hang (the flight recorder's folder under hang/ exists from the rank's start)
    assert proc.exitcode == classes.UNKNOWN.exit and not list((tmp_path / "hang").glob("rank*.txt"))

