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
    multiple of δ (checked by the config: train.batch_ramp). Kept as the ramp's phases, one per size: size b holds
    while ⌊P·k/R⌋ stays, up to the first P with ⌊P·k/R⌋ one more, E = ⌈R(j + 1)/k⌉, so its steps are ⌈(E − P)/b⌉
    (at most k phases, however many steps)."""

    def __init__(self, start: int, increment: int, samples: int, full: int):
        self.start, self.increment, self.samples, self.full = start, increment, samples, full
        self.increments = k = (full - start) // increment if increment else 0
        self.firsts, self.befores, self.sizes = [0], [0], []   # each phase's first step, its P there, its size
        while self.befores[-1] < samples and k:
            P = self.befores[-1]
            size, E = self.size_at(P), -(-samples * (P * k // samples + 1) // k)
            steps = -(-(min(E, samples) - P) // size)
            self.sizes.append(size)
            self.firsts.append(self.firsts[-1] + steps)
            self.befores.append(P + steps * size)
        self.sizes.append(full)   # the last phase, from the ramp's end on
        self.ramp_steps = self.firsts[-1]

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
        i = bisect.bisect_right(self.firsts, step) - 1
        return self.befores[i] + (step - self.firsts[i]) * self.sizes[i]

    def size(self, step: int) -> int:
        """The global batch of step s (from 0; the trainer's step s + 1)."""
        return self.sizes[bisect.bisect_right(self.firsts, step) - 1]

    def steps_for(self, samples: int) -> int:
        """The fewest steps whose batches hold at least `samples` picks."""
        i = max(0, bisect.bisect_left(self.befores, samples) - 1)
        return self.firsts[i] + -(-(samples - self.befores[i]) // self.sizes[i]) if samples > 0 else 0

    def full_batches(self, step: int) -> float:
        """P_s / G: the run's progress in steps of the full batch (s itself without a ramp)."""
        return self.samples_before(step) / self.full

    def phases(self) -> list[tuple[int, int, int]]:
        """[(first step, global batch, steps)] of the ramp, one row per size; then the full batch from the next step."""
        return [(first, size, after - first) for first, after, size in zip(self.firsts, self.firsts[1:], self.sizes)]
