"""The train order: which samples make global batch g, a function of the data settings and the seed alone, never of
the layout that reads them (data-parallel size, DataLoader workers, micro-batch size, accumulation). Pure arithmetic
on the manifests' shard lists and sample counts: nothing here opens a shard.

Canonical streams (MosaicML Streaming's canonical nodes, for WebDataset's sequential reads). A run has C of them
(data.canonical_streams, fixed when it starts; C divides the global batch G). Global batch g is, in stream order,
G/C samples of every stream c = 0 … C-1. Data-parallel rank r of D serves the C/D streams [r·C/D, (r+1)·C/D)
(`rank_streams`), and its DataLoader workers split those among themselves; so for every D and every worker count the
G samples of global batch g are the same ones, in the same order.

How many samples of each source a global batch holds, and how they are split over the streams: `Blend` (the sources'
weights w; m sources). After every global batch each source's count is within 1 − 1/(2m−2) < 1 of w·N (N samples in
all), whatever C is; each stream reads every source at about its weight's rate.

A source's samples for stream c (`SourceOrder`): epoch e shuffles the source's shard list with Random(f"{key}/{e}")
(key: the seed, and the source's name when it has one); stream c takes the positions p of that list with
(e·N + p) mod C = c (N shards: each shard once an epoch across the streams; which streams get one shard more rotates
with e, and a source of fewer shards than streams still feeds every stream over its epochs). It reads them in groups
of `mix` consecutive ones, never across an epoch, pools each group's samples and shuffles them with
Random(f"{key}/{e}/{c}/{j}") (group j): a shard is consecutive text. A source that runs out goes on with its next
epoch, whatever the other sources do.

A position (`Position`) is the same on every rank; a sample position in a source's part of a stream is found by the
manifest's counts, without opening a shard.
"""
from __future__ import annotations

import dataclasses
import math
import random

from tokendata.shards import DataError

DEFAULT_STREAMS_UP_TO = 64   # data.canonical_streams=null: the largest divisor of the global batch up to this


def default_streams(global_batch: int) -> int:
    """data.canonical_streams when the config leaves it null: the largest divisor of the global batch ≤ 64 (a layout
    of D ranks then needs D | C; see README: Training on a cluster)."""
    return max(c for c in range(1, min(global_batch, DEFAULT_STREAMS_UP_TO) + 1) if global_batch % c == 0)


def check_streams(streams: int, global_batch: int, dp: int, key: str = "data.canonical_streams") -> None:
    """One-line DataError unless C streams can make global batches of G samples on D data-parallel ranks."""
    if streams < 1 or global_batch % streams:
        raise DataError(f"{key}={streams} must divide train.global_batch_size={global_batch} (each stream gives "
                        f"G/C samples to every global batch): choose a divisor of {global_batch}")
    if streams % dp:
        raise DataError(f"{key}={streams} is not divisible by the data-parallel size {dp}: each rank serves C/dp "
                        f"whole streams; a new run: set {key} to a multiple of every data-parallel size it may use "
                        f"(dividing train.global_batch_size={global_batch}); a running one: use a data-parallel "
                        f"size that divides {streams}")


def rank_streams(streams: int, dp_rank: int, dp_world: int) -> list[int]:
    """The canonical streams data-parallel rank r of D serves, in the order its share of a global batch has them."""
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
        """The shard list of epoch e, shuffled: the same on every rank and worker."""
        if e not in self._epochs:
            if len(self._epochs) >= 64:   # each stream's position is found epoch after epoch from 0: keep them all
                self._epochs.pop(next(iter(self._epochs)))   # up to 64 (lists of references), dropping the oldest
            order = list(self.shards)
            random.Random(f"{self.key}/{e}").shuffle(order)
            self._epochs[e] = order
        return self._epochs[e]

    def share(self, stream: int, e: int) -> list:
        """Stream c's shards of epoch e: the positions p with (e·N + p) mod C = c."""
        n = len(self.shards)
        return self.epoch(e)[(stream - e * n) % self.streams::self.streams]

    def groups(self, stream: int, e: int) -> list[list]:
        mine = self.share(stream, e)
        return [mine[j:j + self.mix] for j in range(0, len(mine), self.mix)]

    def seed(self, stream: int, e: int, j: int) -> str:
        return f"{self.key}/{e}/{stream}/{j}"

    def locate(self, stream: int, position: int, bad: frozenset = frozenset()) -> tuple[int, int, int]:
        """(epoch, group, samples to skip in it) of sample `position` of this source in `stream`, by the manifest's
        counts; shards in `bad` (found bad while reading) hold none."""
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
        """Endless {"names", "skip", "order_seed", "epoch"} of the groups stream c reads from sample `position` on."""
        e, first, skip = self.locate(stream, position, bad)
        while True:
            for j, group in enumerate(self.groups(stream, e)[first:], start=first):
                yield {"names": [name for name, _ in group], "skip": skip, "order_seed": self.seed(stream, e, j),
                       "epoch": e}
                skip = 0
            e, first = e + 1, 0


@dataclasses.dataclass
class Position:
    """Where a train stream is, the same on every rank: the samples of all global batches so far (N), each source's
    count among them, and each canonical stream's count of each source (where its reading of that source is)."""
    samples: int
    counts: list[int]
    streams: list[list[int]]

    def copy(self) -> "Position":
        return Position(self.samples, list(self.counts), [list(c) for c in self.streams])


class Blend:
    """How many samples of each source every canonical stream gives to each global batch, from the sources' weights
    (any positive numbers, used as proportions).

    The sources of a global batch: the next G of one sequence for the whole run, Tijdeman's rule (the chairman
    assignment problem, 1980): sample t (1-based) goes, among the sources with w·t − count ≥ δ = 1/(2m−2), to the
    one whose next sample is due first, (count + 1 − δ)/w; ties to the lower index. After every sample, so after every
    global batch, each source's count is within 1 − δ of w·N. Its state is the counts alone.
    Their split over the C streams (each gives G/C): every stream gets k // C of a source's k; the k mod C left over
    go to streams, sources with fewest left over first, each to the streams with the most room left (so that every
    stream gets exactly G/C: the greedy of the Gale–Ryser theorem) and, among those, the furthest behind w × its own
    samples on that source: each stream reads every source at about its rate (within a few samples), so each
    source's shards are read at one pace by every stream."""

    def __init__(self, weights: list[float], streams: int):
        total = float(sum(weights))
        self.w, self.C = [float(x) / total for x in weights], streams
        self.delta = 1.0 / (2 * len(self.w) - 2) if len(self.w) > 1 else 0.0

    def start(self) -> Position:
        return Position(0, [0] * len(self.w), [[0] * len(self.w) for _ in range(self.C)])

    def pick(self, t: int, counts: list[int]) -> int:
        """The source of sample t (1-based) of the run after `counts`."""
        due = [i for i, w in enumerate(self.w) if w * t - counts[i] >= self.delta - 1e-9] or range(len(self.w))
        return min(due, key=lambda i: ((counts[i] + 1 - self.delta) / self.w[i], i))

    def advance(self, pos: Position, global_batch: int) -> list[list[int]]:
        """The next global batch of G samples: [per stream, per source, its samples in it]; `pos` moves past it."""
        m, C, per = len(self.w), self.C, global_batch // self.C
        if m == 1:
            pos.samples, pos.counts[0] = pos.samples + global_batch, pos.counts[0] + global_batch
            for row in pos.streams:
                row[0] += per
            return [[per] for _ in range(C)]
        k, counts, due_from = [0] * m, pos.counts, self.delta - 1e-9
        for t in range(pos.samples + 1, pos.samples + global_batch + 1):   # pick(t, counts), the hot loop inlined
            s, first = -1, math.inf
            for i, w in enumerate(self.w):
                if w * t - counts[i] >= due_from and (counts[i] + 1 - self.delta) / w < first:
                    s, first = i, (counts[i] + 1 - self.delta) / w
            s = s if s >= 0 else self.pick(t, counts)
            counts[s] += 1
            k[s] += 1
        pos.samples += global_batch
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

    def position_at(self, step: int, global_batch: int) -> Position:
        """The position after `step` global batches of G from the start (one pass over them: a checkpoint without a
        data position)."""
        pos = self.start()
        if len(self.w) == 1:
            per = global_batch // self.C
            return Position(step * global_batch, [step * global_batch], [[step * per] for _ in range(self.C)])
        for _ in range(step):
            self.advance(pos, global_batch)
        return pos
