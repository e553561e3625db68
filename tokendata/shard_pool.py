"""The shards one reader (a DataLoader worker, or the training process without workers) has fetched or is fetching,
shared by every stream and source it reads.

    pool = ShardPool(threads, spill_root)
    pool.want(key, open_fn)   the shard is needed soon: fetched once (open_fn() -> Loaded, in a fetch thread) while
                              anyone wants it; want() counts users, release(key) drops one, and one nobody wants is
                              dropped (its spilled copy deleted)
    pool.get(key, open_fn)    the Loaded (or the DataError its fetch raised), waiting for it: a shard someone waits
                              for goes before the ones only wanted ahead
    pool.read(loaded, offset, nbytes)   one sample's bytes from the local file (pread)

Bounds (docs/data.md): at most `threads` fetches at once, and a fetch holds one shard's bytes while it downloads and
checks it; then the bytes go to the local disk (data.cache_dir, or a spill folder for a remote source without one;
a local source's file is read where it is) and only the sample offsets stay in memory. So a reader holds at most
`threads` shards in memory, whatever its streams and sources; its disk holds the windows its streams read and the
one each reads next.
"""
from __future__ import annotations

import collections
import multiprocessing.util
import os
import shutil
import socket
import tempfile
import threading

from tokendata.shards import DataError

STATS = {"peak_in_flight": 0, "fetched": 0}   # of every pool of this process: for the data bench and its tests
SPILL = "synthformer-spill"   # under data.cache_dir or the temporary folder: <pid>@<host>-<n> per reader
OPEN_FILES = 64               # local files kept open for reading samples


_GENERATION = [0]   # STATS counts the pools made since the last reset_stats


def reset_stats() -> None:
    """Start STATS from zero, counting only the pools made from now on: a measurement of one reader in a process where
    the readers of others (a test's earlier ones) may still be fetching."""
    _GENERATION[0] += 1
    STATS.update(peak_in_flight=0, fetched=0)


class _Entry:
    def __init__(self, opener):
        self.opener, self.users, self.state, self.result = opener, 0, "queued", None
        self.done = threading.Event()


class ShardPool:
    def __init__(self, threads: int, spill_root: str | None = None):
        self.threads = max(1, threads)
        self.spill_root = spill_root or tempfile.gettempdir()
        self._entries: dict = {}
        self._queue: collections.deque = collections.deque()   # keys to fetch, the most urgent first
        self._lock = threading.Condition()
        self._workers: list[threading.Thread] = []
        self._files: collections.OrderedDict = collections.OrderedDict()   # path -> open file descriptor
        self._spill: str | None = None
        self.in_flight = self.peak_in_flight = self.fetched = 0   # for the data bench and its tests
        self.counted = _GENERATION[0]   # in STATS while no reset_stats came after it
        self.retries = 0   # the retries of the fetches done since `take_retries` last took them

    # ---- fetching ----

    def _entry(self, key, opener, urgent: bool) -> _Entry:
        """The key's entry, queued for a fetch if new (first in the queue if `urgent`); call with the lock held."""
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry(opener)
            if urgent:
                self._queue.appendleft(key)
            else:
                self._queue.append(key)
            self._start()
            self._lock.notify()
        elif urgent and entry.state == "queued":   # waited for: before those wanted ahead
            self._queue.remove(key)
            self._queue.appendleft(key)
        return entry

    def want(self, key, opener) -> None:
        with self._lock:
            self._entry(key, opener, urgent=False).users += 1

    def release(self, key) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return
            entry.users -= 1
            if entry.users <= 0:
                self._drop(key, entry)

    def get(self, key, opener):
        """The shard's Loaded or DataError, fetched now if nobody wanted it (then it is dropped at the next sweep)."""
        with self._lock:
            entry = self._entry(key, opener, urgent=True)
        entry.done.wait()
        return entry.result

    def take_retries(self) -> int:
        """The retries of the fetches done since the last call (prefetched shards' too, used or not)."""
        with self._lock:
            retries, self.retries = self.retries, 0
        return retries

    def sweep(self) -> None:
        """Drop the shards nobody wants (fetched by get() alone)."""
        with self._lock:
            for key, entry in list(self._entries.items()):
                if entry.users <= 0 and entry.state == "done":
                    self._drop(key, entry)

    def _start(self):
        if len(self._workers) < self.threads:
            worker = threading.Thread(target=self._work, daemon=True, name="shard-fetch")
            worker.start()
            self._workers.append(worker)

    def _work(self):
        while True:
            with self._lock:
                while not self._queue:
                    self._lock.wait()
                key = self._queue.popleft()
                entry = self._entries[key]
                entry.state = "running"
                self.in_flight += 1
                self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
                if self.counted == _GENERATION[0]:
                    STATS["peak_in_flight"] = max(STATS["peak_in_flight"], self.in_flight)
            try:
                result = entry.opener(self.spill_dir)
            except DataError as e:
                result = e
            with self._lock:
                self.in_flight -= 1
                self.fetched += 1
                STATS["fetched"] += self.counted == _GENERATION[0]
                entry.state, entry.result = "done", result
                self.retries += getattr(result, "retries", 0)
                entry.done.set()
                if entry.users <= 0 and self._entries.get(key) is not entry:   # dropped while it ran
                    self._delete(result)

    def _drop(self, key, entry):
        del self._entries[key]
        if entry.state == "queued":
            self._queue.remove(key)
        elif entry.state == "done":
            self._delete(entry.result)

    def _delete(self, loaded):
        if getattr(loaded, "spilled", False):
            fd = self._files.pop(loaded.path, None)
            if fd is not None:
                os.close(fd)
            try:
                os.remove(loaded.path)
            except FileNotFoundError:
                pass

    # ---- reading ----

    def read(self, loaded, offset: int, nbytes: int) -> bytes:
        with self._lock:
            fd = self._files.pop(loaded.path, None)
            if fd is None:
                fd = os.open(loaded.path, os.O_RDONLY)
                while len(self._files) >= OPEN_FILES:
                    os.close(self._files.popitem(last=False)[1])
            self._files[loaded.path] = fd
            data = os.pread(fd, nbytes, offset)
        if len(data) != nbytes:
            raise DataError(f"shard {loaded.path} changed while it was read (a sample at byte {offset} is cut short)")
        return data

    # ---- the spill folder ----

    def spill_dir(self) -> str:
        """This reader's folder for remote shards without data.cache_dir, made at its first use; the folders of
        readers of this host that no longer run are removed then, and this one when the process exits. A folder is
        named by its reader's pid and host: on a data.cache_dir that several nodes share, another node's folders
        are never removed here (its pids mean nothing on this host), nor one named without a host."""
        with self._lock:
            if self._spill is None:
                root = os.path.join(self.spill_root, SPILL)
                os.makedirs(root, exist_ok=True)
                host = socket.gethostname()
                for name in os.listdir(root):   # left by a reader that was killed
                    pid, at, rest = name.partition("@")
                    if at and rest.rpartition("-")[0] == host and pid.isdigit() and not _alive(int(pid)):
                        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
                self._spill = tempfile.mkdtemp(prefix=f"{os.getpid()}@{host}-", dir=root)
                # at exit, also of a DataLoader worker (multiprocessing runs its finalizers, not atexit's)
                multiprocessing.util.Finalize(self, shutil.rmtree, args=(self._spill, True), exitpriority=0)
            return self._spill

    def close(self) -> None:
        with self._lock:
            for fd in self._files.values():
                os.close(fd)
            self._files.clear()
            if self._spill is not None:
                shutil.rmtree(self._spill, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
