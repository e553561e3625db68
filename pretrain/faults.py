"""Fault injection for the fault-tolerance tests: one hook object the trainer and the checkpointer are given, which
does nothing unless the environment variable SYNTHFORMER_FAULTS names faults.

SYNTHFORMER_FAULTS is a comma-separated list of KIND@STEP[@RANK] (RANK defaults to 0):
    kill@7@1              rank 1 kills itself (SIGKILL, as `kill -9`) in step 7, after its forward pass
    nan@7                 the loss of step 7 on that rank is NaN (as an overflow would make it), before backward
    term@20               that rank gets SIGTERM during step 20, from itself (as from a scheduler that preempts the
                          job): every rank stops after that step, with a checkpoint
    kill-save-PHASE@6@1   rank 1 kills itself (SIGKILL, as `kill -9` or the OOM killer) while saving step 6, at PHASE:
                          begin    (the temporary directory exists, nothing written yet)
                          engine   (DeepSpeed's files written, the trainer's not yet; async: copied to host)
                          writing  (checkpoint.async_save: the writer thread has written the first file, not the
                                   rest; training goes on meanwhile)
                          written  (every rank's files written, not yet committed; async: at the step that
                                   commits)
                          uploaded (checkpoint.dir in a bucket: this rank's files uploaded, not yet committed; async:
                                   by its writer thread, training going on)
                          renamed  (the directory has its final name, or complete.json is in the bucket; `latest`
                                   still names the previous one)
    upload-fail@6@1       rank 1's upload of the checkpoint of step 6 to a bucket fails after its first file, as a
                          denied or cut-off upload would (pretrain/checkpoints/bucket.py)
    hang@5@1              rank 1 stops in step 5 (after its forward) and never goes on, as a rank stuck in a
                          collective or on storage would: the other ranks wait for it in the next collective
                          (train.hang_timeout finds them all, pretrain/supervision/watchdog.py)
    stall@5@1             rank 1 stops before step 5, before any forward: a hang in any layout (a pipeline stage's
                          forward is DeepSpeed's, so `hang` does not reach it)
    slow@5@2              from step 5 on, rank 2's every forward pass runs SLOW_FACTOR (3) times (the extra runs
                          without gradients, dropped), and so does its GEMM in the check before launch (pretrain/fleet):
                          a GPU computing at a third of its peers' rate. No marker: a slow device stays slow across
                          relaunches
    raise@5@3             rank 3 raises an error that is no data's nor config's (RuntimeError, class unknown) before
                          step 5, before any forward: the other ranks wait for it in the step's first collective

Each fault fires once per run: before it fires it leaves a marker, <run_dir>/faults/KIND@STEP@RANK, and a relaunch of
the run (by hand, or launch/pretrain.sh --max-restarts) with the same SYNTHFORMER_FAULTS does not fire it again.
"""
from __future__ import annotations

import os
import signal
import time

import torch

SAVE_PHASES = ("begin", "engine", "writing", "written", "renamed")
BUCKET_PHASES = ("uploaded",)   # only where checkpoint.dir is a bucket
SLOW_FACTOR = 3   # a `slow` rank's forward passes take this many times as long


class Faults:
    """The faults armed for this rank, as {(kind, step)}; empty (the default) means every hook returns at once.
    `run_dir`: where the markers of fired faults go (None: no markers, each fires whenever its step comes)."""

    def __init__(self, spec: str = "", rank: int = 0, run_dir: str | None = None):
        self.armed, self.rank, self.run_dir = set(), rank, run_dir
        self.firing: set[tuple[str, int]] = set()   # fired in this process: a step's every micro-batch alike
        for item in filter(None, spec.split(",")):
            kind, step, *who = item.strip().split("@")
            if int(who[0] if who else 0) == rank:
                self.armed.add((kind, int(step)))

    @classmethod
    def from_environment(cls, rank: int, run_dir: str | None = None) -> "Faults":
        return cls(os.environ.get("SYNTHFORMER_FAULTS", ""), rank, run_dir)

    def fires(self, kind: str, step: int) -> bool:
        """Whether the fault (kind, step) is armed here and has not fired in an earlier launch of the run; the first
        time it fires, its marker is written (before the fault happens: a killed rank leaves it too)."""
        if (kind, step) not in self.armed:
            return False
        if (kind, step) in self.firing:
            return True
        if self.run_dir is not None:
            marker = os.path.join(self.run_dir, "faults", f"{kind}@{step}@{self.rank}")
            if os.path.exists(marker):
                self.armed.discard((kind, step))
                return False
            os.makedirs(os.path.dirname(marker), exist_ok=True)
            with open(marker, "w") as f:
                f.write(f"fired at {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        self.firing.add((kind, step))
        return True

    def loss(self, loss, step: int):
        """The loss of `step`, or NaN times it where a `nan` fault is armed; SIGTERM where a `term` fault is; never
        returns where a `hang` is; dies as kill -9 would where a `kill` is."""
        if self.fires("kill", step):
            os.kill(os.getpid(), signal.SIGKILL)
        if self.fires("term", step):
            os.kill(os.getpid(), signal.SIGTERM)
        if self.fires("hang", step):
            hang()
        return loss * float("nan") if self.fires("nan", step) else loss

    def before_step(self, step: int) -> None:
        """Never returns where a `stall` fault is armed for this step; raises RuntimeError where a `raise` is."""
        if self.fires("raise", step):
            raise RuntimeError(f"injected fault raise@{step}@{self.rank} (SYNTHFORMER_FAULTS): an error of no data "
                               f"and no config")
        if self.fires("stall", step):
            hang()

    def slow(self, work, step: int) -> None:
        """Where `slow@S` is armed with S ≤ step: `work()` (a forward pass, a GEMM) again SLOW_FACTOR − 1 times,
        without gradients."""
        if any(kind == "slow" and at <= step for kind, at in self.armed):
            with torch.no_grad():
                for _ in range(SLOW_FACTOR - 1):
                    work()

    def saving(self, phase: str, step: int) -> None:
        """Dies here, as kill -9 would, where a `kill-save-<phase>` fault is armed for this step."""
        if self.fires(f"kill-save-{phase}", step):
            os.kill(os.getpid(), signal.SIGKILL)

    def uploading(self, step: int) -> None:
        """Raises PermissionError (a denied upload: not retried) where an `upload-fail` fault is armed for this step."""
        if self.fires("upload-fail", step):
            raise PermissionError(f"injected fault upload-fail@{step}@{self.rank} (SYNTHFORMER_FAULTS): upload denied")


def hang() -> None:
    """Never return (the frame a hung rank's stack dump shows)."""
    while True:
        time.sleep(60)


NO_FAULTS = Faults()
