"""Incremental (cached) decoding: each new position is computed from a cache of the earlier ones, not from the prefix.

Legend: B batch, t0 positions already cached, m new positions i ∈ [t0, t1), t1 = t0 + m ≤ L = max_seq_len.

Why a cache is exact for every mixer of this repo: the output at position i depends on a position j < i only through
per-position quantities that never change once j has been computed, and row i of each map depends only on X_i, i and
fixed parameters (each synthesizer's `logits(x, t0, keys)` gives those rows, model/synthesizers.py):
    SynthesizedAttention   y_i = Σ_{j≤i} softmax_j(S[i, j]) v_j      → cache v_j, and k_j for a dot member
    SGU (and gMLP blocks)  gate_i = Σ_{j≤i} W[i, j]·LN(Z2_j) + b[i]   → cache LN(Z2_j)
LayerNorms, MLPs and residual adds are per position. The model's own forward computes the new rows (`Block.forward`
with `t0` and a `LayerCache`); this file keeps only the bookkeeping.

Under model.document_mask (model/documents.py) the decoder keeps the tokens it was fed: each call finds the documents
of all of them (an eos in the prompt or among the generated tokens ends one), and the new rows read their positions
in their documents and mask to their own document, as the training pass did.

Positions are absolute, so a cache holds at most L of them. Past L, model/generate.py's sampler feeds the last L
tokens, which shifts every position (learned embeddings, W_2, R and W rows): nothing cached stays valid, and
`CachedLM` recomputes the window — exactly the full-recompute result. Works at TP=1 (what the tools load).
"""
from __future__ import annotations

import inspect

import torch

from .lm import SynthesizerLM


class LayerCache:
    """One layer's per-position tensors (values, keys, LN(Z2)), each (…, L, f), allocated at first use."""

    def __init__(self, L: int):
        self.L, self.buffers = L, {}

    def extend(self, name: str, rows: torch.Tensor, t0: int) -> torch.Tensor:
        """Store `rows` (…, m, f) as positions t0 … t1−1 of `name`; return positions 0 … t1−1 (…, t1, f)."""
        t1 = t0 + rows.shape[-2]
        if name not in self.buffers:
            self.buffers[name] = rows.new_empty(rows.shape[:-2] + (self.L, rows.shape[-1]))
        buffer = self.buffers[name]
        buffer[..., t0:t1, :] = rows
        return buffer[..., :t1, :]


def documents_so_far(model: SynthesizerLM, seen: torch.Tensor | None, tokens: torch.Tensor):
    """(every token fed so far (B, t1), their documents) under model.document_mask, else (None, None): `seen` the
    tokens of the cached positions, `tokens` (B, m) the new ones."""
    if not model.cfg.document_mask:
        return None, None
    seen = tokens if seen is None else torch.cat((seen, tokens), dim=1)
    return seen, model.documents(seen, fused=False)


def decodes_incrementally(model) -> bool:
    """Whether the model's blocks take a cache (an export carries the model code of its day)."""
    return all("cache" in inspect.signature(block.forward).parameters for block in model.blocks)


class IncrementalDecoder:
    """Feed positions in order, a chunk at a time (a prompt, then one token per step); get their logits.

    decoder(tokens (B, m)) → logits (B, m, V) of positions t0 … t0+m−1: rows t0… of model(all tokens so far).
    """

    def __init__(self, model: SynthesizerLM):
        self.model, self.t, self.caches, self.tokens = model, 0, None, None

    def reset(self):
        self.t, self.caches, self.tokens = 0, None, None

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        model, t0, L = self.model, self.t, self.model.cfg.max_seq_len
        if model.training:
            raise ValueError("incremental decoding needs model.eval(): dropout would differ from the cached steps")
        if t0 + tokens.shape[1] > L:
            raise ValueError(f"{t0 + tokens.shape[1]} positions exceed model.max_seq_len L={L}; reset() and feed the "
                             f"last L tokens")
        if self.caches is None:
            self.caches = [LayerCache(L) for _ in model.blocks]
        x, docs = self.embedded(tokens)                                  # (B, m, d)
        for block, cache in zip(model.blocks, self.caches):
            x = block(x, t0=t0, cache=cache, docs=docs)
        self.t = t0 + tokens.shape[1]
        return model.logits(x)                                           # (B, m, V)


    def embedded(self, tokens: torch.Tensor):
        """(the embedded new positions (B, m, d), the documents of every position fed so far, or None)."""
        self.tokens, docs = documents_so_far(self.model, self.tokens, tokens)
        return self.model.embed(tokens, self.t, docs), docs


class CachedLM:
    """A stand-in for the model in `model.generate.sample(...)`: same sampling rules, one new position per step.

    cached(tokens (B, n)) → logits (B, n − t, V) of the positions it had not seen (t = how many it had; the sampler
    reads only the last row). A call whose tokens do not extend the previous ones — the first, a new batch, or the
    window that slides once n > L — resets the cache and prefills all n positions (a full recompute). With
    `use_cache=False` every call is model(tokens). `on_call` (e.g. a progress bar's update) is called once per call.
    """

    def __init__(self, model: SynthesizerLM, use_cache: bool = True, on_call=None):
        self.model, self.cfg, self.on_call = model, model.cfg, on_call
        self.reason = None if use_cache else "the cache is disabled"
        if use_cache and not decodes_incrementally(model):
            self.reason = "the model's code predates incremental decoding (a Hugging Face export made before it)"
        self.decoder = None if self.reason else IncrementalDecoder(model)
        self.seen, self.recomputes = None, 0

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.on_call:
            self.on_call()
        if self.decoder is None:
            with torch.no_grad():
                return self.model(tokens)
        t = 0 if self.seen is None else self.seen.shape[1]
        if not (self.seen is not None and tokens.shape[0] == self.seen.shape[0] and tokens.shape[1] > t
                and torch.equal(tokens[:, :t], self.seen)):
            self.decoder.reset()
            self.recomputes, t = self.recomputes + 1, 0
        logits = self.decoder(tokens[:, t:])
        self.seen = tokens
        return logits

    def describe(self) -> str:
        """What the calls so far did, in words: "incremental"; "incremental up to max_seq_len=L, then k full
        recomputes of the sliding window"; or "full recompute: <reason>" (no cache at all)."""
        if self.reason:
            return f"full recompute: {self.reason}"
        slid = self.recomputes - 1   # the first call's prefill is not one
        if slid <= 0:
            return "incremental"
        return (f"incremental up to max_seq_len={self.cfg.max_seq_len}, then {slid} full recompute"
                f"{'s' if slid > 1 else ''} of the sliding window")
