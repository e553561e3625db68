"""Decay branches (tools/branch.py): a branch from step k of a stable warmup-stable-decay run trains as the parent
would have with its decay starting at k — the same losses, bit for bit — and names its parent and step."""
import json

import pytest

from tests.support.runs import launch, losses, metric_rows, write_config
from tools import branch

K, D = 6, 4   # the branch step and the decay's length
WSD = {"decay": "wsd", "decay_steps": D, "decay_shape": "1-sqrt", "warmup_steps": 3}


def test_a_branch_at_k_trains_as_the_parent_decaying_at_k(shards, tmp_path, capsys):
    # the parent with its decay at k: max_steps k + D; the stable parent (decay at 16) stops at k with a checkpoint
    decaying = write_config(tmp_path / "decaying.yaml", shards, tmp_path / "decaying", parallel={"zero_stage": 1},
                            train={**WSD, "max_steps": K + D})
    stable = write_config(tmp_path / "stable.yaml", shards, tmp_path / "stable", parallel={"zero_stage": 1},
                          train={**WSD, "max_steps": 20, "stop_after_steps": K})
    launch(decaying, 2)
    launch(stable, 2)
    assert branch.main([str(tmp_path / "stable"), "--step", str(K), "--out", str(tmp_path / "branch")]) == 0
    assert f"decay over {D} steps (1-sqrt) to step {K + D}, data: the parent's position" in capsys.readouterr().out
    launch(str(tmp_path / "branch" / "config.yaml"), 2)

    whole, first, then = losses(tmp_path / "decaying"), losses(tmp_path / "stable"), losses(tmp_path / "branch")
    assert sorted(first) == list(range(1, K + 1)) and sorted(then) == list(range(K + 1, K + D + 1))
    assert {s: whole[s] for s in first} == first       # the same stable phase
    assert {s: whole[s] for s in then} == then         # and the same decay: bit-equal losses after k
    lr = {r["step"]: r["train/lr"] for r in metric_rows(tmp_path / "branch") if "train/lr" in r}
    assert lr[K + D] < lr[K + 1] < 3e-3                # it decays (lr 3e-3 → min_lr 3e-4)

    record = json.loads((tmp_path / "branch" / "branch.json").read_text())
    assert (record["parent"], record["step"], record["max_steps"]) == (str(tmp_path / "stable"), K, K + D)
    named = [r for r in metric_rows(tmp_path / "branch") if "branch/parent" in r]
    assert [(r["step"], r["branch/parent_step"]) for r in named] == [(K, K)]
    assert f"a decay branch of {tmp_path / 'stable'} at step {K}" in named[0]["branch/parent"]

    # one-line errors: a step without a checkpoint, a step in a decay, an --out that holds a run
    for args, message in [
            ([tmp_path / "stable", "--step", 5], f"{tmp_path / 'stable'} has no checkpoint of step 5 (its "
                                                 f"checkpoints: {K}): pass --step of one of them"),
            ([tmp_path / "decaying", "--step", K + D], f"step {K + D} is not in the parent's stable phase"),
            ([tmp_path / "stable", "--step", K, "--out", tmp_path / "branch"], "already holds checkpoints")]:
        out = ["--out", str(tmp_path / "other")] if "--out" not in args else []
        assert branch.main([str(a) for a in args] + out) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err


@pytest.mark.parametrize("change, message", [
    (["--set", "train.max_steps=50"], "the changes make the branch's decay start at step 46, not at 6"),
    (["--set", "train.lr=abc"], "train.lr='abc' must be of type float")])
def test_branch_changes_that_break_the_branch_are_one_line_errors(shards, tmp_path, capsys, change, message):
    """Checked before any file is linked: the config only (a fake checkpoint directory with its config.yaml)."""
    tag = tmp_path / "parent" / "checkpoints" / f"step_{K:08d}"
    tag.mkdir(parents=True)
    cfg = write_config(tmp_path / "p.yaml", shards, tmp_path / "parent", train={**WSD, "max_steps": 20})
    (tag / "config.yaml").write_text(open(cfg).read())
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"")
    assert branch.main([str(tmp_path / "parent"), "--step", str(K), "--out", str(tmp_path / "b"), *change]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
