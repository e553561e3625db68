"""Fault injection for the fault-tolerance tests: one hook object the trainer and the checkpointer are given, which
does nothing unless the environment variable SYNTHFORMER_FAULTS names faults.

SYNTHFORMER_FAULTS is a comma-separated list of KIND@STEP[@RANK] (RANK defaults to 0):
    nan@7                 the loss of step 7 on that rank is NaN (as an overflow would make it), before backward
    term@20               that rank gets SIGTERM during step 20, from itself (as from a scheduler that preempts the
                          job): every rank stops after that step, with a checkpoint
    kill-save-PHASE@6@1   rank 1 kills itself (SIGKILL, as `kill -9` or the OOM killer) while saving step 6, at PHASE:
                          begin    (the temporary directory exists, nothing written yet)
                          engine   (DeepSpeed's files written, the trainer's not yet)
                          written  (every rank's files written, not yet committed)
                          renamed  (the directory has its final name, `latest` still names the previous one)
"""
from __future__ import annotations

import os
import signal

SAVE_PHASES = ("begin", "engine", "written", "renamed")


class Faults:
    """The faults armed for this rank, as {(kind, step)}; empty (the default) means every hook returns at once."""

    def __init__(self, spec: str = "", rank: int = 0):
        self.armed = set()
        for item in filter(None, spec.split(",")):
            kind, step, *who = item.strip().split("@")
            if int(who[0] if who else 0) == rank:
                self.armed.add((kind, int(step)))

    @classmethod
    def from_environment(cls, rank: int) -> "Faults":
        return cls(os.environ.get("SYNTHFORMER_FAULTS", ""), rank)

    def loss(self, loss, step: int):
        """The loss of `step`, or NaN times it where a `nan` fault is armed; SIGTERM where a `term` fault is."""
        if ("term", step) in self.armed:
            os.kill(os.getpid(), signal.SIGTERM)
        return loss * float("nan") if ("nan", step) in self.armed else loss

    def saving(self, phase: str, step: int) -> None:
        """Dies here, as kill -9 would, where a `kill-save-<phase>` fault is armed for this step."""
        if (f"kill-save-{phase}", step) in self.armed:
            os.kill(os.getpid(), signal.SIGKILL)


NO_FAULTS = Faults()
