"""Context parallelism in the model (model/context.py): 2 gloo ranks split each window into 4 chunks (rank 0 holds
chunks 0 and 3, rank 1 chunks 1 and 2), gather values, keys and LN(Z2) chunk by chunk, and compute only their own
query rows. For every variant, with and without the document mask (documents that cross the chunk boundaries), the
mean of the two ranks' losses is the whole window's loss computed in one process on the fused path, and the sum of
their gradients ÷ 2 is its gradient, for every parameter; under megatron-core's context-parallel group the model's
own forward is that split; with dropout and every block recomputed, the split run's gradients are those of the same
split run without recomputation. One launch for every case."""
import torch
import torch.distributed as dist

from model import build_model, variants
from model import context
from model import parallel as tp
from pretrain.engine import checkpoint_activations
from tests.support.distributed import run_distributed
from tests.unit.test_model import config

VARIANTS = variants.subset("all")   # every registered mixer, gMLP, and mixtures of every fused form
L, EOS = 16, 1


def window(masked: bool) -> torch.Tensor:
    """(2, L + 1) tokens; masked: eos at 2, 6 and 11 in the first row (documents across the chunk boundaries 4, 8,
    12), at 9 in the second."""
    x = torch.randint(2, 64, (2, L + 1), generator=torch.Generator().manual_seed(5))
    if masked:
        x[0, [2, 6, 11]] = EOS
        x[1, 9] = EOS
    return x


def compare(rank, world):
    group = dist.group.WORLD
    worst = {}
    for masked in (False, True):
        x = window(masked)
        for variant in VARIANTS:
            cfg = config(variant, document_mask=masked, eos_id=EOS)
            whole, split = build_model(cfg), build_model(cfg)
            loss = whole(x[:, :-1], x[:, 1:])
            loss.backward()
            part = context.loss(split, x[:, :-1], x[:, 1:], group)
            part.backward()
            mean = part.detach().clone()
            dist.all_reduce(mean)
            mean /= world
            errors = [abs(mean.item() - loss.item()) / loss.item()]
            # relative to the largest gradient where a gradient is 0 in exact arithmetic (a dot key's bias: softmax
            # ignores a constant added to a row)
            top = max(p.grad.norm() for p in whole.parameters() if p.grad is not None)
            for p, q in zip(whole.parameters(), split.parameters()):
                # a parameter that only the fused path reads (dense's key bias: softmax ignores it, its gradient
                # is 0 in exact arithmetic) has none on the materialized path
                ref = torch.zeros_like(p) if p.grad is None else p.grad
                g = torch.zeros_like(q) if q.grad is None else q.grad.clone()
                dist.all_reduce(g)
                g /= world
                errors.append(((g - ref).norm() / (ref.norm() + 1e-3 * top)).item())
            worst[(variant, masked)] = max(errors)
    return worst, wired(), recomputed()


def recomputed():
    """With dropout (residual and head) and every block recomputed in backward (pretrain/engine.py), the split run's
    gradients are those of the same split run without recomputation: the recomputed chunks redo their gathers in the
    same order on both ranks and draw the forward's masks. {variant: worst relative error}."""
    def grads(variant, recompute):
        model = build_model(config(variant, document_mask=True, eos_id=EOS, dropout=0.2, mixer_dropout=0.5))
        if recompute:
            checkpoint_activations(model, 1)
        tp.rng_tracker.set_seed(9)
        torch.manual_seed(4 + dist.get_rank())
        x = window(True)
        context.loss(model, x[:, :-1], x[:, 1:], dist.group.WORLD).backward()
        return [p.grad for p in model.parameters() if p.grad is not None]

    worst = {}
    for variant in ("dense+dot", "gmlp"):   # values, a dot member's keys, head dropout; SGU's LN(Z2)
        plain, again = grads(variant, False), grads(variant, True)
        worst[variant] = max(((a - b).norm() / (b.norm() + 1e-12)).item() for a, b in zip(again, plain))
    return worst


def wired():
    """Under megatron-core's context-parallel group (as the trainer makes it), the model's own forward with targets is
    `context.loss` on this rank's chunks, and a length that does not split into 2·cp chunks runs whole."""
    from megatron.core import parallel_state

    x, cfg = window(True), config("random+dot", document_mask=True, eos_id=EOS)
    parallel_state.initialize_model_parallel(context_parallel_size=2)
    try:
        model = build_model(cfg)
        own = model(x[:, :-1], x[:, 1:]).item()
        parts = context.loss(model, x[:, :-1], x[:, 1:], dist.group.WORLD).item()
        odd = model(x[:, :-3], x[:, 1:-2]).item()                       # n = 14: not a multiple of 4
    finally:
        parallel_state.destroy_model_parallel()
    return own, parts, odd, build_model(cfg)(x[:, :-3], x[:, 1:-2]).item()


def test_context_parallel_2_gives_the_loss_and_gradients_of_one_rank_for_every_variant_masked_and_not():
    (worst, wired0, again0), (worst1, wired1, again1) = run_distributed(compare, 2)
    assert worst == worst1   # the all-reduced figures, the same on both ranks
    bad = {case: e for case, e in worst.items() if e > 1e-4}   # fp32 sums in another order: ~1e-6
    assert len(worst) == 2 * len(VARIANTS) and not bad, bad
    for own, parts, odd, whole in (wired0, wired1):
        assert own == parts and odd == whole
    assert wired0[0] != wired1[0]   # each rank its own chunks' loss
    for again in (again0, again1):   # recomputation: the same operations on the same values
        assert max(again.values()) < 1e-6, again


def test_the_chunks_are_balanced_and_cover_the_sequence_once():
    """Rank r: chunks r and 2cp−1−r; every position on one rank; the same causal (query, key) pairs on every rank."""
    for cp in (1, 2, 4, 8):
        n = 16 * cp
        spans = [context.chunks(n, cp, r) for r in range(cp)]
        covered = sorted(t for s in spans for a, b in s for t in range(a, b))
        assert covered == list(range(n))
        pairs = {sum(i + 1 for a, b in s for i in range(a, b)) for s in spans}
        assert len(pairs) == 1, (cp, pairs)
        x = torch.arange(n)[None]
        assert torch.equal(torch.cat([context.split(x, cp, r) for r in range(cp)], 1).sort().values, x)
