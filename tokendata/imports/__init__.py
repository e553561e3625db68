"""Corpora tokenized elsewhere, read as they are (no detokenizing) for tools/import_tokens.py: each reader yields the
corpus as chunks of a stream of token ids (a numpy array) and the end of every document in the chunk.

    megatron.py  Megatron-LM's (and GPT-NeoX's) <prefix>.bin + <prefix>.idx (MMIDIDX): a document is a document of the
                 index (one or more sequences)
    mds.py       MosaicML Streaming's MDS: index.json + shard.NNNNN.mds (uncompressed), one column of tokens; a
                 document is a sample
    npy.py       token arrays, .npy (with a header) or headerless (OLMo's: --dtype); documents are already separated
                 by eos, and a file's end ends one

`joined(chunks, eos)` puts eos after each document that does not end with one; `checked` rejects an id the tokenizer
does not have, naming the file.
"""
from __future__ import annotations

import numpy as np

from tokendata.remote import DataError

CHUNK_TOKENS = 1 << 21   # ids a reader hands on at a time: bounded memory, enough to amortize the Python, and
# buffers small enough (below glibc's largest mmap threshold) to be reused rather than mapped and faulted in anew


def with_eos(ids: np.ndarray, ends: np.ndarray, eos: int, dtype=None) -> np.ndarray:
    """ids (as `dtype`, default theirs) with eos inserted after each document end in `ends` (positions one past a
    document's last id, ascending) where that document does not end with eos already; an empty document gets none."""
    ends = np.unique(ends[ends > 0])
    missing = ends[ids[ends - 1] != eos].tolist()
    if not missing:   # nothing to insert: the caller's copy (the packer's) is the only one
        return ids.astype(dtype or ids.dtype, copy=False)
    ids = np.ascontiguousarray(ids.astype(dtype or ids.dtype, copy=False))
    # one join of byte slices, an eos between them: one copy at memory speed, where np.insert gathers id by id and
    # a numpy slice assignment a document costs microseconds each
    view, width, eos_bytes = memoryview(ids).cast("B"), ids.itemsize, np.asarray(eos, ids.dtype).tobytes()
    pieces, at = [], 0
    for end in missing:
        pieces += (view[at * width:end * width], eos_bytes)
        at = end
    pieces.append(view[at * width:])
    return np.frombuffer(b"".join(pieces), ids.dtype)


def checked(ids: np.ndarray, vocab_size: int, where: str) -> np.ndarray:
    """ids, or a one-line DataError naming `where` when one is negative or ≥ vocab_size."""
    if len(ids):
        high, low = int(ids.max()), int(ids.min())
        if high >= vocab_size or low < 0:
            bad = high if high >= vocab_size else low
            raise DataError(f"{where} holds token id {bad}, outside the tokenizer's {vocab_size} ids: was it "
                            "tokenized with another tokenizer? pass that one with --tokenizer (or the right --dtype)")
    return ids


def read_exact(path: str, dtype, offset: int = 0, count: int = -1) -> np.ndarray:
    """A read-only memory map of `count` values of `dtype` at byte `offset` of `path` (-1: to the end)."""
    try:
        return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=None if count < 0 else (count,))
    except (OSError, ValueError) as e:
        raise DataError(f"cannot read {path}: {e}") from None
