"""Moving off a slow node (pretrain/fleet/exclusion.py): which node leaves, the data-parallel size without it, and
the excluded-nodes file that keeps it out of later launches until a person removes it."""
from pretrain.fleet.exclusion import EXCLUDED, Exclusion, Refused, due, excluded, hosts_for_launch, plan, record

HOSTS = ["n0", "n1", "n2", "n3"]


def test_the_node_named_longest_past_the_limit_leaves():
    assert due({"n1": 100.0, "n2": 50.0}, now=400.0, after_s=300) == "n2"
    assert due({"n1": 100.0, "n2": 150.0}, now=400.0, after_s=300) == "n1"
    assert due({"n1": 200.0}, now=400.0, after_s=300) is None
    assert due({}, now=400.0, after_s=300) is None


def test_without_one_of_4_nodes_of_8_gpus_dp_drops_to_24_and_the_global_batch_stays():
    move = plan("n2", HOSTS, 8, tp=1, pp=1, global_batch=96, micro_batch=4, why="rank 17 slow compute")
    assert move == Exclusion("n2", ("n0", "n1", "n3"), 24, 24, 4, "rank 17 slow compute")
    assert move.line() == ("fleet.exclude: node n2 leaves (rank 17 slow compute); relaunching on 3 nodes, 24 ranks, "
                           "data parallel 24, micro-batch 4, the same global batch")


def test_tensor_and_pipeline_parallel_divide_the_world_and_the_micro_batch_shrinks_to_fit():
    # 3 nodes × 8 = 24 ranks, tp 2 × pp 2: dp 6; 48 / 6 = 8 samples a rank a step, micro-batch 3 → 2 (4 × 2)
    move = plan("n0", HOSTS, 8, tp=2, pp=2, global_batch=48, micro_batch=3, why="x")
    assert (move.world, move.dp, move.micro_batch, move.hosts) == (24, 6, 2, ("n1", "n2", "n3"))
    assert 48 % (move.dp * move.micro_batch) == 0


def test_a_dp_that_does_not_divide_the_global_batch_keeps_the_node_and_says_why():
    r = plan("n1", HOSTS, 2, tp=1, pp=1, global_batch=16, micro_batch=2, why="x")   # dp 6 does not divide 16
    assert isinstance(r, Refused)
    assert r.line.startswith("fleet.exclude: node n1 stays: without it data parallel would be 6, which does not "
                             "divide train.global_batch_size=16")


def test_the_last_node_and_an_unknown_node_never_leave():
    assert isinstance(plan("n0", ["n0"], 8, 1, 1, 64, 4, "x"), Refused)
    assert "not in the host list" in plan("n9", HOSTS, 8, 1, 1, 64, 4, "x").line


def test_an_excluded_node_stays_out_of_later_launches_until_its_line_is_deleted(tmp_path):
    run = str(tmp_path)
    assert excluded(run) == [] and hosts_for_launch(run, HOSTS) == HOSTS
    move = plan("n2", HOSTS, 8, 1, 1, 96, 4, "rank 17 slow compute")
    path = record(run, move)
    record(run, move)   # a second supervisor (another node's) writing the same move: one line
    assert path == str(tmp_path / EXCLUDED)
    text = open(path).read()
    assert text.count("\n") == 1 and text.startswith("n2  # ") and "rank 17 slow compute" in text
    assert excluded(run) == ["n2"] and hosts_for_launch(run, HOSTS) == ["n0", "n1", "n3"]
    record(run, plan("n0", ["n0", "n1", "n3"], 8, 1, 1, 96, 4, "slow data"))
    assert hosts_for_launch(run, HOSTS) == ["n1", "n3"]
    lines = open(path).readlines()
    with open(path, "w") as f:   # a person lets n2 back
        f.write("".join(line for line in lines if not line.startswith("n2")))
    assert hosts_for_launch(run, HOSTS) == ["n1", "n2", "n3"]


def test_fleet_exclude_true_is_accepted_and_the_fleet_keys_are_checked():
    import pytest

    from model.config import ConfigError
    from pretrain.config import FleetSection

    assert FleetSection(exclude=True, exclude_after_s=60).exclude
    with pytest.raises(ConfigError, match=r"^fleet.exclude_after_s=-1.0 is out of range"):
        FleetSection(exclude=True, exclude_after_s=-1)
    with pytest.raises(ConfigError, match=r"^fleet.slow_factor=1.0 is out of range"):
        FleetSection(slow_factor=1.0)
    assert FleetSection().window_steps(0.5) == 40 and FleetSection().window_steps(None) == 100
    assert FleetSection(every=7).window_steps(0.5) == 7
