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


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b accumulated in fp32. IEEE: exact fp32 products, for fp32 inputs (as SDPA's fp32 path) and under the
    interpreter (whose dot mishandles bf16: numpy has none); else the tensor cores' bf16/fp16 products."""
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _tile(ptr, rows, cols, s_row, n_rows, n_cols):
    """The (rows, cols) tile of a row-major matrix with row stride s_row; zeros outside n_rows × n_cols."""
    return tl.load(ptr + rows[:, None] * s_row + cols[None, :],
                   mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols), other=0.0)


@triton.jit
def _scores(q, k, R_ptr, rows, cols, n, w, s_rn, IEEE: tl.constexpr):
    """S tile in fp32: q kᵀ + w R[rows, cols], −inf above the diagonal and past n."""
    s = _dot(q, tl.trans(k), IEEE) + w * _tile(R_ptr, rows, cols, s_rn, n, n).to(tl.float32)
    keep = (rows[:, None] < n) & (cols[None, :] < n) & (cols[None, :] <= rows[:, None])
    return tl.where(keep, s, float("-inf"))


@triton.jit
def _fwd(Q, K, V, R, W, O, L, n, H, s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_ob, s_oh, s_on, s_rh, s_rn,
         f, dv, F: tl.constexpr, DV: tl.constexpr, BLOCK: tl.constexpr, IEEE: tl.constexpr):
    i0, bh = tl.program_id(0) * BLOCK, tl.program_id(1)
    b, h = bh // H, bh % H
    rows, feat, vcol = i0 + tl.arange(0, BLOCK), tl.arange(0, F), tl.arange(0, DV)
    q = _tile(Q + b * s_qb + h * s_qh, rows, feat, s_qn, n, f)
    w = tl.load(W + h).to(tl.float32)
    m_i = tl.full((BLOCK,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK,), tl.float32)
    acc = tl.zeros((BLOCK, DV), tl.float32)
    for j0 in range(0, i0 + BLOCK, BLOCK):   # key blocks up to the diagonal block; the ones above are skipped
        cols = j0 + tl.arange(0, BLOCK)
        k = _tile(K + b * s_kb + h * s_kh, cols, feat, s_kn, n, f)
        v = _tile(V + b * s_vb + h * s_vh, cols, vcol, s_vn, n, dv)
        s = _scores(q, k, R + h * s_rh, rows, cols, n, w, s_rn, IEEE)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)        # rows past n see no key at all
        p = tl.exp(s - m_safe[:, None])
        scale = tl.exp(m_i - m_safe)
        l_i = l_i * scale + tl.sum(p, 1)
        acc = acc * scale[:, None] + _dot(p.to(v.dtype), v, IEEE)
        m_i = m_new
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    tl.store(O + b * s_ob + h * s_oh + rows[:, None] * s_on + vcol[None, :], (acc / l_safe[:, None]).to(O.dtype.element_ty),
             mask=(rows[:, None] < n) & (vcol[None, :] < dv))
    tl.store(L + bh * n + rows, m_i + tl.log(l_safe), mask=rows < n)


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
        k = _tile(K + b * s_kb + h * s_kh, cols, feat, s_kn, n, f)
        v = _tile(V + b * s_vb + h * s_vh, cols, vcol, s_vn, n, dv)
        dk = tl.zeros((BLOCK, F), tl.float32)
        dv_acc = tl.zeros((BLOCK, DV), tl.float32)
        for i0 in range(j0, n, BLOCK):   # query blocks at or below the diagonal
            rows = i0 + tl.arange(0, BLOCK)
            q = _tile(Q + b * s_qb + h * s_qh, rows, feat, s_qn, n, f)
            do = _tile(DO + b * s_ob + h * s_oh, rows, vcol, s_on, n, dv)
            lse = tl.load(L + (b * H + h) * n + rows, mask=rows < n, other=0.0)
            delta = tl.load(D + (b * H + h) * n + rows, mask=rows < n, other=0.0)
            p = tl.exp(_scores(q, k, R + h * s_rh, rows, cols, n, w, s_rn, IEEE) - lse[:, None])
            dv_acc += _dot(tl.trans(p.to(do.dtype)), do, IEEE)
            ds = p * (_dot(do, tl.trans(v), IEEE) - delta[:, None])        # dS = P ⊙ (dO vᵀ − D)
            dk += _dot(tl.trans(ds.to(q.dtype)), q, IEEE)
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
    i0, bh = tl.program_id(0) * BLOCK, tl.program_id(1)
    b, h = bh // H, bh % H
    rows, feat, vcol = i0 + tl.arange(0, BLOCK), tl.arange(0, F), tl.arange(0, DV)
    q = _tile(Q + b * s_qb + h * s_qh, rows, feat, s_qn, n, f)
    do = _tile(DO + b * s_ob + h * s_oh, rows, vcol, s_on, n, dv)
    lse = tl.load(L + bh * n + rows, mask=rows < n, other=0.0)
    delta = tl.load(D + bh * n + rows, mask=rows < n, other=0.0)
    w = tl.load(W + h).to(tl.float32)
    dq = tl.zeros((BLOCK, F), tl.float32)
    for j0 in range(0, i0 + BLOCK, BLOCK):
        cols = j0 + tl.arange(0, BLOCK)
        k = _tile(K + b * s_kb + h * s_kh, cols, feat, s_kn, n, f)
        v = _tile(V + b * s_vb + h * s_vh, cols, vcol, s_vn, n, dv)
        p = tl.exp(_scores(q, k, R + h * s_rh, rows, cols, n, w, s_rn, IEEE) - lse[:, None])
        ds = p * (_dot(do, tl.trans(v), IEEE) - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, IEEE)
    tl.store(DQ + b * s_dqb + h * s_dqh + rows[:, None] * s_dqn + feat[None, :], dq.to(DQ.dtype.element_ty),
             mask=(rows[:, None] < n) & (feat[None, :] < f))


def _width(x: int) -> int:
    """A tile width: a power of two ≥ 16 (tl.dot's smallest)."""
    return max(16, triton.next_power_of_2(x))


def _block(t: torch.Tensor) -> int:
    """Tile rows and columns: CPU tensors reach a Triton kernel only under the interpreter, which runs each program
    in Python: small tiles there."""
    return 16 if t.device.type == "cpu" else 64


class BiasedFlashAttention(torch.autograd.Function):
    """softmax(q kᵀ + w ⊙ R + M) v on the GPU: q, k (B, Hl, n, f) (a batch stride of 0 is fine), v (B, Hl, n, d_h),
    R (Hl, n, n) (a slice of the (Hl, L, L) parameter), w (Hl,); the last dimension of each contiguous. Grid:
    (⌈n/BLOCK⌉, B·Hl) for the forward and dQ, (⌈n/BLOCK⌉, Hl) for dK/dV/ΣdS; BLOCK 64 keeps a program's tiles in
    registers and shared memory for f, d_h ≤ 128. fp32 inputs take exact fp32 dots (as SDPA's fp32 path does)."""

    @staticmethod
    def forward(ctx, q, k, v, R, w):
        B, H, n, f = q.shape
        block = _block(q)
        o = torch.empty(v.shape, device=v.device, dtype=v.dtype)
        lse = torch.empty((B, H, n), device=q.device, dtype=torch.float32)   # the rows' logsumexp, for backward
        c = dict(f=f, dv=v.shape[-1], F=_width(f), DV=_width(v.shape[-1]), BLOCK=block,
                 IEEE=q.dtype == torch.float32 or q.device.type == "cpu")
        _fwd[(triton.cdiv(n, block), B * H)](q, k, v, R, w, o, lse, n, H, *_rows(q, k, v, o), *R.stride()[:2], **c)
        ctx.save_for_backward(q, k, v, R, w, o, lse)
        ctx.c = c
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, R, w, o, lse = ctx.saved_tensors
        B, H, n, _ = q.shape
        c, blocks = ctx.c, triton.cdiv(n, ctx.c["BLOCK"])
        do = do if do.stride(-1) == 1 else do.contiguous()
        D = (do.float() * o.float()).sum(-1).contiguous()                    # (B, Hl, n): D_i = dO_i · O_i
        dq = torch.empty(q.shape, device=q.device, dtype=q.dtype)            # q, k may be expanded: own buffers
        dk = torch.empty(k.shape, device=k.device, dtype=k.dtype)
        dv = torch.empty(v.shape, device=v.device, dtype=v.dtype)
        dmap = torch.zeros((H, n, n), device=q.device, dtype=torch.float32)   # Σ_b dS
        _bwd_kv[(blocks, H)](q, k, v, R, w, do, lse, D, dk, dv, dmap, n, B, H, *_rows(q, k, v, do),
                             *R.stride()[:2], *_rows(dk, dv), **c)
        _bwd_q[(blocks, B * H)](q, k, v, R, w, do, lse, D, dq, n, H, *_rows(q, k, v, do), *R.stride()[:2],
                                *_rows(dq), **c)
        dw = (dmap * R.float()).sum((-1, -2)).to(w.dtype)                    # dw = Σ_ij (Σ_b dS) ⊙ R
        dR = (dmap * w.float()[:, None, None]).to(R.dtype) if ctx.needs_input_grad[3] else None
        return dq, dk, dv, dR, dw


def _rows(*tensors) -> tuple[int, ...]:
    """Batch, head and row strides of (B, Hl, n, ·) tensors whose rows are contiguous."""
    assert all(t.stride(-1) == 1 for t in tensors), "the kernels read rows contiguously"
    return tuple(s for t in tensors for s in t.stride()[:3])


def biased_flash_attention(q, k, R, w, v) -> torch.Tensor:
    """softmax(q kᵀ + w ⊙ R + M) v; q, k: (B or 1, Hl, n, f), R (Hl, n, n), w (Hl,), v (B, Hl, n, d_h)."""
    B = v.shape[0]
    return BiasedFlashAttention.apply(q.expand(B, -1, -1, -1), k.expand(B, -1, -1, -1), v, R, w)
