"""Fused execution of synthesized attention (docs/DESIGN.md §1, "Fused kernels").

Legend: B batch, Hl heads on this TP rank, n sequence length, f feature width of a query/key, d_h head size.

Four ways to run A = softmax(S + M) V without keeping B·Hl·n² maps:
- `qk_attention` and `BiasedQKAttention` (model/qk_attention.py): S = q·kᵀ plus a per-key bias (dense's b_2) or a
  learnable map R (random+dot), for synthesized q/k (dot, dense and their mixtures).
- `shared_map_attention`: S does not depend on the input (random, factorized_random, their mixture): A is the same
  for every sample and applied with the batch folded into the columns of V, in blocks of query rows over the causal
  keys only, a factored map (R_1 R_2ᵀ) built block by block; no n² buffer is kept for backward.
- `FactorizedDenseAttention`: S_i[j] = A_i[j mod a]·B_i[⌊j/a⌋] has no q·k form; its logits are built from the
  factors one block of query rows at a time (causal keys only) and recomputed in backward.
And one without a softmax, for gMLP's spatial gating: `CausalMatmul`, Y = (W ⊙ causal)[:n, :n] X in causal blocks.

These are the CPU kernels: blocks of rows walked in Python suit a CPU, while on a GPU each block is a handful of
tiny kernel launches. Each op below therefore asks `on_gpu_path` once and, on a GPU, runs its GPU form: SDPA on
contiguous inputs, one batched GEMM for a batch-shared map, Triton kernels where no library kernel fits
(model/gpu_kernels/). Both forms compute the same formula and are tested against the materialized reference.
"""
from __future__ import annotations

import importlib
import math
import os

import torch
import torch.nn.functional as F


def on_gpu_path(t: torch.Tensor) -> bool:
    """The one place a kernel is chosen by device: CUDA tensors take the GPU forms, every other device the CPU ones.
    SYNTHFORMER_KERNELS=gpu sends CPU tensors down the GPU path too, its Triton kernels then under
    TRITON_INTERPRET=1: how the tests check the GPU kernels on a machine without one."""
    return t.is_cuda or os.environ.get("SYNTHFORMER_KERNELS") == "gpu"


def triton_kernel(name: str):
    """The module model/gpu_kernels/<name>.py, or None where it cannot load: without triton, or in a Hugging Face
    export, which carries model/'s own files but not that package (imported by name, so that transformers' loader
    does not require it). The caller then runs its CPU form, which is correct on a GPU too, only slower."""
    try:
        return importlib.import_module(f"{__package__}.gpu_kernels.{name}")
    except ImportError:
        return None


def _autocast_dtype(t: torch.Tensor):
    """torch.autocast's dtype on t's device where it is on, else None."""
    device = t.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


def at_autocast_dtype(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors in torch.autocast's dtype where it is on (else as they are), as SDPA takes them. Under autocast
    fp32 parameters used as features (dense's W_2 rows, R_1/R_2) and queries scaled by an fp32 weight arrive in
    fp32 beside bf16 activations: cast before they are expanded to the batch and concatenated, not after (SDPA's
    own cast), and a Triton kernel does not take its exact fp32 dots (what that cost: docs/benchmarks.md)."""
    dtype = _autocast_dtype(tensors[0])
    return tensors if dtype is None else tuple(t.to(dtype) for t in tensors)


def in_autocast_dtype(kernel, *args):
    """kernel(*args) — a CPU kernel's autograd Function — with its tensors in torch.autocast's dtype and autocast
    off inside, where autocast is on: its forward and backward then run in one dtype, as they do outside autocast
    (left to autocast, fp32 parameters beside bf16 activations meet in one matmul, and backward, which runs without
    autocast, fails on them)."""
    first = next(a for a in args if isinstance(a, torch.Tensor))
    dtype = _autocast_dtype(first)
    if dtype is None:
        return kernel(*args)
    args = [a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    with torch.autocast(first.device.type, enabled=False):
        return kernel(*args)


def causal_mask(n: int, device, dtype=torch.float32, first_row: int = 0) -> torch.Tensor:
    """M (n − first_row, n): rows i = first_row … n−1 of the causal mask, 0 for keys j ≤ i, -inf above — added to the
    logits before the softmax. Only the rows asked for are built (a context-parallel chunk's or a decoding step's)."""
    return torch.full((n - first_row, n), float("-inf"), device=device, dtype=dtype).triu_(1 + first_row)


class SharedMapAttention(torch.autograd.Function):
    """Y = softmax(S + q kᵀ + M) V for one map shared by the batch, given as S (Hl, n, n), as factors q, k (Hl, n, f),
    or both (None for a missing part); V (Hl, n, B·d_h) with the batch folded into the columns. Blocks of `block`
    query rows i see only keys j ≤ i (causality halves the work); neither A nor any n² buffer is kept for backward
    (a factored map is never whole) — the rows of A are recomputed there:
        dV = Aᵀ dY,  dS = A ⊙ (dY Vᵀ − D),  D_i = dY_i · Y_i  (= rowsum(A ⊙ dY Vᵀ), the flash identity),
        dq = dS k,  dk = dSᵀ q.
    Live memory besides dS itself (the gradient of S, Hl·n², only when S is given): Hl·block·n.
    """

    @staticmethod
    def _logits(S, q, k, mask, i, j):
        out = mask[i, j] if S is None else S[:, i, j] + mask[i, j]                      # (Hl, blk, j)
        return out if q is None else torch.baddbmm(out, q[:, i], k[:, j].transpose(-1, -2))

    @staticmethod
    def forward(ctx, S, q, k, v, block: int):
        n = v.shape[1]
        mask = causal_mask(n, v.device, v.dtype)
        y = torch.empty_like(v)
        for i0 in range(0, n, block):
            i, j = slice(i0, min(n, i0 + block)), slice(0, min(n, i0 + block))   # rows i, keys j ≤ i
            y[:, i] = torch.softmax(SharedMapAttention._logits(S, q, k, mask, i, j), dim=-1) @ v[:, j]
        ctx.save_for_backward(S, q, k, v, y)
        ctx.block = block
        return y

    @staticmethod
    def backward(ctx, dy):
        S, q, k, v, y = ctx.saved_tensors
        n = v.shape[1]
        mask = causal_mask(n, v.device, v.dtype)
        dS = None if S is None or not ctx.needs_input_grad[0] else torch.zeros_like(S)
        dq, dk = (None, None) if q is None else (torch.zeros_like(q), torch.zeros_like(k))
        dv = torch.zeros_like(v)
        D = (dy * y).sum(-1, keepdim=True)                                # (Hl, n, 1)
        for i0 in range(0, n, ctx.block):
            i, j = slice(i0, min(n, i0 + ctx.block)), slice(0, min(n, i0 + ctx.block))
            A = torch.softmax(SharedMapAttention._logits(S, q, k, mask, i, j), dim=-1)   # (Hl, blk, j)
            dv[:, j] += A.transpose(-1, -2) @ dy[:, i]
            dA = (dy[:, i] @ v[:, j].transpose(-1, -2)).sub_(D[:, i]).mul_(A)
            if dS is not None:
                dS[:, i, j] = dA
            if dq is not None:
                dq[:, i] = dA @ k[:, j]
                dk[:, j] += dA.transpose(-1, -2) @ q[:, i]
        return dS, dq, dk, dv, None


def shared_map_attention(logits, v: torch.Tensor, q=None, k=None, block: int = 128) -> torch.Tensor:
    """softmax(S + q kᵀ + M) v for an input-independent map: S (Hl, n, n) or None, q, k (Hl, n, f) or None;
    v (B, n, Hl, d_h) -> (B, n, Hl, d_h)."""
    B, n, Hl, d_h = v.shape
    v_cols = v.permute(2, 1, 0, 3).reshape(Hl, n, B * d_h)                          # (Hl, n, B·d_h)
    if on_gpu_path(v):   # softmax once, then one batched GEMM: A (Hl, n, n) is kept for backward, shared by B
        dt = v.dtype     # under autocast, the values' (bf16): the map is made in it too, not in fp32 and cast
        S = causal_mask(n, v.device, dt) if logits is None else logits.to(dt) + causal_mask(n, v.device, dt)
        S = S if q is None else torch.baddbmm(S.expand(Hl, n, n), q.to(dt), k.to(dt).transpose(-1, -2))
        y = torch.softmax(S, dim=-1, dtype=dt) @ v_cols                             # (Hl, n, B·d_h)
    else:
        y = in_autocast_dtype(SharedMapAttention.apply, logits, q, k, v_cols, block)  # (Hl, n, B·d_h)
    return y.view(Hl, n, B, d_h).permute(2, 1, 0, 3)                                 # (B, n, Hl, d_h)


class FactorizedDenseAttention(torch.autograd.Function):
    """Y = softmax(S + M) V for factorized dense logits S[b, h, i, j] = A_i[j mod a] · B_i[⌊j/a⌋], built block by
    block from the factors A (B, Hl, n, a) and B (B, Hl, n, b) and never kept: blocks of `block` query rows i over
    the causal keys j ≤ i only (causality halves the work), P recomputed in backward:
        dV = Pᵀ dY,  dS = P ⊙ (dY Vᵀ − D),  D_i = dY_i · Y_i,
        dA_i[p] = Σ_r dS_i[r·a + p] B_i[r],  dB_i[r] = Σ_p dS_i[r·a + p] A_i[p].
    Live memory: B·Hl·block·n, linear in n.
    """

    @staticmethod
    def _logits(A, Bf, i0, i1):
        """S for rows i0..i1-1 and keys 0..i1-1 (B, Hl, rows, i1), the causal mask added; r rows of the (b, a) grid."""
        r = -(-i1 // A.shape[-1])
        S = (Bf[:, :, i0:i1, :r, None] * A[:, :, i0:i1, None, :]).flatten(-2)[..., :i1]
        S[..., i0:] += causal_mask(i1 - i0, S.device, S.dtype)                     # the diagonal block
        return S, r

    @staticmethod
    def forward(ctx, A, Bf, v, block: int):
        n = v.shape[2]
        y = torch.empty_like(v)
        for i0 in range(0, n, block):
            i1 = min(n, i0 + block)
            S, _ = FactorizedDenseAttention._logits(A, Bf, i0, i1)
            y[:, :, i0:i1] = torch.softmax(S, dim=-1) @ v[:, :, :i1]
        ctx.save_for_backward(A, Bf, v, y)
        ctx.block = block
        return y

    @staticmethod
    def backward(ctx, dy):
        A, Bf, v, y = ctx.saved_tensors
        n, a = v.shape[2], A.shape[-1]
        dA, dBf, dv = torch.zeros_like(A), torch.zeros_like(Bf), torch.zeros_like(v)
        D = (dy * y).sum(-1, keepdim=True)                                        # (B, Hl, n, 1)
        for i0 in range(0, n, ctx.block):
            i1 = min(n, i0 + ctx.block)
            S, r = FactorizedDenseAttention._logits(A, Bf, i0, i1)
            P = torch.softmax(S, dim=-1)                                          # (B, Hl, rows, i1)
            del S
            dv[:, :, :i1] += P.transpose(-1, -2) @ dy[:, :, i0:i1]
            dS = (dy[:, :, i0:i1] @ v[:, :, :i1].transpose(-1, -2)).sub_(D[:, :, i0:i1]).mul_(P)
            dS = F.pad(dS, (0, r * a - i1)).unflatten(-1, (r, a))                 # (B, Hl, rows, r, a)
            dA[:, :, i0:i1] = (Bf[:, :, i0:i1, None, :r] @ dS).squeeze(-2)
            dBf[:, :, i0:i1, :r] = (dS @ A[:, :, i0:i1, :, None]).squeeze(-1)
        return dA, dBf, dv, None


def factorized_dense_attention(A, Bf, v, block: int = 128) -> torch.Tensor:
    """softmax(S + M) v, S_i[j] = A_i[j mod a] · B_i[⌊j/a⌋]; A (B, Hl, n, a), Bf (B, Hl, n, b), v (B, Hl, n, d_h)."""
    gpu = on_gpu_path(v) and triton_kernel("factorized_dense")
    if gpu:   # a Triton flash kernel that builds S's tiles from the factors
        return gpu.factorized_dense_flash(A, Bf, v)
    return in_autocast_dtype(FactorizedDenseAttention.apply, A, Bf, v, block)


class CausalMatmul(torch.autograd.Function):
    """Y = (W ⊙ C)[:n, :n] X per head, C the lower-triangular (causal) mask; W (Hl, L, L) the whole parameter,
    X (Hl, n, m). Row block i of Y reads only columns j ≤ i (causality halves the work), the mask applies to the
    diagonal blocks alone, and the gradient goes straight into the causal [:n, :n] part of a (Hl, L, L) buffer —
    no masked or sliced copies of W, and none of their gradients:
        Y_i = Σ_{j≤i} W_ij X_j,   dX_j = Σ_{i≥j} W_ijᵀ dY_i,   dW_ij = dY_i X_jᵀ (j < i), tril(dY_i X_iᵀ) (j = i).
    """

    @staticmethod
    def forward(ctx, W, x, block: int):
        n = x.shape[1]
        y = torch.empty_like(x)
        for i0 in range(0, n, block):
            i1 = min(n, i0 + block)
            y[:, i0:i1] = W[:, i0:i1, i0:i1].tril() @ x[:, i0:i1]                      # the diagonal block
            if i0:
                y[:, i0:i1].baddbmm_(W[:, i0:i1, :i0], x[:, :i0])                       # the blocks left of it
        ctx.save_for_backward(W, x)
        ctx.block = block
        return y

    @staticmethod
    def backward(ctx, dy):
        W, x = ctx.saved_tensors
        n = x.shape[1]
        dW = torch.zeros_like(W) if ctx.needs_input_grad[0] else None
        dx = torch.empty_like(x) if ctx.needs_input_grad[1] else None
        for i0 in range(0, n, ctx.block):
            i1 = min(n, i0 + ctx.block)
            if dW is not None:
                dW[:, i0:i1, :i0] = dy[:, i0:i1] @ x[:, :i0].transpose(1, 2)
                dW[:, i0:i1, i0:i1] = (dy[:, i0:i1] @ x[:, i0:i1].transpose(1, 2)).tril_()
            if dx is not None:   # columns j in [i0, i1): the diagonal block and every row block below it
                dx[:, i0:i1] = W[:, i0:i1, i0:i1].tril().transpose(1, 2) @ dy[:, i0:i1]
                if i1 < n:
                    dx[:, i0:i1].baddbmm_(W[:, i1:n, i0:i1].transpose(1, 2), dy[:, i1:n])
        return dW, dx, None


def causal_matmul(W: torch.Tensor, x: torch.Tensor, block: int = 128) -> torch.Tensor:
    """(W ⊙ causal)[:n, :n] @ x for W (Hl, L, L) and x (Hl, n, m) -> (Hl, n, m)."""
    if on_gpu_path(x):   # one batched GEMM on the masked map (Hl·n², small beside B·n·m activations)
        n = x.shape[1]
        W, x = at_autocast_dtype(W[:, :n, :n], x)   # under autocast: cast the map before masking it, not after
        return W.tril() @ x
    return in_autocast_dtype(CausalMatmul.apply, W, x, block)


def inv_sqrt(d: int) -> float:
    return 1.0 / math.sqrt(d)
