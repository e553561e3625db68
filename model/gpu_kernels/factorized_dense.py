"""Flash attention whose scores are built from the factorized dense synthesizer's factors: its GPU kernel.

    O = softmax(S + M) v,   S[b, h, i, j] = A_i[j mod a] · B_i[⌊j/a⌋]     A (B, Hl, n, a), B (B, Hl, n, b), a·b = L

S has no q·kᵀ form, so no attention library runs it; materialized it would be B·Hl·n². Here each score tile is made
where it is used, from the factors of its query rows: Ag[i, j] = A_i[j mod a] and Bg[i, j] = B_i[⌊j/a⌋] are read
by gathered loads, S = Ag ⊙ Bg. Forward as FlashAttention-2 (one program per query block and (sample, head), key
blocks up to the diagonal only, online softmax, O and the rows' logsumexp L kept). Backward recomputes P = exp(S − L):
- dV = Pᵀ dO: one program per key block and (sample, head), over the query blocks at or below the diagonal;
- dS = P ⊙ (dO vᵀ − D), D_i = dO_i · O_i, and the factors' gradients as two matrix products with one-hot maps
  E_a[j, p] = [j mod a = p], E_b[j, r] = [⌊j/a⌋ = r] (exact; the tensor cores do the reduction, no atomics):
      dA = (dS ⊙ Bg) E_a,   dB = (dS ⊙ Ag) E_b
  one program per query block and (sample, head), over the key blocks up to the diagonal.
Memory: O(B·Hl·n·(a + b + d_h)); nothing n² is kept.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernels import at_autocast_dtype
from .flash import (block, causal, dot, exact, online_softmax, outputs, program, row_deltas,
                    rows, softmax_start, store_output, tile, width)

# Tiles of 32 on a GPU, not flash.py's 64: with 64, the bf16 backward faults (illegal memory access) on an H100
# with triton 3.6 (B 2, H 2, n 37, a 5, b 8, d_h 24; fp32, and bf16 at 16 and 32, ran clean: measured 2026-11-25).
MAX_BLOCK = 32


def _block(t: torch.Tensor) -> int:
    return min(block(t), MAX_BLOCK)


@triton.jit
def _factor_rows(Af, Bf, b, h, s_ab, s_ah, s_bb, s_bh):
    """Where sample b's head h starts in A and B."""
    return Af + b * s_ab + h * s_ah, Bf + b * s_bb + h * s_bh


@triton.jit
def _gathered(Arow, Brow, rows, cols, n, a, s_an, s_bn):
    """Ag, Bg (BLOCK, BLOCK) in fp32: A_i[j mod a] and B_i[⌊j/a⌋] for the tile's rows i and keys j."""
    inside = (rows[:, None] < n) & (cols[None, :] < n)
    ag = tl.load(Arow + rows[:, None] * s_an + (cols % a)[None, :], mask=inside, other=0.0).to(tl.float32)
    bg = tl.load(Brow + rows[:, None] * s_bn + (cols // a)[None, :], mask=inside, other=0.0).to(tl.float32)
    return ag, bg


@triton.jit
def _fwd(Af, Bf, V, O, L, n, H, a, dv, s_ab, s_ah, s_an, s_bb, s_bh, s_bn, s_vb, s_vh, s_vn, s_ob, s_oh, s_on,
         DV: tl.constexpr, BLOCK: tl.constexpr, IEEE: tl.constexpr):
    """O and L of query block i of one (sample, head): the online softmax over the key blocks up to the diagonal."""
    i0, b, h, bh = program(BLOCK, H)
    rows, vcol = i0 + tl.arange(0, BLOCK), tl.arange(0, DV)
    Arow, Brow = _factor_rows(Af, Bf, b, h, s_ab, s_ah, s_bb, s_bh)
    m_i, l_i, acc = softmax_start(BLOCK, DV)
    for j0 in range(0, i0 + BLOCK, BLOCK):   # key blocks up to the diagonal block
        cols = j0 + tl.arange(0, BLOCK)
        ag, bg = _gathered(Arow, Brow, rows, cols, n, a, s_an, s_bn)
        v = tile(V + b * s_vb + h * s_vh, cols, vcol, s_vn, n, dv)
        m_i, l_i, acc = online_softmax(causal(ag * bg, rows, cols, n), v, m_i, l_i, acc, IEEE)
    store_output(O + b * s_ob + h * s_oh, L + bh * n, acc, l_i, m_i, rows, vcol, s_on, n, dv)


@triton.jit
def _bwd_v(Af, Bf, DO, L, DVb, n, H, a, dv, s_ab, s_ah, s_an, s_bb, s_bh, s_bn, s_ob, s_oh, s_on, s_dvb, s_dvh, s_dvn,
           DV: tl.constexpr, BLOCK: tl.constexpr, IEEE: tl.constexpr):
    """dV of key block j of one (sample, head): Pᵀ dO over the query blocks at or below the diagonal."""
    j0, b, h, bh = program(BLOCK, H)
    Arow, Brow = _factor_rows(Af, Bf, b, h, s_ab, s_ah, s_bb, s_bh)
    acc = tl.zeros((BLOCK, DV), tl.float32)
    cols, vcol = j0 + tl.arange(0, BLOCK), tl.arange(0, DV)
    for i0 in range(j0, n, BLOCK):
        rows = i0 + tl.arange(0, BLOCK)
        ag, bg = _gathered(Arow, Brow, rows, cols, n, a, s_an, s_bn)
        lse = tl.load(L + bh * n + rows, mask=rows < n, other=0.0)
        p = tl.exp(causal(ag * bg, rows, cols, n) - lse[:, None])
        do = tile(DO + b * s_ob + h * s_oh, rows, vcol, s_on, n, dv)
        acc += dot(tl.trans(p.to(do.dtype)), do, IEEE)
    tl.store(DVb + b * s_dvb + h * s_dvh + cols[:, None] * s_dvn + vcol[None, :], acc.to(DVb.dtype.element_ty),
             mask=(cols[:, None] < n) & (vcol[None, :] < dv))


@triton.jit
def _bwd_factors(Af, Bf, V, DO, L, D, DA, DB, n, H, a, nb, dv, s_ab, s_ah, s_an, s_bb, s_bh, s_bn, s_vb, s_vh, s_vn,
                 s_ob, s_oh, s_on, s_dab, s_dah, s_dan, s_dbb, s_dbh, s_dbn,
                 AP: tl.constexpr, BP: tl.constexpr, DV: tl.constexpr, BLOCK: tl.constexpr, IEEE: tl.constexpr):
    """dA, dB of query block i of one (sample, head), over the key blocks up to the diagonal."""
    i0, b, h, bh = program(BLOCK, H)
    rows, vcol, pa, rb = i0 + tl.arange(0, BLOCK), tl.arange(0, DV), tl.arange(0, AP), tl.arange(0, BP)
    Arow, Brow = _factor_rows(Af, Bf, b, h, s_ab, s_ah, s_bb, s_bh)
    do = tile(DO + b * s_ob + h * s_oh, rows, vcol, s_on, n, dv)
    lse = tl.load(L + bh * n + rows, mask=rows < n, other=0.0)
    delta = tl.load(D + bh * n + rows, mask=rows < n, other=0.0)
    da = tl.zeros((BLOCK, AP), tl.float32)
    db = tl.zeros((BLOCK, BP), tl.float32)
    for j0 in range(0, i0 + BLOCK, BLOCK):
        cols = j0 + tl.arange(0, BLOCK)
        ag, bg = _gathered(Arow, Brow, rows, cols, n, a, s_an, s_bn)
        p = tl.exp(causal(ag * bg, rows, cols, n) - lse[:, None])
        v = tile(V + b * s_vb + h * s_vh, cols, vcol, s_vn, n, dv)
        ds = p * (dot(do, tl.trans(v), IEEE) - delta[:, None])        # dS = P ⊙ (dO vᵀ − D)
        Ea = ((cols[:, None] % a) == pa[None, :]).to(tl.float32)        # (BLOCK, AP): key j feeds A's entry j mod a
        Eb = ((cols[:, None] // a) == rb[None, :]).to(tl.float32)       # (BLOCK, BP): and B's entry ⌊j/a⌋
        da += dot((ds * bg).to(do.dtype), Ea.to(do.dtype), IEEE)
        db += dot((ds * ag).to(do.dtype), Eb.to(do.dtype), IEEE)
    tl.store(DA + b * s_dab + h * s_dah + rows[:, None] * s_dan + pa[None, :], da.to(DA.dtype.element_ty),
             mask=(rows[:, None] < n) & (pa[None, :] < a))
    tl.store(DB + b * s_dbb + h * s_dbh + rows[:, None] * s_dbn + rb[None, :], db.to(DB.dtype.element_ty),
             mask=(rows[:, None] < n) & (rb[None, :] < nb))


class FactorizedDenseFlash(torch.autograd.Function):
    """softmax(S + M) v with S built from A (B, Hl, n, a) and B (B, Hl, n, b) in the kernel; v (B, Hl, n, d_h).
    Grids: (⌈n/BLOCK⌉, B·Hl) for each of the three kernels. The one-hot maps are padded to AP, BP ≥ 16 columns
    (tl.dot's smallest); a, b of a 2048-long model are 32 and 64."""

    @staticmethod
    def forward(ctx, A, Bf, v):
        B, H, n, a = A.shape
        blk = _block(v)
        o, lse = outputs(v)                                                  # O, and the rows' logsumexp
        ctx.c = c = dict(DV=width(v.shape[-1]), BLOCK=blk, IEEE=exact(v))
        _fwd[(triton.cdiv(n, blk), B * H)](A, Bf, v, o, lse, n, H, a, v.shape[-1], *rows(A, Bf, v, o), **c)
        ctx.save_for_backward(A, Bf, v, o, lse)
        return o

    @staticmethod
    def backward(ctx, do):
        A, Bf, v, o, lse = ctx.saved_tensors
        B, H, n, a = A.shape
        c, grid, dv_width = ctx.c, (triton.cdiv(n, ctx.c["BLOCK"]), B * H), v.shape[-1]
        do = do if do.stride(-1) == 1 else do.contiguous()
        D = row_deltas(do, o)                                                # (B, Hl, n)
        dA, dB, dv = torch.empty_like(A), torch.empty_like(Bf), torch.empty(v.shape, device=v.device, dtype=v.dtype)
        _bwd_v[grid](A, Bf, do, lse, dv, n, H, a, dv_width, *rows(A, Bf, do, dv), **c)
        _bwd_factors[grid](A, Bf, v, do, lse, D, dA, dB, n, H, a, Bf.shape[-1], dv_width,
                           *rows(A, Bf, v, do, dA, dB), AP=width(a), BP=width(Bf.shape[-1]), **c)
        return dA, dB, dv


def factorized_dense_flash(A, Bf, v) -> torch.Tensor:
    """softmax(S + M) v, S_i[j] = A_i[j mod a] · B_i[⌊j/a⌋]; A (B, Hl, n, a), Bf (B, Hl, n, b), v (B, Hl, n, d_h)."""
    return FactorizedDenseFlash.apply(*at_autocast_dtype(A, Bf, v))
