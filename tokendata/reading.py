"""What the readers of a train stream do, in a DataLoader worker or (without workers) in the training process: read
this rank's positions of every global batch (tokendata/order.py says which samples; this module reads them). Module
level, so workers can pickle it under any start method.

    start(loader, ignored)  iter(loader), its worker processes ignoring the rank's preemption signals
    one_line(e)        a DataError a DataLoader worker raised, as its own line (without the worker's traceback)
    RankPieces(plan)   the IterableDataset of one rank: worker w of W reads the positions whose stream c has
                       c mod W = w and yields, per global batch, one piece {"positions", "tokens", "ids",
                       "skipped_shards", "retries"}; the training process puts the pieces back in position order
                       (tokendata/stream.py)

A reader keeps, for each (stream, source) it reads, the shards of that stream's current window and of the window
after it (fetched ahead, in the order they will be needed), in one ShardPool (tokendata/shard_pool.py): at most
`fetch_threads` shards in memory, the rest on the local disk.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import signal
import sys
import threading
from concurrent.futures import Future

import numpy as np
import torch

from tokendata.lengths import Lengths
from tokendata.order import Blend, Position, SourceOrder, layout, rank_slice
from tokendata.ramp import BatchRamp
from tokendata.shard_files import ShardFiles, fix
from tokendata.shard_pool import ShardPool
from tokendata.remote import FetchFailed
from tokendata.shards import MAKE, DataError


def worker_info() -> tuple[int, int]:
    """(this DataLoader worker's id, the workers) or (0, 1) in the training process."""
    info = torch.utils.data.get_worker_info()
    return (info.id, info.num_workers) if info is not None else (0, 1)


def start(loader, ignored: tuple = ()):
    """iter(loader), its worker processes ignoring the signals `ignored` (the rank's preemption signals, which a
    scheduler may send to every process of the job: the rank finishes its step and saves, and its workers must read
    on until it does; torch's own handler would end them, and the rank's step with them). The signals are blocked in
    this thread while the workers start and stay blocked in them (`ignore`): none falls between, and the rank sees
    one that came meanwhile as soon as they are unblocked here."""
    if not ignored or not loader.num_workers or not hasattr(signal, "sigwaitinfo"):   # (macOS: as torch does)
        return iter(loader)
    loader.worker_init_fn = functools.partial(ignore, tuple(ignored))
    before = signal.pthread_sigmask(signal.SIG_BLOCK, ignored)
    try:
        return iter(loader)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def ignore(signals: tuple, worker_id: int) -> None:
    """A DataLoader worker's init: `signals`, blocked in every thread of it, are taken by a thread of their own, which
    ignores each unless it comes from the rank itself: multiprocessing's terminate() (SIGTERM) when the rank shuts its
    loader down or exits, which ends the worker as torch's own handler does (exit status 0)."""
    threading.Thread(target=take, args=(signals, os.getppid()), daemon=True, name="preempt-signals").start()


def take(signals: tuple, rank: int) -> None:
    while signal.sigwaitinfo(signals).si_pid != rank:
        pass
    os._exit(0)


def in_background(fn, *args) -> Future:
    """fn(*args) in a daemon thread: a process that is done exits without waiting for a fetch it no longer needs."""
    future = Future()

    def run():
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # handed to whoever waits for the result
            future.set_exception(e)

    threading.Thread(target=run, daemon=True, name="shard-prefetch").start()
    return future


def collate(samples, dtype, member):
    """A batch whose tokens are a numpy array, not yet a tensor: a DataLoader worker sends it pickled through its pipe.
    A tensor would travel as a shared-memory file descriptor served by a thread of the worker, and a rank killed in
    mid-handover (kill -9) would leave that thread printing a ConnectionResetError traceback."""
    rows = [np.frombuffer(s[member], dtype=dtype) for s in samples]  # the bytes are decoded only here, when kept
    return {"tokens": np.stack(rows).astype(np.int64) if rows else np.zeros((0, 0), dtype=np.int64),
            "ids": [s["__key__"] for s in samples],
            "skipped_shards": [p for s in samples for p in s.get("__skipped__", ())],
            "retries": sum(s.get("__retries__", 0) for s in samples)}


def join_pieces(pieces, n: int, seq_len: int) -> dict:
    """This rank's share of one global batch (n samples of seq_len + 1 tokens), in position order, from one piece of
    each worker."""
    tokens, ids = np.zeros((n, seq_len + 1), dtype=np.int64), [None] * n
    for piece in pieces:
        if piece["positions"]:
            tokens[piece["positions"]] = piece["tokens"]
            for i, key in zip(piece["positions"], piece["ids"]):
                ids[i] = key
    return {"tokens": tokens, "ids": ids, "skipped_shards": [u for piece in pieces for u in piece["skipped_shards"]],
            "retries": sum(piece["retries"] for piece in pieces)}


def one_line(e):
    """A DataError the DataLoader re-raises from a worker holds the worker's traceback; its own is the last line (of
    the same type: an outage stays FetchFailed)."""
    last, prefix = str(e).rstrip().rsplit("\n", 1)[-1], f"{type(e).__module__}.{type(e).__qualname__}: "
    return type(e)(last[len(prefix):]) if "\n" in str(e) and last.startswith(prefix) else e


def as_is(batch):
    """The DataLoader's collate_fn: its default would turn the numpy tokens into a tensor inside the worker."""
    return batch


@dataclasses.dataclass
class Part:
    """One source as the readers need it: its order (of the model's samples), files, file samples per shard,
    sample-id prefix (None: unnamed) and the shards found bad while reading before this position (not fetched
    again)."""
    order: SourceOrder
    files: ShardFiles
    counts: dict
    prefix: str | None
    bad: frozenset


@dataclasses.dataclass
class Plan:
    """What one rank's readers read, from a position on: its positions [lo, hi) of the global batches of
    sizes `ramp` gives (tokendata/ramp.py) that `blend` and the C `streams` make from `position` on; `fmt`: (member, bytes) of a
    file sample; `lengths`: how file samples make the model's (tokendata/lengths.py)."""
    parts: list[Part]
    blend: Blend
    streams: int
    ramp: BatchRamp
    dp_rank: int
    dp_world: int
    position: Position
    fmt: tuple
    dtype: str
    member: str
    bad_shards: str
    fetch_threads: int
    spill_root: str | None
    lengths: Lengths


class Reader:
    """The samples of one reader's draws (stream c, source s, draw j), from a ShardPool; the windows each (c, s)
    reads and the next ones wanted, the ones behind released. A shard found bad is failed on (bad_shards="fail") or,
    under "skip", warned about once on stderr and replaced (tokendata/order.py), the URL riding on the next sample out
    with the retries the fetches took (`tag`)."""

    def __init__(self, plan: Plan, threads: int):
        self.plan, self.pool = plan, ShardPool(threads, plan.spill_root)
        self.nbytes, self.itemsize = plan.fmt[1], np.dtype(plan.dtype).itemsize
        self.bad = [set(part.bad) for part in plan.parts]
        self.windows: dict = {}   # (stream, source) -> (epoch, window, [keys wanted])
        self.skipped, self.retries = [], 0

    def opener(self, s: int, name: str):
        part = self.plan.parts[s]
        return lambda spill: part.files.open(name, part.counts[name], self.nbytes, spill)

    def _follow(self, c: int, s: int, e: int, k: int) -> None:
        """(c, s) reads window k of epoch e: want its shards and the next window's, release the rest."""
        if self.windows.get((c, s), (None, None))[:2] == (e, k):
            return
        order = self.plan.parts[s].order
        ahead = (e, k + 1) if order.window_shards(c, e, k + 1) else (e + 1, 0)
        keys = [(s, n) for n in order.window_shards(c, e, k) + order.window_shards(c, *ahead)
                if n not in self.bad[s]]
        for key in keys:
            self.pool.want(key, self.opener(*key))
        for key in self.windows.get((c, s), (None, None, []))[2]:
            self.pool.release(key)
        self.windows[(c, s)] = (e, k, keys)

    def sample(self, s: int, c: int, j: int) -> dict:
        part = self.plan.parts[s]
        self._follow(c, s, *part.order.where(c, j)[:2])
        name, index = part.order.draw(c, j, lambda shard: self._is_bad(s, shard))
        loaded = self.pool.get((s, name), self.opener(s, name))
        self.retries += self.pool.take_retries()   # of every fetch done by now, prefetched ones too
        keys, data = [], []
        for f, first, end in self.plan.lengths.pieces(index):   # model sample `index`: ranges of file samples
            key, offset = loaded.locate(f)
            keys.append(key)
            data.append(self.pool.read(loaded, offset + first * self.itemsize, (end - first) * self.itemsize))
        key = self.plan.lengths.key(index, keys)
        sample = {"__key__": f"{part.prefix}/{key}" if part.prefix else key, self.plan.member: b"".join(data)}
        if self.skipped or self.retries:
            sample.update(__skipped__=self.skipped, __retries__=self.retries)
            self.skipped, self.retries = [], 0
        return sample

    def _is_bad(self, s: int, name: str) -> bool:
        """Whether a shard is bad: known, or found so by fetching it (then failed on, or reported: `_bad`)."""
        if name in self.bad[s]:
            return True
        loaded = self.pool.get((s, name), self.opener(s, name))
        if isinstance(loaded, DataError):
            self._bad(s, name, loaded)
            return True
        return False

    def _bad(self, s: int, name: str, error: DataError) -> None:
        part = self.plan.parts[s]
        if self.plan.bad_shards != "skip" or isinstance(error, FetchFailed):   # an outage is no bad shard
            raise error
        url = part.files.url(name)
        what = str(error).removesuffix(f": {fix(part.files.location)}")
        print(f"warning: {what}; skipping it (data.bad_shards=skip)", file=sys.stderr, flush=True)
        self.bad[s].add(name)
        self.skipped.append(url)
        if len(self.bad[s]) >= len(part.order.shards):
            raise DataError(f"every train shard in {part.files.location} is bad (see the warnings above): rebuild it "
                            f"with {MAKE}")


class RankPieces(torch.utils.data.IterableDataset):
    """Endless pieces of global batches for one rank: worker w of W reads this rank's positions whose stream c has
    c mod W = w and yields, for each global batch in turn, their samples and positions: the DataLoader's round robin
    over the workers then hands the training process one piece of every worker per global batch."""

    def __init__(self, plan: Plan):
        self.plan = plan

    def __iter__(self):
        p = self.plan
        worker, workers = worker_info()
        reader = Reader(p, max(1, p.fetch_threads // workers))
        position = p.position.copy()
        while True:
            G = p.ramp.size_at(position.samples)   # of this global batch (it grows along a ramp)
            lo, hi = rank_slice(G, p.dp_rank, p.dp_world)
            lay = layout(p.blend, position, G, p.streams)
            mine = [i for i in range(lo, hi) if lay.streams[i] % workers == worker]
            samples = [reader.sample(int(lay.sources[i]), int(lay.streams[i]), int(lay.draws[i])) for i in mine]
            reader.pool.sweep()
            yield dict(collate(samples, p.dtype, p.member), positions=[i - lo for i in mine])
