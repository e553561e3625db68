"""Context parallelism: one sequence split over the cp ranks of a group, for every mixer of this repo.

Legend: B batch, n length, cp ranks of the context-parallel group, s = n / (2·cp) a chunk's length, chunk c the
positions [c·s, (c+1)·s), Hl heads on this TP rank, d_h head size, f a key's features.

Why it is exact: row i of every map depends only on X_i, i and fixed parameters, and a position j < i reaches
position i only through per-position tensors that do not change once j is computed (model/decoding.py says it for
the decoder's cache):
    SynthesizedAttention   y_i = Σ_{j≤i} softmax_j(S[i, j]) v_j      → the values v_j, and k_j of a dot member
    SGU (and gMLP blocks)  gate_i = Σ_{j≤i} W[i, j]·LN(Z2_j) + b[i]   → LN(Z2_j)
So a rank computes the rows of its own queries — dense's F2 rows, random's R rows and factors, SGU's W rows: the
ℓ × ℓ weights are read only at its rows — and receives from its peers only those per-position tensors of the earlier
chunks: the values (and a dot member's keys), never K and V for a score exchange, never scores. A dot-only model
receives K and V, as all-gather context parallelism does (Llama 3's); a synthesizer receives V alone, half of that.

Balance. Under the causal mask a chunk's work grows with its index: chunk c's s query rows see (c + ½)·s keys on
average. Rank r holds chunks r and 2·cp−1−r (`chunks`): s²·(r + ½ + 2cp − 1 − r + ½) = 2cp·s² (query, key) pairs,
the same on every rank.

The order of work. Layer by layer (`block_chunks`), each rank runs its first chunk through the block, then its
second, as the decoder runs positions, with a `ContextCache` per layer in the place of the decoder's cache. At each chunk every rank
all-gathers its per-position tensors (`ContextCache.extend`): after the first round the cache holds chunks 0 … cp−1
(each rank's first), after the second all 2·cp. Rank r's first chunk r reads chunks ≤ r (there after round one), its
second chunk 2cp−1−r reads chunks ≤ 2cp−1−r (those < cp from round one, the rest from round two). Under the
document mask each chunk's documents are those of the window's prefix up to its end: positions in documents and the
same-document mask depend only on earlier tokens.

Under sequence parallelism (TP > 1) each chunk's s positions split again over the TP ranks: a TP rank holds s/tp of
each chunk outside the TP linears, a block gathers a chunk's s before its mixer and MLP (model/sequence_parallel.py),
and the head's input comes back in TP-rank order, which `split_targets` gives the targets. Under recomputation
(pretrain/engine.py) each chunk's block is its own region: recomputing the second chunk redoes its round-two gather,
on every rank at the same point of backward, and reads round one's rows from the cache the region keeps.

Traffic (forward, per layer, per rank): each round all-gathers B·s·(Hl·d_h + Σ f) elements a rank, received from
cp − 1 peers; backward the same again (the gathered tensors' gradients summed back to their owner).
Memory: activations of 2s = n/cp positions a rank, and S rows (B, Hl, s, ≤ n) a chunk on this materialized path.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .ranks import cp_group, cp_world
from .sequence_parallel import sequence_split


def chunks(n: int, cp: int, rank: int) -> list[tuple[int, int]]:
    """[(t0, t1)] of rank `rank`'s two chunks, r and 2·cp−1−r, each s = n/(2cp) positions, in that order."""
    if n % (2 * cp):
        raise ValueError(f"context parallelism over {cp} ranks splits a sequence into 2·cp = {2 * cp} chunks: the "
                         f"length n={n} must be a multiple of {2 * cp}")
    s = n // (2 * cp)
    return [(c * s, (c + 1) * s) for c in (rank, 2 * cp - 1 - rank)]


def chunk_of(rank: int, cp: int, round_: int) -> int:
    """The chunk rank `rank` runs in round 0 (its first) or 1 (its second)."""
    return rank if round_ == 0 else 2 * cp - 1 - rank


def split(t: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's two chunks of a whole sequence t (… n …) along `dim`, concatenated (… n/cp …)."""
    return torch.cat([t.narrow(dim, t0, t1 - t0) for t0, t1 in chunks(t.shape[dim], cp, rank)], dim=dim)


def split_targets(targets: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """This rank's targets (B, n/cp) of its two chunks of the windows' targets (B, n), in the order of the head's
    input: `split`'s, or under sequence parallelism (sp = TP ranks) that of `gather_sequence` over the rank's
    sequence-parallel pieces (each chunk's s/sp positions of each TP rank): TP rank 0's piece of the first chunk, its
    piece of the second, then TP rank 1's, …"""
    t, sp = split(targets, cp, rank), sequence_split()
    return t if sp == 1 else t.unflatten(1, (2, sp, -1)).transpose(1, 2).flatten(1)


class _AllGather(torch.autograd.Function):
    """[t of every rank of the group] forward; backward each rank's gradient of every copy of its own t, summed.
    A sum over ranks of a gathered gradient is a reduce-scatter; gloo has none, so it is an all-reduce there, and a
    reduce-scatter where the backend has one (NCCL). torch.distributed.nn.functional.all_gather (an all-to-all and
    a sum on gloo) was tried in its place: tests/distributed/test_context_parallel.py's gradients came out wrong with it
    on gloo (relative errors up to 59 for the dot variants), so this one stays until that is understood."""

    @staticmethod
    def forward(ctx, t, group):
        ctx.group = group
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t.contiguous(), group=group)
        return tuple(parts)

    @staticmethod
    def backward(ctx, *grads):
        group = ctx.group
        rank = dist.get_rank(group)
        grads = [g.contiguous() for g in grads]
        if dist.get_backend(group) == dist.Backend.GLOO:
            whole = torch.stack(grads)
            dist.all_reduce(whole, group=group)
            return whole[rank], None
        out = torch.empty_like(grads[rank])
        dist.reduce_scatter(out, grads, group=group)
        return out, None


def all_gather(t: torch.Tensor, group) -> tuple[torch.Tensor, ...]:
    """t of every rank of `group`, in rank order, with gradients summed back to each owner."""
    return _AllGather.apply(t, group)


class ContextCache:
    """A layer's per-position tensors (values, keys, LN(Z2)) of the whole sequence, gathered from the cp ranks a
    chunk at a time: the decoder's `LayerCache` (model/decoding.py) with the earlier positions coming from the peers.
    `extend(name, rows, t0)` takes this rank's rows (…, s, f) of the chunk at t0, gathers every rank's chunk of the
    same round, and returns positions 0 … t1−1 (…, t1, f) with gradients to every rank's rows."""

    def __init__(self, group, n: int):
        self.group, self.n = group, n
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.s = n // (2 * self.cp)
        self.pieces: dict[str, dict[int, torch.Tensor]] = {}

    def extend(self, name: str, rows: torch.Tensor, t0: int) -> torch.Tensor:
        c = t0 // self.s
        round_ = 0 if c == chunk_of(self.rank, self.cp, 0) else 1
        gathered = all_gather(rows, self.group)                          # cp × (…, s, f)
        pieces = self.pieces.setdefault(name, {})
        for r, part in enumerate(gathered):
            pieces[chunk_of(r, self.cp, round_)] = part
        t1 = t0 + rows.shape[-2]
        return torch.cat([pieces[k] for k in range(t1 // self.s)], dim=-2)   # (…, t1, f)


def splits(n: int) -> bool:
    """Whether a forward with targets of windows of n tokens runs split over the context-parallel group (parallel.cp
    > 1; model/ranks.py). A length that does not split into 2·cp chunks runs whole on every rank of the group: the
    same loss on each, so their mean and the mean of their gradients are still the windows'. Under sequence
    parallelism a chunk's positions split again over TP: n must be a multiple of 2·cp·tp."""
    cp = cp_world()
    return cp > 1 and n % (2 * cp * sequence_split()) == 0


def loss(model, tokens: torch.Tensor, targets: torch.Tensor, group=None) -> torch.Tensor:
    """The mean cross-entropy of this rank's two chunks of the windows `tokens` (B, n) (every rank of the group
    passes the whole windows: token ids are small), the model run as above. The mean over the group's ranks of their
    losses is the whole windows' loss (every rank has n/cp targets), and so the sum of their gradients ÷ cp.
    `group`: the context-parallel group (default: megatron-core's, model/ranks.py)."""
    group = cp_group() if group is None else group
    cp, rank, n = dist.get_world_size(group), dist.get_rank(group), tokens.shape[1]
    spans = chunks(n, cp, rank)
    docs = [model.documents(tokens[:, :t1], fused=False) for _, t1 in spans]   # each chunk's prefix (or None)
    x = torch.cat([model.embed(tokens[:, t0:t1], t0, d) for (t0, t1), d in zip(spans, docs)], dim=1)
    for block in model.blocks:
        x = block_chunks(block, x, group, docs)
    return model.head_loss(x, split_targets(targets, cp, rank))


def block_chunks(block, x: torch.Tensor, group, docs: list | None = None) -> torch.Tensor:
    """One block on this rank's two chunks x (B, n/cp, d) (its first chunk's s positions, then its second's, as
    `split` lays them out; under sequence parallelism this TP rank's s/tp positions of each, (B, n/(cp·tp), d)) →
    the same shape: the first chunk through the block, then the second, with the block's own
    `ContextCache` (one all-gather a round of its per-position tensors over `group`). `block(x, t0=, cache=, docs=)`
    is a Block's forward; `docs`: each chunk's documents (of the window's prefix up to the chunk's end), or None.
    The whole model (`loss`) and a pipeline stage (pretrain/pipeline.py) run their blocks through this."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    m = x.shape[1] // 2                      # a chunk's positions here: s, or s/tp in the sequence-parallel region
    n = 2 * cp * m * sequence_split()
    spans, cache = chunks(n, cp, rank), ContextCache(group, n)
    docs = docs or [None, None]
    halves = x.split(m, dim=1)
    return torch.cat([block(h, t0=t0, cache=cache, docs=d) for h, (t0, _), d in zip(halves, spans, docs)], dim=1)
