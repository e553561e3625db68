"""A checkpoint save slower than the collective timeout, on 2 real gloo ranks with a DeepSpeed engine (ZeRO-1): under a
hang watchdog, the save's barriers (the checkpointer's, DeepSpeed's) wait for a slow writer as long as its files grow
(pretrain/supervision/saves.py, pretrain/timeouts.py `raised`), and the run goes on at its collective timeout."""
import io
import os
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from tests.support.distributed import run_distributed

C, H = 2.0, 1.5      # NCCL-like short group timeouts (every group, as supervise() sets them); the hang watchdog's
SLOW_S = 3 * C       # rank 0 writes the model's states in pieces for this long, as on a busy filesystem


def slowly(save):
    """A checkpoint engine's save(state_dict, path) on a slow filesystem: the model's states in 20 pieces."""
    def written(state_dict, path, *args, **kwargs):
        if not path.endswith("model_states.pt"):
            return save(state_dict, path, *args, **kwargs)
        buffer = io.BytesIO()
        torch.save(state_dict, buffer)
        data, pieces = buffer.getvalue(), 20
        with open(path, "wb") as f:
            for k in range(pieces):
                f.write(data[k * len(data) // pieces:(k + 1) * len(data) // pieces])
                f.flush()
                time.sleep(SLOW_S / pieces)
    return written


def slow_save(rank, world, run):
    import deepspeed

    from pretrain.checkpoints.checkpointer import Checkpointer
    from pretrain.supervision.rank import supervise
    from pretrain.timeouts import group_timeout, groups

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config={
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 1},
        "zero_allow_untested_optimizer": True, "steps_per_print": 10**9})
    if rank == 0:
        engine.checkpoint_engine.save = slowly(engine.checkpoint_engine.save)
    saver = Checkpointer(engine, os.path.join(run, "checkpoints"), 2, {}, {}, "", rank, world)
    noop = lambda *_: None   # noqa: E731
    trainer = SimpleNamespace(step=6, log=SimpleNamespace(info=noop), checkpointer=saver,
                              layout=SimpleNamespace(rank=rank, collective_timeout_s=C),
                              cfg=SimpleNamespace(train=SimpleNamespace(hang_timeout=H, run_dir=run, compile=False,
                                                                        collective_timeout=C)),
                              train_step=noop, validate=noop, log_samples=noop, log_scores=noop, train=noop)
    dog = supervise(trainer)
    try:
        t0 = time.time()
        final = trainer.checkpointer.save(7)
        took = time.time() - t0
        after = {g.group_name: group_timeout(g) for g in groups()}
        total = torch.ones(1)
        dist.all_reduce(total)   # the run goes on
    except Exception as e:       # each rank's own error in the test's line
        return f"rank {rank}: {type(e).__name__}: {str(e).splitlines()[0]}"
    finally:
        dog.stop()
    return took, after, total.item(), sorted(os.listdir(final))


@pytest.mark.slow
def test_a_save_three_times_slower_than_the_collective_timeout_finishes_and_the_run_goes_on(tmp_path):
    """Rank 0 writes the model's states for 3 × C (6 s) while rank 1, its own files written, waits in DeepSpeed's
    barrier, under hang_timeout 1.5 s: the save completes on both ranks (before, rank 1's barrier timed out after C:
    "Timed out waiting 2000ms"), nobody hangs, every group is back at C, and a collective after it works."""
    results = run_distributed(slow_save, 2, str(tmp_path))
    assert not any(isinstance(r, str) for r in results), "\n".join(map(str, results))
    for took, after, total, files in results:
        assert took >= SLOW_S and set(after.values()) == {C} and total == 2.0, (took, after, total)
        assert "mp_rank_00_model_states.pt" in files and "trainer_rank1.pt" in files, files
    assert not (tmp_path / "hang").exists()
