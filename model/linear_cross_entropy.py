"""The LM head and its cross-entropy in one pass over row chunks: no (B·n, V) logits are ever materialized.

    loss = Σ_i keep_i · (logsumexp_v(x_i · W_v) − x_i · W_{t_i}) / Σ_i keep_i        x (N, d), W (V, d), N = B·n

Its gradient is known in the forward pass, since the loss is a scalar: with p_i = softmax(x_i Wᵀ) and e_t the
one-hot of the target, ∂loss/∂(x_i Wᵀ) = keep_i · (p_i − e_{t_i}) / Σ keep. So each chunk of C rows computes its
logits (C, V), their log-sum-exp, its loss, and at once its share of both gradients, ∂x = G W (C, d) and
∂W += Gᵀ x (V, d); then the chunk's logits are dropped. Backward only scales the two stored gradients by the
incoming one (Liger-Kernel's fused linear cross-entropy does the same; this one is plain torch, so it runs on CPU
and GPU alike, and it is exact under vocabulary-parallel TP).

Peak memory: two (C, V) fp32 tensors instead of the unfused path's (N, V) logits, their fp32 copy, log-softmax and
gradient. FLOPs: the unfused path's 3 · 2·N·d·V (forward, ∂x, ∂W), no recomputation.

Tensor parallelism: W is this rank's vocabulary slice (V/TP, d); the row max, the sum of exponentials and the target
logit are all-reduced over the TP group (megatron's vocab_parallel_cross_entropy does the same on full logits), and
∂x is this rank's partial sum: the caller passes x through `copy_to_tp`, whose backward all-reduces it.
Precision: the matmuls run in the autocast dtype where autocast is on (as the unfused head's would), everything
after them in fp32.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import parallel as tp

CHUNK_ELEMENTS = 2**25   # logits per chunk: rows = this ÷ the vocabulary slice (1048 rows at V/TP = 32000)


def chunk_rows(vocab_slice: int, rows: int) -> int:
    return max(1, min(rows, CHUNK_ELEMENTS // vocab_slice))


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype of the head's matmul: the autocast dtype where autocast is on for x's device, else x's."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


def all_reduce_tp(t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if tp.tp_world() > 1:
        dist.all_reduce(t, op=op, group=tp.tp_group())
    return t


class LinearCrossEntropy(torch.autograd.Function):
    """(x (N, d), W (V/TP, d), targets (N,) in [0, V), keep (N,) 0/1) → the mean loss over the kept rows."""

    @staticmethod
    def forward(ctx, x, weight, targets, keep):
        dtype = compute_dtype(x)
        with torch.autocast(x.device.type, enabled=False):
            xc, wc = x.to(dtype), weight.to(dtype)                       # (N, d), (V/TP, d)
            n_rows, vocab = xc.shape[0], wc.shape[0]
            first = tp.tp_rank() * vocab                                 # this rank's vocabulary range
            local = targets - first                                      # (N,)
            mine = (local >= 0) & (local < vocab)                        # targets in this rank's slice
            local = local.masked_fill(~mine, 0)
            scale = keep.float() / keep.float().sum()                    # (N,) ∂loss/∂ℓ_i (NaN if none kept)
            grad_x = torch.empty_like(xc)                                # (N, d)
            grad_w = torch.zeros(wc.shape, dtype=torch.float32, device=wc.device)   # (V/TP, d) fp32 sum
            losses = []
            step = chunk_rows(vocab, n_rows)
            for s in range(0, n_rows, step):
                e = min(s + step, n_rows)
                logits = (xc[s:e] @ wc.T).float()                        # (C, V/TP)   2·C·d·V/TP FLOPs
                row_max = all_reduce_tp(logits.max(dim=-1).values, dist.ReduceOp.MAX)        # (C,)
                logits -= row_max[:, None]                               # z − max, in place
                rows = torch.arange(e - s, device=x.device)
                target = all_reduce_tp(torch.where(mine[s:e], logits[rows, local[s:e]], 0.0))   # (C,) z_t − max
                exp = logits.exp_()                                      # (C, V/TP) in place
                total = all_reduce_tp(exp.sum(dim=-1))                   # (C,) Σ_v exp(z_v − max), all ranks
                losses.append(total.log() - target)                      # (C,) ℓ_i = lse_i − z_{i,t}
                probs = exp.div_(total[:, None])                         # (C, V/TP) softmax, in place
                probs[rows, local[s:e]] -= mine[s:e].float()             # − one-hot of the target
                g = (probs * scale[s:e, None]).to(dtype)                 # (C, V/TP) ∂loss/∂logits
                grad_x[s:e] = g @ wc                                     # (C, d)      2·C·V/TP·d FLOPs
                grad_w.add_(g.T @ xc[s:e])                               # (V/TP, d)   2·C·V/TP·d FLOPs
            loss = (torch.cat(losses) * scale).sum()
        ctx.save_for_backward(grad_x, grad_w)
        ctx.dtypes = (x.dtype, weight.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_x, grad_w = ctx.saved_tensors
        return ((grad_x * grad_loss).to(ctx.dtypes[0]), (grad_w * grad_loss).to(ctx.dtypes[1]), None, None)


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of the head `x Wᵀ` (x (B, n, d), W (V/TP, d) this rank's vocabulary slice) against
    `targets` (B, n), over the targets that are not `ignore_index`; the logits are never materialized."""
    keep = targets != ignore_index
    flat = tp.copy_to_tp(x).reshape(-1, x.shape[-1])                     # ∂x all-reduced over TP
    return LinearCrossEntropy.apply(flat, weight, targets.masked_fill(~keep, 0).reshape(-1), keep.reshape(-1))
