"""Windows of a stream of documents, copied straight from where the documents lie: one pass over the bytes, with no
joined stream in between (tokendata/packing.py writes the windows; tools/import_tokens.py hands it the documents of
a memory-mapped corpus, tools/make_shards.py a stream it tokenized).

    Documents(src, starts, lengths, eos, dtype, eos_id)
        document d: lengths[d] ids of `dtype` at byte starts[d] of `src` (uint8: a map of the corpus file), then
        eos_id if eos[d] (a document that does not end with eos gets one; an empty one gets none)
    the stream: the documents back to back; document d begins at stream position at[d] = Σ_{e<d} lengths[e] + eos[e]
    fill(docs, positions, width, out): the windows stream[p : p + width] for each p of `positions` (ascending), back
        to back into `out` (as bytes); returns the smallest and largest
        id written: every id of a stream passes through a window, so the vocabulary check needs no pass of its own

Invariant: the bytes are those of the stream np.insert(ids, ends of the documents flagged eos, eos_id) cut into the
same windows (tests/unit/test_windows.py holds it against that reference for random documents, lengths, strides and
ids that do and do not lie at aligned addresses: MDS puts a 9-byte header before each sample's ids).

Cost: each id is copied once, a run of whole ids at a time (a document's piece of a window: a loop the compiler
vectorizes), and its range taken while its window is still in cache; finding a window's first document is a binary
search. The loop is compiled by numba, once per machine and type (cached beside this file), where Python would spend
a microsecond on each piece. Without numba, `by_numpy` gives the same bytes: it joins the documents the windows
cover (a bytes join, then one copy of the windows: two passes, and a Python step a document).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

try:
    import numba
except ImportError:   # a machine without it (a GPU image that carries only what training needs): numpy's copy
    numba = None


@dataclass
class Documents:
    """The documents of one chunk of a corpus, where they lie (see the module docstring)."""
    src: np.ndarray        # uint8
    starts: np.ndarray     # int64 byte offsets in src
    lengths: np.ndarray    # int64 ids
    eos: np.ndarray        # bool: an eos follows the document
    dtype: np.dtype        # the ids' type (its itemsize is the stride of a document's ids in src)
    eos_id: int

    def __post_init__(self):
        self.dtype = np.dtype(self.dtype)
        self.starts = np.asarray(self.starts, dtype=np.int64)
        self.lengths = np.asarray(self.lengths, dtype=np.int64)
        self.eos = np.asarray(self.eos, dtype=bool)
        self.at = np.concatenate([[0], np.cumsum(self.lengths + self.eos)]).astype(np.int64)   # [D + 1]
        self.eos_bytes = np.frombuffer(np.asarray(self.eos_id, self.dtype).tobytes(), np.uint8)

    @classmethod
    def of_stream(cls, ids: np.ndarray, eos_id: int) -> "Documents":
        """A stream already joined (make_shards' ids, a token array): one document, no eos added."""
        ids = np.ascontiguousarray(ids)
        return cls(ids.reshape(-1).view(np.uint8), [0], [len(ids)], [False], ids.dtype, eos_id)

    @property
    def tokens(self) -> int:
        """The stream's length, eos included."""
        return int(self.at[-1])

    def ids(self, start: int, stop: int) -> np.ndarray:
        """stream[start:stop], copied."""
        out = np.empty(max(0, stop - start), dtype=self.dtype)
        fill(self, [start], len(out), out.view(np.uint8))
        return out


def fill(docs: Documents, positions: np.ndarray, width: int, out: np.ndarray) -> tuple[int, int]:
    """The windows of `width` ids at the stream positions `positions` (ascending), back to back into `out` (uint8);
    the smallest and the largest id written (0, 0 for none)."""
    positions = np.asarray(positions, dtype=np.int64)
    if len(positions) and (positions[0] < 0 or positions[-1] + width > docs.tokens):
        raise ValueError(f"windows of {width} ids at {positions[0]}..{positions[-1]} of a stream of {docs.tokens}")
    if out.nbytes != len(positions) * width * docs.dtype.itemsize:
        raise ValueError(f"out holds {out.nbytes} bytes for {len(positions)} windows of {width} ids of {docs.dtype}")
    if not len(positions) or not width:
        return 0, 0
    copy = by_numpy if numba is None else copy_windows
    low, high = copy(docs.src, docs.starts, docs.lengths, docs.eos, docs.at, docs.eos_bytes, docs.dtype.itemsize,
                     positions, width, out, out.view(docs.dtype))
    return int(low), int(high)


def by_numpy(src, starts, lengths, eos, at, eos_bytes, itemsize, positions, width, out, ids):
    """copy_windows by numpy: the documents under the windows joined, then the windows copied out of the join."""
    first, stop = int(positions[0]), int(positions[-1]) + width
    d0, d1 = int(np.searchsorted(at, first, side="right")) - 1, int(np.searchsorted(at, stop, side="left"))
    view, pieces, eos_id = memoryview(src), [], eos_bytes.tobytes()
    for d in range(d0, d1):
        pieces.append(view[starts[d]:starts[d] + lengths[d] * itemsize])
        if eos[d]:
            pieces.append(eos_id)
    stream = np.frombuffer(b"".join(pieces), ids.dtype)   # stream positions at[d0] ..
    rows = ids.reshape(len(positions), width)
    rows[...] = stream[(positions - at[d0])[:, None] + np.arange(width)]
    return rows.min(), rows.max()


def copy_windows(src, starts, lengths, eos, at, eos_bytes, itemsize, positions, width, out, ids):
    """The loop of `fill`; `ids` is `out` seen as the ids' type, for their range while a window is still in cache."""
    o = 0
    low, high = ids[0], ids[0]
    d = np.searchsorted(at, positions[0], side="right") - 1
    for k in range(len(positions)):
        p = positions[k]
        while d + 1 < len(at) - 1 and at[d + 1] <= p:   # the document holding stream position p
            d += 1
        doc, off, left = d, p - at[d], width
        while left > 0:
            if off < lengths[doc]:   # the document's ids: one run
                take = min(lengths[doc] - off, left)
                s, nbytes = starts[doc] + off * itemsize, take * itemsize
                to, frm = out[o:o + nbytes], src[s:s + nbytes]
                for i in range(nbytes):   # a loop over two views: vectorized (a slice assignment is byte by byte)
                    to[i] = frm[i]
                o, off, left = o + nbytes, off + take, left - take
            elif off == lengths[doc] and eos[doc]:
                for i in range(itemsize):
                    out[o + i] = eos_bytes[i]
                o, off, left = o + itemsize, off + 1, left - 1
            else:
                doc, off = doc + 1, 0
        window = ids[k * width:(k + 1) * width]
        if k == 0:
            low, high = window[0], window[0]
        for i in range(width):
            low, high = min(low, window[i]), max(high, window[i])
    return low, high


if numba is not None:
    copy_windows = numba.njit(cache=True, nogil=True)(copy_windows)
