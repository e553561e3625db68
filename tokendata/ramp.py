"""The global batch of each optimizer step (train.batch_ramp): a batch-size ramp in the manner of Megatron-LM's
`--rampup-batch-size start increment samples` (megatron/core/num_microbatches_calculator.py), in integers.

With start b₀, increment δ, the full batch G and a ramp of R samples, k = (G − b₀)/δ increments, the global batch
that begins after P samples of the run is

    G(P) = b₀ + δ·⌊P·k / R⌋   while P < R,        G(P) = G   from P ≥ R on

(Megatron: b₀ + δ·int(P / (R/k)), in floats). Step s consumes the picks P_s … P_s + G(P_s) − 1 of the canonical
order (tokendata/order.py), P_{s+1} = P_s + G(P_s): the batches of a ramped run, laid end to end, are the same
sequence of picks as an unramped run's, and each batch lays its picks out stream by stream as any global batch does.
Everything here is a function of (b₀, δ, R, G) alone; a run without a ramp is `BatchRamp.constant(G)`, whose step s
begins at s·G.
"""
from __future__ import annotations

import bisect


class BatchRamp:
    """The global batch of every step. `start`, `increment`: b₀, δ; `samples`: R; `full`: G. G − b₀ must be a
    multiple of δ (checked by the config: train.batch_ramp)."""

    def __init__(self, start: int, increment: int, samples: int, full: int):
        self.start, self.increment, self.samples, self.full = start, increment, samples, full
        self.increments = (full - start) // increment if increment else 0
        self.firsts = [0]   # P_s of each step s of the ramp, and the first sample at the full batch after them
        while self.firsts[-1] < samples and self.increments:
            self.firsts.append(self.firsts[-1] + self.size_at(self.firsts[-1]))
        self.ramp_steps = len(self.firsts) - 1

    @classmethod
    def constant(cls, full: int) -> "BatchRamp":
        """No ramp: every step's global batch is G."""
        return cls(full, 0, 0, full)

    @property
    def ramped(self) -> bool:
        return self.ramp_steps > 0

    def key(self) -> dict | None:
        """What a data state records of the ramp (None without one): resuming needs the same."""
        return {"start": self.start, "increment": self.increment, "samples": self.samples} if self.ramped else None

    def size_at(self, samples: int) -> int:
        """G(P): the global batch that begins after `samples` picks of the run."""
        if samples >= self.samples or not self.increments:
            return self.full
        return self.start + self.increment * (samples * self.increments // self.samples)

    def samples_before(self, step: int) -> int:
        """P_s: the picks of steps 0 … s − 1."""
        if step <= self.ramp_steps:
            return self.firsts[step]
        return self.firsts[-1] + (step - self.ramp_steps) * self.full

    def size(self, step: int) -> int:
        """The global batch of step s (from 0; the trainer's step s + 1)."""
        return self.size_at(self.samples_before(step))

    def steps_for(self, samples: int) -> int:
        """The fewest steps whose batches hold at least `samples` picks."""
        if samples <= self.firsts[-1]:
            return bisect.bisect_left(self.firsts, samples)
        return self.ramp_steps + -(-(samples - self.firsts[-1]) // self.full)

    def full_batches(self, step: int) -> float:
        """P_s / G: the run's progress in steps of the full batch (s itself without a ramp)."""
        return self.samples_before(step) / self.full

    def phases(self) -> list[tuple[int, int, int]]:
        """[(first step, global batch, steps)] of the ramp, one row per size; then the full batch from the next step."""
        rows = []
        for s in range(self.ramp_steps):
            size = self.size(s)
            if rows and rows[-1][1] == size:
                rows[-1] = (rows[-1][0], size, rows[-1][2] + 1)
            else:
                rows.append((s, size, 1))
        return rows
