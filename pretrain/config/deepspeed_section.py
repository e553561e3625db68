"""The `deepspeed:` section: DeepSpeed settings the trainer does not own, merged into the generated DeepSpeed config
(pretrain/config/deepspeed_dict.py `deepspeed_config`) — overlap_comm, bucket sizes, communication logging, the flops profiler, ...

    deepspeed:
      zero_optimization: {overlap_comm: true, reduce_bucket_size: 5e7}
      comms_logger: {enabled: true, verbose: false}

DeepSpeed accepts unknown top-level keys silently, so they are checked here (a typo names the nearest key). Keys the
trainer writes itself are refused in one line naming the setting that controls them (OWNED), and so is offload,
which is not tested with the trainer's optimizer (GuardedAdamW, torch's fused AdamW). What DeepSpeed does with a
value (its ranges, the keys inside zero_optimization) is DeepSpeed's own check, when the engine is built.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from model.config import ConfigError
from model.fields import check_types, described

# top-level DeepSpeed keys the trainer sets itself → the setting that controls them
OWNED = {
    "train_batch_size": "train.global_batch_size",
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.global_batch_size ÷ (train.micro_batch_size × data-parallel ranks)",
    "bf16": "train.precision (and train.master_weights)",
    "fp16": "train.precision",
    "amp": "train.precision",
    "torch_autocast": "train.autocast",
    "gradient_clipping": "train.grad_clip",
    "activation_checkpointing": "parallel.activation_checkpointing",
    "optimizer": "train.lr, train.betas, train.eps, train.weight_decay (the trainer's AdamW)",
    "scheduler": "train.warmup_steps, train.decay, train.min_lr (the trainer's LR schedule)",
    "zero_allow_untested_optimizer": "the trainer (its optimizer is set by train.precision and parallel.zero_stage)",
    "steps_per_print": "logging.every (the trainer logs itself)",
    "timers": "the trainer (it times its own steps: the step line, logging.every)",
    "compile": "train.compile",
}
# keys inside a DeepSpeed mapping the trainer owns → the setting that controls them
OWNED_INSIDE = {
    "zero_optimization.stage": "parallel.zero_stage",
    "checkpoint.load_universal": "checkpoint.relayout",
}
# keys inside a DeepSpeed mapping refused outright → why, and what to use instead
REFUSED_INSIDE = {
    "checkpoint.writer": "DeepSpeed's decoupled and FastPersist writers finish after save_checkpoint returns, so the "
                         "checkpointer would publish a half-written checkpoint; remove it and set "
                         "checkpoint.async_save: true for saves in the background",
}
UNTESTED = ("zero_optimization.offload_optimizer", "zero_optimization.offload_param", "zero_optimization.cpu_offload")


@dataclass(kw_only=True)
class DeepSpeedSection:
    """DeepSpeed settings passed through to the engine, merged over the generated config (null: DeepSpeed's default)."""
    zero_optimization: dict | None = described("ZeRO's tuning: overlap_comm, contiguous_gradients, reduce_bucket_size, "
                                               "allgather_bucket_size, reduce_scatter, round_robin_gradients, "
                                               "stage3_* (not stage: parallel.zero_stage; no offload)", None)
    communication_data_type: str | None = described("dtype of gradient all-reduces (fp32, fp16, bf16)", None)
    prescale_gradients: bool | None = described("divide gradients by the DP size before the all-reduce", None)
    gradient_predivide_factor: float | None = described("divide gradients by this before the all-reduce", None)
    sparse_gradients: bool | None = described("sparse all-reduce of embedding gradients", None)
    comms_logger: dict | None = described("DeepSpeed's communication logger: {enabled, verbose, prof_all, debug}",
                                          None)
    flops_profiler: dict | None = described("DeepSpeed's flops profiler: {enabled, profile_step, module_depth, ...}",
                                            None)
    wall_clock_breakdown: bool | None = described("DeepSpeed's per-phase timers in its own log (they synchronize the "
                                                  "device)", None)
    memory_breakdown: bool | None = described("DeepSpeed's memory log lines", None)
    dump_state: bool | None = described("print DeepSpeed's state after initialization", None)
    data_types: dict | None = described("DeepSpeed's data types, e.g. {grad_accum_dtype: fp32}", None)
    checkpoint: dict | None = described("DeepSpeed's checkpoint options: tag_validation, use_node_local_storage, "
                                        "parallel_write (not load_universal: checkpoint.relayout; not writer: "
                                        "checkpoint.async_save)", None)
    pipeline: dict | None = described("DeepSpeed's pipeline engine options (pipe_partitioned, grad_partitioned, ...)",
                                      None)
    aio: dict | None = described("DeepSpeed's async I/O settings", None)
    tensorboard: dict | None = described("DeepSpeed's own TensorBoard monitor (the trainer writes its own)", None)
    csv_monitor: dict | None = described("DeepSpeed's CSV monitor", None)

    def __post_init__(self):
        check_types(self, "deepspeed")
        for dotted, setting in OWNED_INSIDE.items():
            outer, inner = dotted.split(".")
            if inner in (getattr(self, outer) or {}):
                raise ConfigError(owned_message(f"deepspeed.{dotted}", setting))
        for dotted, why in REFUSED_INSIDE.items():
            outer, inner = dotted.split(".")
            if inner in (getattr(self, outer) or {}):
                raise ConfigError(f"deepspeed.{dotted} is refused: {why}")
        for dotted in UNTESTED:
            outer, inner = dotted.split(".")
            if inner in (getattr(self, outer) or {}):
                raise ConfigError(f"deepspeed.{dotted} is refused: offload is not tested with the trainer's optimizer "
                                  f"(GuardedAdamW / torch's fused AdamW, pretrain/engine.py); remove it, and use "
                                  f"parallel.zero_stage=3, parallel.tp or parallel.pp to fit a larger model")

    def passed(self) -> dict:
        """The keys set, as DeepSpeed takes them (merged over the generated config); YAML's 5e7 as the int it means."""
        return {f.name: _whole(getattr(self, f.name)) for f in fields(self) if getattr(self, f.name) is not None}


def _whole(value):
    if isinstance(value, dict):
        return {k: _whole(v) for k, v in value.items()}
    return int(value) if isinstance(value, float) and value.is_integer() and abs(value) >= 1 else value


def owned_message(key: str, setting: str) -> str:
    return f"{key} is set by the trainer from {setting}: set that instead, and remove {key}"


def refuse_owned(tree, source: str) -> None:
    """A ConfigError naming the first trainer-owned key of a `deepspeed:` mapping (before its keys are checked)."""
    for key in tree or {} if isinstance(tree, dict) else {}:
        if key in OWNED:
            raise ConfigError(owned_message(f"deepspeed.{key}", OWNED[key]) + f" (in {source})")
