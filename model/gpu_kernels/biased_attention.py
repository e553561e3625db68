"""Flash attention with a learned, batch-shared bias map: the GPU kernel of random+dot (and random+dense).

    O = softmax(q kᵀ + w ⊙ R + M) v          q, k (B, Hl, n, f), v (B, Hl, n, d_h), R (Hl, n, n), w (Hl,)

No library kernel takes a bias that needs a gradient (SDPA with a float mask falls back to its slow path and keeps
B·Hl·n² for backward; flex_attention's backward for a captured buffer took 244 ms a layer on an H100). So, in the
pattern of FlashAttention-2 (Dao 2023; Triton's fused-attention tutorial), with R's tile added to each score tile:
- forward, one program per (block of BLOCK query rows, sample, head): keys in blocks of BLOCK up to the diagonal
  only (the causal tiles above it are skipped, not computed and masked), online softmax, O and the row's
  logsumexp L kept for backward;
- backward, recomputing P = exp(S − L) tile by tile, with D_i = dO_i · O_i:
      dV = Pᵀ dO,  dP = dO vᵀ,  dS = P ⊙ (dP − D),  dK = dSᵀ q,  dQ = dS k,
      dR = w ⊙ Σ_b dS,  dw = Σ_ij (Σ_b dS) ⊙ R.
  One program per (key block, head) walks the samples in turn and the query blocks at or below the diagonal: it
  alone owns the column block of Σ_b dS (fp32, Hl·n², the size of R's gradient), so it adds into it without
  atomics; dK, dV of a sample are finished before the next. dQ has its own kernel, one program per query block.
Memory: O(B·Hl·n·f) besides R and its gradient; nothing B·Hl·n² is kept. Runs on CPU tensors under
TRITON_INTERPRET=1 (the tests), where BLOCK is 16 to keep the interpreter quick.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernels import at_autocast_dtype
from .flash import (block, causal, dot, exact, online_softmax, outputs, program, row_deltas,
                    rows, softmax_start, store_output, tile, width)


@triton.jit
def _scores(q, k, R_ptr, rows, cols, n, w, s_rn, IEEE: tl.constexpr):
    """S tile in fp32: q kᵀ + w R[rows, cols], −inf above the diagonal and past n."""
    return causal(dot(q, tl.trans(k), IEEE) + w * tile(R_ptr, rows, cols, s_rn, n, n).to(tl.float32), rows, cols, n)


@triton.jit
def _fwd(Q, K, V, R, W, O, L, n, H, s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_ob, s_oh, s_on, s_rh, s_rn,
         f, dv, F: tl.constexpr, DV: tl.constexpr, BLOCK: tl.constexpr, IEEE: tl.constexpr):
    """O and L of query block i of one (sample, head): the online softmax over the key blocks up to the diagonal."""
    i0, b, h, bh = program(BLOCK, H)
    rows, feat, vcol = i0 + tl.arange(0, BLOCK), tl.arange(0, F), tl.arange(0, DV)
    q = tile(Q + b * s_qb + h * s_qh, rows, feat, s_qn, n, f)
    w = tl.load(W + h).to(tl.float32)
    m_i, l_i, acc = softmax_start(BLOCK, DV)
    for j0 in range(0, i0 + BLOCK, BLOCK):   # key blocks up to the diagonal block; the ones above are skipped
        cols = j0 + tl.arange(0, BLOCK)
        k = tile(K + b * s_kb + h * s_kh, cols, feat, s_kn, n, f)
        v = tile(V + b * s_vb + h * s_vh, cols, vcol, s_vn, n, dv)
        s = _scores(q, k, R + h * s_rh, rows, cols, n, w, s_rn, IEEE)
        m_i, l_i, acc = online_softmax(s, v, m_i, l_i, acc, IEEE)
    store_output(O + b * s_ob + h * s_oh, L + bh * n, acc, l_i, m_i, rows, vcol, s_on, n, dv)


@triton.jit
def _bwd_kv(Q, K, V, R, W, DO, L, D, DK, DVb, DMAP, n, B, H,
            s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_ob, s_oh, s_on, s_rh, s_rn,
            s_dkb, s_dkh, s_dkn, s_dvb, s_dvh, s_dvn,
            f, dv, F: tl.constexpr, DV: tl.constexpr, BLOCK: tl.constexpr, IEEE: tl.constexpr):
    """dK, dV of key block j for every sample in turn, and Σ_b dS of its column block (DMAP, fp32, (Hl, n, n))."""
    j0, h = tl.program_id(0) * BLOCK, tl.program_id(1)
    cols, feat, vcol = j0 + tl.arange(0, BLOCK), tl.arange(0, F), tl.arange(0, DV)
    w = tl.load(W + h).to(tl.float32)
    for b in range(0, B):
        k = tile(K + b * s_kb + h * s_kh, cols, feat, s_kn, n, f)
        v = tile(V + b * s_vb + h * s_vh, cols, vcol, s_vn, n, dv)
        dk = tl.zeros((BLOCK, F), tl.float32)
        dv_acc = tl.zeros((BLOCK, DV), tl.float32)
        for i0 in range(j0, n, BLOCK):   # query blocks at or below the diagonal
            rows = i0 + tl.arange(0, BLOCK)
            q = tile(Q + b * s_qb + h * s_qh, rows, feat, s_qn, n, f)
            do = tile(DO + b * s_ob + h * s_oh, rows, vcol, s_on, n, dv)
            lse = tl.load(L + (b * H + h) * n + rows, mask=rows < n, other=0.0)
            delta = tl.load(D + (b * H + h) * n + rows, mask=rows < n, other=0.0)
            p = tl.exp(_scores(q, k, R + h * s_rh, rows, cols, n, w, s_rn, IEEE) - lse[:, None])
            dv_acc += dot(tl.trans(p.to(do.dtype)), do, IEEE)
            ds = p * (dot(do, tl.trans(v), IEEE) - delta[:, None])        # dS = P ⊙ (dO vᵀ − D)
            dk += dot(tl.trans(ds.to(q.dtype)), q, IEEE)
            inside = (rows[:, None] < n) & (cols[None, :] < n)
            at = DMAP + h * n * n + rows[:, None] * n + cols[None, :]      # this program's columns alone
            tl.store(at, tl.load(at, mask=inside, other=0.0) + ds, mask=inside)
        tl.store(DK + b * s_dkb + h * s_dkh + cols[:, None] * s_dkn + feat[None, :], dk.to(DK.dtype.element_ty),
                 mask=(cols[:, None] < n) & (feat[None, :] < f))
        tl.store(DVb + b * s_dvb + h * s_dvh + cols[:, None] * s_dvn + vcol[None, :],
                 dv_acc.to(DVb.dtype.element_ty), mask=(cols[:, None] < n) & (vcol[None, :] < dv))


@triton.jit
def _bwd_q(Q, K, V, R, W, DO, L, D, DQ, n, H,
           s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_ob, s_oh, s_on, s_rh, s_rn, s_dqb, s_dqh, s_dqn,
           f, dv, F: tl.constexpr, DV: tl.constexpr, BLOCK: tl.constexpr, IEEE: tl.constexpr):
    """dQ of query block i of one (sample, head): dS over the key blocks up to the diagonal, times k."""
    i0, b, h, bh = program(BLOCK, H)
    rows, feat, vcol = i0 + tl.arange(0, BLOCK), tl.arange(0, F), tl.arange(0, DV)
    q = tile(Q + b * s_qb + h * s_qh, rows, feat, s_qn, n, f)
    do = tile(DO + b * s_ob + h * s_oh, rows, vcol, s_on, n, dv)
    lse = tl.load(L + bh * n + rows, mask=rows < n, other=0.0)
    delta = tl.load(D + bh * n + rows, mask=rows < n, other=0.0)
    w = tl.load(W + h).to(tl.float32)
    dq = tl.zeros((BLOCK, F), tl.float32)
    for j0 in range(0, i0 + BLOCK, BLOCK):
        cols = j0 + tl.arange(0, BLOCK)
        k = tile(K + b * s_kb + h * s_kh, cols, feat, s_kn, n, f)
        v = tile(V + b * s_vb + h * s_vh, cols, vcol, s_vn, n, dv)
        p = tl.exp(_scores(q, k, R + h * s_rh, rows, cols, n, w, s_rn, IEEE) - lse[:, None])
        ds = p * (dot(do, tl.trans(v), IEEE) - delta[:, None])
        dq += dot(ds.to(k.dtype), k, IEEE)
    tl.store(DQ + b * s_dqb + h * s_dqh + rows[:, None] * s_dqn + feat[None, :], dq.to(DQ.dtype.element_ty),
             mask=(rows[:, None] < n) & (feat[None, :] < f))


class BiasedFlashAttention(torch.autograd.Function):
    """softmax(q kᵀ + w ⊙ R + M) v on the GPU: q, k (B, Hl, n, f) (a batch stride of 0 is fine), v (B, Hl, n, d_h),
    R (Hl, n, n) (a slice of the (Hl, L, L) parameter), w (Hl,); the last dimension of each contiguous. Grid:
    (⌈n/BLOCK⌉, B·Hl) for the forward and dQ, (⌈n/BLOCK⌉, Hl) for dK/dV/ΣdS; BLOCK 64 keeps a program's tiles in
    registers and shared memory for f, d_h ≤ 128. fp32 inputs take exact fp32 dots (as SDPA's fp32 path does)."""

    @staticmethod
    def forward(ctx, q, k, v, R, w):
        B, H, n, f = q.shape
        blk = block(q)
        o, lse = outputs(v)                                                  # O, and the rows' logsumexp
        ctx.c = c = dict(f=f, dv=v.shape[-1], F=width(f), DV=width(v.shape[-1]), BLOCK=blk, IEEE=exact(q))
        _fwd[(triton.cdiv(n, blk), B * H)](q, k, v, R, w, o, lse, n, H, *rows(q, k, v, o), *R.stride()[:2], **c)
        ctx.save_for_backward(q, k, v, R, w, o, lse)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, R, w, o, lse = ctx.saved_tensors
        B, H, n, _ = q.shape
        c, blocks = ctx.c, triton.cdiv(n, ctx.c["BLOCK"])
        do = do if do.stride(-1) == 1 else do.contiguous()
        D = row_deltas(do, o)                                                # (B, Hl, n)
        dq = torch.empty(q.shape, device=q.device, dtype=q.dtype)            # q, k may be expanded: own buffers
        dk = torch.empty(k.shape, device=k.device, dtype=k.dtype)
        dv = torch.empty(v.shape, device=v.device, dtype=v.dtype)
        dmap = torch.zeros((H, n, n), device=q.device, dtype=torch.float32)   # Σ_b dS
        _bwd_kv[(blocks, H)](q, k, v, R, w, do, lse, D, dk, dv, dmap, n, B, H, *rows(q, k, v, do),
                             *R.stride()[:2], *rows(dk, dv), **c)
        _bwd_q[(blocks, B * H)](q, k, v, R, w, do, lse, D, dq, n, H, *rows(q, k, v, do), *R.stride()[:2],
                                *rows(dq), **c)
        dw = (dmap * R.float()).sum((-1, -2)).to(w.dtype)                    # dw = Σ_ij (Σ_b dS) ⊙ R
        dR = (dmap * w.float()[:, None, None]).to(R.dtype) if ctx.needs_input_grad[3] else None
        return dq, dk, dv, dR, dw


def biased_flash_attention(q, k, R, w, v) -> torch.Tensor:
    """softmax(q kᵀ + w ⊙ R + M) v; q, k: (B or 1, Hl, n, f), R (Hl, n, n), w (Hl,), v (B, Hl, n, d_h)."""
    B = v.shape[0]
    q, k, v = at_autocast_dtype(q, k, v)   # R and w stay fp32: added and reduced in fp32 in the kernels
    return BiasedFlashAttention.apply(q.expand(B, -1, -1, -1), k.expand(B, -1, -1, -1), v, R, w)
