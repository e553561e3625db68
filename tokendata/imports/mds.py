"""MosaicML Streaming's MDS, read from its published layout (mosaicml/streaming, streaming/base/format/mds): the
library itself needs torchvision and more beside the pinned torch (tests/data/mds/README.md).

    index.json        {"shards": [{"format": "mds", "version": 2, "column_names", "column_encodings",
                       "column_sizes" (null: variable size), "compression": null, "raw_data": {"basename"},
                       "samples"}, ...]}
    shard.NNNNN.mds   uint32 sample count n, uint32 offsets[n + 1] (byte offsets of the samples in the file), then
                      each sample: a uint32 size for each variable-size column, then the columns' bytes in order

The column of tokens (--mds-column, default "tokens", else "input_ids") is an "ndarray[:dtype[:shape]]" (a dynamic
dtype is one byte before the values, a dynamic shape one byte ndim<<2 | shape-dtype code then the shape) or "bytes"
of raw ids (--dtype; llm-foundry's concatenated sets). Each sample is one document.
"""
from __future__ import annotations

import json
import os

import numpy as np

from tokendata.imports import CHUNK_TOKENS, read_exact
from tokendata.remote import DataError

VALUE_DTYPES = {8: "uint8", 9: "int8", 16: "uint16", 17: "int16", 32: "uint32", 33: "int32", 64: "uint64",
                65: "int64"}
COLUMNS = ("tokens", "input_ids")


def shards(folder: str) -> list[dict]:
    path = os.path.join(folder, "index.json")
    try:
        with open(path) as f:
            found = json.load(f)["shards"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{path}: not an MDS index ({type(e).__name__}: {e}): give a folder MDSWriter wrote") from None
    for s in found:
        if s.get("format") != "mds" or s.get("compression"):
            raise DataError(f"{path}: shard {s.get('raw_data', {}).get('basename')} is format {s.get('format')!r}, "
                            f"compression {s.get('compression')!r}: only uncompressed MDS is read (decompress it "
                            "with Streaming first)")
    return found


def column_of(shard: dict, column: str | None, where: str) -> tuple[int, str]:
    names = shard["column_names"]
    name = column or next((c for c in COLUMNS if c in names), None)
    if name not in names:
        raise DataError(f"{where} has no column {name or ' or '.join(COLUMNS)} (columns: {', '.join(names)}): "
                        "name the column of token ids with --mds-column")
    return names.index(name), shard["column_encodings"][names.index(name)]


def spans(data: np.ndarray, shard: dict, col: int, where: str):
    """(byte start, byte end) of the token column of every sample of one shard file (uint8 map `data`)."""
    n = int(data[:4].view(np.uint32)[0])
    if n != shard["samples"]:
        raise DataError(f"{where} holds {n} samples but index.json says {shard['samples']}")
    offsets = data[4:4 + 4 * (n + 1)].view(np.uint32).astype(np.int64)
    sizes = shard["column_sizes"]
    variable = [i for i, s in enumerate(sizes) if s is None]
    head = 4 * len(variable)
    # each variable column's size, read at once for every sample: [n, len(variable)]
    at = offsets[:-1, None] + 4 * np.arange(len(variable))[None, :]
    var_sizes = data[at[..., None] + np.arange(4)].reshape(n, len(variable), 4).copy().view(np.uint32)[..., 0]
    start = offsets[:-1] + head
    for i in range(col):
        start = start + (var_sizes[:, variable.index(i)] if sizes[i] is None else sizes[i])
    size = var_sizes[:, variable.index(col)] if sizes[col] is None else np.full(n, sizes[col])
    return start, start + size


def decode(raw: bytes, encoding: str, dtype: str | None, where: str) -> np.ndarray:
    """One sample's ids from its column bytes."""
    kind, *args = encoding.split(":")
    if kind == "bytes":
        if dtype is None:
            raise DataError(f"{where}: its tokens are raw bytes: give their dtype with --dtype")
        return np.frombuffer(raw, dtype)
    if kind != "ndarray":
        raise DataError(f"{where}: column encoding {encoding!r} holds no token ids (ndarray or bytes)")
    i = 0
    if args:
        value = args[0]
    else:
        value, i = VALUE_DTYPES[raw[0]], 1
    if len(args) < 2:   # a dynamic shape: ndim<<2 | shape dtype code, then the shape
        ndim, code = raw[i] >> 2, raw[i] & 3
        i += 1 + ndim * (1 << code)
    return np.frombuffer(raw, value, offset=i)


def chunks(folder: str, column: str | None = None, dtype: str | None = None):
    """(ids, document ends in them, where): a sample a document, about CHUNK_TOKENS ids at a time."""
    for shard in shards(folder):
        where = os.path.join(folder, shard["raw_data"]["basename"])
        col, encoding = column_of(shard, column, where)
        data = read_exact(where, np.uint8)
        start, end = spans(data, shard, col, where)
        buf, parts, ends, count = memoryview(data), [], [], 0
        for s, e in zip(start.tolist(), end.tolist()):
            ids = decode(buf[s:e], encoding, dtype, where)
            parts.append(ids)
            count += len(ids)
            ends.append(count)
            if count >= CHUNK_TOKENS:
                yield np.concatenate(parts), np.array(ends, dtype=np.int64), where
                parts, ends, count = [], [], 0
        if parts:
            yield np.concatenate(parts), np.array(ends, dtype=np.int64), where
