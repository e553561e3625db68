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

from tokendata.imports import eos_after, read_exact
from tokendata.remote import DataError
from tokendata.windows import Documents

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


def values(data: np.ndarray, start: np.ndarray, end: np.ndarray, encoding: str, dtype: str | None, where: str):
    """(the ids' dtype, where each sample's ids start): the column's own header skipped, for every sample at once."""
    kind, *args = encoding.split(":")
    if kind == "bytes":
        if dtype is None:
            raise DataError(f"{where}: its tokens are raw bytes: give their dtype with --dtype")
        return np.dtype(dtype), start
    if kind != "ndarray":
        raise DataError(f"{where}: column encoding {encoding!r} holds no token ids (ndarray or bytes)")
    if args:
        value = args[0]
    else:   # a dynamic dtype: one byte before the values, the same in every sample of a token column
        codes = np.unique(data[start]) if len(start) else np.array([65])
        if len(codes) != 1 or int(codes[0]) not in VALUE_DTYPES:
            raise DataError(f"{where}: its token arrays have dtype codes {codes.tolist()}: expected one integer type")
        value, start = VALUE_DTYPES[int(codes[0])], start + 1
    if len(args) < 2 and len(start):   # a dynamic shape: one byte ndim<<2 | shape dtype code, then the shape
        byte = data[start].astype(np.int64)
        start = start + 1 + (byte >> 2) * (1 << (byte & 3))
    return np.dtype(value), start


def chunks(folder: str, column: str | None, dtype: str | None, eos: int):
    """(Documents, where): a sample a document, a shard file at a time, each where it lies in the file."""
    for shard in shards(folder):
        where = os.path.join(folder, shard["raw_data"]["basename"])
        col, encoding = column_of(shard, column, where)
        data = read_exact(where, np.uint8)
        start, end = spans(data, shard, col, where)
        value, first = values(data, start, end, encoding, dtype, where)
        width = value.itemsize
        if np.any((end - first) % width):
            raise DataError(f"{where}: a sample's tokens are not a whole number of {value} ids")
        lengths = (end - first) // width
        # each sample's last id, read byte by byte: a sample's ids need not lie at an address aligned for `value`
        last_at = np.maximum(end - width, 0)[:, None] + np.arange(width)
        last = data[last_at].copy().view(value)[:, 0] if len(end) else np.zeros(0, value)
        yield Documents(data, first, lengths, eos_after(last, lengths, eos), value, eos), where
