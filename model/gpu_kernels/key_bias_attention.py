"""Flash attention with a per-key bias: the GPU kernel of dense+dot at its own widths (q·k features 256, values 128).

    O = softmax(scale·q kᵀ + b + M) v      q, k (B, Hl, n, f), v (B, Hl, n, d_v), b (Hl, n): S_ij gains b_j

b is dense's b_2 (weighted by α in a mixture), shared by the batch and by every query row. SDPA takes no bias that
needs a gradient on its flash path, and as a feature column b would take q, k past its 256 (f = 2·d_h at d_h 128),
so model/kernels.py carried it on the values: [e ⊙ v, e] with e_j = e^{b_j − max b}, v padded to 256, and a row sum
(the output's last column, P e) to normalize. Here no column and no normalizer: b's tile (BLOCK,) is added to each
score tile, broadcast over its rows, before the online softmax, which normalizes as for any score. The tiles keep
their power-of-two widths (f → F, d_v → DV; tl.dot's need), v stays at d_v, and b is added in fp32 (any spread
of b is exact; the value-factor form underflows past a spread of ~80). In the pattern of FlashAttention-2 (Dao
2023) and biased_attention.py:
- forward, one program per (block of BLOCK query rows, sample, head): key blocks up to the diagonal only, online
  softmax, O and the rows' logsumexp L kept for backward;
- backward, recomputing P = exp(S − L) tile by tile, with D_i = dO_i · O_i:
      dV = Pᵀ dO,  dP = dO vᵀ,  dS = P ⊙ (dP − D),  dK = scale·dSᵀ q,  dQ = scale·dS k,  db_j = Σ_b Σ_i dS_ij.
  One program per (key block, sample, head) makes dK, dV and its column sums of dS (fp32, (B, Hl, n); summed over
  the batch after); dQ has its own kernel, one program per query block: no atomics, deterministic.
FLOPs per (sample, head), causal (n²/2 pairs): forward n²·(f + d_v), backward n²·(4f + 3d_v) (S, dP, dV, dK; then S,
dP, dQ again) — at f 256, d_v 128 1792·n², as many as SDPA's on the value-factor form (v at 256: n²·(2 + 5)·256);
what goes is that form's work outside the kernel: [e ⊙ v, e] and its padding to 256 (B·Hl·n·256 each), an output
twice as wide to keep and to slice and divide. Memory: O (B·Hl·n·d_v) and L, D, db's partials (B·Hl·n fp32 each);
nothing n² is kept. Runs on CPU tensors under TRITON_INTERPRET=1 (the tests), where BLOCK is 16.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernels import at_autocast_dtype
from .flash import (block, causal, dot, exact, online_softmax, outputs, program, row_deltas,
                    rows, softmax_start, store_output, tile, width)

MAX_WIDTH = 256   # the widest q·k features and values whose tiles a program keeps (F, DV ≤ 256)


@triton.jit
def _scores(q, k, Bias, rows, cols, n, scale, IEEE: tl.constexpr):
    """S tile in fp32: scale·q kᵀ + b_j (the keys' bias broadcast over the rows), −inf above the diagonal and
    past n. 2·BLOCK²·F FLOPs."""
    b = tl.load(Bias + cols, mask=cols < n, other=0.0).to(tl.float32)                    # (BLOCK,) keys' bias
    return causal(scale * dot(q, tl.trans(k), IEEE) + b[None, :], rows, cols, n)          # (BLOCK, BLOCK)


@triton.jit
def _stats(L, D, bh, rows, n):
    """The rows' logsumexp L and D = dO · O of one (sample, head), (BLOCK,) each."""
    return tl.load(L + bh * n + rows, mask=rows < n, other=0.0), tl.load(D + bh * n + rows, mask=rows < n, other=0.0)


@triton.jit
def _fwd(Q, K, V, Bias, O, L, n, H, scale, s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_ob, s_oh, s_on,
         s_bh, f, dv, F: tl.constexpr, DV: tl.constexpr, BLOCK: tl.constexpr, IEEE: tl.constexpr):
    """O and L of query block i of one (sample, head): the online softmax over the key blocks up to the diagonal."""
    i0, b, h, bh = program(BLOCK, H)
    rows, feat, vcol = i0 + tl.arange(0, BLOCK), tl.arange(0, F), tl.arange(0, DV)
    q = tile(Q + b * s_qb + h * s_qh, rows, feat, s_qn, n, f)                            # (BLOCK, F)
    m_i, l_i, acc = softmax_start(BLOCK, DV)
    for j0 in range(0, i0 + BLOCK, BLOCK):   # key blocks up to the diagonal block; the ones above are skipped
        cols = j0 + tl.arange(0, BLOCK)
        k = tile(K + b * s_kb + h * s_kh, cols, feat, s_kn, n, f)                        # (BLOCK, F)
        v = tile(V + b * s_vb + h * s_vh, cols, vcol, s_vn, n, dv)                       # (BLOCK, DV)
        s = _scores(q, k, Bias + h * s_bh, rows, cols, n, scale, IEEE)                   # (BLOCK, BLOCK)
        m_i, l_i, acc = online_softmax(s, v, m_i, l_i, acc, IEEE)                        # P v: 2·BLOCK²·DV FLOPs
    store_output(O + b * s_ob + h * s_oh, L + bh * n, acc, l_i, m_i, rows, vcol, s_on, n, dv)


@triton.jit
def _bwd_kv(Q, K, V, Bias, DO, L, D, DK, DVb, DB, n, H, scale,
            s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_ob, s_oh, s_on, s_bh,
            s_dkb, s_dkh, s_dkn, s_dvb, s_dvh, s_dvn,
            f, dv, F: tl.constexpr, DV: tl.constexpr, BLOCK: tl.constexpr, IEEE: tl.constexpr):
    """dK, dV of key block j of one (sample, head), and Σ_i dS_ij of its keys into DB (B, Hl, n) fp32."""
    j0, b, h, bh = program(BLOCK, H)
    cols, feat, vcol = j0 + tl.arange(0, BLOCK), tl.arange(0, F), tl.arange(0, DV)
    k = tile(K + b * s_kb + h * s_kh, cols, feat, s_kn, n, f)                            # (BLOCK, F)
    v = tile(V + b * s_vb + h * s_vh, cols, vcol, s_vn, n, dv)                           # (BLOCK, DV)
    dk = tl.zeros((BLOCK, F), tl.float32)
    dv_acc = tl.zeros((BLOCK, DV), tl.float32)
    db = tl.zeros((BLOCK,), tl.float32)
    for i0 in range(j0, n, BLOCK):   # query blocks at or below the diagonal
        rows = i0 + tl.arange(0, BLOCK)
        q = tile(Q + b * s_qb + h * s_qh, rows, feat, s_qn, n, f)                        # (BLOCK, F)
        do = tile(DO + b * s_ob + h * s_oh, rows, vcol, s_on, n, dv)                     # (BLOCK, DV)
        lse, delta = _stats(L, D, bh, rows, n)                                           # (BLOCK,) each
        p = tl.exp(_scores(q, k, Bias + h * s_bh, rows, cols, n, scale, IEEE) - lse[:, None])   # (BLOCK, BLOCK)
        dv_acc += dot(tl.trans(p.to(do.dtype)), do, IEEE)                                # 2·BLOCK²·DV FLOPs
        ds = p * (dot(do, tl.trans(v), IEEE) - delta[:, None])                           # dS = P ⊙ (dO vᵀ − D)
        dk += dot(tl.trans(ds.to(q.dtype)), q, IEEE)                                     # 2·BLOCK²·F FLOPs
        db += tl.sum(ds, 0)                                                              # (BLOCK,) column sums
    tl.store(DK + b * s_dkb + h * s_dkh + cols[:, None] * s_dkn + feat[None, :], (scale * dk).to(DK.dtype.element_ty),
             mask=(cols[:, None] < n) & (feat[None, :] < f))
    tl.store(DVb + b * s_dvb + h * s_dvh + cols[:, None] * s_dvn + vcol[None, :], dv_acc.to(DVb.dtype.element_ty),
             mask=(cols[:, None] < n) & (vcol[None, :] < dv))
    tl.store(DB + bh * n + cols, db, mask=cols < n)


@triton.jit
def _bwd_q(Q, K, V, Bias, DO, L, D, DQ, n, H, scale,
           s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_ob, s_oh, s_on, s_bh, s_dqb, s_dqh, s_dqn,
           f, dv, F: tl.constexpr, DV: tl.constexpr, BLOCK: tl.constexpr, IEEE: tl.constexpr):
    """dQ of query block i of one (sample, head): scale·dS k over the key blocks up to the diagonal."""
    i0, b, h, bh = program(BLOCK, H)
    rows, feat, vcol = i0 + tl.arange(0, BLOCK), tl.arange(0, F), tl.arange(0, DV)
    q = tile(Q + b * s_qb + h * s_qh, rows, feat, s_qn, n, f)                            # (BLOCK, F)
    do = tile(DO + b * s_ob + h * s_oh, rows, vcol, s_on, n, dv)                         # (BLOCK, DV)
    lse, delta = _stats(L, D, bh, rows, n)                                               # (BLOCK,) each
    dq = tl.zeros((BLOCK, F), tl.float32)
    for j0 in range(0, i0 + BLOCK, BLOCK):
        cols = j0 + tl.arange(0, BLOCK)
        k = tile(K + b * s_kb + h * s_kh, cols, feat, s_kn, n, f)                        # (BLOCK, F)
        v = tile(V + b * s_vb + h * s_vh, cols, vcol, s_vn, n, dv)                       # (BLOCK, DV)
        p = tl.exp(_scores(q, k, Bias + h * s_bh, rows, cols, n, scale, IEEE) - lse[:, None])   # (BLOCK, BLOCK)
        ds = p * (dot(do, tl.trans(v), IEEE) - delta[:, None])                           # 2·BLOCK²·DV FLOPs
        dq += dot(ds.to(k.dtype), k, IEEE)                                               # 2·BLOCK²·F FLOPs
    tl.store(DQ + b * s_dqb + h * s_dqh + rows[:, None] * s_dqn + feat[None, :], (scale * dq).to(DQ.dtype.element_ty),
             mask=(rows[:, None] < n) & (feat[None, :] < f))


def _launch(c: dict, t: torch.Tensor) -> dict:
    """Warps and pipeline stages on a GPU: 8 warps and 2 stages for tiles 256 wide (a (64, 256) fp32 dK in
    registers, q and dO tiles double-buffered in shared memory: proposed for sm_90, not measured on GPU); Triton's
    defaults for narrower ones. The interpreter takes none."""
    return dict(num_warps=8, num_stages=2) if t.is_cuda and c["F"] > 128 else {}


class KeyBiasFlashAttention(torch.autograd.Function):
    """softmax(scale·q kᵀ + b + M) v on the GPU: q, k (B, Hl, n, f) (a batch stride of 0 is fine), v (B, Hl, n, d_v),
    b (Hl, n) (a slice of dense's (Hl, L) b_2, or α·b_2), f, d_v ≤ 256; the last dimension of each contiguous.
    Grid (⌈n/BLOCK⌉, B·Hl) for all three kernels. fp32 inputs take exact fp32 dots (as SDPA's fp32 path does); b is
    read in its own dtype (fp32 for a parameter under autocast) and added in fp32."""

    @staticmethod
    def forward(ctx, q, k, v, b, scale: float):
        B, H, n, f = q.shape
        blk = block(q)
        o, lse = outputs(v)                                                  # O (B, Hl, n, d_v), L (B, Hl, n)
        ctx.c = c = dict(f=f, dv=v.shape[-1], F=width(f), DV=width(v.shape[-1]), BLOCK=blk, IEEE=exact(q))
        _fwd[(triton.cdiv(n, blk), B * H)](q, k, v, b, o, lse, n, H, scale, *rows(q, k, v, o), b.stride(0), **c,
                                           **_launch(c, q))
        ctx.save_for_backward(q, k, v, b, o, lse)
        ctx.scale = scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, b, o, lse = ctx.saved_tensors
        B, H, n, _ = q.shape
        c, grid = ctx.c, (triton.cdiv(n, ctx.c["BLOCK"]), B * H)
        do = do if do.stride(-1) == 1 else do.contiguous()
        D = row_deltas(do, o)                                                # (B, Hl, n)
        dq = torch.empty(q.shape, device=q.device, dtype=q.dtype)            # q, k may be expanded: own buffers
        dk = torch.empty(k.shape, device=k.device, dtype=k.dtype)
        dv = torch.empty(v.shape, device=v.device, dtype=v.dtype)
        db = torch.empty((B, H, n), device=q.device, dtype=torch.float32)   # Σ_i dS_ij per sample
        _bwd_kv[grid](q, k, v, b, do, lse, D, dk, dv, db, n, H, ctx.scale, *rows(q, k, v, do), b.stride(0),
                      *rows(dk, dv), **c, **_launch(c, q))
        _bwd_q[grid](q, k, v, b, do, lse, D, dq, n, H, ctx.scale, *rows(q, k, v, do), b.stride(0), *rows(dq), **c,
                     **_launch(c, q))
        return dq, dk, dv, db.sum(0).to(b.dtype), None                       # db_j = Σ_b Σ_i dS_ij (Hl, n)


def key_bias_flash_attention(q, k, v, key_bias, scale: float = 1.0) -> torch.Tensor:
    """softmax(scale·q kᵀ + b + M) v; q, k: (B or 1, Hl, n, f), v (B, Hl, n, d_v), key_bias b (Hl, n);
    f, d_v ≤ 256 -> (B, Hl, n, d_v)."""
    if max(q.shape[-1], v.shape[-1]) > MAX_WIDTH:
        raise ValueError(f"key-bias flash attention takes widths ≤ {MAX_WIDTH}, got f {q.shape[-1]}, d_v {v.shape[-1]}")
    B = v.shape[0]
    q, k, v = at_autocast_dtype(q, k, v)   # b stays in its dtype: added and reduced in fp32 in the kernels
    b = key_bias if key_bias.stride(-1) == 1 else key_bias.contiguous()     # (Hl, n)
    return KeyBiasFlashAttention.apply(q.expand(B, -1, -1, -1), k.expand(B, -1, -1, -1), v, b, scale)
