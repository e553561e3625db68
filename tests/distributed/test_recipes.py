"""docs/recipes.md at tiny size, end to end: a warmup-stable-decay parent stopped in its stable phase, a decay branch
on the same data and one on an annealing blend (tools/branch.py), and the plot of their losses (tools/plot_runs.py).
The recipe's steps, in its order, with the trainer tests' tiny model and shards for the demo's."""
import json

from tests.support.runs import launch, losses, metric_rows, write_config
from tools import branch, plot_runs

K, D = 4, 3


def test_wsd_recipe_with_a_decay_branch_and_an_annealing_branch(shards, blend, tmp_path, capsys):
    # 1. the parent: WSD, stable until its decay at 80% of 40 steps; stopped at step 6, a checkpoint every 2
    parent = write_config(tmp_path / "wsd.yaml", shards, tmp_path / "wsd", train={
        "decay": "wsd", "warmup_steps": 2, "max_steps": 40, "stop_after_steps": 6},
        checkpoint={"every": 2, "keep": 2, "keep_every": 2})
    launch(parent, 2)
    # 2. a decay branch from step K on the same data, and one on an annealing blend (half the parent's data)
    runs = [tmp_path / "wsd", tmp_path / "decay", tmp_path / "anneal"]
    assert branch.main([str(runs[0]), "--step", str(K), "--out", str(runs[1]), "--decay-steps", str(D)]) == 0
    sources = f"[{{name: base, path: {shards}, weight: 0.5}}, {{name: anneal, path: {blend['a']}, weight: 0.5}}]"
    assert branch.main([str(runs[0]), "--step", str(K), "--out", str(runs[2]), "--decay-steps", str(D),
                        "--set", "data.shard_dir=null", "--set", f"data.sources={sources}"]) == 0
    printed = capsys.readouterr().out
    assert "data: another blend (data.shard_dir, data.sources changed): its order from global batch 4" in printed
    for run in runs[1:]:
        launch(str(run / "config.yaml"), 2)
    # 3. the plot
    assert plot_runs.main([*map(str, runs), "--out", str(tmp_path / "losses.png")]) == 0
    assert (tmp_path / "losses.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    assert sorted(losses(runs[0])) == list(range(1, 7))
    for run in runs[1:]:
        assert sorted(losses(run)) == list(range(K + 1, K + D + 1))
        assert json.loads((run / "branch.json").read_text())["step"] == K
    # the same-data branch's first step is the parent's step K + 1 (same weights, same batch), the blend's is not
    assert losses(runs[1])[K + 1] == losses(runs[0])[K + 1] != losses(runs[2])[K + 1]
    # the blend's order from its global batch K: its sources' tokens count K + D global batches of 8 × 32 tokens
    read = [r for r in metric_rows(runs[2]) if "data/anneal/tokens" in r][-1]
    assert read["data/anneal/tokens"] > 0 and read["data/base/tokens"] > 0
    assert read["data/anneal/tokens"] + read["data/base/tokens"] == (K + D) * 8 * 32
