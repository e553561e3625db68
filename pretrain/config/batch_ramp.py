"""train.batch_ramp beside TrainSection: its checks, the ramp of a config (tokendata/ramp.py `BatchRamp`, which also
says how the global batch of each step follows from it) and the lines `python -m pretrain.config` prints of it.

    train.batch_ramp: {start: 32, increment: 32, tokens: 4.0e+9}

starts at 32 sequences a step and grows by 32 in equal parts of the first 4e9 tokens to train.global_batch_size
(Megatron-LM's --rampup-batch-size 32 32 SAMPLES, with SAMPLES = tokens / model.max_seq_len). The LR schedule follows
tokens along it (pretrain/engine.py `lr_lambda`; docs/DESIGN.md)."""
from __future__ import annotations

import math

from model.config import ConfigError
from tokendata.ramp import BatchRamp

KEYS = ("start", "increment", "tokens")
KEY = "train.batch_ramp"


def tokens_of(value) -> float | None:
    """The ramp's tokens as a number: YAML reads 2e6 (without a dot) as a string."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def check_ramp(train) -> None:
    """One-line errors for train.batch_ramp (a TrainSection): null, or {start, increment, tokens} with
    1 ≤ start ≤ global_batch_size and increment dividing global_batch_size − start."""
    ramp = train.batch_ramp
    if ramp is None:
        return
    if not isinstance(ramp, dict) or sorted(ramp) != sorted(KEYS):
        raise ConfigError(f"{KEY}={ramp!r} must be null or {{start, increment, tokens}}, e.g. {{start: 32, increment: "
                          f"32, tokens: 4.0e+9}}")
    start, inc, tokens = ramp["start"], ramp["increment"], tokens_of(ramp["tokens"])
    G = train.global_batch_size
    if not (isinstance(start, int) and isinstance(inc, int) and 1 <= start <= G and inc >= 1):
        raise ConfigError(f"{KEY}: start={start!r} and increment={inc!r} must be integers with 1 ≤ start ≤ "
                          f"train.global_batch_size={G} and increment ≥ 1")
    if (G - start) % inc:
        raise ConfigError(f"{KEY}: train.global_batch_size − start = {G} − {start} = {G - start} is not a multiple of "
                          f"increment={inc}: the ramp must reach the global batch; choose an increment that divides it")
    if tokens is None or not math.isfinite(tokens) or tokens <= 0:
        raise ConfigError(f"{KEY}: tokens={ramp['tokens']!r} must be a number > 0 (the tokens over which the batch "
                          f"grows)")


def ramp_of(train, seq_len: int) -> BatchRamp:
    """The run's ramp: its tokens in samples of seq_len tokens, rounded up (BatchRamp.constant without one)."""
    r = train.batch_ramp
    if r is None:
        return BatchRamp.constant(train.global_batch_size)
    return BatchRamp(r["start"], r["increment"], math.ceil(tokens_of(r["tokens"]) / seq_len), train.global_batch_size)


def sizes(ramp: BatchRamp) -> list[int]:
    """The global batches of the ramp's steps, smallest first (none without a ramp)."""
    return sorted({size for _, size, _ in ramp.phases()})


def splits(ramp: BatchRamp, per_step: int) -> bool:
    """Whether every global batch along the ramp is a multiple of micro-batch × dp = `per_step`."""
    return all(size % per_step == 0 for size in sizes(ramp))


def check_layout(ramp: BatchRamp, micro: int, dp: int) -> None:
    """Every global batch along the ramp must split into micro-batches over the data-parallel ranks."""
    per_step = micro * dp
    bad = [size for size in sizes(ramp) if size % per_step]
    if bad:
        raise ConfigError(f"{KEY}: its global batch {bad[0]} (of {', '.join(map(str, sizes(ramp)))}) is not divisible by "
                          f"train.micro_batch_size × data-parallel size = {micro} × {dp} = {per_step}; choose start "
                          f"and increment as multiples of {per_step}")


def ramp_lines(ramp: BatchRamp, seq_len: int) -> list[str]:
    """What `python -m pretrain.config` prints of a ramp: each size's steps and tokens, then the full batch."""
    if not ramp.ramped:
        return []
    lines = []
    for first, size, steps in ramp.phases():
        tokens = (ramp.samples_before(first + steps) - ramp.samples_before(first)) * seq_len
        lines.append(f"batch ramp: steps {first}–{first + steps}: global batch {size} ({steps} steps, {tokens:,} "
                     f"tokens)")
    done = ramp.samples_before(ramp.ramp_steps) * seq_len
    return lines + [f"batch ramp: from step {ramp.ramp_steps} ({done:,} tokens in): global batch {ramp.full}"]
