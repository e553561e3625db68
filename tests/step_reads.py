"""How often one training step makes the host wait for a tensor's value, the trainer's and DeepSpeed's own.

    RANK=… WORLD_SIZE=… python tests/step_reads.py CONFIG OUT.json [section.key=value ...]   (tests/runs.py:spawn)

Counted per step: the trainer's reads (Trainer.read, its one way to the host), and every value read from a tensor
in the step (`.item()`, `float(t)`, `bool(t)`: aten._local_scalar_dense) by anyone; then the same for the stock
DeepSpeed loop (forward, backward, step) on the same engine. On a GPU each such read is a host sync.
"""
import json
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pretrain import distributed
from pretrain.config import load_config
from pretrain.train import Trainer


class ScalarReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def main(config, out, *overrides):
    trainer = Trainer(load_config(config, list(overrides)))
    batches = trainer.micro_batches(iter(trainer.stream))
    steps = []
    for _ in range(4):
        before = trainer.host_reads
        with ScalarReads() as reads:
            trainer.train_step(batches)
        steps.append({"trainer": trainer.host_reads - before, "scalar_reads": reads.n})
    engine = trainer.engine
    with ScalarReads() as stock:
        for _ in range(trainer.layout.grad_accum):
            inputs, targets = next(batches)
            loss = engine(inputs, targets)
            engine.backward(loss)
            engine.step()
    if trainer.layout.is_main:
        with open(out, "w") as f:
            json.dump({"steps": steps, "stock_scalar_reads": stock.n}, f)
    trainer.close()
    distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
