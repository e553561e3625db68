"""Sequence parallelism (Korthikanti et al. 2022, Megatron-LM's): under tensor parallelism the regions between the
TP linears — the layer norms, dropouts, residual adds and the loss's input — hold n/TP of a sequence's tokens on
each rank instead of all n, so their activations divide by TP like the heads' do.

Legend: B batch, n length, d width, TP the tensor-parallel size; "·/TP" a width split over the TP ranks.

    region              a rank holds          entered by                              left by
    sequence-parallel   (B, n/TP, d)          scatter_sequence (after the embedding)  gather_sequence
    tensor-parallel     (B, n, ·/TP)          gather_sequence: all-gather along n     reduce_scatter_sequence: the
                                              (backward: reduce-scatter)               row linear's partial sums
                                                                                      (backward: all-gather)

The mixers (synthesizers mix along the sequence) and the MLP run inside the tensor-parallel region on every
position, as without it; each all-reduce of plain TP (the row linear's output forward, the column linears' input
gradient backward) becomes one reduce-scatter and one all-gather, the same bytes on a ring. Weights replicated over
TP that act in the sequence-parallel region (the layer norms, the row linears' bias) see only this rank's tokens:
`summed_over_tp` sums their gradients over TP in backward, as megatron's finalize_model_grads does for the weights
it marks `sequence_parallel`.

megatron-core's versions (tensor_parallel/mappings.py) allocate on torch.cuda.current_device() and split dim 0 of
its sequence-first (n, B, d) layout; these follow the tensor's device and split dim 1 of (B, n, d).
The model asks for a region by name and never looks at the flag's value; `set_sequence_parallel` is called once by
the launch (pretrain/distributed.py) before the model is built.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from .ranks import tp_group, tp_rank, tp_world

_enabled = False


def set_sequence_parallel(on: bool) -> None:
    global _enabled
    _enabled = bool(on)


@contextlib.contextmanager
def whole_sequences():
    """Within it, a model built with sequence parallelism runs whole sequences on every TP rank, as plain TP does
    (the row linears all-reduce, nothing is split or gathered): inference at any length (samples, attention maps,
    downstream evaluation), where n need not divide by TP. Training steps stay outside it."""
    global _enabled
    before, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = before


def sequence_parallel() -> bool:
    """Whether the regions outside the TP linears hold n/TP tokens: asked for, and more than one TP rank."""
    return _enabled and tp_world() > 1


def sequence_split() -> int:
    """How many ranks split the sequence-parallel region's positions: TP under sequence parallelism, else 1."""
    return tp_world() if sequence_parallel() else 1


def _chunk(n: int) -> int:
    if n % tp_world():
        raise ValueError(f"sequence length n={n} is not divisible by parallel.tp={tp_world()}: under "
                         "parallel.sequence_parallel every sequence is split evenly over the tensor-parallel ranks; "
                         "use lengths divisible by tp or set parallel.sequence_parallel=false")
    return n // tp_world()


def _all_gather(x: torch.Tensor) -> torch.Tensor:
    """(B, n/TP, ·) of every rank → (B, n, ·), chunks in rank order."""
    parts = [torch.empty_like(x) for _ in range(tp_world())]
    dist.all_gather(parts, x.contiguous(), group=tp_group())
    return torch.cat(parts, dim=1)


def _reduce_scatter(x: torch.Tensor) -> torch.Tensor:
    """(B, n, ·) partial sums → this rank's chunk of their sum over TP, (B, n/TP, ·)."""
    _chunk(x.shape[1])
    parts = [p.contiguous() for p in x.chunk(tp_world(), dim=1)]
    out = torch.empty_like(parts[0])
    dist.reduce_scatter(out, parts, group=tp_group())
    return out


def _own_chunk(x: torch.Tensor) -> torch.Tensor:
    m = _chunk(x.shape[1])
    return x[:, tp_rank() * m:(tp_rank() + 1) * m].contiguous()


class _GatherSequence(torch.autograd.Function):
    """All-gather along n forward; reduce-scatter of the gradient backward (it sums the TP ranks' partial ∂x)."""

    @staticmethod
    def forward(ctx, x):
        return _all_gather(x)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad)


class _ReduceScatterSequence(torch.autograd.Function):
    """Reduce-scatter along n forward; all-gather of the gradient backward."""

    @staticmethod
    def forward(ctx, x):
        return _reduce_scatter(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad)


class _ScatterSequence(torch.autograd.Function):
    """This rank's chunk of a replicated tensor forward; all-gather of the gradient backward."""

    @staticmethod
    def forward(ctx, x):
        return _own_chunk(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad)


class _SumGradient(torch.autograd.Function):
    """Identity forward; the gradient summed over TP backward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=tp_group())
        return grad


def gather_sequence(x: torch.Tensor) -> torch.Tensor:
    """Enter the tensor-parallel region: (B, n/TP, ·) → (B, n, ·) under sequence parallelism, else x itself."""
    return _GatherSequence.apply(x) if sequence_parallel() else x


def reduce_scatter_sequence(x: torch.Tensor) -> torch.Tensor:
    """Leave it: a row linear's partial sums (B, n, ·) → this rank's n/TP positions of their sum."""
    return _ReduceScatterSequence.apply(x)


def scatter_sequence(x: torch.Tensor) -> torch.Tensor:
    """Enter the sequence-parallel region from a tensor replicated over TP (the embedding's output):
    (B, n, ·) → (B, n/TP, ·) under sequence parallelism, else x itself."""
    return _ScatterSequence.apply(x) if sequence_parallel() else x


def summed_over_tp(weight: torch.Tensor) -> torch.Tensor:
    """A replicated weight used on this rank's n/TP tokens: its gradient summed over TP under sequence parallelism."""
    return _SumGradient.apply(weight) if sequence_parallel() else weight
