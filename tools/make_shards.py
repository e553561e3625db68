"""Tokenize a corpus into fixed-length samples in compact, checksummed WebDataset shards, streaming.

    python tools/make_shards.py --input data/austen.txt.gz --tokenizer runs/tok/tokenizer.model \\
        --out runs/shards --seq-len 256 --samples-per-shard 1000 --val-fraction 0.01
    python tools/make_shards.py --input pile/*.jsonl.zst --tokenizer gpt-neox/tokenizer.json --out shards \\
        --seq-len 2048 --workers 8                      # JSONL with a "text" field; a Hugging Face tokenizer
    python tools/make_shards.py --input wikitext-103/train-*.parquet --tokenizer tok/ --out shards --seq-len 1024

Inputs (tokendata/corpus.py): text (plain/.gz/.zst, a document a line), JSONL (--text-key, default text), Parquet,
a Hugging Face dataset (saved with save_to_disk, or local data files; --split); --format, or found from each input. A
record is one document, its newlines kept. Tokenizer (tokendata/tokenizer.py): a sentencepiece model from
tools/train_tokenizer.py, a Hugging Face tokenizer.json, or a directory that transformers.AutoTokenizer loads; eos
is the tokenizer's (--eos names one where it has none).

documents -> ids -> one continuous stream with eos after each document -> samples of seq_len+1 tokens, taken with
stride seq_len (consecutive samples share one boundary token, as in Megatron's GPTDataset, so every stream token after
the first is a target exactly once; the trainer uses tokens[:-1] as input and tokens[1:] as targets) -> each sample
goes to train or val (a seeded coin flip per sample, P(val) = --val-fraction) -> shards of --samples-per-shard samples.
--workers N encode in N processes (each with --threads threads); the stream, and so every file, is the same for any N.

Output directory (the format: tokendata/shards.py, manifest format 2):
  train-000000.tar ...   val-000000.tar ...   tokenizer.model, or tokenizer.json + tokenizer_config.json (a copy;
  the trainer ships it into checkpoints)
  manifest.json  {"format": 2, "seq_len": n, "vocab_size": V, "eos_id", "tokenizer": "tokenizer.model" (relative to
                  the directory), "tokenizer_kind", "tokenizer_sha256", "tokenizer_source", "dtype": "uint16" |
                  "int32", "hash": "xxh3_128", "seed": s, "val_fraction": f, "inputs": [...], "input": {formats,
                  text_key, bad_records_skipped}, "splits": {"train": {"samples": N, "tokens": N*n, "shards":
                  [{"name": "train-000000.tar", "samples": k, "first_id": "train-000000-000000", "first_index": 0,
                  "bytes": b, "hash": h}, ...]}, "val": {...}}}
  "tokens" counts target tokens (samples x seq_len). A split with no samples has "shards": []. "bytes" is the size of
  the shard, compared with the file when it is read (a truncated copy is named then); "hash" is the content hash of
  the file, checked when the shard is read (data.verify).
Each shard is a tar of one member "<split>-<shard:06d>.tokens.u16" (or .tokens.i32 when V > 65535): its samples'
n+1 ids each, back to back, raw little-endian; sample k has the id "<split>-<shard:06d>-<k:06d>".

--out may also be a pipe: command that reads one file from stdin ({} is its name), an fsspec URL (with fsspec's
backend for it installed: s3:// takes the AWS variables, AWS_ENDPOINT_URL for an S3-compatible store), or an
http(s):// URL that takes a PUT of each file (with --ca-bundle and --header-from-env, as training reads it), which
write straight into a bucket:
    python tools/make_shards.py ... --out "pipe:aws s3 cp - s3://bucket/shards/{}"
    python tools/make_shards.py ... --out s3://bucket/shards
or write a directory and upload it (aws s3 sync runs/shards s3://bucket/shards; gsutil -m rsync -r …). The trainer
then streams data.shard_dir=https://bucket.s3.amazonaws.com/shards, "pipe:aws s3 cp s3://bucket/shards/{} -" or
s3://bucket/shards. manifest.json is written last; --force has no meaning there (nothing is listed or removed).

Memory is bounded whatever the input size: documents are read and encoded in batches (at most 2 per worker in
flight), only the tail of the token stream that does not fill a sample is kept between batches, and shards are written
as they fill. manifest.json is written last, so a directory without one is an unfinished run.
"""

import argparse
import glob
import os
import sys
import time

from cli import UsageError, one_line_errors
from cli.remote_args import add_remote_arguments, configure_remote
from tokendata import corpus as corpora, remote, tokenizer as tokenizers
from tokendata.encode import encoded
from tokendata.packing import Packer
from tokendata.shards import dtype_for


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
                batch_chars=1 << 21, threads=None, force=False, progress=True, workers=1, eos=None, corpus=None):
    """Write the shards and manifest.json; return the manifest (plus a "stats" entry with counts and timings).
    corpus: a tokendata.corpus.Corpus of the inputs (default: `inputs` with their formats found)."""
    corpus = corpus or corpora.Corpus(inputs)
    if seq_len < 1 or samples_per_shard < 1 or workers < 1:
        raise UsageError(f"--seq-len, --samples-per-shard and --workers must be >= 1, got {seq_len}, "
                         f"{samples_per_shard} and {workers}")
    if not 0.0 <= val_fraction < 1.0:
        raise UsageError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    tok = tokenizers.prepare(tokenizer, eos)
    vocab, eos_id = tok.vocab_size(), tok.eos_id()
    if eos_id < 0:
        raise UsageError(f"tokenizer {tokenizer} has no eos id: retrain it with tools/train_tokenizer.py")
    dtype = dtype_for(vocab)
    prepare_out_dir(out, force)

    packer = Packer(out, seq_len, samples_per_shard, val_fraction, seed, dtype)
    n_docs = n_bytes = n_tokens = 0
    t0 = time.perf_counter()
    documents = corpus.documents(desc="tokenizing", progress=progress)
    for ids, docs, text_bytes in encoded(documents, tok, workers, threads or os.cpu_count() or 1, batch_chars):
        n_docs, n_bytes, n_tokens = n_docs + docs, n_bytes + text_bytes, n_tokens + len(ids)
        packer.add(ids)
    packer.close()
    seconds = time.perf_counter() - t0
    if packer.writers["train"].samples == 0:
        raise UsageError(f"{', '.join(corpus.paths)}: only {n_tokens} tokens, not one train sample of {seq_len + 1}: "
                         "give more text or a smaller --seq-len")
    manifest = packer.finish(tok, tokenizer, corpus.paths, corpus.describe())
    manifest["stats"] = {"documents": n_docs, "text_bytes": n_bytes, "stream_tokens": n_tokens, "seconds": seconds,
                         "dropped_tokens": packer.dropped, "skipped_records": corpus.skip_note()}
    return manifest


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    corpora.add_arguments(p)
    p.add_argument("--tokenizer", required=True, metavar="PATH",
                   help="a sentencepiece model from tools/train_tokenizer.py, a Hugging Face tokenizer.json, or a "
                        "local tokenizer directory that transformers.AutoTokenizer loads")
    p.add_argument("--eos", metavar="TOKEN", help="the token that ends a document, for a tokenizer that names none")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="where the shards and manifest.json go: a directory, or pipe:COMMAND that reads one file "
                        "from stdin, with {} for its name (pipe:aws s3 cp - s3://bucket/shards/{}), an fsspec URL "
                        "with its backend installed (s3://bucket/shards: credentials from the environment), or "
                        "https://host/path, each file written by one PUT (--ca-bundle, --header-from-env)")
    p.add_argument("--seq-len", type=int, required=True, help="n: each sample holds n+1 tokens")
    p.add_argument("--samples-per-shard", type=int, default=1000, help="samples in each .tar (default 1000)")
    p.add_argument("--val-fraction", type=float, default=0.01,
                   help="probability that a sample goes to val (default 0.01)")
    p.add_argument("--seed", type=int, default=0, help="seed of the train/val assignment (default 0)")
    p.add_argument("--workers", type=int, default=1,
                   help="encoding processes (default 1); the output is the same for any number")
    p.add_argument("--threads", type=int, default=None, help="encoding threads of each process (default: all cores)")
    p.add_argument("--batch-chars", type=int, default=1 << 21, metavar="N",
                   help="characters of documents encoded as one batch (default 2097152)")
    p.add_argument("--force", action="store_true", help="replace shards already in --out")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_remote_arguments(p)
    return p.parse_args(argv)


def wrote_line(out: str, m: dict) -> str:
    """The summary of a written shard set (its manifest `m`): its splits, length, vocabulary and dtype."""
    tr, va = m["splits"]["train"], m["splits"]["val"]
    return (f"wrote {out}: train {tr['samples']} samples in {len(tr['shards'])} shards, val {va['samples']} samples "
            f"in {len(va['shards'])} shards, seq_len={m['seq_len']}, vocab_size={m['vocab_size']}, dtype={m['dtype']}")


@one_line_errors
def main(argv=None):
    args = parse_args(argv)
    configure_remote(args)   # --out at an https:// URL: its CA and headers, as training reads it
    m = make_shards(args.input, args.tokenizer, args.out, args.seq_len, args.samples_per_shard, args.val_fraction,
                    args.seed, args.batch_chars, args.threads, args.force, not args.quiet, args.workers, args.eos,
                    corpora.Corpus.from_args(args))
    st, secs = m["stats"], max(m["stats"]["seconds"], 1e-9)
    print(wrote_line(args.out, m))
    print(f"read {st['documents']} documents, {st['text_bytes'] / 1e6:.1f} MB, {st['stream_tokens']} tokens "
          f"({st['dropped_tokens']} left over at the end) in {secs:.1f} s: "
          f"{st['text_bytes'] / 1e6 / secs:.2f} MB/s, {st['stream_tokens'] / secs:,.0f} tokens/s")
    if st["skipped_records"]:
        print(st["skipped_records"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
