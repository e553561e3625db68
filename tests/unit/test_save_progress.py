"""What the hang watchdog reads of a checkpoint save (pretrain/supervision/saves.py): this rank's own files, at most
every 10 s, never a walk of the checkpoint's folder, which holds every rank's files; and the run's count of moving
saves, through which a rank that waits in a barrier of the save for a slower writer sees it move. One rank, in this
process (a gloo group of one), on a clock of its own: the watchdog's minute passes in a moment."""
import os
import threading
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist

from pretrain.checkpoints.checkpointer import Checkpointer
from pretrain.supervision import watchdog
from pretrain.supervision.rank import supervise

OTHERS, SAVE_S = 1000, 60   # the files of other ranks in step_N.partial/; the seconds the save takes, on the clock


class Clock:
    """time for the watchdog: its sleeps move the clock (and yield) while `running` (while this rank's file is
    written); the save waits for it."""

    def __init__(self):
        self.now, self.running = 1000.0, False

    def monotonic(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds if self.running else 0
        time.sleep(0.0005)

    def strftime(self, *args):
        return time.strftime(*args)

    def until(self, t):
        while self.now < t:
            time.sleep(0.0005)


class Engine:
    """DeepSpeed's part of a save as the checkpointer sees it: 1,000 files of the other ranks appear, and this rank
    writes its optimizer state through the checkpoint engine, a piece every 5 s for a minute."""

    def __init__(self, clock):
        self.clock = clock
        self.checkpoint_engine = SimpleNamespace(save=self.write, load=torch.load)   # as DeepSpeed's: both

    def save_checkpoint(self, directory, tag, save_latest):
        folder = os.path.join(directory, tag)
        for k in range(1, OTHERS + 1):
            with open(os.path.join(folder, f"zero_pp_rank_{k}_mp_rank_00_optim_states.pt"), "wb") as f:
                f.write(b"x")
        self.checkpoint_engine.save({"w": torch.ones(4)}, os.path.join(folder, "zero_pp_rank_0_mp_rank_00_optim_"
                                                                               "states.pt"))

    def write(self, state_dict, path):
        start, self.clock.running = self.clock.now, True
        with open(path, "wb") as f:
            for piece in range(SAVE_S // 5):
                f.write(b"y" * 1000)
                f.flush()
                self.clock.until(start + 5 * (piece + 1))
        self.clock.running = False


def test_a_save_s_progress_is_this_rank_s_own_files_read_every_10_s(tmp_path, monkeypatch):
    """A minute-long save, 1,000 files of other ranks beside this rank's: the watchdog reads the save's progress at
    most every 10 s (7 readings), each one stat of this rank's file being written, no folder listed (before: a walk of
    step_N.partial/ every second, 60 walks of 1,001 files); the save is progress (no hang) and completes."""
    clock = Clock()
    monkeypatch.setattr(watchdog, "time", clock)
    seen = {"stat": [], "scandir": 0}
    stat, scandir = os.stat, os.scandir

    def counted_stat(path, *args, **kwargs):
        if threading.current_thread().name == "hang-watchdog":
            seen["stat"].append(clock.now)
        return stat(path, *args, **kwargs)

    def counted_scandir(*args):
        if threading.current_thread().name == "hang-watchdog":
            seen["scandir"] += 1
        return scandir(*args)

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    dog = None
    try:
        run = str(tmp_path)
        saver = Checkpointer(Engine(clock), os.path.join(run, "checkpoints"), 2, {}, {}, "", 0, 1)
        noop = lambda *_: None   # noqa: E731
        trainer = SimpleNamespace(step=6, log=SimpleNamespace(info=noop), checkpointer=saver,
                                  layout=SimpleNamespace(rank=0, collective_timeout_s=1920.0),
                                  cfg=SimpleNamespace(train=SimpleNamespace(hang_timeout=1800.0, run_dir=run,
                                                                            compile=False, collective_timeout=None)),
                                  train_step=noop, validate=noop, log_samples=noop, log_scores=noop, train=noop)
        dog = supervise(trainer)
        monkeypatch.setattr(os, "stat", counted_stat)
        monkeypatch.setattr(os, "scandir", counted_scandir)
        final = trainer.checkpointer.save(7)
        monkeypatch.undo()
    finally:
        if dog is not None:
            dog.stop()
        dist.destroy_process_group()
    readings = sorted(set(seen["stat"]))
    gaps = [b - a for a, b in zip(readings, readings[1:])]
    assert len(seen["stat"]) == len(readings) <= SAVE_S // 10 + 1 and min(gaps) >= 10, \
        (f"{len(seen['stat'])} stats at {len(readings)} readings, {min(gaps):g} s apart at least, "
         f"{seen['scandir']} folders listed")
    assert seen["scandir"] == 0
    assert os.path.exists(os.path.join(final, "zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    assert not (tmp_path / "hang").exists()


def test_a_rank_waiting_for_a_slower_writer_sees_the_run_s_saves_move():
    """Two ranks' readings over one store: rank 1 has written its files and waits; its reading changes while rank 0's
    files grow, and stops changing when they stop (then its watchdog expires, as rank 0's does)."""
    from pretrain.supervision.saves import SaveProgress

    store = dist.HashStore()
    files = {0: [1, 100], 1: [2, 5000]}
    ranks = {r: SaveProgress(SimpleNamespace(own=SimpleNamespace(progress=lambda r=r: tuple(files[r]))),
                             shared=lambda: store) for r in (0, 1)}
    waiting = [ranks[1]()]
    for grown in (200, 300, 300, 300):
        files[0][1] = grown
        ranks[0]()
        waiting.append(ranks[1]())
    moved = [a != b for a, b in zip(waiting, waiting[1:])]
    assert moved == [True, True, False, False], waiting
