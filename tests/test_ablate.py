"""tools/ablate.py end to end on the tiny test shards: two variants, a few steps each, one process."""
import json
import os
import subprocess

import pytest

from model.accounting import model_stats
from pretrain.config import load_config
from tests.runs import PY, ROOT, write_config
from evaluation.cli import load
from evaluation.perplexity import evaluate_shards


@pytest.mark.slow
def test_ablate_trains_evaluates_and_reports(shards, tmp_path):
    base = write_config(tmp_path / "base.yaml", shards, tmp_path / "unused", train={"max_steps": 6})
    out = tmp_path / "study"
    cmd = [PY, os.path.join(ROOT, "tools", "ablate.py"), "--variants", "dot,random", "--steps", "6", "--nproc", "1",
           "--config", base, "--tasks", "", "--out", str(out)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {row["variant"]: row for row in json.loads((out / "results.json").read_text())["rows"]}
    assert sorted(rows) == ["dot", "random"]
    for variant, row in rows.items():
        run_dir = out / variant
        model, _, info = load(str(run_dir), need_tokenizer=False)
        assert info["step"] == 6                                        # the budget, not the config's max_steps
        val = evaluate_shards(model, shards, "val", batch_size=16)
        assert row["val_ppl"] == pytest.approx(val["ppl"], rel=1e-9)
        cfg = load_config(base, [f"model.mixer={variant}"]).model
        assert row["synth_params"] == model_stats(cfg)["total"]["table1"]
    table = (out / "results.md").read_text()
    assert "| dot |" in table and "| random |" in table and (out / "loss_curves.png").stat().st_size > 10_000
    # finished variants are not trained again
    trained = (out / "dot" / "metrics.jsonl").read_text()
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and (out / "dot" / "metrics.jsonl").read_text() == trained
    bad = subprocess.run(cmd[:3] + ["dot,randm"] + cmd[4:], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and "randm" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
