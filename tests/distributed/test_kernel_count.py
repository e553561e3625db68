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

from tests.support.distributed import run_distributed
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


# Under model.document_mask (model/documents.py), a block's forward on the GPU path, kernels counted as above with the
# one FlexAttention call (compiled on a GPU: one kernel) as one; the documents and their block mask are made once a
# pass, outside the block. Forward only, without autograd: FlexAttention has no CPU backward (its backward on a GPU
# is its own kernels). The counts measured when the plan was written; a change that adds kernels must say why here.
DOCUMENTS_FORWARD = {"dot": 12, "dense+dot": 37, "dense": 19, "random": 13, "random_fixed": 13, "factorized_random": 14,
                     "factorized_dense": 29, "random+dot": 15, "sgu": 35}


def test_a_block_under_the_document_mask_makes_no_map_per_sample_on_the_gpu_path(monkeypatch):
    """Every synthesized attention runs as one FlexAttention call and no op outside it makes a (B, …, n, n) tensor:
    no per-sample mask, map or logits. SGU (no softmax, no attention kernel) makes its masked map per sample, the
    cost model/memory.py names. n 24 here, apart from every other width (d_h 32)."""
    from model import ModelConfig, build_model, documents

    monkeypatch.setenv("SYNTHFORMER_KERNELS", "gpu")
    flex, inside, B, n = documents.flex_attention, [0], 3, 24

    def counted(*args, **kwargs):   # one kernel, whatever its eager CPU form does inside
        counts.ops["flex_attention"] += 1
        inside[0] += 1
        try:
            with torch.utils._python_dispatch._disable_current_modes():   # a higher-order op: no dispatch mode
                return flex(*args, **kwargs)
        finally:
            inside[0] -= 1

    monkeypatch.setattr(documents, "flex_attention", counted)
    got, per_sample = {}, {}
    for mixer in DOCUMENTS_FORWARD:
        d = 256 if mixer == "dense+dot" else 64
        cfg = ModelConfig(vocab_size=64, d_model=d, n_layers=1, n_heads=2, max_seq_len=n, mixer=mixer, bias=True,
                          position="rope" if mixer == "dense+dot" else "learned", document_mask=True, eos_id=1)
        model = build_model(cfg)
        tokens = torch.randint(2, 64, (B, n), generator=torch.Generator().manual_seed(0))
        tokens[:, [7, 15]] = 1
        docs, x = model.documents(tokens), torch.randn(B, n, d)
        with torch.no_grad(), Kernels(lambda: inside[0] > 0) as counts:
            shapes = counts.shapes = []
            model.blocks[0](x, docs=docs)
        got[mixer] = sum(counts.ops.values())
        per_sample[mixer] = [s for s in shapes if len(s) >= 3 and s[0] == B and s[-2:] == (n, n)]
        assert counts.ops["flex_attention"] == (0 if mixer == "sgu" else 1), (mixer, dict(counts.ops))
    print("kernels per block forward under the document mask, now / plan:",
          {m: f"{got[m]} / {DOCUMENTS_FORWARD[m]}" for m in got})
    assert all(got[m] <= DOCUMENTS_FORWARD[m] for m in got), got
    assert all(not shapes for m, shapes in per_sample.items() if m != "sgu"), per_sample
    assert per_sample["sgu"], "SGU's per-sample map went unseen: the check would see nothing"
