"""Tokenize text files into fixed-length samples in WebDataset shards, streaming.

    python tools/make_shards.py --input data/austen.txt.gz --tokenizer runs/tok/tokenizer.model \\
        --out runs/shards --seq-len 256 --samples-per-shard 1000 --val-fraction 0.01

text (one document per line, plain or .gz) -> sentencepiece ids -> one continuous stream with eos after each document ->
samples of seq_len+1 tokens, taken with stride seq_len (consecutive samples share one boundary token, as in Megatron's
GPTDataset, so every stream token after the first is a target exactly once; the trainer uses tokens[:-1] as input and
tokens[1:] as targets) -> each sample goes to train or val (a seeded coin flip per sample, P(val) = --val-fraction) ->
shards of --samples-per-shard samples.

Output directory:
  train-000000.tar ...   val-000000.tar ...   tokenizer.model (a copy; the trainer ships it into checkpoints)
  manifest.json  {"format": 1, "seq_len": n, "vocab_size": V, "eos_id": 2, "tokenizer": "tokenizer.model" (relative
                  to the directory), "tokenizer_sha256": ..., "tokenizer_source": ..., "dtype": "uint16" | "int32",
                  "seed": s, "val_fraction": f, "inputs": [...],
                  "splits": {"train": {"samples": N, "tokens": N*n, "shards": [{"name": "train-000000.tar",
                  "samples": k, "first_id": "train-000000-000000", "first_index": 0, "bytes": b}, ...]},
                  "val": {...}}}
  "tokens" counts target tokens (samples x seq_len). A split with no samples has "shards": []. "bytes" is the size of
  the closed tar: the loader compares it with the file, so a truncated copy is named before training starts.
Each sample: __key__ "<split>-<shard:06d>-<index in shard:06d>" (unique over the directory) and one member
"tokens.u16" (or "tokens.i32" when V > 65535): the n+1 ids as raw little-endian integers.

--out may also be a pipe: command that reads one file from stdin ({} is its name) or an fsspec URL (with fsspec's
backend for it installed), which writes straight into a bucket:
    python tools/make_shards.py ... --out "pipe:aws s3 cp - s3://bucket/shards/{}"
or write a directory and upload it (aws s3 sync runs/shards s3://bucket/shards; gsutil -m rsync -r …). The trainer
then streams data.shard_dir=https://bucket.s3.amazonaws.com/shards, "pipe:aws s3 cp s3://bucket/shards/{} -" or
s3://bucket/shards. manifest.json is written last; --force has no meaning there (nothing is listed or removed).

Memory is bounded whatever the input size: lines are read and encoded in batches, only the tail of the token stream that
does not fill a sample is kept between batches, and shards are written as they fill. manifest.json is written last, so
a directory without one is an unfinished run.
"""

import argparse
import glob
import hashlib
import os
import random
import shutil
import sys
import time

import numpy as np

from tokendata import remote
from tokendata.shards import DTYPES, MANIFEST_FORMAT, SplitWriter, dtype_for, write_file, write_manifest

from cli import UsageError, one_line_errors
from tokendata.corpus import check_inputs, iter_documents

def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def prepare_out_dir(out, force):
    if remote.is_remote(out):   # a pipe: command or a bucket: nothing to list or clear here; the manifest comes last
        return
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"--out {out} is a file, not a directory")
    old = glob.glob(os.path.join(out, "*.tar")) + glob.glob(os.path.join(out, "manifest.json"))
    if old and not force:
        raise UsageError(f"{out} already holds shards ({len(old)} files): pass --force to replace them, "
                         "or pick another --out")
    for path in old:
        os.remove(path)
    os.makedirs(out, exist_ok=True)


def make_shards(inputs, tokenizer, out, seq_len, samples_per_shard=1000, val_fraction=0.01, seed=0,
                batch_chars=1 << 21, threads=None, force=False, progress=True):
    """Write the shards and manifest.json; return the manifest (plus a "stats" entry with counts and timings)."""
    import sentencepiece as spm

    check_inputs(inputs)
    if not os.path.isfile(tokenizer):
        raise UsageError(f"tokenizer file not found: {tokenizer} (train one with tools/train_tokenizer.py)")
    if seq_len < 1 or samples_per_shard < 1:
        raise UsageError(f"--seq-len and --samples-per-shard must be >= 1, got {seq_len} and {samples_per_shard}")
    if not 0.0 <= val_fraction < 1.0:
        raise UsageError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    try:
        sp = spm.SentencePieceProcessor(model_file=tokenizer)
    except (RuntimeError, OSError) as e:
        raise UsageError(f"cannot load tokenizer {tokenizer}: {str(e).strip().splitlines()[0]}") from None
    vocab, eos = sp.vocab_size(), sp.eos_id()
    if eos < 0:
        raise UsageError(f"tokenizer {tokenizer} has no eos id: retrain it with tools/train_tokenizer.py")
    dtype = dtype_for(vocab)
    prepare_out_dir(out, force)
    import webdataset  # noqa: F401 -- imports torch (~2 s): here, after the checks, and before the clock starts

    writers = {s: SplitWriter(out, s, samples_per_shard, dtype) for s in ("train", "val")}
    coin = random.Random(seed)  # one draw per sample, in stream order: the split depends only on (input, seed, seq_len)
    leftover = np.zeros(0, dtype=np.int64)
    n_docs = n_bytes = n_tokens = 0
    threads = threads or os.cpu_count() or 1
    t0 = time.perf_counter()

    def flush(batch):
        nonlocal leftover, n_tokens
        flat = []
        for ids in sp.encode(batch, num_threads=threads):
            flat.extend(ids)
            flat.append(eos)
        n_tokens += len(flat)
        stream = np.concatenate([leftover, np.asarray(flat, dtype=np.int64)])
        count = (len(stream) - 1) // seq_len  # windows [i*n, i*n + n + 1) that fit completely
        for i in range(count):
            window = stream[i * seq_len : i * seq_len + seq_len + 1]
            split = "val" if coin.random() < val_fraction else "train"
            writers[split].write(window.astype(DTYPES[dtype][0]).tobytes())
        leftover = stream[count * seq_len :]  # >= 1 token: the last window's end is the next window's start

    batch, size = [], 0
    for doc in iter_documents(inputs, desc="tokenizing", progress=progress):
        batch.append(doc)
        size += len(doc)
        n_docs += 1
        n_bytes += len(doc.encode("utf-8"))
        if size >= batch_chars:
            flush(batch)
            batch, size = [], 0
    if batch:
        flush(batch)
    for w in writers.values():
        w.close()
    seconds = time.perf_counter() - t0
    if writers["train"].samples == 0:
        raise UsageError(f"{', '.join(inputs)}: only {n_tokens} tokens, not one train sample of {seq_len + 1}: "
                         "give more text or a smaller --seq-len")

    tok_copy = remote.join(out, "tokenizer.model")
    if remote.is_remote(out):
        with open(tokenizer, "rb") as f:
            write_file(out, "tokenizer.model", f.read())
    elif os.path.abspath(tok_copy) != os.path.abspath(tokenizer):
        shutil.copyfile(tokenizer, tok_copy)
    manifest = {
        "format": MANIFEST_FORMAT, "seq_len": seq_len, "vocab_size": vocab, "eos_id": eos,
        "tokenizer": "tokenizer.model", "tokenizer_sha256": sha256_file(tokenizer),
        "tokenizer_source": os.path.abspath(tokenizer),
        "dtype": dtype, "seed": seed, "val_fraction": val_fraction,
        "inputs": [os.path.abspath(p) for p in inputs],
        "splits": {s: {"samples": w.samples, "tokens": w.samples * seq_len, "shards": w.shards}
                   for s, w in writers.items()},
    }
    write_manifest(out, manifest)
    manifest["stats"] = {"documents": n_docs, "text_bytes": n_bytes, "stream_tokens": n_tokens, "seconds": seconds,
                         "dropped_tokens": max(0, len(leftover) - 1)}
    return manifest


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, metavar="FILE",
                   help="text files, plain or .gz, one document per line")
    p.add_argument("--tokenizer", required=True, metavar="PATH",
                   help="sentencepiece model from tools/train_tokenizer.py")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="where the shards and manifest.json go: a directory, or pipe:COMMAND that reads one file "
                        "from stdin, with {} for its name (pipe:aws s3 cp - s3://bucket/shards/{}), or an fsspec URL "
                        "with its backend installed (s3://bucket/shards)")
    p.add_argument("--seq-len", type=int, required=True, help="n: each sample holds n+1 tokens")
    p.add_argument("--samples-per-shard", type=int, default=1000, help="samples in each .tar (default 1000)")
    p.add_argument("--val-fraction", type=float, default=0.01,
                   help="probability that a sample goes to val (default 0.01)")
    p.add_argument("--seed", type=int, default=0, help="seed of the train/val assignment (default 0)")
    p.add_argument("--threads", type=int, default=None, help="encoding threads (default: all cores)")
    p.add_argument("--force", action="store_true", help="replace shards already in --out")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


@one_line_errors
def main(argv=None):
    args = parse_args(argv)
    m = make_shards(args.input, args.tokenizer, args.out, args.seq_len, args.samples_per_shard, args.val_fraction,
                    args.seed, threads=args.threads, force=args.force, progress=not args.quiet)
    st, tr, va = m["stats"], m["splits"]["train"], m["splits"]["val"]
    secs = max(st["seconds"], 1e-9)
    print(f"wrote {args.out}: train {tr['samples']} samples in {len(tr['shards'])} shards, "
          f"val {va['samples']} samples in {len(va['shards'])} shards, seq_len={m['seq_len']}, "
          f"vocab_size={m['vocab_size']}, dtype={m['dtype']}")
    print(f"read {st['documents']} documents, {st['text_bytes'] / 1e6:.1f} MB, {st['stream_tokens']} tokens "
          f"({st['dropped_tokens']} left over at the end) in {secs:.1f} s: "
          f"{st['text_bytes'] / 1e6 / secs:.2f} MB/s, {st['stream_tokens'] / secs:,.0f} tokens/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
