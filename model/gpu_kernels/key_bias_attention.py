"""Flash attention with a per-key bias, its q·k features in two groups: dense+dot's attention at its own widths.

    O = softmax(scale·(q₁k₁ᵀ + q₂k₂ᵀ) + b + M) v     q_g, k_g (B, Hl, n, f_g), v (B, Hl, n, d_v), b (Hl, n)

For dense+dot, group 1 is dense's (q₁ = α·σ(W₁X), k₁ = W₂'s rows, shared by the batch: read with a batch stride of 0,
never copied per sample) and group 2 dot's (α·s·q, k); b is α·b₂, shared by the batch and every query row. No SDPA
backend takes this at its widths (f 128 + 128, d_v 128): flash and cuDNN's backward want q·k and v equally wide
(cuDNN's sm90 backward: both ≤ 128, or 192/128, or 256/256) and SDPA takes no bias that needs a gradient, so the
SDPA form (model/qk_attention.py) concatenates the groups (a batch copy of W₂), carries b on the values
([e ⊙ v, e], e_j = e^{b_j − max b}) padded to 256, and divides by the output's last column. Here the groups stay
apart (two tile dots summed, no concatenation), v stays at d_v, and b's tile (BLOCK,) is added to each score tile
in fp32 before the online softmax (exact for any spread of b; the value-factor form underflows past ~80). A single
group is given as two views of its halves. In the pattern of FlashAttention-2 (Dao 2023):
- forward, one program per (block of BLOCK query rows, sample, head): key blocks up to the diagonal only, online
  softmax, O and the rows' logsumexp L kept for backward;
- backward, recomputing P = exp(S − L) tile by tile, with D_i = dO_i · O_i:
      dV = Pᵀ dO,  dP = dO vᵀ,  dS = P ⊙ (dP − D),  dK_g = scale·dSᵀ q_g,  dQ_g = scale·dS k_g,  db_j = Σ_b Σ_i dS_ij.
  One program per (key block, sample, head) makes dK_g, dV, its column sums of dS (fp32 (B, Hl, n), summed over the
  batch after) and, in one pass, adds its dQ_g tiles into fp32 buffers with atomics (FlashAttention-2's way); where
  torch.use_deterministic_algorithms is on, dQ has its own kernel instead, one program per query block, which
  recomputes S and dP (no atomics, deterministic).
FLOPs per (sample, head), causal (n²/2 pairs), f = f₁ + f₂: forward n²·(f + d_v) (S, P v); backward n²·(3f + 2d_v)
in one pass (S, dV, dP, dK, dQ), n²·(4f + 3d_v) deterministic. At f 256, d_v 128: 1408·n² (1792·n² deterministic),
where SDPA's value-factor form at 256 × 256 takes 1792·n² (forward 512, backward 1280) and dot alone 896·n²: the
1.5× of dense+dot's FLOP count is 1344·n². Memory kept for backward: q_g, k₂, v, O (B·Hl·n·(f + f₂ + 2·d_v)), k₁ a view
of W₂, L (B·Hl·n fp32); the SDPA form keeps q, k, v, O at 256 each (B·Hl·n·1024). Backward's transients: dQ's fp32
buffers (B·Hl·n·f, one pass only) and D, db's partials (B·Hl·n fp32 each). Nothing n² is kept.

Launched through torch.library custom ops (`synthformer::key_bias_attention`, `…_backward`), so torch.compile keeps
them whole in its graph (compiled blocks); under TRITON_INTERPRET=1 they run on CPU tensors (the tests), BLOCK 16.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernels import at_autocast_dtype
from .flash import (block, causal, dot, exact, online_softmax, outputs, program, row_deltas,
                    rows, softmax_start, store_output, tile, width)

MAX_WIDTH = 256   # the widest q·k features (f₁ + f₂) and values whose tiles a program keeps


@triton.jit
def _pair(P1, P2, s1, s2, rows, n, f1, f2, F1: tl.constexpr, F2: tl.constexpr):
    """The tiles of the (rows) of both groups: (BLOCK, F1) at P1 and (BLOCK, F2) at P2, row strides s1, s2."""
    return tile(P1, rows, tl.arange(0, F1), s1, n, f1), tile(P2, rows, tl.arange(0, F2), s2, n, f2)


@triton.jit
def _scores(q1, k1, q2, k2, Bias, rows, cols, n, scale, IEEE: tl.constexpr):
    """S tile in fp32: scale·(q₁k₁ᵀ + q₂k₂ᵀ) + b_j (the keys' bias broadcast over the rows), −inf above the diagonal
    and past n. 2·BLOCK²·(F1 + F2) FLOPs."""
    b = tl.load(Bias + cols, mask=cols < n, other=0.0).to(tl.float32)                    # (BLOCK,) keys' bias
    s = dot(q1, tl.trans(k1), IEEE) + dot(q2, tl.trans(k2), IEEE)                       # (BLOCK, BLOCK)
    return causal(scale * s + b[None, :], rows, cols, n)


@triton.jit
def _stats(L, D, bh, rows, n):
    """The rows' logsumexp L and D = dO · O of one (sample, head), (BLOCK,) each."""
    return tl.load(L + bh * n + rows, mask=rows < n, other=0.0), tl.load(D + bh * n + rows, mask=rows < n, other=0.0)


@triton.jit
def _store(P, rows, F: tl.constexpr, s_n, n, f, x):
    """x (BLOCK, F) into the (rows, :f) of a row-major matrix at P, in P's dtype."""
    feat = tl.arange(0, F)
    tl.store(P + rows[:, None] * s_n + feat[None, :], x.to(P.dtype.element_ty), mask=(rows[:, None] < n) & (feat[None, :] < f))


@triton.jit
def _fwd(Q1, Q2, K1, K2, V, Bias, O, L, n, H, scale,
         s_q1b, s_q1h, s_q1n, s_q2b, s_q2h, s_q2n, s_k1b, s_k1h, s_k1n, s_k2b, s_k2h, s_k2n,
         s_vb, s_vh, s_vn, s_ob, s_oh, s_on, s_bh, f1, f2, dv,
         F1: tl.constexpr, F2: tl.constexpr, DV: tl.constexpr, BLOCK: tl.constexpr, IEEE: tl.constexpr):
    """O and L of query block i of one (sample, head): the online softmax over the key blocks up to the diagonal."""
    i0, b, h, bh = program(BLOCK, H)
    rows, vcol = i0 + tl.arange(0, BLOCK), tl.arange(0, DV)
    q1, q2 = _pair(Q1 + b * s_q1b + h * s_q1h, Q2 + b * s_q2b + h * s_q2h, s_q1n, s_q2n, rows, n, f1, f2, F1, F2)
    m_i, l_i, acc = softmax_start(BLOCK, DV)
    for j0 in range(0, i0 + BLOCK, BLOCK):   # key blocks up to the diagonal block; the ones above are skipped
        cols = j0 + tl.arange(0, BLOCK)
        k1, k2 = _pair(K1 + b * s_k1b + h * s_k1h, K2 + b * s_k2b + h * s_k2h, s_k1n, s_k2n, cols, n, f1, f2, F1, F2)
        v = tile(V + b * s_vb + h * s_vh, cols, vcol, s_vn, n, dv)                       # (BLOCK, DV)
        s = _scores(q1, k1, q2, k2, Bias + h * s_bh, rows, cols, n, scale, IEEE)         # (BLOCK, BLOCK)
        m_i, l_i, acc = online_softmax(s, v, m_i, l_i, acc, IEEE)                        # P v: 2·BLOCK²·DV FLOPs
    store_output(O + b * s_ob + h * s_oh, L + bh * n, acc, l_i, m_i, rows, vcol, s_on, n, dv)


@triton.jit
def _bwd_kv(Q1, Q2, K1, K2, V, Bias, DO, L, D, DK1, DK2, DVb, DB, DQ1, DQ2, n, H, scale,
            s_q1b, s_q1h, s_q1n, s_q2b, s_q2h, s_q2n, s_k1b, s_k1h, s_k1n, s_k2b, s_k2h, s_k2n,
            s_vb, s_vh, s_vn, s_ob, s_oh, s_on, s_bh, s_dk1b, s_dk1h, s_dk1n, s_dk2b, s_dk2h, s_dk2n,
            s_dvb, s_dvh, s_dvn, s_dq1b, s_dq1h, s_dq1n, s_dq2b, s_dq2h, s_dq2n, f1, f2, dv,
            F1: tl.constexpr, F2: tl.constexpr, DV: tl.constexpr, ONE_PASS: tl.constexpr, BLOCK: tl.constexpr,
            IEEE: tl.constexpr):
    """dK_g, dV of key block j of one (sample, head), Σ_i dS_ij of its keys into DB (B, Hl, n) fp32, and with
    ONE_PASS its share scale·dS k_g of every query block's dQ_g, added into the fp32 buffers DQ1, DQ2."""
    j0, b, h, bh = program(BLOCK, H)
    cols, vcol = j0 + tl.arange(0, BLOCK), tl.arange(0, DV)
    k1, k2 = _pair(K1 + b * s_k1b + h * s_k1h, K2 + b * s_k2b + h * s_k2h, s_k1n, s_k2n, cols, n, f1, f2, F1, F2)
    v = tile(V + b * s_vb + h * s_vh, cols, vcol, s_vn, n, dv)                           # (BLOCK, DV)
    dk1, dk2 = tl.zeros((BLOCK, F1), tl.float32), tl.zeros((BLOCK, F2), tl.float32)
    dv_acc, db = tl.zeros((BLOCK, DV), tl.float32), tl.zeros((BLOCK,), tl.float32)
    for i0 in range(j0, n, BLOCK):   # query blocks at or below the diagonal
        rows = i0 + tl.arange(0, BLOCK)
        q1, q2 = _pair(Q1 + b * s_q1b + h * s_q1h, Q2 + b * s_q2b + h * s_q2h, s_q1n, s_q2n, rows, n, f1, f2, F1, F2)
        do = tile(DO + b * s_ob + h * s_oh, rows, vcol, s_on, n, dv)                     # (BLOCK, DV)
        lse, delta = _stats(L, D, bh, rows, n)                                           # (BLOCK,) each
        p = tl.exp(_scores(q1, k1, q2, k2, Bias + h * s_bh, rows, cols, n, scale, IEEE) - lse[:, None])
        dv_acc += dot(tl.trans(p.to(do.dtype)), do, IEEE)                                # 2·BLOCK²·DV FLOPs
        ds = p * (dot(do, tl.trans(v), IEEE) - delta[:, None])                           # dS = P ⊙ (dO vᵀ − D)
        dk1 += dot(tl.trans(ds.to(q1.dtype)), q1, IEEE)                                  # 2·BLOCK²·F FLOPs
        dk2 += dot(tl.trans(ds.to(q2.dtype)), q2, IEEE)
        db += tl.sum(ds, 0)                                                              # (BLOCK,) column sums
        if ONE_PASS:   # dQ_g += scale·dS k_g: 2·BLOCK²·F FLOPs, BLOCK·F fp32 atomic adds
            f1c, f2c = tl.arange(0, F1), tl.arange(0, F2)
            tl.atomic_add(DQ1 + b * s_dq1b + h * s_dq1h + rows[:, None] * s_dq1n + f1c[None, :],
                          scale * dot(ds.to(k1.dtype), k1, IEEE), mask=(rows[:, None] < n) & (f1c[None, :] < f1),
                          sem="relaxed")
            tl.atomic_add(DQ2 + b * s_dq2b + h * s_dq2h + rows[:, None] * s_dq2n + f2c[None, :],
                          scale * dot(ds.to(k2.dtype), k2, IEEE), mask=(rows[:, None] < n) & (f2c[None, :] < f2),
                          sem="relaxed")
    _store(DK1 + b * s_dk1b + h * s_dk1h, cols, F1, s_dk1n, n, f1, scale * dk1)
    _store(DK2 + b * s_dk2b + h * s_dk2h, cols, F2, s_dk2n, n, f2, scale * dk2)
    _store(DVb + b * s_dvb + h * s_dvh, cols, DV, s_dvn, n, dv, dv_acc)
    tl.store(DB + bh * n + cols, db, mask=cols < n)


@triton.jit
def _bwd_q(Q1, Q2, K1, K2, V, Bias, DO, L, D, DQ1, DQ2, n, H, scale,
           s_q1b, s_q1h, s_q1n, s_q2b, s_q2h, s_q2n, s_k1b, s_k1h, s_k1n, s_k2b, s_k2h, s_k2n,
           s_vb, s_vh, s_vn, s_ob, s_oh, s_on, s_bh, s_dq1b, s_dq1h, s_dq1n, s_dq2b, s_dq2h, s_dq2n, f1, f2, dv,
           F1: tl.constexpr, F2: tl.constexpr, DV: tl.constexpr, BLOCK: tl.constexpr, IEEE: tl.constexpr):
    """dQ_g of query block i of one (sample, head): scale·dS k_g over the key blocks up to the diagonal (the
    deterministic backward's second kernel)."""
    i0, b, h, bh = program(BLOCK, H)
    rows, vcol = i0 + tl.arange(0, BLOCK), tl.arange(0, DV)
    q1, q2 = _pair(Q1 + b * s_q1b + h * s_q1h, Q2 + b * s_q2b + h * s_q2h, s_q1n, s_q2n, rows, n, f1, f2, F1, F2)
    do = tile(DO + b * s_ob + h * s_oh, rows, vcol, s_on, n, dv)                         # (BLOCK, DV)
    lse, delta = _stats(L, D, bh, rows, n)                                               # (BLOCK,) each
    dq1, dq2 = tl.zeros((BLOCK, F1), tl.float32), tl.zeros((BLOCK, F2), tl.float32)
    for j0 in range(0, i0 + BLOCK, BLOCK):
        cols = j0 + tl.arange(0, BLOCK)
        k1, k2 = _pair(K1 + b * s_k1b + h * s_k1h, K2 + b * s_k2b + h * s_k2h, s_k1n, s_k2n, cols, n, f1, f2, F1, F2)
        v = tile(V + b * s_vb + h * s_vh, cols, vcol, s_vn, n, dv)                       # (BLOCK, DV)
        p = tl.exp(_scores(q1, k1, q2, k2, Bias + h * s_bh, rows, cols, n, scale, IEEE) - lse[:, None])
        ds = p * (dot(do, tl.trans(v), IEEE) - delta[:, None])                           # 2·BLOCK²·DV FLOPs
        dq1 += dot(ds.to(k1.dtype), k1, IEEE)                                            # 2·BLOCK²·F FLOPs
        dq2 += dot(ds.to(k2.dtype), k2, IEEE)
    _store(DQ1 + b * s_dq1b + h * s_dq1h, rows, F1, s_dq1n, n, f1, scale * dq1)
    _store(DQ2 + b * s_dq2b + h * s_dq2h, rows, F2, s_dq2n, n, f2, scale * dq2)


def _config(q1, q2, v) -> dict:
    c = dict(f1=q1.shape[-1], f2=q2.shape[-1], dv=v.shape[-1], F1=width(q1.shape[-1]), F2=width(q2.shape[-1]),
             DV=width(v.shape[-1]), BLOCK=block(q1), IEEE=exact(q1))
    # warps and stages on a GPU: 8 warps, 2 stages for tiles 256 wide in all (a (64, 128) fp32 dK_g pair and dV in
    # registers, q and dO tiles double-buffered in shared memory: proposed for sm_90, not measured on a GPU);
    # Triton's defaults for narrower ones. The interpreter takes none.
    launch = dict(num_warps=8, num_stages=2) if q1.is_cuda and c["F1"] + c["F2"] > 128 else {}
    return c, launch


@torch.library.custom_op("synthformer::key_bias_attention", mutates_args=())
def _forward(q1: torch.Tensor, q2: torch.Tensor, k1: torch.Tensor, k2: torch.Tensor, v: torch.Tensor,
             b: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(O (B, Hl, n, d_v) in the mixer's layout, L (B, Hl, n) fp32). Grid (⌈n/BLOCK⌉, B·Hl)."""
    B, H, n, _ = v.shape
    (c, launch), (o, lse) = _config(q1, q2, v), outputs(v)
    _fwd[(triton.cdiv(n, c["BLOCK"]), B * H)](q1, q2, k1, k2, v, b, o, lse, n, H, scale, *rows(q1, q2, k1, k2, v, o),
                                              b.stride(0), **c, **launch)
    return o, lse


@_forward.register_fake
def _(q1, q2, k1, k2, v, b, scale):
    return outputs(v)


@torch.library.custom_op("synthformer::key_bias_attention_backward", mutates_args=("dq1", "dq2"))
def _backward(do: torch.Tensor, q1: torch.Tensor, q2: torch.Tensor, k1: torch.Tensor, k2: torch.Tensor,
              v: torch.Tensor, b: torch.Tensor, lse: torch.Tensor, D: torch.Tensor, dq1: torch.Tensor,
              dq2: torch.Tensor, scale: float, one_pass: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                         torch.Tensor]:
    """(dk₁, dk₂ per sample, dv, Σ_i dS_ij per sample (B, Hl, n) fp32); dQ_g into dq1, dq2: added into their fp32
    zeros with atomics (one_pass), else written by the second kernel. Grid (⌈n/BLOCK⌉, B·Hl) for each. Only
    launches and allocations here: the ops around it are plain torch (visible to inductor, which fuses them)."""
    B, H, n, _ = v.shape
    (c, launch), grid = _config(q1, q2, v), (triton.cdiv(n, block(q1)), B * H)
    dk = [torch.empty(v.shape[:3] + k.shape[-1:], device=k.device, dtype=k.dtype) for k in (k1, k2)]
    dv = torch.empty(v.shape, device=v.device, dtype=v.dtype)
    db = torch.empty((B, H, n), device=v.device, dtype=torch.float32)
    strides = rows(q1, q2, k1, k2, v, do)
    _bwd_kv[grid](q1, q2, k1, k2, v, b, do, lse, D, *dk, dv, db, dq1, dq2, n, H, scale, *strides, b.stride(0),
                  *rows(*dk, dv, dq1, dq2), **c, ONE_PASS=one_pass, **launch)
    if not one_pass:
        _bwd_q[grid](q1, q2, k1, k2, v, b, do, lse, D, dq1, dq2, n, H, scale, *strides, b.stride(0), *rows(dq1, dq2),
                     **c, **launch)
    return dk[0], dk[1], dv, db


@_backward.register_fake
def _(do, q1, q2, k1, k2, v, b, lse, D, dq1, dq2, scale, one_pass):
    keys = [torch.empty(v.shape[:3] + k.shape[-1:], device=k.device, dtype=k.dtype) for k in (k1, k2)]
    return *keys, torch.empty_like(v), torch.empty(v.shape[:3], device=v.device, dtype=torch.float32)


def _setup(ctx, inputs, output):
    q1, q2, k1, k2, v, b, scale = inputs
    ctx.save_for_backward(q1, q2, k1, k2, v, b, *output)
    ctx.scale = scale
    ctx.mark_non_differentiable(output[1])


def _grads(ctx, do, _):
    """dQ by atomics into fp32 zeros (one pass) or, under torch.use_deterministic_algorithms, by its own kernel."""
    q1, q2, k1, k2, v, b, o, lse = ctx.saved_tensors
    do = do if do.stride(-1) == 1 else do.contiguous()
    one_pass = not torch.are_deterministic_algorithms_enabled()
    dq = [torch.zeros(q.shape, device=q.device, dtype=torch.float32) if one_pass else
          torch.empty(q.shape, device=q.device, dtype=q.dtype) for q in (q1, q2)]
    dk1, dk2, dv, db = _backward(do, q1, q2, k1, k2, v, b, lse, row_deltas(do, o), *dq, ctx.scale, one_pass)
    return dq[0].to(q1.dtype), dq[1].to(q2.dtype), dk1, dk2, dv, db.sum(0).to(b.dtype), None   # db_j = Σ_b Σ_i dS_ij


_forward.register_autograd(_grads, setup_context=_setup)


def key_bias_flash_attention(qs, ks, v, key_bias, scale: float = 1.0) -> torch.Tensor:
    """softmax(scale·Σ_g q_g k_gᵀ + b + M) v; qs, ks: one or two groups of (B or 1, Hl, n, f_g) (a tensor for one),
    Σ f_g ≤ 256; v (B, Hl, n, d_v ≤ 256), key_bias b (Hl, n) -> (B, Hl, n, d_v)."""
    qs, ks = ([x] if isinstance(x, torch.Tensor) else list(x) for x in (qs, ks))
    f = sum(q.shape[-1] for q in qs)
    if len(qs) > 2 or max(f, v.shape[-1]) > MAX_WIDTH:
        raise ValueError(f"key-bias flash attention takes two feature groups of widths ≤ {MAX_WIDTH} in all, got "
                         f"{len(qs)} groups, f {f}, d_v {v.shape[-1]}")
    if len(qs) == 1:   # one group as two views of its halves
        half = f // 2
        qs, ks = [qs[0][..., :half], qs[0][..., half:]], [ks[0][..., :half], ks[0][..., half:]]
    B = v.shape[0]
    *qk, v = at_autocast_dtype(*qs, *ks, v)   # b stays in its dtype: added and reduced in fp32 in the kernels
    q1, q2, k1, k2 = (t.expand(B, -1, -1, -1) if t.stride(-1) == 1 else t.expand(B, -1, -1, -1).contiguous()
                      for t in qk)
    b = key_bias if key_bias.stride(-1) == 1 else key_bias.contiguous()     # (Hl, n)
    return _forward(q1, q2, k1, k2, v, b, scale)[0]
