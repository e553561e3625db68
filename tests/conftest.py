import os

import pytest
import torch

from tests.runs import CORPUS, ROOT, build_shards, launch, reference_config, tool

# Without a GPU, the Triton kernels of the GPU path (model/gpu_kernels/) run under Triton's interpreter on CPU
# tensors. Set before any kernel module is imported: @triton.jit reads it when a kernel is defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def shards(tmp_path_factory):
    """Tiny one-sample-per-shard token shards for the trainer's tests (see tests/runs.py)."""
    return build_shards(tmp_path_factory)


@pytest.fixture(scope="session")
def reference_run(shards, tmp_path_factory):
    """The uninterrupted run of tests/runs.py reference_config, trained once: its run directory (read only)."""
    tmp = tmp_path_factory.mktemp("reference")
    launch(reference_config(tmp, shards, "run"), 2)
    return tmp / "run"


@pytest.fixture(scope="session")
def demo(tmp_path_factory):
    """`make demo`, shortened: its tokenizer and shards built by the Makefile's own commands and settings (so the
    same files: the shipped tasks' tokenizer check holds), configs/demo-cpu.yaml on 2 ranks for 20 steps, and the
    release of its checkpoint."""
    tmp = tmp_path_factory.mktemp("demo")
    shards, run, release = tmp / "shards", tmp / "run", tmp / "release"
    tool("train_tokenizer.py", "--input", CORPUS, "--vocab-size", 4096, "--out", tmp / "tokenizer.model", "--quiet")
    tool("make_shards.py", "--input", CORPUS, "--tokenizer", tmp / "tokenizer.model", "--out", shards,
         "--seq-len", 128, "--samples-per-shard", 200, "--val-fraction", 0.02, "--force", "--quiet")
    launch(os.path.join(ROOT, "configs", "demo-cpu.yaml"), 2, f"data.shard_dir={shards}", f"train.run_dir={run}",
           "train.max_steps=20", "train.warmup_steps=5", "checkpoint.every=20", "logging.val_every=0",
           "logging.image_every=0")
    tool("convert.py", "to-release", run, release, "--quiet")
    return {"shards": str(shards), "run": str(run), "release": str(release)}
