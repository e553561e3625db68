"""Each rank's own log file: everything the rank writes to its stdout and stderr, appended to
<run_dir>/logs/rank<k>.log as well as passed on to the launcher's console.

The copy is taken at the file descriptors (1 and 2), not at Python's sys.stdout: it holds what C code writes too
(NCCL's and gloo's messages, faulthandler's dumps, the DataLoader workers' output), and a traceback. Each descriptor
becomes a pipe whose reader thread writes every chunk to the original descriptor and to the file. `drain()` before
os._exit (the hang watchdog) hands the last lines on; a rank killed by -9 loses at most what sat in the pipe.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
import time

DRAIN_S = 2.0   # how long drain() waits for the pipes to empty (a DataLoader worker may hold one open)
ACTIVE: "RankLog | None" = None   # this process's, once started


def log_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, "logs", f"rank{rank}.log")


def start(run_dir: str, rank: int, header: str) -> "RankLog":
    """This process's rank log (one per process: a second call returns the first)."""
    global ACTIVE
    if ACTIVE is None:
        ACTIVE = RankLog(log_path(run_dir, rank), header)
    return ACTIVE


class RankLog:
    """Tee this process's descriptors 1 and 2 into `path` (appended) from construction until `drain()`."""

    def __init__(self, path: str, header: str):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self.path = path
        self.file = open(path, "ab", buffering=0)
        self.file.write(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} {header} ====\n".encode())
        self.lock = threading.Lock()
        self.saved: dict[int, int] = {}
        self.pumps: list[threading.Thread] = []
        for fd, stream in ((1, sys.stdout), (2, sys.stderr)):
            stream.flush()
            self.saved[fd] = os.dup(fd)
            reader, writer = os.pipe()
            os.dup2(writer, fd)
            os.close(writer)
            pump = threading.Thread(target=self.pump, args=(reader, self.saved[fd]), name=f"rank-log-{fd}",
                                    daemon=True)
            pump.start()
            self.pumps.append(pump)
        atexit.register(self.drain)

    @property
    def fileno(self) -> int:
        """The log file's descriptor: where a dump from C (faulthandler's backstop) goes straight."""
        return self.file.fileno()

    def pump(self, reader: int, out: int) -> None:
        while chunk := os.read(reader, 65536):
            with self.lock:
                write_all(out, chunk)
                write_all(self.file.fileno(), chunk)
        os.close(reader)

    def drain(self) -> None:
        """Give the descriptors back and wait (DRAIN_S at most) for what the pipes still hold to be copied."""
        if not self.saved:
            return
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        for fd, original in self.saved.items():
            os.dup2(original, fd)   # the pipe's last writer here closes: its reader ends once the data is out
        self.saved = {}
        deadline = time.monotonic() + DRAIN_S
        for pump in self.pumps:
            pump.join(max(0.0, deadline - time.monotonic()))


def write_all(fd: int, data: bytes) -> None:
    try:
        while data:
            data = data[os.write(fd, data):]
    except OSError:   # a closed console: the file still gets it
        pass
