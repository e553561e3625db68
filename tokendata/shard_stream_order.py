"""The order of runs started with canonical streams dealt by shard (checkpoints whose data state says "order":
"canonical streams"), kept so that they go on resuming exactly; tokendata/order.py is the order of new runs. A
TokenStream switches to it when it loads such a state, and its later checkpoints keep it.

Order, a function of the data settings and the seed:
    C streams (C divides G); global batch g is, stream after stream, G/C samples of every stream c, and within a
    stream its samples of each source in source order, X[c][s] of them (`Blend.advance`: the batch's counts k_s from
    Tijdeman's rule, split over the streams by the greedy of the Gale–Ryser theorem, the stream furthest behind its
    weight first). Data-parallel rank r of D serves the C/D streams [r·C/D, (r+1)·C/D): D must divide C.
    A source's samples for stream c (`SourceOrder`): epoch e shuffles its shard list with Random(f"{key}/{e}"); stream
    c takes the positions p with (e·N + p) mod C = c, in groups of `mix` consecutive shards, each group's samples (of
    the shards not found bad) pooled and shuffled with Random(f"{key}/{e}/{c}/{j}"). A source with fewer shards than
    streams is read in several epochs side by side: it repeats samples before its epoch is read (the reason for
    tokendata/order.py).
Its reader (`RankPieces`) holds two groups of shards of every (stream, source) pair a rank reads, each fetched by a
thread of its own.
"""
from __future__ import annotations

import dataclasses
import random

import numpy as np
import torch

from tokendata.order import Blend as Picks
from tokendata.reading import Part, as_is, collate, in_background, worker_info
from tokendata.shard_files import ShardReader
from tokendata.shards import DataError

ORDER = "canonical streams"


def check_streams(streams: int, global_batch: int, dp: int) -> None:
    """One-line DataError unless the C streams of this order can be read by D data-parallel ranks."""
    if streams % dp or global_batch % streams:
        sizes = ", ".join(str(d) for d in range(1, streams + 1) if streams % d == 0 and global_batch % d == 0)
        raise DataError(f"this run's data order (canonical streams dealt by shard, data.canonical_streams={streams}, "
                        f"from a checkpoint of before the order dealt by sample) gives each data-parallel rank whole "
                        f"streams: the data-parallel size {dp} does not divide {streams}; it can resume on {sizes} "
                        f"data-parallel ranks")


def rank_streams(streams: int, dp_rank: int, dp_world: int) -> list[int]:
    per = streams // dp_world
    return list(range(dp_rank * per, (dp_rank + 1) * per))


class SourceOrder:
    """One source's shards dealt to C canonical streams, epoch after epoch. `shards`: [(name, samples)] sorted by name
    (the good train shards); `key`: the seed string of its shuffles."""

    def __init__(self, shards: list, key: str, streams: int, mix: int):
        if not shards:
            raise DataError(f"no train shards to read (key {key})")
        self.shards, self.key, self.streams, self.mix = list(shards), key, streams, mix
        self._epochs: dict[int, list] = {}

    def epoch(self, e: int) -> list:
        if e not in self._epochs:
            if len(self._epochs) >= 64:   # each stream's position is found epoch after epoch from 0: keep them all
                self._epochs.pop(next(iter(self._epochs)))   # up to 64 (lists of references), dropping the oldest
            order = list(self.shards)
            random.Random(f"{self.key}/{e}").shuffle(order)
            self._epochs[e] = order
        return self._epochs[e]

    def share(self, stream: int, e: int) -> list:
        """Stream c's shards of epoch e: the positions p with (e·N + p) mod C = c."""
        return self.epoch(e)[(stream - e * len(self.shards)) % self.streams::self.streams]

    def groups(self, stream: int, e: int) -> list[list]:
        mine = self.share(stream, e)
        return [mine[j:j + self.mix] for j in range(0, len(mine), self.mix)]

    def locate(self, stream: int, position: int, bad: frozenset = frozenset()) -> tuple[int, int, int]:
        """(epoch, group, samples to skip in it) of sample `position` of this source in `stream`; shards in `bad`
        hold none."""
        if len(bad) >= len(self.shards):
            raise DataError(f"every train shard of {self.key} was found bad")
        e = 0
        while True:
            for j, group in enumerate(self.groups(stream, e)):
                n = sum(count for name, count in group if name not in bad)
                if position < n:
                    return e, j, position
                position -= n
            e += 1

    def walk(self, stream: int, position: int, bad: frozenset = frozenset()):
        """Endless {"names", "skip", "order_seed"} of the groups stream c reads from sample `position` on."""
        e, first, skip = self.locate(stream, position, bad)
        while True:
            for j, group in enumerate(self.groups(stream, e)[first:], start=first):
                yield {"names": [name for name, _ in group], "skip": skip, "order_seed": f"{self.key}/{e}/{stream}/{j}"}
                skip = 0
            e, first = e + 1, 0


@dataclasses.dataclass
class Position:
    """The picks so far (N), each source's count among them, and each stream's count of each source."""
    samples: int
    counts: list[int]
    streams: list[list[int]]

    def copy(self) -> "Position":
        return Position(self.samples, list(self.counts), [list(c) for c in self.streams])


class Blend(Picks):
    """Tijdeman's picks (tokendata/order.py), split over C streams of G/C samples each."""

    def __init__(self, weights: list[float], streams: int):
        super().__init__(weights)
        self.C = streams

    def start(self) -> Position:
        return Position(0, [0] * len(self.w), [[0] * len(self.w) for _ in range(self.C)])

    def advance(self, pos: Position, global_batch: int) -> list[list[int]]:
        """The next global batch: [per stream, per source, its samples in it]; `pos` moves past it."""
        m, C, per = len(self.w), self.C, global_batch // self.C
        k = [0] * m
        for s in self.picks(pos, global_batch):   # moves pos.samples and pos.counts
            k[s] += 1
        X = [[q // C for q in k] for _ in range(C)]
        room = [per - sum(X[0])] * C
        done = sum(pos.streams[0]) + per   # every stream's samples after this batch
        for s in sorted(range(m), key=lambda s: (k[s] % C, s)):   # the rarest first: they pick the streams
            behind = lambda c: (-room[c], pos.streams[c][s] - self.w[s] * done, c)  # noqa: E731
            for c in sorted(range(C), key=behind)[:k[s] % C]:   # most room first: every stream fills (Gale–Ryser)
                X[c][s] += 1
                room[c] -= 1
        for c in range(C):
            for s in range(m):
                pos.streams[c][s] += X[c][s]
        return X


def shuffled_samples(groups, counts: dict, reader: ShardReader, prefix: str | None = None):
    """Each group's ({"names", "skip", "order_seed"}) samples pooled in a seeded random order, minus the first `skip`;
    ids prefixed "<prefix>/" when given. A bad shard (bad_shards="skip") adds no samples. The next group is fetched by
    a thread while this one's samples are handed out."""
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


@dataclasses.dataclass
class Plan:
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
    each global batch, their samples in it (G/C each), stream after stream."""

    def __init__(self, plan: Plan):
        self.plan = plan

    def __iter__(self):
        p = self.plan
        worker, workers = worker_info()
        mine = p.streams[worker::workers]
        readers = [ShardReader(part.files, p.fmt, p.bad_shards, "train", len(part.order.shards), part.bad)
                   for part in p.parts]
        samples = {(stream, s): shuffled_samples(part.order.walk(stream, p.position.streams[stream][s], part.bad),
                                                 part.counts, readers[s], part.prefix)
                   for stream in mine for s, part in enumerate(p.parts)}
        position = p.position.copy()
        while True:
            split = p.blend.advance(position, p.global_batch)
            piece = [next(samples[stream, s]) for stream in mine for s, n in enumerate(split[stream]) for _ in range(n)]
            yield dict(collate(piece, p.dtype, p.member), streams=mine)


class Mode:
    """A TokenStream reading this order from its data state `sd`: `shards`, each source's train shards as the run
    started with them (less those its size check dropped)."""

    def __init__(self, stream, sd: dict, shards: list[list]):
        G, C = stream.global_batch_size, int(sd["canonical_streams"])
        check_streams(C, G, stream.dp_world)
        self.stream, self.C, self.per_stream = stream, C, G // C
        self.orders = [SourceOrder(shards[i], stream.key(p.source), C, stream.mix_shards)
                       for i, p in enumerate(stream.parts)]
        self.blend = Blend([p.source.weight for p in stream.parts], C)
        self.streams = rank_streams(C, stream.dp_rank, stream.dp_world)
        self.workers = min(stream.num_workers, len(self.streams))
        self.pos = Position(int(sd["samples"]), list(sd["counts"]), [list(c) for c in sd["stream_counts"]])

    def loader(self, bad: list[set]):
        st = self.stream
        parts = [Part(order, p.files, dict(order.shards), p.source.name, frozenset(b))
                 for order, p, b in zip(self.orders, st.parts, bad)]
        plan = Plan(parts, self.blend, self.streams, st.global_batch_size, self.pos.copy(), st.fmt, st.dtype,
                    st.member, st.bad_shards)
        return torch.utils.data.DataLoader(RankPieces(plan), batch_size=None, collate_fn=as_is,
                                           num_workers=self.workers, prefetch_factor=2 if self.workers else None)

    def share(self, pieces: list[dict]) -> dict:
        """The rank's share of one global batch in stream order, from one piece of each worker."""
        tokens, ids, L = {}, {}, self.per_stream
        for piece in pieces:
            for j, c in enumerate(piece["streams"]):
                tokens[c], ids[c] = piece["tokens"][j * L:(j + 1) * L], piece["ids"][j * L:(j + 1) * L]
        return {"tokens": np.concatenate([tokens[c] for c in self.streams]),
                "ids": [i for c in self.streams for i in ids[c]],
                "skipped_shards": [u for piece in pieces for u in piece["skipped_shards"]],
                "retries": sum(piece["retries"] for piece in pieces)}

    def advance(self) -> None:
        self.blend.advance(self.pos, self.stream.global_batch_size)

    def state(self) -> dict:
        return {"order": ORDER, "samples": self.pos.samples, "counts": list(self.pos.counts),
                "stream_counts": [list(c) for c in self.pos.streams], "canonical_streams": self.C}

    def upcoming(self, worker: int, source: int, bad: set) -> list[str]:
        order = self.orders[source]
        return [name for c in self.streams[worker::max(1, self.workers)]
                for name in next(order.walk(c, self.pos.streams[c][source], frozenset(bad)))["names"]]
