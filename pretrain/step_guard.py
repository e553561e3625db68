"""Which updates to skip: non-finite losses and gradients, loss spikes, and when to give up.

A skipped step consumes its batches (the data position moves on, as in metaseq and levanter) but changes no
parameter and no optimizer state. Every skip goes through one path, the one a real overflow takes: the step's
gradients are non-finite, and then
    fp16, fp32 ZeRO 1-3, ZeRO-3, bf16 ZeRO-0: DeepSpeed's optimizer finds the gradients or their global norm
                            non-finite, drops the step and counts it in `engine.skipped_steps` (the LR schedule
                            does not advance);
    ZeRO-0 fp32, bf16 ZeRO-1/2 (pretrain/config/deepspeed_dict.py guards_steps_itself): DeepSpeed has no check (ZeRO-0 fp32) or a
                            costly one that is turned off (bf16), so the trainer hands it `GuardedAdamW`, a fused
                            AdamW that also clips the gradients and whose step does nothing when any rank holds a
                            non-finite gradient (one all-reduce of the squared norm, never read on the host); it
                            counts in `.skipped`, a tensor on the device (the LR schedule advances: DeepSpeed steps
                            it after the optimizer).
A loss spike is turned into that case on purpose: its loss is multiplied by NaN before backward.

The loss-spike rule (off by default): a step's loss above mean + z·std of the last `window` kept steps' losses is
skipped; it starts once the window is full.
"""
from __future__ import annotations

import math
from collections import deque
from typing import Callable

import torch

from pretrain import distributed


class TrainingStopped(RuntimeError):
    """The run cannot go on (too many skipped steps in a row); the message is one line that says what to do."""


class GuardedAdamW(torch.optim.AdamW):
    """torch's fused AdamW that clips the gradients to a global norm and drops a step with a non-finite gradient on
    any rank, all on the device: the host never waits for it.

    The global norm of a step (`grad_norm`, a device tensor the trainer reads on its logging steps):
      - without ZeRO, this optimizer sees every gradient: the squared norm of what this rank holds, each element
        that other ranks hold too counted on one rank only (`count_once`), summed over all ranks in one all-reduce;
      - under ZeRO-1/2, DeepSpeed steps it once per parameter group, each call seeing only that group's flat
        partition, so no call sees every gradient: the norm is DeepSpeed's (`take_norm_from`), computed over all
        groups before the first call, replicas counted once, all-reduced, and not read on the host in bf16.
    A non-finite norm becomes `found_inf` for the fused kernel, which then leaves parameters, moments and step
    counts as they were (torch.amp.GradScaler's way of skipping), in every group alike, and `skipped` counts the
    step. Otherwise, with `clip` > 0, the gradients are scaled by min(1, clip / (norm + 1e-6)), DeepSpeed's and
    torch's rule (torch.nn.utils.clip_grads_with_norm_), inside the fused kernel: it divides each gradient by
    `grad_scale` = max(1, (norm + 1e-6) / clip) as it reads it (GradScaler's unscaling), so clipping costs no pass
    of its own over the gradients (a foreach multiply reads and writes every gradient once more)."""

    def __init__(self, params, layout, clip: float = 0.0, **adamw):
        super().__init__(params, fused=True, **adamw)
        self.layout, self.clip = layout, clip
        self.skipped = torch.zeros((), device=layout.device)
        self.grad_norm = torch.zeros((), device=layout.device)
        self.grad_scale: torch.Tensor | None = None   # what the fused kernel divides the gradients by (clipping)
        self.elsewhere: dict[int, torch.Tensor | None] = {}
        self.norm_of_step: Callable[[], torch.Tensor] | None = None

    def count_once(self, elsewhere: dict) -> None:
        """{parameter of this optimizer: None (all of it) or flat indices of its elements} whose gradients another
        rank holds as well and counts in the norm (pretrain/engine.py counted_elsewhere)."""
        self.elsewhere = {id(p): idx for p, idx in elsewhere.items()}

    def take_norm_from(self, norm_of_step: Callable[[], torch.Tensor]) -> None:
        """Use `norm_of_step()`, the global norm of the current step's gradients, instead of computing it."""
        self.norm_of_step = norm_of_step

    def squared_norm(self, p: torch.Tensor) -> torch.Tensor:
        """This rank's share of the squared global norm from p's gradient, in fp32."""
        square = torch.linalg.vector_norm(p.grad, dtype=torch.float32).square()
        if id(p) not in self.elsewhere:
            return square
        idx = self.elsewhere[id(p)]
        if idx is None:
            return square * 0.0   # still NaN where the gradient is not finite
        return square - torch.linalg.vector_norm(p.grad.view(-1)[idx], dtype=torch.float32).square()

    def global_norm(self, params: list[torch.Tensor]) -> torch.Tensor:
        """Whole gradients in multi-tensor norms (torch's foreach kernels: a few launches for all of them, not two
        a tensor): those this rank counts, and those another rank counts (× 0, which keeps a NaN); gradients counted
        in part (`count_once` with indices) one by one."""
        mine = [p.grad.float() for p in params if id(p) not in self.elsewhere]
        theirs = [p.grad.float() for p in params if id(p) in self.elsewhere and self.elsewhere[id(p)] is None]
        parts = [self.squared_norm(p) for p in params if self.elsewhere.get(id(p)) is not None]
        parts += [torch.nn.utils.get_total_norm(mine).square()] if mine else []
        parts += [torch.nn.utils.get_total_norm(theirs).square() * 0.0] if theirs else []
        square = torch.stack(parts).sum() if parts else self.grad_norm.new_zeros(())
        return distributed.all_reduce(square.reshape(1), self.layout)[0].clamp(min=0.0).sqrt()

    @torch.no_grad()
    def step(self, closure=None):
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        norm = self.global_norm(params) if self.norm_of_step is None else self.norm_of_step()
        if norm is not self.grad_norm:   # the step's first call (under ZeRO-1/2 one call per parameter group)
            self.grad_norm = norm
            self.found_inf = (~norm.isfinite()).float()   # read by the fused kernel: 1.0 changes nothing
            self.skipped += self.found_inf
            # read by the fused kernel too: g / grad_scale = g · min(1, clip / (norm + 1e-6))
            self.grad_scale = ((norm + 1e-6) / self.clip).clamp(min=1.0) if self.clip > 0 else None
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
