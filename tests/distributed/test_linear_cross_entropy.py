"""The fused head + cross-entropy (model/linear_cross_entropy.py) against the unfused one: the same loss and
gradients (fp32, also vocabulary-parallel over 2 real TP ranks, and with ignored targets), a quarter of the peak
memory at V 32000, and bf16 autocast within bf16's rounding."""
import weakref

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from model import parallel as tp
from model.lm import Head
from model.linear_cross_entropy import linear_cross_entropy
from tests.support.distributed import run_distributed


def inputs(rows=300, d=16, vocab=96, seed=0, ignored=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, rows // 3, d, generator=g) * 2
    w = torch.randn(vocab, d, generator=g) * 0.5
    targets = torch.randint(vocab, (3, rows // 3), generator=g)
    if ignored:
        targets[0, :7] = -100
    return x, w, targets


def both(x, w, targets, slice_=slice(None)):
    """(loss, ∂x, ∂W) of the unfused head (logits, then Head.loss) and of the fused one, W sliced for TP."""
    out = []
    for fused in (False, True):
        xi, wi = x.clone().requires_grad_(), w[slice_].clone().requires_grad_()
        loss = linear_cross_entropy(xi, wi, targets) if fused else Head.loss(Head.project(xi, wi), targets)
        loss.backward()
        out.append((loss.detach(), xi.grad, wi.grad))
    return out


def test_fused_equals_unfused_in_fp32_over_many_chunks(monkeypatch):
    monkeypatch.setattr("model.linear_cross_entropy.CHUNK_ELEMENTS", 96 * 37)   # 37-row chunks, a ragged last one
    (loss, gx, gw), (f_loss, f_gx, f_gw) = both(*inputs())
    assert abs(f_loss - loss) <= 1e-5 * abs(loss)
    torch.testing.assert_close(f_gx, gx, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(f_gw, gw, rtol=1e-5, atol=1e-7)


def test_fused_under_bf16_autocast_is_as_close_to_fp32_as_the_unfused_head():
    x, w, targets = inputs(rows=600, d=64, vocab=512)
    ref = both(x, w, targets)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        unfused, fused = both(x, w, targets)
    for i in range(3):
        err = (fused[i].float() - ref[i]).abs().max()
        assert err <= 1.5 * (unfused[i].float() - ref[i]).abs().max() + 1e-6, (i, err)


def vocab_parallel(rank, world):
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    x, w, targets = inputs(vocab=96)
    part = slice(rank * 96 // world, (rank + 1) * 96 // world)
    result = both(x, w, targets, part)
    gathered = []
    for loss, gx, gw in result:   # the full ∂W, gathered from the vocabulary slices
        parts = [torch.empty_like(gw) for _ in range(world)]
        dist.all_gather(parts, gw.contiguous(), group=tp.tp_group())
        gathered.append((loss, gx, torch.cat(parts)))
    parallel_state.destroy_model_parallel()
    return gathered


@pytest.mark.slow
def test_fused_is_exact_under_vocabulary_parallel_tp():
    ref_loss, ref_gx, ref_gw = both(*inputs(vocab=96))[0]
    for rank, (unfused, fused) in enumerate(run_distributed(vocab_parallel, 2)):
        for loss, gx, gw in (unfused, fused):   # megatron's vocab-parallel CE, and ours, against TP=1
            assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), rank
            torch.testing.assert_close(gx, ref_gx, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(gw, ref_gw, rtol=1e-5, atol=1e-6)


class LiveBytes(TorchDispatchMode):
    """The peak of the bytes held by tensors that ops create, each storage counted until it is freed."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.seen:
                    self.seen.add(key)
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self.freed, key, storage.nbytes())
        return out

    def freed(self, key, nbytes):
        self.seen.discard(key)
        self.live -= nbytes


def test_fused_loss_peaks_at_a_quarter_of_the_unfused_memory_at_v32000():
    """B·n = 8192 rows (batch 4 at n 2048), V 32000: the unfused head holds (N, V) logits, their log-softmax and
    gradient; the fused one (C, V) chunks."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 2048, 8, generator=g), torch.randn(32000, 8, generator=g) * 0.1
    targets = torch.randint(32000, (4, 2048), generator=g)
    peaks = []
    for fused in (False, True):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        with LiveBytes() as mem:
            loss = linear_cross_entropy(xi, wi, targets) if fused else Head.loss(Head.project(xi, wi), targets)
            loss.backward()
        peaks.append(mem.peak)
    print(f"peak live bytes of loss + backward: unfused {peaks[0] / 2**20:.0f} MiB, fused {peaks[1] / 2**20:.0f} MiB")
    assert peaks[1] <= peaks[0] / 4
