"""Table-1 parameter counts and training FLOPs, read off the real modules, against the paper and a FLOP counter."""
import json
import os
import subprocess
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from model import ModelConfig, build_model, variants
from model.accounting import model_stats

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def table1(variant, d, H, L, k, a, b):
    """Tay et al. 2020, Table 1 (+ H·m mixture weights), excluding V/O projections and biases."""
    parts = {"dot": 2 * d * d, "dense": d * d + d * L, "random": H * L * L, "random_fixed": 0,
             "factorized_dense": d * d + d * (a + b), "factorized_random": 2 * H * L * k, "sgu": H * L * L}
    names = variant.split("+")
    return sum(parts[m] for m in names) + (H * len(names) if len(names) > 1 else 0)


SETTINGS = [dict(d=32, H=4, L=16, k=4), dict(d=48, H=3, L=24, k=8), dict(d=64, H=8, L=32, k=2)]
VARIANTS = variants.names() + list(variants.PAPER_MIXTURES) + ["random+dense+factorized_random"]


@pytest.mark.parametrize("s", SETTINGS, ids=lambda s: "d{d}-H{H}-L{L}-k{k}".format(**s))
@pytest.mark.parametrize("variant", VARIANTS)
def test_table1_counts(variant, s):
    cfg = ModelConfig(vocab_size=64, d_model=s["d"], n_layers=2, n_heads=s["H"], max_seq_len=s["L"], mixer=variant,
                      factorized_k=s["k"])
    stats = model_stats(cfg)
    expect = table1(variant, s["d"], s["H"], s["L"], s["k"], cfg.factorized_a, cfg.factorized_b)
    assert [row["table1"] for row in stats["layers"]] == [expect, expect]
    assert stats["total"]["table1"] == 2 * expect


def test_random_fixed_counts_frozen_and_saves_R():
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=16, mixer="random_fixed")
    model = build_model(cfg)
    stats = model_stats(cfg)
    assert stats["total"]["table1"] == 0 and stats["total"]["frozen"] == 2 * 4 * 16 * 16
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert stats["total"]["trainable"] == trainable
    assert model.state_dict()["blocks.1.mixer.synth.random_fixed.R"].shape == (4, 16, 16)


@pytest.mark.parametrize("variant", VARIANTS + ["gmlp"])
def test_training_flops_match_a_flop_counter(variant):
    """Our per-token count vs torch's FlopCounterMode on one materialized forward+backward (batch 1, no biases).

    The counter sees matmuls only; we also count a few elementwise terms (α-weighting, outer products): ≤ 0.5%.
    """
    extra = variants.model_fields(variant)
    cfg = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, max_seq_len=32, impl="reference",
                      bias=False, **extra)
    model, n = build_model(cfg), 32
    x = torch.randint(0, 256, (1, n + 1))
    with FlopCounterMode(display=False) as counter:
        model(x[:, :-1], x[:, 1:]).backward()
    measured = counter.get_total_flops() / n
    ours = model_stats(cfg)["total"]["train_flops_per_token"]
    assert measured <= ours <= 1.005 * measured, (ours, measured)


def test_model_stats_cli_json(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"base: {ROOT}/configs/demo-cpu.yaml\n"
                   "model: {vocab_size: 64, d_model: 48, n_layers: 3, n_heads: 3, max_seq_len: 24, mixer: random}\n")
    out = subprocess.run([sys.executable, "tools/model_stats.py", "--config", str(cfg), "--json",
                          "model.factorized_k=8"], cwd=ROOT, capture_output=True, text=True, check=True)
    stats = json.loads(out.stdout)
    assert [r["table1"] for r in stats["layers"]] == [3 * 24 * 24] * 3
    bad = subprocess.run([sys.executable, "tools/model_stats.py", "--config", str(cfg), "model.mixer=rand"],
                         cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "rand" in bad.stderr
