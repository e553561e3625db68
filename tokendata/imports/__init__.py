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
    ends = ends[ends > 0]
    if len(ends) > 1 and np.any(ends[1:] <= ends[:-1]):
        ends = np.unique(ends)
    missing = ends[ids[ends - 1] != eos]
    if not len(missing):   # nothing to insert: the caller's copy (the packer's) is the only one
        return ids.astype(dtype or ids.dtype, copy=False)
    ids = np.ascontiguousarray(ids.astype(dtype or ids.dtype, copy=False))
    # one join of byte slices, an eos between them: one copy at memory speed, where np.insert gathers id by id and
    # a numpy slice assignment a document costs microseconds each
    view, width, eos_bytes = memoryview(ids).cast("B"), ids.itemsize, np.asarray(eos, ids.dtype).tobytes()
    cuts = (np.concatenate([[0], missing, [len(ids)]]) * width).tolist()
    return np.frombuffer(b"".join(interleaved([view[a:b] for a, b in zip(cuts[:-1], cuts[1:])], eos_bytes)),
                         ids.dtype)


def interleaved(pieces: list, sep: bytes, keep=None) -> list:
    """pieces with `sep` after each but the last (after each piece i where keep[i] is False, none): built by list
    slicing rather than a Python loop, which costs as much as the join itself at a million documents."""
    out = [sep] * (2 * len(pieces) - 1) if pieces else []
    out[::2] = pieces
    if keep is not None:
        for i in np.flatnonzero(~keep[:len(pieces) - 1]).tolist():
            out[2 * i + 1] = b""
    return out


def checked(ids: np.ndarray, vocab_size: int, where: str) -> np.ndarray:
    """ids, or a one-line DataError naming `where` when one is negative or ≥ vocab_size."""
    if len(ids):
        # an unsigned type has no id below 0, and one whose largest value is below vocab_size none above: each
        # reduction skipped is a pass over the chunk saved
        low = 0 if ids.dtype.kind == "u" else int(ids.min())
        high = 0 if np.iinfo(ids.dtype).max < vocab_size else int(ids.max())
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
