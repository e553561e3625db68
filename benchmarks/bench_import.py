"""The speed of tools/import_tokens.py against `cp` of the same bytes, for each format it reads: a synthetic corpus
of --mb MB of uint16 ids (documents of 1-4000 ids, none ending in eos), written once per format, then copied with
cp and imported (seq_len 2048, 1000 samples a shard); MB/s is input bytes per second, both from the page cache
(the inputs dropped from it and read back once, as a corpus read from disk is cached; --cache written: as written),
each the best of --repeat tries (on a shared machine one try of a fraction of a second mostly measures the load), and
the same by CPU time (user + system of the import, of cp's process), which other jobs on the machine disturb less.

    python benchmarks/bench_import.py --mb 256
    python benchmarks/bench_import.py --mb 32 --formats npy   # quick

The Megatron input is written by megatron-core's IndexedDatasetBuilder; the MDS input in the layout Streaming's
MDSWriter writes (tokendata/imports/mds.py; Streaming cannot be installed beside the pinned torch), one
ndarray:uint16 column, a document a sample; the .npy input as OLMo writes it (headerless, eos between documents).
"""
import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from tools.import_tokens import main as import_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = os.path.join(ROOT, "tests", "data", "format1", "shards", "tokenizer.model")   # 320 ids, eos 2
EOS = 2


def corpus(mb: int, seed=0):
    """(ids, document ends): mb MB of uint16 ids in [3, 320)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, 320, size=mb * (1 << 20) // 2, dtype=np.uint16)
    ends = np.cumsum(rng.integers(1, 4000, size=len(ids) // 1000 + 1))
    return ids, np.append(ends[ends < len(ids)], len(ids))


def write_megatron(folder, ids, ends):
    builder = IndexedDatasetBuilder(os.path.join(folder, "corpus.bin"), dtype=np.uint16)
    for doc in np.split(ids, ends[:-1]):
        builder.add_item(torch.from_numpy(doc))
        builder.end_document()
    builder.finalize(os.path.join(folder, "corpus.idx"))
    return [os.path.join(folder, "corpus.bin"), os.path.join(folder, "corpus.idx")], os.path.join(folder, "corpus")


def write_mds(folder, ids, ends, limit=1 << 26):
    """index.json + shard.NNNNN.mds: per sample a uint32 size, then ndim<<2|shape-dtype byte, the shape, the ids."""
    shards, samples, size = [], [], 0

    def flush():
        n = len(samples)
        offsets = 4 + 4 * (n + 1) + np.concatenate([[0], np.cumsum([len(s) for s in samples])])
        name = f"shard.{len(shards):05d}.mds"
        with open(os.path.join(folder, name), "wb") as f:
            f.write(np.uint32(n).tobytes() + offsets.astype(np.uint32).tobytes() + b"".join(samples))
        shards.append({"column_encodings": ["ndarray:uint16"], "column_names": ["tokens"], "column_sizes": [None],
                       "compression": None, "format": "mds", "hashes": [], "raw_data": {"basename": name},
                       "samples": n, "size_limit": limit, "version": 2, "zip_data": None})
    for doc in np.split(ids, ends[:-1]):
        body = bytes([(1 << 2) | 2]) + np.uint32(len(doc)).tobytes() + doc.tobytes()
        samples.append(np.uint32(len(body)).tobytes() + body)
        size += len(samples[-1])
        if size >= limit:
            flush()
            samples, size = [], 0
    if samples:
        flush()
    with open(os.path.join(folder, "index.json"), "w") as f:
        json.dump({"shards": shards, "version": 2}, f)
    return [os.path.join(folder, n) for n in os.listdir(folder)], folder


def write_npy(folder, ids, ends):
    path = os.path.join(folder, "part-0-00000.npy")
    np.insert(ids, ends[:-1], np.uint16(EOS)).tofile(path)
    return [path], path


WRITERS = {"megatron": (write_megatron, []), "mds": (write_mds, []), "npy": (write_npy, ["--dtype", "uint16"])}


def timed(fn):
    """(wall seconds, CPU seconds of this process and its children) of fn(), after the previous try's dirty pages are
    written back (neither side pays for the other's writeback)."""
    os.sync()
    t0, c0 = time.perf_counter(), cpu_seconds()
    fn()
    return time.perf_counter() - t0, cpu_seconds() - c0


def cpu_seconds():
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def measure(fmt, ids, ends, work, repeat=3, cache="read"):
    src, out = os.path.join(work, fmt), os.path.join(work, f"{fmt}-shards")
    os.makedirs(src)
    write, extra = WRITERS[fmt]
    files, given = write(src, ids, ends)
    nbytes = sum(os.path.getsize(f) for f in files)
    cp_dir = os.path.join(work, "cp")
    for f in files if cache == "read" else ():   # out of the page cache, then read back: cached as a corpus read
        fd = os.open(f, os.O_RDONLY)                  # from disk is (in large folios, mapped a few faults a MB)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)   # both start from the page cache
    args = ["--format", fmt, "--input", given, "--tokenizer", TOKENIZER, "--out", out, "--seq-len", "2048",
            "--quiet", *extra]
    cp, imp = [], []
    for _ in range(repeat):
        os.makedirs(cp_dir)
        cp.append(timed(lambda: subprocess.run(["cp", *files, cp_dir], check=True)))
        shutil.rmtree(cp_dir)
        imp.append(timed(lambda: import_main(args) == 0 or sys.exit(f"import of {fmt} failed")))
        shutil.rmtree(out)
    shutil.rmtree(src)
    best = [min(t[i] for t in cp) for i in range(2)], [min(t[i] for t in imp) for i in range(2)]   # wall, CPU
    return (nbytes, *best)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, default=256, help="MB of ids in the synthetic corpus (default 256)")
    p.add_argument("--formats", nargs="+", default=sorted(WRITERS), choices=sorted(WRITERS))
    p.add_argument("--repeat", type=int, default=3, help="tries of cp and of the import; the best counts (default 3)")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    p.add_argument("--cache", choices=["read", "written"], default="read",
                   help="how the inputs sit in the page cache: read back from disk (default), or as just written "
                        "(small pages: a map of them costs more faults)")
    args = p.parse_args(argv)
    ids, ends = corpus(args.mb)
    print(f"{'format':<9} {'MB':>7} {'cp MB/s':>9} {'import MB/s':>12} {'ratio':>6}  (goal >= 0.5)  "
          "by CPU time: cp, import, ratio")
    with tempfile.TemporaryDirectory(dir=args.dir) as work:
        for fmt in args.formats:
            print(f"writing {fmt} ...", end="\r", file=sys.stderr, flush=True)
            nbytes, cp, imp = measure(fmt, ids, ends, work, args.repeat, args.cache)
            mb = nbytes / 1e6
            print(f"{fmt:<9} {mb:>7.0f} {mb / cp[0]:>9.0f} {mb / imp[0]:>12.0f} {cp[0] / imp[0]:>6.2f}"
                  f"{'':>15}{mb / cp[1]:>6.0f} {mb / imp[1]:>6.0f} {cp[1] / imp[1]:>6.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
