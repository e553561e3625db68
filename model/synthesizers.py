"""The synthesizing functions of Tay et al. 2020: each one produces the logits S_h (n × n) of its heads.

Legend: B batch, n sequence length (n ≤ L = max_seq_len), d model width, H heads, Hl = H/TP heads on this rank,
d_h = d/H head size. X (B, n, d) is the block's normed input. Every per-head weight is stored as (Hl, …), split
over TP along dim 0, so a head's synthesizer lives on the rank that owns the head.

Each class is a `Synthesizer` (model/forms.py) and gives S two ways, both from the same parameters:
- `logits(x, t0, keys)`: rows t0 … t1−1 of the materialized map, (B or 1, Hl, m, t1) for the m = t1 − t0 positions
  of x — the paper's formula, used by `impl: reference`, attention maps and cached decoding (t0 > 0). A dot-product
  member's keys of positions < t1 come from the decoding cache (`keys(x, t0)` is what it caches per position);
  the whole map is `logits(x)`;
- `fused(x)`: S over all n positions in the form the fused kernels of model/kernels.py take (q·k features, a shared
  map, or factors: model/forms.py).
`flops(n)` counts forward multiply-adds ×2 per token of this function alone (projections and the n² terms).
Each is registered once, by name, in model/variants.py.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from .forms import FactorForm, MapForm, QKForm
from .kernels import inv_sqrt
# by name, not `from . import parallel`: a Hugging Face export loads this file from its config (model/variants.py),
# and transformers copies only the files it sees in `from .x import` lines
from .parallel import annotate, column_linear, constant, full_shape, normal, split_size

if TYPE_CHECKING:   # annotations only: model/config.py asks model/variants.py, which builds these, for the names
    from .config import ModelConfig


def heads(x: torch.Tensor, d_h: int) -> torch.Tensor:
    """(B, n, Hl·d_h) -> (B, Hl, n, d_h)."""
    B, n, _ = x.shape
    return x.view(B, n, -1, d_h).transpose(1, 2)


def per_head(n_heads: int, *shape: int, init) -> nn.Parameter:
    """A parameter of shape (H/TP, *shape) whose rows are heads: split over TP along the head dim."""
    local = split_size(n_heads, "model.n_heads")
    return annotate(nn.Parameter(torch.empty(local, *shape)), init, partition_dim=0)


def linear_flops(layer: nn.Module) -> int:
    d_out, d_in = full_shape(layer.weight)
    return 2 * d_out * d_in


class Rotary(nn.Module):
    """RoPE (Su et al.): rotates pairs (x_{2i}, x_{2i+1}) of q and k by angle t·base^(−2i/d_h) at position t — as
    one complex product per pair, (x_{2i} + i·x_{2i+1})·e^{iθ}, in fp32 (Llama's form: one elementwise kernel where
    the real form takes eight); an odd d_h's last feature is left as it is."""

    def __init__(self, d_h: int, max_len: int, base: float):
        super().__init__()
        inv_freq = base ** (-torch.arange(0, d_h - d_h % 2, 2, dtype=torch.float32) / d_h)   # (d_h/2,)
        angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)          # (L, d_h/2)
        self.register_buffer("cos", angles.cos(), persistent=False)   # real buffers: Module.to(dtype) keeps them
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor, offset: int = 0, positions: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, Hl, m, d_h) at positions offset…, or at `positions` (B, m) (in their documents)."""
        m, half = x.shape[-2], self.cos.shape[-1]
        at = slice(offset, offset + m) if positions is None else positions[:, None]       # (m,) or (B, 1, m)
        turn = torch.complex(self.cos[at].float(), self.sin[at].float())   # (m, d_h/2) or (B, 1, m, d_h/2)
        y = x[..., :2 * half].float()
        if any(stride % 2 for stride in y.stride()[:-1]):   # heads of odd d_h: views with an odd stride, which
            y = y.contiguous()                              # view_as_complex refuses; even ones stay views
        pairs = torch.view_as_complex(y.unflatten(-1, (half, 2)))                             # (B, Hl, m, d_h/2)
        rot = torch.view_as_real(pairs * turn).flatten(-2).to(x.dtype)                        # (B, Hl, m, 2·half)
        return rot if 2 * half == x.shape[-1] else torch.cat((rot, x[..., 2 * half:]), dim=-1)


class DotProduct(nn.Module):
    """Vanilla attention logits: S_h[i, j] = q_i · k_j / √d_h, q = X W_q^h, k = X W_k^h (optionally rotary).

    W_q, W_k: d → d column-parallel (heads split over TP). Table 1: 2d².
    """

    input_dependent, cached = True, True

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, self.d_h = cfg.d_model, cfg.head_dim
        self.q = column_linear(d, d, cfg.bias, cfg.init_std)
        self.k = column_linear(d, d, cfg.bias, cfg.init_std)
        self.rope = Rotary(self.d_h, cfg.max_seq_len, cfg.rope_base) if cfg.position == "rope" else None

    def _heads(self, y, t0, positions=None):
        y = heads(y, self.d_h)                                           # (B, Hl, m, d_h)
        if self.rope is None:
            return y
        rows = None if positions is None else positions[:, t0:t0 + y.shape[2]]
        return self.rope(y, t0, rows)                                    # rotated by the positions t0… or p

    def keys(self, x, t0=0, positions=None):
        """k_j of x's positions t0…: what a decoding cache keeps."""
        return self._heads(self.k(x), t0, positions)

    def projections(self):
        return [self.q, self.k]

    def fused(self, x, inputs, positions=None):
        q, k = self._heads(inputs[self.q], 0, positions), self._heads(inputs[self.k], 0, positions)
        return QKForm(q, k, inv_sqrt(self.d_h))

    def logits(self, x, t0=0, keys=None, positions=None):
        k = self.keys(x, 0, positions) if keys is None else keys         # (B, Hl, t1, d_h)
        return self._heads(self.q(x), t0, positions) @ k.transpose(-1, -2) * inv_sqrt(self.d_h)   # (B, Hl, m, t1)

    def flops(self, n):
        return linear_flops(self.q) + linear_flops(self.k) + 2 * n * full_shape(self.q.weight)[0]

    def activations(self, B, n, mixed=False, documents=False):
        """Elements it keeps for backward beyond the attention kernel's (model/memory.py), all heads: in a mixture,
        q (its product with the weight α keeps it); `documents`: under the document mask."""
        return {"q, kept by the mixture's weight α": B * n * full_shape(self.q.weight)[0]} if mixed else {}


class Dense(nn.Module):
    """Dense synthesizer: S_h[i, :] = W_2^h σ(W_1^h X_i + b_1^h) + b_2^h, σ = ReLU.

    W_1: d → d column-parallel (head h owns d_h outputs); W_2^h = `w2` (Hl, L, d_h), b_2^h = `w2_bias` (Hl, L):
    row j of W_2^h scores key position j; both sliced to the first n positions. Table 1: d² + dL.
    Fused: q = σ(W_1 X + b_1), k_j = W_2^h[j] (the same for every sample), scale 1, and a per-key bias b_2^h[j].
    """

    input_dependent, cached = True, False

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, L, self.d_h = cfg.d_model, cfg.max_seq_len, cfg.head_dim
        self.w1 = column_linear(d, d, cfg.bias, cfg.init_std)
        self.w2 = per_head(cfg.n_heads, L, self.d_h, init=normal(cfg.init_std))
        self.w2_bias = per_head(cfg.n_heads, L, init=constant(0.0))

    def hidden(self, h):
        return torch.relu(heads(h, self.d_h))                            # (B, Hl, n, d_h) from W_1 X + b_1

    def projections(self):   # W_1 X + b_1 apart: a slice of the joint GEMM would keep the whole of its output alive
        return []             # for backward, where ReLU keeps only its own output

    def fused(self, x, inputs, positions=None):
        n, q = x.shape[1], self.hidden(self.w1(x))   # q (B, Hl, n, d_h), k (1, Hl, n, d_h), b_2^h[j] for key j (Hl, n)
        if positions is not None:   # key j's row W_2[p_j], per sample: k (B, Hl, n, d_h), b (B, Hl, n)
            return QKForm(q, self.w2[:, positions].transpose(0, 1), 1.0, self.w2_bias[:, positions].transpose(0, 1))
        return QKForm(q, self.w2[:, :n].unsqueeze(0), 1.0, key_bias=self.w2_bias[:, :n])

    def logits(self, x, t0=0, keys=None, positions=None):
        t1, h = t0 + x.shape[1], self.hidden(self.w1(x))                 # keys j < t1: the rows W_2[j] (or W_2[p_j])
        if positions is not None:
            k, b = self.w2[:, positions].transpose(0, 1), self.w2_bias[:, positions].transpose(0, 1)
            return h @ k.transpose(-1, -2) + b[:, :, None]               # (B, Hl, m, t1)
        return h @ self.w2[:, :t1].transpose(-1, -2) + self.w2_bias[:, None, :t1]

    def flops(self, n):
        H_d_h = full_shape(self.w1.weight)[0]
        return linear_flops(self.w1) + 2 * n * H_d_h

    def activations(self, B, n, mixed=False, documents=False):
        H_d_h = full_shape(self.w1.weight)[0]
        out = {"hidden features σ(W_1 X)": B * n * H_d_h}
        if documents and mixed:   # b_2[p_j] gathered per sample, and its product with α keeps it
            out["key bias b_2[p_j] per sample, kept by the mixture's weight α"] = B * n * full_shape(self.w2)[0]
        return out


class Random(nn.Module):
    """Random synthesizer: S_h = R^h[:n, :n], R^h ∈ ℝ^{L×L} — `R` (Hl, L, L), trainable or (`frozen`) fixed.

    Table 1: H·L² trainable (0 when fixed; the frozen R is still a parameter, saved in checkpoints).
    Fused: softmax(R + M) is the same for every sample, so it is computed once per forward.
    """

    input_dependent, cached = False, False

    def __init__(self, cfg: ModelConfig, frozen: bool = False):
        super().__init__()
        L = cfg.max_seq_len
        self.R = per_head(cfg.n_heads, L, L, init=normal(cfg.random_init_std))
        self.R.requires_grad_(not frozen)

    def bias(self, n):   # at n = L, R itself: a full-size slice's backward would copy the whole (Hl, L, L) gradient
        return self.R if n == self.R.shape[-1] else self.R[:, :n, :n]    # (Hl, n, n)

    def projections(self):
        return []

    def fused(self, x, inputs, positions=None):
        return MapForm(self.bias(x.shape[1])) if positions is None else MapForm(self.R, positions)

    def logits(self, x, t0=0, keys=None, positions=None):
        t1 = t0 + x.shape[1]
        if positions is not None:                                        # R[p_i, p_j] per sample (B, Hl, m, t1)
            return self.R[:, positions[:, t0:, None], positions[:, None, :]].transpose(0, 1)
        return (self.bias(t1) if t0 == 0 else self.R[:, t0:t1, :t1]).unsqueeze(0)   # (1, Hl, m, t1)

    def flops(self, n):
        return 0

    def activations(self, B, n, mixed=False, documents=False):
        return {}   # R is a parameter; its softmax is the kernel's (model/memory.py)


class FactorizedRandom(nn.Module):
    """Factorized random synthesizer: S_h = R_1^h[:n] (R_2^h[:n])ᵀ, R_1^h, R_2^h ∈ ℝ^{L×k}; no dependence on X.

    `R1`, `R2`: (Hl, L, k). Table 1: 2·H·L·k. Fused: q = R_1, k = R_2 for every sample, scale 1.
    """

    input_dependent, cached = False, False

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        L, k = cfg.max_seq_len, cfg.factorized_k
        self.R1 = per_head(cfg.n_heads, L, k, init=normal(cfg.random_init_std / k ** 0.25))
        self.R2 = per_head(cfg.n_heads, L, k, init=normal(cfg.random_init_std / k ** 0.25))

    def projections(self):
        return []

    def fused(self, x, inputs, positions=None):
        n = x.shape[1]
        if positions is not None:   # R_1[p_i], R_2[p_j] per sample: (B, Hl, n, k) each
            return QKForm(self.R1[:, positions].transpose(0, 1), self.R2[:, positions].transpose(0, 1), 1.0)
        return QKForm(self.R1[:, :n].unsqueeze(0), self.R2[:, :n].unsqueeze(0), 1.0)   # (1, Hl, n, k) each

    def logits(self, x, t0=0, keys=None, positions=None):
        t1 = t0 + x.shape[1]
        if positions is not None:                                        # R_1[p_i] R_2[p_j]ᵀ (B, Hl, m, t1)
            return self.R1[:, positions[:, t0:]].transpose(0, 1) @ self.R2[:, positions].permute(1, 0, 3, 2)
        return (self.R1[:, t0:t1] @ self.R2[:, :t1].transpose(-1, -2)).unsqueeze(0)   # (1, Hl, m, t1)

    def flops(self, n):
        H, _, k = full_shape(self.R1)
        return 2 * n * k * H

    def activations(self, B, n, mixed=False, documents=False):
        if documents and mixed:   # R_1[p] gathered per sample, and its product with α keeps it
            H, _, k = full_shape(self.R1)
            return {"R_1[p] per sample, kept by the mixture's weight α": B * n * H * k}
        return {}   # its features are slices of R_1, R_2 (or, under the document mask, SDPA's inputs)


class FactorizedDense(nn.Module):
    """Factorized dense synthesizer, a·b = L: A_i = F_A^h(X_i) ∈ ℝ^a, B_i = F_B^h(X_i) ∈ ℝ^b,
    S_h[i, j] = A_i[j mod a] · B_i[⌊j/a⌋] — all a·b products, one per key position j < L, then sliced to n.

    F_A^h(X_i) = W_A^h σ(W_1^h X_i + b_1^h) + b_A^h with W_1: d → d column-parallel, `fa` (Hl, a, d_h),
    `fa_bias` (Hl, a); likewise `fb`, `fb_bias` with b. Table 1: d² + d(a+b).
    Fused: S has no q·k form; `factors(x)` feed a kernel that builds S one block of query rows at a time.
    """

    input_dependent, cached = True, False

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, self.d_h, a, b = cfg.d_model, cfg.head_dim, cfg.factorized_a, cfg.factorized_b
        self.w1 = column_linear(d, d, cfg.bias, cfg.init_std)
        self.fa = per_head(cfg.n_heads, a, self.d_h, init=normal(cfg.init_std))
        self.fa_bias = per_head(cfg.n_heads, a, init=constant(0.0))
        self.fb = per_head(cfg.n_heads, b, self.d_h, init=normal(cfg.init_std))
        self.fb_bias = per_head(cfg.n_heads, b, init=constant(0.0))

    def factors(self, h):
        """A (B, Hl, n, a), B (B, Hl, n, b) from h = W_1 X + b_1 — what the fused kernel builds S from, block by
        block."""
        h = torch.relu(heads(h, self.d_h))                                # (B, Hl, n, d_h)
        A = h @ self.fa.transpose(-1, -2).unsqueeze(0) + self.fa_bias[:, None]   # (B, Hl, n, a)
        Bf = h @ self.fb.transpose(-1, -2).unsqueeze(0) + self.fb_bias[:, None]  # (B, Hl, n, b)
        return A, Bf

    def projections(self):   # W_1 X + b_1 apart, as Dense's
        return []

    def fused(self, x, inputs, positions=None):
        return FactorForm(*self.factors(self.w1(x)), positions)

    def logits(self, x, t0=0, keys=None, positions=None):
        A, Bf = self.factors(self.w1(x))
        # S[..., j] with j = ⌊j/a⌋·a + (j mod a): row-major flattening of the (b, a) outer product.
        S = (Bf.unsqueeze(-1) * A.unsqueeze(-2)).flatten(-2)              # (B, Hl, m, L)
        if positions is not None:                                         # key j's column p_j (B, Hl, m, t1)
            return S.gather(-1, positions[:, None, None, :].expand(S.shape[0], S.shape[1], S.shape[2], -1))
        return S[..., :t0 + x.shape[1]]                                   # (B, Hl, m, t1)

    def flops(self, n):
        H, a, d_h = full_shape(self.fa)
        b = self.fb.shape[1]
        return linear_flops(self.w1) + 2 * H * d_h * (a + b) + H * n

    def activations(self, B, n, mixed=False, documents=False):
        H, a, d_h = full_shape(self.fa)
        b = full_shape(self.fb)[1]
        return {"hidden features σ(W_1 X), and the copy each factor product makes": 3 * B * n * H * d_h,
                "factors A, B": B * H * n * (a + b), "F_A, F_B broadcast over the batch": B * H * (a + b) * d_h}
