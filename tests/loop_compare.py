"""Our engine's step against the plain PyTorch loop's (benchmarks/bench_lib.PlainLoop), on the same model, batch and
settings: the losses of a few steps and the kernels one step launches.

    RANK=… WORLD_SIZE=… python tests/loop_compare.py train|loop CONFIG OUT.json [section.key=value ...]
    (tests/runs.py:spawn; one process a side)

SYNTHFORMER_KERNELS=gpu is set, so that CPU tensors take the GPU path. A kernel is an aten op that is not a view
(on a GPU each is a launch), counted per phase of the step after two warm-up steps. Both sides use
bench_lib.training_step, the step benchmarks/bench.py times: `train` (our engine, with the overrides) and `loop`.
"""
import collections
import json
import os
import sys

from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.bench_lib import training_step
from pretrain import distributed

NOT_KERNELS = ("detach", "alias", "lift_fresh")
STEPS = 4


class Kernels(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not func.is_view and name not in NOT_KERNELS:
            self.count[name] += 1
        return func(*args, **(kwargs or {}))


def measured(kind, config, overrides):
    step, sync, engine, cfg, lay, _ = training_step({"kind": kind, "config": config, "overrides": overrides})
    for _ in range(STEPS):
        step()
    with Kernels() as kernels:
        step()
    sync()
    tensors = sum(1 for p in engine.module.parameters() if p.requires_grad)
    return lay, {"losses": [float(x) for x in step.losses[:STEPS]], "kernels": sum(kernels.count.values()),
                 "tensors": tensors,
                 "by_op": dict(kernels.count.most_common(12))}


def main(kind, config, out, *overrides):
    os.environ["SYNTHFORMER_KERNELS"] = "gpu"
    lay, got = measured(kind, config, list(overrides))
    if lay.is_main:
        with open(out, "w") as f:
            json.dump(got, f)
    distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
