import os

import pytest
import torch

from tests.runs import build_shards

# Without a GPU, the Triton kernels of the GPU path (model/gpu_kernels/) run under Triton's interpreter on CPU
# tensors. Set before any kernel module is imported: @triton.jit reads it when a kernel is defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def shards(tmp_path_factory):
    """Tiny one-sample-per-shard token shards for the trainer's tests (see tests/runs.py)."""
    return build_shards(tmp_path_factory)
