"""Megatron-LM's indexed dataset (also GPT-NeoX's): <prefix>.idx and <prefix>.bin, as megatron-core's
IndexedDatasetBuilder writes them (megatron/core/datasets/indexed_dataset.py).

    .idx  b"MMIDIDX\\x00\\x00", version <Q (1), dtype code <B, sequence count S <Q, document count D+1 <Q, then
          sequence lengths int32[S], sequence byte pointers int64[S], document indices int64[D+1] (the first sequence
          of each document, then S)
    .bin  the sequences' ids back to back
"""
from __future__ import annotations

import os
import struct

import numpy as np

from tokendata.imports import CHUNK_TOKENS, eos_after, read_exact
from tokendata.remote import DataError
from tokendata.windows import Documents

MAGIC = b"MMIDIDX\x00\x00"
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}


def prefix_of(path: str) -> str:
    return path[:-4] if path.endswith((".bin", ".idx")) else path


def index(prefix: str):
    """(dtype, sequence lengths, sequence pointers, document indices) of <prefix>.idx."""
    path = prefix + ".idx"
    if not os.path.isfile(path) or not os.path.isfile(prefix + ".bin"):
        raise DataError(f"{prefix}: no {prefix}.idx and {prefix}.bin (a Megatron dataset is given by its prefix, "
                        "or either file)")
    with open(path, "rb") as f:
        head = f.read(len(MAGIC) + 8 + 1 + 8 + 8)
    if len(head) < 34 or head[:len(MAGIC)] != MAGIC:
        raise DataError(f"{path} is not a Megatron index (no MMIDIDX header): give a .idx written by Megatron's "
                        "preprocess_data.py or IndexedDatasetBuilder")
    version, code, sequences, documents = struct.unpack("<QBQQ", head[len(MAGIC):])
    if version != 1 or code not in DTYPES or DTYPES[code] in (np.float32, np.float64):
        raise DataError(f"{path}: version {version}, dtype code {code}: only version 1 with integer ids is read")
    lengths = read_exact(path, np.int32, 34, sequences)
    pointers = read_exact(path, np.int64, 34 + 4 * sequences, sequences)
    docs = read_exact(path, np.int64, 34 + 12 * sequences, documents)
    return np.dtype(DTYPES[code]), lengths, pointers, docs


def chunks(path: str, eos: int):
    """(Documents, where) of the dataset at `path` in order, about CHUNK_TOKENS ids at a time (whole documents)."""
    prefix = prefix_of(path)
    dtype, lengths, pointers, docs = index(prefix)
    bin_path = prefix + ".bin"
    ids = read_exact(bin_path, dtype)
    starts = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])   # in ids, were the sequences back to back
    if len(pointers) and not np.array_equal(pointers, starts[:-1] * dtype.itemsize):
        raise DataError(f"{bin_path}: its sequences are not stored back to back as its .idx says; rewrite it with "
                        "Megatron's tools/merge_datasets.py")
    if starts[-1] > len(ids):
        raise DataError(f"{bin_path} holds {len(ids)} ids but {prefix}.idx says {starts[-1]} (truncated?)")
    ends = starts[docs[1:]]   # one past each document's last id
    begins = np.concatenate([[0], ends[:-1]]).astype(np.int64)
    sizes = ends - begins
    eos_flags = eos_after(ids[np.maximum(ends - 1, 0)], sizes, eos)
    src = ids.view(np.uint8)
    cuts = np.searchsorted(ends, np.arange(CHUNK_TOKENS, int(starts[-1]), CHUNK_TOKENS), side="left")
    for lo, hi in zip([0, *cuts.tolist()], [*cuts.tolist(), len(ends)]):
        if hi > lo:
            yield Documents(src, begins[lo:hi] * dtype.itemsize, sizes[lo:hi], eos_flags[lo:hi], dtype, eos), bin_path
