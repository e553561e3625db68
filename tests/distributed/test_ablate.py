"""tools/ablate.py: the spread and ranking arithmetic by hand, and end to end on the tiny test shards (two variants,
two seeds, a few steps each, one process), resumed after an interruption."""
import json
import os
import subprocess

import pytest
import yaml

from model.accounting import model_stats
from pretrain.config import load_config
from tests.support.runs import PY, ROOT
from evaluation.loading import load
from evaluation.perplexity import evaluate_shards
from tools.ablate import cell, ranking, spread


def test_spread_and_ranking_by_hand():
    ppl = {"dot": [45.0, 46.0], "dense": [44.0, 44.5], "random": [53.0, 54.5], "random+dot": [45.5, 45.8]}
    assert spread(ppl["dot"]) == (45.5, 45.0, 46.0)
    assert cell(ppl["dot"], "{:.2f}") == "45.50 [45.00, 46.00]" and cell([45.0], "{:.2f}") == "45.00"
    # by mean: dense 44.25, dot 45.5, random+dot 45.65, random 53.75; dot's worst (46.0) does not beat
    # random+dot's best (45.5): that pair alone is indistinguishable
    assert ranking(ppl) == [("dense", "dot", True), ("dense", "random+dot", True), ("dense", "random", True),
                            ("dot", "random+dot", False), ("dot", "random", True), ("random+dot", "random", True)]
    assert ranking({"dot": [45.0], "random": [53.0]}) == [("dot", "random", False)]   # one seed: no spread, no rank


@pytest.mark.slow
def test_ablate_trains_evaluates_reports_and_resumes(shards, tmp_path):
    # the GPU study's preset, at a reduced size on the test shards (its model and batch made small, fp32 on CPU)
    small = [f"data.shard_dir={shards}", "data.num_workers=0", "data.val_batches=2", "model.vocab_size=512",
             "model.max_seq_len=32", "model.d_model=64", "model.n_layers=2", "model.n_heads=4",
             "train.global_batch_size=8", "train.micro_batch_size=4", "train.precision=fp32"]
    out = tmp_path / "study"
    # each cell's launch/pretrain.sh runs its one trainer in place, as in a one-task job step of a scheduler (RANK
    # set): the DeepSpeed launcher's own path, its check and its two Python processes a cell, is test_training's
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    cmd = [PY, os.path.join(ROOT, "tools", "ablate.py"), "--preset", os.path.join(ROOT, "configs", "studies",
           "gpu.yaml"), "--variants", "dot,random", "--steps", "6", "--nproc", "1", "--out", str(out), *small]
    first = subprocess.run(cmd + ["--seeds", "1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]   # an interrupted study: seed 0 of each variant done
    trained = (out / "dot" / "seed0" / "metrics.jsonl").read_text()
    r = subprocess.run(cmd + ["--seeds", "2"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (out / "dot" / "seed0" / "metrics.jsonl").read_text() == trained   # finished runs are not trained again
    study = json.loads((out / "results.json").read_text())
    assert study["seeds"] == 2 and study["tokens"] == 6 * 8 * 32
    for variant, rows in study["runs"].items():
        assert [row["seed"] for row in rows] == [0, 1]
        for row in rows:
            model, _, info = load(str(out / variant / f"seed{row['seed']}"), need_tokenizer=False)
            assert info["step"] == 6                                    # the budget, not the config's max_steps
            val = evaluate_shards(model, shards, "val", batch_size=16)
            assert row["val_ppl"] == pytest.approx(val["ppl"], rel=1e-9)
        assert rows[0]["val_ppl"] != rows[1]["val_ppl"]                 # other init and data order
        cfg = load_config(os.path.join(ROOT, "configs", "study-gpu-50m.yaml"), [*small, f"model.mixer={variant}"]).model
        assert rows[0]["synth_params"] == model_stats(cfg)["total"]["table1"]
    table = (out / "results.md").read_text()
    ppl = [row["val_ppl"] for row in study["runs"]["dot"]]
    assert "| dot | " in table and f"{sum(ppl) / 2:.2f} [{min(ppl):.2f}, {max(ppl):.2f}]" in table
    assert "Seeds: 2 per variant" in table and "Ranking by validation perplexity" in table
    assert (out / "loss_curves.png").stat().st_size > 10_000
    bad = subprocess.run(cmd[:5] + ["dot,randm"] + cmd[6:], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and "randm" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def test_the_recorded_default_study_keeps_its_ranking_at_twice_the_budget():
    """docs/study: the default study (600 steps) and its 2× check (1200), as run: every pair ranked at 600 is ranked the
    same way at 1200 or indistinguishable there (never reversed), and docs/study/README.md quotes their perplexities."""
    def verdicts(steps):
        with open(os.path.join(ROOT, "docs", "study", f"cpu-{steps}.json")) as f:
            study = json.load(f)
        assert study["steps"] == steps and study["seeds"] == 2
        ppl = {v: [r["val_ppl"] for r in runs] for v, runs in study["runs"].items()}
        return ppl, {(a, b) for a, b, ranked in ranking(ppl) if ranked}

    ppl_600, ranked_600 = verdicts(600)
    ppl_1200, ranked_1200 = verdicts(1200)
    with open(os.path.join(ROOT, "configs", "studies", "cpu.yaml")) as f:
        assert set(ppl_600) == set(ppl_1200) == set(yaml.safe_load(f)["variants"])
    assert ranked_600, "the default budget ranks no pair: nothing to check"
    assert not {(b, a) for a, b in ranked_600} & ranked_1200, "a pair ranked at 600 steps is reversed at 1200"
    with open(os.path.join(ROOT, "docs", "study", "README.md")) as f:
        readme = f.read()
    for ppl in (ppl_600, ppl_1200):
        for v, values in ppl.items():
            assert f"| {v} | {cell(values, '{:.2f}')}" in readme, f"docs/study/README.md's table row of {v} differs from the JSON"


def test_compare_studies_names_the_flipped_pairs_and_the_distance_to_the_papers_order(tmp_path):
    from tools.compare_studies import compare, kendall_tau, main

    a = {"dot": [50.0, 51.0], "dense": [40.0, 41.0], "random": [45.0, 46.0]}
    b = {"dot": [40.0, 41.0], "dense": [42.0, 43.0], "random": [47.0, 48.0]}
    out = compare(a, b, ("windows", "documents"))
    assert "| dense, dot (order changed) | dense < dot | +24.7% | dot < dense | -4.7% |" in out
    assert "| dense, random | dense < random | +12.3% | dense < random | +11.8% |" in out
    # paper: dot < random < dense; windows: dense < random < dot (τ −1), documents: dot < dense < random (τ +1/3)
    assert kendall_tau(["dense", "random", "dot"], {"dot": 38.2, "random": 40.6, "dense": 40.9}) == -1.0
    assert "windows -1.00, documents +0.33" in out
    for name, study in (("a", a), ("b", b)):
        runs = {v: [{"val_ppl": p} for p in ppl] for v, ppl in study.items()}
        (tmp_path / f"{name}.json").write_text(json.dumps({"runs": runs}))
    assert main([str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--names", "x"]) == 2
    assert main([str(tmp_path / "a.json"), str(tmp_path / "missing.json")]) == 2
