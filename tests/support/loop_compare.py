"""Our engine's step against the plain PyTorch loop's (benchmarks/bench_lib.PlainLoop), on the same model, batch and
settings: the losses of a few steps and the kernels one step launches.

    RANK=… WORLD_SIZE=… python tests/support/loop_compare.py train|loop CONFIG OUT.json [section.key=value ...]
    (tests/support/runs.py:spawn; one process a side)

SYNTHFORMER_KERNELS=gpu is set, so that CPU tensors take the GPU path. The kernels (benchmarks/kernel_census.py) are
counted over one whole step, taken after the STEPS steps whose losses are recorded. Both sides use
bench_lib.training_step, the step benchmarks/bench.py times: `train` (our engine, with the overrides) and `loop`.
"""
import json
import os
import sys

from benchmarks.bench_lib import training_step
from pretrain import distributed
from benchmarks.kernel_census import Kernels

STEPS = 4


def measured(kind, config, overrides):
    step, sync, engine, cfg, lay, _ = training_step({"kind": kind, "config": config, "overrides": overrides,
                                                     "same_batch": True})
    for _ in range(STEPS):
        step()
    with Kernels(in_triton=lambda: False) as kernels:
        step()
    sync()
    tensors = sum(1 for p in engine.module.parameters() if p.requires_grad)
    return lay, {"losses": [float(x) for x in step.losses[:STEPS]], "kernels": sum(kernels.ops.values()),
                 "tensors": tensors, "by_op": dict(kernels.ops.most_common())}


def main(kind, config, out, *overrides):
    os.environ["SYNTHFORMER_KERNELS"] = "gpu"
    lay, got = measured(kind, config, list(overrides))
    if lay.is_main:
        with open(out, "w") as f:
            json.dump(got, f)
    distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
