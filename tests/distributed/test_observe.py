"""Seeing inside a run: the profiler window of a demo run holds the step's forward, backward and optimizer ops where
the trainer says they ran, and the time split shows where a step's time went, a slowed data source included."""
import json
import os

import pytest

from model import ConfigError
from pretrain.config import ProfileSection, load_config
from pretrain.observe import ProfileWindows
from tests.support.runs import ROOT, launch, metric_rows, write_config

SPLIT = ("perf/step_s", "perf/data_wait_s", "perf/fwd_bwd_s", "perf/optimizer_s")


def phases(trace) -> dict[str, list[tuple[float, float]]]:
    """{synthformer/<lap>: [(start, end) µs]} of the trainer's labelled ranges in a Chrome trace."""
    out = {}
    for e in trace:
        if e["name"].startswith("synthformer/"):
            out.setdefault(e["name"].split("/")[1], []).append((e["ts"], e["ts"] + e["dur"]))
    return out


def inside(event, spans) -> bool:
    return any(a <= event["ts"] and event["ts"] + event["dur"] <= b for a, b in spans)


def test_a_profiler_window_of_the_demo_holds_its_steps_ops_where_they_ran(demo):
    """The demo run (tests/conftest.py) profiled steps 5-6 on rank 1 only: rank 1's trace (Chrome's JSON) has both
    steps, the model's forward ops and the autograd backward inside the forward+backward laps, the AdamW update inside
    the optimizer laps, and rank 0 wrote nothing."""
    window = os.path.join(demo["run"], "profile", "steps_5-6")
    assert sorted(os.listdir(window)) == ["rank1.pt.trace.json"], os.listdir(window)
    with open(os.path.join(window, "rank1.pt.trace.json")) as f:
        trace = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    names = {e["name"] for e in trace}
    laps = phases(trace)
    print(f"{len(trace)} events; laps {({k: len(v) for k, v in laps.items()})}; e.g. "
          f"{sorted(n for n in names if 'Backward' in n)[:3]}, {sorted(n for n in names if 'adam' in n.lower())}")
    assert {"ProfilerStep#1", "ProfilerStep#2"} <= names and "ProfilerStep#3" not in names
    # one micro-batch a step on each of the 2 ranks: each lap twice, once a step
    assert {k: len(v) for k, v in laps.items()} == {"data_wait": 2, "fwd_bwd": 2, "optimizer": 2, "step_outcome": 2}
    forward = [e for e in trace if e["name"] in ("aten::embedding", "aten::layer_norm", "aten::linear")]
    backward = [e for e in trace if e["name"].startswith("autograd::engine::evaluate_function: ")]
    update = [e for e in trace if e["name"] in ("aten::_fused_adamw_", "aten::_foreach_add_")
              or e["name"].startswith("Optimizer.step#")]
    assert forward and backward and update, sorted(names)[:50]
    assert all(inside(e, laps["fwd_bwd"]) for e in forward + backward)
    assert all(inside(e, laps["optimizer"]) for e in update)
    assert not any(inside(e, laps["data_wait"]) for e in forward + backward + update)


def test_the_time_split_of_the_demo_adds_up_and_a_slow_data_source_shows_in_it(demo, shards, tmp_path):
    """Each logged step of the demo has the split, its parts within the step, the step within the wall time between
    logged steps, and little data wait (a worker reads local shards ahead). A data source that takes 0.3 s a shard
    (a pipe: command that sleeps; one sample a shard, 8 a step, fetched by a thread per stream while the steps run)
    makes the data wait most of the step, and not the forward and backward."""
    rows = [r for r in metric_rows(demo["run"]) if "train/loss" in r]
    for r in rows:
        parts = r["perf/data_wait_s"] + r["perf/fwd_bwd_s"] + r["perf/optimizer_s"]
        wall = 16 * 128 / r["perf/tokens_per_s"]   # seconds a step between logged steps: global batch × seq_len
        assert 0 < parts <= r["perf/step_s"] <= 1.02 * wall, r
    demo_wait = [r["perf/data_wait_s"] / r["perf/step_s"] for r in rows]
    print("demo:", [{k: round(r[k], 4) for k in SPLIT} for r in rows])
    assert max(demo_wait) < 0.2, demo_wait

    slow = f"pipe:sleep 0.3; cat {shards}/{{}}"
    run = tmp_path / "slow"
    launch(write_config(tmp_path / "slow.yaml", slow, run, data={"val_batches": 1}, train={"max_steps": 3},
                        logging={"every": 3}), 1)
    (row,) = [r for r in metric_rows(run) if "train/loss" in r]
    print("slow data:", {k: round(row[k], 4) for k in SPLIT})
    assert row["perf/data_wait_s"] >= 0.15 and row["perf/data_wait_s"] >= 0.5 * row["perf/step_s"]
    assert row["perf/fwd_bwd_s"] < row["perf/data_wait_s"]


def test_profile_settings_are_checked_and_windows_repeat(tmp_path):
    """logging.profile: a misspelt key, a start of 0, windows that would overlap are one-line errors; `every` repeats
    the window (the arithmetic of ProfileWindows.first_of)."""
    cfg = write_config(tmp_path / "c.yaml", "/nonexistent", tmp_path / "run")
    for value, needle in (("{strat: 3}", "did you mean 'logging.profile.start'"),
                          ("{start: 0}", "logging.profile.start=0 is out of range"),
                          ("{start: 5, steps: 3, every: 3}", "logging.profile.every=3 is out of range"),
                          ("{start: 5, ranks: 0}", "logging.profile.ranks=0 must be a list of int"),
                          ("{start: 5, ranks: [-1]}", r"logging.profile.ranks=\[-1\] is out of range")):
        with pytest.raises(ConfigError, match=needle):
            load_config(cfg, [f"logging.profile={value}"])
    assert load_config(cfg, ["logging.profile={start: 5}"]).logging.profile == ProfileSection(start=5)
    windows = ProfileWindows(ProfileSection(start=5, steps=2, every=10, ranks=[1]), 1,
                             __import__("torch").device("cpu"), str(tmp_path), None)
    assert [s for s in range(1, 30) if windows.first_of(s) is not None] == [5, 6, 15, 16, 25, 26]
    assert ProfileWindows(ProfileSection(start=5), 0, windows.device, str(tmp_path), None).first_of(7) == 5
    assert not ProfileWindows(ProfileSection(start=5), 1, windows.device, str(tmp_path), None).on   # not in [0]
    assert not ProfileWindows(None, 0, windows.device, str(tmp_path), None).on   # null: off
