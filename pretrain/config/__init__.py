"""The training config: the whole run in typed, nested sections, each field with its docstring and its checks.

    sections.py       the YAML sections (data, parallel, train, checkpoint, logging, and logging's own mappings
                      profile and wandb); the model section is model/config.py's ModelConfig
    train_config.py   TrainConfig (the sections together, the checks across them and against a launch) and
                      load_config, the one loader
    files.py          YAML files with `base:` chains, and `section.key=value` overrides
    fleet_section.py  the fleet section (its own file: sections.py is at its length)
    stage_lengths.py  data.seq_len and data.stages[i].seq_len against the model and the layout
    reference.py      every key with its type, default and description (`--keys`, docs/config.md)

One loader, in one fixed order (later wins):
    dataclass defaults  <  YAML file (after its `base:` chain)  <  command-line overrides `section.key=value`.
`base: other.yaml` (relative to the file) is merged recursively under the file, so a variant is a few lines.
Every user mistake is a `ConfigError` with one line naming the dotted key, the value and what is allowed.
Paths inside a config (shard_dir, run_dir, ...) are relative to the working directory, i.e. the repo root.
This package imports nothing of the trainer: the model's config, the data layer's locations, and itself.

    python -m pretrain.config configs/demo-cpu.yaml train.lr=1e-3 [--deepspeed --world-size 2]

runs the check before a launch (its code is pretrain/prelaunch.py's `main`; this package only hands over to it).
"""
from pretrain.config.checkpoint_section import CheckpointSection
from pretrain.config.fleet_section import FleetSection
from pretrain.config.sections import (DataSection, LoggingSection, ParallelSection, ProfileSection,
                                      TrainSection, WandbSection)
from pretrain.config.train_config import Runtime, TrainConfig, check_release, cuda_available, load_config

__all__ = ["CheckpointSection", "DataSection", "FleetSection", "LoggingSection", "ParallelSection", "ProfileSection", "Runtime",
           "TrainConfig", "TrainSection", "WandbSection", "check_release", "cuda_available", "load_config"]
