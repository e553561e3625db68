"""Kernels counted on the CPU: every aten op that is not a view (each is a kernel launch on a GPU), by name and per
phase, for tests/test_kernel_count.py (a block) and tests/loop_compare.py (a whole training step)."""
import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

NOT_KERNELS = ("detach", "alias", "lift_fresh")


class Kernels(TorchDispatchMode):
    """Per phase: the non-view aten ops by name, bias adds apart from a GEMM, and 4-D copies (head layouts) of the
    attention's inputs (made before the attention kernel runs)."""

    def __init__(self, in_triton):
        super().__init__()
        self.ops, self.bias_adds, self.head_copies, self.in_triton = collections.Counter(), 0, 0, in_triton

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if self.in_triton() or func.is_view or name in NOT_KERNELS or func.namespace == "synthformer":
            return out   # the project's custom ops only launch Triton kernels (counted apart) and allocate
        self.ops[name] += 1
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if name == "add" and len(tensors) == 2 and min(t.dim() for t in tensors) == 1 and \
                max(t.dim() for t in tensors) >= 2:   # y + b with b (d_out,): a bias added after its matmul
            self.bias_adds += 1
        attended = self.ops["triton"] or any("scaled_dot_product" in op for op in self.ops)
        if name in ("clone", "contiguous", "_to_copy", "copy_") and isinstance(out, torch.Tensor) and out.dim() == 4 \
                and not attended:
            self.head_copies += 1
        return out
