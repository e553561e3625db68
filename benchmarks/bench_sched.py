"""Timing on a shared machine: how long this process waited for a CPU while it could run (taken out of a timed
step), and the real-time class for a timed repetition (the machine's other processes wait instead of it)."""
from __future__ import annotations

import os


def runqueue_s() -> float:
    """Seconds this process's main thread has waited for a CPU while runnable (Linux's /proc/self/schedstat; 0 where
    there is none): what other processes of a shared machine took from a timed step."""
    try:
        with open("/proc/self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


class Foreground:
    """`with Foreground(on):` this process's threads in the real-time class (SCHED_FIFO, priority 1) for the block,
    back to the normal class after it: a shared machine's other processes then wait, not the timed repetition. Each
    block is one repetition (seconds), and the caller pauses after it so that the others catch up. Without the right
    to (not root) or `on` False: nothing, and `.held` stays False."""

    def __init__(self, on: bool):
        self.on, self.held = on, False

    def _set(self, policy: int, priority: int) -> bool:
        try:
            for tid in os.listdir("/proc/self/task"):
                os.sched_setscheduler(int(tid), policy, os.sched_param(priority))
            return True
        except (OSError, AttributeError):
            return False

    def __enter__(self):
        self.held = self.on and self._set(os.SCHED_FIFO, 1)
        return self

    def __exit__(self, *exc):
        if self.held:
            self._set(os.SCHED_OTHER, 0)
