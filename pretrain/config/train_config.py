"""TrainConfig: the whole run, its sections, the checks across them and against a launch, and its one loader.

One loader, in one fixed order (later wins):
    dataclass defaults  <  YAML file (after its `base:` chain)  <  command-line overrides `section.key=value`.
Checks that need only the config run when a section is built (`__post_init__`, per section); checks that need
the launch (world size, CUDA, existing paths) run in `TrainConfig.check_runtime`, still before any process group.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, ClassVar, NamedTuple, get_type_hints

from model.config import ConfigError, ModelConfig, architecture_difference, plain
from model.fields import build, check_keys, described, nearest_key, nested
from model.release import FORMAT, is_release
from pretrain.config import files
from pretrain.config.deepspeed_section import DeepSpeedSection, refuse_owned
from pretrain.config.fleet_section import FleetSection
from pretrain.config.batch_ramp import check_layout, ramp_of
from pretrain.config.schedule import stage_decay
from pretrain.config.stage_lengths import check_stage_lengths, split_problem
from pretrain.config.checkpoint_section import CheckpointSection
from pretrain.config.sections import DataSection, LoggingSection, ParallelSection, TrainSection
from tokendata.order import check_streams, default_streams
from tokendata.ramp import BatchRamp
from tokendata.shards import DataError
from tokendata.sources import decay_stage


class Runtime(NamedTuple):
    """What a launch of `world_size` ranks derives from the config (and the launch check, pretrain/prelaunch.py: the
    sources it read, tokendata.sources.Opened, and what it notes of the vocabulary)."""
    world_size: int
    dp: int
    grad_accum: int
    sources: tuple = ()
    vocab_note: str | None = None


@dataclass(kw_only=True)
class TrainConfig:
    """A whole run; YAML top-level keys are these section names."""
    model: ModelConfig = described("the Synthesizer LM (model/config.py)")
    data: DataSection = described("token shards and their reading")
    parallel: ParallelSection = field(default_factory=ParallelSection, metadata={"help": "TP × PP × DP layout"})
    train: TrainSection = described("optimizer, schedule, batch, length, precision")
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection, metadata={"help": "saving and resuming"})
    logging: LoggingSection = field(default_factory=LoggingSection, metadata={"help": "console and TensorBoard"})
    deepspeed: DeepSpeedSection = field(default_factory=DeepSpeedSection,
                                        metadata={"help": "DeepSpeed settings passed through to the engine"})
    fleet: FleetSection = field(default_factory=FleetSection,
                                metadata={"help": "every rank's timings, stragglers named, the check before launch"})

    SECTIONS: ClassVar[tuple[str, ...]] = ("model", "data", "parallel", "train", "checkpoint", "logging", "deepspeed",
                                         "fleet")

    def __post_init__(self):
        # Defaults that depend on another section are filled once here, so to_dict() saves concrete paths.
        if self.checkpoint.dir is None:
            self.checkpoint.dir = os.path.join(self.train.run_dir, "checkpoints")
        in_bucket = any("://" in (p or "") for p in (self.checkpoint.dir, self.checkpoint.resume))
        if self.checkpoint.staging_dir is None and in_bucket:   # local and shared directories stage nothing
            self.checkpoint.staging_dir = os.path.join(self.train.run_dir, "checkpoint_staging")
        if self.logging.tensorboard_dir is None:
            self.logging.tensorboard_dir = os.path.join(self.train.run_dir, "tensorboard")
        check_stage_lengths(self.model, self.parallel, self.data)   # data.seq_len, data.stages[i].seq_len
        if decay_stage(self.data.stages) is not None:   # an annealing stage at the decay: its length from the stage
            self.train.decay_steps = stage_decay(self.train, decay_stage(self.data.stages), self.total_steps())

    @property
    def tokens_per_step(self) -> int:
        """Tokens per optimizer step of the full global batch (sequences are packed to max_seq_len); along a
        train.batch_ramp, step s has `batch_ramp().size(s)` sequences."""
        return self.train.global_batch_size * self.model.max_seq_len

    def batch_ramp(self) -> BatchRamp:
        """The global batch of every step (train.batch_ramp; constant without one): tokendata/ramp.py."""
        return ramp_of(self.train, self.model.max_seq_len)

    def tokens_before(self, step: int) -> int:
        """The tokens of the run's steps 0 … step − 1 (of the ramp's batches)."""
        return self.batch_ramp().samples_before(step) * self.model.max_seq_len

    def total_steps(self) -> int:
        """Optimizer steps of the run: train.max_steps, or fewer when train.max_tokens is reached first (along the
        ramp's batches)."""
        if self.train.max_tokens is None:
            return self.train.max_steps
        return min(self.train.max_steps, self.batch_ramp().steps_for(math.ceil(self.train.max_tokens /
                                                                                self.model.max_seq_len)))

    def canonical_streams(self) -> int:
        """data.canonical_streams, or its default for this global batch (tokendata/order.py; a resumed run keeps its
        checkpoint's)."""
        return self.data.canonical_streams or default_streams(self.train.global_batch_size)

    def check_context_parallel(self) -> None:
        """parallel.cp > 1 (model/context.py): the combinations the trainer does not run with it (how it splits
        model.max_seq_len: `split_problem`, in check_runtime)."""
        p, t = self.parallel, self.train
        if t.compile:
            raise ConfigError(f"parallel.cp={p.cp} needs train.compile=false: compiled blocks are not built for "
                              "context-parallel chunks yet")

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
        if problem := split_problem("model.max_seq_len", m.max_seq_len, p):   # 2·cp chunks, tp parts under SP
            raise ConfigError(problem)
        if p.cp > 1:
            self.check_context_parallel()
        if m.n_layers < p.pp:
            raise ConfigError(f"model.n_layers < parallel.pp ({m.n_layers} < {p.pp}): each stage needs a layer")
        if p.pp > 1 and self.train.spike_z is not None:   # DeepSpeed's train_batch runs backward before we see the loss
            raise ConfigError(f"train.spike_z={self.train.spike_z} needs parallel.pp=1: the pipeline engine runs "
                              "backward before the loss is known; set train.spike_z=null")
        if self.train.master_weights == "bf16" and p.zero_stage not in (1, 2):   # DeepSpeed's ZeRO optimizer holds them
            raise ConfigError(f"train.master_weights='bf16' needs parallel.zero_stage 1 or 2 (it is {p.zero_stage}); "
                              "set parallel.zero_stage=1")
        if self.train.autocast and p.zero_stage != 0:   # ZeRO would keep an fp32 master copy of fp32 weights
            raise ConfigError(f"train.autocast=true needs parallel.zero_stage=0 (it is {p.zero_stage}): ZeRO-1/2 would "
                              "keep a second fp32 copy of the fp32 weights; set parallel.zero_stage=0, or "
                              "train.autocast=false to shard the optimizer")
        if self.train.autocast and p.tp != 1:   # megatron's TP linears keep autocast in backward on CUDA only
            raise ConfigError(f"train.autocast=true needs parallel.tp=1 (it is {p.tp}): megatron-core's tensor-parallel "
                              "linears run their backward under autocast only on CUDA, a path not tested here; set "
                              "train.autocast=false")
        grad_accum = self.train.grad_accum(dp)   # of the full global batch
        if self.train.batch_ramp is not None and p.pp > 1:
            raise ConfigError(f"train.batch_ramp needs parallel.pp=1 (it is {p.pp}): DeepSpeed's pipeline engine runs a "
                              f"fixed number of micro-batches a step; set train.batch_ramp=null or parallel.pp=1")
        if self.train.batch_ramp is not None:
            check_layout(self.batch_ramp(), self.train.micro_batch_size, dp)
        try:
            check_streams(self.canonical_streams(), self.train.global_batch_size)
        except DataError as e:
            raise ConfigError(str(e)) from None
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
        refuse_owned(tree.get("deepspeed"), source)
        types = get_type_hints(cls)
        return cls(**{name: build(types[name], tree.get(name) or {}, name, source, _suggest)
                      for name in cls.SECTIONS})

    def to_dict(self) -> dict:
        """Plain nested dict (lists, no tuples; a nested section a dict of its keys): YAML-dumpable and
        `from_dict`-loadable."""
        return {name: _as_dict(getattr(self, name)) for name in self.SECTIONS}


def _as_dict(section) -> dict:
    return {f.name: _as_dict(v) if is_dataclass(v := getattr(section, f.name)) else plain(v) for f in fields(section)}


def check_release(path: str, model: ModelConfig) -> None:
    """ConfigError unless `path` is a release directory of the same architecture as `model`."""
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


def _nested() -> dict[str, list[str]]:
    """{dotted field: its keys} of the fields that are sections of their own (logging.profile: start, steps, …)."""
    types = get_type_hints(TrainConfig)
    return {f"{s}.{name}": [f.name for f in fields(cls)] for s in TrainConfig.SECTIONS
            for name, cls in nested(types[s]).items()}


def _suggest(key: str) -> str | None:
    """The nearest valid dotted key of any section (train.tp → parallel.tp, learning_rate → lr); for a key inside a
    nested section (logging.profile.strat), of the nested sections' keys too."""
    valid = list(TrainConfig.SECTIONS) + [f"{s}.{k}" for s, ks in _valid_keys().items() for k in ks]
    if key.count(".") > 1:
        valid += [f"{prefix}.{k}" for prefix, ks in _nested().items() for k in ks]
    return nearest_key(key, valid)


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
    refuse_owned(tree.get("deepspeed"), source)
    valid = _valid_keys()
    for name, sub in tree.items():
        if sub is not None:
            check_keys(sub, name, valid[name], source, _suggest)
    for prefix, keys in _nested().items():   # logging.profile's own keys, named against this file
        section, _, name = prefix.partition(".")
        if isinstance((tree.get(section) or {}).get(name), dict):
            check_keys(tree[section][name], prefix, keys, source, _suggest)


def load_config(path: str | os.PathLike, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """Defaults, then the YAML file (with its `base:` chain), then `section.key=value` overrides (a nested section's
    key too: logging.wandb.mode=offline); validated."""
    tree = files.read(str(path), _check_keys)
    for item in overrides:
        section, name, value = files.override(item)
        refuse_owned({name: value} if section == "deepspeed" else None, f"override '{item}'")
        name, _, sub = name.partition(".")
        if name not in _valid_keys().get(section, ()) or (sub and sub not in _nested().get(f"{section}.{name}", ())):
            raise _unknown(item.partition("=")[0], f"override '{item}'")   # also 'lr=…', 'train=…': the full key
        tree = files.merge(tree, {section: {name: {sub: value} if sub else value}})
    return TrainConfig.from_dict(tree, source=str(path))


# ---- what the trainer derives --------------------------------------------------------------------------------------
def cuda_available() -> bool:
    """Whether ranks will run on CUDA. torch is asked rather than DeepSpeed's accelerator so that this module stays
    cheap to import (and DeepSpeed's import-time log does not go to stdout); DS_ACCELERATOR=cpu is respected."""
    if os.environ.get("DS_ACCELERATOR", "cuda") != "cuda":
        return False
    import torch
    return torch.cuda.is_available()

