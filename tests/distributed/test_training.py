"""The training system end to end, through launch/pretrain.sh and the real DeepSpeed launcher (gloo on CPU)."""
import json
import os
import subprocess
import time
import urllib.request

import pytest

from tests.support.runs import (PY, ROOT, free_local_port, ids_per_step, launch, losses, metric_rows, reference_config,
                                run_py, spawn, write_config)


@pytest.mark.slow
def test_parallel_layouts_match_one_process(shards, tmp_path):
    """Same global batch, same samples: DP=2 under ZeRO 0-3, TP=2, and TP=2 × DP=2 give the 1-process losses."""
    one = tmp_path / "one"
    launch(write_config(tmp_path / "one.yaml", shards, one), 1)
    ref = losses(one)
    assert sorted(ref) == list(range(1, 21))
    layouts = [(2, {"zero_stage": s}) for s in (0, 1, 2, 3)] + [(2, {"tp": 2, "zero_stage": 1}),
                                                               (4, {"tp": 2, "zero_stage": 2})]
    for i, (nproc, parallel) in enumerate(layouts):
        run = tmp_path / f"layout{i}"
        launch(write_config(tmp_path / f"l{i}.yaml", shards, run, parallel=parallel), nproc)
        got = losses(run)
        stage = (nproc, parallel)
        assert sorted(got) == sorted(ref)
        for step in ref:
            assert abs(got[step] - ref[step]) <= 1e-4 * abs(ref[step]), (stage, step, got[step], ref[step])
    assert ref[20] < ref[1] - 0.5   # and it learns


@pytest.mark.slow
def test_exact_resume_with_workers(shards, tmp_path, reference_run):
    """Stopped at step 20 and launched again, the run gives the reference run's losses and reads its samples, bit
    for bit (2 data workers per rank resume their positions too)."""
    straight, resumed = reference_run, tmp_path / "resumed"
    cfg_b = reference_config(tmp_path, shards, "resumed")
    first = launch(cfg_b, 2, "train.stop_after_steps=20")
    assert "saved checkpoint" in first.stdout and sorted(losses(resumed)) == list(range(1, 21))
    second = launch(cfg_b, 2)                      # a new launcher invocation: resumes from step 20
    assert "resumed at step 20" in second.stdout
    a, b = losses(straight), losses(resumed)
    assert [b[s] for s in range(21, 41)] == [a[s] for s in range(21, 41)]   # bit for bit
    for rank in (0, 1):
        ia, ib = ids_per_step(straight, rank), ids_per_step(resumed, rank)
        assert all(ia[s] == ib[s] for s in range(1, 41))
    # A finished run, launched again, says so and writes nothing; a higher train.max_steps trains on.
    rows = (resumed / "metrics.jsonl").read_text()
    again = launch(cfg_b, 2)
    assert "the run is finished: its checkpoint is at step 40 of 40" in again.stdout
    assert (resumed / "metrics.jsonl").read_text() == rows
    launch(cfg_b, 2, "train.max_steps=42")
    assert sorted(losses(resumed)) == list(range(1, 43))
    tensorboard_serves_the_run(straight)


@pytest.mark.slow
def test_bf16_run_tracks_fp32_and_resumes_exactly(shards, tmp_path):
    """bf16 as the cluster configs run it (DeepSpeed's ZeRO-1 with fp32 master weights, 2 data-parallel ranks), on
    CPU: its losses follow fp32's within 2%, and a run stopped at step 10 and relaunched gives the straight run's
    losses bit for bit. With train.master_weights=bf16 the checkpoint holds ZeRO's weights and AdamW moments in bf16,
    the losses still follow fp32's within 2% but are not the fp32-master ones, and a run resumed from its step-10
    checkpoint gives its losses bit for bit. TORCH_CUDA_ARCH_LIST=9.0a (a Hopper value DeepSpeed's op builder cannot
    parse) is set: nothing on the training path builds an op."""
    import torch

    env = {"TORCH_CUDA_ARCH_LIST": "9.0a"}
    precision = {"fp32": {"precision": "fp32"}, "bf16": {"precision": "bf16"}, "resumed": {"precision": "bf16"},
                 "bf16-master": {"precision": "bf16", "master_weights": "bf16"}}
    runs = {name: tmp_path / name for name in (*precision, "bf16-master-resumed")}
    cfgs = {name: write_config(tmp_path / f"{name}.yaml", shards, runs[name], parallel={"zero_stage": 1},
                               train=train, checkpoint={"every": 10}) for name, train in precision.items()}
    for name in ("fp32", "bf16", "bf16-master"):
        r = launch(cfgs[name], 2, env=env)
        assert "MFU n/a" in r.stdout and "MFU 0" not in r.stdout   # no peak known for a CPU: no made-up MFU
    launch(cfgs["resumed"], 2, "train.stop_after_steps=10", env=env)
    assert "resumed at step 10" in launch(cfgs["resumed"], 2, env=env).stdout
    step10 = runs["bf16-master"] / "checkpoints" / "step_00000010"
    assert "resumed at step 10" in launch(cfgs["bf16-master"], 2, f"train.run_dir={runs['bf16-master-resumed']}",
                                          f"checkpoint.resume={step10}", env=env).stdout
    fp32, bf16, resumed, master, master_resumed = (losses(run) for run in runs.values())
    assert sorted(bf16) == sorted(fp32) == sorted(resumed) == sorted(master) == list(range(1, 21))
    assert resumed == bf16 and sorted(master_resumed) == list(range(11, 21))
    assert all(master_resumed[s] == master[s] for s in master_resumed)
    for name, got in (("bf16", bf16), ("bf16 master weights", master)):
        worst = max(abs(got[s] - fp32[s]) / fp32[s] for s in fp32)
        print(f"{name} vs fp32 losses over 20 steps: largest relative difference {worst:.4f}")
        assert worst <= 0.02 and got != fp32 and got[20] < got[1] - 0.5
    assert master != bf16   # really another precision of the master weights
    optim = torch.load(next(step10.glob("*zero_pp_rank_0_*optim_states.pt")), weights_only=False)["optimizer_state_dict"]
    moments = [t for state in optim["base_optimizer_state"]["state"].values() for k, t in state.items() if k != "step"]
    assert {t.dtype for t in optim["single_partition_of_fp32_groups"] + moments} == {torch.bfloat16}


@pytest.mark.slow
def test_compiled_blocks_train_as_the_eager_model(shards, tmp_path):
    """train.compile: the blocks run through inductor (its generated code is on disk), the losses follow the eager
    run's within 1e-4 (fused kernels round differently), validation and samples run (eager) beside it, and the
    checkpoint holds the eager model's parameter names."""
    import torch

    runs = {name: tmp_path / name for name in ("eager", "compiled")}
    for name, run in runs.items():
        cfg = write_config(tmp_path / f"{name}.yaml", shards, run,
                           train={"max_steps": 8, "compile": name == "compiled"},
                           logging={"val_every": 4, "image_every": 8, "sample_tokens": 4})
        r = launch(cfg, 1, env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / f"inductor-{name}")})
        assert ("compiled blocks" in r.stdout) == (name == "compiled") and "validation at step 8" in r.stdout
        assert "sample: " in r.stdout
    eager, compiled = losses(runs["eager"]), losses(runs["compiled"])
    assert sorted(compiled) == sorted(eager) == list(range(1, 9))
    assert all(abs(compiled[s] - eager[s]) <= 1e-4 * eager[s] for s in eager), (compiled, eager)
    assert list((tmp_path / "inductor-compiled").rglob("*.py")) and not list((tmp_path / "inductor-eager").rglob("*.py"))
    names = [set(torch.load(next((run / "checkpoints").rglob("*model_states.pt")), weights_only=False)["module"])
             for run in runs.values()]
    assert names[0] == names[1] and len(names[0]) > 10


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [["parallel.zero_stage=1", "train.precision=bf16"], ["parallel.zero_stage=0"]],
                         ids=["zero1-bf16", "zero0-fp32"])
def test_a_step_makes_the_host_wait_once(shards, tmp_path, overrides):
    """Outside logging steps the trainer reads the device once a step (loss, skip and stop flags together), and
    nothing else in its step waits for the device: GuardedAdamW clips on the device, DeepSpeed's throughput timer
    (a synchronize at each forward and step) is off. The stock forward/backward/step loop on the same engine waits
    for nothing either."""
    cfg = write_config(tmp_path / "c.yaml", shards, tmp_path / "run", logging={"every": 100})
    spawn(os.path.join(ROOT, "tests", "support", "step_reads.py"), ["trainer", cfg, tmp_path / "reads.json",
                                                                    *overrides], 1)
    counts = json.loads((tmp_path / "reads.json").read_text())
    print(f"{overrides}: per step {counts['steps']}; the stock DeepSpeed loop: {counts['stock']}")
    assert counts["steps"][1:] == [{"trainer": 1}] * 3   # the first step also makes DeepSpeed's one-time reads
    assert counts["stock"] == {}


def tensorboard_serves_the_run(run_dir):
    """A real TensorBoard server over the run: one loss point per logged step, and the attention images."""
    port = free_local_port()
    proc = subprocess.Popen([PY, "-m", "tensorboard.main", "--logdir", str(run_dir / "tensorboard"),
                             "--host", "127.0.0.1", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline, tags = time.time() + 90, {}
        while time.time() < deadline:
            try:
                tags = json.load(urllib.request.urlopen(f"{base}/data/plugin/scalars/tags", timeout=5))
                if any("train/loss" in t for t in tags.values()):
                    break
            except OSError:
                pass
            time.sleep(1)
        run = next(r for r, t in tags.items() if "train/loss" in t)
        q = f"{base}/data/plugin/scalars/scalars?tag=train/loss&run={urllib.request.quote(run)}"
        points = json.load(urllib.request.urlopen(q, timeout=10))
        assert [p[1] for p in points] == list(range(1, 41))
        assert {"val/ppl", "train/lr", "perf/tokens_per_s", "perf/tflops_per_device", "train/grad_norm"} <= set(tags[run])
        # how much of the validation split the figure covers, beside its chart
        assert "over 16 of the " in tags[run]["val/ppl"]["description"], tags[run]["val/ppl"]
        assert "perf/mfu" not in tags[run]   # a CPU has no known peak: no MFU against a made-up one
        # the time plan's predicted step, and measured ÷ predicted from the second logged window on (pretrain/plan/)
        assert {"perf/predicted_step_s", "perf/measured_over_predicted"} <= set(tags[run])
        images = json.load(urllib.request.urlopen(f"{base}/data/plugin/images/tags", timeout=10))
        assert any("attention/layer_00" in t for t in images[run]), images
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def one_line_error(r, *needles):
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    err = [l for l in r.stderr.splitlines() if l.startswith("error: ")]
    assert len(err) == 1, r.stderr
    for n in needles:
        assert n in err[0], err[0]
    return err[0]


def run_train(config, *overrides):
    return run_py([PY, "-m", "pretrain.train", config, *overrides], timeout=300)


def test_errors_are_one_line(shards, tmp_path):
    cfg = write_config(tmp_path / "c.yaml", shards, tmp_path / "run")
    one_line_error(run_train(cfg, f"data.shard_dir={tmp_path}/nope"), f"{tmp_path}/nope")
    (tmp_path / "empty").mkdir()
    one_line_error(run_train(cfg, f"data.shard_dir={tmp_path}/empty"), f"{tmp_path}/empty")
    one_line_error(run_train(cfg, "model.vocab_size=256"), "vocab_size=512", "model.vocab_size=256")   # fewer ids
    one_line_error(run_train(cfg, "train.learning_rate=1e-3"), "train.learning_rate", "train.lr")
    one_line_error(run_train(cfg, "train.lr=-1"), "train.lr", "-1")
    one_line_error(run_train(str(tmp_path / "missing.yaml")), "missing.yaml")


def test_launch_errors_are_one_line_before_any_rank_starts(shards, tmp_path):
    """launch/pretrain.sh's check before launching finds what each rank would otherwise report after DeepSpeed
    started: a missing shard directory, a vocabulary or length the shards do not have, a checkpoint of another
    layout or world size. One line, exit 2, and no rank ever started (nothing of the launcher's in stdout)."""
    import shutil

    from tests.distributed.test_formats import DATA

    run = tmp_path / "run"
    shutil.copytree(os.path.join(DATA, "checkpoints"), run / "checkpoints")   # tp=1 pp=1, 2 ranks
    cfg = write_config(tmp_path / "c.yaml", shards, run,
                       model={"d_model": 32, "n_layers": 2, "n_heads": 4, "max_seq_len": 32,
                              "mixer": ["random+dot", "factorized_dense"]}, parallel={"zero_stage": 1})
    cases = [(["data.shard_dir=/nonexistent/shards"], 2, ["/nonexistent/shards", "does not exist"]),
             (["model.vocab_size=256"], 2, ["vocab_size=512", "model.vocab_size=256"]),
             (["model.max_seq_len=48"], 2, ["32 tokens", "model.max_seq_len=48", "--seq-len 48"]),
             (["parallel.tp=2"], 2, ["parallel.tp=1", "parallel.tp=2", "tools/convert.py"]),
             ([], 1, ["written by 2 ranks", "launch 2", "tools/convert.py"])]
    for overrides, nproc, needles in cases:
        t0 = time.time()
        r = launch(cfg, nproc, *overrides, check=False, launcher=True)
        errors = [line for line in r.stderr.splitlines() if line.strip()]
        assert r.returncode == 2 and len(errors) == 1 and errors[0].startswith("error: "), r.stderr[-2000:]
        assert r.stdout == "" and "Traceback" not in r.stderr, r.stdout[-2000:]
        for needle in needles:
            assert needle in errors[0], (needle, errors[0])
        print(f"{overrides or 'one rank'}: {time.time() - t0:.1f} s: {errors[0]}")


@pytest.mark.slow
def test_tensor_and_pipeline_parallel_runs_show_every_head_and_a_sample(shards, tmp_path):
    """TensorBoard's attention images hold every head, labelled, whatever the layout (TP=2 gathers the other rank's
    heads; PP=2 joins the stages' weights), and a text sample is written; PP with few micro-batches warns once,
    with the bubble it costs."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sizes = {}
    for name, parallel in (("tp1", {}), ("tp2", {"tp": 2}), ("pp2", {"pp": 2, "partition": "uniform"})):
        run = tmp_path / name
        cfg = write_config(tmp_path / f"{name}.yaml", shards, run, parallel={"zero_stage": 1, **parallel},
                           train={"max_steps": 4, "micro_batch_size": 2},
                           logging={"every": 2, "image_every": 4, "sample_tokens": 6})
        r = launch(cfg, 1 if name == "tp1" else 2)
        split = [set(row) & {"perf/data_wait_s", "perf/fwd_bwd_s", "perf/optimizer_s", "perf/pipeline_step_s"}
                 for row in metric_rows(run) if "train/loss" in row]   # the time split: around train_batch under PP
        assert split == [{"perf/data_wait_s", "perf/pipeline_step_s"} if name == "pp2" else
                         {"perf/data_wait_s", "perf/fwd_bwd_s", "perf/optimizer_s"}] * 2, (name, split)
        events = EventAccumulator(str(run / "tensorboard"), size_guidance={"images": 0, "tensors": 0})
        events.Reload()
        images = events.Tags()["images"]
        assert images == ["attention/layer_00", "attention/layer_01"], (name, images)
        sizes[name] = [(im.width, im.height) for tag in images for im in events.Images(tag)]
        assert "sample/text_summary" in events.Tags()["tensors"] and "sample: '" in r.stdout, name
        warned = [line for line in r.stdout.splitlines() if "pipeline bubble" in line]
        assert len(warned) == (1 if name == "pp2" else 0), warned
        if name == "pp2":
            assert "4 micro-batches a step through 2 pipeline stages: each stage idles 20%" in warned[0], warned
    assert sizes["tp2"] == sizes["tp1"] == sizes["pp2"], sizes   # 4 heads a layer in every layout
