"""The DeepSpeed engine of a run: built here, and only here. Of pretrain/, only the trainer (train.py) imports this
module; the planner and the checks before a launch read the DeepSpeed config from pretrain/config/deepspeed_dict.py.

    build_engine(cfg, layout)   model (full init from one seed, this rank's TP slice) → FP8 linears (train.fp8) →
                                activation checkpointing → compiled blocks, embedding and head + loss → pipeline
                                stages (PP > 1) →
                                deepspeed.initialize (ZeRO, AdamW, LR schedule)
    build_optimizer(cfg, ...)   torch's fused AdamW, or GuardedAdamW where the trainer drops non-finite steps
    lr_lambda(train, T)         the LR schedule
    compile_model, checkpoint_activations   the wrappers build_engine applies from outside the model
    accumulation(engine, G_s)   the micro-batches of one optimizer step of G_s sequences (train.batch_ramp)

The optimizer is always torch's fused AdamW, handed to DeepSpeed as a client optimizer, on CUDA as on CPU: its
kernel ships with torch, so nothing is JIT-compiled on the training path. (DeepSpeed's own FusedAdam needs nvcc on
every node, compiles for minutes on a first run, and fails to build for TORCH_CUDA_ARCH_LIST=9.0a.)
"""
from __future__ import annotations

import math
from functools import partial
from typing import Callable, Iterator

import torch
import torch.utils.checkpoint

from model import build_model
from model import release
from model.lm import Block, SynthesizerLM
from model.parallel import is_sharded, rng_tracker, tp_rank
from model.ranks import cp_rank, cp_world
from pretrain import distributed, float8
from pretrain.config import TrainConfig, TrainSection
from pretrain.config.schedule import DECAY_SHAPES, decay_length
from pretrain.config.deepspeed_dict import clips_on_device, deepspeed_config, guards_steps_itself
from pretrain.pipeline import build_pipeline
from pretrain.step_guard import GuardedAdamW


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices; not biases, norms or mixture logits θ. Frozen parameters (random_fixed's R) stay out."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        plain = p.dim() < 2 or name.endswith("bias") or ".ln_" in name or name.startswith("ln_") \
            or name.endswith("theta") or "norm_" in name
        (no_decay if plain else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(cfg: TrainConfig, groups: list[dict], lay: distributed.Layout,
                    device_clip: bool = True) -> torch.optim.Optimizer:
    """torch's fused AdamW: one vectorized pass over each flat ZeRO partition (~6× faster on CPU than the per-op
    AdamW of DeepSpeed's `torch_adam`, benchmarks/bench.py), and on CUDA a kernel that needs no build. Where DeepSpeed
    does not drop non-finite steps itself (`guards_steps_itself`), GuardedAdamW (pretrain/step_guard.py), which also
    clips the gradients on the device (`device_clip`, see `clips_on_device`)."""
    t = cfg.train
    adamw = dict(lr=t.lr, betas=t.betas, eps=t.eps, weight_decay=t.weight_decay)
    if guards_steps_itself(cfg):
        return GuardedAdamW(groups, lay, clip=t.grad_clip if device_clip else 0.0, **adamw)
    return torch.optim.AdamW(groups, fused=lay.device.type in ("cpu", "cuda"), **adamw)


def lr_lambda(train: TrainSection, total_steps: int | None = None,
              progress: Callable[[int], float] | None = None) -> Callable[[int], float]:
    """The LR multiplier of optimizer step s (LambdaLR multiplies train.lr by it), with W = warmup_steps,
    T = total_steps (default train.max_steps; pass TrainConfig.total_steps() when max_tokens may end the run first)
    and f = min_lr/lr:
        s < W:      s / W                                   linear warmup from 0
        W ≤ s < T:  f + (1 - f)·½(1 + cos(π (s - W)/(T - W)))  cosine from 1 to f ('linear': straight)
        s ≥ T:      f                                       constant min_lr ('constant' decay: 1 throughout)
    'wsd' (warmup-stable-decay), with D = decay_length(train, T) decay steps starting at S = T - D:
        W ≤ s < S:  1                                       the stable phase
        S ≤ s < T:  f + (1 - f)·g(p), p = (s - S)/D         g(p) = 1 - p, ½(1 + cos πp) or 1 - √p (train.decay_shape)
        s ≥ T:      f
    A decay branch (tools/branch.py) from the checkpoint of step k sets T = k + D: its decay starts at S = k, where
    the parent's stable phase had the multiplier 1 too.
    In tokens along a batch ramp (train.batch_ramp): `progress(s)` = P_s / G, the tokens before step s in steps of
    the full batch (tokendata/ramp.py `full_batches`), stands for s everywhere above, T included; W and D count
    steps of the full batch. Without a ramp progress(s) = s."""
    progress = progress or float
    T = progress(train.max_steps if total_steps is None else total_steps)
    W, floor, decay = min(train.warmup_steps, T), train.min_lr / train.lr, train.decay
    S = T - decay_length(train, T) if decay == "wsd" else W   # where the decay starts
    shape = DECAY_SHAPES["cosine" if decay == "cosine" else "linear" if decay == "linear" else train.decay_shape]

    def factor(s: int) -> float:
        step = progress(s)
        if step < W:
            return step / W
        if decay == "constant" or step < S:
            return 1.0
        if step >= T:
            return floor
        return floor + (1.0 - floor) * shape((step - S) / (T - S))

    return factor


def build_engine(cfg: TrainConfig, lay, load_universal: bool = False, device_clip: bool | None = None):
    """The DeepSpeed engine over this rank's model, in a fixed order: model (full init from one seed, this rank's
    TP slice) → FP8 linears (train.fp8: torchao's Float8Linear for the plain linears, FP8 GEMMs for megatron's TP
    ones, pretrain/float8.py) → activation checkpointing → compiled blocks, embedding and head + loss (train.compile)
    → pipeline stages (PP > 1) → DeepSpeed (ZeRO, AdamW, LR schedule). `load_universal`: the engine will load a universal checkpoint (DeepSpeed
    decides this when it is built); `device_clip`: see `clips_on_device` (default: a run that resumes no checkpoint)."""
    float8.check(cfg, lay.device)   # a one-line error before any model is built
    if cfg.parallel.pp > 1:   # DeepSpeed's PipelineModule brings its own grid (topology) as the mpu
        model, mpu = build_pipeline(cfg.model, lay.tp, lay.pp, lay.dp, cfg.parallel.partition, lay.cp), None
    else:
        # the mpu where TP or CP makes DeepSpeed's data-parallel group other than the world (None: DP is the world)
        model, mpu = build_model(cfg.model), distributed.MegatronMPU() if lay.tp > 1 or lay.cp > 1 else None
    rename = getattr(model, "canonical_name", lambda name: name)
    if cfg.train.fp8:
        float8.convert(model, cfg.train.fp8)
    checkpoint_activations(model, cfg.parallel.activation_checkpointing, rename)
    if cfg.train.compile:
        compile_model(model)
    if cfg.train.init_from:   # full tensors of a release; each rank keeps its TP slice of its stage's tensors
        release.load_into(model, release.read_release(cfg.train.init_from)[1], rename=rename)
    return initialize(model, cfg, lay, mpu, load_universal, device_clip)


def checkpoint_activations(model: torch.nn.Module, every: int, rename=lambda name: name) -> None:
    """Activation checkpointing, applied from outside the model: blocks 0, k, 2k, … (k = `every`, canonical layer
    numbers, so a pipeline stage counts as the whole model does) keep only their input in forward and recompute
    in backward. Each such block's forward is wrapped in place, so parameter names do not change."""
    if every <= 0:
        return
    for name, module in model.named_modules():
        if isinstance(module, Block) and int(rename(name + ".").split(".")[1]) % every == 0:
            module.forward = partial(_recomputed, module.forward)


def compile_model(model: torch.nn.Module, backend: str = "inductor") -> None:
    """torch.compile the model's parts in place, names (and so checkpoints) unchanged:
      - every transformer block (`nn.Module.compile`), as torchtitan does: the blocks share their code, so one
        compiled graph serves them all; a recomputed block compiles with its recomputation;
      - the whole LM's (PP 1) embedding and its final LayerNorm + head + fused loss (`SynthesizerLM.embed`,
        `head_loss`), each one graph of its own (torchtitan compiles its loss apart too), so that the loss's chunk
        loop runs as fused kernels rather than a dozen elementwise ones a chunk. Under PP the stages between the
        blocks stay eager: an embedding lookup and a LayerNorm, and the loss is DeepSpeed's `loss_fn` on logits.
    What lies between them (DeepSpeed's hooks) stays eager. The trainer runs evaluation, samples and maps eager
    (`torch.compiler.set_stance`). `backend`: torch.compile's (the tests trace with "aot_eager")."""
    for module in model.modules():
        if isinstance(module, Block):
            module.compile(backend=backend)
    if isinstance(model, SynthesizerLM):   # bound methods replaced on this instance only
        model.embed = torch.compile(model.embed, backend=backend)
        model.head_loss = torch.compile(model.head_loss, backend=backend)


def _recomputed(forward, *args, **kwargs):
    if not torch.is_grad_enabled():   # evaluation: nothing to save, nothing to recompute
        return forward(*args, **kwargs)
    # the TP-rank dropout streams (head dropout; the residual ones under sequence parallelism) replayed as well;
    # not in a compiled block, whose tracing takes no context_fn but a selective-checkpoint one
    if torch.compiler.is_compiling():
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False,
                                             context_fn=rng_tracker.checkpoint_contexts, **kwargs)


def initialize(model: torch.nn.Module, cfg: TrainConfig, lay, mpu=None, load_universal: bool = False,
               device_clip: bool | None = None):
    """deepspeed.initialize over `model` with the run's parameter groups, AdamW, DeepSpeed config and LR schedule
    (also what benchmarks/bench.py gives its GPT-2 peer, so both train alike)."""
    import deepspeed

    device_clip = clips_on_device(cfg) if device_clip is None else device_clip
    schedule = lr_lambda(cfg.train, cfg.total_steps(), cfg.batch_ramp().full_batches)   # in tokens along a ramp
    groups = param_groups(model, cfg.train.weight_decay)
    optimizer = build_optimizer(cfg, groups, lay, device_clip)
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=groups, optimizer=optimizer,
        config=deepspeed_config(cfg, lay.dp, load_universal, device_clip), mpu=mpu,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule))
    if isinstance(optimizer, GuardedAdamW) and cfg.parallel.zero_stage == 0:
        optimizer.count_once(counted_elsewhere(optimizer, lay))
        if lay.replicas == 1:   # DeepSpeed would still flatten, "all-reduce" and copy back every gradient over one rank
            engine.enable_backward_allreduce = engine.pipeline_enable_backward_allreduce = False
    elif isinstance(optimizer, GuardedAdamW):   # ZeRO-1/2's norm of the step, set before it steps any group
        optimizer.take_norm_from(lambda: engine.optimizer._global_grad_norm)
    return engine


def accumulation(engine, global_batch: int) -> Iterator[int]:
    """The micro-batches of one optimizer step of `global_batch` sequences, for the plain loop (pp = 1): each index k
    is handed out with DeepSpeed told whether micro-batch k ends the step. Along a ramp (train.batch_ramp) the count
    changes from step to step: `set_train_batch_size` sets DeepSpeed's gradient_accumulation_steps (the 1/m it scales
    each loss by), and the boundary is set explicitly because DeepSpeed's own, (micro_steps + 1) mod m, counts from
    the run's first micro-batch and would fall mid-step once m changed; it is handed back after the step."""
    engine.set_train_batch_size(global_batch * cp_world())   # DeepSpeed counts dp × cp ranks (deepspeed_dict.py)
    m = engine.gradient_accumulation_steps()
    for k in range(m):
        engine.set_gradient_accumulation_boundary(k == m - 1)
        yield k
    engine.set_gradient_accumulation_boundary(None)   # DeepSpeed's own count again (None: its initial state)


def counted_elsewhere(optimizer: GuardedAdamW, lay) -> dict:
    """Without ZeRO, what GuardedAdamW must leave out of this rank's share of the global gradient norm because
    another rank holds the same gradient and counts it: {parameter: None (all of it)}.
      - a parameter that tensor parallelism does not split (norms, row-parallel biases, the mixture logits) is
        the same on every TP rank: TP rank 0 counts it;
      - a pipeline-tied copy (the token embedding on the last stage, DeepSpeed's `ds_pipe_replicated`): the stage
        that owns it counts it;
      - every data-parallel and context-parallel rank holds all the (averaged) gradients: DP and CP rank 0 count them."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {p: None for p in params if lay.dp_rank > 0 or cp_rank() > 0 or (not is_sharded(p) and tp_rank() > 0)
            or getattr(p, "ds_pipe_replicated", False)}
