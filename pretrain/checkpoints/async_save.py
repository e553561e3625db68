"""Saves in the background (checkpoint.async_save): the training step waits only for a copy of the state in host
memory; a writer thread writes the files while training goes on; the checkpoint is published at a later step.

    HostCopy      copies of the state dicts in host memory (pinned where a tensor lives on an accelerator, so that
                  the device-to-host copy runs without staging), kept from one save to the next: the buffers are
                  allocated once, at the first save, and refilled at each
    Writing       one checkpoint's files, queued as (path, host copy, the function that writes it: DeepSpeed's
                  checkpoint engine's save, or torch.save), written in order by a thread of this rank, each fsynced;
                  the first error stops it and is kept as one line. Where checkpoint.dir is a bucket the same thread
                  then uploads this rank's files (bucket.py `Saves.uploading`): "done" means written and uploaded
    Report        what a rank's writer reports once done: its write error, its upload's problem, what it uploaded
    Background    the save under way: started after the snapshot, then settled once every rank's writer has
                  finished (the checkpointer commits it, or reports the failure) — never two at once

Why a writer of our own on DeepSpeed's state dicts, not DeepSpeed's decoupled or FastPersist engines:
docs/DESIGN.md "Saves in the background".
"""
from __future__ import annotations

import os
import threading
from typing import NamedTuple

import numpy as np
import torch


class HostCopy:
    """Host-memory copies of state dicts, one buffer per tensor, reused by the next save of the same file. A tensor
    reached twice in one state (a tied weight) is copied once, so torch.save stores it once, as it would have."""

    def __init__(self):
        self.buffers: dict[tuple[str, int], torch.Tensor] = {}
        self.devices: set[torch.device] = set()   # accelerators copied from since the last `wait`

    def copy(self, state, name: str):
        """`state` with every tensor replaced by its host copy and every container rebuilt: nothing that training
        changes in place is shared with what the writer writes. `name`: the file's, the key of its buffers."""
        memo, count = {}, iter(range(1 << 62))

        def visit(x):
            if isinstance(x, torch.Tensor):
                if id(x) not in memo:
                    memo[id(x)] = self.take((name, next(count)), x)
                return memo[id(x)]
            if isinstance(x, dict):
                out = x.copy()   # keeps the type (OrderedDict, defaultdict's factory)
                for k, v in x.items():
                    out[k] = visit(v)
                return out
            if isinstance(x, list):
                return [visit(v) for v in x]
            if type(x) is tuple:
                return tuple(visit(v) for v in x)
            if isinstance(x, np.ndarray):
                return x.copy()
            return x   # numbers, strings, torch.Size, …: not changed in place

        return visit(state)

    def take(self, key: tuple[str, int], t: torch.Tensor) -> torch.Tensor:
        """`t`'s values in the host buffer `key` (made, or remade where the shape changed); from an accelerator the
        copy is asynchronous into pinned memory, finished by `wait`."""
        on_device = t.device.type != "cpu"
        buf = self.buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = self.buffers[key] = torch.empty(t.shape, dtype=t.dtype, pin_memory=on_device)
        buf.copy_(t.detach(), non_blocking=on_device)
        if on_device:
            self.devices.add(t.device)
        return buf

    def wait(self) -> None:
        """Every copy from an accelerator has landed in host memory."""
        for device in self.devices:
            torch.accelerator.synchronize(device)
        self.devices.clear()

    @property
    def bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())


def cause_of(e: Exception) -> str:
    """An exception as one line: its class and its first line (an OSError's strerror)."""
    cause = e.strerror if isinstance(e, OSError) and e.strerror else (str(e).splitlines() or [""])[0]
    return f"{type(e).__name__}: {cause}"


class Report(NamedTuple):
    """A rank's writer, once done. `error`: why its files could not be written (the run stops: the disk is the
    problem); `problem`: why its upload to the bucket failed (the save is not committed, training goes on);
    `uploaded`: {file name: size} of what it uploaded."""
    error: str | None = None
    problem: str | None = None
    uploaded: dict = {}


class Writing:
    """One checkpoint's files, written by a thread in the order they were queued, then (`upload`, checkpoint.dir in
    a bucket) uploaded by the same thread. `own`: the checkpointer's OwnFiles (the hang watchdog's view of this
    rank's save), told of each file as it starts; `after_first`: a hook after the first file is written (fault
    tests)."""

    def __init__(self, own, after_first=lambda: None):
        self.files: list[tuple[str, object, object]] = []
        self.own, self.after_first = own, after_first
        self.error: str | None = None
        self.upload = None   # upload(stopped) → (problem or None, {name: size}); never raises
        self.uploaded: tuple[str | None, dict] = (None, {})
        self.finished = threading.Event()
        self.cancelled = False
        self.thread: threading.Thread | None = None

    def add(self, path: str, state, write) -> None:
        self.files.append((path, state, write))

    def start(self, name: str) -> None:
        # a daemon: a rank that fails meanwhile exits without waiting; its half-written .partial is never published
        self.thread = threading.Thread(target=self.run, name=f"checkpoint writer {name}", daemon=True)
        self.thread.start()

    def run(self) -> None:
        try:
            self.write()
            if self.error is None and self.upload is not None and not self.cancelled:
                self.uploaded = self.upload(lambda: self.cancelled)
        except Exception as e:   # an upload's unforeseen error: the save is not committed, as for a refused one
            self.uploaded = (cause_of(e), {})
        finally:
            self.files = []   # the host buffers stay with HostCopy, for the next save
            self.finished.set()

    def write(self) -> None:
        path = None
        try:
            for i, (path, state, write) in enumerate(self.files):
                if self.cancelled:
                    break
                self.own.writing(path)
                write(state, path)
                with open(path, "rb") as f:   # durable now, in the background: the commit's fsync finds it clean
                    os.fsync(f.fileno())
                if i == 0:
                    self.after_first()
            self.own.finished()
        except Exception as e:   # the cause, kept as one line for the checkpointer's report
            self.error = cause_of(e) + (f" ({path})" if isinstance(e, OSError) else "")

    def failed(self) -> bool:
        return self.error is not None or self.uploaded[0] is not None

    def wait(self) -> Report:
        """Wait for the thread; what it reports."""
        self.finished.wait()
        return Report(self.error, *self.uploaded)


class Background:
    """The save in the background of one rank: at most one, from its snapshot until it is settled."""

    def __init__(self):
        self.host = HostCopy()
        self.collecting: Writing | None = None   # the save whose files are being snapshot now
        self.pending = None                      # the checkpointer's record of the save being written, or None
        self.writing: Writing | None = None

    def begin(self, own, after_first=lambda: None) -> None:
        self.collecting = Writing(own, after_first)

    def add(self, path: str, state, write) -> None:
        """Queue a file: its state copied to host memory now, written later by the thread."""
        self.collecting.add(path, self.host.copy(state, os.path.basename(path)), write)

    def queued(self) -> list[str]:
        """The files of the snapshot being taken."""
        return [path for path, _, _ in self.collecting.files]

    def start(self, pending, name: str, upload=None) -> None:
        """The snapshot is whole: once the device's copies have landed, the thread writes it (and, with `upload`,
        uploads it: Writing.upload)."""
        self.host.wait()
        self.writing, self.collecting, self.pending = self.collecting, None, pending
        self.writing.upload = upload
        self.writing.start(name)

    def abandon(self) -> None:
        """A save that failed while it was being snapshot: nothing is written."""
        self.collecting = None

    def flags(self) -> list[bool]:
        """[this rank's writer still writing, this rank's writer failed]: for the step's all-reduce (MAX)."""
        w = self.writing if self.pending is not None else None
        if w is None:
            return [False, False]
        done = w.finished.is_set()
        return [not done, done and w.failed()]

    def wait(self, cancel: bool = False) -> Report:
        """This rank's writer finished (stopped after its current file, with `cancel`): its report."""
        if self.writing is None:
            return Report()
        self.writing.cancelled |= cancel
        return self.writing.wait()

    def settled(self):
        """The save under way is over (committed or reported): its record, and no save pending."""
        pending, self.pending, self.writing = self.pending, None, None
        return pending
