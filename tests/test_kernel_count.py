"""How many kernels one transformer block launches, forward and backward, on the GPU path — counted on the CPU.

The model is built as the trainer builds it (megatron-core's parallel state at TP=1) and run with
SYNTHFORMER_KERNELS=gpu, so CPU tensors take the GPU path (its Triton kernels under TRITON_INTERPRET=1). Counted: every
aten op that is not a view (each is a kernel launch on a GPU), and each Triton kernel launch as one (the aten ops the
interpreter issues to emulate it are not counted). fp32, a block of d 64 (dense+dot: d 256, its flagship widths
d_h 128, so q·k is 256 wide), 2 heads, n 32, batch 2, biases on.

BEFORE: the counts at c3464e2, the code the GPU issue profiled, by this same harness. Goals: the binding variants
(dot and the flagship dense+dot) at ≤ 0.7 × BEFORE, no variant above BEFORE; no bias added apart from its GEMM; no
layout copy of q, k or v in forward. The flagship is counted twice: on the default SDPA form, and at its own widths
on the Triton key-bias kernel (SYNTHFORMER_KEY_BIAS_KERNEL=triton), which must launch fewer and concatenate nothing.
The project's custom ops (torch.library, `synthformer::`) launch Triton kernels and allocate only: the launches are
what counts.
"""
import os

import torch

from tests.distributed import run_distributed
from benchmarks.kernel_census import Kernels

BEFORE = {"dot": 63, "dense+dot": 163, "dense": 71, "random": 58, "random_fixed": 56, "factorized_random": 64,
          "factorized_dense": 92, "random+dot": 90, "sgu": 69}
BINDING = ("dot", "dense+dot")
KEY_BIAS_KERNEL = "dense+dot, key-bias kernel"   # the flagship at its own widths (SYNTHFORMER_KEY_BIAS_KERNEL=triton)


def count_worker(rank, world, mixers):
    import triton.runtime.interpreter as interpreter
    from megatron.core import parallel_state

    from model import ModelConfig, build_model

    os.environ["SYNTHFORMER_KERNELS"] = "gpu"
    parallel_state.initialize_model_parallel(1)
    depth = [0]
    launch = interpreter.InterpretedFunction.run

    def counted(self, *args, **kwargs):   # a Triton launch: one kernel, whatever the interpreter does inside
        counts.ops["triton"] += 1
        depth[0] += 1
        try:
            return launch(self, *args, **kwargs)
        finally:
            depth[0] -= 1

    interpreter.InterpretedFunction.run = counted
    out = {}
    for name in mixers:
        mixer = name.split(",")[0]
        os.environ["SYNTHFORMER_KEY_BIAS_KERNEL"] = "triton" if name == KEY_BIAS_KERNEL else "sdpa"
        d = 256 if mixer == "dense+dot" else 64
        cfg = ModelConfig(vocab_size=64, d_model=d, n_layers=1, n_heads=2, max_seq_len=32, mixer=mixer, bias=True,
                          position="rope" if mixer == "dense+dot" else "learned")
        block = build_model(cfg).blocks[0]
        x = torch.randn(2, 32, d, requires_grad=True)
        with Kernels(lambda: depth[0] > 0) as counts:
            y = block(x)
        forward = counts
        with Kernels(lambda: depth[0] > 0) as counts:
            y.sum().backward()
        out[name] = {"forward": dict(forward.ops), "backward": dict(counts.ops), "bias_adds": forward.bias_adds,
                     "head_copies": forward.head_copies}
    interpreter.InterpretedFunction.run = launch
    parallel_state.destroy_model_parallel()
    return out


def total(counts) -> int:
    return sum(counts["forward"].values()) + sum(counts["backward"].values())


def test_a_block_launches_fewer_kernels_than_before():
    got = run_distributed(count_worker, 1, list(BEFORE) + [KEY_BIAS_KERNEL])[0]
    ratios = {m: round(total(got[m]) / BEFORE[m], 2) for m in BEFORE}
    print("kernels per block (forward + backward), now ÷ before:",
          {m: f"{total(got[m])} / {BEFORE[m]} = {ratios[m]}" for m in BEFORE})
    assert all(ratios[m] <= 0.7 for m in BINDING), ratios
    assert all(r <= 1.0 for r in ratios.values()), ratios
    for m, counts in got.items():
        assert counts["bias_adds"] == 0, (m, counts["forward"])      # every bias inside its GEMM (addmm)
        assert "mm" not in counts["forward"], (m, counts["forward"])
    for m in BINDING:   # q, k, v stay strided views of their projection (dense+dot's output y, made on the
        # value-factor path by a quotient in the heads' layout, is still copied back to features: not an input)
        assert got[m]["head_copies"] == 0, (m, got[m]["forward"])
    flagship, kernel = got["dense+dot"], got[KEY_BIAS_KERNEL]
    print(f"dense+dot: the SDPA form {total(flagship)} ({flagship}), the key-bias kernel {total(kernel)} ({kernel})")
    # at its own widths: no concatenation of the groups (nor the batch copy of W_2's keys it makes), no padding of v,
    # no factor on it, no quotient, and fewer kernels than the SDPA form in all
    assert not {"cat", "constant_pad_nd", "exp", "div"} & kernel["forward"].keys(), kernel["forward"]
    assert total(kernel) < total(flagship) and kernel["head_copies"] == kernel["bias_adds"] == 0, kernel
