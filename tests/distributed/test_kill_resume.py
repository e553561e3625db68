"""Crashes at random moments: `kill -9` of one rank at a random step (its shards streamed over HTTP), and death in
the middle of a checkpoint save at a random phase (shards on disk). Each time the same command is launched again; at
the end every loss the run ever logged (before and after each crash) and every sample id it read equal those of a run
that was never interrupted and read the local directory, bit for bit. And a blend with data.stages killed (kill -9) one
step before its stage boundary and one step after: the same, and a source is not restarted at the boundary."""
import os
import random
import shutil
import signal
import time

import pytest

from model.accounting import train_flops_per_token
from pretrain.checkpoints.resume import newest_complete
from pretrain.config import load_config
from pretrain.faults import SAVE_PHASES
from tests.support.http_shards import ShardServer
from tests.support.runs import (blend_sources, finish, free_local_port, launch, logged_step, metric_rows, output,
                                record, reference_config, start, trainer_ranks)

pytestmark = pytest.mark.slow
# SYNTHFORMER_KILL_TRIALS=N: N random trials of each kind (10 for a thorough run); by default 3 kill -9 trials, and
# one kill in a save for each place a rank can die in one (every save phase of rank 0, the two of rank 1, and the
# background write of checkpoint.async_save on rank 0: its writer thread dies with it after the first file)
TRIALS = int(os.environ.get("SYNTHFORMER_KILL_TRIALS", 0))
STEPS, EVERY = 40, 3   # the reference config's
ASYNC = "checkpoint.async_save=true"
IN_BACKGROUND = ("writing",)   # the phases of an async save only
SAVE_KILLS = ([(p, 0) for p in SAVE_PHASES] +   # rank 1 commits nothing
              [(p, 1) for p in ("begin", "engine")])


@pytest.fixture(scope="module")
def reference(reference_run):
    """The uninterrupted run: {step: loss}, and {rank: {step: ids}}."""
    return record(reference_run)


def wait_until_started(proc):
    """Until the relaunched run has resumed (and moved the rows it will replay aside) or died."""
    while not ("resumed at step" in output(proc) or "starting fresh" in output(proc)) and proc.poll() is None:
        time.sleep(0.01)


def latest(run) -> int:
    """The step `latest` names (0: none)."""
    path = run / "checkpoints" / "latest"
    return int(path.read_text().split("_")[1]) if path.exists() else 0


def resume_point(run) -> int:
    """The step a relaunch resumes at: `latest`'s, or with none yet the newest complete checkpoint (a kill between a
    save's rename and its `latest` leaves the first checkpoint complete and unnamed: it is resumed)."""
    tag = newest_complete(str(run / "checkpoints")) if (run / "checkpoints").is_dir() else None
    return int(tag.split("_")[1]) if tag else 0


def relaunch(cfg, env=None):
    return start(cfg, env={"NPROC": "2", "MASTER_PORT": str(free_local_port()), **(env or {})})


def check_resumed(out: str, step: int):
    assert (f"resumed at step {step}" if step else "starting fresh") in out, out[-3000:]


def test_kill_9_at_a_random_step_resumes_bit_for_bit(shards, tmp_path, reference):
    with ShardServer(shards) as srv:   # the ranks stream their shards from http://127.0.0.1:PORT
        kill_9_and_relaunch(reference_config(tmp_path, srv.url, "run"), tmp_path / "run", reference)


def kill_9_and_relaunch(cfg, run, reference):
    rng = random.Random(7)
    resume_at, kills = 0, []
    for _ in range(TRIALS or 3):
        target = min(STEPS - 1, resume_at + rng.randint(1, 2 * EVERY + 1))
        proc = relaunch(cfg)
        wait_until_started(proc)
        while logged_step(run) < target and proc.poll() is None:
            time.sleep(0.005)
        victim, ranks = rng.randint(0, 1), trainer_ranks(proc.pid)
        assert proc.poll() is None and len(ranks) == 2, finish(proc).stderr[-3000:]
        os.kill(ranks[victim].pid, signal.SIGKILL)
        killed_at = logged_step(run)
        r = finish(proc)
        assert r.returncode != 0
        check_resumed(r.stdout, resume_at)
        # the rank left standing says, in one line and without a traceback, which one it lost and what to do; the
        # supervisor's one line after it names that rank's record (pretrain/supervision/)
        errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
        assert "Traceback" not in r.stderr and len(errors) == 2, r.stderr[-3000:]
        assert f"lost rank {victim} " in errors[0] and "relaunch the same command" in errors[0], errors[0]
        assert errors[1].startswith(f"error: rank {1 - victim} failed first (lost rank): lost rank {victim} "), errors
        kills.append((killed_at, victim))
        resume_at = resume_point(run)
        assert resume_at <= killed_at
    r = finish(relaunch(cfg))
    assert r.returncode == 0, r.stderr[-3000:]
    check_resumed(r.stdout, resume_at)
    print(f"kill -9 at (step, rank): {kills}")
    loss, ids = record(run)
    assert loss == reference[0] and ids == reference[1]


def test_kill_during_a_checkpoint_save_resumes_from_the_previous_one(shards, tmp_path, reference):
    """Also saves in the background: a kill in the writer thread's write, and the last launch saves asynchronously
    to the end (a checkpoint published at a later step resumes as one saved in place, and its losses are the
    reference's)."""
    rng, run, cfg = random.Random(11), tmp_path / "run", reference_config(tmp_path, shards, "run")
    trials = [rng.choice(SAVE_KILLS) for _ in range(TRIALS)] if TRIALS else SAVE_KILLS   # each place once
    resume_at, kills = 0, []
    for phase, rank in trials:
        save = resume_at + EVERY * rng.randint(1, 2)
        shutil.rmtree(run / "faults", ignore_errors=True)   # a new injection: a fault's marker stops it firing twice
        # the ranks started directly (the launcher's part, a one-line message, is test_kill_9's)
        r = launch(cfg, 2, *[ASYNC] * (phase in IN_BACKGROUND), check=False,
                   env={"SYNTHFORMER_FAULTS": f"kill-save-{phase}@{save}@{rank}"})
        assert r.returncode != 0
        check_resumed(r.stdout, resume_at)
        assert f"saved checkpoint {run / 'checkpoints' / f'step_{save:08d}'}" not in r.stdout
        kills.append((save, phase, rank))
        assert latest(run) == save - EVERY, (kills, latest(run))   # the one before the interrupted save
        resume_at = save - EVERY
    r = launch(cfg, 2, ASYNC)
    check_resumed(r.stdout, resume_at)
    assert f"saved checkpoint {run / 'checkpoints' / f'step_{STEPS:08d}'}" in r.stdout and latest(run) == STEPS
    print(f"killed in the save of (step, phase, rank): {kills}")
    loss, ids = record(run)
    assert loss == reference[0] and ids == reference[1]


def test_kill_9_on_each_side_of_a_stage_boundary_resumes_bit_for_bit(blend, tmp_path):
    """An annealing stage at the decay: a and b (c of weight 0: it joins at the stage) at rows of 16 (data.seq_len,
    2 a sample of model.max_seq_len=32), then from step 6 a and c 1:3 at the full 32 with decay: true
    (train.decay=wsd decays over steps 6-10); a checkpoint every 2. Rank 1 is killed (SIGKILL, from itself) in step
    5, the relaunch resumes at 4 and crosses the boundary, rank 0 is killed in step 7, the next resumes at 6 (in the
    stage) and ends: every loss and sample id equal an uninterrupted run's; the rows of stage 0 are each sample's
    two halves; source a, drawn in both stages, gives no sample twice (its epoch carries over the boundary and the
    change of length); the LR decays from the stage on."""
    sources = [{**s, "weight": 0 if s["name"] == "c" else s["weight"]} for s in blend_sources(blend)]
    data = {"shard_dir": None, "sources": sources, "seq_len": 16,
            "stages": [{"step": 6, "weights": {"a": 1, "c": 3}, "seq_len": 32, "decay": True}]}
    config = lambda name: reference_config(tmp_path, None, name, data=data,  # noqa: E731
                                           train={"max_steps": 10, "decay": "wsd"}, checkpoint={"every": 2})
    launch(config("straight"), 2)
    chain, faults = config("chain"), {"SYNTHFORMER_FAULTS": "kill@5@1,kill@7@0"}   # each fires once (its marker)
    for resumed in (0, 4):
        r = launch(chain, 2, check=False, env=faults)
        assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]
        check_resumed(r.stdout, resumed)
    check_resumed(launch(chain, 2, env=faults).stdout, 6)
    (loss, ids), (want_loss, want_ids) = record(tmp_path / "chain"), record(tmp_path / "straight")
    assert sorted(loss) == list(range(1, 11)) and loss == want_loss and ids == want_ids
    halves = [ids[rank][step] for step in range(1, 7) for rank in (0, 1)]   # steps 1-6: stage 0's rows of 16
    assert all(len(b) == 8 and [i[-4:] for i in b] == ["0of2", "1of2"] * 4 and b[::2] == [i[:-4] + "0of2" for i in
                                                                                         b[1::2]] for b in halves)
    drawn = [i.removesuffix("/0of2") for step in sorted(ids[0]) for rank in (0, 1) for i in ids[rank][step]
             if not i.endswith("/1of2")]   # a sample of 32 once: its first row's id, or its own
    first_c = next(k for k, i in enumerate(drawn) if i.startswith("c/"))
    a = [i for i in drawn if i.startswith("a/")]
    assert first_c == 6 * 8 and len(a) > 30 and len(set(a)) == len(a)
    lr = {row["step"]: row["train/lr"] for row in metric_rows(tmp_path / "chain") if "train/lr" in row}
    assert lr[4] == lr[6] == 3e-3 > lr[8] > lr[10]
    model = load_config(chain).model   # the throughput's FLOPs: at 16 tokens a row to step 6, then at 32
    per_token = {row["step"]: row["perf/tflops_per_device"] * 2e12 / row["perf/tokens_per_s"]
                 for row in metric_rows(tmp_path / "straight") if "perf/tokens_per_s" in row}
    assert all(per_token[s] == pytest.approx(train_flops_per_token(model, 16 if s <= 6 else 32)) for s in per_token)
    assert train_flops_per_token(model, 16) < train_flops_per_token(model, 32) and len(per_token) == 10
