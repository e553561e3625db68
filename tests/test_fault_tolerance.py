"""Atomic checkpoints and preemption: a damaged newest checkpoint is never resumed from; SIGTERM and the wall-clock
limit stop a run cleanly with a checkpoint of the current step, and the relaunch continues bit for bit."""
import json
import os
import signal
import time

import psutil
import pytest

from pretrain.checkpoint import verify
from tests.runs import finish, free_port, launch, losses, start, write_config

pytestmark = pytest.mark.slow


def config(tmp_path, shards, name, **train):
    return write_config(tmp_path / f"{name}.yaml", shards, tmp_path / name, train={"max_steps": 9, **train},
                        checkpoint={"every": 3, "keep": 5})


def test_damaged_newest_checkpoint_falls_back_to_the_previous_complete_one(shards, tmp_path):
    launch(config(tmp_path, shards, "straight"), 2)
    run = tmp_path / "crashed"
    cfg = config(tmp_path, shards, "crashed")
    launch(cfg, 2, "train.stop_after_steps=6")
    ckpts = run / "checkpoints"
    assert (ckpts / "latest").read_text() == "step_00000006"
    assert json.loads((ckpts / "step_00000006" / "complete.json").read_text())["step"] == 6
    # a save that died half-way: a file of step 6 cut short, and a stray partial directory of a later one
    victim = sorted((ckpts / "step_00000006").glob("*model_states.pt"))[0]
    victim.write_bytes(victim.read_bytes()[:100])
    (ckpts / "step_00000009.partial").mkdir()
    assert "has 100 bytes" in verify(str(ckpts / "step_00000006"))
    r = launch(cfg, 2)
    assert "resuming from step_00000003" in r.stdout and "resumed at step 3" in r.stdout
    assert losses(run) == losses(tmp_path / "straight")               # steps 4-9 redone, bit for bit
    assert not (ckpts / "step_00000009.partial").exists() and verify(str(ckpts / "step_00000009")) is None
    # resuming it with another model or layout: one line that says what to do, before DeepSpeed reads anything
    for override, words in (("model.n_layers=3", "model.n_layers=2"), ("parallel.tp=2", "tools/convert.py")):
        r = launch(cfg, 2, override, "train.max_steps=12", check=False)
        errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
        assert r.returncode != 0 and errors and words in errors[0] and "Traceback" not in r.stderr, r.stderr[-2000:]


def trainer_ranks(launcher: psutil.Process) -> list[psutil.Process]:
    """The trainer processes under a launcher: `python -u -m pretrain.train --local_rank=R CONFIG`."""
    return [p for p in launcher.children(recursive=True)
            if "pretrain.train" in p.cmdline() and any(a.startswith("--local_rank") for a in p.cmdline())]


def test_sigterm_stops_after_the_step_with_a_checkpoint_and_exit_0(shards, tmp_path):
    cfg = config(tmp_path, shards, "preempted", max_steps=2000)
    proc = start(cfg, env={"NPROC": "2", "MASTER_PORT": str(free_port())})
    metrics = tmp_path / "preempted" / "metrics.jsonl"
    deadline = time.time() + 300
    while not (metrics.exists() and '"train/loss"' in metrics.read_text()) and time.time() < deadline:
        time.sleep(0.2)
    ranks = trainer_ranks(psutil.Process(proc.pid))
    assert len(ranks) == 2
    for p in ranks:                                     # as SLURM does: every task of the job step gets the signal
        p.send_signal(signal.SIGTERM)
    t0 = time.time()
    r = finish(proc)
    assert r.returncode == 0, r.stderr[-2000:]
    assert time.time() - t0 < 60
    stopped = max(losses(tmp_path / "preempted"))
    assert f"stopped at step {stopped} (SIGTERM)" in r.stdout and stopped < 2000
    assert (tmp_path / "preempted" / "checkpoints" / "latest").read_text() == f"step_{stopped:08d}"
    # the relaunch continues exactly: the same losses as a run that was never stopped
    r = launch(cfg, 2, "train.stop_after_steps=2")
    assert f"resumed at step {stopped}" in r.stdout
    launch(config(tmp_path, shards, "reference", max_steps=2000), 2, f"train.stop_after_steps={stopped + 2}")
    assert losses(tmp_path / "preempted") == losses(tmp_path / "reference")


def test_wall_clock_limit_stops_cleanly(shards, tmp_path):
    r = launch(config(tmp_path, shards, "limited", max_steps=2000, max_wall_minutes=0.001), 2)
    stopped = max(losses(tmp_path / "limited"))
    assert stopped < 100 and f"stopped at step {stopped} (train.max_wall_minutes=0.001 reached)" in r.stdout
    assert (tmp_path / "limited" / "checkpoints" / "latest").read_text() == f"step_{stopped:08d}"
