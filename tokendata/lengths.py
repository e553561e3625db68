"""A shard set's length and the model's, apart: shards written at n tokens a sample train a model of L positions
for any L that divides n or that n divides. The samples are cut or joined when read, and the train order
(tokendata/order.py) is defined on the model's samples, so the exact order, its resume and its relayout hold as at
L = n.

A file sample holds n + 1 ids, a window [i·n, i·n + n + 1) of the tokenized stream: consecutive samples of a shard
share one boundary id (tools/make_shards.py). A model sample holds L + 1 ids.

    cut, k = n / L   model sample m of a shard is ids [(m mod k)·L, (m mod k)·L + L + 1) of its file sample m div k:
                     each file sample gives k model samples, the stream's windows of L + 1, none lost, none doubled.
                     Its id: "<file sample id>/<m mod k>of<k>".
    join, k = L / n  model sample m of a shard is its file samples mk … mk + k − 1 joined, each one's boundary id
                     dropped but the last's: kn + 1 = L + 1 ids, consecutive text where the k windows were
                     consecutive in the stream (make_shards sends each window to train or val by a coin flip, so a
                     join of train samples spans a gap with probability ≈ (k − 1)·val_fraction, and joined val
                     samples are windows far apart: evaluate long contexts on shards written at that length). A
                     shard's last (count mod k) file samples, too few to join, are not read. Its id: "<first file
                     sample id>+<k>".
    L = n            the file samples themselves, read as before (the same bytes, the same ids).

Where neither divides the other, or no shard holds k samples to join, `fit` is a one-line DataError naming the
lengths and model.max_seq_len.

A data stage of its own length L' < L (data.seq_len, data.stages[i].seq_len; `StageLengths`) changes none of this: the
order's samples stay those of L, and a batch of that stage is `rows` of them, each sample of L as L/L' rows of L' + 1
ids, row p its ids [pL', pL' + L' + 1), id "<sample id>/<p>of<L/L'>" (a cut of the model's sample, as above).
"""
from __future__ import annotations

import bisect
import dataclasses

import numpy as np

from tokendata.shards import MAKE, need

KEY = "model.max_seq_len"


@dataclasses.dataclass(frozen=True)
class Lengths:
    """Shards of n tokens a sample read as samples of L."""
    n: int
    L: int

    @property
    def cut(self) -> int:
        """k where each file sample is cut into k model samples (1 otherwise)."""
        return self.n // self.L if self.n % self.L == 0 else 1

    @property
    def join(self) -> int:
        """k where k file samples are joined into one model sample (1 otherwise)."""
        return self.L // self.n if self.L % self.n == 0 else 1

    def samples(self, count: int) -> int:
        """The model samples of a shard of `count` file samples."""
        return count * self.cut // self.join

    def pieces(self, m: int) -> list[tuple[int, int, int]]:
        """Model sample m of a shard as (file sample, first id, end id) pieces, in order: its ids are those ranges of
        those file samples, back to back."""
        if self.cut > 1:
            first = m % self.cut * self.L
            return [(m // self.cut, first, first + self.L + 1)]
        k = self.join
        return [(m * k + i, 0, self.n + (i == k - 1)) for i in range(k)]

    def key(self, m: int, keys: list[str]) -> str:
        """The id of model sample m from the ids of its file samples (`pieces` order)."""
        if self.cut > 1:
            return f"{keys[0]}/{m % self.cut}of{self.cut}"
        return keys[0] if self.join == 1 else f"{keys[0]}+{self.join}"

    def regroup(self, samples: list[dict], member: str, itemsize: int) -> list[dict]:
        """One shard's file samples ({"__key__", member: bytes, ...}, all of them, in file order) as its model
        samples, each with the other fields of its first file sample."""
        if self.cut == 1 and self.join == 1:
            return samples
        out = []
        for m in range(self.samples(len(samples))):
            parts = self.pieces(m)
            data = b"".join(samples[f][member][a * itemsize:b * itemsize] for f, a, b in parts)
            out.append(dict(samples[parts[0][0]], __key__=self.key(m, [samples[f]["__key__"] for f, _, _ in parts]),
                            **{member: data}))
        return out


def fit(manifest: dict, max_seq_len: int) -> Lengths:
    """The Lengths of a shard set read by a model of max_seq_len positions; a one-line DataError where neither length
    divides the other."""
    n, L = manifest["seq_len"], max_seq_len
    need(n % L == 0 or L % n == 0,
         f"shards in {manifest['shard_dir']} hold samples of {n} tokens and {KEY}={L}: neither divides the other "
         f"(samples are cut or joined when read); set {KEY} to a divisor or a multiple of {n}, or rebuild the "
         f"shards with {MAKE} --seq-len {L}")
    lengths = Lengths(n, L)
    most = max((s["samples"] for s in manifest["splits"]["train"]["shards"]), default=0)
    need(lengths.samples(most), f"shards in {manifest['shard_dir']} hold at most {most} samples of {n} tokens, too few "
                                f"to join {lengths.join} into one of {KEY}={L} (samples are joined within a shard): "
                                f"rebuild them with {MAKE} --samples-per-shard ≥ {lengths.join}, or --seq-len {L}")
    return lengths


class StageLengths:
    """The length each global batch trains at (data.seq_len, data.stages[i].seq_len): L_k from pick `starts[k]` of
    the run on, each a divisor of the order's length M (model.max_seq_len). The order, its positions and every
    source's draws and epochs are those of samples of M, whatever the stages' lengths: a batch of stage k holds the
    same M-samples as at M, each cut into M/L_k rows of L_k (`rows`), so no token is trained twice or skipped at a
    change of length, and the global batch keeps its tokens (G·M a step)."""

    def __init__(self, M: int, stages: list[tuple[int, int]]):
        self.M, self.starts, self.lengths = M, [0], [M]   # [(first pick, L)]: pick 0's L replaces M
        for first, L in stages:
            need(L >= 1 and M % L == 0, f"a data stage's seq_len={L} must divide model.max_seq_len={M} (each sample "
                                        f"of {M} is cut into rows of seq_len)")
            if first == self.starts[-1]:
                self.lengths[-1] = L
            else:
                self.starts.append(first)
                self.lengths.append(L)

    def at(self, samples: int) -> int:
        """L of the global batch that begins after `samples` picks of the run."""
        return self.lengths[bisect.bisect_right(self.starts, samples) - 1]


def rows(batch: dict, L: int) -> dict:
    """A batch of samples of M + 1 ids ({"tokens": (B, M + 1), "ids": [B ids], ...}) as rows of L + 1: sample i's
    rows i·q … i·q + q − 1 (q = M/L) are its ids [pL, pL + L + 1), p = 0 … q − 1 (consecutive rows share one
    boundary id, as in a cut), their ids "<id>/<p>of<q>"."""
    tokens, q = batch["tokens"], (batch["tokens"].shape[1] - 1) // L
    if q == 1:
        return batch
    windows = np.arange(q)[:, None] * L + np.arange(L + 1)[None, :]   # (q, L + 1) positions in a sample
    return dict(batch, tokens=tokens[:, windows].reshape(-1, L + 1),
                ids=[f"{key}/{p}of{q}" for key in batch["ids"] for p in range(q)])
