"""tokendata/windows.py: windows copied straight from where documents lie are the windows of the joined stream (the
documents back to back, eos after each one flagged), checked against that stream built another way (a concatenation
of the documents' ids), for the compiled loop and for numpy's copy; and tokendata/packing.py's numpy coin is Python's
random.Random, draw for draw."""
import random

import numpy as np
import pytest

from tokendata import windows
from tokendata.packing import coin
from tokendata.windows import Documents, fill

EOS = 7


def corpus(rng, dtype, count):
    """(Documents over a byte buffer with gaps and odd offsets between documents, the joined stream as a reference)."""
    dtype = np.dtype(dtype)
    lengths = rng.integers(0, 60, count)
    lengths[rng.random(count) < 0.1] = 0                    # empty documents get no eos
    gaps = rng.integers(0, 12, count)                       # bytes between documents: MDS's headers, unaligned
    ids = [rng.integers(0, min(np.iinfo(dtype).max, 50_000), n).astype(dtype) for n in lengths]
    for d in ids[::5]:
        if len(d):
            d[-1] = EOS                                     # ends with eos already: none added
    flags = np.array([len(d) > 0 and d[-1] != EOS for d in ids])
    src, starts = bytearray(), []
    for d, gap in zip(ids, gaps):
        src += bytes(rng.integers(0, 256, gap, dtype=np.uint8))
        starts.append(len(src))
        src += d.tobytes()
    docs = Documents(np.frombuffer(bytes(src), np.uint8), starts, lengths, flags, dtype, EOS)
    stream = np.concatenate([np.append(d, [EOS] if f else []).astype(dtype) for d, f in zip(ids, flags)])
    return docs, stream


@pytest.mark.parametrize("dtype", ["uint16", "int32", "uint32", "int64"])
def test_windows_are_the_joined_streams(dtype):
    rng = np.random.default_rng(np.dtype(dtype).num)
    for trial in range(40):
        docs, stream = corpus(rng, dtype, int(rng.integers(1, 40)))
        assert docs.tokens == len(stream)
        if not len(stream):
            continue
        width = int(rng.integers(1, min(len(stream), 50) + 1))
        stride = int(rng.integers(1, width + 2))   # overlapping (the shards' n of n + 1), touching, or apart
        positions = np.arange(0, len(stream) - width + 1, stride)
        positions = np.sort(rng.choice(positions, size=min(len(positions), 9), replace=False))   # runs broken
        want = np.stack([stream[p:p + width] for p in positions])
        for copy in (fill, numpy_fill):
            out = np.full(len(positions) * width * np.dtype(dtype).itemsize, 0xAB, dtype=np.uint8)
            low, high = copy(docs, positions, width, out)
            assert np.array_equal(out.view(dtype).reshape(want.shape), want), (copy.__name__, trial)
            assert (low, high) == (want.min(), want.max()), (copy.__name__, trial)
        start, stop = sorted(int(x) for x in rng.integers(0, len(stream) + 1, 2))
        assert np.array_equal(docs.ids(start, stop), stream[start:stop])


def numpy_fill(docs, positions, width, out):
    """fill by tokendata/windows.py's numpy copy (what a machine without numba runs)."""
    positions = np.asarray(positions, dtype=np.int64)
    low, high = windows.by_numpy(docs.src, docs.starts, docs.lengths, docs.eos, docs.at, docs.eos_bytes,
                                 docs.dtype.itemsize, positions, width, out, out.view(docs.dtype))
    return int(low), int(high)


def test_the_compiled_loop_is_what_runs_here():
    assert windows.numba is not None   # requirements.txt pins numba: CI runs the compiled copy, not numpy's


def test_windows_past_the_stream_are_refused():
    docs, stream = corpus(np.random.default_rng(1), "uint16", 5)
    with pytest.raises(ValueError, match="of a stream of"):
        fill(docs, [len(stream) - 2], 3, np.empty(6, np.uint8))


@pytest.mark.parametrize("seed", [0, 1, 1234, 2**40 + 7])
def test_numpy_coin_draws_pythons_numbers(seed):
    python = random.Random(seed)
    draws = coin(seed)
    for size in (1, 1000, 31_337, 5):   # drawn a chunk at a time, as the packer does
        assert np.array_equal(draws.random_sample(size), [python.random() for _ in range(size)])
