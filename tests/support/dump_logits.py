"""One rank of a run that loads a DeepSpeed checkpoint in its own layout and writes the logits of a fixed input.

    RANK=… WORLD_SIZE=… python tests/support/dump_logits.py CONFIG TAG_DIR OUT.pt    (started by tests/support/runs.py:spawn)

The reference for tools/convert.py: the training-time model as DeepSpeed itself restores it, not our converter.
"""
import sys

import torch

from model import parallel as tp
from pretrain import distributed
from pretrain.checkpoints.checkpointer import Checkpointer
from pretrain.config import load_config
from pretrain.engine import build_engine


def fixed_tokens(cfg):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch_size, cfg.model.max_seq_len), generator=g)


def main(config, tag_dir, out):
    cfg = load_config(config, [])
    lay = distributed.init(cfg)
    engine = build_engine(cfg, lay)
    Checkpointer(engine, cfg.checkpoint.dir, 1, {}, cfg.to_dict(), "", lay.rank, lay.world).load(tag_dir)
    engine.eval()
    x = fixed_tokens(cfg)
    with torch.no_grad():
        if cfg.parallel.pp > 1:
            _, logits = engine.eval_batch(iter([(x, x)]), return_logits=True, compute_loss=False,
                                          num_micro_batches=1)   # compute_loss: megatron CE rewrites logits
        else:
            logits = engine.module(x)
    if logits is not None:                        # the last stage holds (B, n, V/TP) on each TP rank
        logits = tp.gather_last_dim(logits)
        if tp.tp_rank() == 0 and lay.dp_rank == 0:
            torch.save(logits, out)
    distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:4])
