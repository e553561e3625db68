#!/usr/bin/env python
"""Perplexity and bits per byte of a checkpoint or release, on held-out text files or a shard split.

    python tools/evaluate.py runs/demo --shards build/demo/shards --split val
    python tools/evaluate.py runs/demo-release --text heldout.txt [more.txt.gz ...] --stride 64 --json
    python tools/evaluate.py runs/demo-release --shards https://host/shards --header-from-env Authorization=TOKEN

CHECKPOINT: a release directory, any DeepSpeed checkpoint path (run directory, its checkpoints/, a step_* dir; also
in a bucket, s3://bucket/prefix[/step_*], downloaded first), or a Hugging Face export (tools/convert.py to-hf; loaded through transformers, to check the export).
Reported: tokens scored, bytes they stand for, loss (mean NLL in nats per token), ppl = e^loss, bits_per_token =
loss / ln 2, and bits_per_byte = total NLL / ln 2 / bytes — comparable between tokenizers.

--text: each input is read like the training corpus (tokendata/corpus.py: text files one document per non-empty line,
stripped; JSONL, Parquet or a Hugging Face dataset one document a record, newlines kept), tokenized with the
model's tokenizer into one stream [eos] doc_1 eos doc_2 eos … (the leading eos is the "new document" context the model
saw in training; it is not scored). Windows of L = max_seq_len tokens step by --stride: the first scores all its
tokens, each later one only its last `stride`, so every token is scored once with at least L − stride tokens of
context (stride 1: the full L − 1 for every token, L times the work of stride L). Bytes: the UTF-8 length of the
documents plus one newline per document (what the scored eos tokens stand for).
--shards: each sample of the split holds n+1 tokens; tokens 1..n are predicted from the ones before (as in training).
Bytes: the UTF-8 length of the decoded targets — each piece's text (▁ = one space, <0xNN> = one byte), eos = the
newline that ended its document, minus the space sentencepiece prepends to a document's first piece; for a Hugging
Face tokenizer the bytes of the decoded text of each document (one byte for each eos).
Errors are one line (exit 2): a path that is not a checkpoint, a missing file, a vocabulary mismatch.
"""
from __future__ import annotations

import argparse
import json
import sys

from cli import UsageError, one_line_errors
from cli.remote_args import add_remote_arguments, configure_remote
from evaluation.loading import load, local
from evaluation.prompts import run_data
from evaluation.perplexity import evaluate_shards, evaluate_text
from tokendata.corpus import Corpus, add_record_arguments
from tokendata.shards import read_manifest


# ---- command line ------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="release directory or DeepSpeed run / checkpoints / step_* directory")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", nargs="+", metavar="PATH",
                     help="held-out text (plain, .gz, .zst; a document a line), JSONL, Parquet or a Hugging Face "
                          "dataset (tokendata/corpus.py; --format, --text-key, --dataset-split)")
    src.add_argument("--shards", metavar="DIR", help="a tools/make_shards.py output directory")
    p.add_argument("--split", default="val", help="shard split to evaluate (default val)")
    p.add_argument("--stride", type=int, default=None, help="--text window step, 1..max_seq_len (default L/2)")
    p.add_argument("--batch-size", type=int, default=8, help="windows or samples per forward (default 8)")
    p.add_argument("--max-samples", type=int, default=None, help="--shards: evaluate only the first N samples")
    p.add_argument("--tokenizer", metavar="PATH",
                   help="tokenizer.model or tokenizer.json, if the checkpoint carries none (--text)")
    add_record_arguments(p, split_flag="--dataset-split")
    add_remote_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the human line")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def run(args) -> dict:
    if args.batch_size < 1 or (args.max_samples is not None and args.max_samples < 1):
        raise UsageError(f"--batch-size {args.batch_size} and --max-samples {args.max_samples} must be ≥ 1")
    # inputs before the slow load: a typo fails fast
    texts = Corpus.from_args(args, args.text).per_input() if args.text else None
    args.checkpoint = local(args.checkpoint)   # one in a bucket: downloaded (its config tells how the run read data)
    if args.shards:
        configure_remote(args, run_data(args.checkpoint))   # shards at a URL: as the run read them, or the flags
        read_manifest(args.shards)
    model, sp, info = load(args.checkpoint, args.tokenizer, need_tokenizer=bool(args.text))
    if texts is not None:
        result = evaluate_text(model, sp, texts, args.stride, args.batch_size, progress=not args.quiet)
        data = " ".join(args.text)
    else:
        result = evaluate_shards(model, args.shards, args.split, args.batch_size, args.max_samples,
                                 progress=not args.quiet)
        data = f"{args.shards}:{args.split}"
    return {**result, "source": info["source"], "step": info["step"], "data": data}


@one_line_errors
def main(argv=None) -> int:
    args = parse_args(argv)
    r = run(args)
    if args.json:
        print(json.dumps(r))
    else:
        print(f"{r['source']} (step {r['step']}) on {r['data']}: {r['tokens']:,} tokens, {r['bytes']:,} bytes, "
              f"loss {r['loss']:.4f}, ppl {r['ppl']:.2f}, {r['bits_per_token']:.4f} bits/token, "
              f"{r['bits_per_byte']:.4f} bits/byte")
    return 0


if __name__ == "__main__":
    sys.exit(main())
