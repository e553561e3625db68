"""Operating a run: W&B beside TensorBoard, downstream scores during training, the ETA, the `deepspeed:` section, and
the memory plan at the head of the log — all on one run of the real trainer, interrupted and resumed:

    launch 1: TP 2, ZeRO-2 with deepspeed: {zero_optimization: {overlap_comm: true, reduce_bucket_size: 5e7}},
              W&B offline, austen_cloze scored every 4 steps, stopped after step 6 (checkpoints at 4 and 6);
    then the checkpoint of step 6 is removed, as if the launch had died after logging step 6 and before saving it;
    launch 2: resumes at step 4 and trains to step 8.

The real wandb library (pinned) writes one offline run directory per launch; both are read back through its own
protobuf records and together must hold what metrics.jsonl holds, each step once. The scores logged at step 4 must
equal tools/run_lm_eval.py's on the step-4 checkpoint (fp32, the same batch size and documents).
"""
import glob
import json
import os
import shutil
import struct
import subprocess

import pytest
import yaml

from tests.support.runs import PY, ROOT, launch, metric_rows, run_py, write_config

EVAL = {"eval_tasks": ["austen_cloze"], "eval_every": 4, "eval_batch_size": 8, "eval_limit": 12}
PASS_THROUGH = {"zero_optimization": {"overlap_comm": True, "reduce_bucket_size": 5e7}}
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "WANDB_SILENT": "true"}


# ---- reading W&B's offline files with the library's own protobuf records --------------------------------------------
def wandb_records(path):
    """The Records of a .wandb file: W&B's LevelDB-log framing (7-byte file header ':W&B', 32 KiB blocks of records,
    each a 7-byte header — crc, length, type full/first/middle/last — and its bytes) around wandb_internal Records."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, part = open(path, "rb").read(), 7, 32768, b""
    assert data[:4] == b":W&B", path
    while pos + 7 <= len(data):
        if block - pos % block < 7:                     # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        part = chunk if kind in (1, 2) else part + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(part)
            yield record


def wandb_history(run_dir):
    """[(run record, {metric: its step metric}, {training step: {key: value}})] of each offline run directory of
    `run_dir`, in launch order; the rows by the training step each carries (trainer/step)."""
    out = []
    for path in sorted(glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "*.wandb"))):
        run, metrics, rows = None, {}, {}
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run = record.run
            elif kind == "metric":
                metrics[record.metric.name or record.metric.glob_name] = record.metric.step_metric
            elif kind == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                rows.setdefault(int(items["trainer/step"]), {}).update(items)
        out.append((run, metrics, rows))
    return out


@pytest.fixture(scope="module")
def operated(shards, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("operate")
    config = write_config(tmp / "run.yaml", shards, tmp / "run", parallel={"tp": 2, "zero_stage": 2},
                          train={"max_steps": 8, "global_batch_size": 4, "micro_batch_size": 4},
                          checkpoint={"every": 4},
                          logging={"every": 1, "val_every": 4, "image_every": 4, "sample_tokens": 4,
                                   "wandb": {"project": "synthformer-tests", "mode": "offline", "tags": ["ci"]},
                                   **EVAL})
    tree = yaml.safe_load(open(config))
    tree["deepspeed"] = PASS_THROUGH
    yaml.safe_dump(tree, open(config, "w"))
    env = {**OFFLINE, "HF_DATASETS_CACHE": str(tmp / "datasets-cache")}
    first = launch(config, 2, "train.stop_after_steps=6", env=env)
    run = tmp / "run"
    scores_at_4 = {k: v for r in metric_rows(run) if r["step"] == 4 for k, v in r.items() if k.startswith("eval/")}
    shutil.copytree(run / "checkpoints" / "step_00000004", tmp / "step_00000004")   # for run_lm_eval, untouched
    shutil.rmtree(run / "checkpoints" / "step_00000006")                          # died before saving step 6
    (run / "checkpoints" / "latest").write_text("step_00000004")
    second = launch(config, 2, env=env)
    return {"run": run, "logs": (first.stdout, second.stdout), "scores_at_4": scores_at_4, "tmp": tmp, "env": env}


@pytest.mark.slow
def test_wandb_offline_runs_read_back_equal_metrics_jsonl(operated):
    """Both launches open the same W&B run by its id (no rewind: W&B's resume_from is a preview that self-managed
    servers lack), every row carries the training step as its x axis, and the steps launch 2 replays (5, 6) are not
    sent again: W&B holds each step once, as first logged."""
    run = operated["run"]
    (run1, metrics1, first), (run2, metrics2, second) = wandb_history(run)
    run_id = (run / "wandb-run-id").read_text().strip()
    assert run1.run_id == run2.run_id == run_id                           # one W&B run, both launches
    assert not run1.HasField("branch_point") and not run2.HasField("branch_point")
    assert metrics1 == metrics2 == {"trainer/step": "", "*": "trainer/step"}
    assert max(first) == 6 and min(second) == 7                           # 5 and 6, replayed, not sent twice
    merged = {**first, **second}
    expected = {}   # each step as first logged: 5 and 6 as launch 1 logged them (metrics.replayed.jsonl)
    for row in [r for r in metric_rows(run) if r["step"] not in (5, 6)] + metric_rows(run, replayed=True):
        expected.setdefault(row["step"], {}).update({k: v for k, v in row.items() if k != "step"})
    assert sorted(merged) == sorted(expected) == list(range(0, 9))   # each step once, none dropped
    for step, values in expected.items():
        media = {k.removesuffix("/_type"): v for k, v in merged[step].items() if k.endswith("/_type")}
        got = {k: v for k, v in merged[step].items()
               if not k.startswith("_") and k != "trainer/step" and k.rpartition("/")[0] not in media}
        assert got == pytest.approx(values, rel=1e-12), step
        if step in (4, 8):   # the attention images and the text sample, as in TensorBoard
            assert media == {"attention/layer_00": "image-file", "attention/layer_01": "image-file",
                             "sample": "html-file"}, media
        else:
            assert not media
    replayed = {r["step"]: r["train/loss"] for r in metric_rows(run) if r["step"] in (5, 6) and "train/loss" in r}
    assert replayed == {s: first[s]["train/loss"] for s in (5, 6)}   # the replay gave the same losses, bit for bit
    assert [p.rpartition("-")[2] for p in glob.glob(str(run / "wandb" / "offline-run-*"))] == [run_id, run_id]


def test_a_refused_wandb_is_one_warning_and_the_logger_goes_on(tmp_path, capsys, monkeypatch):
    """A W&B server that refuses the run (403, as a self-managed server without rewind, or without the project, does):
    one warning line, and the Logger writes metrics.jsonl and TensorBoard as without W&B (before, the refusal raised
    from the trainer's construction, and each relaunch spent a restart on it)."""
    from pretrain.config import WandbSection
    from pretrain.observe.metrics import Logger
    from tests.support.wandb_server import refusing_wandb

    with refusing_wandb() as wandb_env:
        for key, value in wandb_env.items():
            monkeypatch.setenv(key, value)
        log = Logger(True, str(tmp_path / "tb"), str(tmp_path / "run"), WandbSection(project="p", mode="online"), {})
        log.resume_at(0)
        log.scalars(1, {"train/loss": 2.5})
        log.close()
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: W&B")]
    assert warnings == [warnings[0]] and warnings[0].startswith("warning: W&B could not start the run (CommError: ")
    assert "403" in warnings[0] and warnings[0].endswith("training goes on without it (metrics.jsonl and TensorBoard "
                                                         "have every step)")
    assert metric_rows(tmp_path / "run") == [{"step": 1, "train/loss": 2.5}]


@pytest.mark.slow
def test_scores_during_training_equal_run_lm_eval_on_the_checkpoint(operated):
    logged = operated["scores_at_4"]
    assert {"eval/austen_cloze/acc", "eval/austen_cloze/perplexity"} <= set(logged), logged
    out = operated["tmp"] / "lm-eval"
    r = run_py([PY, os.path.join(ROOT, "tools", "run_lm_eval.py"), "--model", "synthformer", "--model_args",
                f"path={operated['tmp'] / 'step_00000004'},batch_size={EVAL['eval_batch_size']}",
                "--tasks", "austen_cloze", "--limit", str(EVAL["eval_limit"]), "--output_path", str(out)],
               env={**os.environ, **operated["env"], "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stderr[-2000:]
    results = json.load(open(glob.glob(str(out / "**" / "results_*.json"), recursive=True)[0]))["results"]
    reference = {f"eval/austen_cloze/{k.split(',')[0]}": v for k, v in results["austen_cloze"].items()
                 if isinstance(v, float)}
    assert set(logged) <= set(reference)   # the reference also has bootstrapped standard errors
    assert logged == pytest.approx({k: reference[k] for k in logged}, rel=1e-6)
    first, second = operated["logs"]
    line = next(l for l in first.splitlines() if "eval at step 4:" in l)
    assert "austen_cloze/acc" in line and "s added)" in line     # the time it took, in the log line
    assert "eval at step 8:" in second                           # and at the end of the run


@pytest.mark.slow
def test_the_log_opens_with_the_memory_plan_and_reports_eta_and_the_deepspeed_section(operated):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first, second = operated["logs"]
    lines = first.splitlines()
    plan = next(i for i, l in enumerate(lines) if "memory plan per rank: tp 2 × pp 1 × dp 1, ZeRO-2, micro-batch 4 × n "
                                                   "32, fp32" in l)
    assert plan < next(i for i, l in enumerate(lines) if "2 ranks (tp=2, cp=1, pp=1, dp=1)" in l)   # it heads the log
    assert ("deepspeed section applied, as the engine reports it: zero_optimization.overlap_comm=True, "
            "zero_optimization.reduce_bucket_size=50000000") in first
    steps = [l for l in second.splitlines() if "| loss " in l]
    assert steps and all("| elapsed " in l and "| ETA " in l for l in steps)
    assert "ETA 0:00:00" in steps[-1] or "ETA 0:00:0" in steps[-1]
    acc = EventAccumulator(str(operated["run"] / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    assert {"time/eta_s", "time/elapsed_s", "eval/austen_cloze/acc"} <= set(acc.Tags()["scalars"])
    rows = [r for r in metric_rows(operated["run"]) if "time/eta_s" in r]
    assert rows[-1]["step"] == 8 and rows[-1]["time/eta_s"] >= 0


def test_without_wandb_installed_one_line_names_the_extra(shards, tmp_path):
    fake = tmp_path / "site"
    (fake / "wandb").mkdir(parents=True)
    (fake / "wandb" / "__init__.py").write_text("raise ImportError('No module named wandb')\n")
    config = write_config(tmp_path / "c.yaml", shards, tmp_path / "run",
                          logging={"wandb": {"project": "p", "mode": "offline"}})
    r = subprocess.run([PY, "-m", "pretrain.config", config, "--world-size", "1"], cwd=ROOT, capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": f"{fake}:{ROOT}"})
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "logging.wandb needs the wandb package" in r.stderr and "pip install 'synthformer[wandb]'" in r.stderr
