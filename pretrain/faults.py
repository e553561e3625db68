"""Fault injection for the fault-tolerance tests; inert unless the environment variable SYNTHFORMER_FAULTS is set.

SYNTHFORMER_FAULTS is a comma-separated list of KIND@STEP[@RANK] (RANK defaults to 0):
    nan@7                 the loss of step 7 on that rank is NaN (as an overflow would make it), before backward
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


def _armed(kind: str, step: int, rank: int) -> bool:
    for item in filter(None, os.environ.get("SYNTHFORMER_FAULTS", "").split(",")):
        name, at, *who = item.strip().split("@")
        if name == kind and int(at) == step and int(who[0] if who else 0) == rank:
            return True
    return False


def poison_loss(loss, step: int, rank: int):
    return loss * float("nan") if _armed("nan", step, rank) else loss


def maybe_kill_in_save(phase: str, step: int, rank: int) -> None:
    if _armed(f"kill-save-{phase}", step, rank):
        os.kill(os.getpid(), signal.SIGKILL)
