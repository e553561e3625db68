"""A run that looks after itself (pretrain/supervision/): under torchrun, a rank that hangs is found within
train.hang_timeout and leaves the stacks of its threads and the flight recorder's dump, and the supervisor names it;
launch/pretrain.sh --max-restarts relaunches after a hang and after a kill -9 and the run ends as one never interrupted
does, bit for bit, every process group on the timeout the watchdog precedes, W&B refusing every launch without a
restart spent on it; a run that keeps failing stops after N restarts with one line."""
import collections
import json
import os
import pickle
import random
import signal
import subprocess
import time

from types import SimpleNamespace

import pytest
import torch

from pretrain.supervision.rank import RESTARTS, supervise
from pretrain.timeouts import MARGIN_S, SAVE_S
from pretrain.supervision.watchdog import HANG_EXIT
from tests.support.runs import (PY, ROOT, finish, free_local_port, launch, logged_step, metric_rows, record, start,
                                tensorboard_scalars, trainer_ranks, write_config)
from tests.support.wandb_server import refusing_wandb

HANG_TIMEOUT = 15
# SYNTHFORMER_HANG_TRIALS=N: N hangs at random steps and ranks in the run, each found and restarted (default 1)
TRIALS = int(os.environ.get("SYNTHFORMER_HANG_TRIALS", 1))
KILL_AT = 4                            # the kill -9 of rank 0, before the hangs
STEPS = KILL_AT + 4 + max(4, 3 * TRIALS)   # a hang at each of TRIALS steps after it, among 3 × TRIALS


def wait_for(what, timeout, proc, interval=0.05):
    deadline = time.time() + timeout
    while not what():
        assert proc.poll() is None, finish(proc).stderr[-3000:]
        assert time.time() < deadline, f"waited {timeout} s"
        time.sleep(interval)
    return time.time()


def config(tmp_path, shards, name, **logging):
    """A short run of 2 ranks as 2 pipeline stages (DeepSpeed's pipeline groups), one micro-batch a step, one data
    worker each, a checkpoint every 3 steps, sample ids recorded."""
    return write_config(tmp_path / f"{name}.yaml", shards, tmp_path / name, data={"num_workers": 1},
                        parallel={"pp": 2}, train={"max_steps": STEPS, "hang_timeout": HANG_TIMEOUT,
                                                   "global_batch_size": 4, "micro_batch_size": 4},
                        checkpoint={"every": 3, "keep": 2}, logging={"sample_ids": True, **logging})


@pytest.mark.slow
def test_a_hang_is_found_and_a_hang_and_a_kill_9_are_restarted_to_the_uninterrupted_run(shards, tmp_path):
    """A run under LAUNCHER=torchrun launch/pretrain.sh --max-restarts (torchrun itself with --max-restarts 0): rank 0
    is killed (-9) after step 4, and a rank stalls at a later step (SYNTHFORMER_FAULTS stall@STEP@RANK, which fires
    once per run). Each hang is found within hang_timeout + 10 s of the step before it; every rank wrote its threads'
    stacks (the stalled one's in faults.py's `hang`) and its flight recorder's dump; the supervisor's line names the
    stalled rank; every process group of every rank, DeepSpeed's pipeline groups among them, waits hang_timeout +
    MARGIN_S in a collective (the ranks' records, and torch's own entries); the launcher relaunched by itself, each
    restart logged with its cause (metrics.jsonl, TensorBoard); W&B refused every launch (one warning line each) and
    no restart went to it; every loss and sample id the run logged equals those of the same run uninterrupted."""
    rng = random.Random(5)
    hangs = sorted((step, rng.randint(0, 1)) for step in rng.sample(range(KILL_AT + 4, STEPS), TRIALS))
    launch(config(tmp_path, shards, "straight"), 2)
    run = tmp_path / "run"
    with refusing_wandb() as wandb_env:
        cfg = config(tmp_path, shards, "run", wandb={"project": "p", "mode": "online"})
        proc = start(cfg, "--max-restarts", str(TRIALS + 1), env={
            "LAUNCHER": "torchrun", "NPROC": "2", "MASTER_PORT": str(free_local_port()), "RESTART_BACKOFF": "0.05",
            "SYNTHFORMER_FAULTS": ",".join(f"stall@{step}@{rank}" for step, rank in hangs), **wandb_env})
        wait_for(lambda: logged_step(run) >= KILL_AT, 300, proc)
        os.kill(trainer_ranks(proc.pid)[0].pid, signal.SIGKILL)
        hang_dir = run / "hang"
        for step, rank in hangs:
            last_beat = wait_for(lambda: logged_step(run) >= step - 1, 300, proc)
            found = wait_for(lambda: all((hang_dir / f"rank{r}.txt").exists() for r in (0, 1)), HANG_TIMEOUT + 60,
                             proc)
            assert found - last_beat <= HANG_TIMEOUT + 10, (step, found - last_beat)
            time.sleep(1.0)   # the files are written whole before the rank's line and exit
            stacks = (hang_dir / f"rank{rank}.txt").read_text()
            assert stacks.startswith(f"rank {rank} (pid ") and f"after finishing step {step - 1}," in stacks
            assert f'pretrain{os.sep}faults.py", line' in stacks and " in hang\n" in stacks, stacks
            dumps = {r: pickle.loads((hang_dir / "flight_recorder" / f"rank_{r}").read_bytes()) for r in (0, 1)}
            for r, dump in dumps.items():   # torch's own record of the collectives: those of the last steps (a
                last = {e["timeout_ms"] for e in dump["entries"][-10:]}   # save's wait SAVE_S: timeouts.raised)
                assert len(dump["entries"]) > 10 and (HANG_TIMEOUT + MARGIN_S) * 1000 in last and \
                    last <= {(HANG_TIMEOUT + MARGIN_S) * 1000, SAVE_S * 1000}, \
                    (r, collections.Counter(e["timeout_ms"] for e in dump["entries"]))
            hang_dir.rename(run / f"hang-{step}")   # the next hang writes anew
        r = finish(proc)
    assert r.returncode == 0, r.stderr[-3000:]
    print(f"hangs (step, rank): {hangs}")
    lines = r.stderr.splitlines()
    for step, rank in hangs:   # each rank's line; the supervisor's, naming the stalled rank
        assert any(line.startswith("error: rank ") and "made no progress for " in line and
                   f"after finishing step {step - 1}: stopped; the stacks of its threads are in {run}" in line
                   for line in lines), r.stderr[-3000:]
        named = f"error: rank {rank} hung; rank {1 - rank} waits for it in a collective (rank {rank} entered "
        assert any(line.startswith(named) for line in lines), r.stderr[-3000:]
    endings = [json.loads(line) for k in (0, 1) for line in open(run / "logs" / f"rank{k}.exits.jsonl")]
    hung = [e for e in endings if e["cls"] == "hang"]
    assert len(hung) == 2 * TRIALS
    groups = [g for e in hung for g in e["collectives"].values()]
    assert len(groups) >= 2 * 20 and {g["timeout_s"] for g in groups} == {HANG_TIMEOUT + MARGIN_S}
    descs = {g["desc"].split(" (", 1)[1].split(",")[0] for g in groups}   # megatron's names; DeepSpeed's "undefined"
    assert {"PIPELINE_MODEL_PARALLEL_GROUP", "DATA_PARALLEL_GROUP", "default_pg", "undefined"} <= descs, descs
    refused = [line for line in lines if line.startswith("warning: W&B could not start the run (")]
    assert len(refused) == TRIALS + 2, [line for line in lines if "W&B" in line or "wandb" in line.lower()]
    restarts = [row for row in metric_rows(run) + metric_rows(run, replayed=True) if "run/restarts" in row]
    causes = {row["run/restarts"]: row["run/restart_cause"] for row in restarts}
    assert sorted(causes) == list(range(1, TRIALS + 2)), causes
    assert causes[1].startswith("lost rank 0 ") and all(" hung; " in causes[k] for k in causes if k > 1), causes
    shown = tensorboard_scalars(run, "run/restarts")   # one point a step: a later restart at a step replaces one
    assert shown[max(shown)] == TRIALS + 1 and set(shown.values()) <= set(causes), shown   # before it (TensorBoard)
    assert record(run) == record(tmp_path / "straight")


def test_a_run_that_keeps_failing_stops_after_max_restarts_in_one_line(tmp_path):
    """The relauncher of launch/pretrain.sh --max-restarts N (pretrain/supervision/relaunch.py) around a launch that fails
    each time as a hung rank's does: N relaunches, each told its number and the cause; then one line, the exit status
    kept. A config error (exit 2) is not relaunched: the same command fails the same way."""
    attempts = tmp_path / "attempts"
    fail = (f"import os, sys; open({str(attempts)!r}, 'a').write(os.environ['SYNTHFORMER_RESTARTS'] + ' ' + "
            f"os.environ.get('SYNTHFORMER_RESTART_CAUSE', '-') + '\\n'); "
            f"print('error: rank 1 made no progress for 16 s', file=sys.stderr); sys.exit({HANG_EXIT})")
    relaunch = [PY, "-m", "pretrain.supervision", "--max-restarts", "2", "--backoff", "0.1", "--", PY, "-c"]
    run = lambda command: subprocess.run(relaunch + [command], cwd=ROOT, capture_output=True, text=True, timeout=60,
                                         env={**os.environ, "PYTHONPATH": ROOT})   # noqa: E731
    r = run(fail)
    assert r.returncode == HANG_EXIT, r.stderr
    assert attempts.read_text().splitlines() == ["0 -"] + ["%d rank 1 made no progress for 16 s" % k for k in (1, 2)]
    last = r.stderr.strip().splitlines()[-1]
    assert last == ("error: the run failed 3 times (launch/pretrain.sh --max-restarts 2); not restarting again. The "
                    "last failure: rank 1 made no progress for 16 s"), r.stderr
    assert [line for line in r.stderr.splitlines() if line.startswith("restart ")] == [
        "restart 1 of at most 2 in 0.1 s, from the newest checkpoint, after: rank 1 made no progress for 16 s",
        "restart 2 of at most 2 in 0.2 s, from the newest checkpoint, after: rank 1 made no progress for 16 s"]
    attempts.unlink()
    r = run(fail.replace(f"sys.exit({HANG_EXIT})", "sys.exit(2)"))
    assert r.returncode == 2 and attempts.read_text().splitlines() == ["0 -"], r.stderr


def test_the_watchdog_takes_steps_validation_saves_and_compilation_as_progress(tmp_path, monkeypatch):
    """supervise() wraps the trainer's steps, validation, images, scores, checkpoint saves and its loop from outside,
    and hears torch.compile start and end: each is a heartbeat (the trainer here is the smallest object with those)."""
    monkeypatch.delenv(RESTARTS, raising=False)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    done = []
    work = lambda name: lambda *args: done.append(name) or name   # noqa: E731
    trainer = SimpleNamespace(step=4, log=None, layout=SimpleNamespace(rank=0, collective_timeout_s=720.0),
                              cfg=SimpleNamespace(train=SimpleNamespace(hang_timeout=600.0, run_dir=str(tmp_path),
                                                                        compile=True, collective_timeout=None)),
                              checkpointer=SimpleNamespace(save=work("save"), partial_path=str),
                              train_step=work("train_step"),
                              validate=work("validate"), log_samples=work("log_samples"),
                              log_scores=work("log_scores"), train=work("train"))
    dog = supervise(trainer)
    compiled = torch.compile(lambda x: x * 2 + 1, backend="eager")
    try:
        for name, call in (("a step", trainer.train_step), ("validation", trainer.validate),
                           ("images", trainer.log_samples), ("scores", trainer.log_scores),
                           ("a save", lambda: trainer.checkpointer.save(5)),
                           ("the loop", trainer.train), ("a compilation", lambda: compiled(torch.ones(3)))):
            dog.last = before = 0.0
            call()
            assert dog.last > before, f"no heartbeat after {name}"
        assert done == ["train_step", "validate", "log_samples", "log_scores", "save", "train"]   # each ran, once
    finally:
        dog.stop()
    assert not (tmp_path / "hang").exists()


def test_a_rank_that_makes_no_progress_dumps_its_stacks_and_exits_in_one_line(tmp_path):
    """The watchdog alone, in a process stuck in a function of its own: within hang_timeout (+ a poll) it writes every
    thread's stack, names the stuck frame, prints one line (rank, last finished step, file) and exits HANG_EXIT."""
    script = (f"import time\nfrom pretrain.supervision.watchdog import Watchdog\n"
              f"Watchdog(1.0, {str(tmp_path)!r}, 3, lambda: 7).start()\n"
              f"def stuck_here():\n    time.sleep(120)\nstuck_here()\n")
    t0 = time.time()
    r = subprocess.run([PY, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == HANG_EXIT and time.time() - t0 < 1.0 + 10, (r.returncode, time.time() - t0, r.stderr)
    path = tmp_path / "hang" / "rank3.txt"
    assert r.stderr.strip().splitlines() == [f"error: rank 3 made no progress for 1 s (train.hang_timeout=1) after "
                                             f"finishing step 7: stopped; the stacks of its threads are in {path}"]
    stacks = path.read_text()
    assert "line 5 in stuck_here" in stacks and "in expire" in stacks, stacks   # the main thread's, the watchdog's
