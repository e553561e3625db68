"""Incremental (cached) decoding: each new position is computed from a cache of the earlier ones, not from the prefix.

Legend: B batch, t0 positions already cached, m new positions i ∈ [t0, t1), t1 = t0 + m ≤ L = max_seq_len,
Hl heads, d_h head size, c SGU channels per head.

Why a cache is exact for every mixer of this repo: the output at position i depends on a position j < i only through
per-position quantities that never change once j has been computed, and row i of each map depends only on X_i, i and
fixed parameters:
    SynthesizedAttention  y_i = Σ_{j≤i} softmax_j(S[i, j]) v_j,  S = Σ_m α_m S_m (α = softmax(θ) for a mixture)
        dot                S[i, j] = q_i·k_j / √d_h, q_i = X_i W_q, k_j = X_j W_k (RoPE: rotated by i and j)
        dense              S[i, j] = σ(W_1 X_i + b_1)·W_2[j] + b_2[j]
        random(_fixed)     S[i, j] = R[i, j]
        factorized_random  S[i, j] = R_1[i]·R_2[j]
        factorized_dense   S[i, j] = A_i[j mod a]·B_i[⌊j/a⌋], A_i, B_i from X_i
      → cache v_j, plus k_j for a dot member.
    SGU (and gMLP blocks)  gate_i = Σ_{j≤i} W[i, j]·LN(Z2_j) + b[i]   → cache LN(Z2_j).
LayerNorms, MLPs and residual adds are per position. Caches are preallocated for L positions.

Positions are absolute, so a cache holds at most L of them. Past L, model/generate.py's sampler feeds the last L
tokens, which shifts every position (learned embeddings, W_2, R and W rows): nothing cached stays valid, and
`CachedLM` recomputes the window — exactly the full-recompute result. Works at TP=1 (what the tools load).
"""
from __future__ import annotations

import functools
import types

import torch
import torch.nn.functional as F

from .kernels import causal_mask, inv_sqrt
from .lm import SynthesizerLM
from .mixers import SpatialGatingMixer, SynthesizedAttention
from .synthesizers import Dense, DotProduct, FactorizedDense, FactorizedRandom, Random, heads


# ---- rows S[t0:t1, :t1] of each synthesizer, (B or 1, Hl, m, t1) -------------------------------------------------
class DotRows:
    """q_i·k_j/√d_h with k_j cached; RoPE rotates q and k by their absolute positions."""

    def __init__(self, synth: DotProduct, B: int, Hl: int, L: int, like: torch.Tensor):
        self.s = synth
        self.k = like.new_empty(B, Hl, L, synth.d_h)                     # (B, Hl, L, d_h)

    def _rotate(self, x, t0):
        if self.s.rope is None:
            return x
        # Rotary.forward always starts at position 0: hand it its tables from position t0 on.
        shifted = types.SimpleNamespace(cos=self.s.rope.cos[t0:], sin=self.s.rope.sin[t0:])
        return type(self.s.rope).forward(shifted, x)

    def __call__(self, x, t0, t1):
        q = self._rotate(heads(self.s.q(x), self.s.d_h), t0)             # (B, Hl, m, d_h)
        self.k[:, :, t0:t1] = self._rotate(heads(self.s.k(x), self.s.d_h), t0)
        return q @ self.k[:, :, :t1].transpose(-1, -2) * inv_sqrt(self.s.d_h)


def dense_rows(s: Dense, x, t0, t1):
    """σ(W_1 X_i + b_1) against the fixed key rows W_2[:t1], plus b_2[:t1]."""
    return s.hidden(x) @ s.w2[:, :t1].transpose(-1, -2) + s.w2_bias[:, None, :t1]


def random_rows(s: Random, x, t0, t1):
    return s.R[:, t0:t1, :t1].unsqueeze(0)                              # (1, Hl, m, t1)


def factorized_random_rows(s: FactorizedRandom, x, t0, t1):
    return (s.R1[:, t0:t1] @ s.R2[:, :t1].transpose(-1, -2)).unsqueeze(0)   # (1, Hl, m, t1)


def factorized_dense_rows(s: FactorizedDense, x, t0, t1):
    """All a·b products A_i[j mod a]·B_i[⌊j/a⌋] of row i (j < L), kept for keys j < t1."""
    h = torch.relu(heads(s.w1(x), s.d_h))                                # (B, Hl, m, d_h)
    A = h @ s.fa.transpose(-1, -2).unsqueeze(0) + s.fa_bias[:, None]      # (B, Hl, m, a)
    Bf = h @ s.fb.transpose(-1, -2).unsqueeze(0) + s.fb_bias[:, None]     # (B, Hl, m, b)
    return (Bf.unsqueeze(-1) * A.unsqueeze(-2)).flatten(-2)[..., :t1]    # (B, Hl, m, t1)


STATELESS_ROWS = {Dense: dense_rows, Random: random_rows, FactorizedRandom: factorized_random_rows,
                  FactorizedDense: factorized_dense_rows}


# ---- one cache per mixer family ----------------------------------------------------------------------------------
class AttentionCache:
    """SynthesizedAttention: y_i = Σ_{j≤i} softmax_j(Σ_m α_m S_m[i, j]) v_j, with v_j (B, Hl, L, d_h) cached."""

    def __init__(self, mixer: SynthesizedAttention, B: int, L: int, like: torch.Tensor):
        Hl = mixer.value.weight.shape[0] // mixer.d_h                    # heads on this rank
        self.mixer, self.v = mixer, like.new_empty(B, Hl, L, mixer.d_h)
        self.rows = [DotRows(s, B, Hl, L, like) if isinstance(s, DotProduct) else
                     functools.partial(STATELESS_ROWS[type(s)], s) for s in mixer.synth.values()]

    def step(self, x, t0):
        mixer, (B, m, _) = self.mixer, x.shape
        t1 = t0 + m
        self.v[:, :, t0:t1] = heads(mixer.value(x), mixer.d_h)          # (B, Hl, m, d_h)
        alpha = None if mixer.theta is None else torch.softmax(mixer.theta, dim=-1)   # (Hl, members)
        S = 0
        for k, rows in enumerate(self.rows):
            S_k = rows(x, t0, t1)                                        # (B or 1, Hl, m, t1)
            S = S + (S_k if alpha is None else alpha[:, k, None, None] * S_k)
        A = torch.softmax(S + causal_mask(t1, x.device, S.dtype)[t0:t1], dim=-1)   # rows i: keys j ≤ i
        y = A @ self.v[:, :, :t1]                                        # (B, Hl, m, d_h)
        return mixer.out(y.transpose(1, 2).reshape(B, m, -1))           # (B, m, d)


class GatingCache:
    """SGU: out_i = (Z1_i ⊙ (Σ_{j≤i} W[i, j]·LN(Z2_j) + b[i])) V, with LN(Z2_j) (B, L, Hl, c) cached."""

    def __init__(self, unit: SpatialGatingMixer, B: int, L: int, like: torch.Tensor):
        self.unit, self.z2 = unit, like.new_empty(B, L, unit.norm_weight.shape[0], unit.c)

    def step(self, x, t0):
        u, (B, m, _) = self.unit, x.shape
        t1 = t0 + m
        z = F.gelu(u.in_proj(x)).view(B, m, -1, 2, u.c)                  # (B, m, Hl, 2, c)
        z2 = F.layer_norm(z[..., 1, :], (u.c,), eps=u.eps) * u.norm_weight + u.norm_bias
        self.z2[:, t0:t1] = z2                                           # (B, m, Hl, c)
        W = u.spatial[:, t0:t1, :t1].tril(t0)                            # (Hl, m, t1): row i keeps j ≤ i = t0 + r
        gate = torch.einsum("hij,bjhc->bihc", W, self.z2[:, :t1])        # (B, m, Hl, c)
        gate = gate + u.spatial_bias[:, t0:t1].T[None, :, :, None]       # + b[i]
        return u.out((z[..., 0, :] * gate).reshape(B, m, -1))           # (B, m, d)


def unsupported_reason(model: SynthesizerLM) -> str | None:
    """None when every layer has a cache; else why not (the caller falls back to full recompute)."""
    for i, block in enumerate(model.blocks):
        mixer = block.mixer
        if isinstance(mixer, SpatialGatingMixer):
            continue
        if not isinstance(mixer, SynthesizedAttention):
            return f"layer {i}: no cache for mixer {type(mixer).__name__}"
        for name, s in mixer.synth.items():
            if not isinstance(s, DotProduct) and type(s) not in STATELESS_ROWS:
                return f"layer {i}: no cache for synthesizer '{name}' ({type(s).__name__})"
    return None


class IncrementalDecoder:
    """Feed positions in order, a chunk at a time (a prompt, then one token per step); get their logits.

    decoder(tokens (B, m)) → logits (B, m, V) of positions t0 … t0+m−1: rows t0… of model(all tokens so far).
    """

    def __init__(self, model: SynthesizerLM):
        reason = unsupported_reason(model)
        if reason:
            raise ValueError(f"incremental decoding unavailable: {reason}")
        self.model, self.t, self.caches = model, 0, None

    def reset(self):
        self.t, self.caches = 0, None

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        model, (B, m) = self.model, tokens.shape
        L, t0 = model.cfg.max_seq_len, self.t
        if model.training:
            raise ValueError("incremental decoding needs model.eval(): dropout would differ from the cached steps")
        if t0 + m > L:
            raise ValueError(f"{t0 + m} positions exceed model.max_seq_len L={L}; reset() and feed the last L tokens")
        x = model.wte(tokens)                                            # (B, m, d)
        if model.wpe is not None:
            x = x + model.wpe.weight[t0:t0 + m]
        if self.caches is None:
            self.caches = [(GatingCache if isinstance(b.mixer, SpatialGatingMixer) else AttentionCache)(
                b.mixer, B, L, x) for b in model.blocks]
        for block, cache in zip(model.blocks, self.caches):             # Block._forward, one chunk of positions
            x = x + cache.step(block.ln_1(x), t0)
            if block.mlp is not None:
                x = x + block.mlp(block.ln_2(x))
        self.t = t0 + m
        return model.logits(x)                                           # (B, m, V)


class CachedLM:
    """A stand-in for the model in `model.generate.sample(...)`: same sampling rules, one new position per step.

    cached(tokens (B, n)) → logits (B, n − t, V) of the positions it had not seen (t = how many it had; the sampler
    reads only the last row). A call whose tokens do not extend the previous ones — the first, a new batch, or the
    window that slides once n > L — resets the cache and prefills all n positions (a full recompute). With
    `use_cache=False`, or a model `unsupported_reason` rejects, every call is model(tokens). `on_call` (e.g. a
    progress bar's update) is called once per call.
    """

    def __init__(self, model: SynthesizerLM, use_cache: bool = True, on_call=None):
        self.model, self.cfg, self.on_call = model, model.cfg, on_call
        self.reason = "disabled" if not use_cache else unsupported_reason(model)
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
