"""The pieces of FlashAttention-2 (Dao 2023) that the Triton kernels of this package share: exact or tensor-core
dots, masked tile loads, the causal mask of a tile, one step of the online softmax, and the output's store.

A forward program owns BLOCK query rows of one (sample, head) and walks key blocks up to the diagonal:
    m ← max(m, rowmax S),  P = exp(S − m),  ℓ ← ℓ·e^{m_old − m} + rowsum P,  acc ← acc·e^{m_old − m} + P v
and stores O = acc / ℓ and the rows' logsumexp L = m + log ℓ, from which backward recomputes P = exp(S − L).
Under TRITON_INTERPRET=1 (CPU tensors: the tests) tiles are 16 wide and dots exact fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def dot(a, b, IEEE: tl.constexpr):
    """a @ b accumulated in fp32. IEEE: exact fp32 products, for fp32 inputs (as SDPA's fp32 path) and under the
    interpreter (whose dot mishandles bf16: numpy has none); else the tensor cores' bf16/fp16 products."""
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def tile(ptr, rows, cols, s_row, n_rows, n_cols):
    """The (rows, cols) tile of a row-major matrix with row stride s_row; zeros outside n_rows × n_cols."""
    return tl.load(ptr + rows[:, None] * s_row + cols[None, :],
                   mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols), other=0.0)


@triton.jit
def causal(s, rows, cols, n):
    """S tile with −inf above the diagonal (key j > query i) and past n."""
    keep = (rows[:, None] < n) & (cols[None, :] < n) & (cols[None, :] <= rows[:, None])
    return tl.where(keep, s, float("-inf"))


@triton.jit
def program(BLOCK: tl.constexpr, H):
    """Of a grid (⌈n/BLOCK⌉, B·H): (this program's first row or key, its sample b, head h, and b·H + h)."""
    bh = tl.program_id(1)
    return tl.program_id(0) * BLOCK, bh // H, bh % H, bh


@triton.jit
def softmax_start(BLOCK: tl.constexpr, DV: tl.constexpr):
    """(m, ℓ, acc) before the first key block: −inf, 0, 0."""
    return tl.full((BLOCK,), float("-inf"), tl.float32), tl.zeros((BLOCK,), tl.float32), tl.zeros((BLOCK, DV), tl.float32)


@triton.jit
def online_softmax(s, v, m_i, l_i, acc, IEEE: tl.constexpr):
    """One key block of the forward: (m, ℓ, acc) updated with the scores s (BLOCK, BLOCK) and values v."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)        # rows past n see no key at all
    p = tl.exp(s - m_safe[:, None])
    scale = tl.exp(m_i - m_safe)
    return m_new, l_i * scale + tl.sum(p, 1), acc * scale[:, None] + dot(p.to(v.dtype), v, IEEE)


@triton.jit
def store_output(O_row, L_row, acc, l_i, m_i, rows, vcol, s_on, n, dv):
    """O = acc / ℓ into the (rows, vcol) tile at O_row, and L = m + log ℓ of the rows at L_row."""
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    tl.store(O_row + rows[:, None] * s_on + vcol[None, :], (acc / l_safe[:, None]).to(O_row.dtype.element_ty),
             mask=(rows[:, None] < n) & (vcol[None, :] < dv))
    tl.store(L_row + rows, m_i + tl.log(l_safe), mask=rows < n)


def width(x: int) -> int:
    """A tile width: a power of two ≥ 16 (tl.dot's smallest)."""
    return max(16, triton.next_power_of_2(x))


def block(t: torch.Tensor) -> int:
    """Tile rows and columns: CPU tensors reach a Triton kernel only under the interpreter, which runs each program
    in Python: small tiles there."""
    return 16 if t.device.type == "cpu" else 64


def exact(t: torch.Tensor) -> bool:
    """IEEE dots: fp32 inputs, or the interpreter."""
    return t.dtype == torch.float32 or t.device.type == "cpu"


def rows(*tensors) -> tuple[int, ...]:
    """Batch, head and row strides of (B, Hl, n, ·) tensors whose rows are contiguous."""
    assert all(t.stride(-1) == 1 for t in tensors), "the kernels read rows contiguously"
    return tuple(s for t in tensors for s in t.stride()[:3])


def outputs(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Buffers of the forward: O (B, Hl, n, d_h) laid out as (B, n, Hl, d_h), the mixer's layout, so that its
    heads-back-to-features reshape is a view, not a copy; and L (B, Hl, n) in fp32."""
    B, H, n, d = v.shape
    o = torch.empty((B, n, H, d), device=v.device, dtype=v.dtype).transpose(1, 2)       # rows stay contiguous
    return o, torch.empty((B, H, n), device=v.device, dtype=torch.float32)


def row_deltas(do: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """D_i = dO_i · O_i (B, Hl, n) in fp32: the softmax backward's rowsum(P ⊙ dP)."""
    return (do.float() * o.float()).sum(-1).contiguous()
