"""What a launch checks before any process starts: the config against the world size, the shards against the model,
and the checkpoint it would resume against the run. launch/pretrain.sh runs these checks once
(`python -m pretrain.config CONFIG … --world-size N`), so that a mistake is one line at once, not one per rank
after DeepSpeed started; the trainer runs them again on every rank before its process group, for launches without
the script.
"""
from __future__ import annotations

import os

from model import ConfigError
from pretrain.checkpoint import compatibility_problem, newest_complete
from pretrain.config import Runtime, TrainConfig
from pretrain.shards import DataError, check_vocab, read_manifest


def check_launch(cfg: TrainConfig, world_size: int) -> Runtime:
    """Runtime of the launch; a ConfigError or DataError (one line naming key, file and fix) for what cannot run."""
    runtime = cfg.check_runtime(world_size)
    manifest = read_manifest(cfg.data.shard_dir)
    check_vocab(manifest, cfg.model.vocab_size)
    n, L = manifest["seq_len"], cfg.model.max_seq_len
    if n != L:
        raise DataError(f"shards in {cfg.data.shard_dir} hold sequences of {n} tokens but model.max_seq_len={L}: "
                        f"set model.max_seq_len={n}, or rebuild the shards with tools/make_shards.py --seq-len {L}")
    resume = cfg.checkpoint.resume
    if resume == "auto":
        tag = newest_complete(cfg.checkpoint.dir)
        resume = os.path.join(cfg.checkpoint.dir, tag) if tag else None
    if resume not in (None, "none"):
        problem = compatibility_problem(resume, cfg.to_dict(), world_size)
        if problem:
            raise ConfigError(problem)
    return runtime
