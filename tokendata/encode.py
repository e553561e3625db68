"""Tokenizing a corpus into one stream of ids: the documents in order, eos after each, in batches of about
`batch_chars` characters, encoded by this process (workers=1) or by `workers` spawned processes. The batches come back
in the order they were read whatever the number of workers, so the stream, and every shard made from it, is the same
for any N. At most 2 × workers batches are in flight: memory stays bounded on any corpus. Workers are forked (spawned
where there is no fork).

    encoded(documents, tokenizer, workers=1, threads=1, batch_chars=1 << 21)
        -> iterator of (ids: int32 numpy array, documents, UTF-8 bytes of those documents)

`threads`: each encoding process's own threads (sentencepiece's num_threads; for a Hugging Face tokenizer, the size
of tokenizers' thread pool, RAYON_NUM_THREADS).
"""
from __future__ import annotations

import collections
import multiprocessing
import os

import numpy as np

_worker = {}   # the tokenizer of a worker process (set by _start)


def batches(documents, batch_chars: int):
    """Lists of consecutive documents of at least batch_chars characters (the last one may be shorter)."""
    batch, size = [], 0
    for doc in documents:
        batch.append(doc)
        size += len(doc)
        if size >= batch_chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def encode_batch(tokenizer, batch: list[str], threads: int):
    """(ids of the batch's documents with eos after each, as int32; documents; their UTF-8 bytes)."""
    eos, flat = tokenizer.eos_id(), []
    for ids in tokenizer.encode(batch, num_threads=threads):
        flat.extend(ids)
        flat.append(eos)
    return np.asarray(flat, dtype=np.int32), len(batch), sum(len(d.encode("utf-8")) for d in batch)


def _start(tokenizer, threads: int) -> None:
    os.environ.setdefault("RAYON_NUM_THREADS", str(threads))   # before tokenizers first uses its pool
    _worker.update(tokenizer=tokenizer, threads=threads)


def _encode(batch):
    return encode_batch(_worker["tokenizer"], batch, _worker["threads"])


def encoded(documents, tokenizer, workers: int = 1, threads: int = 1, batch_chars: int = 1 << 21):
    if workers <= 1:
        os.environ.setdefault("RAYON_NUM_THREADS", str(threads))
        for batch in batches(documents, batch_chars):
            yield encode_batch(tokenizer, batch, threads)
        return
    # fork where there is one (as DataLoader workers start): a spawned worker would import the command's whole
    # __main__ again (torch among it: seconds per worker); the pool starts before this process reads or encodes
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    with multiprocessing.get_context(method).Pool(workers, _start, (tokenizer, threads)) as pool:
        pending = collections.deque()
        for batch in batches(documents, batch_chars):
            pending.append(pool.apply_async(_encode, (batch,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
