"""Documents in a packed window (`model.document_mask`): Megatron's rule (--reset-attention-mask and
--reset-position-ids with its eod token), for every mixer of this repo.

Shards pack documents end to end, each closed by eos. The rule, per sample b of a window x (B, n):
    an eos ends the document it belongs to; the token after it starts a new document at position 0; the window's
    leading (partial) document starts at position 0 too.
    g[b, i] = #{j < i : x[b, j] = eos}                     the document of position i (`ids`)
    p[b, i] = i − s[b, i], s[b, i] = min{j : g[b, j] = g[b, i]}   its position within the document (`positions`)
    M[b, i, j] = 0 where j ≤ i and g[b, i] = g[b, j], −∞ elsewhere   the mask: causal ∧ same document
Every mixer masks with M and reads its position-indexed weights (learned positions, RoPE, dense's W_2 and b_2, R,
R_1/R_2, factorized dense's key columns, SGU's W and b) at p instead of i: docs/DESIGN.md §1 gives the formula of
each. The loss is kept at every position: predicting a document's first token from the eos is part of the objective.
The boundaries come from the tokens alone (no shard format change; a resumed run sees the same windows). Without
the setting no `Documents` exists and every path is the one of a single document per window (g = 0, p = i).

Where the mask is made, per forward pass (once, shared by the layers; in a pipeline each block makes its own from the
document ids that travel with the activations):
    CPU path   M as a (B, 1, n, n) tensor in the activations' dtype (SDPA takes it for q·k logits, the whole maps add
               it) and as booleans (SGU's map keeps its entries where they are true)
    GPU path   a FlexAttention BlockMask from g (torch.compile'd create_block_mask): no (n × n) tensor per sample;
               the kernel skips the tiles outside every document and evaluates the mask inside the rest
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from .kernels import on_gpu_path
from .qk_attention import with_key_bias

_compiled = {}   # name → torch.compile'd flex function, made at first use on a CUDA device


def document_ids(tokens: torch.Tensor, eos: int) -> torch.Tensor:
    """g (B, n): how many eos precede each position (an eos belongs to the document that it ends)."""
    ends = (tokens == eos).long()
    return ends.cumsum(1) - ends


def positions_in_documents(ids: torch.Tensor) -> torch.Tensor:
    """p (B, n) from g: i minus the first position of i's document (the window's first position starts one)."""
    i = torch.arange(ids.shape[1], device=ids.device)
    starts = F.pad(ids[:, 1:] != ids[:, :-1], (1, 0), value=True)            # (B, n): a document begins here
    return i - torch.where(starts, i, 0).cummax(1).values


def dense_mask(ids: torch.Tensor, t0: int = 0) -> torch.Tensor:
    """(B, 1, n − t0, n) bool, True where query i ≥ t0 may see key j: j ≤ i and the same document."""
    n = ids.shape[1]
    i, j = torch.arange(t0, n, device=ids.device), torch.arange(n, device=ids.device)
    return ((j[None, :] <= i[:, None]) & (ids[:, t0:, None] == ids[:, None, :])).unsqueeze(1)


class Documents:
    """The documents of a batch of windows: `ids` g and `positions` p (B, n), and the masks of the fused path of their
    device, made once when `fused` (a training or scoring pass): on the CPU path `allowed` (B, 1, n, n) bool and
    `mask`, M itself in `dtype`; on the GPU path `block_mask`. Decoding makes one without (`fused=False`) and reads
    the rows of its new positions from `dense_mask(t0)`."""

    def __init__(self, ids: torch.Tensor, fused: bool = True, dtype: torch.dtype = torch.float32):
        self.ids, self.positions = ids, positions_in_documents(ids)
        gpu, self.allowed, self.mask, self.block_mask = on_gpu_path(ids), None, None, None
        if fused and gpu:
            self.block_mask = block_mask(ids)
        elif fused:
            self.allowed = dense_mask(ids)                                            # (B, 1, n, n) bool
            self.mask = torch.zeros(self.allowed.shape, dtype=dtype, device=ids.device).masked_fill_(
                ~self.allowed, float("-inf"))                                         # (B, 1, n, n): 0 or −∞

    @classmethod
    def of(cls, tokens: torch.Tensor, eos: int, fused: bool = True, dtype: torch.dtype = torch.float32):
        return cls(document_ids(tokens, eos), fused, dtype)

    def dense_mask(self, t0: int = 0) -> torch.Tensor:
        """Rows t0… of M as (B, 1, n − t0, n) bool."""
        return self.allowed[:, :, t0:] if self.allowed is not None else dense_mask(self.ids, t0)


def _flex(name: str, fn, device: torch.device):
    """fn compiled on CUDA (eager FlexAttention materializes the scores; compiled, it is one fused kernel), as it is
    elsewhere: the CPU tests run its formula eagerly (forward only: FlexAttention has no CPU backward)."""
    if device.type != "cuda":
        return fn
    if name not in _compiled:
        _compiled[name] = torch.compile(fn, dynamic=False)
    return _compiled[name]


def block_mask(ids: torch.Tensor):
    """FlexAttention's BlockMask of M for document ids g (B, n): torchtitan's document masking."""
    def same_document(b, h, q, kv):
        return (kv <= q) & (ids[b, q] == ids[b, kv])

    B, n = ids.shape
    return _flex("create_block_mask", create_block_mask, ids.device)(same_document, B, None, n, n,
                                                                      device=ids.device)


def gathered_map(R: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """R[h, p_i, p_j] per sample: R (Hl, L, L), rows (B, m), cols (B, t) → (B, Hl, m, t)."""
    Hl, L = R.shape[0], R.shape[-1]
    B, m = rows.shape
    return columns(R.index_select(1, rows.flatten()).view(Hl, B, m, L).transpose(0, 1), cols)


def gathered_factors(A: torch.Tensor, Bf: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """S[b, h, i, j] = A_i[p_j mod a] · B_i[⌊p_j / a⌋]: A (B, Hl, m, a), Bf (B, Hl, m, b), cols p (B, t) → (B, Hl, m, t):
    all a·b products of a row (its L keys), then their columns p_j."""
    return columns((Bf.unsqueeze(-1) * A.unsqueeze(-2)).flatten(-2), cols)


def columns(T: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """T[b, …, cols[b, j]]: T (B, …, L), cols (B, t) → (B, …, t), by one index_select over the samples' columns side
    by side, whose backward keeps the B·t indices alone (a gather's would keep T, and index tensors of T's rank would
    be (B, m, t) integers)."""
    B, L, t = T.shape[0], T.shape[-1], cols.shape[1]
    flat = (cols + L * torch.arange(B, device=cols.device)[:, None]).flatten()       # (B·t)
    side_by_side = T.movedim(0, -2).reshape(*T.shape[1:-1], B * L)                   # (…, B·L), not kept
    return side_by_side.index_select(-1, flat).view(*T.shape[1:-1], B, t).movedim(-2, 0).contiguous()


def attention(v: torch.Tensor, docs: Documents, q=None, k=None, scale: float = 1.0, key_bias=None, R=None, w=None,
              factors=None) -> torch.Tensor:
    """softmax(S + M) v under the document mask, S the sum of the terms given, each at the positions p:
        scale · q kᵀ          q, k (B or 1, Hl, n, f): features already indexed by p (dense's W_2[p_j], R_1[p_i] …)
        + b_j                 key_bias (B or 1, Hl, n), b_2[p_j]
        + w ⊙ R[p_i, p_j]     R (Hl, L, L) the whole table, w (Hl,) or None
        + A_i[p_j mod a] · B_i[⌊p_j/a⌋]   factors (A, B) (B, Hl, n, a|b)
    v (B, Hl, n, d_h) → (B, Hl, n, d_h).
    GPU path: one compiled FlexAttention call with `docs.block_mask`, the map and the factors as its score_mod (their
    gradients are FlexAttention's own), q·k and the bias column as its features. CPU path: q·k alone (dot, dense,
    factorized_random and their mixtures) through SDPA with the boolean mask; with a map or factors the per-sample
    logits (B, Hl, n, n) are made whole (the map differs per sample: it is no longer one for the batch).
    """
    B, _, n, _ = v.shape
    if q is not None:
        q, k = with_key_bias(q.expand(B, -1, -1, -1), k.expand(B, -1, -1, -1), key_bias, scale)
    if on_gpu_path(v):
        return _flex_attention(v, docs, q, k, scale, R, w, factors)
    if R is None and factors is None:   # q, k, v at one width (zero features add nothing): SDPA's flash kernel
        width = v.shape[-1] if q.shape[-1] <= v.shape[-1] else -(-q.shape[-1] // 8) * 8   # 8: a CPU vector
        q, k, v_wide = (t if t.shape[-1] == width else F.pad(t, (0, width - t.shape[-1])) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v_wide, attn_mask=docs.mask.to(q.dtype), scale=scale)
        return out[..., :v.shape[-1]]
    p, S = docs.positions, docs.mask.to(v.dtype)                                   # (B, 1, n, n)
    if q is not None:
        S = S + (q * scale) @ k.transpose(-1, -2)
    if R is not None:   # weighted as a table (Hl, L, L): what backward keeps is R and w, not a weighted map
        S = S + gathered_map(R if w is None else w[:, None, None] * R, p, p)
    if factors is not None:
        S = S + gathered_factors(*factors, p)
    return torch.softmax(S, dim=-1) @ v                                              # A (B, Hl, n, n) kept


def _flex_attention(v, docs, q, k, scale, R, w, factors):
    B, Hl, n, _ = v.shape
    if q is None:   # no q·k member: zero features (FlexAttention's narrowest) under the score_mod's terms
        q = k = v.new_zeros(B, Hl, n, 16)
    p = docs.positions

    def score_mod(score, b, h, i, j):
        if R is not None:
            term = R[h, p[b, i], p[b, j]]
            score = score + (term if w is None else w[h] * term)
        if factors is not None:
            A, Bf = factors
            score = score + A[b, h, i, p[b, j] % A.shape[-1]] * Bf[b, h, i, p[b, j] // A.shape[-1]]
        return score

    mod = None if R is None and factors is None else score_mod
    return _flex("flex_attention", flex_attention, v.device)(q, k, v, score_mod=mod, block_mask=docs.block_mask,
                                                             scale=scale)
