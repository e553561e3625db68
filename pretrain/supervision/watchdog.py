"""Each rank's hang watchdog (train.hang_timeout): progress is a heartbeat, and a rank without one for hang_timeout
seconds writes what it was doing and exits, so that a hang becomes an ordinary failure that a relaunch fixes.

Progress, defined. A heartbeat is a finished training step, validation, checkpoint save, attention images and text
sample, or downstream scores (`after`: when the call returns). Two kinds of work are progress while they run
(`during`): a checkpoint save while its bytes grow (read every POLL_S at most: saves.py reads this rank's own files and
the run's count of moving saves, never a walk of the checkpoint), so that a slow but moving save on a busy filesystem
is not a hang and a save that writes nothing for hang_timeout is; and a torch.compile compilation, from its start to
its end (the first may take minutes).

When it expires, the rank, in this order: writes the stack of every thread to <run_dir>/hang/rank<k>.txt
(faulthandler); asks PyTorch's flight recorder for its dump, beside it (flight_recorder.py); writes its failure record
(classes.py: class `hang`, the last step it finished, and per process group how many collectives it entered, from which
the supervisor names the rank the others wait for); prints one line (`error: rank k made no progress …`); hands its
log on (ranklog.py) and exits with HANG_EXIT. A rank stuck in a collective or on storage keeps the others waiting in
their next collective, so every rank's watchdog expires and writes its files. The watchdog is a Python thread (it needs
the interpreter: a hung collective or read releases it); should a C call hold the interpreter, faulthandler's own C
thread dumps the stacks into the rank's log and ends the rank BACKSTOP_S later.
"""
from __future__ import annotations

import faulthandler
import functools
import os
import sys
import threading
import time

from pretrain import timeouts
from pretrain.supervision import classes, flight_recorder

HANG_EXIT = classes.HANG.exit
BACKSTOP_S = timeouts.MIN_MARGIN_S   # faulthandler's dump and exit, after hang_timeout, where the watchdog cannot run
POLL_S = 10   # the longest wait between two readings of a work's progress (`during`: a save's on a shared filesystem)


class Watchdog:
    """beat() on progress; after `timeout` seconds without one, `expire()` (from its own thread)."""

    def __init__(self, timeout: float, run_dir: str, rank: int, finished_step, restart: int = 0, log=None):
        self.timeout, self.run_dir, self.rank, self.finished_step = timeout, run_dir, rank, finished_step
        self.restart, self.log = restart, log   # log: the rank's RankLog, drained before the exit
        self.path = os.path.join(run_dir, "hang", f"rank{rank}.txt")
        self.last, self.stopped, self.undo = time.monotonic(), False, []
        self.deciding = threading.Lock()   # held from an expiry's decision to its exit: stop() waits for one
        self.active: dict[str, list] = {}   # work in progress: {what: [progress(), its last value, next reading]}
        self.thread = threading.Thread(target=self.run, name="hang-watchdog", daemon=True)

    def beat(self, *_) -> None:
        if not self.stopped:
            self.last = time.monotonic()
            backstop = self.log.fileno if self.log else sys.stderr   # re-armed: the backstop
            faulthandler.dump_traceback_later(self.timeout + BACKSTOP_S, exit=True, file=backstop)

    def after(self, method):
        """`method`, followed by a heartbeat when it returns."""
        @functools.wraps(method)
        def beating(*args, **kwargs):
            result = method(*args, **kwargs)
            self.beat()
            return result
        return beating

    def during(self, what: str, method, progress):
        """`method`, which is progress while `progress(*its arguments)` changes, and a heartbeat when it starts and
        when it returns. The watchdog reads the progress every `poll_s()` (POLL_S, or a quarter of the timeout where
        that is shorter)."""
        @functools.wraps(method)
        def watched(*args, **kwargs):
            name = what.format(*args)
            self.beat()
            self.active[name] = [functools.partial(progress, *args), None, time.monotonic()]
            try:
                return method(*args, **kwargs)
            finally:
                self.active.pop(name, None)
                self.beat()
        return watched

    def on_compilation(self) -> None:
        """A torch.compile compilation is progress from its start to its end."""
        from torch._dynamo import callback

        def started(*_):
            self.beat()
            self.active["a torch.compile compilation"] = [time.monotonic, None, 0.0]   # always moving

        def ended(*_):
            self.active.pop("a torch.compile compilation", None)
            self.beat()

        callback.on_compile_start(started)
        callback.on_compile_end(ended)
        self.undo += [lambda: callback.callback_handler.remove_start_callback(started),
                      lambda: callback.callback_handler.remove_end_callback(ended)]

    def start(self) -> None:
        self.beat()
        self.thread.start()

    def stop(self, teardown: bool = False) -> None:
        """No more watching (the process goes on without it); once stopped, it records nothing. An expiry under way
        is not stopped: it records its hang and ends the process (stop waits for it). `teardown`: the rank is about
        to write its own record and end; faulthandler's backstop still ends a teardown that blocks for
        hang_timeout + BACKSTOP_S (the stacks into the log, no record)."""
        with self.deciding:
            if self.stopped:
                return
            self.stopped = True
        faulthandler.cancel_dump_traceback_later()
        if teardown:
            faulthandler.dump_traceback_later(self.timeout + BACKSTOP_S, exit=True,
                                              file=self.log.fileno if self.log else sys.stderr)
        for undo in self.undo:
            undo()

    def poll_s(self) -> float:
        return min(POLL_S, self.timeout / 4)

    def run(self) -> None:
        while not self.stopped:
            for work in list(self.active.values()):
                if time.monotonic() < work[2]:
                    continue
                try:
                    value = work[0]()
                except Exception:   # a progress reading that fails is no progress; the watchdog goes on
                    value = work[1]
                work[2] = time.monotonic() + self.poll_s()
                if value != work[1]:
                    work[1] = value
                    self.beat()
            idle = time.monotonic() - self.last
            if idle > self.timeout:
                with self.deciding:
                    if not self.stopped:
                        self.expire(idle)
            time.sleep(min(1.0, self.timeout / 10))

    def doing(self) -> str:
        """What the rank was doing, for its line: the work in progress that stopped moving, if any."""
        work = list(self.active)
        return f" in {work[0]}, which stopped moving" if work else ""

    def expire(self, idle: float) -> None:
        step = self.finished_step()
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        what = (f"made no progress for {idle:.0f} s (train.hang_timeout={self.timeout:g}) after finishing step "
                f"{step}{self.doing()}")
        with open(self.path, "w") as f:
            f.write(f"rank {self.rank} (pid {os.getpid()}) {what}, at {time.strftime('%Y-%m-%d %H:%M:%S')}; the "
                    f"stack of each of its threads follows, most recent call first\n\n")
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)
        try:
            recorded = flight_recorder.dump(self.run_dir, self.rank)
        except Exception as e:   # the stacks are written; a failed dump must not keep the rank alive
            recorded = None
            print(f"warning: rank {self.rank}: the flight recorder's dump failed: {e}", file=sys.stderr, flush=True)
        line = f"rank {self.rank} {what}: stopped; the stacks of its threads are in {self.path}"
        classes.write(self.run_dir, classes.Ending(self.rank, classes.HANG.name, line, step, self.restart,
                                                   collectives=timeouts.collectives_entered()))
        print(f"error: {line}" + (f", its flight recorder in {recorded}" if recorded else ""), file=sys.stderr,
              flush=True)
        if self.log:
            self.log.drain()
        os._exit(HANG_EXIT)
