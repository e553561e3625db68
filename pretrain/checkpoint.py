"""Checkpoints: DeepSpeed's engine checkpoint (model, optimizer, LR schedule) plus, per rank, everything else a
restart needs to continue exactly: the data position, the RNG states and the step — and, for people and tools,
the run's config and tokenizer beside it.

Layout of `<checkpoint.dir>/<tag>/` (tag = `step_00000100`): DeepSpeed's files, `trainer_rank<R>.pt` for every
global rank, `config.yaml`, `tokenizer.model`; `<checkpoint.dir>/latest` names the newest tag (DeepSpeed's own file).
"""
from __future__ import annotations

import os
import random
import shutil

import numpy as np
import torch
import torch.distributed as dist
import yaml

from model import parallel as tp


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "tracker": tp.rng_tracker.state_dict()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    tp.rng_tracker.load_state_dict(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class Checkpointer:
    """Saves and restores a DeepSpeed engine together with a dict of Stateful objects of this rank."""

    def __init__(self, engine, directory: str, keep: int, stateful: dict, config: dict, tokenizer: str, rank: int,
                 world: int):
        self.engine, self.dir, self.keep, self.stateful = engine, directory, keep, stateful
        self.config, self.tokenizer, self.rank, self.world = config, tokenizer, rank, world
        self.restored: set[str] = set()   # after load(): "engine" and the names of the Stateful objects restored

    def save(self, step: int) -> str:
        tag = f"step_{step:08d}"
        self.engine.save_checkpoint(self.dir, tag=tag)           # collective; writes `latest` last
        path = os.path.join(self.dir, tag)
        own = {name: obj.state_dict() for name, obj in self.stateful.items()}
        torch.save({"step": step, "world": self.world, "rng": rng_state(), "stateful": own},
                   os.path.join(path, f"trainer_rank{self.rank}.pt"))
        if self.rank == 0:
            with open(os.path.join(path, "config.yaml"), "w") as f:
                yaml.safe_dump(self.config, f, sort_keys=False)
            if os.path.exists(self.tokenizer):
                shutil.copy(self.tokenizer, os.path.join(path, "tokenizer.model"))
        dist.barrier()
        if self.rank == 0:
            self._prune()
        return path

    def _prune(self) -> None:
        tags = sorted(t for t in os.listdir(self.dir) if t.startswith("step_"))
        for old in tags[:-self.keep]:
            shutil.rmtree(os.path.join(self.dir, old), ignore_errors=True)

    def latest_tag(self) -> str | None:
        latest = os.path.join(self.dir, "latest")
        if not os.path.exists(latest):
            return None
        with open(latest) as f:
            return f.read().strip()

    def load(self, resume: str) -> int:
        """Restore the newest checkpoint (resume='auto'), a given one (a path), or nothing ('none'); returns the step."""
        if resume == "none":
            return 0
        directory, tag = self.dir, None
        if resume != "auto":
            directory, tag = os.path.dirname(os.path.abspath(resume)), os.path.basename(os.path.abspath(resume))
        elif self.latest_tag() is None:
            return 0
        tag = tag or self.latest_tag()
        load_path, _ = self.engine.load_checkpoint(directory, tag=tag)
        if load_path is None:
            raise RuntimeError(f"no checkpoint could be loaded from {directory} (tag {tag})")
        load_path = os.path.join(directory, tag)
        own_file = os.path.join(load_path, f"trainer_rank{self.rank}.pt")
        state = torch.load(own_file, weights_only=False)
        if state["world"] != self.world:
            raise RuntimeError(f"checkpoint {load_path} was written by {state['world']} ranks, this run has "
                               f"{self.world}; convert it with tools/convert.py to change the layout")
        for name, obj in self.stateful.items():   # a checkpoint made by tools/convert.py has no data position
            if name in state["stateful"]:
                obj.load_state_dict(state["stateful"][name])
        set_rng_state(state["rng"])
        self.restored = {"engine", *state["stateful"]}
        return state["step"]
