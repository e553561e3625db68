"""Fleet health on real ranks: a rank slowed 3× in its forward (the `slow` fault hook) is named with its host, GPU
index and phases, its peers are not, and the window records say the same."""
import json
import os

from tests.support.runs import ROOT, launch, ranks, tensorboard_scalars, write_config


def test_a_rank_slowed_3x_in_its_forward_is_named_and_its_peers_are_not(shards, tmp_path):
    """4 gloo ranks, data parallel; rank 2 runs every forward 3 times from step 1 (SYNTHFORMER_FAULTS=slow@1@2).
    Windows of 5 steps, the first (warm-up) not judged, named after 3 late windows in a row: at step 20, later where
    this machine's noise broke a streak (the suite runs 2 tests at once on 2 cores: step 30 was seen), and again after
    a broken streak runs 3 windows once more; no other rank ever. The factor is 1.5 here: on 4 ranks sharing 2 cores a window of a few steps can
    show any rank 1.2× its peers (tests/data/fleet_even_4ranks.json: none named at 1.5 in windows of 5)."""
    cfg = write_config(tmp_path / "c.yaml", shards, tmp_path / "run", train={"max_steps": 40, "global_batch_size": 8,
                                                                            "micro_batch_size": 2},
                       logging={"every": 40, "val_every": 0, "image_every": 0},
                       fleet={"every": 5, "slow_factor": 1.5})
    r = launch(cfg, 4, env={"SYNTHFORMER_FAULTS": "slow@1@2", "OMP_NUM_THREADS": "1"})
    lines = [line for line in r.stdout.splitlines() if "fleet: rank" in line]
    print("\n".join(lines))
    assert lines and all("fleet: rank 2 (host " in line and ", GPU 2) slow compute" in line for line in lines), lines
    assert all(f"{p} " in lines[0] for p in ("data_wait", "compute", "backward", "optimizer", "collective")), lines
    windows = [json.loads(line) for line in open(tmp_path / "run" / "fleet" / "windows.jsonl")]
    assert [w["step"] for w in windows] == [5, 10, 15, 20, 25, 30, 35, 40]
    named = {w["step"]: [s["rank"] for s in w["named"]] for w in windows if w["named"]}
    assert named and all(r == [2] for r in named.values()) and min(named) >= 20 and len(named) == len(lines), named
    assert sum(w["slowest_rank"] == 2 for w in windows[1:]) >= 5, windows
    record = next(s for w in windows for s in w["named"])
    assert record["phase"] == "compute" and record["gpu"] == 2 and record["ratio"] > 1.5
    assert len(tensorboard_scalars(str(tmp_path / "run"), "fleet/slowest_rank")) == 8


def preflight(cfg, env, *overrides):
    # loopback links of a 2-core machine shared with other jobs vary by 2× between pairs: their floor is set low here
    return ranks([cfg, "fleet.link_floor=0.25", *overrides, "--repeats", "10", "--mb", "1"], 4, {"PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", **env}, 120,
                 warm="pretrain.fleet")


def test_the_check_before_launch_names_a_slow_gemm_and_passes_an_even_machine(shards, tmp_path):
    """python -m pretrain.fleet on 4 gloo ranks: with rank 1's GEMM slowed 3× (slow@1@1) it names rank 1 alone, in
    both passes, and exits 1; without, it passes (once a link of this loaded machine came out at 23% of the median in
    one pass: the confirming pass is what keeps such a pass from failing an even machine) with the figures of 4 ranks and 6 links (every rank pair, on one host)."""
    cfg = write_config(tmp_path / "c.yaml", shards, tmp_path / "run", train={"micro_batch_size": 2})
    # a floor of 0.7: under the suite's other worker a healthy rank's best GEMM came out at 0.88 of the median once,
    # below the default 0.9; the slowed rank measures 0.2–0.56
    slow = preflight(cfg, {"SYNTHFORMER_FAULTS": "slow@1@1"}, "fleet.gpu_floor=0.7")
    [line] = [line for line in slow.stdout.splitlines() if line.startswith("preflight")]   # rank 0's, one
    print(line)
    assert slow.returncode == 1, slow.stdout + slow.stderr[-2000:]
    assert line.startswith("preflight: slow: rank 1 (host ") and "GPU 1) GEMM TFLOP/s" in line
    assert "rank 0 " not in line and "rank 2 " not in line and "rank 3 " not in line
    assert line.endswith("(the best of 2 passes)")   # a slow GPU is named again by the confirming pass
    # the even machine's GEMMs at a floor of 0.6: with the suite's other worker on the same 2 cores a rank's turn can
    # come out at 0.8 of the median (the slowed rank above is at 0.2–0.56)
    even = preflight(cfg, {}, "fleet.gpu_floor=0.6")
    [line] = [line for line in even.stdout.splitlines() if line.startswith("preflight")]
    print(line)
    assert even.returncode == 0 and line.startswith("preflight: 4 ranks even") and "6 links even" in line


def test_fleet_preflight_stops_the_trainer_before_its_first_step_on_a_slow_gemm(shards, tmp_path):
    cfg = write_config(tmp_path / "c.yaml", shards, tmp_path / "run", train={"micro_batch_size": 2},
                       fleet={"preflight": True, "link_floor": 0.25})
    r = launch(cfg, 4, check=False, env={"SYNTHFORMER_FAULTS": "slow@1@3", "OMP_NUM_THREADS": "1"})
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "preflight: slow: " in out and "rank 3 (host vm, GPU 3) GEMM" in out, out[-3000:]
    assert "fleet.preflight=false" in out
    assert "step 1/" not in r.stdout
