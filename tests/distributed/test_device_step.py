"""A training step that never makes the host wait for the device, and gradient clipping done on the device.

GuardedAdamW (pretrain/step_guard.py) clips where it runs (bf16 ZeRO-1/2, fp32 ZeRO-0): one all-reduce of the squared
norm, each replicated gradient counted once, no host read. Its steps must equal those of DeepSpeed's own clipping
on the same engine (tests/support/clip_compare.py), in the layouts where replicas exist: TP (norms and row biases on every TP
rank), PP (the tied embedding on the last stage) and ZeRO-0's data-parallel copies.
"""
import json
import os

import pytest

from tests.support.runs import ROOT, spawn, write_config


def waits(tmp_path, what, cfg, *overrides):
    out = tmp_path / f"{what}.json"
    spawn(os.path.join(ROOT, "tests", "support", "step_reads.py"), [what, cfg, out, *overrides], 1)
    return json.loads(out.read_text())


@pytest.mark.parametrize("mixer", ["dot", "dense+dot"])
def test_the_benchmarked_engine_step_never_waits_for_the_device(shards, tmp_path, mixer):
    """benchmarks/bench.py's step (bench_lib.training_step), bf16 ZeRO-1 as on a GPU: no value read from a tensor, no
    nonzero/is_nonzero/equal, no accelerator synchronize (DeepSpeed's throughput timer, turned off)."""
    cfg = write_config(tmp_path / "c.yaml", shards, tmp_path / "run", model={"mixer": mixer})
    counts = waits(tmp_path, "bench", cfg, "parallel.zero_stage=1", "train.precision=bf16",
                   "train.global_batch_size=4")
    assert counts["steps"] == [{}] * 3, counts


@pytest.mark.slow
@pytest.mark.parametrize("layout,overrides", [
    ("tp2-pp2-bf16-zero1", ["parallel.tp=2", "parallel.pp=2", "parallel.zero_stage=1", "train.precision=bf16",
                            "parallel.partition=uniform"]),
    ("tp2-dp2-fp32-zero0", ["parallel.tp=2", "parallel.zero_stage=0", "train.micro_batch_size=2"]),
], ids=lambda x: x if isinstance(x, str) else "")
def test_clipping_on_the_device_equals_deepspeeds(shards, tmp_path, layout, overrides):
    """Three steps with the norm far above train.grad_clip: the same global norms as DeepSpeed computes (it counts
    replicas once by its own bookkeeping) and the same parameters after them, on every rank."""
    cfg = write_config(tmp_path / "c.yaml", shards, tmp_path / "run", model={"mixer": ["random+dot", "dense"]},
                       train={"grad_clip": 0.01, "lr": 1e-2, "warmup_steps": 0})
    out = tmp_path / "clip.json"
    spawn(os.path.join(ROOT, "tests", "support", "clip_compare.py"), [cfg, out, *overrides], 4)
    got = json.loads(out.read_text())
    print(layout, got)
    device, deepspeed = got["device"], got["deepspeed"]
    assert all(n > 10 * 0.01 for n in device["norms"]), device   # clipping binds at every step
    if deepspeed["norms"][0] is not None:   # ZeRO-1/2 report DeepSpeed's norm (fp32 ZeRO-0 keeps none)
        for a, b in zip(device["norms"], deepspeed["norms"]):
            assert abs(a - b) <= 1e-3 * b, (device["norms"], deepspeed["norms"])
    for a, b in zip(device["losses"], deepspeed["losses"]):
        assert abs(a - b) <= 1e-3 * abs(b), (device["losses"], deepspeed["losses"])
    # a ZeRO-1/2 checkpoint of DeepSpeed's clipping is told apart: a run resuming it keeps DeepSpeed's clipping
    assert (device["deepspeed_clipped"], deepspeed["deepspeed_clipped"]) == (False, "zero1" in layout)
    # parameters: equal up to rounding (bf16 weights: one bf16 step of the largest ones)
    assert max(got["param_diff"]) <= (2e-2 if "bf16" in layout else 1e-5), got["param_diff"]
