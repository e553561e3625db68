"""The GPU window's harness on a CPU (benchmarks/gpu_part.py, gpu_window.py, gpu_records.py): a part measures only
the points that do not stand and writes each with its census entry as it finishes (a part killed midway keeps them),
stops cleanly before a deadline, times a point over 20 steps with their spread, records the commit without .git;
the window's dry run prints its plan with estimated seconds; what moves a figure changes the census's record.
The points are tiny stand-ins (tests/support/fake_gpu.py): an H100 named for planning, instant results."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from benchmarks import bench, gpu_part, gpu_records, gpu_window
from benchmarks.gpu_queue import configurations, planning_args, standing, verdict_judge
from benchmarks.gpu_records import read_rows, tree_state
from benchmarks.kernel_census import CENSUS_VERSION, key
from tests.support import fake_gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAKE = os.path.join(ROOT, "tests", "support", "fake_gpu.py")


def part_args(records, out, *extra):
    return ["--quick", "--gpu-part", "1", "--mem-budget-gb", "10", "--records", str(records), "--out", str(out),
            *extra]


def census_keys(out):
    path = out / "census.json"
    return json.loads(path.read_text())["parts"].get("1", []) if path.exists() else []


def test_a_part_killed_midway_keeps_its_points_and_census_and_its_rerun_measures_the_rest(tmp_path, monkeypatch):
    """Part 1 (6 points) in a process killed (SIGKILL) while its 4th point runs: the 3 measured rows and their census
    entries are on disk; run again, it measures the other 3 only, and its report shows all 6."""
    out = tmp_path / "2026-01-01-abc1234-h100" / "part1"
    proc = subprocess.Popen([sys.executable, FAKE, "0.1", "3", *part_args(tmp_path, out)], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": ROOT}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        end = time.time() + 90
        while len(census_keys(out)) < 3 and proc.poll() is None and time.time() < end:
            time.sleep(0.2)
        time.sleep(0.3)   # the 4th point is running (it never ends)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    first = census_keys(out)
    assert len(first) == 3 and len(read_rows(out)) == 3 and not (out / "results.md").exists()
    fake_gpu.install(monkeypatch)
    fake_gpu.RUN.clear()
    assert bench.main(part_args(tmp_path, out)) == 0
    again = {key(s) for s in fake_gpu.RUN}
    assert len(fake_gpu.RUN) == 3 and not again & set(first) and len(census_keys(out)) == 6
    report = json.loads((out / "results.json").read_text())
    earlier = [e for e in report["results"] if e.get("measured_in") and e["unit"] == "TFLOP/s"]
    assert len(earlier) == 3 and all(e["value"] for e in earlier)
    assert "measured earlier" in (out / "results.md").read_text()


def test_a_part_stops_before_its_deadline_and_times_twenty_steps(tmp_path, monkeypatch):
    """With --deadline-s 250 and points estimated at 100 s that take 100 s (a stand-in clock), two points run (each
    only until the deadline), the rest are left for the next run, recorded as such; each point is one process
    timing 20 steps, whose spread the report shows. A whole part (0) whose estimate does not fit does not start."""
    now = [1000.0]
    monkeypatch.setattr(gpu_part, "clock", lambda: now[0])
    fake_gpu.install(monkeypatch, on_point=lambda: now.__setitem__(0, now[0] + 100))
    fake_gpu.RUN.clear()
    monkeypatch.setattr(gpu_part, "estimate_s", lambda spec, walls=None: 100.0)
    out = tmp_path / "part1"
    assert bench.main(part_args(tmp_path, out, "--deadline-s", "250")) == 0
    assert len(fake_gpu.RUN) == 2 and all(s["timeout"] <= 250 for s in fake_gpu.RUN)
    assert all((s["reps"], s["steps"]) == (1, 20) for s in fake_gpu.RUN)
    report = json.loads((out / "results.json").read_text())
    assert len(report["left"]) == 4 and report["stopped"].startswith("stopped before the deadline")
    assert len(census_keys(out)) == 2
    measured = [e for e in report["results"] if e.get("step_ms")]
    assert len(measured) == 2 and measured[0]["step_ms"]["n"] == 20 and measured[0]["iqr"] > 0
    assert "IQR" in (out / "results.md").read_text()
    lines = []
    args = bench.parse_args(["--quick", "--gpu-part", "0", "--mem-budget-gb", "1", "--records", str(tmp_path), "--out",
                             str(tmp_path / "part0"), "--deadline-s", "100"])
    assert gpu_part.run_gpu_part(args, bench.parse_args, log=lines.append) == 0
    assert "stopped before the deadline" in lines[-1] and not (tmp_path / "part0").exists()


def plant(root, name, part, specs, census, boot=None):
    """A record of `specs` measured (census.json as a GPU part writes it), with `census` counted for each."""
    folder = root / name
    folder.mkdir(parents=True)
    machine = {"device": fake_gpu.DEVICE, "boot": boot}
    (folder / "census.json").write_text(json.dumps({
        "commit": "abc1234", "device": fake_gpu.DEVICE, "torch": torch.__version__, "census_version": CENSUS_VERSION,
        "parts": {str(part): [key(s) for s in specs]},
        "configurations": {key(s): {"spec": s, "census": census, "machine": machine, "tree": {"commit": "abc1234"}}
                           for s in specs}}))


def test_the_window_dry_run_prints_its_plan_and_the_stamp_it_leaves_decides_on_the_machine(tmp_path, monkeypatch,
                                                                                             capsys):
    """Part 0 measured whole and dot's three points of part 1, their census today's: the dry run (the census counted
    by a stand-in) plans part 1's three flagship points and part 2's first, each with its estimated seconds, the rest
    for the next window; its stamp carries the commit and the verdicts, by which the GPU machine (no count there)
    finds the same points standing; without them they would not stand there."""
    census = {"forward": {"mm": 3}, "backward": {"mm": 6}, "optimizer step": {"_fused_adamw": 1}, "beside": {}}
    planned = {k: configurations(k, planning_args(k, bench.parse_args)) for k in (0, 1)}
    plant(tmp_path, "2026-01-01-abc1234-h100/part0", 0, planned[0], census)
    plant(tmp_path, "2026-01-01-abc1234-h100/part1", 1, planned[1][:3], census)
    monkeypatch.setattr(gpu_records, "STAMP", str(tmp_path / "stamp.json"))
    counted = []

    def count(specs, tree):
        counted.extend(specs)
        return {key(s): census for s in specs}
    assert gpu_window.main(["--dry-run", "--records", str(tmp_path), "--parts", "0,1,2,3"], count=count) == 0
    shown = capsys.readouterr().out
    print(shown)
    assert "part 0: stands (3 configurations)" in shown and "part 1: partly, 3 to measure" in shown
    assert shown.count("~67 s") >= 2 and "~157 s" in shown and "[next window] ~" in shown
    assert "parts to run: 1, 2" in shown and len(counted) == 6
    stamp = json.loads((tmp_path / "stamp.json").read_text())
    assert stamp["commit"] == tree_state()["commit"] and stamp["digest"] == tree_state()["digest"]
    verdicts = stamp["verdicts"][os.path.relpath(tmp_path / "2026-01-01-abc1234-h100/part1", ROOT)]
    assert len(verdicts) == 3 and all(v[0] is True for v in verdicts.values())
    here = {"device": fake_gpu.DEVICE}
    on_gpu = standing(bench.parse_args, [1], root=str(tmp_path), machine=here,
                      judge=gpu_part.local_judge(tree_state()), log=lambda *_: None)[1]
    assert len(on_gpu["stands"]) == 3
    unjudged = standing(bench.parse_args, [1], root=str(tmp_path), machine=here, judge=verdict_judge({}, None),
                        log=lambda *_: None)[1]
    assert unjudged["stands"] == [] and unjudged["state"] == "uncounted"
    elsewhere = standing(bench.parse_args, [1], root=str(tmp_path), machine={**here, "device": "NVIDIA H200"},
                         judge=gpu_part.local_judge(tree_state()), log=lambda *_: None)[1]
    assert elsewhere["stands"] == [] and sum(elsewhere["points"][k]["why"] == "measured elsewhere: device "
                                             f"{fake_gpu.DEVICE} here NVIDIA H200" for k in elsewhere["missing"]) == 3


def test_the_commit_is_recorded_where_the_tree_arrives_without_git(tmp_path, monkeypatch):
    """The stamp written where git names the commit is read where the tree arrives without .git; a file changed
    since marks the commit; the record's folder is docs/gpu/<date>-<commit>-<device>."""
    monkeypatch.delenv("GPU_COMMIT", raising=False)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "a.py").write_text("x = 1\n")
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t", "-C", str(tmp_path)]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "one"]):
        subprocess.run(git + args, check=True, capture_output=True)
    commit = tree_state(str(tmp_path))["commit"]
    gpu_records.write_stamp(str(tmp_path))
    subprocess.run(["rm", "-rf", str(tmp_path / ".git")], check=True)
    copied = tree_state(str(tmp_path))
    assert (copied["commit"], copied["source"], copied["dirty"]) == (commit, "stamp", False)
    assert gpu_records.default_out(copied, "NVIDIA H200", "/r").endswith(f"-{commit}-h200")
    (tmp_path / "model" / "a.py").write_text("x = 2\n")
    changed = tree_state(str(tmp_path))
    assert changed["commit"] == f"{commit}+changed" and changed["dirty"] and changed["digest"] != copied["digest"]
    monkeypatch.setenv("GPU_COMMIT", "feed123")
    assert tree_state(str(tmp_path))["commit"] == "feed123"


def test_what_moves_a_figure_changes_the_census_key_or_its_record(tmp_path):
    """Compiled or not (the key), what is compiled and how, the compiler's settings, SDPA's signature and backends,
    a Triton source's body, the ops' dtypes (the record beside the counts), and the machine's device, torch,
    triton and steering environment (each point's machine): each change is seen."""
    import torch._inductor.config as inductor
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from benchmarks.kernel_census import Beside, Kernels, compiler_settings

    eager = {"kind": "train", "config": "c.yaml", "overrides": ["a=1"], "compile": False}
    assert key(eager) == json.dumps({"config": "c.yaml", "kind": "train", "overrides": ["a=1"]}, sort_keys=True)
    assert key({**eager, "compile": True}) != key(eager)

    def record(run):
        beside = Beside().patch()
        try:
            with Kernels(in_triton=lambda: False) as kernels, beside:
                beside.counting = True
                run(beside)
                kernels.phase("forward")
            return beside.record(kernels, str(tmp_path))
        finally:
            beside.unpatch()
    block = torch.nn.Linear(4, 4)
    base = record(lambda b: torch.compile(block)(torch.ones(2, 4)))
    assert record(lambda b: torch.compile(block, mode="max-autotune")(torch.ones(2, 4)))["compiled"] != \
        base["compiled"] and record(lambda b: block(torch.ones(2, 4)))["compiled"] == {}
    assert record(lambda b: block.to(torch.bfloat16)(torch.ones(2, 4, dtype=torch.bfloat16)))["dtypes"] != \
        record(lambda b: block.float()(torch.ones(2, 4)))["dtypes"]
    q = torch.ones(1, 2, 8, 64)

    def attend(*args, **kwargs):
        return lambda b: F.scaled_dot_product_attention(*args, **kwargs)
    signatures = [record(run)["sdpa"] for run in (attend(q, q, q, is_causal=True), attend(q, q, q),
                                                  attend(q.bfloat16(), q.bfloat16(), q.bfloat16(), is_causal=True),
                                                  attend(q, q, torch.ones(1, 2, 8, 32), is_causal=True))]
    with sdpa_kernel(SDPBackend.MATH):
        signatures.append(record(attend(q, q, q, is_causal=True))["sdpa"])
    assert len({json.dumps(s) for s in signatures}) == 5
    with inductor.patch(max_autotune=not inductor.max_autotune):
        assert compiler_settings() != base["compiler"]
    source = tmp_path / "kernel.py"
    hashes = []
    for body in ("x = 1\n", "x = 2\n"):
        source.write_text(body)
        beside = Beside()
        beside.triton_files.add(str(source))
        hashes.append(beside.record(Kernels(in_triton=lambda: False), str(tmp_path))["triton"])
    assert hashes[0] != hashes[1] and list(hashes[0]) == ["kernel.py"]
    then = gpu_records.machine(fake_gpu.DEVICE)
    for k, v in (("device", "NVIDIA H200"), ("torch", "2.99"), ("triton", "9.9"),
                 ("env", {**then["env"], "TORCHINDUCTOR_MAX_AUTOTUNE": "1"})):
        assert gpu_records.differences(then, {**then, k: v}), k
    assert not gpu_records.differences(then, {**then, "boot": "another session"})


def test_the_mfu_goals_are_at_accumulation_8_by_device():
    """Part 3: dot and the flagship at accumulation 8 with the goals of the device (H100 55% and 45%, H200 58% and
    48%); their accumulation-1 points beside them are part 1's configurations, without a goal."""
    from benchmarks.bench_points import GOAL_MFU
    from benchmarks.bench_runs import full_plan

    assert GOAL_MFU == {"dot": {"H100": 0.55, "H200": 0.58}, "dense+dot": {"H100": 0.45, "H200": 0.48}}
    part1 = {key(s) for s in configurations(1, planning_args(1, bench.parse_args))}
    for device, goals in (("NVIDIA H100 80GB HBM3", (0.55, 0.45)), ("NVIDIA H200", (0.58, 0.48))):
        a = planning_args(3, bench.parse_args, device)
        p = full_plan(a)
        by_id = {e["id"]: e for e in p.entries}
        for m, goal in zip(("dot", "dense+dot"), goals):
            for how in ("bf16-master", "autocast"):
                eight, one = by_id[f"gpu-accum:{m}:{how}:accum8"], by_id[f"gpu-accum:{m}:{how}:accum1"]
                assert eight["goal_min"] == goal and one["goal_min"] is None
                assert "train.global_batch_size=32" in p.points[eight["point"]]["overrides"]
                assert key(p.points[one["point"]]) in part1
    with pytest.raises(KeyError):
        by_id["gpu-accum:dot:bf16-master:accum4"]


def test_the_window_runs_the_next_parts_and_stops_with_a_part_that_meets_its_deadline(tmp_path, monkeypatch):
    """`make gpu-window` on stand-in points of 100 s (estimated and taken, by a stand-in clock) with 250 s: part 1
    runs two of its points and stops before its deadline; the window stops with it (part 2 waits for the next
    window, in the queue's order) and says so in window.json."""
    now = [1000.0]
    monkeypatch.setattr(gpu_part, "clock", lambda: now[0])
    monkeypatch.setattr(gpu_part, "estimate_s", lambda spec, walls=None: 100.0)
    fake_gpu.install(monkeypatch, on_point=lambda: now.__setitem__(0, now[0] + 100))
    fake_gpu.RUN.clear()
    monkeypatch.setattr(gpu_window, "tee", lambda command, log, timeout: bench.main(command[2:] + ["--quick"]))
    out = tmp_path / "2026-01-01-abc1234-h100"
    assert gpu_window.main(["--records", str(tmp_path), "--out", str(out), "--parts", "1,2", "--no-install",
                            "--deadline-s", "250"]) == 0
    window = json.loads((out / "window.json").read_text())
    assert list(window["parts"]) == ["1"] and window["parts"]["1"]["stopped"].startswith("stopped before")
    assert len(fake_gpu.RUN) == 2 and not (out / "part2").exists() and "part 2" in " ".join(window["plan"])
