import os

import pytest
import torch

from tests.support.runs import (BLEND, CORPUS, ROOT, build_blend, build_shards, built_once, launch, reference_config,
                                tool)

# Without a GPU, the Triton kernels of the GPU path (model/gpu_kernels/) run under Triton's interpreter on CPU
# tensors. Set before any kernel module is imported: @triton.jit reads it when a kernel is defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Every trainer the tests start runs one torch thread (the trainer honours OMP_NUM_THREADS): two test processes
# and their ranks share the cores, and threads that spin-wait for each other would only slow every run down.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# torch.compile's inductor compiles in this process, not in a pool of workers of its own (on 2 cores it starts 2, each
# importing torch: seconds of a core in every process that compiles)
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
torch.set_num_threads(1)   # and so do the tests that compute in this process


@pytest.fixture(scope="session")
def shards(tmp_path_factory):
    """Tiny one-sample-per-shard token shards for the trainer's tests (see tests/support/runs.py)."""
    return str(built_once(tmp_path_factory, "train-data", build_shards) / "shards")


@pytest.fixture(scope="session")
def blend(shards, tmp_path_factory):
    """{name: shard directory} of three shard sets of 8 samples a shard (tests/support/runs.py build_blend): a, b and c, which
    is small enough to start its next epoch within a short run."""
    root = built_once(tmp_path_factory, "blend-data", lambda tmp: build_blend(tmp, shards))
    return {name: str(root / name) for name in BLEND}


@pytest.fixture(scope="session")
def reference_run(shards, tmp_path_factory):
    """The uninterrupted run of tests/support/runs.py reference_config, trained once: its run directory (read only)."""
    return built_once(tmp_path_factory, "reference",
                      lambda tmp: launch(reference_config(tmp, shards, "run"), 2)) / "run"


@pytest.fixture(scope="session")
def demo(tmp_path_factory):
    """`make demo`, shortened: its tokenizer and shards built by the Makefile's own commands and settings (so the
    same files: the shipped tasks' tokenizer check holds), configs/demo-cpu.yaml on 2 ranks for 20 steps (steps 5-6
    under the profiler on rank 1: tests/distributed/test_observe.py), and the release of its checkpoint."""
    tmp = built_once(tmp_path_factory, "demo", build_demo)
    return {"shards": str(tmp / "shards"), "run": str(tmp / "run"), "release": str(tmp / "release")}


def build_demo(tmp):
    shards, run, release = tmp / "shards", tmp / "run", tmp / "release"
    tool("train_tokenizer.py", "--input", CORPUS, "--vocab-size", 4096, "--out", tmp / "tokenizer.model", "--quiet")
    tool("make_shards.py", "--input", CORPUS, "--tokenizer", tmp / "tokenizer.model", "--out", shards,
         "--seq-len", 128, "--samples-per-shard", 200, "--val-fraction", 0.02, "--force", "--quiet")
    launch(os.path.join(ROOT, "configs", "demo-cpu.yaml"), 2, f"data.shard_dir={shards}", f"train.run_dir={run}",
           "train.max_steps=20", "train.warmup_steps=5", "checkpoint.every=20", "logging.val_every=0",
           "logging.image_every=0", "logging.profile={start: 5, steps: 2, ranks: [1]}")
    tool("convert.py", "to-release", run, release, "--quiet")


# The files by their seconds in one `make test` (2 cores), longest first: pytest-xdist hands a worker the next file
# when it is almost done with its own (pytest.ini: --dist loadfile --no-loadscope-reorder keeps this order; xdist's
# own puts the files with the most tests first, which left the longest runs to the end), so the two workers finish
# within about the shortest of these of each other. The files not named follow, in collection order.
LONGEST_FIRST = ["test_convert.py", "test_training.py", "test_3d.py", "test_fault_tolerance.py", "test_bench.py",
                 "test_kill_resume.py", "test_ablate.py", "test_gpu_kernels.py", "test_eval_tools.py",
                 "test_restarts.py", "test_memory_plan.py", "test_order_runs.py", "test_data.py", "test_ingest.py",
                 "test_operate.py", "test_remote.py", "test_supervision.py", "test_lm_eval.py", "test_device_step.py",
                 "test_tensor_parallel.py", "test_formats.py", "test_linear_cross_entropy.py", "test_engine_loop.py"]


def pytest_collection_modifyitems(items):
    def rank(item):
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)
    items.sort(key=rank)   # stable: the order inside a file is kept
