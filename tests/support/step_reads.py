"""How often one training step makes the host wait for the device, the trainer's and DeepSpeed's own.

    RANK=… WORLD_SIZE=… python tests/support/step_reads.py trainer CONFIG OUT.json [section.key=value ...]
    RANK=… WORLD_SIZE=… python tests/support/step_reads.py bench CONFIG OUT.json [section.key=value ...]
    (tests/support/runs.py:spawn)

Counted per step, by anyone in the process: every value read from a tensor (`.item()`, `float(t)`, `bool(t)`:
aten._local_scalar_dense), the ops whose result size or value the host must see (nonzero, is_nonzero, equal), and
every `get_accelerator().synchronize()` (DeepSpeed's timers call it; the accelerator's method is wrapped to count).
On a GPU each is a host sync. `trainer`: Trainer.train_step, with the trainer's own reads (Trainer.read, its one way
to the host), then the stock DeepSpeed loop (forward, backward, step) on the same engine. `bench`: the step that
benchmarks/bench.py times (bench_lib.training_step: our engine, random tokens).
"""
import json
import sys
from collections import Counter

import torch
from deepspeed.accelerator import get_accelerator
from torch.utils._python_dispatch import TorchDispatchMode

from pretrain import distributed
from pretrain.config import load_config

WAITS = {torch.ops.aten._local_scalar_dense.default: "scalar_reads", torch.ops.aten.nonzero.default: "nonzero",
         torch.ops.aten.is_nonzero.default: "is_nonzero", torch.ops.aten.equal.default: "equal"}


class Waits(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in WAITS:
            self.counts[WAITS[func]] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        accelerator = get_accelerator()
        self.synchronize = accelerator.synchronize

        def counted(*args, **kwargs):
            self.counts["synchronize"] += 1
            return self.synchronize(*args, **kwargs)

        accelerator.synchronize = counted
        return super().__enter__()

    def __exit__(self, *exc):
        get_accelerator().synchronize = self.synchronize
        return super().__exit__(*exc)


def trainer_steps(config, overrides):
    from pretrain.train import Trainer

    trainer = Trainer(load_config(config, list(overrides)))
    batches = trainer.micro_batches(iter(trainer.stream))
    steps = []
    for _ in range(4):
        before = trainer.host_reads
        with Waits() as waits:
            trainer.train_step(batches)
        steps.append({"trainer": trainer.host_reads - before, **waits.counts})
    engine = trainer.engine
    with Waits() as stock:
        for _ in range(trainer.layout.grad_accum):
            inputs, targets = next(batches)
            loss = engine(inputs, targets)
            engine.backward(loss)
            engine.step()
    trainer.close()
    return trainer.layout, {"steps": steps, "stock": dict(stock.counts)}


def bench_steps(config, overrides):
    from benchmarks.bench_lib import training_step

    step, sync, engine, cfg, lay, _ = training_step({"kind": "train", "config": config, "overrides": list(overrides)})
    step()   # DeepSpeed's one-time work
    steps = []
    for _ in range(3):
        with Waits() as waits:
            step()
        steps.append(dict(waits.counts))
    sync()
    return lay, {"steps": steps}


def main(what, config, out, *overrides):
    lay, counts = {"trainer": trainer_steps, "bench": bench_steps}[what](config, overrides)
    if lay.is_main:
        with open(out, "w") as f:
            json.dump(counts, f)
    distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
