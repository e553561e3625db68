"""What a synthesizer offers the fused kernels (model/kernels.py): the typed interface between the two.

A synthesizer gives its logits S (Hl heads, n queries × n keys, per sample) in one of three forms, over all n
positions of its input x (B, n, d), from `fused(x, inputs)`; `inputs[layer]` is layer(x) for each linear it names in
`projections()`, computed by the mixer in one GEMM with the values' and every other member's (parallel.joint_column):

    QKForm(q, k, scale, key_bias)   S = scale · q kᵀ (+ b_j, one term per key): q (B or 1, Hl, n, f), k likewise,
                                    key_bias (Hl, n) or None. dot, dense, factorized_random. In a mixture the q·k
                                    members' features go to one kernel call as groups (concatenated for SDPA).
    MapForm(S)                      S (Hl, n, n), the same for every sample: random, random_fixed. Alone or beside
                                    other input-independent members: one map for the batch; beside q·k members: added
                                    block by block (qk_attention.biased_qk_attention).
    FactorForm(A, B)                S_i[j] = A_i[j mod a] · B_i[⌊j/a⌋], A (B, Hl, n, a), B (B, Hl, n, b):
                                    factorized dense. Its own kernel; never a member of a mixture.

SynthesizedAttention (model/mixers.py) asks each member for its form and picks the kernel by the forms' types: a new
synthesizer that returns one of these forms runs on the existing kernels with no change there.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class QKForm:
    """S = scale · q kᵀ + b: query and key features, a scale, and an optional per-key bias b (Hl, n)."""
    q: torch.Tensor
    k: torch.Tensor
    scale: float
    key_bias: torch.Tensor | None = None


@dataclass
class MapForm:
    """S itself, one (Hl, n, n) map shared by every sample of the batch."""
    S: torch.Tensor


@dataclass
class FactorForm:
    """S_i[j] = A_i[j mod a] · B_i[⌊j/a⌋] from the factors A (B, Hl, n, a) and B (B, Hl, n, b)."""
    A: torch.Tensor
    B: torch.Tensor


Form = QKForm | MapForm | FactorForm


class Synthesizer(Protocol):
    """What SynthesizedAttention asks of each member (every built-in of model/synthesizers.py is one).

    input_dependent   whether S depends on the input x (if no member's does, the whole map is shared by the batch)
    cached            whether decoding caches what `keys(x, t0)` returns per position (then it has `keys`)
    projections()     the column-parallel linears it applies to x on the fused path ([] for none)
    activations(B, n, mixed)  {what: elements} it keeps for backward itself, beyond the attention kernel's (model/
                      memory.py's memory plan; `mixed`: a member of a mixture); {} for none
    fused(x, inputs)  S as one of the forms above, over all positions of x: the fused path; inputs[layer] = layer(x)
                      for each of `projections()`
    logits(x, t0, keys)  rows t0 … t0+m−1 of the materialized S, (B or 1, Hl, m, t0+m): the reference path, maps,
                      decoding (keys: the cached keys of positions < t0+m, for a cached member)
    flops(n)          forward FLOPs per token of this function alone (model/accounting.py)
    """
    input_dependent: bool
    cached: bool

    def projections(self) -> list[torch.nn.Module]: ...

    def activations(self, B: int, n: int, mixed: bool = False) -> dict[str, int]: ...

    def fused(self, x: torch.Tensor, inputs: dict) -> Form: ...

    def logits(self, x: torch.Tensor, t0: int = 0, keys: torch.Tensor | None = None) -> torch.Tensor: ...

    def flops(self, n: int) -> int: ...
