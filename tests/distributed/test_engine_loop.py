"""Our engine against the training loop a PyTorch user writes (benchmarks/bench_lib.PlainLoop: fp32 weights,
torch.autocast in bf16, torch's fused AdamW, clipping): under train.autocast, at one data-parallel rank, the engine
must be that loop, in its numbers and in its kernels (the GPU goal: engine ÷ loop ≤ 1.05 in step time).

The CPU proxy for the step time is the count of kernels (non-view aten ops, SYNTHFORMER_KERNELS=gpu) in one step,
tests/support/loop_compare.py. With bf16 weights and ZeRO-1 (train.autocast=false) DeepSpeed adds about four kernels a
gradient tensor at one rank: two copies in its backward hooks, a cast and a norm in its step.
"""
import json
import os

import pytest

from tests.support.runs import ROOT, launch, losses, spawn, write_config

BF16 = ["train.precision=bf16", "train.global_batch_size=4", "train.micro_batch_size=4", "train.warmup_steps=0",
        "train.decay=constant", "train.grad_clip=0.05"]   # the loop has no schedule; clipping binds


def side(tmp_path, kind, cfg, *overrides):
    out = tmp_path / f"{kind}.json"
    spawn(os.path.join(ROOT, "tests", "support", "loop_compare.py"), [kind, cfg, out, *overrides], 1)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def compared(shards, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engine-loop")
    cfg = write_config(tmp / "c.yaml", shards, tmp / "run", model={"mixer": "dot"})
    return {"loop": side(tmp, "loop", cfg, *BF16),
            "autocast": side(tmp, "train", cfg, *BF16, "parallel.zero_stage=0", "train.autocast=true"),
            "zero1": side(tmp, "train", cfg, *BF16, "parallel.zero_stage=1")}   # today's default for bf16


def test_the_engine_under_autocast_computes_the_plain_loops_losses(compared):
    """Four steps on one batch, clipping binding: the same bf16 operations, AdamW and clipping rule. The first
    losses are equal bit for bit; later ones differ only where the clipping's rounding does, carried through bf16:
    the loop takes the norm of the per-tensor norms and multiplies each gradient by clip / (norm + 1e-6),
    GuardedAdamW takes the root of the all-reduced squares and the fused kernel divides by (norm + 1e-6) / clip
    (tests/distributed/test_collectives.py: the same update within 1e-6). (Without clipping all four are equal bit for bit:
    checked once.)"""
    loop, engine, zero1 = (compared[k]["losses"] for k in ("loop", "autocast", "zero1"))
    print("loop", loop, "engine (autocast)", engine, "engine (bf16 weights, ZeRO-1)", zero1)
    assert loop[-1] < loop[0] - 0.5
    assert engine[0] == loop[0], (engine, loop)
    for a, b in zip(engine, loop):
        assert abs(a - b) <= 5e-5 * abs(b), (engine, loop)


def test_the_engine_under_autocast_launches_the_loops_kernels(compared):
    """Per step, the engine under autocast launches the loop's kernels plus a constant few (GuardedAdamW's
    non-finite guard: the norm's all-reduce, the skip flag and count; DeepSpeed's loss scaling), not a few per
    gradient tensor; with bf16 weights under ZeRO-1 DeepSpeed adds more than two per gradient tensor. The loop's
    clipping pass over the gradients (a foreach multiply) is not among the engine's: its fused AdamW clips."""
    counts = {name: got["kernels"] for name, got in compared.items()}
    tensors = compared["loop"]["tensors"]
    print(counts, "gradient tensors", tensors, {name: got["by_op"] for name, got in compared.items()})
    assert compared["autocast"]["tensors"] == tensors
    assert counts["autocast"] - counts["loop"] <= 16, counts
    assert counts["zero1"] - counts["loop"] > 2 * tensors, (counts, tensors)
    assert "_foreach_mul_" in compared["loop"]["by_op"]
    assert all("_foreach_mul_" not in compared[k]["by_op"] for k in ("autocast", "zero1"))


def test_an_autocast_run_on_two_ranks_resumes_exactly(shards, tmp_path):
    """train.autocast with two data-parallel ranks (DeepSpeed all-reduces the fp32 gradients): a run stopped after
    step 3 and relaunched logs the uninterrupted run's losses bit for bit, and its checkpoint holds fp32 weights."""
    import torch

    settings = dict(model={"mixer": "dense+dot"}, train={"max_steps": 6, "precision": "bf16", "autocast": True},
                    checkpoint={"every": 3})
    whole = write_config(tmp_path / "whole.yaml", shards, tmp_path / "whole", **settings)
    parts = write_config(tmp_path / "parts.yaml", shards, tmp_path / "parts", **settings)
    launch(whole, 2)
    launch(parts, 2, "train.stop_after_steps=3")
    weights = torch.load(next((tmp_path / "parts" / "checkpoints").glob("*/mp_rank_00_model_states.pt")),
                         weights_only=False)["module"]
    assert {t.dtype for t in weights.values() if torch.is_tensor(t)} == {torch.float32}
    launch(parts, 2)
    assert losses(tmp_path / "parts") == losses(tmp_path / "whole") and len(losses(tmp_path / "whole")) == 6
