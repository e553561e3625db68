"""Atomic checkpoints and preemption: a damaged newest checkpoint is never resumed from; SIGTERM and the wall-clock
limit stop a run cleanly with a checkpoint of the current step, and the relaunch continues bit for bit."""
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import torch

from pretrain.checkpoints.durable import verify
from pretrain.supervision.classes import CONFIG, STOPPED
from tests.support.runs import (PY, ROOT, finish, free_local_port, launch, losses, metric_rows, output,
                                reference_config, start, trainer_ranks, write_config)

pytestmark = pytest.mark.slow


def config(tmp_path, shards, name, **train):
    return write_config(tmp_path / f"{name}.yaml", shards, tmp_path / name, train={"max_steps": 9, **train},
                        checkpoint={"every": 3, "keep": 5})


def test_damaged_newest_checkpoint_falls_back_to_the_previous_complete_one(shards, tmp_path, reference_run):
    run = tmp_path / "crashed"
    cfg = reference_config(tmp_path, shards, "crashed")
    launch(cfg, 2, "train.stop_after_steps=6")
    ckpts = run / "checkpoints"
    assert (ckpts / "latest").read_text() == "step_00000006"
    assert json.loads((ckpts / "step_00000006" / "complete.json").read_text())["step"] == 6
    # a save that died half-way: a file of step 6 cut short, and a stray partial directory of a later one
    victim = sorted((ckpts / "step_00000006").glob("*model_states.pt"))[0]
    victim.write_bytes(victim.read_bytes()[:100])
    (ckpts / "step_00000009.partial").mkdir()
    assert "has 100 bytes" in verify(str(ckpts / "step_00000006"))
    r = launch(cfg, 2, "train.stop_after_steps=6")
    assert "resuming from step_00000003" in r.stdout and "resumed at step 3" in r.stdout
    reference = losses(reference_run)
    assert losses(run) == {s: reference[s] for s in range(1, 10)}     # steps 4-9 redone, bit for bit
    steps = [row["step"] for row in metric_rows(run) if "train/loss" in row]
    assert steps == list(range(1, 10))                                # each step once; the replaced rows aside:
    assert [row["step"] for row in metric_rows(run, replayed=True) if "train/loss" in row] == [4, 5, 6]
    assert not (ckpts / "step_00000009.partial").exists() and verify(str(ckpts / "step_00000009")) is None
    # resuming it with another model or layout: one line that says what to do, before DeepSpeed reads anything
    for override, words in (("model.n_layers=3", "model.n_layers=2"), ("parallel.tp=2", "tools/convert.py")):
        r = launch(cfg, 2, override, "train.max_steps=12", check=False, launcher=True)
        errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
        assert r.returncode != 0 and errors and words in errors[0] and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_sigterm_stops_after_the_step_with_a_checkpoint_and_exit_0(shards, tmp_path):
    cfg = config(tmp_path, shards, "preempted", max_steps=2000)
    proc = start(cfg, env={"NPROC": "2", "MASTER_PORT": str(free_local_port())})
    metrics = tmp_path / "preempted" / "metrics.jsonl"
    deadline = time.time() + 300
    while not (metrics.exists() and '"train/loss"' in metrics.read_text()) and time.time() < deadline:
        time.sleep(0.2)
    ranks = trainer_ranks(proc.pid)
    assert len(ranks) == 2
    for p in ranks.values():                                     # as SLURM does: every task of the job step gets the signal
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


def test_a_preemption_signal_to_every_process_of_the_launch_saves_the_step_and_exits_0(shards, tmp_path):
    """As SLURM delivers `--signal` and `scancel --signal` (proctrack/cgroup): to every process of the job step, the
    supervisor, DeepSpeed's two launcher processes and the DataLoader workers as well as the ranks. The launchers must
    not end the ranks, the workers must read on: the ranks stop after the step, save it, and every exit status is 0."""
    run = tmp_path / "tree"
    cfg = write_config(tmp_path / "tree.yaml", shards, run, data={"num_workers": 2}, train={"max_steps": 2000},
                       checkpoint={"every": 1000})
    proc = start(cfg, env={"NPROC": "2", "MASTER_PORT": str(free_local_port())})
    deadline = time.time() + 300
    while not ((run / "metrics.jsonl").exists() and '"train/loss"' in (run / "metrics.jsonl").read_text()):
        assert time.time() < deadline and proc.poll() is None, output(proc)[-2000:]
        time.sleep(0.2)
    tree = [psutil.Process(proc.pid)] + psutil.Process(proc.pid).children(recursive=True)
    ranks = trainer_ranks(proc.pid)
    assert len(ranks) == 2 and all(len(p.children()) == 2 for p in ranks.values())   # 2 DataLoader workers each
    for p in tree:                                               # every process of the tree, at once
        p.send_signal(signal.SIGTERM)
    r = finish(proc)
    assert r.returncode == 0, r.stderr[-3000:]
    stopped = max(losses(run))
    assert f"stopped at step {stopped} (SIGTERM)" in r.stdout and "Killing subprocess" not in r.stdout + r.stderr
    assert (run / "checkpoints" / "latest").read_text() == f"step_{stopped:08d}"
    ends = [json.loads((run / "logs" / f"rank{k}.exits.jsonl").read_text().splitlines()[-1]) for k in (0, 1)]
    assert [(e["cls"], e["step"]) for e in ends] == [("preempted", stopped)] * 2


def test_wall_clock_limit_stops_cleanly(shards, tmp_path):
    r = launch(config(tmp_path, shards, "limited", max_steps=2000, max_wall_minutes=0.001), 2)
    stopped = max(losses(tmp_path / "limited"))
    assert stopped < 100 and f"stopped at step {stopped} (train.max_wall_minutes=0.001 reached)" in r.stdout
    assert (tmp_path / "limited" / "checkpoints" / "latest").read_text() == f"step_{stopped:08d}"


def weights(checkpoint) -> dict:
    """Full fp32 weights of a checkpoint directory (ZeRO shards consolidated)."""
    from pretrain.checkpoints.ds_checkpoint import read_weights

    return read_weights(str(checkpoint))[1]


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ZeRO-0 fp32 and ZeRO-1 bf16 (the cluster configs): GuardedAdamW drops the step; ZeRO-2 fp32: DeepSpeed's optimizer
@pytest.mark.parametrize("zero,precision", [(0, "fp32"), (2, "fp32"), (1, "bf16")])
def test_nan_steps_are_skipped_counted_and_too_many_stop_the_run(shards, tmp_path, zero, precision):
    run = tmp_path / "nan"
    cfg = write_config(tmp_path / "nan.yaml", shards, run, parallel={"zero_stage": zero},
                       train={"max_steps": 12, "max_consecutive_skips": 3, "precision": precision},
                       checkpoint={"every": 1, "keep": 20})
    # NaN loss at step 4 on rank 1 only, then at steps 6-8 (on one rank or the other): 3 in a row stop the run
    r = launch(cfg, 2, check=False, env={"SYNTHFORMER_FAULTS": "nan@4@1,nan@6,nan@7@1,nan@8"})
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == STOPPED.exit and errors, r.stderr[-3000:]   # a class a relaunch cannot fix, on every rank
    assert {json.loads(line)["cls"] for k in (0, 1) for line in open(run / "logs" / f"rank{k}.exits.jsonl")} == \
        {STOPPED.name}
    assert "3 optimizer steps in a row were skipped (non-finite loss or gradient; steps 6-8)" in errors[0]
    assert "step 4: update skipped (non-finite loss or gradient); 1 in a row, 1 in all" in r.stdout
    assert "step 7: update skipped (non-finite loss or gradient); 2 in a row, 3 in all" in r.stdout
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    skipped = {row["step"]: row["train/skipped_steps"] for row in rows if "train/skipped_steps" in row}
    assert skipped[3] == 0 and skipped[4] == 1 and skipped[5] == 1 and skipped[7] == 3
    # the run stopped before saving step 8; step 7 is complete and latest
    ckpts = run / "checkpoints"
    assert (ckpts / "latest").read_text() == "step_00000007" and not (ckpts / "step_00000008").exists()
    assert verify(str(ckpts / "step_00000007")) is None
    w = {s: weights(ckpts / f"step_{s:08d}") for s in (3, 4, 5, 7)}
    assert same(w[3], w[4]) and not same(w[4], w[5]) and same(w[5], w[7])   # a skipped step changes no weight
    assert all(torch.isfinite(t).all() for t in w[7].values())


def test_disk_full_while_saving_keeps_the_previous_checkpoint(shards, tmp_path):
    """A real full disk: the checkpoint directory is a 2.5 MB tmpfs (one checkpoint fits, not two), mounted in a
    private user + mount namespace; then the same filesystem is grown and the same command resumes."""
    if subprocess.run(["unshare", "-Urm", "true"], capture_output=True).returncode:
        pytest.skip("unshare -Urm (user and mount namespaces) is not allowed here: cannot mount a small tmpfs")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    cfg = write_config(tmp_path / "full.yaml", shards, tmp_path / "full", train={"max_steps": 9},
                       checkpoint={"every": 3, "keep": 5, "dir": str(mnt)})
    script = (f"mount -t tmpfs -o size=2500k tmpfs {mnt}\n"
              f"MASTER_PORT={free_local_port()} launch/pretrain.sh {cfg}; echo exit=$?\n"
              f"cp -a {mnt} {tmp_path}/after-full\n"
              f"mount -o remount,size=64m {mnt}\n"
              f"MASTER_PORT={free_local_port()} launch/pretrain.sh {cfg}; echo exit=$?\n"
              f"cp -a {mnt} {tmp_path}/after-resume\n")
    r = subprocess.run(["unshare", "-Urm", "bash", "-c", script], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHON": PY, "NPROC": "2"}, timeout=600)
    codes = re.findall(r"^exit=(\d+)$", r.stdout, re.M)
    assert len(codes) == 2 and codes[0] != "0" and codes[1] == "0", r.stdout[-3000:] + r.stderr[-3000:]
    second = r.stdout.split("exit=")[1]
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: could not write checkpoint")]
    assert errors and f"step_00000006 in {mnt}" in errors[0], r.stderr[-3000:]
    print(errors[0])
    assert "the disk is full, 0.0 MiB free" in errors[0]
    assert "the previous checkpoint step_00000003 is kept as latest" in errors[0]
    full = tmp_path / "after-full"
    assert (full / "latest").read_text() == "step_00000003" and verify(str(full / "step_00000003")) is None
    assert not (full / "step_00000006").exists()
    assert "resumed at step 3" in second, second[-3000:]
    assert (tmp_path / "after-resume" / "latest").read_text() == "step_00000009"


def corrupt(path):
    """Garbage over the first tar header: the same size, a bad checksum."""
    with open(path, "r+b") as f:
        f.seek(100)
        f.write(bytes(range(200)))


def test_bad_shards_in_a_run_are_named_and_skipped_or_fatal(shards, tmp_path):
    """A truncated shard (found by its size) and a corrupt one (by its hash), both when first read: with
    data.bad_shards=skip both are named, counted in TensorBoard's data/skipped_shards and left out; with the default
    (fail) the run stops with one line naming the file."""
    from tokendata.stream import TokenStream

    from pretrain.config import DataSection

    bad = tmp_path / "shards"
    shutil.copytree(shards, bad)
    seed = DataSection(shard_dir=str(bad)).seed   # the default of data.seed, as the run below uses it
    stream = TokenStream(str(bad), 4, 32, dp_rank=0, dp_world=2, seed=seed, bad_shards="skip")
    first_read, second = stream.upcoming_shards()[:2]   # rank 0 reads them first
    truncated = bad / second
    os.truncate(truncated, os.path.getsize(truncated) // 2)
    corrupt(bad / first_read)

    run = tmp_path / "skip"
    cfg = write_config(tmp_path / "skip.yaml", str(bad), run, data={"bad_shards": "skip"}, train={"max_steps": 4})
    r = launch(cfg, 2, "logging.sample_ids=true")
    assert f"warning: shard {truncated} has " in r.stdout + r.stderr and "(truncated?)" in r.stdout + r.stderr
    assert f"warning: shard {bad / first_read} has content hash" in r.stdout + r.stderr   # data.verify=hash
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [row["data/skipped_shards"] for row in rows if "data/skipped_shards" in row][-1] == 2
    seen = {i for rank in (0, 1) for row in (json.loads(l) for l in open(run / "sample_ids" / f"rank{rank}.jsonl"))
            for i in row["ids"]}
    assert not any(i.startswith(first_read[:-4]) or i.startswith(truncated.name[:-4]) for i in seen)

    (bad / first_read).write_bytes((Path(shards) / first_read).read_bytes())   # the corrupt one mended
    os.truncate(truncated, 0)    # and with the default, the empty one ends the run in one line when read
    cfg = write_config(tmp_path / "fail.yaml", str(bad), tmp_path / "fail", train={"max_steps": 4})
    r = launch(cfg, 2, check=False, launcher=True)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode != 0 and errors and f"shard {truncated} is empty (0 bytes)" in errors[0], r.stderr[-3000:]
    assert "data.bad_shards=skip" in errors[0] and "Traceback" not in r.stderr
    truncated.write_bytes((Path(shards) / truncated.name).read_bytes())   # only corrupt content is left
    first_read = TokenStream(str(bad), 4, 32, dp_rank=0, dp_world=2, seed=seed).upcoming_shards()[0]
    corrupt(bad / first_read)
    # found while training: a data error, which --max-restarts does not relaunch (the same shard fails the same way)
    r = launch(cfg, 2, "--max-restarts", "2", check=False, launcher=True, env={"RESTART_BACKOFF": "0.1"})
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == CONFIG.exit and errors and f"shard {bad / first_read} has content hash" in errors[0], \
        r.stderr[-3000:]
    assert not [line for line in r.stderr.splitlines() if line.startswith("restart ")], r.stderr[-3000:]
    assert errors[-2].startswith(f"error: rank 0 failed first (config or data error): shard {bad / first_read} "
                                 f"has content hash"), errors
    assert errors[-1].startswith("error: not relaunching: a relaunch cannot fix a config or data error"), errors
