"""TrainConfig: the whole run in typed, nested sections, each field with its docstring and its checks.

One loader, in one fixed order (later wins):
    dataclass defaults  <  YAML file (after its `base:` chain)  <  command-line overrides `section.key=value`.
`base: other.yaml` (relative to the file) is merged recursively under the file, so a variant is a few lines.
Every user mistake is a `ConfigError` with one line naming the dotted key, the value and what is allowed.
Checks that need only the config run when a section is built (`__post_init__`, per section); checks that need
the launch (world size, CUDA, existing paths) run in `TrainConfig.check_runtime`, still before any process group.
Paths inside a config (shard_dir, run_dir, ...) are relative to the working directory, i.e. the repo root.

    python -m pretrain.config configs/demo-cpu.yaml train.lr=1e-3 [--deepspeed --world-size 2]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, NamedTuple, get_type_hints

import yaml

from pretrain import config_files, remote
from model.config import ConfigError, ModelConfig, architecture_difference, plain
from model.fields import build, check_keys, check_types, described, nearest_key, need


# ---- sections ------------------------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class DataSection:
    """Where the token shards are and how they are read."""
    shard_dir: str = described("where the shards written by tools/make_shards.py are (beside their manifest.json): a "
                        "directory, or a URL: http(s)://host/path, pipe:COMMAND with {} for the file name (pipe:aws "
                        "s3 cp s3://bucket/shards/{} -), or an fsspec URL (s3://, gs://…, with its backend installed)")
    tokenizer: str | None = described("path or URL of the sentencepiece tokenizer.model; default "
                               "<shard_dir>/tokenizer.model", None)
    cache_dir: str | None = described("a local folder that keeps a copy of each shard read from a URL (keyed by name "
                               "and size), so later epochs and relaunches read the disk; default none", None)
    num_workers: int = described("DataLoader worker processes per rank (0 = read in the training process)", 2)
    seed: int = described("seed of the shard/sample order", 1234)
    val_batches: int = described("validation micro-batches per evaluation (the same batches every time)", 20)
    bad_shards: str = described("a truncated, empty or unreadable shard: 'fail' (stop with an error naming it) or 'skip' "
                         "(train without it; logged and counted)", "fail")

    def __post_init__(self):
        check_types(self, "data")
        need(bool(self.shard_dir), "data.shard_dir", self.shard_dir, "a directory path")
        if self.tokenizer is None:
            self.tokenizer = remote.join(self.shard_dir, "tokenizer.model")
        need(self.num_workers >= 0, "data.num_workers", self.num_workers, "≥ 0")
        need(self.val_batches >= 1, "data.val_batches", self.val_batches, "≥ 1")
        need(self.bad_shards in ("fail", "skip"), "data.bad_shards", self.bad_shards, "fail, skip")


@dataclass(kw_only=True)
class ParallelSection:
    """How ranks are split: world = tp × pp × dp, dp derived from the world size at launch (`dp()`)."""
    tp: int = described("tensor-parallel size: heads (and every per-head synthesizer weight) are split over tp ranks", 1)
    pp: int = described("pipeline stages (DeepSpeed PipelineModule); layers are split over them", 1)
    zero_stage: int = described("DeepSpeed ZeRO stage over the data-parallel group: 0 (off), 1 (optimizer states), "
                         "2 (+ gradients), 3 (+ parameters)", 1)
    partition: str = described("how pipeline stages split the layers: 'parameters' (balance parameter counts) or "
                        "'uniform' (balance layer counts)", "parameters")
    activation_checkpointing: int = described("recompute activations in backward: 0 = off, 1 = every layer, "
                                       "k = every k-th layer (layers 0, k, 2k, …)", 0)
    cpu_keep_freed_memory: bool = described("CPU runs: malloc keeps freed memory in the process (faster steps, no page "
                                     "faults; resident memory grows by what the heap fragments)", True)

    def __post_init__(self):
        check_types(self, "parallel")
        need(self.tp >= 1, "parallel.tp", self.tp, "≥ 1")
        need(self.pp >= 1, "parallel.pp", self.pp, "≥ 1")
        need(self.zero_stage in (0, 1, 2, 3), "parallel.zero_stage", self.zero_stage, "0, 1, 2 or 3")
        need(self.partition in ("parameters", "uniform"), "parallel.partition", self.partition,
              "parameters, uniform")
        need(self.activation_checkpointing >= 0, "parallel.activation_checkpointing",
              self.activation_checkpointing, "0 (off) or k ≥ 1 (every k-th layer)")
        # Within one section, so checked here rather than at launch: DeepSpeed's PipelineEngine refuses ZeRO-2/3.
        if self.pp > 1 and self.zero_stage > 1:
            raise ConfigError(f"parallel.pp > 1 needs parallel.zero_stage ≤ 1 (got pp={self.pp}, "
                              f"zero_stage={self.zero_stage}); DeepSpeed pipelines support ZeRO-0/1 only")

    def dp(self, world_size: int) -> int:
        """Data-parallel size: the ranks left after tensor and pipeline parallelism."""
        if world_size < 1 or world_size % (self.tp * self.pp):
            raise ConfigError(f"world size {world_size} is not divisible by parallel.tp × parallel.pp = "
                              f"{self.tp} × {self.pp} = {self.tp * self.pp}")
        return world_size // (self.tp * self.pp)


@dataclass(kw_only=True)
class TrainSection:
    """Optimizer (AdamW), schedule (warmup + decay, see `lr_lambda`), batch sizes, length and numerics of the run."""
    lr: float = described("peak learning rate, reached at the end of warmup", 3e-4)
    min_lr: float = described("learning rate at train.max_steps and after (GPT-3: lr/10)", 3e-5)
    warmup_steps: int = described("linear warmup from 0 to lr over this many optimizer steps", 100)
    decay: str = described("after warmup: 'cosine' (to min_lr at max_steps), 'linear', or 'constant' (stay at lr)", "cosine")
    weight_decay: float = described("AdamW decoupled weight decay", 0.1)
    betas: tuple[float, float] = described("AdamW (beta1, beta2)", (0.9, 0.95))
    eps: float = described("AdamW epsilon", 1e-8)
    grad_clip: float = described("clip the global gradient norm to this (0 = no clipping)", 1.0)
    global_batch_size: int = described("sequences per optimizer step summed over all data-parallel ranks")
    micro_batch_size: int = described("sequences per rank per forward/backward pass")
    max_steps: int = described("optimizer steps of the run (the cosine reaches min_lr here)")
    max_tokens: int | None = described("optional token budget (global_batch_size × max_seq_len per step); the run stops "
                                "at whichever of max_steps / max_tokens comes first", None)
    precision: str = described("'fp32', 'bf16' (mixed, fp32 master weights) or 'fp16' (CUDA only, dynamic loss scale)",
                        "fp32")
    master_weights: str = described("with precision bf16 and ZeRO-1/2: 'fp32' master weights and AdamW moments (the "
                                    "default), or 'bf16' for all of them (DeepSpeed's bf16_master_weights_and_grads: "
                                    "half the optimizer's memory traffic, but updates below bf16's resolution of a "
                                    "weight are lost)", "fp32")
    compile: bool = described("torch.compile each transformer block for the training steps (one graph per block, as "
                              "torchtitan does; names and checkpoints unchanged; evaluation, samples and maps run "
                              "eager); the first steps pay the compile", False)
    seed: int = described("seed of the trainer's RNGs (dropout); model init uses model.seed", 1234)
    stop_after_steps: int | None = described("end this invocation after this many more optimizer steps, with a checkpoint; "
                                      "the schedule still runs to max_steps (time-limited jobs: relaunch to go on)",
                                      None)
    run_dir: str = described("output directory of the run; checkpoints and TensorBoard go under it by default")
    max_wall_minutes: float | None = described("stop cleanly (checkpoint, exit 0) once this much wall time has passed, for "
                                        "time-limited jobs; relaunch to continue", None)
    preempt_signals: tuple[str, ...] = described("signals that stop the run cleanly after the current step with a "
                                          "checkpoint and exit 0 (SLURM sends SIGTERM, or SIGUSR1 with --signal)",
                                          ("SIGTERM", "SIGUSR1"))
    init_from: str | None = described("release directory (tools/convert.py) whose weights start a fresh run, in any layout; "
                               "its training step carries on (LR schedule, data position). A checkpoint of this run "
                               "takes precedence when resuming", None)
    max_consecutive_skips: int = described("stop with an error after this many optimizer steps in a row were skipped "
                                    "(non-finite loss or gradient, loss spike); 0 = never stop", 8)
    spike_z: float | None = described("skip a step whose loss exceeds mean + spike_z × std of the last spike_window kept "
                               "steps (null = no spike rule; not with parallel.pp > 1)", None)
    spike_window: int = described("steps in the window of the loss-spike rule", 100)

    def __post_init__(self):
        check_types(self, "train")
        need(self.lr > 0, "train.lr", self.lr, "> 0")
        need(0 <= self.min_lr <= self.lr, "train.min_lr", self.min_lr, f"0 ≤ min_lr ≤ train.lr={self.lr}")
        need(self.max_steps >= 1, "train.max_steps", self.max_steps, "≥ 1")
        need(0 <= self.warmup_steps <= self.max_steps, "train.warmup_steps", self.warmup_steps,
              f"0 ≤ warmup_steps ≤ train.max_steps={self.max_steps}")
        need(self.decay in ("cosine", "linear", "constant"), "train.decay", self.decay, "cosine, linear, constant")
        need(self.weight_decay >= 0, "train.weight_decay", self.weight_decay, "≥ 0")
        need(all(0 <= b < 1 for b in self.betas), "train.betas", list(self.betas), "each in [0, 1)")
        need(self.eps > 0, "train.eps", self.eps, "> 0")
        need(self.grad_clip >= 0, "train.grad_clip", self.grad_clip, "≥ 0 (0 = off)")
        need(self.global_batch_size >= 1, "train.global_batch_size", self.global_batch_size, "≥ 1")
        need(1 <= self.micro_batch_size <= self.global_batch_size, "train.micro_batch_size",
              self.micro_batch_size, f"1 … train.global_batch_size={self.global_batch_size}")
        need(self.stop_after_steps is None or self.stop_after_steps >= 1, "train.stop_after_steps",
              self.stop_after_steps, "null or ≥ 1")
        need(self.max_tokens is None or self.max_tokens >= 1, "train.max_tokens", self.max_tokens, "null or ≥ 1")
        need(self.precision in ("fp32", "bf16", "fp16"), "train.precision", self.precision, "fp32, bf16, fp16")
        need(self.master_weights in ("fp32", "bf16"), "train.master_weights", self.master_weights, "fp32, bf16")
        if self.master_weights == "bf16" and self.precision != "bf16":
            raise ConfigError(f"train.master_weights='bf16' needs train.precision='bf16' (it is "
                              f"{self.precision!r}); set both, or master_weights=fp32")
        need(bool(self.run_dir), "train.run_dir", self.run_dir, "a directory path")
        need(self.max_wall_minutes is None or self.max_wall_minutes > 0, "train.max_wall_minutes",
              self.max_wall_minutes, "null or > 0")
        need(all(s in ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT") for s in self.preempt_signals),
              "train.preempt_signals", self.preempt_signals, "a list of SIGTERM, SIGUSR1, SIGUSR2, SIGINT")
        need(self.max_consecutive_skips >= 0, "train.max_consecutive_skips", self.max_consecutive_skips,
              "≥ 0 (0 = never stop)")
        need(self.spike_z is None or self.spike_z > 0, "train.spike_z", self.spike_z, "null or > 0")
        need(self.spike_window >= 2, "train.spike_window", self.spike_window, "≥ 2")

    def grad_accum(self, dp: int) -> int:
        """Micro-batches per rank per optimizer step: global = micro × accumulation × dp."""
        per_step = self.micro_batch_size * dp
        if self.global_batch_size % per_step:
            raise ConfigError(f"train.global_batch_size={self.global_batch_size} is not divisible by "
                              f"train.micro_batch_size × data-parallel size = {self.micro_batch_size} × {dp} = "
                              f"{per_step}")
        return self.global_batch_size // per_step


@dataclass(kw_only=True)
class CheckpointSection:
    """DeepSpeed checkpoints (model, optimizer, scheduler, data position, this config)."""
    every: int = described("save every this many optimizer steps (and at the end of the run)", 1000)
    keep: int = described("keep the last this many checkpoints, delete older ones", 3)
    dir: str | None = described("checkpoint directory; default <train.run_dir>/checkpoints", None)
    resume: str = described("'auto' (latest in dir, if any), 'none' (start fresh), or a checkpoint path", "auto")
    relayout: bool = described("when the checkpoint to resume is of another layout (TP, PP, ZeRO-3, world size): "
                               "launch/pretrain.sh converts it to a universal checkpoint first, and the run resumes "
                               "from it with its optimizer state (one launcher; with NNODES launchers, convert "
                               "first: tools/convert.py to-universal)", False)

    def __post_init__(self):
        check_types(self, "checkpoint")
        need(self.every >= 1, "checkpoint.every", self.every, "≥ 1")
        need(self.keep >= 1, "checkpoint.keep", self.keep, "≥ 1")
        need(bool(self.resume), "checkpoint.resume", self.resume, "auto, none, or a path")


@dataclass(kw_only=True)
class LoggingSection:
    """What goes to the console and TensorBoard, and how often."""
    every: int = described("log loss, lr, grad norm, tokens/s and MFU every this many steps", 10)
    val_every: int = described("validate every this many steps (0 = only at the end)", 500)
    image_every: int = described("attention-map images and a text sample every this many steps (0 = never)", 1000)
    tensorboard_dir: str | None = described("TensorBoard event directory; default <train.run_dir>/tensorboard", None)
    peak_tflops_per_device: float | None = described(
        "peak dense TFLOP/s of one device at train.precision, the denominator of MFU; null = from the device's name "
        "(pretrain/engine.py PEAK_TFLOPS: H100 bf16 989, A100 312, ...); on a CPU or an unknown GPU MFU is then n/a",
        None)
    sample_prompt: str | None = described("prompt of the text sample in TensorBoard; null = the opening words of the "
                                          "first document of the run's validation data", None)
    sample_tokens: int = described("tokens generated for the text sample", 64)
    sample_ids: bool = described("write each step's sample ids to <run_dir>/sample_ids/rank<R>.jsonl (audits, tests)", False)

    def __post_init__(self):
        check_types(self, "logging")
        for name in ("every", "val_every", "image_every", "sample_tokens"):
            low = 1 if name == "every" else 0
            need(getattr(self, name) >= low, f"logging.{name}", getattr(self, name), f"≥ {low}")
        need(self.peak_tflops_per_device is None or self.peak_tflops_per_device > 0,
              "logging.peak_tflops_per_device", self.peak_tflops_per_device, "null (from the device) or > 0")


class Runtime(NamedTuple):
    """What a launch of `world_size` ranks derives from the config."""
    world_size: int
    dp: int
    grad_accum: int


@dataclass(kw_only=True)
class TrainConfig:
    """A whole run; YAML top-level keys are these section names."""
    model: ModelConfig = described("the Synthesizer LM (model/config.py)")
    data: DataSection = described("token shards and their reading")
    parallel: ParallelSection = field(default_factory=ParallelSection, metadata={"help": "TP × PP × DP layout"})
    train: TrainSection = described("optimizer, schedule, batch, length, precision")
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection, metadata={"help": "saving and resuming"})
    logging: LoggingSection = field(default_factory=LoggingSection, metadata={"help": "console and TensorBoard"})

    SECTIONS: ClassVar[tuple[str, ...]] = ("model", "data", "parallel", "train", "checkpoint", "logging")

    def __post_init__(self):
        # Defaults that depend on another section are filled once here, so to_dict() saves concrete paths.
        if self.checkpoint.dir is None:
            self.checkpoint.dir = os.path.join(self.train.run_dir, "checkpoints")
        if self.logging.tensorboard_dir is None:
            self.logging.tensorboard_dir = os.path.join(self.train.run_dir, "tensorboard")

    @property
    def tokens_per_step(self) -> int:
        """Tokens per optimizer step (sequences are packed to max_seq_len)."""
        return self.train.global_batch_size * self.model.max_seq_len

    def total_steps(self) -> int:
        """Optimizer steps of the run: train.max_steps, or fewer when train.max_tokens is reached first."""
        if self.train.max_tokens is None:
            return self.train.max_steps
        return min(self.train.max_steps, math.ceil(self.train.max_tokens / self.tokens_per_step))

    def check_runtime(self, world_size: int, cuda: bool | None = None) -> Runtime:
        """Checks across sections and against the launch; call on every rank before any process group starts.
        `cuda` defaults to what this machine has (see `cuda_available`)."""
        m, p = self.model, self.parallel
        dp = p.dp(world_size)
        if m.n_heads % p.tp:
            raise ConfigError(f"model.n_heads={m.n_heads} is not divisible by parallel.tp={p.tp}")
        if m.vocab_size % p.tp:  # VocabParallelEmbedding splits the vocabulary evenly
            raise ConfigError(f"model.vocab_size={m.vocab_size} is not divisible by parallel.tp={p.tp}; "
                              "pad the vocabulary")
        if m.n_layers < p.pp:
            raise ConfigError(f"model.n_layers < parallel.pp ({m.n_layers} < {p.pp}): each stage needs a layer")
        if p.pp > 1 and self.train.spike_z is not None:   # DeepSpeed's train_batch runs backward before we see the loss
            raise ConfigError(f"train.spike_z={self.train.spike_z} needs parallel.pp=1: the pipeline engine runs "
                              "backward before the loss is known; set train.spike_z=null")
        if self.train.master_weights == "bf16" and p.zero_stage not in (1, 2):   # DeepSpeed's ZeRO optimizer holds them
            raise ConfigError(f"train.master_weights='bf16' needs parallel.zero_stage 1 or 2 (it is {p.zero_stage}); "
                              "set parallel.zero_stage=1")
        grad_accum = self.train.grad_accum(dp)
        if self.train.precision == "fp16" and not (cuda_available() if cuda is None else cuda):
            raise ConfigError("train.precision='fp16' needs CUDA (DeepSpeed refuses fp16 on CPU); use bf16 or fp32")
        if self.checkpoint.resume not in ("auto", "none") and not Path(self.checkpoint.resume).exists():
            raise ConfigError(f"checkpoint.resume={self.checkpoint.resume!r} does not exist; "
                              "use auto, none, or an existing checkpoint path")
        if self.train.init_from is not None:
            check_release(self.train.init_from, m)
        return Runtime(world_size, dp, grad_accum)

    @classmethod
    def from_dict(cls, tree: dict, source: str = "the config") -> "TrainConfig":
        """Build from a nested dict (a merged YAML tree, or `to_dict()` saved in a checkpoint)."""
        _check_sections(tree, source)
        types = get_type_hints(cls)
        return cls(**{name: build(types[name], tree.get(name) or {}, name, source, _suggest)
                      for name in cls.SECTIONS})

    def to_dict(self) -> dict:
        """Plain nested dict (lists, no tuples): YAML-dumpable and `from_dict`-loadable."""
        out = {}
        for name in self.SECTIONS:
            section = getattr(self, name)
            out[name] = {f.name: plain(getattr(section, f.name)) for f in fields(section)}
        return out


def check_release(path: str, model: ModelConfig) -> None:
    """ConfigError unless `path` is a release directory of the same architecture as `model`."""
    from model.release import FORMAT, is_release

    if not is_release(path):
        raise ConfigError(f"train.init_from={path!r} is not a release directory (config.json with format '{FORMAT}'); "
                          f"make one with tools/convert.py to-release")
    with open(os.path.join(path, "config.json")) as f:
        theirs = json.load(f)["model"]
    ours = model.to_dict()
    key = architecture_difference(theirs, ours)
    if key:
        raise ConfigError(f"train.init_from={path!r} holds a model with model.{key}={theirs.get(key)!r} but this "
                          f"config has {ours[key]!r}; set model.{key}={theirs.get(key)!r}")


# ---- reading -------------------------------------------------------------------------------------------------------
def _valid_keys() -> dict[str, list[str]]:
    types = get_type_hints(TrainConfig)
    return {s: [f.name for f in fields(types[s])] for s in TrainConfig.SECTIONS}


def _suggest(key: str) -> str | None:
    """The nearest valid dotted key of any section (train.tp → parallel.tp, learning_rate → lr)."""
    return nearest_key(key, list(TrainConfig.SECTIONS) + [f"{s}.{k}" for s, ks in _valid_keys().items() for k in ks])


def _unknown(key: str, source: str) -> ConfigError:
    guess = _suggest(key)
    hint = f"did you mean '{guess}'?" if guess else "valid sections: " + ", ".join(TrainConfig.SECTIONS)
    return ConfigError(f"unknown config key '{key}' in {source}; {hint}")


def _check_sections(tree: Any, source: str) -> None:
    """The top level holds sections only."""
    if not isinstance(tree, dict):
        raise ConfigError(f"{source} must be a mapping of sections ({', '.join(TrainConfig.SECTIONS)})")
    for name in tree:
        if name not in TrainConfig.SECTIONS:
            raise _unknown(str(name), source)


def _check_keys(tree: Any, source: str) -> None:
    """Every key must be `section` or `section.field`: typos fail loudly instead of being silently ignored."""
    _check_sections(tree, source)
    valid = _valid_keys()
    for name, sub in tree.items():
        if sub is not None:
            check_keys(sub, name, valid[name], source, _suggest)


def load_config(path: str | os.PathLike, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """Defaults, then the YAML file (with its `base:` chain), then `section.key=value` overrides; validated."""
    tree = config_files.read(str(path), _check_keys)
    for item in overrides:
        section, name, value = config_files.override(item)
        if name not in _valid_keys().get(section, ()):  # also catches 'lr=…' and 'train=…': suggest the full key
            raise _unknown(item.partition("=")[0], f"override '{item}'")
        tree = config_files.merge(tree, {section: {name: value}})
    return TrainConfig.from_dict(tree, source=str(path))


# ---- what the trainer derives --------------------------------------------------------------------------------------
def cuda_available() -> bool:
    """Whether ranks will run on CUDA. torch is asked rather than DeepSpeed's accelerator so that this module stays
    cheap to import (and DeepSpeed's import-time log does not go to stdout); DS_ACCELERATOR=cpu is respected."""
    if os.environ.get("DS_ACCELERATOR", "cuda") != "cuda":
        return False
    import torch
    return torch.cuda.is_available()


# ---- CLI -----------------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pretrain.config",
                                description="Load, validate and print a training config.")
    p.add_argument("config", help="YAML file, e.g. configs/demo-cpu.yaml")
    p.add_argument("overrides", nargs="*", help="section.key=value, value parsed as YAML (train.lr=3e-4 "
                                                "model.mixer=[random,dot])")
    p.add_argument("--print", action="store_true", help="print the resolved config as YAML (the default output)")
    p.add_argument("--deepspeed", action="store_true", help="print the generated DeepSpeed config (JSON)")
    p.add_argument("--world-size", type=int, default=None, help="check a launch of this many ranks: the config, "
                                                                "the shards, a checkpoint it would resume (with "
                                                                "--deepspeed: the config only; default 1)")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        if args.deepspeed:                # the DeepSpeed config of a launch of that many ranks
            rt = cfg.check_runtime(args.world_size or 1)
        elif args.world_size is not None:   # the check before a launch: config, shards, a checkpoint to resume
            from pretrain.prelaunch import check_launch

            check_launch(cfg, args.world_size, relayout=True)
        if args.print or not args.deepspeed:
            print(yaml.safe_dump(cfg.to_dict(), sort_keys=False, allow_unicode=True), end="")
        if args.deepspeed:
            from pretrain.engine import deepspeed_config   # the engine's module imports torch: only when asked

            print(("---\n" if args.print else "") + json.dumps(deepspeed_config(cfg, rt.dp), indent=2))
    except (ConfigError, ValueError) as e:   # ValueError: a DataError of the shards
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
