"""The trainer's collectives (pretrain/distributed.py) and GuardedAdamW, on real gloo processes.

NCCL takes only CUDA tensors, gloo only CPU ones: on a CPU machine a tensor built on the CPU by mistake passes every
run, and crashes the first GPU run (it did: `No backend type associated with device type cpu`). So the layout's
device is made `meta` here, which gloo reduces as a no-op: every tensor the trainer reduces must be built there.
"""
import os
import sys

import pytest
import torch
import torch.distributed as dist

from pretrain.distributed import Layout
from tests.support.distributed import run_distributed


def layout(device: str, world: int = 1) -> Layout:
    return Layout(rank=dist.get_rank(), world=world, dp_rank=dist.get_rank(), dp=world, tp=1, pp=1, grad_accum=1,
                  device=torch.device(device))


def reductions_on_meta(rank, world):
    from pretrain import distributed

    lay, meta = layout("meta"), torch.device("meta")
    loss, count = torch.ones((), device=meta), torch.zeros((), device=meta)
    built = {"dp_mean": distributed.dp_mean(loss, lay), "dp_sum": distributed.dp_sum([3, 4], lay),
             "any_rank": distributed.any_rank([True, False], lay),
             "step_outcome": distributed.step_outcome(loss, count, [False, True], lay)}
    devices = {name: (str(t.device), tuple(t.shape)) for name, t in built.items()}
    try:
        distributed.all_reduce(torch.ones(1), lay)   # a CPU tensor under a meta layout: refused, on CPU too
        refused = None
    except RuntimeError as e:
        refused = str(e)
    return devices, refused


def test_trainer_collectives_build_their_tensors_on_the_layouts_device():
    devices, refused = run_distributed(reductions_on_meta, 1)[0]
    assert devices == {"dp_mean": ("meta", (1,)), "dp_sum": ("meta", (2,)), "any_rank": ("meta", (2,)),
                       "step_outcome": ("meta", (4,))}
    assert refused and "on cpu" in refused and "device is meta" in refused


def guarded_steps(rank, world):
    """Two steps of GuardedAdamW on every rank: in the first, rank 1 alone has a NaN gradient (as a TP rank can).
    Then `clipped_steps`."""
    from pretrain.step_guard import GuardedAdamW

    lay = layout("cpu", world)
    p = torch.nn.Parameter(torch.arange(4.0))
    ref = torch.nn.Parameter(torch.arange(4.0))
    opt = GuardedAdamW([p], lay, lr=0.1, weight_decay=0.1)
    plain = torch.optim.AdamW([ref], lr=0.1, weight_decay=0.1, foreach=False)
    p.grad = torch.full((4,), float("nan") if rank == 1 else 1.0)
    opt.step()
    after_bad = (p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}, opt.skipped.item())
    p.grad, ref.grad = torch.ones(4), torch.ones(4)
    opt.step()
    plain.step()
    return after_bad, (p.detach().clone(), ref.detach().clone(), opt.state[p]["step"].item(), opt.skipped.item()), \
        clipped_steps(lay)


def clipped_steps(lay):
    """Three steps of GuardedAdamW with clipping binding (global norms ~ 100 × the threshold), and beside them the
    rule as GuardedAdamW ran it before clipping moved into the fused kernel: torch's clip_grads_with_norm_ with the
    same global norm (a foreach multiply over every gradient), then the fused AdamW step; the kernels of each
    (benchmarks/kernel_census.py)."""
    from pretrain.step_guard import GuardedAdamW
    from benchmarks.kernel_census import Kernels

    g = torch.Generator().manual_seed(0)
    shapes = [(64, 33), (33,), (7, 5)]
    start = [torch.randn(s, generator=g) for s in shapes]
    ours, ref = ([torch.nn.Parameter(t.clone()) for t in start] for _ in range(2))
    opt = GuardedAdamW(ours, lay, clip=0.5, lr=0.1, weight_decay=0.1)
    plain = torch.optim.AdamW(ref, lr=0.1, weight_decay=0.1, fused=True)
    for step in range(3):
        grads = [torch.randn(s, generator=g) * 10 * (step + 1) for s in shapes]
        for p, r, grad in zip(ours, ref, grads):
            p.grad, r.grad = grad.clone(), grad.clone()
        with Kernels(lambda: False) as guarded:
            opt.step()
        with Kernels(lambda: False) as before:
            torch.nn.utils.clip_grads_with_norm_(ref, 0.5, opt.grad_norm)
            plain.step()
    updates = [((p - s).detach(), (r - s).detach()) for p, r, s in zip(ours, ref, start)]
    return (max(((a - b).abs().max() / b.abs().max()).item() for a, b in updates), opt.grad_norm.item(),
            dict(guarded.ops), dict(before.ops))


@pytest.fixture(scope="module")
def guarded():
    return run_distributed(guarded_steps, 2)


def test_guarded_adamw_drops_a_step_that_is_nonfinite_on_any_rank_without_touching_its_state(guarded):
    for rank, ((p_bad, state_bad, skipped_bad), (p, ref, step, skipped), _) in enumerate(guarded):
        assert torch.equal(p_bad, torch.arange(4.0)), rank             # rank 0's finite gradient was not applied
        assert state_bad["step"].item() == 0 and not state_bad["exp_avg"].any(), rank   # nor counted in Adam
        assert skipped_bad == 1 and skipped == 1, rank
        torch.testing.assert_close(p, ref, rtol=1e-6, atol=1e-7)      # the next step is Adam's first step
        assert step == 1, rank


def test_guarded_adamw_clips_inside_the_fused_step(guarded):
    """Clipping folded into the optimizer step: the fused AdamW kernel divides each gradient by
    max(1, (norm + 1e-6) / clip) as it reads it, where clip_grads_with_norm_ multiplies every gradient by
    min(1, clip / (norm + 1e-6)) in a pass of its own. The updates of three clipped steps equal that rule's within
    1e-6 (relative to the largest update) on every rank; the step launches no foreach multiply, one fused AdamW."""
    for rank, (_, _, (error, norm, ours, before)) in enumerate(guarded):
        print(f"rank {rank}: update error {error:.2e}; kernels a step: GuardedAdamW {sum(ours.values())}, "
              f"before (clip_grads_with_norm_ + fused AdamW step) {sum(before.values())} {before}")
        assert norm > 100 * 0.5 and error <= 1e-6, (norm, error)
        assert "_foreach_mul_" in before and "_foreach_mul_" not in ours and ours["_fused_adamw_"] == 1


def decided_on_rank0(rank, world):
    """from_rank0 with a function that differs by rank: every rank gets rank 0's result, and rank 0's error."""
    from pretrain import distributed
    from tokendata.shards import DataError

    lay, calls = layout("cpu", world), []

    def check():
        calls.append(rank)
        return {"rank": rank, "shards": [("train-000000.tar", 8)]}

    def fail():
        raise DataError(f"shard x is missing (seen by rank {rank})")

    result = distributed.from_rank0(check, lay)
    try:
        distributed.from_rank0(fail, lay)
        error = None
    except DataError as e:
        error = str(e)
    return result, calls, error


def test_a_decision_is_made_on_rank_0_alone_and_shared_with_its_error():
    results = run_distributed(decided_on_rank0, 3)
    assert [r[0] for r in results] == [{"rank": 0, "shards": [("train-000000.tar", 8)]}] * 3
    assert [r[1] for r in results] == [[0], [], []]   # the function ran on rank 0 only
    assert [r[2] for r in results] == ["shard x is missing (seen by rank 0)"] * 3


def environment_of_a_rank(rank, world):
    return os.environ.get("SYNTHFORMER_KERNELS")


def test_the_ranks_take_the_callers_environment_as_it_is_now(monkeypatch):
    """tests/support/distributed.py forks its ranks from a warm forkserver that started with the environment of its time; a
    test's monkeypatch.setenv("SYNTHFORMER_KERNELS", "gpu") must still reach them (the GPU path's TP test), and leave
    the next test's ranks on the CPU path (CI once ran every variant's TP test down the GPU path this way)."""
    monkeypatch.setenv("SYNTHFORMER_KERNELS", "gpu")
    assert run_distributed(environment_of_a_rank, 2) == ["gpu", "gpu"]
    monkeypatch.delenv("SYNTHFORMER_KERNELS")
    assert run_distributed(environment_of_a_rank, 2) == [None, None]


def wandb_is_imported(rank, world):
    return "wandb" in sys.modules


def test_the_warm_server_has_not_imported_wandb():
    """The ranks fork from a server that preloaded modules (tests/support/warm_ranks.py PRELOAD): never wandb, whose import
    makes a temporary folder that its atexit handler removes, so that each forked rank would remove it for all (megatron
    imports wandb: it is not preloaded)."""
    assert run_distributed(wandb_is_imported, 1) == [False]
