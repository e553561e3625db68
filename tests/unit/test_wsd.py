"""Warmup-stable-decay (train.decay: wsd): the LR multiplier against hand-computed numbers, its config errors."""
from pathlib import Path

import pytest

from model.config import ConfigError
from pretrain.config import load_config
from pretrain.engine import lr_lambda

DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo-cpu.yaml"
# lr 1e-3 → min_lr 1e-4 (f = 0.1), warmup 10 steps, 110 steps, the decay the last 40: steps 70 … 110
WSD = ["train.lr=1e-3", "train.min_lr=1e-4", "train.warmup_steps=10", "train.max_steps=110", "train.decay=wsd",
       "train.decay_steps=40"]


def schedule(*overrides, total=None):
    return lr_lambda(load_config(DEMO, [*WSD, *overrides]).train, total)


# Hand numbers: f + (1 − f)·g(p), f = 0.1, p = (s − 70)/40. At s = 80, p = ¼: linear g = ¾ → 0.775; cosine
# g = ½(1 + cos 45°) = 0.853553 → 0.868198; 1-sqrt g = 1 − ½ → 0.55. At s = 100, p = ¾: 1-sqrt g = 1 − 0.866025 →
# 0.220577; linear g = ¼ → 0.325; cosine g = ½(1 − 0.707107) = 0.146447 → 0.231802.
@pytest.mark.parametrize("shape, at80, at100", [("linear", 0.775, 0.325), ("cosine", 0.868198, 0.231802),
                                                ("1-sqrt", 0.55, 0.220577)])
def test_wsd_warmup_stable_decay_by_hand(shape, at80, at100):
    f = schedule(f"train.decay_shape={shape}")
    assert [f(s) for s in (0, 5, 10)] == [0.0, 0.5, 1.0]                      # warmup s/10
    assert [f(s) for s in (11, 40, 69, 70)] == [1.0] * 4                      # stable, and the decay's first step
    assert f(80) == pytest.approx(at80, abs=1e-6) and f(100) == pytest.approx(at100, abs=1e-6)
    assert f(90) == pytest.approx(0.55 if shape != "1-sqrt" else 0.1 + 0.9 * (1 - 0.5 ** 0.5))   # halfway
    assert f(110) == pytest.approx(0.1) and f(10_000) == pytest.approx(0.1)  # min_lr at the end and after


def test_wsd_decay_length_from_fraction_and_from_total_steps():
    # decay_fraction 0.5 of 110 steps = 55: the decay starts at 55; linear, at s = 66 (p = 0.2) 0.1 + 0.9 × 0.8
    f = schedule("train.decay_steps=null", "train.decay_fraction=0.5", "train.decay_shape=linear")
    assert f(55) == 1.0 and f(66) == pytest.approx(0.1 + 0.9 * 0.8)
    # the default fraction 0.2 of 110 = 22 steps: 88 … 110
    f = schedule("train.decay_steps=null", "train.decay_shape=linear")
    assert f(87) == 1.0 and f(88) == 1.0 and f(99) == pytest.approx(0.55)
    # a run that max_tokens ends at 60 decays over its last 40 steps: 20 … 60
    f = schedule("train.decay_shape=linear", total=60)
    assert f(19) == 1.0 and f(30) == pytest.approx(0.775) and f(60) == pytest.approx(0.1)
    # a decay longer than the steps after warmup starts where warmup ends
    f = schedule("train.decay_shape=linear", total=30)
    assert f(10) == 1.0 and f(20) == pytest.approx(0.55)


def test_branch_schedule_starts_its_decay_at_k():
    """A branch from step k of a stable parent sets max_steps = k + D: at k, where it resumes, its multiplier is the
    stable phase's 1, as the parent's; from there it decays over D steps."""
    parent, branch = schedule("train.max_steps=1000"), schedule("train.max_steps=70")   # k = 30, D = 40
    assert parent(30) == branch(30) == 1.0 and parent(50) == 1.0
    assert branch(50) == pytest.approx(0.1 + 0.9 * (1 - 0.5 ** 0.5)) and branch(70) == pytest.approx(0.1)


@pytest.mark.parametrize("overrides, message", [
    (["train.decay=cosine"], "train.decay_steps=40 is the decay phase of train.decay='wsd' (it is 'cosine'): set "
                             "train.decay=wsd, or train.decay_steps=null"),
    (["train.decay_steps=101"], "train.decay_steps=101 is out of range; allowed: null or 1 … train.max_steps − "
                                "train.warmup_steps = 100"),
    (["train.decay_shape=exp"], "train.decay_shape='exp' is out of range; allowed: linear, cosine, 1-sqrt"),
    (["train.decay_fraction=0"], "train.decay_fraction=0.0 is out of range; allowed: 0 < fraction ≤ 1"),
    (["train.decay=step"], "train.decay='step' is out of range; allowed: cosine, linear, constant, wsd")])
def test_wsd_config_errors_are_one_line(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(DEMO, [*WSD, *overrides])
    assert str(e.value) == message
