"""From one stream of token ids (documents joined by eos) to a shard set (tokendata/shards.py, format 2): the windows,
their train/val split and the manifest. tools/make_shards.py feeds it the ids it tokenizes; tools/import_tokens.py
the ids of a corpus tokenized elsewhere (tokendata/imports/). The same stream gives the same files either way.

    packer = Packer(out, seq_len, samples_per_shard, val_fraction, seed, dtype)
    packer.add(ids)     # any number of times: the next ids of the stream (any integer dtype)
    packer.close()      # the last partial shards
    packer.finish(tok, tokenizer_source, inputs, input_description)   # tokenizer files, then manifest.json

Windows of seq_len+1 ids are taken with stride seq_len (consecutive samples share one boundary token, as in
Megatron's GPTDataset); each goes to val with probability val_fraction (a seeded coin flip per window, in stream
order), else to train.
"""
from __future__ import annotations

import os
import random

import numpy as np

from tokendata import tokenizer as tokenizers
from tokendata.shards import DTYPES, HASH, MANIFEST_FORMAT, SplitWriter, write_file, write_manifest


class Packer:
    """Cuts the stream into windows and writes them to the train and val shards as they fill."""

    def __init__(self, out, seq_len, samples_per_shard, val_fraction, seed, dtype):
        self.out, self.seq_len, self.seed, self.val_fraction, self.dtype = out, seq_len, seed, val_fraction, dtype
        self.writers = {s: SplitWriter(out, s, samples_per_shard, dtype) for s in ("train", "val")}
        self.coin = random.Random(seed)   # one draw per sample: the split depends only on (stream, seed, seq_len)
        self.leftover = np.zeros(0, dtype=DTYPES[dtype][0])
        self.tokens = 0

    def add(self, ids: np.ndarray) -> None:
        n = self.seq_len
        self.tokens += len(ids)
        ids = np.asarray(ids).astype(DTYPES[self.dtype][0], copy=False)
        head = len(self.leftover)   # 1..n ids left from before (0 at the start): the first window begins with them
        if head + len(ids) < n + 1:
            self.leftover = np.concatenate([self.leftover, ids])
            return
        # window 0 joins the leftover to the chunk; every later one lies inside `ids`, from n - head on, and is read
        # through an overlapping view (no copy), so a run of windows bound for one shard is copied once, by the writer
        first = np.concatenate([self.leftover, ids[:n + 1 - head]])[None, :]
        rest = ids[n - head:]
        count = (len(rest) - 1) // n   # len(rest) >= 1: head + len(ids) > n
        rest_windows = np.lib.stride_tricks.as_strided(rest, (count, n + 1), (n * rest.itemsize, rest.itemsize),
                                                       writeable=False)
        coin, fraction = self.coin.random, self.val_fraction
        val = np.array([coin() < fraction for _ in range(count + 1)], dtype=bool)   # window 0 is `first`
        self.writers["val" if val[0] else "train"].write_block(first, 1)
        # runs of windows bound for one split, found at once; each run goes to its writer a shard's room at a time
        bounds = np.flatnonzero(np.diff(val[1:].view(np.int8))) + 1
        for lo, hi in zip([0, *bounds.tolist()], [*bounds.tolist(), count]) if count else ():
            writer = self.writers["val" if val[lo + 1] else "train"]
            while lo < hi:
                take = min(hi - lo, writer.room)
                writer.write_block(rest_windows[lo:lo + take], take)
                lo += take
        self.leftover = rest[count * n:].copy()   # >= 1 token: the last window's end is the next window's start

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
