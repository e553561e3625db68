"""Checkpoints: DeepSpeed's engine checkpoint (model, optimizer, LR schedule) plus, per rank, everything else a
restart needs to continue exactly: the data position, the RNG states and the step — and, for people and tools,
the run's config and tokenizer beside it.

Layout of `<checkpoint.dir>/<tag>/` (tag = `step_00000100`): DeepSpeed's files, `trainer_rank<R>.pt` for every
global rank, `config.yaml`, `tokenizer.model`, `complete.json`; `<checkpoint.dir>/latest` names the newest tag.

A save is atomic: every rank writes into `<tag>.partial/`; after a barrier rank 0 fsyncs every file, records each
file's size in `complete.json`, renames the directory to `<tag>` and only then replaces `latest` (write + rename).
A crash at any moment leaves the previous checkpoint complete and named by `latest`; a leftover `.partial`
directory is removed by the next save. Loading checks `complete.json` (every file present, same size) and falls
back to the newest complete checkpoint when `latest` names a damaged one.
"""
from __future__ import annotations

import errno
import json
import os
import random
import shutil
import tempfile

import numpy as np
import torch
import torch.distributed as dist
import yaml

from model import ConfigError
from model import parallel as tp
from model.config import architecture_difference
from pretrain.distributed import is_peer_loss
from pretrain.faults import NO_FAULTS, Faults


class CheckpointError(RuntimeError):
    """A checkpoint could not be written; the message is one line that says what was kept and what to do."""


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
                 world: int, faults: Faults = NO_FAULTS):
        self.engine, self.dir, self.keep, self.stateful = engine, directory, keep, stateful
        self.config, self.tokenizer, self.rank, self.world = config, tokenizer, rank, world
        self.faults = faults
        self.restored: set[str] = set()   # after load(): "engine" and the names of the Stateful objects restored
        self.loaded_from: str | None = None

    def save(self, step: int) -> str:
        """Write the checkpoint of `step` atomically. Collective. A failed write (a full disk, a quota, an I/O error)
        raises CheckpointError on the rank that saw it; the other ranks then wait in a collective until the launcher,
        seeing a rank exit with an error, ends them: the previous checkpoint stays complete and `latest`."""
        tag = f"step_{step:08d}"
        final, partial = os.path.join(self.dir, tag), os.path.join(self.dir, tag + ".partial")
        previous = self.latest_tag()
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)           # a crashed earlier attempt at this step
        dist.barrier()
        try:
            self._write(partial, tag, step)
            dist.barrier()                                        # every rank's files are written
            self.faults.saving("written", step)
            if self.rank == 0:
                self._commit(partial, final, tag, step)
                self._prune()
        except (OSError, RuntimeError) as e:                      # torch.save reports ENOSPC as a RuntimeError
            if self.rank == 0:
                shutil.rmtree(partial, ignore_errors=True)        # give the space back
            if is_peer_loss(e):                                   # another rank died mid-save: not a disk problem
                raise
            free = shutil.disk_usage(self.dir).free / 2**20 if os.path.isdir(self.dir) else float("nan")
            cause = e.strerror if isinstance(e, OSError) and e.strerror else (str(e).splitlines() or [""])[0]
            full = "the disk is full, " if free < 1 or getattr(e, "errno", None) == errno.ENOSPC else ""
            kept = f"the previous checkpoint {previous} is kept as latest" if previous else "no earlier checkpoint"
            raise CheckpointError(f"could not write checkpoint {tag} in {self.dir}: {full}{free:.1f} MiB free "
                                  f"({type(e).__name__}: {cause}); {kept}: free space or set checkpoint.dir, then "
                                  f"relaunch to resume") from None
        dist.barrier()                                            # nobody runs on before the commit
        return final

    def _write(self, partial: str, tag: str, step: int) -> None:
        """This rank's files: DeepSpeed's (collective), the trainer state, and on rank 0 the config and tokenizer."""
        os.makedirs(partial, exist_ok=True)                       # also for ranks DeepSpeed gives nothing to write
        self.faults.saving("begin", step)
        self.engine.save_checkpoint(self.dir, tag=tag + ".partial", save_latest=False)
        self.faults.saving("engine", step)
        own = {name: obj.state_dict() for name, obj in self.stateful.items()}
        torch.save({"step": step, "world": self.world, "rng": rng_state(), "stateful": own},
                   os.path.join(partial, f"trainer_rank{self.rank}.pt"))
        if self.rank == 0:
            with open(os.path.join(partial, "config.yaml"), "w") as f:
                yaml.safe_dump(self.config, f, sort_keys=False)
            if os.path.exists(self.tokenizer):
                shutil.copy(self.tokenizer, os.path.join(partial, "tokenizer.model"))

    def _commit(self, partial: str, final: str, tag: str, step: int) -> None:
        """Make the written files durable, record them, then publish: rename the directory, then point `latest`."""
        record_complete(partial, step)
        if os.path.exists(final):                                 # re-saving a step (e.g. after a resume)
            shutil.rmtree(final)
        os.rename(partial, final)
        _fsync_dir(self.dir)
        self.faults.saving("renamed", step)
        _write_durably(os.path.join(self.dir, "latest"), tag)

    def _prune(self) -> None:
        complete = complete_tags(self.dir)
        for old in complete[:-self.keep]:
            shutil.rmtree(os.path.join(self.dir, old), ignore_errors=True)
        for name in os.listdir(self.dir):                         # leftovers of crashed saves
            if name.endswith(".partial"):
                shutil.rmtree(os.path.join(self.dir, name), ignore_errors=True)

    def latest_tag(self) -> str | None:
        """The newest complete checkpoint: the one `latest` names if it verifies, else the newest that does."""
        return newest_complete(self.dir, announce=self.rank == 0)

    def check_compatible(self, path: str) -> None:
        """One-line errors, before DeepSpeed reads a tensor, for a checkpoint of another model or parallel layout."""
        problem = compatibility_problem(path, self.config, self.world) if self.config else None
        if problem:
            raise ConfigError(problem)

    def load(self, path: str | None) -> int:
        """Restore the checkpoint at `path` (a tag directory: `resume_point`'s choice), or nothing (None). Returns
        the step."""
        if path is None:
            return 0
        self.check_compatible(path)
        self.loaded_from = path
        if is_universal(path):
            return self._load_universal(path)
        directory, tag = os.path.split(path)
        with torch.no_grad():   # a pipeline's load re-broadcasts the tied embedding: no autograd (pipeline.py)
            load_path, _ = self.engine.load_checkpoint(directory, tag=tag)
        if load_path is None:
            raise ConfigError(f"no checkpoint could be loaded from {directory} (tag {tag})")
        state = torch.load(os.path.join(path, f"trainer_rank{self.rank}.pt"), weights_only=False)
        if state["world"] != self.world:   # checked before launch already (compatibility_problem); a hand-made one
            raise ConfigError(f"checkpoint {path} was written by {state['world']} ranks, this run has "
                              f"{self.world}; convert it with tools/convert.py to change the layout")
        for name, obj in self.stateful.items():   # a checkpoint made by tools/convert.py has no data position
            if name in state["stateful"]:
                obj.load_state_dict(state["stateful"][name])
        set_rng_state(state["rng"])
        self.restored = {"engine", *state["stateful"]}
        return state["step"]

    def _load_universal(self, path: str) -> int:
        """Weights and AdamW's moments in this run's layout, through DeepSpeed's universal loader (the engine was
        built with `checkpoint.load_universal`); the step and the loss guard from the trainer's state. The data
        position follows from the step (the trainer skips that many batches); the RNG streams start from the seed."""
        from pretrain import universal

        with tempfile.TemporaryDirectory() as tmp:
            view = universal.view_for(path, self.engine.module, tmp)
            with torch.no_grad():
                load_path, _ = self.engine.load_checkpoint(tmp, tag=os.path.basename(view))
        if load_path is None:
            raise ConfigError(f"no checkpoint could be loaded from the universal checkpoint {path}")
        universal.restore_frozen(path, self.engine.module)
        state = torch.load(os.path.join(path, "trainer_state.pt"), weights_only=False)
        self.restored = {"engine", "universal"}
        if state.get("guard") and "guard" in self.stateful:
            self.stateful["guard"].load_state_dict(state["guard"])
            self.restored.add("guard")
        return state["step"]


def is_universal(path: str) -> bool:
    """Whether a checkpoint directory holds a universal checkpoint (pretrain/universal.py) of any layout."""
    return os.path.isfile(os.path.join(path, "trainer_state.pt")) and os.path.isdir(os.path.join(path, "zero"))


def newest_universal(directory: str) -> str | None:
    """The complete universal checkpoint that `latest_universal` names in `directory`, or None."""
    named = os.path.join(directory, "latest_universal")
    tag = open(named).read().strip() if os.path.isfile(named) else None
    complete = tag and os.path.isfile(os.path.join(directory, tag, "complete.json"))   # not one being written
    return tag if complete and verify(os.path.join(directory, tag)) is None else None


def resume_point(resume: str, directory: str, config: dict, world: int, announce: bool = False) -> str | None:
    """The checkpoint directory a run resumes from, or None. resume='none': None; a path: that path; 'auto': the
    newest complete checkpoint in `directory`, unless a universal one is newer, or as new while the newest regular
    one is of another layout (tools/convert.py to-universal wrote it for the relaunch in a new layout)."""
    if resume == "none":
        return None
    if resume != "auto":
        problem = verify(os.path.abspath(resume))
        if problem:
            raise ConfigError(f"checkpoint.resume={resume} is not a complete checkpoint: {problem}")
        return os.path.abspath(resume)
    tag, uni = newest_complete(directory, announce), newest_universal(directory)
    step = lambda t: int(t.rsplit("_", 1)[-1])   # noqa: E731  step_00000100, universal_step_00000100
    if uni and (tag is None or step(uni) > step(tag) or
                (step(uni) == step(tag) and layout_problem(os.path.join(directory, tag), config, world))):
        return os.path.join(directory, uni)
    return os.path.join(directory, tag) if tag else None


def newest_complete(directory: str, announce: bool = False) -> str | None:
    """The tag to resume from: the one `latest` names if it verifies, else the newest that does (said when
    `announce`), else None."""
    latest = os.path.join(directory, "latest")
    named = open(latest).read().strip() if os.path.exists(latest) else None
    why = verify(os.path.join(directory, named)) if named else None
    if named and why is None:
        return named
    complete = complete_tags(directory)
    if named and complete and announce:
        print(f"checkpoint {os.path.join(directory, named)} is incomplete ({why}); resuming from {complete[-1]}",
              flush=True)
    return complete[-1] if complete else None


def complete_tags(directory: str) -> list[str]:
    """Tags whose every recorded file is present with its recorded size, oldest first."""
    if not os.path.isdir(directory):
        return []
    tags = sorted(t for t in os.listdir(directory) if t.startswith("step_") and not t.endswith(".partial"))
    return [t for t in tags if verify(os.path.join(directory, t)) is None]


def compatibility_problem(path: str, config: dict, world: int) -> str | None:
    """Why a run of `config` on `world` ranks cannot resume the checkpoint at `path` (another model, another
    layout, another world size), as one line with what to do; None if it can. Reads only config.yaml and the file
    names: cheap enough for the check before launch."""
    return architecture_problem(path, config) or layout_problem(path, config, world)


def _saved_config(path: str) -> dict | None:
    saved_file = os.path.join(path, "config.yaml")
    if not os.path.exists(saved_file):
        return None
    with open(saved_file) as f:
        return yaml.safe_load(f)


def architecture_problem(path: str, config: dict) -> str | None:
    """Why the checkpoint at `path` holds another model than `config` describes (one line), or None."""
    saved = _saved_config(path)
    key = saved and architecture_difference(saved.get("model", {}), config["model"])
    if key:
        return (f"checkpoint {path} holds a model with model.{key}={saved['model'].get(key)!r}, this config has "
                f"{config['model'][key]!r}: set it back, or start a new run (train.run_dir / checkpoint.dir)")
    return None


def layout_problem(path: str, config: dict, world: int) -> str | None:
    """Why a run in the layout of `config` on `world` ranks cannot load the checkpoint at `path` as it is (another
    TP, PP, ZeRO-3 or world size), with what to do; None if it can."""
    saved = _saved_config(path)
    if saved is None:
        return None
    if is_universal(path):
        if config["parallel"]["zero_stage"] not in (1, 2):   # DeepSpeed's loader is in the ZeRO-1/2 optimizers
            return (f"checkpoint {path} is a universal checkpoint, which loads into ZeRO stages 1 and 2: set "
                    f"parallel.zero_stage=1 or 2 to resume from it (and change the stage at the next checkpoint)")
        return None   # written to be resumed in any layout
    change = (f"to change the layout and keep the optimizer state, relaunch with checkpoint.relayout=true (or "
              f"convert it first: tools/convert.py to-universal {path})")
    for key in ("tp", "pp"):
        theirs, ours = saved.get("parallel", {}).get(key), config["parallel"][key]
        if theirs != ours:
            return (f"checkpoint {path} was written with parallel.{key}={theirs}, this run has parallel.{key}={ours}: "
                    f"launch with parallel.{key}={theirs} to resume it, or {change}")
    theirs, ours = saved.get("parallel", {}).get("zero_stage", 0), config["parallel"]["zero_stage"]
    if (theirs == 3) != (ours == 3):   # ZeRO-3 partitions parameters: its files are not those of stages 0-2
        return (f"checkpoint {path} was written with parallel.zero_stage={theirs}, this run has "
                f"parallel.zero_stage={ours}: launch with parallel.zero_stage={theirs} to resume it, or {change}")
    ranks = sum(n.startswith("trainer_rank") and n.endswith(".pt") for n in os.listdir(path))
    if ranks and ranks != world:
        return (f"checkpoint {path} was written by {ranks} ranks, this launch has {world}: launch {ranks} to resume "
                f"it, or {change}")
    return None


def verify(path: str) -> str | None:
    """None if the checkpoint directory holds every file its complete.json records, at the recorded size; else why not.
    A directory without complete.json (written before atomic saves, or by hand) is accepted as it is."""
    if not os.path.isdir(path):
        return "no such directory"
    record = os.path.join(path, "complete.json")
    if not os.path.exists(record):
        return None if any(n.endswith("_model_states.pt") for n in os.listdir(path)) else "no model states"
    try:
        with open(record) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError):
        return "complete.json is unreadable"
    for name, size in files.items():
        file = os.path.join(path, name)
        if not os.path.exists(file):
            return f"{name} is missing"
        if os.path.getsize(file) != size:
            return f"{name} has {os.path.getsize(file)} bytes, {size} were written"
    return None


def record_complete(directory: str, step: int) -> None:
    """fsync every file under a written checkpoint directory, then record their sizes in complete.json, which
    `verify` checks."""
    sizes = {}
    for root, _, files in os.walk(directory):
        for name in sorted(files):
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                os.fsync(f.fileno())
            sizes[os.path.relpath(path, directory)] = os.path.getsize(path)
    _write_durably(os.path.join(directory, "complete.json"), json.dumps({"step": step, "files": sizes}, indent=1))


def _write_durably(path: str, text: str) -> None:
    """Replace `path` atomically: write a temporary file, fsync it, rename it over the old one."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
