"""Which updates to skip: non-finite losses and gradients, loss spikes, and when to give up.

A skipped step consumes its batches (the data position moves on, as in metaseq and levanter) but changes no
parameter and no optimizer state. Every skip goes through one path, the one a real overflow takes: the step's
gradients are non-finite, and then
    fp16, fp32 ZeRO 1-3, ZeRO-3, bf16 ZeRO-0: DeepSpeed's optimizer finds the gradients or their global norm
                            non-finite, drops the step and counts it in `engine.skipped_steps` (the LR schedule
                            does not advance);
    ZeRO-0 fp32, bf16 ZeRO-1/2 (pretrain/engine.py guards_steps_itself): DeepSpeed has no check (ZeRO-0 fp32) or a
                            costly one that is turned off (bf16), so the trainer hands it `GuardedAdamW`, a fused
                            AdamW whose step does nothing when any rank holds a non-finite gradient (one all-reduce
                            of a flag, never read on the host); it counts in `.skipped`, a tensor on the device (the
                            LR schedule advances: DeepSpeed steps it after the optimizer).
A loss spike is turned into that case on purpose: its loss is multiplied by NaN before backward.

The loss-spike rule (off by default): a step's loss above mean + z·std of the last `window` kept steps' losses is
skipped; it starts once the window is full.
"""
from __future__ import annotations

import math
from collections import deque

import torch
import torch.distributed as dist

from pretrain import distributed


class TrainingStopped(RuntimeError):
    """The run cannot go on (too many skipped steps in a row); the message is one line that says what to do."""


class GuardedAdamW(torch.optim.AdamW):
    """torch's fused AdamW, except that a step with a non-finite gradient on any rank changes nothing (collective).

    One fused norm over all gradients tells whether any is non-finite; the flag is all-reduced (tensor-parallel
    ranks hold different gradients) and handed to the fused kernel as `found_inf`, the way torch.amp.GradScaler
    skips a step: parameters, moments and step counts stay as they were, and the host never waits for the flag.
    `skipped` counts the skipped steps on the device."""

    def __init__(self, params, layout, **adamw):
        super().__init__(params, fused=True, **adamw)
        self.layout = layout
        self.skipped = torch.zeros((), device=layout.device)

    @torch.no_grad()
    def step(self, closure=None):
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads) if grads else self.skipped.new_zeros(())
        bad = distributed.all_reduce((~norm.isfinite()).float().reshape(1), self.layout, op=dist.ReduceOp.MAX)
        self.found_inf = bad[0]        # read by the fused kernel: 1.0 leaves everything unchanged
        self.skipped += bad[0]
        return super().step(closure)


class LossGuard:
    """Counts skipped steps, applies the spike rule and stops after `max_consecutive` skips in a row. Stateful: its
    counts and loss window are part of a checkpoint, so a resumed run decides exactly as an uninterrupted one."""

    def __init__(self, max_consecutive: int, spike_z: float | None, window: int):
        self.max_consecutive, self.spike_z, self.window = max_consecutive, spike_z, window
        self.losses: deque[float] = deque(maxlen=window)   # losses of the last `window` kept steps
        self.total = self.in_a_row = 0
        self.first_bad_step: int | None = None

    def is_spike(self, loss: float) -> bool:
        """loss > mean + z·std of the window (population std); False until the window is full."""
        if self.spike_z is None or len(self.losses) < self.window:
            return False
        mean = sum(self.losses) / len(self.losses)
        std = math.sqrt(sum((x - mean) ** 2 for x in self.losses) / len(self.losses))
        return loss > mean + self.spike_z * std

    def record(self, step: int, loss: float, skipped: bool, why: str = "non-finite loss or gradient") -> str | None:
        """Account for one optimizer step; a line for the log when it was skipped. Raises TrainingStopped after
        `max_consecutive` skips in a row."""
        if not skipped:
            self.in_a_row, self.first_bad_step = 0, None
            if math.isfinite(loss):
                self.losses.append(loss)
            return None
        self.total += 1
        self.in_a_row += 1
        self.first_bad_step = self.first_bad_step or step
        if self.max_consecutive and self.in_a_row >= self.max_consecutive:
            raise TrainingStopped(
                f"{self.in_a_row} optimizer steps in a row were skipped ({why}; steps {self.first_bad_step}-{step}), "
                f"train.max_consecutive_skips={self.max_consecutive}: stopped without saving, so the checkpoints on "
                f"disk hold only good updates; lower train.lr or look at the data of these steps "
                f"(logging.sample_ids=true records it), then relaunch")
        return f"step {step}: update skipped ({why}); {self.in_a_row} in a row, {self.total} in all"

    def state_dict(self) -> dict:
        return {"losses": list(self.losses), "total": self.total, "in_a_row": self.in_a_row,
                "first_bad_step": self.first_bad_step}

    def load_state_dict(self, sd: dict) -> None:
        self.losses = deque(sd["losses"], maxlen=self.window)
        self.total, self.in_a_row, self.first_bad_step = sd["total"], sd["in_a_row"], sd["first_bad_step"]
