"""Perplexity and bits per byte of a model on text files or a shard split (tools/evaluate.py documents the
definitions: windows, strides, what the bytes of a token are)."""
from __future__ import annotations

import math
import sys
import tempfile

import torch
from tqdm import tqdm

from cli import UsageError
from model.parallel import cross_entropy
from tokendata import tokenizer as tokenizers
from tokendata.corpus import documents
from tokendata.shards import DataError, check_seq_len, check_vocab, read_manifest, tokenizer_path
from tokendata.stream import TokenStream


def summarize(nll_nats: float, tokens: int, n_bytes: int) -> dict:
    """tokens, bytes, loss (nats/token), ppl, bits_per_token, bits_per_byte from the total NLL in nats."""
    loss = nll_nats / tokens
    return {"tokens": tokens, "bytes": n_bytes, "loss": loss, "ppl": math.exp(loss),
            "bits_per_token": loss / math.log(2), "bits_per_byte": nll_nats / math.log(2) / n_bytes}


@torch.no_grad()
def token_nll(model, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """−log p(target_t | inputs_≤t) (B, n) in fp32 nats: the per-token cross-entropy the training loss averages."""
    return cross_entropy(model(inputs), targets)                         # logits (B, n, V) → (B, n)


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


def decoded_bytes(tok, tokens: torch.Tensor, eos: int) -> int:
    """UTF-8 bytes of the decoded targets 1..n of each sample (B, n+1), for tokenizers whose pieces do not add up
    (a Hugging Face tokenizer's decoder joins them): the documents between eos are decoded, one byte per eos (the
    document boundary, as for sentencepiece), and a first segment that continues the document of token 0 counts as
    text(token 0 + segment) − text(token 0)."""
    total = 0
    for row in tokens.tolist():
        segments, current = [], []
        for t in row[1:]:
            if t == eos:
                segments.append(current)
                current = []
            else:
                current.append(t)
        first, *rest = segments + [current]
        context = [] if row[0] == eos else [row[0]]
        total += len(tok.decode(context + first).encode()) - len(tok.decode(context).encode())
        total += sum(len(tok.decode(s).encode()) for s in rest) + len(rest)
    return total


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


def evaluate_text(model, sp, texts: list, stride: int | None = None, batch_size: int = 8,
                  progress: bool = False) -> dict:
    """Sliding-window NLL over each text's stream [eos] doc eos doc eos …; see the module docstring. A text: a string
    (a document a line) or a list of documents (tokendata/corpus.py's records, newlines kept).

    stride: 1 … L (default L/2). Returns summarize(...) plus the stride used.
    """
    L, eos = model.cfg.max_seq_len, sp.eos_id()
    stride = max(1, L // 2) if stride is None else stride
    if not 1 <= stride <= L:
        raise UsageError(f"--stride {stride} must be between 1 and the model's max_seq_len {L}")
    streams, n_bytes = [], 0
    for text in texts:
        docs = documents(text) if isinstance(text, str) else text
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
    try:
        manifest = read_manifest(shard_dir)
        check_vocab(manifest, model.cfg.vocab_size)
        check_seq_len(manifest, model.cfg.max_seq_len)
        n = manifest["seq_len"]
        stream = TokenStream(shard_dir, batch_size, n)
        batches = stream.val_batches(split=split)
    except DataError as e:
        raise UsageError(str(e)) from None
    sp = tokenizers.load(tokenizers.local_copy(tokenizer_path(manifest), tempfile.gettempdir()))
    eos = manifest["eos_id"]
    if sp.kind == tokenizers.SENTENCEPIECE:   # bytes from a table of the pieces' texts
        table, dummy = piece_bytes(sp), sp.encode("a", out_type=str)[0].startswith("▁")
        count = lambda tokens: target_bytes(table, tokens[:, :-1], tokens[:, 1:], eos, dummy)  # noqa: E731
    else:
        count = lambda tokens: decoded_bytes(sp, tokens, eos)  # noqa: E731
    # val_batches wraps round to the start to fill its last batch: stop after the split's sample count.
    available = sum(s["samples"] for s in manifest["splits"][split]["shards"])
    todo = available if max_samples is None else min(max_samples, available)
    nll, n_bytes, done = 0.0, 0, 0
    with tqdm(total=todo, unit="sample", desc=f"evaluating {split}", disable=not progress, file=sys.stderr) as bar:
        for batch in batches:
            tokens = batch["tokens"][:todo - done]                                         # (B, n+1)
            nll += token_nll(model, tokens[:, :-1], tokens[:, 1:]).double().sum().item()
            n_bytes += count(tokens)
            done += len(tokens)
            bar.update(len(tokens))
            if done >= todo:
                break
    return {**summarize(nll, done * n, n_bytes), "samples": done}
