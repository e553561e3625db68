"""From one stream of token ids (documents joined by eos) to a shard set (tokendata/shards.py, format 2): the windows,
their train/val split and the manifest. tools/make_shards.py feeds it the ids it tokenizes; tools/import_tokens.py
the ids of a corpus tokenized elsewhere (tokendata/imports/). The same stream gives the same files either way.

    packer = Packer(out, seq_len, samples_per_shard, val_fraction, seed, dtype)
    packer.add(ids)     # any number of times: the next ids of the stream (any integer dtype)
    low, high = packer.add_documents(docs)   # or the next documents where they lie (tokendata/windows.py)
    packer.close()      # the last partial shards
    packer.finish(tok, tokenizer_source, inputs, input_description)   # tokenizer files, then manifest.json

Windows of seq_len+1 ids are taken with stride seq_len (consecutive samples share one boundary token, as in
Megatron's GPTDataset); each goes to val with probability val_fraction (a seeded coin flip per window, in stream
order: Python's random.Random(seed).random(), drawn by numpy a chunk at a time), else to train. Each window is copied
once, from where its documents lie straight into its shard's buffer (tokendata/windows.py).
"""
from __future__ import annotations

import os
import random

import numpy as np

from tokendata import tokenizer as tokenizers
from tokendata.shards import DTYPES, HASH, MANIFEST_FORMAT, SplitWriter, write_file, write_manifest
from tokendata.windows import Documents, fill


def coin(seed: int) -> np.random.RandomState:
    """Draws equal to random.Random(seed).random()'s, in order (both MT19937 with 53-bit doubles; numpy takes Python's
    seeded state), a chunk at a time: shard sets split by one Python draw a window stay the same."""
    state = random.Random(seed).getstate()[1]
    draws = np.random.RandomState()
    draws.set_state(("MT19937", np.array(state[:624], dtype=np.uint32), state[624]))
    return draws


def span(ids: np.ndarray) -> tuple[int, int]:
    return (int(ids.min()), int(ids.max())) if len(ids) else (0, 0)


class Packer:
    """Cuts the stream into windows and writes them to the train and val shards as they fill."""

    def __init__(self, out, seq_len, samples_per_shard, val_fraction, seed, dtype):
        self.out, self.seq_len, self.seed, self.val_fraction, self.dtype = out, seq_len, seed, val_fraction, dtype
        self.writers = {s: SplitWriter(out, s, samples_per_shard, dtype) for s in ("train", "val")}
        self.coin = coin(seed)   # one draw per sample: the split depends only on (stream, seed, seq_len)
        self.leftover = np.zeros(0, dtype=DTYPES[dtype][0])
        self.tokens = 0

    def add(self, ids: np.ndarray) -> None:
        """The next ids of the stream (any integer dtype)."""
        self.add_documents(Documents.of_stream(np.asarray(ids).astype(self.numpy_dtype, copy=False), 0))

    def add_documents(self, docs: Documents) -> tuple[int, int]:
        """The next documents' stream (ids as wide as the shards'), each window copied from where its ids lie into
        its shard; the smallest and largest id of that stream (as docs.dtype reads them; 0, 0 when it is empty)."""
        n, total, dtype = self.seq_len, docs.tokens, np.dtype(self.numpy_dtype)
        if docs.dtype.itemsize != dtype.itemsize:
            raise ValueError(f"documents of {docs.dtype} for shards of {dtype}: convert them first")
        self.tokens += total
        head = len(self.leftover)   # 1..n ids left from before (0 at the start): the first window begins with them
        if head + total < n + 1:
            tail = docs.ids(0, total)
            self.leftover = np.concatenate([self.leftover, tail.view(dtype)])
            return span(tail)
        # window 0 joins the leftover to the documents; window k ≥ 1 is the stream's [n - head + (k-1)·n, + n + 1)
        first = docs.ids(0, n + 1 - head)
        ranges = [span(first)]
        count = (total - (n - head) - 1) // n   # total - (n - head) >= 1: head + total > n
        val = self.coin.random_sample(count + 1) < self.val_fraction   # window 0 is `first`
        self.writers["val" if val[0] else "train"].write_block(np.concatenate([self.leftover, first.view(dtype)]), 1)
        # each split's windows, a shard's room at a time, each window copied once from where its ids lie
        at = n - head + n * np.arange(count, dtype=np.int64)   # window k + 1 starts at stream position at[k]
        row = (n + 1) * dtype.itemsize
        for split, positions in (("train", at[~val[1:]]), ("val", at[val[1:]])):
            writer = self.writers[split]
            while len(positions):
                take = min(len(positions), writer.room)
                ranges.append(fill(docs, positions[:take], n + 1, writer.reserve(take * row)))
                writer.commit(take, take * row)
                positions = positions[take:]
        rest = docs.ids(n - head + count * n, total)   # >= 1 id: the last window's end is the next window's start
        self.leftover = rest.view(dtype)
        ranges.append(span(rest))
        return min(r[0] for r in ranges), max(r[1] for r in ranges)

    @property
    def numpy_dtype(self) -> str:
        return DTYPES[self.dtype][0]

    def close(self) -> None:
        for w in self.writers.values():
            w.close()

    @property
    def dropped(self) -> int:
        return max(0, len(self.leftover) - 1)

    def finish(self, tok, tokenizer_source: str, inputs: list[str], described: dict) -> dict:
        """Copy the tokenizer's files and write manifest.json (last); return the manifest."""
        files = tokenizers.contents(tok)
        for name, data in files.items():
            write_file(self.out, name, data)
        name = next(iter(files))
        manifest = {
            "format": MANIFEST_FORMAT, "seq_len": self.seq_len, "vocab_size": tok.vocab_size(),
            "eos_id": tok.eos_id(), "tokenizer": name, "tokenizer_kind": tok.kind,
            "tokenizer_sha256": tokenizers.sha256(files[name]), "tokenizer_source": os.path.abspath(tokenizer_source),
            "dtype": self.dtype, "hash": HASH, "seed": self.seed, "val_fraction": self.val_fraction,
            "inputs": [os.path.abspath(p) for p in inputs], "input": described,
            "splits": {s: {"samples": w.samples, "tokens": w.samples * self.seq_len, "shards": w.shards}
                       for s, w in self.writers.items()},
        }
        write_manifest(self.out, manifest)
        return manifest
