#!/usr/bin/env python
"""A decay branch of a warmup-stable-decay run: a new run directory that resumes a checkpoint of the parent's stable
phase and runs only the decay.

    python tools/branch.py PARENT --step K --out BRANCH [--decay-steps D] [--config CHANGES.yaml]
                           [--set section.key=value ...]
    NPROC=2 launch/pretrain.sh BRANCH/config.yaml

PARENT is the parent's run directory (or its checkpoint directory); its checkpoint of step K is linked (hard links,
or copies across file systems) into BRANCH/checkpoints, so the branch resumes with the parent's weights, AdamW
state, RNG streams and data position. Its config is the parent's with train.decay=wsd, train.decay_steps=D and
train.max_steps=K+D: its decay starts at step K (lr_lambda), where the parent's LR was still the stable phase's. D
defaults to the parent's own decay length (train.decay_steps, or decay_fraction of its steps). The parent's
data.stages are kept without a `decay: true` (the branch's decay is its own, from K). A relaunch of the branch resumes
its own newest checkpoint, as any run does.

Another data blend for the decay (an annealing mix): `--set data.sources=[...]` or a YAML file of changes
(--config, merged over the parent's config, e.g. `data: {sources: [...]}`). A blend cannot continue the parent's
position (its order is another), so the branch reads the new blend's order from its global batch K on; the record
says so. BRANCH/branch.json records the parent, the step and the changes; the trainer logs it (TensorBoard text
`branch/parent`, metrics.jsonl at step K). Errors are one line (exit 2).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

import torch
import yaml

from model import ConfigError
from pretrain.checkpoints import safe_load
from pretrain.checkpoints.durable import publish, verify
from pretrain.checkpoints.resume import complete_tags
from pretrain.config import TrainConfig, load_config
from pretrain.config.files import merge
from pretrain.config.schedule import decay_length
from pretrain.engine import lr_lambda
from pretrain.observe.metrics import BRANCH_RECORD
from tokendata.shards import DataError

ORDER_KEYS = ("shard_dir", "sources", "seed", "canonical_streams")   # data.*: what the sample order depends on


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("parent", help="the parent's run directory (or its checkpoint directory)")
    p.add_argument("--step", type=int, required=True, help="the checkpoint step K to branch from (in the stable phase)")
    p.add_argument("--out", required=True, help="the branch's run directory (new)")
    p.add_argument("--decay-steps", type=int, help="D, the decay's steps (default: the parent's decay length)")
    p.add_argument("--config", help="a YAML file of config changes, merged over the parent's (e.g. data: {sources: …})")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="section.key=value",
                   help="a config change (repeatable), after --config")
    return p


def checkpoint_of(parent: str, step: int) -> str:
    """The complete checkpoint of `step` in the run directory (or checkpoint directory) `parent`."""
    tag = f"step_{step:08d}"
    for directory in (os.path.join(parent, "checkpoints"), parent):
        if os.path.isdir(os.path.join(directory, tag)):
            problem = verify(os.path.join(directory, tag))
            if problem:
                raise ConfigError(f"checkpoint {directory}/{tag} is incomplete ({problem}): branch from another step")
            return os.path.join(directory, tag)
    found = [int(t.rsplit("_", 1)[-1]) for d in (os.path.join(parent, "checkpoints"), parent) for t in complete_tags(d)]
    raise ConfigError(f"{parent} has no checkpoint of step {step} (its checkpoints: "
                      f"{', '.join(map(str, sorted(found))) or 'none'}): pass --step of one of them")


def branch_config(parent: TrainConfig, step: int, out: str, decay_steps: int | None, changes: str | None,
                  overrides: list[str]) -> TrainConfig:
    """The parent's config, decaying from `step` over D steps in the run directory `out`, with the changes."""
    t = parent.train
    if lr_lambda(t, parent.total_steps())(step) != 1.0:
        raise ConfigError(f"step {step} is not in the parent's stable phase (train.decay={t.decay!r}, warmup "
                          f"{t.warmup_steps} steps, the LR there is not train.lr): branch from a checkpoint after "
                          f"the warmup and before the decay of a train.decay=wsd or constant run")
    D = decay_length(t, parent.total_steps()) if decay_steps is None else decay_steps
    if D < 1:
        raise ConfigError(f"--decay-steps={D}: the decay needs ≥ 1 step")
    tree = merge(parent.to_dict(), {
        "train": {"run_dir": out, "decay": "wsd", "decay_steps": D, "max_steps": step + D, "max_tokens": None,
                  "stop_after_steps": None, "init_from": None},
        "checkpoint": {"dir": None, "resume": "auto"}, "logging": {"tensorboard_dir": None}})
    stages = tree["data"].get("stages") or []   # the branch's decay is its own: a parent's decay stage keeps its mix
    tree["data"]["stages"] = [{k: v for k, v in stage.items() if k != "decay"} for stage in stages] or None
    if changes:
        try:
            with open(changes) as f:
                tree = merge(tree, yaml.safe_load(f) or {})
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"--config {changes}: {str(e).splitlines()[0]}") from None
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "config.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(tree, f, sort_keys=False)
    cfg = load_config(path, overrides)   # validated, each --set checked against the keys
    start = cfg.total_steps() - decay_length(cfg.train, cfg.total_steps())
    if cfg.train.decay != "wsd" or start != step:
        raise ConfigError(f"the changes make the branch's decay start at step {start}, not at {step}: leave "
                          f"train.decay, max_steps, max_tokens and decay_steps to --decay-steps")
    with open(path, "w") as f:
        yaml.safe_dump(cfg.to_dict(), f, sort_keys=False)
    return cfg


def link_checkpoint(source: str, directory: str, step: int, keep_data: bool) -> str:
    """`source` as the complete checkpoint of `step` in `directory` (the branch's), its files hard-linked (copied
    across file systems). Without `keep_data`, each rank's trainer state loses its data position: the trainer then
    positions the (new) blend at global batch `step` of its own order."""
    tag = os.path.basename(source)
    partial, final = os.path.join(directory, tag + ".partial"), os.path.join(directory, tag)
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(source, partial, copy_function=hard_link, ignore=shutil.ignore_patterns("complete.json"))
    for name in os.listdir(partial) if not keep_data else ():
        if name.startswith("trainer_rank") and name.endswith(".pt"):
            state = safe_load.load(os.path.join(partial, name))
            state["stateful"].pop("data", None)
            torch.save(state, os.path.join(partial, name + ".tmp"))
            os.replace(os.path.join(partial, name + ".tmp"), os.path.join(partial, name))   # the link to the parent's goes
    publish(partial, final, os.path.join(directory, "latest"), step)
    return final


def hard_link(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def branch(args) -> str:
    source = checkpoint_of(args.parent, args.step)
    with open(os.path.join(source, "config.yaml")) as f:
        parent = TrainConfig.from_dict(yaml.safe_load(f), source=f"{source}/config.yaml")
    if os.path.exists(os.path.join(args.out, "checkpoints")):
        raise ConfigError(f"--out {args.out} already holds checkpoints: give a new directory")
    cfg = branch_config(parent, args.step, args.out, args.decay_steps, args.config, args.overrides)
    ours, theirs = cfg.to_dict()["data"], parent.to_dict()["data"]
    changed = [f"data.{key}" for key in ORDER_KEYS if ours[key] != theirs[key]]
    final = link_checkpoint(source, cfg.checkpoint.dir, args.step, keep_data=not changed)
    record = {"parent": os.path.abspath(parent.train.run_dir), "parent_checkpoint": os.path.abspath(source),
              "step": args.step, "decay_steps": cfg.train.decay_steps, "max_steps": cfg.train.max_steps,
              "decay_shape": cfg.train.decay_shape,
              "data": (f"another blend ({', '.join(changed)} changed): its order from global batch {args.step}"
                       if changed else "the parent's position"),
              "changes": args.overrides + ([f"--config {args.config}"] if args.config else [])}
    with open(os.path.join(args.out, BRANCH_RECORD), "w") as f:
        json.dump(record, f, indent=1)
    return (f"branch of {record['parent']} at step {args.step}: decay over {cfg.train.decay_steps} steps "
            f"({cfg.train.decay_shape}) to step {cfg.train.max_steps}, data: {record['data']}; checkpoint {final}\n"
            f"run it: launch/pretrain.sh {os.path.join(args.out, 'config.yaml')}")


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        print(branch(args))
    except (ConfigError, DataError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
