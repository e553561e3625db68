"""The live model as one piece, for what the run reports from it: attention maps, a text sample (pretrain/train.py
`log_samples`) and downstream scores (logging.eval_tasks, `log_scores`).

Without pipeline stages every rank holds its TP slice of the whole model and computes (TP and ZeRO-3 forward passes
are collective); under PP the stages' weights are joined on the ranks of the first stage of data-parallel replica 0
(each its TP shard), and every other rank has nothing to compute. Only global rank 0 writes.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from model import SynthesizerLM


def whole_model(engine, cfg, layout):
    """The whole model of this rank's TP shard: the engine's module, or under PP the stages joined on the first
    stage's ranks of replica 0 (gathered over the pipeline group), None on every other rank."""
    if layout.pp == 1:
        return engine.module
    from megatron.core import parallel_state as ps

    if ps.get_data_parallel_rank() != 0:
        return None
    stage = engine.module
    mine = {stage.canonical_name(name): p.detach().cpu() for name, p in stage.named_parameters()}
    parts = [None] * layout.pp
    dist.all_gather_object(parts, mine, group=ps.get_pipeline_model_parallel_group())
    if ps.get_pipeline_model_parallel_rank() != 0:
        return None
    weights = {name: t for part in parts for name, t in part.items()}
    model = SynthesizerLM(cfg.model)
    for name, p in model.named_parameters():   # each tensor is this TP rank's shard already
        p.data = weights[name].to(p.dtype)
    return model.to(layout.device)


@torch.no_grad()
@torch.compiler.set_stance("force_eager")   # compiled blocks (train.compile) serve training steps only
def log_scores(step: int, model, cfg, tokenizer: str, log) -> dict:
    """logging.eval_tasks on the live weights (pretrain/observe/downstream.py, lm-eval): `eval/<task>/<metric>` to
    TensorBoard, W&B and metrics.jsonl at `step`, and one log line with the scores and the time they took."""
    from pretrain.observe.downstream import score   # lm-eval, an optional extra: imported only when scores are asked for

    if model is None:
        return {}
    t0, training = time.time(), model.training
    scores = score(model, tokenizer, list(cfg.logging.eval_tasks), cfg.logging.eval_batch_size,
                   cfg.logging.eval_limit)
    model.train(training)
    log.scalars(step, scores)
    main = ", ".join(f"{name[5:]} {value:.4f}" for name, value in scores.items() if "_stderr" not in name)
    log.info(f"eval at step {step}: {main} (lm-eval on the live weights, {time.time() - t0:.1f} s added)")
    return scores
