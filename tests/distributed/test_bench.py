"""benchmarks/bench.py: one --quick run (throughput, peer, memory for dot, random and GPT-2, engine ÷ plain loop; 11 measuring
processes), its JSON
schema and ratios (the throughput and peer ones from repetitions alternated with dot's), the FLOP ratios recomputed
here from model_stats, --help and a bad --only."""
import json
import math
import os
import statistics
import subprocess
import sys

import pytest

from model.accounting import model_stats
from pretrain.config import load_config
from benchmarks.bench import PARTS, build_parser
from benchmarks.bench_report import PointFailed, ServedPoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "benchmarks", "bench.py")
# 9 measuring processes of ~8 s each (imports and process group start dominate); --quick runs 1 torch thread each.
QUICK = ["--quick", "--only", "throughput,peer,memory,engine", "--variants", "dot,random", "--lengths", "64,128",
         "--steps", "1"]
KEYS = ("id", "name", "variant", "value", "unit", "ratio_to", "ratio", "ratio_range", "spread", "reps", "paired_reps",
        "goal", "status", "machine")
MACHINE = ("platform", "cpu", "cpu_count", "torch", "deepspeed", "transformers", "gpu")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    r = subprocess.run([sys.executable, BENCH, *QUICK, "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    print(r.stdout)   # the table (pytest -s)
    report = json.loads((out / "results.json").read_text())
    return report, {e["id"]: e for e in report["results"]}, (out / "results.md").read_text()


@pytest.mark.slow
def test_schema(run):
    report, by_id, md = run
    assert all(k in report["machine"] for k in MACHINE) and report["machine"]["cpu_count"] >= 1
    expected = {"throughput:dot", "throughput:random", "peer:gpt2", "peer:dot", "peer:random",
                *(f"memory:{v}:n={n}" for v in ("dot", "random", "gpt2-sdpa") for n in (64, 128)),
                "engine:loop:eager", "engine:eager"}
    assert set(by_id) == expected
    for e in report["results"]:
        assert all(k in e for k in KEYS), (e["id"], [k for k in KEYS if k not in e])
        assert e["machine"] == report["machine"]
        assert e["value"] is not None and e["value"] > 0, e
        # dot's one live process runs 2 repetitions next to each of the 2 points alternated with it (random, GPT-2)
        assert e["spread"] >= 0 and len(e["reps"]) == (4 if e["id"] in ("throughput:dot", "peer:dot") else 2)
        assert e["status"] in (None, "ok", "MISSED") and (e["status"] is None) == (e["goal"] is None or
                                                                                   e["ratio"] is None)
        assert f"| {e['name']} | {e['variant']} |" in md
        if e["name"] == "memory":   # the total holds the step's peak (its highest phase's) and the engine at rest
            assert set(e["phase_mb"]) == {"forward", "backward", "optimizer step"}
            assert 0 < max(e["phase_mb"].values()) <= e["step_mb"] * 1.5 and e["at_rest_mb"] >= e["after_engine_mb"] - 5
            assert e["value"] >= e["step_mb"] + (e["at_rest_mb"] - e["after_init_mb"]) - 1
    units = {e["name"]: e["unit"] for e in report["results"]}
    assert units == {"throughput": "tokens/s", "peer": "tokens/s", "memory": "MB", "engine": "s"}
    loop, engine = by_id["engine:loop:eager"], by_id["engine:eager"]   # the same model in both
    assert loop["params"] == engine["params"] and loop["train_flops_per_token"] == engine["train_flops_per_token"]
    assert engine["ratio_to"] == "engine:loop:eager" and engine["goal"] == "≤ 1.05"


@pytest.mark.slow
def test_ratios(run):
    _, by_id, _ = run

    def beside_dot(e):   # each repetition ÷ dot's repetition next to it (dot's own: 1)
        return [x / y for x, y in zip(e["reps"], e["paired_reps"])]

    for e in by_id.values():
        if e["ratio_to"] is None:
            assert e["ratio"] is None
            continue
        ref = by_id[e["ratio_to"]]
        if e["name"] in ("memory", "engine"):   # separate processes: ratio of medians
            assert e["paired_reps"] is None
            expected = e["value"] / ref["value"]
        else:                       # alternated with dot: ratio of the medians of the side-by-side ratios
            assert len(e["paired_reps"]) == len(e["reps"]) and len(ref["paired_reps"]) == len(ref["reps"])
            expected = statistics.median(beside_dot(e)) / statistics.median(beside_dot(ref))
        assert math.isclose(e["ratio"], expected, rel_tol=1e-9, abs_tol=1e-12)
        lo, hi = e["ratio_range"]
        assert lo <= e["ratio"] <= hi
    dot = by_id["throughput:dot"]
    assert dot["paired_reps"] == dot["reps"] and by_id["peer:dot"]["reps"] == dot["reps"]
    # dot's repetitions next to random's are among dot's own (one process measured both sides)
    assert set(by_id["throughput:random"]["paired_reps"]) <= set(dot["reps"])
    assert set(by_id["peer:gpt2"]["paired_reps"]) <= set(dot["reps"])
    assert by_id["peer:dot"]["ratio_to"] == "peer:gpt2" and by_id["peer:dot"]["goal"] == "≥ 1"
    assert by_id["peer:random"]["goal"] == "≥ 1.15"
    assert by_id["memory:random:n=128"]["ratio_to"] == "memory:random:n=64"
    # same shapes: GPT-2 has exactly the parameters of our dot model (learned positions, tied head, biases, 4·d MLP)
    assert by_id["peer:gpt2"]["params"] == by_id["peer:dot"]["params"]


@pytest.mark.slow
def test_flop_ratios_match_model_stats(run):
    report, by_id, _ = run
    s = report["settings"]

    def flops(variant):
        cfg = load_config(os.path.join(ROOT, "configs", "variants", f"{variant}.yaml"),
                          [f"model.vocab_size={s['vocab']}", f"model.d_model={s['d_model']}",
                           f"model.n_layers={s['layers']}", f"model.n_heads={s['heads']}",
                           f"model.max_seq_len={s['seq_len']}"])
        return model_stats(cfg.model, s["seq_len"])["total"]["train_flops_per_token"]

    dot, rnd = flops("dot"), flops("random")
    assert by_id["throughput:dot"]["train_flops_per_token"] == dot
    assert by_id["throughput:random"]["train_flops_per_token"] == rnd
    assert math.isclose(by_id["throughput:random"]["flop_ratio"], dot / rnd, rel_tol=1e-12)
    assert by_id["throughput:random"]["goal"] == f"≥ {0.9 * dot / rnd:.3g}"


def test_help_lists_every_option():
    r = subprocess.run([sys.executable, BENCH, "--help"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0 and "--only" in r.stdout and "--quick" in r.stdout
    for action in build_parser()._actions:
        assert action.help, action.option_strings


def test_bad_only_is_one_line():
    r = subprocess.run([sys.executable, BENCH, "--only", "throughput,speed"], cwd=ROOT, capture_output=True,
                       text=True)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "'speed'" in lines[0] and all(p in lines[0] for p in PARTS), r.stderr


def test_served_point_reports_a_dead_or_silent_child():
    dies = "print('BENCH_READY', flush=True); input(); print('boom: out of memory', flush=True); raise SystemExit(3)"
    served = ServedPoint([sys.executable, "-c", dies], dict(os.environ), ROOT, timeout=60)
    with pytest.raises(PointFailed, match="^boom: out of memory$"):
        served.rep()
    with pytest.raises(PointFailed, match="boom"):   # a dead point stays failed at once, no wait
        served.rep()
    with pytest.raises(PointFailed, match="^timeout after 1 s$"):
        ServedPoint([sys.executable, "-c", "import time; time.sleep(60)"], dict(os.environ), ROOT, timeout=1)


def test_gpu_part_plans_every_variant_against_dot_with_the_goals():
    """What the gpu part measures on a CUDA machine (planned here; measuring needs the GPU): each variant ÷ dot under
    the engine, eager and compiled, with the GPU issue's goals, and memory at the longest n ÷ the shortest."""
    from benchmarks.bench import parse_args
    from benchmarks.bench_points import GPU_GOAL_MEM, GPU_GOALS, Plan, plan_gpu_memory, plan_gpu_variants

    a = parse_args(["--quick"])
    p = Plan(a)
    plan_gpu_variants(a, p)
    plan_gpu_memory(a, p)
    by_id = {e["id"]: e for e in p.entries}
    assert set(GPU_GOALS) | {"dot"} == set(a.variant_paths)
    for mode in ("eager", "compiled"):
        assert by_id[f"gpu:{mode}:dot"]["ratio_to"] is None
        for v, goal in GPU_GOALS.items():
            e = by_id[f"gpu:{mode}:{v}"]
            assert e["ratio_to"] == f"gpu:{mode}:dot" and e["goal_min"] == goal and e["field"] == "rate"
            point = p.points[e["point"]]
            assert point["kind"] == "train" and "train.precision=bf16" in point["overrides"]
            assert point["compile"] == (mode == "compiled")
    for v, goal in GPU_GOAL_MEM.items():
        assert by_id[f"gpu:memory:{v}:n=512"] == {**by_id[f"gpu:memory:{v}:n=512"], "goal_max": goal,
                                                  "ratio_to": f"gpu:memory:{v}:n=128", "field": "total_mb"}


def test_gpu_part_1_plans_the_binding_points_as_configured():
    """GPU part 1, planned for an H100 by name (measuring needs it): dot and the flagship under bf16 master weights
    + compiled blocks and under train.autocast (fp32 master, ZeRO-0) + compiled blocks, MFU at accumulation 1 without
    a goal (the goals are at accumulation 8, part 3), and the bf16-master loss against the fp32-master eager run's."""
    from benchmarks.bench import parse_args
    from benchmarks.bench_points import LOSS_SLACK, Plan, plan_gpu_binding

    a = parse_args(["--quick", "--gpu-part", "1"])
    p = Plan(a)
    plan_gpu_binding(a, p, device="NVIDIA H100 80GB HBM3")
    by_id = {e["id"]: e for e in p.entries}
    for m in ("dot", "dense+dot"):
        for how, extra in (("bf16-master", ["train.master_weights=bf16"]),
                           ("autocast", ["parallel.zero_stage=0", "train.autocast=true"])):
            e = by_id[f"gpu-binding:{m}:{how}:compiled"]
            point = p.points[e["point"]]
            assert "goal_min" not in e and e["ratio_to"] == "gpu-binding:peak" and point["compile"], e
            assert point["kind"] == "train" and f"model.mixer={m}" in point["overrides"]
            assert all(o in point["overrides"] for o in ["train.precision=bf16", *extra]), point
        loss = by_id[f"gpu-binding:{m}:loss:bf16-master"]
        assert (loss["goal_min"], loss["goal_max"]) == (1 - LOSS_SLACK, 1 + LOSS_SLACK)
    assert by_id["gpu-binding:peak"]["reps"] == [989.4]


def test_the_data_part_plans_the_reader_and_the_start_at_100000_shards():
    """The data part's cluster-scale points (planned here; measured by `bench.py --only data`): a rank's reader at
    one rank, three sources, G 1024, and the demo trainer's start from 100,000 shards over HTTP."""
    from benchmarks.bench import parse_args
    from benchmarks.bench_points import DEMO, STARTUP_SHARDS, plan

    p = plan(parse_args(["--quick", "--only", "data"]))
    by_id = {e["id"]: e for e in p.entries}
    reader = p.points[by_id["data:reader-memory"]["point"]]
    assert (reader["kind"], reader["global_batch"], reader["fetch_threads"]) == ("reader", 1024, 8)
    assert by_id["data:reader-shards"]["field"] == "held_shards"
    if by_id["data:first-step-100k"]["point"]:   # planned where the demo shards are built (its tokenizer)
        start = p.points[by_id["data:first-step-100k"]["point"]]
        assert (start["kind"], start["config"], start["shards"]) == ("startup", DEMO, STARTUP_SHARDS) == \
            ("startup", DEMO, 100_000)


def test_a_point_whose_port_was_taken_is_started_again():
    """The rendezvous port is picked free, but another socket on the host may take it before the rank listens
    (EADDRINUSE): that point is started again, with a new port; any other failure is reported as it is."""
    from benchmarks.bench import PointFailed, retried_on_port_race

    tries = []
    taken = "DistNetworkError: The server socket has failed to listen ... EADDRINUSE, message: address already in use"

    def start(outcomes):
        tries.append(1)
        outcome = outcomes[len(tries) - 1]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    assert retried_on_port_race(lambda: start([{"error": taken}, {"rate": [1.0]}])) == {"rate": [1.0]}
    assert len(tries) == 2
    tries.clear()
    assert retried_on_port_race(lambda: start([PointFailed(taken), {"rate": [2.0]}])) == {"rate": [2.0]}
    tries.clear()
    assert retried_on_port_race(lambda: start([{"error": "boom"}, {"rate": [3.0]}])) == {"error": "boom"}
    assert len(tries) == 1
    tries.clear()
    assert retried_on_port_race(lambda: start([{"error": taken}] * 3)) == {"error": taken} and len(tries) == 3


def test_the_gpu_queue_splits_the_gpu_parts_and_plans_them_skipped_without_a_gpu():
    """make gpu-bench PART=k: part 3 is accumulation 8, part 4 every variant (resumed point by point where a window
    ends); a part's points are timed in one repetition of 20 steps; on a machine without CUDA the GPU parts plan one
    skipped entry each, saying why; part 0 plans no bench point (it runs benchmarks/compile_check.py), part 7 the
    three convergence runs (also on the CPU: --quick sizes)."""
    from benchmarks.bench import parse_args
    from benchmarks.bench_points import GPU_GOALS
    from benchmarks.bench_runs import SETTINGS, full_plan

    parts = {k: parse_args(["--quick", "--gpu-part", str(k)]) for k in range(9)}
    assert [parts[k].only for k in range(9)] == [[], ["gpu-binding"], ["engine"], ["gpu-accum"], ["gpu-variants"],
                                                 ["gpu-memory"], ["engine", "gpu"], ["convergence"], ["fp8"]]
    assert set(parts[4].variant_paths) == set(GPU_GOALS) | {"dot"}
    assert all((parts[k].reps, parts[k].steps) == (1, 20) for k in range(9))
    for k in (1, 3, 5, 8):
        entries = full_plan(parts[k]).entries
        assert len(entries) == 1 and "no CUDA device" in entries[0]["skipped"], entries
    assert full_plan(parts[0]).entries == []
    runs = full_plan(parts[7])
    assert [e["id"] for e in runs.entries] == [f"convergence:{s}" for s in SETTINGS]
    assert all(runs.points[e["point"]]["kind"] == "run" and e["field"] == "val_loss" for e in runs.entries)
    assert [e["goal_max"] for e in runs.entries] == [None, 1.01, 1.01]

LOSS_TOLERANCE = 1e-6   # relative, per step: loop and engine at fp32 on the CPU (measured: equal bit for bit)


def loop_and_engine_worker(rank, world):
    """The --quick engine part's two eager points stepped over the bench's steps (warm-up + reps × steps) in this
    process: each step's loss and learning rate, and the batches drawn."""
    from benchmarks.bench import parse_args
    from benchmarks.bench_lib import training_step
    from benchmarks.bench_points import plan
    from pretrain import distributed

    a = parse_args(["--quick", "--only", "engine"])
    p = plan(a)
    points = {e["id"]: p.points[e["point"]] for e in p.entries}
    out = {}
    for name, spec in (("loop", points["engine:loop:eager"]), ("engine", points["engine:eager"])):
        step, _, engine, cfg, _, _ = training_step(spec)
        lrs = []
        for _ in range(spec["warmup"] + spec["reps"] * spec["steps"]):
            lrs.append(engine.optimizer.param_groups[0]["lr"] if name != "engine" else engine.get_lr()[0])
            step()
        out[name] = {"losses": [float(x) for x in step.losses], "lr": lrs, "peak_lr": cfg.train.lr,
                     "warmup": cfg.train.warmup_steps, "batches": [b[0, :16].tolist() for b in step.batches]}
        distributed.shutdown()
    return out


def test_the_plain_loop_runs_the_engines_schedule_on_fresh_batches():
    """The engine part's plain loop and engine, eager at fp32 on the CPU (--quick sizes), over the bench's steps: the
    same learning rate each step (lr_lambda's warm-up: 0 at the first step), a fresh batch each step, and so the same
    loss each step within LOSS_TOLERANCE (the loop as it ran before, at train.lr from step 0 on one batch, is 3e-3
    off by the last step)."""
    from tests.support.distributed import run_distributed

    got = run_distributed(loop_and_engine_worker, 1)[0]
    loop, engine = got["loop"], got["engine"]
    print({k: v["losses"] for k, v in got.items()})
    steps = len(loop["losses"])
    assert steps == 5 and len(engine["losses"]) == steps
    assert loop["lr"] == engine["lr"] == [loop["peak_lr"] * s / loop["warmup"] for s in range(steps)]
    assert len({tuple(b) for b in loop["batches"]}) == steps and loop["batches"] == engine["batches"]
    for a, b in zip(loop["losses"], engine["losses"]):
        assert abs(a - b) <= LOSS_TOLERANCE * abs(b), (loop["losses"], engine["losses"])
