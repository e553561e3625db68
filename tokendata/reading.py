"""What the readers of a train stream do, in a DataLoader worker or (without workers) in the training process: fetch
each group of shards while the one before is handed out, pool and shuffle a group's samples, and hand out this rank's
pieces of global batches (tokendata/order.py says which samples; this module reads them). Module level, so workers
can pickle it under any start method.

    RankPieces(plan)   the IterableDataset of one rank: each worker yields, per global batch, one piece: the next
                       samples of each canonical stream it serves, {"streams", "tokens", "ids", "skipped_shards",
                       "retries"}; the training process puts the pieces back in stream order (tokendata/stream.py)
"""
from __future__ import annotations

import dataclasses
import random
import threading
from concurrent.futures import Future

import numpy as np
import torch

from tokendata.order import Blend, Position, SourceOrder
from tokendata.shard_files import ShardFiles, ShardReader


def worker_info() -> tuple[int, int]:
    """(this DataLoader worker's id, the workers) or (0, 1) in the training process."""
    info = torch.utils.data.get_worker_info()
    return (info.id, info.num_workers) if info is not None else (0, 1)


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


def shuffled_samples(groups, counts: dict, reader: ShardReader, prefix: str | None = None):
    """Each group's ({"names", "skip", "order_seed"}) samples pooled in a seeded random order, minus the first `skip`
    of it (still bytes, not decoded); ids prefixed "<prefix>/" when given (a named source). A bad shard (bad_shards=
    "skip") adds no samples: the group is smaller, its order still a function of the seed. The next group's shards
    are fetched by a thread while this one's samples are handed out: over a network the reader does not wait a whole
    download at each group boundary (memory: two groups of shards). The first group's fetch starts at once."""
    fetch = lambda group: [reader.fetch(name, counts[name]) for name in group["names"]]  # noqa: E731
    groups = iter(groups)
    group = next(groups)
    return _pooled(groups, group, in_background(fetch, group), fetch, reader, prefix)


def _pooled(groups, group, fetched, fetch, reader, prefix):
    while True:
        results = fetched.result()
        upcoming = next(groups)   # endless
        fetched = in_background(fetch, upcoming)
        samples = [s for name, r in zip(group["names"], results) for s in reader.accept(name, r)]
        order = list(range(len(samples)))
        random.Random(group["order_seed"]).shuffle(order)
        for j in order[group["skip"]:]:
            sample = reader.tag(samples[j])
            yield dict(sample, __key__=f"{prefix}/{sample['__key__']}") if prefix else sample
        group = upcoming


def collate(samples, dtype, member):
    """A batch whose tokens are a numpy array, not yet a tensor: a DataLoader worker sends it pickled through its pipe.
    A tensor would travel as a shared-memory file descriptor served by a thread of the worker, and a rank killed in
    mid-handover (kill -9) would leave that thread printing a ConnectionResetError traceback."""
    rows = [np.frombuffer(s[member], dtype=dtype) for s in samples]  # the bytes are decoded only here, when kept
    return {"tokens": np.stack(rows).astype(np.int64), "ids": [s["__key__"] for s in samples],
            "skipped_shards": [p for s in samples for p in s.get("__skipped__", ())],
            "retries": sum(s.get("__retries__", 0) for s in samples)}


def as_is(batch):
    """The DataLoader's collate_fn: its default would turn the numpy tokens into a tensor inside the worker."""
    return batch


@dataclasses.dataclass
class Part:
    """One source as the readers need it: its order, files, samples per shard, sample-id prefix (None: unnamed) and
    the shards found bad while reading before this position (their samples are not counted)."""
    order: SourceOrder
    files: ShardFiles
    counts: dict
    prefix: str | None
    bad: frozenset


@dataclasses.dataclass
class Plan:
    """What one rank's readers read, from a position on: the canonical streams of the rank, and the global batches of
    `global_batch` samples that `blend` makes from `position` on."""
    parts: list[Part]
    blend: Blend
    streams: list[int]
    global_batch: int
    position: Position
    fmt: tuple
    dtype: str
    member: str
    bad_shards: str


class RankPieces(torch.utils.data.IterableDataset):
    """Endless pieces of global batches for one rank: worker w of W serves the rank's streams [w::W] and yields, for
    each global batch in turn, their samples in it (G/C each), stream after stream: the DataLoader's round robin over
    the workers then hands the training process one piece of every worker per global batch."""

    def __init__(self, plan: Plan):
        self.plan = plan

    def __iter__(self):
        p = self.plan
        worker, workers = worker_info()
        mine = p.streams[worker::workers]
        readers = []
        for part in p.parts:   # one reader a source: a shard it finds bad is reported once and not reopened
            readers.append(ShardReader(part.files, p.fmt, p.bad_shards, "train", len(part.order.shards), part.bad))
        # (stream, source): its samples from the start position, every first fetch started now, side by side
        samples = {(stream, s): shuffled_samples(part.order.walk(stream, p.position.streams[stream][s], part.bad),
                                                 part.counts, readers[s], part.prefix)
                   for stream in mine for s, part in enumerate(p.parts)}
        position = p.position.copy()
        while True:
            split = p.blend.advance(position, p.global_batch)   # [stream][source]: samples in this global batch
            piece = [next(samples[stream, s]) for stream in mine for s, n in enumerate(split[stream]) for _ in range(n)]
            yield dict(collate(piece, p.dtype, p.member), streams=mine)
