"""The train order: which samples make global batch g, a function of the data settings and the seed alone, never of
the layout that reads them (data-parallel size, DataLoader workers, micro-batch size, accumulation). Pure arithmetic
on the manifests' shard lists and sample counts: nothing here opens a shard.

Picks. The run is one sequence of picks; global batch g is picks gG … gG + G − 1. Pick τ's source follows Tijdeman's
rule over the sources' weights w (`Blend`; m sources): after every pick each source's count is within 1 − 1/(2m−2)
< 1 of w·τ. A pick of source s is that source's draw t: its t-th pick of the run, from 0 (Megatron-LM's blended
dataset_sample_index).

Canonical streams (MosaicML Streaming's canonical nodes). A run has C of them (data.canonical_streams, 1 ≤ C ≤ G,
fixed when it starts). Draw t of a source belongs to stream a·t mod C, as that stream's draw j = t div C: each
stream takes one residue class of t, the draws of each source dealt round robin; a (`stride`) is coprime to C and
near C/φ, so a batch's consecutive draws of a source spread over the streams rather than crowd into an arc of them. A
global batch lists its picks stream by stream, each stream's in pick order (`layout`); data-parallel rank r of D
serves its positions [rG/D, (r+1)G/D) (`rank_slice`), for every D that divides G. So the G samples of global batch
g, in their order, are the same for every D, worker count and micro-batch. Stream c's band of a batch starts within
2m positions of c·G/C (m sources; tests/unit/test_order.py and tests/unit/test_order_scale.py hold it), so a rank reads the
streams of its positions, at most C/D + 2 + 4m·C/G of them (`rank_streams`), not all C.

Epochs, exact. Epoch e of a source (n samples in N shards) is its shard list shuffled with Random(f"{key}/{e}") (key:
the seed, and the source's name when it has one), read as one sequence of n slots, each shard's samples in file
order. Stream c's span of epoch e is the a_c(e) slots after the spans of streams 0 … c − 1, where
a_c(e) = #{t ∈ [e·n, (e+1)·n) : a·t ≡ c (mod C)} is exactly the number of its draws in that epoch. So draws
e·n … (e+1)·n − 1 of a source are each of its samples once: no sample of a source is drawn twice before every sample
of it has been drawn once, whether it has 1 shard, fewer shards than streams, or many. A stream reads its span in
windows of W = mix × ⌈n/N⌉ slots (about `mix` shards; data's mix_shards), each in the order Random(f"{key}/{e}/{c}/{k}")
shuffles it (window k): a shard is consecutive text, a window pools about mix of them. A stream's span is a
contiguous run of the epoch's shards, so each shard is read by one stream an epoch, two where it straddles spans.

Bad shards (found bad while reading, data.bad_shards=skip): the i-th slot of a window (in its order) that is in a
bad shard takes the window's i-th good slot, cyclically (a window of bad shards alone: the first good shard after it
in the epoch). Those samples are read twice in the epoch (more only where a window holds more bad slots than good);
no other draw moves, so the batches depend on which shards are bad, not on which rank found them or when.

Stages (data.stages, `Staged`): from a stage's first pick on, Tijdeman's rule runs over that stage's weights, counted
from the stage's start; draws (so epochs) of each source carry on across the boundary.

Stage lengths (data.seq_len, data.stages[i].seq_len; tokendata/lengths.py `StageLengths`) are no part of the order: its
picks are samples of the model's length M in every stage, and a stage of L < M trains each as M/L rows of L, so the
picks, draws, epochs and positions are those of a run without them.

Batch ramps (train.batch_ramp, tokendata/ramp.py): step s's global batch is picks P_s … P_s + G_s − 1 instead, laid
out as above with G_s for G; the picks, and so the samples, are those of a run without the ramp.

A position (`Position`) is the picks so far and each source's count: the same on every rank.
"""
from __future__ import annotations

import bisect
import dataclasses
import math
import random

import numpy as np

from tokendata.shards import DataError

DEFAULT_STREAMS = 64   # data.canonical_streams=null: min(64, G) (docs/data.md: the trade-off)


def default_streams(global_batch: int) -> int:
    """data.canonical_streams when the config leaves it null: 64, or the global batch where it is smaller."""
    return min(DEFAULT_STREAMS, global_batch)


def check_streams(streams: int, global_batch: int, key: str = "data.canonical_streams") -> None:
    """One-line DataError unless C streams can make global batches of G samples (1 ≤ C ≤ G)."""
    if not 1 <= streams <= global_batch:
        raise DataError(f"{key}={streams} must be between 1 and train.global_batch_size={global_batch} (each stream "
                        f"gives about G/C samples to every global batch): set {key}=null (min(64, G)) or a number "
                        f"≤ {global_batch}")


def stride(streams: int) -> int:
    """a: the integer nearest C/φ that is coprime to C (1 for C ≤ 2). t ↦ a·t mod C is a bijection of the residues
    that sends consecutive draws about 0.618·C streams apart, a low-discrepancy (Kronecker) spread."""
    if streams <= 2:
        return 1
    target = streams * 2 / (1 + 5 ** 0.5)
    return min((a for a in range(1, streams) if math.gcd(a, streams) == 1), key=lambda a: (abs(a - target), a))


def rank_slice(global_batch: int, dp_rank: int, dp_world: int) -> tuple[int, int]:
    """The positions [lo, hi) of every global batch that data-parallel rank r of D trains on."""
    per = global_batch // dp_world
    return dp_rank * per, (dp_rank + 1) * per


def reachable(global_batch: int) -> list[int]:
    """The data-parallel sizes this order can use: every divisor of the global batch."""
    return [d for d in range(1, global_batch + 1) if global_batch % d == 0]


@dataclasses.dataclass
class Position:
    """Where a train stream is, the same on every rank: the picks of all global batches so far, and each source's
    count among them (its next draw)."""
    samples: int
    counts: list[int]

    def copy(self) -> "Position":
        return Position(self.samples, list(self.counts))


class Blend:
    """The source of every pick, from the sources' weights (any positive numbers, used as proportions): Tijdeman's rule
    (the chairman assignment problem, 1980): pick t (1-based) goes, among the sources with w·t − count ≥ δ = 1/(2m−2),
    to the one whose next sample is due first, (count + 1 − δ)/w; ties to the lower index. After every pick each
    source's count is within 1 − δ of w·t. Its state is the counts alone."""

    def __init__(self, weights: list[float]):
        total = float(sum(weights))
        self.w = [float(x) / total for x in weights]
        self.delta = 1.0 / (2 * len(self.w) - 2) if len(self.w) > 1 else 0.0

    def start(self) -> Position:
        return Position(0, [0] * len(self.w))

    def pick(self, t: int, counts: list[int]) -> int:
        """The source of pick t (1-based) of the run after `counts`."""
        due = [i for i, w in enumerate(self.w) if w * t - counts[i] >= self.delta - 1e-9] or range(len(self.w))
        return min(due, key=lambda i: ((counts[i] + 1 - self.delta) / self.w[i], i))

    def picks(self, pos: Position, n: int) -> list[int]:
        """The sources of the next n picks; `pos` moves past them."""
        if len(self.w) == 1:
            pos.samples, pos.counts[0] = pos.samples + n, pos.counts[0] + n
            return [0] * n
        out, counts, due_from = [], pos.counts, self.delta - 1e-9
        for t in range(pos.samples + 1, pos.samples + n + 1):   # pick(t, counts), the hot loop inlined
            s, first = -1, math.inf
            for i, w in enumerate(self.w):
                if w * t - counts[i] >= due_from and (counts[i] + 1 - self.delta) / w < first:
                    s, first = i, (counts[i] + 1 - self.delta) / w
            s = s if s >= 0 else self.pick(t, counts)
            counts[s] += 1
            out.append(s)
        pos.samples += n
        return out

    def position_at(self, step: int, global_batch: int) -> Position:
        """The position after `step` global batches of G from the start (one pass over them: a checkpoint without a
        data position)."""
        pos = self.start()
        if len(self.w) == 1:
            return Position(step * global_batch, [step * global_batch])
        for _ in range(step):
            self.picks(pos, global_batch)
        return pos


class Staged(Blend):
    """Data stages (data.stages): the picks from sample `starts[k]` on follow Tijdeman's rule over stage k's weights,
    counted from that stage's start over its sources of weight > 0 (its own pick index and counts, so each stage's
    counts stay within 1 of its weights × its picks), while each source's draw number, hence its epoch, carries on
    across the boundary: a source is not restarted. Stage 0 (the sources' own weights) starts at 0. The counts at a stage's start are a function of
    the settings alone (one pass over the earlier stages' picks, kept once computed)."""

    def __init__(self, weights: list[float], stages: list[tuple[int, list[float]]]):
        super().__init__(weights)
        self.starts = [0] + [start for start, _ in stages]
        every = [list(weights)] + [list(w) for _, w in stages]
        self.used = [[i for i, x in enumerate(w) if x > 0] for w in every]   # a stage's sources of weight > 0
        self.blends = [Blend([w[i] for i in used]) for w, used in zip(every, self.used)]
        self._base = [[0] * len(weights)]   # each stage's counts at its start, as far as computed

    def base(self, k: int) -> list[int]:
        while len(self._base) <= k:
            i = len(self._base) - 1
            inner = self.blends[i].position_at(1, self.starts[i + 1] - self.starts[i])   # one pass of its picks
            base = list(self._base[i])
            for i_used, c in zip(self.used[i], inner.counts):
                base[i_used] += c
            self._base.append(base)
        return self._base[k]

    def picks(self, pos: Position, n: int) -> list[int]:
        out = []
        while n > 0:
            k = bisect.bisect_right(self.starts, pos.samples) - 1
            take = n if k + 1 == len(self.starts) else min(n, self.starts[k + 1] - pos.samples)
            base, used = self.base(k), self.used[k]
            inner = Position(pos.samples - self.starts[k], [pos.counts[i] - base[i] for i in used])
            out += [used[s] for s in self.blends[k].picks(inner, take)]
            for i, c in zip(used, inner.counts):
                pos.counts[i] = base[i] + c
            pos.samples, n = pos.samples + take, n - take
        return out

    def position_at(self, step: int, global_batch: int) -> Position:
        k = bisect.bisect_right(self.starts, step * global_batch) - 1
        pos = Position(self.starts[k], list(self.base(k)))
        self.picks(pos, step * global_batch - self.starts[k])
        return pos


def blend_of(weights: list[float], stages=()) -> Blend:
    """The run's picks: a `Blend` of the weights, or `Staged` where stages [(first sample, weights)] are given or a
    source has weight 0 (it joins in a later stage)."""
    return Staged(weights, list(stages)) if stages or 0 in weights else Blend(weights)


@dataclasses.dataclass
class Layout:
    """One global batch, position by position: the source, stream and the stream's draw of each."""
    sources: np.ndarray   # (G,) int
    streams: np.ndarray   # (G,) int
    draws: np.ndarray     # (G,) int: j, the stream's draw of that source (t = j·C + stream)


def layout(blend: Blend, pos: Position, global_batch: int, streams: int) -> Layout:
    """The next global batch; `pos` moves past it."""
    before = list(pos.counts)
    src = np.asarray(blend.picks(pos, global_batch), dtype=np.int64)   # (G,) in pick order
    t = np.empty(global_batch, dtype=np.int64)                         # each pick's draw of its source
    for s, first in enumerate(before):
        mine = src == s
        t[mine] = first + np.arange(int(mine.sum()))
    stream = stride(streams) * t % streams
    order = np.argsort(stream, kind="stable")                          # stream by stream, pick order within
    return Layout(src[order], stream[order], (t // streams)[order])


def rank_streams(lay: Layout, lo: int, hi: int) -> list[int]:
    """The streams a rank's positions [lo, hi) of one global batch take samples of."""
    return sorted(set(lay.streams[lo:hi].tolist()))


class Recent(dict):
    """A dict that keeps the `size` entries set last (a small per-object LRU; functools.lru_cache on a method would
    share one cache among every object)."""

    def __init__(self, size: int):
        super().__init__()
        self.size = size

    def get_or(self, key, make):
        if key in self:
            self[key] = self.pop(key)   # now the newest
        else:
            self[key] = make()
            while len(self) > self.size:
                del self[next(iter(self))]
        return self[key]


class SourceOrder:
    """One source's samples dealt to C canonical streams, epoch after epoch (the module docstring). `shards`:
    [(name, samples)] sorted by name; `key`: the seed string of its shuffles; `mix`: shards a window pools."""

    def __init__(self, shards: list, key: str, streams: int, mix: int):
        if not shards:
            raise DataError(f"no train shards to read (key {key})")
        self.shards, self.key, self.streams = list(shards), key, streams
        self.n = sum(count for _, count in self.shards)
        self.window = mix * -(-self.n // len(self.shards))   # W: mix shards of the mean size
        a = stride(streams)
        self.residue = [pow(a, -1, streams) * c % streams for c in range(streams)]   # stream c takes t ≡ r_c (mod C)
        self._epochs = Recent(4)   # streams are within one draw of each other: two epochs at most are read at once
        self._windows = Recent(2 * streams + 8)   # each stream's window and the one it fetches ahead

    def epoch(self, e: int) -> tuple[list, list, list]:
        """Epoch e: (its shard names in order, the first slot of each and n, the first slot of each stream's span
        and n)."""
        return self._epochs.get_or(e, lambda: self._epoch(e))

    def _epoch(self, e):
        order = list(self.shards)
        random.Random(f"{self.key}/{e}").shuffle(order)
        starts = np.cumsum([0] + [count for _, count in order]).tolist()
        phase, spans = e * self.n % self.streams, [0]
        for c in range(self.streams):   # a_c(e): the slots u < n with e·n + u ≡ r_c (mod C)
            r = (self.residue[c] - phase) % self.streams
            spans.append(spans[-1] + (-(-(self.n - r) // self.streams) if r < self.n else 0))
        return [name for name, _ in order], starts, spans

    def before(self, stream: int, e: int) -> int:
        """Stream c's draws of this source before epoch e: #{t < e·n : t ≡ r_c (mod C)}."""
        return max(0, -(-(e * self.n - self.residue[stream]) // self.streams))

    def where(self, stream: int, j: int) -> tuple[int, int, int]:
        """(epoch, window, place in the window's order) of stream c's draw j: t = j·C + r_c."""
        e = (j * self.streams + self.residue[stream]) // self.n
        k, p = divmod(j - self.before(stream, e), self.window)
        return e, k, p

    def window_slots(self, stream: int, e: int, k: int) -> np.ndarray:
        """The epoch slots of window k of stream c's span, in the order it reads them."""
        def make():
            spans = self.epoch(e)[2]
            first = spans[stream] + k * self.window
            slots = list(range(first, min(first + self.window, spans[stream + 1])))
            random.Random(f"{self.key}/{e}/{stream}/{k}").shuffle(slots)
            return np.asarray(slots, dtype=np.int64)
        return self._windows.get_or((stream, e, k), make)

    def slot(self, e: int, u: int) -> tuple[str, int]:
        """(shard name, sample index in it) of slot u of epoch e."""
        names, starts, _ = self.epoch(e)
        i = bisect.bisect_right(starts, u) - 1
        return names[i], u - starts[i]

    def window_shards(self, stream: int, e: int, k: int) -> list[str]:
        """The shards window k of stream c's span reads, in epoch order (none past the span's end)."""
        names, starts, spans = self.epoch(e)
        first = spans[stream] + k * self.window
        last = min(first + self.window, spans[stream + 1]) - 1
        if last < first:
            return []
        return names[bisect.bisect_right(starts, first) - 1:bisect.bisect_right(starts, last)]

    def draw(self, stream: int, j: int, is_bad=lambda name: False) -> tuple[str, int]:
        """(shard name, sample index in it) of stream c's draw j; `is_bad(name)`: whether a shard is bad (asked of
        the window's shards only where the draw's own is). The module docstring: the i-th bad slot of a window, in
        its order, takes the window's i-th good one (cyclically); in a window of bad shards alone, the draw takes
        the first good shard after it in the epoch's order."""
        e, k, p = self.where(stream, j)
        slots = self.window_slots(stream, e, k)
        name, index = self.slot(e, int(slots[p]))
        if not is_bad(name):
            return name, index
        placed = [self.slot(e, int(u)) for u in slots]
        good = [q for q, (shard, _) in enumerate(placed) if not is_bad(shard)]
        if good:
            return placed[good[sum(is_bad(shard) for shard, _ in placed[:p]) % len(good)]]
        names, starts, _ = self.epoch(e)
        after = names.index(placed[-1][0]) + 1
        for i in list(range(after, len(names))) + list(range(after)):
            if not is_bad(names[i]):
                return names[i], p % (starts[i + 1] - starts[i])
        raise DataError(f"every train shard of {self.key} was found bad")
