"""What a launch checks before any process starts: the config against the world size, the shards against the model,
and the checkpoint it would resume against the run. launch/pretrain.sh runs these checks once
(`python -m pretrain.config CONFIG … --world-size N`), so that a mistake is one line at once, not one per rank
after DeepSpeed started; the trainer runs them again on every rank before its process group, for launches without
the script.
"""
from __future__ import annotations

import os
import sys

from model import ConfigError
from pretrain.checkpoint import architecture_problem, layout_problem, resume_point
from pretrain.config import Runtime, TrainConfig
from pretrain.shards import DataError, check_vocab, read_manifest


def check_launch(cfg: TrainConfig, world_size: int, relayout: bool = False) -> Runtime:
    """Runtime of the launch; a ConfigError or DataError (one line naming key, file and fix) for what cannot run.
    `relayout`: this is the one process before the launch (launch/pretrain.sh), which converts a checkpoint of
    another layout to a universal one when the config sets checkpoint.relayout."""
    runtime = cfg.check_runtime(world_size)
    manifest = read_manifest(cfg.data.shard_dir)
    check_vocab(manifest, cfg.model.vocab_size)
    n, L = manifest["seq_len"], cfg.model.max_seq_len
    if n != L:
        raise DataError(f"shards in {cfg.data.shard_dir} hold sequences of {n} tokens but model.max_seq_len={L}: "
                        f"set model.max_seq_len={n}, or rebuild the shards with tools/make_shards.py --seq-len {L}")
    resume = resume_point(cfg.checkpoint.resume, cfg.checkpoint.dir, cfg.to_dict(), world_size)
    if resume is None:
        return runtime
    problem = architecture_problem(resume, cfg.to_dict())
    if not problem and layout_problem(resume, cfg.to_dict(), world_size) and cfg.checkpoint.relayout and relayout \
            and cfg.checkpoint.resume == "auto" and os.environ.get("NODE_RANK", "0") == "0":
        from pretrain import universal

        print(f"checkpoint.relayout: converting {resume} to a universal checkpoint in {cfg.checkpoint.dir} "
              f"(weights and optimizer state, for any layout)", file=sys.stderr, flush=True)
        resume = universal.convert(resume, cfg.checkpoint.dir)
        print(f"wrote {resume}; the ranks resume from it", file=sys.stderr, flush=True)
    problem = problem or layout_problem(resume, cfg.to_dict(), world_size)
    if problem:
        raise ConfigError(problem)
    return runtime
