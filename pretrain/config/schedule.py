"""The LR schedule's settings beside TrainSection: train.decay's names, the shapes of a 'wsd' decay, their checks and
the decay's length (also where a data stage starts it). The schedule itself is pretrain/engine.py `lr_lambda`."""
from __future__ import annotations

import math

from model.config import ConfigError
from model.fields import need

DECAYS = ("cosine", "linear", "constant", "wsd")          # train.decay
DECAY_SHAPES = {   # train.decay_shape of a 'wsd' decay, g(p): the part of (lr − min_lr) left at progress p ∈ [0, 1]
    "linear": lambda p: 1.0 - p,
    "cosine": lambda p: 0.5 * (1.0 + math.cos(math.pi * p)),
    "1-sqrt": lambda p: 1.0 - math.sqrt(p),
}


def check_decay(train) -> None:
    """One-line errors for train.decay, decay_steps, decay_fraction and decay_shape (a TrainSection)."""
    need(train.decay in DECAYS, "train.decay", train.decay, ", ".join(DECAYS))
    need(train.decay_steps is None or 1 <= train.decay_steps <= train.max_steps - train.warmup_steps,
         "train.decay_steps", train.decay_steps, f"null or 1 … train.max_steps − train.warmup_steps = "
                                                 f"{train.max_steps - train.warmup_steps}")
    if train.decay_steps is not None and train.decay != "wsd":
        raise ConfigError(f"train.decay_steps={train.decay_steps} is the decay phase of train.decay='wsd' (it is "
                          f"{train.decay!r}): set train.decay=wsd, or train.decay_steps=null")
    need(0 < train.decay_fraction <= 1, "train.decay_fraction", train.decay_fraction, "0 < fraction ≤ 1")
    need(train.decay_shape in DECAY_SHAPES, "train.decay_shape", train.decay_shape, ", ".join(DECAY_SHAPES))


def decay_length(train, total_steps: int) -> int:
    """D, the steps of a 'wsd' decay phase in a run of `total_steps` (TrainConfig.total_steps): train.decay_steps, or
    train.decay_fraction of them rounded; never into the warmup (at most total − warmup_steps)."""
    D = train.decay_steps if train.decay_steps is not None else round(train.decay_fraction * total_steps)
    return max(0, min(D, total_steps - min(train.warmup_steps, total_steps)))


def stage_decay(train, step: int, total_steps: int) -> int:
    """D where the data stage of `step` has decay: true (data.stages): the 'wsd' decay runs from that stage's first
    step to the run's end, D = total_steps − step. One-line errors where train.decay is not 'wsd', the stage is not
    within the run after the warmup, or train.decay_steps gives another length."""
    where = f"data.stages: the stage of step {step} has decay: true"
    if train.decay != "wsd":
        raise ConfigError(f"{where} (train.decay=wsd's decay starts there), but train.decay={train.decay!r}: set "
                          f"train.decay=wsd, or remove the stage's decay")
    if not train.warmup_steps <= step < total_steps:
        raise ConfigError(f"{where}, but the decay must start after the warmup and before the run ends: give it a "
                          f"step in {train.warmup_steps} … {total_steps - 1}")
    if train.decay_steps not in (None, total_steps - step):
        raise ConfigError(f"{where} (a decay of {total_steps - step} steps, to the run's end), but train.decay_steps="
                          f"{train.decay_steps}: set train.decay_steps=null")
    return total_steps - step
