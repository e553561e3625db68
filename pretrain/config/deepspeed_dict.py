"""A config turned into DeepSpeed's config dict, and the two choices of the trainer's optimizer it depends on. Pure
arithmetic on the config: the planner (pretrain/plan/), the checks before a launch and the engine builder
(pretrain/engine.py) all read it here, so none of them imports the engine.

    deepspeed_config(cfg, dp)   the DeepSpeed config, generated, never hand-kept; the `deepspeed:` section
                                (deepspeed_section.py) merged over it
    guards_steps_itself(cfg)    whether the trainer's GuardedAdamW, not DeepSpeed, drops non-finite steps
    clips_on_device(cfg)        whether GuardedAdamW clips the gradients on the device rather than DeepSpeed
"""
from __future__ import annotations

from pretrain.config.files import merge
from pretrain.config.train_config import TrainConfig


def guards_steps_itself(cfg: TrainConfig) -> bool:
    """Whether the trainer's optimizer, not DeepSpeed, drops a step with a non-finite gradient.
    ZeRO-0 fp32: DeepSpeed has no such check. ZeRO-1/2 bf16: its check (`bf16.check_grad_overflow`) launches ~4
    kernels per gradient tensor and reads the result on the host, every step (1564 `abs` and 780 `isfinite` a
    step for synth-1.3b on an H100, benchmarks/profile_step.py); it is turned off and one fused norm over the flat fp32
    partition decides instead. train.autocast (ZeRO-0, fp32 weights): as ZeRO-0 fp32. Elsewhere (fp16's loss
    scaling, ZeRO-3, bf16 ZeRO-0 with bf16 weights) DeepSpeed's own check stays."""
    zero, precision = cfg.parallel.zero_stage, cfg.train.weights_precision()
    return (zero == 0 and precision == "fp32") or (zero in (1, 2) and precision == "bf16")


def clips_on_device(cfg: TrainConfig, deepspeed_clipped_checkpoint: bool = False) -> bool:
    """Whether GuardedAdamW clips the gradients (on the device, no host read) rather than DeepSpeed: wherever it
    runs (`guards_steps_itself`), unless the run resumes a ZeRO-1/2 checkpoint whose engine let DeepSpeed clip
    (checkpoint.deepspeed_clipped): loading its optimizer state sets DeepSpeed's clipping back on (the state's
    clip_grad wins over the config's), so such a run keeps DeepSpeed's clipping, and its host reads, alone."""
    return guards_steps_itself(cfg) and not (deepspeed_clipped_checkpoint and cfg.parallel.zero_stage in (1, 2))


def deepspeed_config(cfg: TrainConfig, dp_world: int, load_universal: bool = False,
                     device_clip: bool | None = None) -> dict:
    """The DeepSpeed config of a run with `dp_world` data-parallel ranks (`device_clip`: `clips_on_device`, by
    default for a run that resumes no checkpoint).

    No "optimizer" entry: the trainer hands DeepSpeed its AdamW (`build_optimizer`) with parameter groups (no
    decay on norms/biases). No "scheduler" entry: the schedule is `lr_lambda`, given to `deepspeed.initialize` as
    `lr_scheduler=lambda opt: LambdaLR(opt, lr_lambda(cfg.train, cfg.total_steps()))`, so one tested function
    defines it on every backend and its step count lives in the engine's checkpoint. The config's `deepspeed:`
    section is merged over it (what the trainer sets itself is refused there)."""
    t, stage = cfg.train, cfg.parallel.zero_stage
    device_clip = clips_on_device(cfg) if device_clip is None else device_clip
    generated = {
        # DeepSpeed's data-parallel ranks are dp × cp (distributed.MegatronMPU): it counts a micro-batch on each,
        # where the cp ranks of a group share theirs; only its batch check, its throughput timer (off) and its
        # sample counter (unused) read this number
        "train_batch_size": t.global_batch_size * cfg.parallel.cp,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.grad_accum(dp_world),
        # GuardedAdamW clips on the device (under ZeRO-1/2 with the norm DeepSpeed computes, never read on the host)
        "gradient_clipping": 0.0 if device_clip else t.grad_clip,
        "zero_optimization": {"stage": stage},
        # GuardedAdamW is torch's AdamW plus a skip flag; DeepSpeed's ZeRO vets optimizers by exact type
        "zero_allow_untested_optimizer": guards_steps_itself(cfg),
        # master_weights=bf16: ZeRO keeps its flat weights and both AdamW moments in bf16 (DeepSpeed needs the two
        # flags together on a GPU), so the step neither reads fp32 copies nor casts them back to the model
        "bf16": {"enabled": t.weights_precision() == "bf16", "check_grad_overflow": not guards_steps_itself(cfg),
                 "bf16_master_weights_and_grads": t.master_weights == "bf16",
                 "bf16_optimizer_states": t.master_weights == "bf16"},
        "fp16": {"enabled": t.precision == "fp16"},  # loss scale: DeepSpeed's dynamic default
        # train.autocast: fp32 weights, each forward under torch.autocast in bf16 (DeepSpeed enters it in forward)
        "torch_autocast": {"enabled": t.autocast, "dtype": "bfloat16"},
        "checkpoint": {"load_universal": load_universal},  # a resume in another layout (pretrain/checkpoints/universal.py)
        "steps_per_print": 10**9,  # the trainer logs itself
        # and times itself: DeepSpeed's throughput timer synchronizes the device at each forward and each step
        "timers": {"throughput": {"enabled": False}},
        "wall_clock_breakdown": False,
    }
    if cfg.parallel.pp > 1 and cfg.parallel.tp > 1 and cfg.parallel.sequence_parallel:
        # DeepSpeed's pipeline sends 1/tp of an activation from each TP rank and all-gathers it at the next stage,
        # which assumes the TP ranks hold the same tensor; under sequence parallelism each holds other positions
        generated["pipeline"] = {"pipe_partitioned": False, "grad_partitioned": False}
    return merge(generated, cfg.deepspeed.passed())   # the `deepspeed:` section (pretrain/config/deepspeed_section.py)
