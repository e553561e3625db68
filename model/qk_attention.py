"""Attention whose logits have a q·k form (dot, dense and their mixtures): A = softmax(scale·q kᵀ + bias + M) V on
fused kernels, without keeping B·Hl·n² maps (docs/DESIGN.md §1, "Fused kernels").

Legend: B batch, Hl heads on this TP rank, n sequence length, f feature width of a query/key, d_h head size.

- `qk_attention`: S = scale·q·kᵀ + b for synthesized q/k, given in groups (one per member of a mixture), and a
  per-key bias b (dense's b_2), through torch SDPA. Its flash and cuDNN kernels run only if q, k, v share batch
  size and width (≤ 256 on CUDA; cuDNN's sm90 backward: 256/256 or both ≤ 128) and no mask needs grad, so the
  groups are concatenated, batch-shared keys are `.expand()`ed (stride 0, no copy), the narrower side is
  zero-padded, and b rides as a feature column — or, where that column would pass 256 (dense+dot at d_h 128,
  f 128 + 128), on the GPU the values carry it (`_values_with_key_bias`, v padded to 256): twice dot's attention
  work where dense+dot's FLOP count credits 1.5×. The Triton key-bias kernel runs that case at its own widths
  (model/gpu_kernels/key_bias_attention.py: the groups apart, W₂ read once for the batch, b added to each score
  tile, v at 128, 1408·n² FLOPs per sample and head against SDPA's 1792·n²) where SYNTHFORMER_KEY_BIAS_KERNEL=triton:
  opt-in until a GPU run times it against the SDPA form (docs/gpu/README.md).
- `BiasedQKAttention`: S = q·kᵀ + w ⊙ R with a learnable map R weighted per head (random+dot, random+dense): flash
  forward and a backward that walk blocks of query rows over the causal keys only, w ⊙ R + M made per block, so
  B·Hl·block·n is live and nothing n² is kept between forward and backward; on the GPU a Triton kernel
  (model/gpu_kernels/biased_attention.py).
Each asks `kernels.on_gpu_path` once, as every kernel of model/kernels.py does.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from .kernels import causal_mask, in_autocast_dtype, on_gpu_path, triton_kernel


# The widest q/k/v that CUDA's flash kernel takes; wider ones fall to the memory-efficient kernel's slow generic
# path (dense+dot at d_h 128 with its bias column, 264 wide: 12.9 ms a layer's backward on an H100, dot's 0.85).
SDPA_MAX_WIDTH = 256


def _common_width(q: torch.Tensor, v: torch.Tensor) -> int:
    """The width q, k, v are padded to: v's when the features fit, else a multiple of 8 (the CPU kernels' vector
    width: 129 → 136 runs dense+dot's flash kernel ~10% faster than 129, measured)."""
    return v.shape[-1] if q.shape[-1] <= v.shape[-1] else -(-q.shape[-1] // 8) * 8


def _pad_last(x: torch.Tensor, width: int) -> torch.Tensor:
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


def with_key_bias(q: torch.Tensor, k: torch.Tensor, key_bias, scale: float):
    """q, k with one more feature each, so that scale·q kᵀ gains b_j: q's column 1/scale, k's column b (Hl, n)."""
    if key_bias is None:
        return q, k
    ones = q.new_full(q.shape[:-1] + (1,), 1.0 / scale)
    b = key_bias[None, :, :, None].to(k.dtype).expand(k.shape[0], -1, -1, -1)   # (B or 1, Hl, n, 1)
    return torch.cat((q, ones), -1), torch.cat((k, b), -1)


def _values_with_key_bias(v: torch.Tensor, key_bias: torch.Tensor) -> torch.Tensor:
    """[e ⊙ v, e] (B, Hl, n, d_h + 1), e_j = e^{b_j − c}: b carried by the values instead of the features. With
    P = softmax(s·q kᵀ + M),
        softmax(s·q kᵀ + b + M) v = P (e ⊙ v) / P e
    (e_j scales key j's weight in numerator and denominator alike; c = max_j b_j per head cancels and keeps e ≤ 1).
    Exact while b's spread within a head stays below ~80 (e^{−87} is the smallest normal float of fp32 and bf16).
    In v's dtype: fp32 here measured no closer to the formula in bf16, only slower."""
    b = key_bias.to(v.dtype)
    e = torch.exp(b - b.detach().amax(-1, keepdim=True))[None, :, :, None]        # (1, Hl, n, 1)
    return torch.cat((v * e, e.expand(v.shape[0], -1, -1, -1)), -1)


def key_bias_kernel() -> str:
    """SYNTHFORMER_KEY_BIAS_KERNEL: what runs q·k features that fill SDPA's 256 beside a key bias on the GPU path,
    "sdpa" (the default: the value-factor form) or "triton" (the key-bias kernel at the features' own widths)."""
    choice = os.environ.get("SYNTHFORMER_KEY_BIAS_KERNEL") or "sdpa"
    if choice not in ("sdpa", "triton"):
        raise ValueError(f"SYNTHFORMER_KEY_BIAS_KERNEL={choice!r}: set it to sdpa (the default) or triton")
    return choice


def concat_features(parts: list[torch.Tensor]) -> torch.Tensor:
    """One q or k (B or 1, Hl, n, Σf) from the feature groups of a mixture's members (B or 1, Hl, n, f_g): a
    batch-shared group (dense's W₂ rows) is expanded to the batch first where another is per sample."""
    if len(parts) == 1:
        return parts[0]
    B = max(p.shape[0] for p in parts)
    return torch.cat([p.expand(B, -1, -1, -1) for p in parts], dim=-1)


def qk_attention(qs: list[torch.Tensor], ks: list[torch.Tensor], v: torch.Tensor, scale: float,
                 key_bias=None) -> torch.Tensor:
    """softmax(scale·Σ_g q_g k_gᵀ + b + M) v on a fused kernel.

    qs, ks: the q·k features in groups, one per member of a mixture, each (B or 1, Hl, n, f_g) — a batch of 1 is
    shared by all samples; v: (B, Hl, n, d_h); key_bias b: (Hl, n) or None. SDPA takes the groups concatenated
    (`concat_features`) and b as a feature column of q and k — unless that column would take them past flash's
    widths on the GPU path, where the values carry it (`_values_with_key_bias`, v padded to q's width), or, there,
    with SYNTHFORMER_KEY_BIAS_KERNEL=triton, the Triton key-bias kernel takes the groups apart and adds b to the
    scores (v at d_h; model/gpu_kernels/key_bias_attention.py). Returns (B, Hl, n, d_h).
    """
    B, d_h, gpu = v.shape[0], v.shape[-1], on_gpu_path(v)
    f = sum(q.shape[-1] for q in qs)
    on_values = key_bias is not None and gpu and f + 1 > SDPA_MAX_WIDTH >= f
    flash = on_values and d_h <= SDPA_MAX_WIDTH and key_bias_kernel() == "triton" and triton_kernel("key_bias_attention")
    if flash:   # at the flagship's own widths: no concatenation of two groups, no column, no factor on v, no padding
        qs, ks = ([p[0], concat_features(p[1:])] if len(p) > 2 else p for p in (qs, ks))   # a third member's joins
        return flash.key_bias_flash_attention(qs, ks, v, key_bias, scale)                  # the second group
    q, k = concat_features(qs), concat_features(ks)                    # (B or 1, Hl, n, f)
    if on_values:
        v = _values_with_key_bias(v, key_bias)
    else:
        q, k = with_key_bias(q, k, key_bias, scale)
    width = _common_width(q, v)
    q = _pad_last(q, width).expand(B, -1, -1, -1)   # (B, Hl, n, width); zero features add 0 to q·k
    k = _pad_last(k, width).expand(B, -1, -1, -1)
    if gpu:   # a batch stride of 0 sends CUDA's SDPA to its slow memory-efficient backward (9× dot's): a shared
        # q or k is materialized; per-sample heads stay the strided views of their projection (no layout copy)
        q, k = (t.contiguous() if t.stride(0) == 0 and B > 1 else t for t in (q, k))
    v_wide = _pad_last(v, width)                     # zero columns give zero outputs, sliced off below
    out = F.scaled_dot_product_attention(q, k, v_wide, is_causal=True, scale=scale)
    if not on_values:
        return out[..., :d_h]
    rows = out.transpose(1, 2)                       # (B, n, Hl, ·): the quotient is made in the mixer's layout
    return (rows[..., :d_h] / rows[..., d_h:d_h + 1]).transpose(1, 2)


class BiasedQKAttention(torch.autograd.Function):
    """out = softmax(q kᵀ + w ⊙ R + M) v with scale 1, a batch-shared bias map R (Hl, n, n) and its weight per head
    w (Hl,) (the mixture's α, so neither w ⊙ R nor its gradient is ever a separate n² tensor of autograd's).

    q, k, v: (B, Hl, n, f), same width (pad before). Both passes walk blocks of `block` query rows i over only the
    keys j ≤ i they can see (causality halves the work; a float mask keeps SDPA from skipping anything itself) and
    make w ⊙ R + M for the block only. Forward: SDPA's flash kernel per block (29 vs 48 ms for one masked call at
    B=4, Hl=8, n=1024 on 2 CPU cores). Backward, recomputing P, with the standard softmax-attention gradients:
        P = softmax(S),  dP = dO vᵀ,  dS = P ⊙ (dP − rowsum(dO ⊙ O)),
        dq = dS k,  dk = dSᵀ q,  dv = Pᵀ dO,  dR = w ⊙ Σ_batch dS,  dw = Σ_ij (Σ_batch dS) ⊙ R.
    Live memory per block is B·Hl·block·n, linear in n (besides dR itself, Hl·n²); nothing n² is saved.
    """

    @staticmethod
    def forward(ctx, q, k, v, R, w, block: int):
        n, w3 = q.shape[-2], w[:, None, None]
        causal = causal_mask(n, q.device, q.dtype)
        out = torch.empty_like(v)
        for i0 in range(0, n, block):
            i, j = slice(i0, min(n, i0 + block)), slice(0, min(n, i0 + block))   # rows i, keys j ≤ i
            mask = torch.addcmul(causal[i, j], R[:, i, j], w3)                     # (Hl, blk, j)
            out[:, :, i] = F.scaled_dot_product_attention(q[:, :, i], k[:, :, j], v[:, :, j],
                                                          attn_mask=mask.unsqueeze(0), scale=1.0)
        ctx.save_for_backward(q, k, v, R, w, out)
        ctx.block = block
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, R, w, out = ctx.saved_tensors
        # heads are transposed views: one copy each here, not one per block in every matmul (~10% of the pass)
        q, k, v, d_out = q.contiguous(), k.contiguous(), v.contiguous(), d_out.contiguous()
        n = q.shape[-2]
        causal = causal_mask(n, q.device, q.dtype)
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)        # q, k may be expanded: own buffers
        dk, dv = torch.zeros(k.shape, dtype=k.dtype, device=k.device), torch.zeros_like(v)
        dR = torch.zeros_like(R) if ctx.needs_input_grad[3] else None
        dw = torch.zeros_like(w)
        D = (d_out * out).sum(-1, keepdim=True)                          # (B, Hl, n, 1)
        w3 = w[:, None, None]
        for i0 in range(0, n, ctx.block):
            i, j = slice(i0, min(n, i0 + ctx.block)), slice(0, min(n, i0 + ctx.block))   # rows i, keys j ≤ i
            bias = torch.addcmul(causal[i, j], R[:, i, j], w3)                                # (Hl, blk, j)
            S = (q[:, :, i] @ k[:, :, j].transpose(-1, -2)).add_(bias)                        # (B, Hl, blk, j)
            P = torch.softmax(S, dim=-1)
            del S
            dS = (d_out[:, :, i] @ v[:, :, j].transpose(-1, -2)).sub_(D[:, :, i]).mul_(P)
            dq[:, :, i] = dS @ k[:, :, j]
            dk[:, :, j] += dS.transpose(-1, -2) @ q[:, :, i]
            dv[:, :, j] += P.transpose(-1, -2) @ d_out[:, :, i]
            d_map = dS.sum(0)                                            # (Hl, blk, j): d(w ⊙ R) of the block
            dw += (d_map * R[:, i, j]).sum((-1, -2))
            if dR is not None:
                dR[:, i, j] = d_map.mul_(w3)
        return dq, dk, dv, dR, dw, None


def biased_qk_attention(q, k, R, w, v, block: int = 128) -> torch.Tensor:
    """softmax(q kᵀ + w ⊙ R + M) v; q, k: (B or 1, Hl, n, f), R (Hl, n, n), w (Hl,), v (B, Hl, n, d_h)
    -> (B, Hl, n, d_h)."""
    gpu = on_gpu_path(v) and triton_kernel("biased_attention")
    if gpu:   # a Triton flash kernel adding R's tiles (any widths; no padding needed)
        return gpu.biased_flash_attention(q, k, R, w, v)
    B, d_h = v.shape[0], v.shape[-1]
    width = _common_width(q, v)
    q = _pad_last(q, width).expand(B, -1, -1, -1)
    k = _pad_last(k, width).expand(B, -1, -1, -1)
    out = in_autocast_dtype(BiasedQKAttention.apply, q, k, _pad_last(v, width), R, w, block)
    return out[..., :d_h]


