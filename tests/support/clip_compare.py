"""The same three optimizer steps with the gradients clipped by GuardedAdamW on the device and by DeepSpeed.

    RANK=… WORLD_SIZE=… python tests/support/clip_compare.py CONFIG OUT.json [section.key=value ...]   (tests/support/runs.py:spawn)

Two engines of one config, built alike (`build_engine(device_clip=…)`), train on the same random batches. Written by
rank 0: per run the global gradient norm of each step (GuardedAdamW's `grad_norm`; DeepSpeed's
`get_global_grad_norm()`, None where it keeps none), the loss, and whether the checkpoint the run's engine saves
reads as one that DeepSpeed clipped (pretrain/checkpoints/resume.py deepspeed_clipped); and every rank's largest difference
between the two runs' parameters after the last step.
"""
import json
import os
import shutil
import sys
import tempfile

import torch

from pretrain import distributed
from pretrain.checkpoints.resume import deepspeed_clipped
from pretrain.config import load_config
from pretrain.engine import build_engine
from pretrain.step_guard import GuardedAdamW

STEPS = 3


def batches(cfg, lay, step):
    g = torch.Generator().manual_seed(1000 * step + lay.dp_rank)
    B, n = cfg.train.micro_batch_size, cfg.model.max_seq_len
    tokens = torch.randint(cfg.model.vocab_size, (lay.grad_accum, B, n + 1), generator=g).to(lay.device)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def train(cfg, lay, device_clip: bool, checkpoints: str):
    engine = build_engine(cfg, lay, device_clip=device_clip)
    guarded = next((o for o in (engine.optimizer, getattr(engine.optimizer, "optimizer", None))
                    if isinstance(o, GuardedAdamW)), None)
    assert (guarded is not None and guarded.clip > 0) == device_clip
    norms, losses = [], []
    for step in range(STEPS):
        micro = batches(cfg, lay, step)
        if cfg.parallel.pp > 1:
            loss = engine.train_batch(iter(micro))
        else:
            for inputs, targets in micro:
                loss = engine(inputs, targets)
                engine.backward(loss)
                engine.step()
        norm = guarded.grad_norm if device_clip else engine.get_global_grad_norm()
        norms.append(None if norm is None else float(norm))
        losses.append(float(loss))
    params = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    tag = "device" if device_clip else "deepspeed"
    engine.save_checkpoint(checkpoints, tag=tag)
    clipped = deepspeed_clipped(os.path.join(checkpoints, tag))
    return {"norms": norms, "losses": losses, "deepspeed_clipped": clipped}, params


def main(config, out, *overrides):
    cfg = load_config(config, list(overrides))
    lay = distributed.init(cfg)
    torch.manual_seed(cfg.train.seed)
    checkpoints = [tempfile.mkdtemp() if lay.is_main else None]
    torch.distributed.broadcast_object_list(checkpoints, src=0)
    device, p_device = train(cfg, lay, True, checkpoints[0])
    deepspeed, p_deepspeed = train(cfg, lay, False, checkpoints[0])
    diff = max((p_device[n] - p_deepspeed[n]).abs().max().item() for n in p_device)
    diffs = [None] * lay.world
    torch.distributed.all_gather_object(diffs, diff)
    if lay.is_main:
        with open(out, "w") as f:
            json.dump({"device": device, "deepspeed": deepspeed, "param_diff": diffs}, f)
        shutil.rmtree(checkpoints[0])
    distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
