"""Corpora tokenized elsewhere, read as they are (no detokenizing) for tools/import_tokens.py: each reader yields the
corpus as chunks of documents where they lie in the file's map (tokendata/windows.py's Documents: byte offsets,
lengths, and an eos flag on each document that does not end with eos), with the file they come from.

    megatron.py  Megatron-LM's (and GPT-NeoX's) <prefix>.bin + <prefix>.idx (MMIDIDX): a document is a document of the
                 index (one or more sequences)
    mds.py       MosaicML Streaming's MDS: index.json + shard.NNNNN.mds (uncompressed), one column of tokens; a
                 document is a sample
    npy.py       token arrays, .npy (with a header) or headerless (OLMo's: --dtype); documents are already separated
                 by eos, and a file's end ends one

`checked` (an array) and `in_vocab` (a range) reject an id the tokenizer does not have, naming the file; `eos_after`
flags the documents that need an eos.
"""
from __future__ import annotations

import numpy as np

from tokendata.remote import DataError

CHUNK_TOKENS = 1 << 24   # ids a reader hands on at a time (whole documents, or a piece of a longer one): nothing is
# copied per chunk, so it sets only how often progress is shown


def eos_after(last: np.ndarray, lengths: np.ndarray, eos: int) -> np.ndarray:
    """Which documents get an eos: those not empty whose last id (`last`, read where lengths > 0) is not eos."""
    return (lengths > 0) & (last != eos)


def checked(ids: np.ndarray, vocab_size: int, where: str) -> np.ndarray:
    """ids, or a one-line DataError naming `where` when one is negative or ≥ vocab_size."""
    if len(ids):
        # an unsigned type has no id below 0, and one whose largest value is below vocab_size none above: each
        # reduction skipped is a pass over the chunk saved
        low = 0 if ids.dtype.kind == "u" else int(ids.min())
        high = 0 if np.iinfo(ids.dtype).max < vocab_size else int(ids.max())
        in_vocab(low, high, vocab_size, where)
    return ids


def in_vocab(low: int, high: int, vocab_size: int, where: str) -> None:
    """A one-line DataError naming `where` when the ids' range [low, high] leaves the tokenizer's."""
    if high >= vocab_size or low < 0:
        bad = high if high >= vocab_size else low
        raise DataError(f"{where} holds token id {bad}, outside the tokenizer's {vocab_size} ids: was it "
                        "tokenized with another tokenizer? pass that one with --tokenizer (or the right --dtype)")


def read_exact(path: str, dtype, offset: int = 0, count: int = -1) -> np.ndarray:
    """A read-only memory map of `count` values of `dtype` at byte `offset` of `path` (-1: to the end)."""
    try:
        return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=None if count < 0 else (count,))
    except (OSError, ValueError) as e:
        raise DataError(f"cannot read {path}: {e}") from None
