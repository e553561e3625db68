#!/usr/bin/env python
"""Perplexity and bits per byte of a checkpoint or release, on held-out text files or a shard split.

    python tools/evaluate.py runs/demo --shards build/demo/shards --split val
    python tools/evaluate.py runs/demo-release --text heldout.txt [more.txt.gz ...] --stride 64 --json

CHECKPOINT: a release directory, any DeepSpeed checkpoint path (run directory, its checkpoints/, a step_* dir), or a
Hugging Face export (tools/convert.py to-hf; loaded through transformers, to check the export).
Reported: tokens scored, bytes they stand for, loss (mean NLL in nats per token), ppl = e^loss, bits_per_token =
loss / ln 2, and bits_per_byte = total NLL / ln 2 / bytes — comparable between tokenizers.

--text: each file is read like the training corpus (one document per non-empty line, stripped), tokenized with the
model's tokenizer into one stream [eos] doc_1 eos doc_2 eos … (the leading eos is the "new document" context the model
saw in training; it is not scored). Windows of L = max_seq_len tokens step by --stride: the first scores all its
tokens, each later one only its last `stride`, so every token is scored once with at least L − stride tokens of
context (stride 1: the full L − 1 for every token, L times the work of stride L). Bytes: the UTF-8 length of the
documents plus one newline per document (what the scored eos tokens stand for).
--shards: each sample of the split holds n+1 tokens; tokens 1..n are predicted from the ones before (as in training).
Bytes: the UTF-8 length of the decoded targets — each piece's text (▁ = one space, <0xNN> = one byte), eos = the
newline that ended its document, minus the space sentencepiece prepends to a document's first piece.
Errors are one line (exit 2): a path that is not a checkpoint, a missing file, a vocabulary mismatch.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tqdm import tqdm  # noqa: E402

from model import ConfigError  # noqa: E402
from tools.train_tokenizer import open_text  # noqa: E402


class UsageError(Exception):
    """A bad argument or input file: printed as one `error: ...` line, exit status 2."""


# ---- loading (shared by tools/generate.py and tools/plot_attention.py) ---------------------------------------------
def is_hf_export(path: str) -> bool:
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        return False
    with open(config) as f:
        return json.load(f).get("model_type") == "synthformer"


class HFLogits(torch.nn.Module):
    """A Hugging Face export (tools/convert.py to-hf) seen as the native model: tokens → logits, with `.cfg`."""

    def __init__(self, hf):
        super().__init__()
        self.hf, self.cfg = hf, hf.model.cfg

    def forward(self, tokens):
        return self.hf(tokens).logits


def load_hf(path: str):
    """(model, tokenizer path, info) of a Hugging Face export, loaded by transformers itself (remote code)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).eval()
    tokenizer = os.path.join(path, "tokenizer.model")
    step = (getattr(hf.config, "synthformer_training", None) or {}).get("step", 0)
    return HFLogits(hf), tokenizer if os.path.isfile(tokenizer) else None, {"source": path, "step": step}


def load(path: str, tokenizer: str | None = None, need_tokenizer: bool = True):
    """(model in eval mode at TP=1, SentencePieceProcessor or None, info {"source", "step"}); UsageError otherwise."""
    import sentencepiece as spm

    from pretrain.ds_checkpoint import load_any

    if not os.path.exists(path):
        raise UsageError(f"checkpoint {path} does not exist: pass a release directory or a DeepSpeed run/checkpoint")
    try:
        with contextlib.redirect_stdout(sys.stderr):   # DeepSpeed's import banner must not corrupt --json output
            model, found, info = load_hf(path) if is_hf_export(path) else load_any(path)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    except (OSError, RuntimeError, ValueError, KeyError) as e:   # a truncated or foreign file
        raise UsageError(f"cannot read checkpoint {path}: {str(e).strip().splitlines()[0]}") from None
    tokenizer = tokenizer or found
    if tokenizer is None:
        if need_tokenizer:
            raise UsageError(f"{info['source']} holds no tokenizer.model: pass --tokenizer PATH")
        return model, None, info
    try:
        sp = spm.SentencePieceProcessor(model_file=tokenizer)
    except (RuntimeError, OSError) as e:
        raise UsageError(f"cannot load tokenizer {tokenizer}: {str(e).strip().splitlines()[0]}") from None
    if sp.vocab_size() != model.cfg.vocab_size:
        raise UsageError(f"tokenizer {tokenizer} has {sp.vocab_size()} ids but the model's vocab_size is "
                         f"{model.cfg.vocab_size}: pass the tokenizer the model was trained with (--tokenizer)")
    return model, sp, info


# ---- the numbers -------------------------------------------------------------------------------------------------
def summarize(nll_nats: float, tokens: int, n_bytes: int) -> dict:
    """tokens, bytes, loss (nats/token), ppl, bits_per_token, bits_per_byte from the total NLL in nats."""
    loss = nll_nats / tokens
    return {"tokens": tokens, "bytes": n_bytes, "loss": loss, "ppl": math.exp(loss),
            "bits_per_token": loss / math.log(2), "bits_per_byte": nll_nats / math.log(2) / n_bytes}


@torch.no_grad()
def token_nll(model, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """−log p(target_t | inputs_≤t) (B, n) in fp32 nats."""
    logits = model(inputs).float()                                       # (B, n, V)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view_as(targets)


def piece_bytes(sp) -> tuple[torch.Tensor, torch.Tensor]:
    """(bytes (V,), starts_with_space (V,) bool): the UTF-8 bytes each id decodes to (eos: its newline; other control
    ids and unk: 0), and whether its text begins with ▁ (the dummy-prefix space at a document's start)."""
    n, space = torch.zeros(sp.vocab_size(), dtype=torch.int64), torch.zeros(sp.vocab_size(), dtype=torch.bool)
    for i in range(sp.vocab_size()):
        piece = sp.id_to_piece(i)
        if i == sp.eos_id():
            n[i] = 1
        elif sp.is_byte(i):
            n[i] = 1
        elif not (sp.is_control(i) or sp.is_unknown(i)):
            n[i], space[i] = len(piece.replace("▁", " ").encode("utf-8")), piece.startswith("▁")
    return n, space


def target_bytes(table, prev: torch.Tensor, targets: torch.Tensor, eos: int, dummy_prefix: bool) -> int:
    """UTF-8 bytes of the targets (any shape), given the token before each (a document starts after eos)."""
    n, space = table
    total = n[targets].sum()
    if dummy_prefix:   # sentencepiece's "▁" before a document's first piece is not in the text
        total = total - (space[targets] & (prev == eos)).sum()
    return int(total)


def windows(T: int, L: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, scored) over a stream of T+1 tokens (targets 1..T): inputs [begin, end), targets [begin+1,
    end+1), of which the last `scored` are new. The first window ends at min(L, T), each later one `stride` further."""
    out, end = [], min(L, T)
    out.append((0, end, end))
    while end < T:
        new_end = min(end + stride, T)
        out.append((new_end - L, new_end, new_end - end))
        end = new_end
    return out


def documents(text: str) -> list[str]:
    """Non-empty stripped lines, as tools/train_tokenizer.py and make_shards.py read a corpus."""
    return [line.strip() for line in text.splitlines() if line.strip()]


def evaluate_text(model, sp, texts: list[str], stride: int | None = None, batch_size: int = 8,
                  progress: bool = False) -> dict:
    """Sliding-window NLL over each text's stream [eos] doc eos doc eos …; see the module docstring.

    stride: 1 … L (default L/2). Returns summarize(...) plus the stride used.
    """
    L, eos = model.cfg.max_seq_len, sp.eos_id()
    stride = max(1, L // 2) if stride is None else stride
    if not 1 <= stride <= L:
        raise UsageError(f"--stride {stride} must be between 1 and the model's max_seq_len {L}")
    streams, n_bytes = [], 0
    for text in texts:
        docs = documents(text)
        ids = [eos]
        for doc in docs:
            ids += sp.encode(doc) + [eos]
        streams.append(torch.tensor(ids, dtype=torch.int64))
        n_bytes += sum(len(d.encode("utf-8")) + 1 for d in docs)
    total = sum(len(s) - 1 for s in streams)
    if total == 0:
        raise UsageError("the text holds no documents (every line is empty): nothing to evaluate")
    nll = 0.0
    with tqdm(total=total, unit="tok", desc="evaluating", disable=not progress, file=sys.stderr) as bar:
        for s in streams:
            wins = windows(len(s) - 1, L, stride)   # all of length L, or one shorter window: they stack
            for k in range(0, len(wins), batch_size):
                part = wins[k:k + batch_size]
                inputs = torch.stack([s[b:e] for b, e, _ in part])                       # (B, n)
                targets = torch.stack([s[b + 1:e + 1] for b, e, _ in part])              # (B, n)
                losses = token_nll(model, inputs, targets)                               # (B, n)
                nll += sum(losses[r, -c:].double().sum().item() for r, (_, _, c) in enumerate(part))
                bar.update(sum(c for _, _, c in part))
    return {**summarize(nll, total, n_bytes), "stride": stride}


def evaluate_shards(model, shard_dir: str, split: str = "val", batch_size: int = 8, max_samples: int | None = None,
                    progress: bool = False) -> dict:
    """NLL of tokens 1..n of every sample of a split (each once, in manifest order); bytes by the shards' tokenizer."""
    import sentencepiece as spm

    from pretrain.data import DataError, TokenStream, check_vocab, read_manifest, tokenizer_path

    try:
        manifest = read_manifest(shard_dir)
        check_vocab(manifest, model.cfg.vocab_size)
        n, L = manifest["seq_len"], model.cfg.max_seq_len
        if n > L:
            raise UsageError(f"shards in {shard_dir} have seq_len={n} > the model's max_seq_len={L}: "
                             f"evaluate on shards made with --seq-len ≤ {L}")
        stream = TokenStream(shard_dir, batch_size, n)
        batches = stream.val_batches(split=split)
    except DataError as e:
        raise UsageError(str(e)) from None
    sp = spm.SentencePieceProcessor(model_file=tokenizer_path(manifest))
    table, eos = piece_bytes(sp), manifest["eos_id"]
    dummy = sp.encode("a", out_type=str)[0].startswith("▁")
    # val_batches wraps round to the start to fill its last batch: stop after the split's sample count.
    available = sum(s["samples"] for s in manifest["splits"][split]["shards"])
    todo = available if max_samples is None else min(max_samples, available)
    nll, n_bytes, done = 0.0, 0, 0
    with tqdm(total=todo, unit="sample", desc=f"evaluating {split}", disable=not progress, file=sys.stderr) as bar:
        for batch in batches:
            tokens = batch["tokens"][:todo - done]                                         # (B, n+1)
            nll += token_nll(model, tokens[:, :-1], tokens[:, 1:]).double().sum().item()
            n_bytes += target_bytes(table, tokens[:, :-1], tokens[:, 1:], eos, dummy)
            done += len(tokens)
            bar.update(len(tokens))
            if done >= todo:
                break
    return {**summarize(nll, done * n, n_bytes), "samples": done}


# ---- command line ------------------------------------------------------------------------------------------------
def read_texts(paths: list[str]) -> list[str]:
    """Each file's text, plain or gzip (as the tokenizer trainer reads a corpus)."""
    texts = []
    for path in paths:
        if not os.path.isfile(path):
            raise UsageError(f"text file not found: {path}")
        with open(path, "rb") as raw:
            texts.append(open_text(raw).read())
    return texts


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="release directory or DeepSpeed run / checkpoints / step_* directory")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", nargs="+", metavar="FILE", help="held-out text (plain or .gz), a document a line")
    src.add_argument("--shards", metavar="DIR", help="a tools/make_shards.py output directory")
    p.add_argument("--split", default="val", help="shard split to evaluate (default val)")
    p.add_argument("--stride", type=int, default=None, help="--text window step, 1..max_seq_len (default L/2)")
    p.add_argument("--batch-size", type=int, default=8, help="windows or samples per forward (default 8)")
    p.add_argument("--max-samples", type=int, default=None, help="--shards: evaluate only the first N samples")
    p.add_argument("--tokenizer", metavar="PATH", help="tokenizer.model, if the checkpoint carries none (--text)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the human line")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def run(args) -> dict:
    if args.batch_size < 1 or (args.max_samples is not None and args.max_samples < 1):
        raise UsageError(f"--batch-size {args.batch_size} and --max-samples {args.max_samples} must be ≥ 1")
    texts = read_texts(args.text) if args.text else None   # inputs before the slow load: a typo fails fast
    if args.shards:
        from pretrain.data import DataError, read_manifest
        try:
            read_manifest(args.shards)
        except DataError as e:
            raise UsageError(str(e)) from None
    model, sp, info = load(args.checkpoint, args.tokenizer, need_tokenizer=bool(args.text))
    if texts is not None:
        result = evaluate_text(model, sp, texts, args.stride, args.batch_size, progress=not args.quiet)
        data = " ".join(args.text)
    else:
        result = evaluate_shards(model, args.shards, args.split, args.batch_size, args.max_samples,
                                 progress=not args.quiet)
        data = f"{args.shards}:{args.split}"
    return {**result, "source": info["source"], "step": info["step"], "data": data}


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        r = run(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(r))
    else:
        print(f"{r['source']} (step {r['step']}) on {r['data']}: {r['tokens']:,} tokens, {r['bytes']:,} bytes, "
              f"loss {r['loss']:.4f}, ppl {r['ppl']:.2f}, {r['bits_per_token']:.4f} bits/token, "
              f"{r['bits_per_byte']:.4f} bits/byte")
    return 0


if __name__ == "__main__":
    sys.exit(main())
