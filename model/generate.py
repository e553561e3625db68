"""Sampling from a SynthesizerLM: every step hands the model the last ≤ max_seq_len tokens (a CachedLM of
model/decoding.py computes only the new position of them).

Works under TP: each rank computes its vocabulary slice and the logits of the last position are gathered, so
every rank draws the same token from the same seeded generator.
"""
from __future__ import annotations

import torch

from . import parallel as tp


@torch.no_grad()
def sample(model, prompt: torch.Tensor, n_tokens: int, temperature: float = 1.0, top_k: int | None = None,
           top_p: float | None = None, seed: int = 0) -> torch.Tensor:
    """prompt (B, t) int64 -> (B, t + n_tokens): ancestral sampling with temperature, top-k and nucleus (top-p)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    L, tokens = model.cfg.max_seq_len, prompt
    for _ in range(n_tokens):
        logits = tp.gather_last_dim(model(tokens[:, -L:])[:, -1]).float().cpu()   # (B, V)
        if temperature <= 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k:
                kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = torch.softmax(logits, dim=-1)
            if top_p is not None and top_p < 1.0:
                p_sorted, idx = probs.sort(dim=-1, descending=True)
                drop = p_sorted.cumsum(-1) - p_sorted > top_p        # keep the smallest set reaching top_p
                probs = probs.scatter(-1, idx, p_sorted.masked_fill(drop, 0.0))
            nxt = torch.multinomial(probs, 1, generator=g)
        tokens = torch.cat((tokens, nxt.to(tokens.device)), dim=1)
    return tokens
