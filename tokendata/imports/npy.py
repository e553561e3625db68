"""Arrays of token ids: a .npy file (its header gives the dtype), or a headerless file of raw ids as OLMo writes
them (the dtype given: uint16 for vocabularies up to 65536, uint32 above). Documents in them are already separated
by eos; the end of a file ends a document too (an eos is added there where the file does not end with one)."""
from __future__ import annotations

import numpy as np

from tokendata.imports import CHUNK_TOKENS, read_exact
from tokendata.remote import DataError
from tokendata.windows import Documents

NPY_MAGIC = b"\x93NUMPY"


def array(path: str, dtype: str | None) -> np.ndarray:
    with open(path, "rb") as f:
        magic = f.read(len(NPY_MAGIC))
    if magic == NPY_MAGIC:
        try:
            a = np.load(path, mmap_mode="r", allow_pickle=False)
        except ValueError as e:
            raise DataError(f"cannot read {path}: {e}") from None
        if a.ndim != 1 and a.ndim != 2 or a.dtype.kind not in "iu":
            raise DataError(f"{path} holds a {a.ndim}-d {a.dtype} array: give 1-d (or 2-d, rows back to back) "
                            "integer token ids")
        return a.reshape(-1)
    if dtype is None:
        raise DataError(f"{path} has no .npy header: a headerless token array (OLMo's) needs --dtype "
                        "(uint16 or uint32)")
    size = np.dtype(dtype).itemsize
    with open(path, "rb") as f:
        f.seek(0, 2)
        if f.tell() % size:
            raise DataError(f"{path} has {f.tell()} bytes, not a whole number of {dtype} ids: is --dtype right?")
    return read_exact(path, dtype)


def chunks(path: str, dtype: str | None, eos: int):
    """(Documents, where): the file CHUNK_TOKENS ids at a time, each piece a document; an eos after the last one where
    the file does not end with eos."""
    ids = array(path, dtype)
    src = ids.view(np.uint8)
    for first in range(0, len(ids), CHUNK_TOKENS):
        size = min(len(ids), first + CHUNK_TOKENS) - first
        last = first + size == len(ids) and int(ids[-1]) != eos   # the file's end ends a document
        yield Documents(src, [first * ids.itemsize], [size], [last], ids.dtype, eos), path
