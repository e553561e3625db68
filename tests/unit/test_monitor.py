"""Unit tests of what watches and configures a run without starting one: the ETA formula (pretrain/observe/monitor.py), the
`deepspeed:` section (pretrain/config/deepspeed_section.py) and the install's declared ranges (pyproject.toml)."""
import os
import tomllib
from importlib import metadata

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from model import ConfigError
from pretrain.config import load_config
from pretrain.config.deepspeed_dict import deepspeed_config
from pretrain.observe.monitor import Eta, clock_text
from tests.support.runs import ROOT

DEMO = os.path.join(ROOT, "configs", "demo-cpu.yaml")


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_eta_is_steps_left_times_step_time_plus_each_event_due_times_its_mean_cost():
    clock = Clock()
    # T = 100; validation every 20 (and at the end), checkpoints every 50 (and at the end), samples every 30
    eta = Eta(100, {"validation": 20, "checkpoint": 50, "samples": 30}, ("validation", "checkpoint"), clock=clock)
    assert eta.estimate(0) is None and "ETA n/a" in eta.words(0)
    clock.now += 10 * 0.5                                  # 10 steps of 0.5 s
    eta.mark(10)
    assert eta.estimate(10) == pytest.approx(90 * 0.5)     # no event measured yet: they count 0
    for event, cost in (("validation", 3.0), ("validation", 5.0), ("checkpoint", 8.0), ("samples", 1.0)):
        with eta.timing(event):
            clock.now += cost
    clock.now += 10 * 0.25                                 # the next 10 steps take 0.25 s each
    eta.mark(20)
    # still due at step 20 (the step line comes before its own events): validation at 20, 40, 60, 80 and the end;
    # checkpoints at 50 and the end; samples at 30, 60, 90
    assert [eta.due(e, 20) for e in ("validation", "checkpoint", "samples")] == [5, 2, 3]
    assert eta.estimate(20) == pytest.approx(80 * 0.25 + 5 * 4.0 + 2 * 8.0 + 3 * 1.0)
    assert eta.due("samples", 91) == 0 and eta.due("checkpoint", 100) == 1 and eta.due("validation", 101) == 0
    assert eta.scalars(20)["time/eta_s"] == pytest.approx(eta.estimate(20))
    assert eta.scalars(20)["time/elapsed_s"] == pytest.approx(clock.now - 1000.0)
    assert eta.timed("samples", lambda x: x + 1, 1) == 2 and len(eta.durations["samples"]) == 2


def test_eta_from_a_config_counts_its_loop_events():
    cfg = load_config(DEMO, ["train.max_steps=300", "logging.val_every=100", "logging.image_every=200",
                             "checkpoint.every=100"])
    eta = Eta.for_config(cfg, step=150)
    assert eta.window_step == 150 and eta.total == 300
    assert [eta.due(e, 150) for e in ("validation", "checkpoint", "samples", "eval")] == [2, 2, 1, 0]


def test_clock_text():
    assert [clock_text(s) for s in (0, 59.2, 3600, 90061)] == ["0:00:00", "0:01:00", "1:00:00", "1d 1:01:01"]


# ---- the deepspeed: section -----------------------------------------------------------------------------------
def test_the_deepspeed_section_is_merged_into_the_generated_config():
    cfg = load_config(DEMO, ["deepspeed.zero_optimization={overlap_comm: true, reduce_bucket_size: 5e7}",
                             "deepspeed.comms_logger={enabled: true}"])
    ds = deepspeed_config(cfg, 2)
    assert ds["zero_optimization"] == {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 50_000_000}
    assert ds["comms_logger"] == {"enabled": True} and ds["train_batch_size"] == 16
    plain = deepspeed_config(load_config(DEMO), 2)
    assert {k: v for k, v in ds.items() if k not in ("zero_optimization", "comms_logger")} == \
        {k: v for k, v in plain.items() if k != "zero_optimization"}   # the trainer's own settings stay


@pytest.mark.parametrize("override, words", [
    ("deepspeed.train_batch_size=8", "deepspeed.train_batch_size is set by the trainer from train.global_batch_size"),
    ("deepspeed.bf16={enabled: true}", "deepspeed.bf16 is set by the trainer from train.precision"),
    ("deepspeed.gradient_clipping=2.0", "deepspeed.gradient_clipping is set by the trainer from train.grad_clip"),
    ("deepspeed.activation_checkpointing={partition_activations: true}",
     "set by the trainer from parallel.activation_checkpointing"),
    ("deepspeed.timers={throughput: {enabled: true}}", "deepspeed.timers is set by the trainer"),
    ("deepspeed.zero_optimization={stage: 3}", "deepspeed.zero_optimization.stage is set by the trainer from "
                                               "parallel.zero_stage"),
    ("deepspeed.zero_optimization={offload_optimizer: {device: cpu}}", "offload is not tested with the trainer's "
                                                                       "optimizer"),
    ("deepspeed.checkpoint={writer: {decoupled: true}}", "deepspeed.checkpoint.writer is refused: DeepSpeed's "
                                                          "decoupled and FastPersist writers"),
    ("deepspeed.zero_optimisation={overlap_comm: true}", "did you mean 'deepspeed.zero_optimization'?"),
    ("deepspeed.comms_loger={enabled: true}", "did you mean 'deepspeed.comms_logger'?"),
])
def test_trainer_owned_untested_and_unknown_deepspeed_keys_are_one_line_errors(override, words):
    with pytest.raises(ConfigError) as e:
        load_config(DEMO, [override])
    assert words in str(e.value) and "\n" not in str(e.value)


def test_a_deepspeed_key_the_trainer_owns_is_refused_in_a_file_too(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(f"base: {DEMO}\ndeepspeed:\n  gradient_accumulation_steps: 4\n")
    with pytest.raises(ConfigError, match=r"deepspeed.gradient_accumulation_steps is set by the trainer from "
                                          r"train.global_batch_size ÷"):
        load_config(str(path))


# ---- the install ------------------------------------------------------------------------------------------------
def project():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]


def test_declared_ranges_accept_the_lock_and_an_ngc_style_environment():
    """requirements.txt is the exact lock the README's commands and CI install; pyproject.toml's ranges must accept
    it, and an NVIDIA NGC PyTorch container's own builds (torch 2.6.0a0+…nv…, its triton) with a DeepSpeed of that
    time."""
    p = project()
    declared = {canonicalize_name(Requirement(r).name): Requirement(r) for r in p["dependencies"]}
    for extra in p["optional-dependencies"].values():
        declared.update({canonicalize_name(Requirement(r).name): Requirement(r) for r in extra})
    lock = {}
    for line in open(os.path.join(ROOT, "requirements.txt")):
        line = line.split("#")[0].strip()
        if line:   # name==version, or a range (triton's): then the version installed from it
            req = Requirement(line)
            pinned = [s.version for s in req.specifier if s.operator == "=="]
            lock[canonicalize_name(req.name)] = pinned[0] if pinned else metadata.version(req.name)
    lock["torch"] = "2.13.0"   # installed first by the Makefile (the CPU wheel here)
    assert set(declared) <= set(lock) | {"zstandard", "s3fs", "gcsfs"}   # the lock pins what the ranges name
    for name, req in declared.items():
        if name in lock:
            assert req.specifier.contains(lock[name], prereleases=True), (name, str(req.specifier), lock[name])
    ngc = {"torch": "2.6.0a0+ecf3bae40a.nv25.1", "triton": "3.2.0", "deepspeed": "0.16.4", "numpy": "1.26.4"}
    for name, version in ngc.items():
        assert declared[name].specifier.contains(version, prereleases=True), (name, str(declared[name].specifier))


def test_the_base_install_carries_no_evaluation_or_test_packages_and_the_extras_are_there():
    p = project()
    base = {canonicalize_name(Requirement(r).name) for r in p["dependencies"]}
    assert not base & {"lm-eval", "datasets", "evaluate", "pytest", "pytest-xdist", "wandb", "einops"}
    extras = {k: {canonicalize_name(Requirement(r).name) for r in v} for k, v in p["optional-dependencies"].items()}
    assert {"lm-eval", "datasets"} <= extras["eval"] and "datasets" in extras["data"]
    assert extras["s3"] == {"s3fs"} and extras["gcs"] == {"gcsfs"} and extras["wandb"] == {"wandb"}
    assert "triton" in extras["gpu"] and {"pytest", "pytest-xdist"} <= extras["dev"]
    assert not any(line.startswith("einops") for line in open(os.path.join(ROOT, "requirements.txt")))
