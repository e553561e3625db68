"""The skip rules of pretrain/step_guard.py on their own: spikes against a window computed another way, the stop after
K skips in a row, and the state a checkpoint carries; the optimizer each device and ZeRO stage gets, and the CPU
allocator setting of pretrain/distributed.py."""
import os
import statistics
import subprocess
import sys

import pytest
import torch
import yaml

from model import ConfigError
from pretrain.step_guard import LossGuard, TrainingStopped


def test_spike_rule_is_mean_plus_z_std_of_the_window_once_full():
    guard = LossGuard(max_consecutive=0, spike_z=2.0, window=5)
    history = [3.0, 3.2, 2.9, 3.1, 3.05]
    for step, loss in enumerate(history[:-1], 1):
        guard.record(step, loss, skipped=False)
        assert not guard.is_spike(100.0)                  # the window is not full yet
    guard.record(5, history[-1], skipped=False)
    limit = statistics.fmean(history) + 2.0 * statistics.pstdev(history)
    assert guard.is_spike(limit + 1e-6) and not guard.is_spike(limit - 1e-6)
    guard.record(6, 9.0, skipped=True, why="loss spike")     # a skipped loss does not enter the window
    guard.record(7, 3.3, skipped=False)                      # the window slides: 3.0 leaves, 3.3 enters
    window = history[1:] + [3.3]
    limit = statistics.fmean(window) + 2.0 * statistics.pstdev(window)
    assert guard.is_spike(limit + 1e-6) and not guard.is_spike(limit - 1e-6)
    assert not LossGuard(0, None, 5).is_spike(1e9)          # no rule by default


def test_k_skips_in_a_row_stop_and_a_kept_step_resets_the_count():
    guard = LossGuard(max_consecutive=3, spike_z=None, window=10)
    assert guard.record(1, float("nan"), skipped=True) == \
        "step 1: update skipped (non-finite loss or gradient); 1 in a row, 1 in all"
    guard.record(2, float("nan"), skipped=True)
    guard.record(3, 2.0, skipped=False)                      # the streak ends
    guard.record(4, float("nan"), skipped=True)
    guard.record(5, float("nan"), skipped=True)
    with pytest.raises(TrainingStopped, match=r"3 optimizer steps in a row were skipped \(non-finite loss or "
                                              r"gradient; steps 4-6\), train.max_consecutive_skips=3"):
        guard.record(6, float("inf"), skipped=True)
    assert guard.total == 5
    never = LossGuard(max_consecutive=0, spike_z=None, window=10)
    for step in range(1, 50):
        never.record(step, float("nan"), skipped=True)


def test_state_round_trip_decides_alike():
    a = LossGuard(4, 1.5, 4)
    for step, loss in enumerate([2.0, 2.1, 1.9, 2.2, 2.05], 1):
        a.record(step, loss, skipped=False)
    a.record(6, float("nan"), skipped=True)
    b = LossGuard(4, 1.5, 4)
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict() and b.total == 1 and b.in_a_row == 1
    for x in torch.linspace(1.5, 3.0, 31).tolist():
        assert a.is_spike(x) == b.is_spike(x)


def test_spike_rule_needs_no_pipeline(tmp_path):
    from pretrain.config import load_config

    base = {"model": {"vocab_size": 512, "d_model": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 32},
            "data": {"shard_dir": str(tmp_path)}, "parallel": {"pp": 2, "zero_stage": 1},
            "train": {"global_batch_size": 8, "micro_batch_size": 4, "max_steps": 10, "warmup_steps": 2, "run_dir": str(tmp_path),
                      "spike_z": 3.0}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(base))
    with pytest.raises(ConfigError, match=r"train.spike_z=3.0 needs parallel.pp=1"):
        load_config(str(tmp_path / "c.yaml"), []).check_runtime(world_size=2, cuda=False)
    with pytest.raises(ConfigError, match=r"train.spike_z"):
        load_config(str(tmp_path / "c.yaml"), ["train.spike_z=-1", "parallel.pp=1"])


def test_the_optimizer_per_device_and_stage_is_adamw_with_the_config(tmp_path):
    """torch's fused AdamW on CPU and on CUDA alike (no DeepSpeed op to JIT-build), GuardedAdamW for ZeRO-0 fp32 and
    bf16 ZeRO-1/2 (DeepSpeed's own per-tensor check is off there).
    Its steps equal torch's per-op AdamW with train.lr/betas/eps/weight_decay, to rounding."""
    from pretrain.config import load_config
    from pretrain.distributed import Layout
    from pretrain.config.deepspeed_dict import deepspeed_config
    from pretrain.engine import build_optimizer
    from pretrain.step_guard import GuardedAdamW

    base = {"model": {"vocab_size": 512, "d_model": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 32},
            "data": {"shard_dir": str(tmp_path)},
            "train": {"global_batch_size": 8, "micro_batch_size": 4, "max_steps": 10, "warmup_steps": 2,
                      "run_dir": str(tmp_path), "lr": 0.01, "betas": [0.8, 0.9], "eps": 1e-6, "weight_decay": 0.3}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(base))
    cfg = lambda *o: load_config(str(tmp_path / "c.yaml"), list(o))   # noqa: E731
    layout = lambda device: Layout(rank=0, world=1, dp_rank=0, dp=1, tp=1, pp=1, grad_accum=1,   # noqa: E731
                                   device=torch.device(device))
    cpu = layout("cpu")

    def groups(seed):
        g = torch.Generator().manual_seed(seed)
        decay, plain = (torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in ((37, 11), (5,)))
        return [{"params": [decay], "weight_decay": 0.3}, {"params": [plain], "weight_decay": 0.0}]

    for zero in (1, 2, 3):
        opt = build_optimizer(cfg(f"parallel.zero_stage={zero}"), groups(0), cpu)
        assert type(opt) is torch.optim.AdamW and opt.defaults["fused"], zero
        bf16 = build_optimizer(cfg(f"parallel.zero_stage={zero}", "train.precision=bf16"), groups(0), cpu)
        assert type(bf16) is (torch.optim.AdamW if zero == 3 else GuardedAdamW) and bf16.defaults["fused"], zero
        assert deepspeed_config(cfg(f"parallel.zero_stage={zero}", "train.precision=bf16"), 1)["bf16"] == \
            {"enabled": True, "check_grad_overflow": zero == 3, "bf16_master_weights_and_grads": False,
             "bf16_optimizer_states": False}
    on_cuda = build_optimizer(cfg("parallel.zero_stage=3", "train.precision=bf16"), groups(0), layout("cuda"))
    assert type(on_cuda) is torch.optim.AdamW and on_cuda.defaults["fused"]
    guarded = build_optimizer(cfg("parallel.zero_stage=0"), groups(0), cpu)
    assert type(guarded) is GuardedAdamW and guarded.defaults["fused"]

    ours = build_optimizer(cfg("parallel.zero_stage=1"), groups(0), cpu)
    ref_groups = groups(0)
    ref = torch.optim.AdamW(ref_groups, lr=0.01, betas=(0.8, 0.9), eps=1e-6, foreach=False)
    g = torch.Generator().manual_seed(1)
    params = lambda opt_groups: [p for x in opt_groups for p in x["params"]]   # noqa: E731
    for _ in range(5):
        for a, b in zip(params(ours.param_groups), params(ref_groups)):
            a.grad = torch.randn(a.shape, generator=g)
            b.grad = a.grad.clone()
        ours.step()
        ref.step()
    for a, b in zip(params(ours.param_groups), params(ref_groups)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("keep", [False, True])
def test_freed_memory_is_kept_in_the_process_on_cpu(keep):
    """pretrain.distributed.keep_freed_memory: once warm (thread pool started), 64 MB tensors and a 2.5 GB one freed
    and allocated again (mostly) cost no new page faults — the big one also not when it leaves more than 2 GB free at
    the heap's top, which a trim threshold would give back; glibc's default unmaps each on free, so every allocation
    faults all of its pages in again."""
    code = f"""
import resource, torch
from pretrain.distributed import keep_freed_memory
assert keep_freed_memory() if {keep} else True
sizes = [2**24] * 8 + [5 * 2**27] * 2                  # 64 MB tensors, then a 2.5 GB one twice
for n in sizes[:3] + sizes[-1:]:                      # warm: OpenMP threads, the heap's first growth
    torch.ones(n)
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for n in sizes:
    torch.ones(n)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root)
    assert r.returncode == 0, r.stderr[-2000:]
    faults = int(r.stdout.split()[-1])
    pages = 2**24 * 4 // 4096                                        # 16384 pages of 4 KB a 64 MB tensor
    # kept: a fresh chunk now and then where the heap is fragmented; not kept: every allocation faults (40 × 16384)
    assert (faults < 3 * pages) if keep else (faults > 40 * pages), faults
