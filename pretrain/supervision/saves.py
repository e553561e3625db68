"""A checkpoint save as the hang watchdog sees it (wired by supervision/rank.py `supervise`): progress while the
save's files grow, read without walking the checkpoint, and collectives that wait for a slow save.

    SaveProgress(checkpointer)   what the watchdog reads of a save under way, every watchdog.POLL_S (10 s; a quarter
                                 of train.hang_timeout where that is shorter): this rank's own files (the checkpointer's
                                 OwnFiles: the ones it has written and a stat of the one it writes, never a walk of
                                 step_N.partial/, which holds every rank's files: at 1,024 ranks a walk a second by each
                                 was ~10⁶ stats a second on Lustre or GPFS); where they grew, it adds one to the run's
                                 count of moving saves in torch.distributed's store, then reads that count. A rank that
                                 waits in a barrier of the save (the checkpointer's, DeepSpeed's) for a slower writer
                                 sees the count move and is not a hang; once no rank's files grow for hang_timeout,
                                 every rank's watchdog expires, the stalled writer's naming its save.
    waiting(save, after)         the save with every process group waiting timeouts.SAVE_S in a collective, and the
                                 collective timeout C (`after`) again once it returns: a save that moves may outlast
                                 C; the watchdogs, not a collective's timeout, end one that stops.

Each poll costs a rank a stat and two requests to the store (one where its files did not grow): at 1,024 ranks and
10 s, about 200 small requests a second to the store's server, a thread of rank 0.
"""
from __future__ import annotations

import functools

from pretrain import timeouts

MOVES = "synthformer/save-moves"   # the store's key: how many times a rank saw its own files of a save grow


def store():
    """torch.distributed's store of this run (the TCPStore every rank reached at start), or None without one."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    return c10d._get_default_store() if dist.is_initialized() else None


class SaveProgress:
    """progress(*the save's arguments) for Watchdog.during: (this rank's files, the run's count of moves)."""

    def __init__(self, checkpointer, shared=store):
        self.checkpointer, self.shared, self.mine = checkpointer, shared, None

    def __call__(self, *_) -> tuple:
        mine = self.checkpointer.own.progress()
        kv = self.shared()
        if kv is None:
            return mine, 0
        moves = kv.add(MOVES, 1 if mine != self.mine else 0)   # the TCPStore's client is thread-safe
        self.mine = mine
        return mine, moves


def waiting(save, after: float):
    """`save` with every process group of this rank on timeouts.SAVE_S while it runs, on `after` again after."""
    @functools.wraps(save)
    def waited(*args, **kwargs):
        with timeouts.raised(timeouts.SAVE_S, after):
            return save(*args, **kwargs)
    return waited
