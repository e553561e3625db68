"""Checkpoints: DeepSpeed's engine checkpoint (model, optimizer, LR schedule) plus, per rank, everything else a
restart needs to continue exactly: the data position, the RNG states and the step — and, for people and tools,
the run's config and tokenizer beside it.

Layout of `<checkpoint.dir>/<tag>/` (tag = `step_00000100`): DeepSpeed's files, `trainer_rank<R>.pt` for every
global rank, `config.yaml`, `tokenizer.model`, `complete.json`; `<checkpoint.dir>/latest` names the newest tag.

A save is atomic: every rank writes into `<tag>.partial/`; after a barrier rank 0 fsyncs every file, records each
file's size in `complete.json`, renames the directory to `<tag>` and only then replaces `latest` (write + rename).
A crash at any moment leaves the previous checkpoint complete and named by `latest`; a leftover `.partial`
directory older than the newest committed checkpoint is removed by the next save (retention.py). Loading checks
`complete.json` (every file present, same size) and falls back to the newest complete checkpoint when `latest` names
a damaged one. While it saves, `own` lists the files this rank writes (DeepSpeed's, through its checkpoint engine,
and the trainer's): all the hang watchdog reads of a save.

With checkpoint.async_save the save returns once this rank's state is copied to host memory; a writer thread
writes the same files (async_save.py), and the commit above happens at a later step, after every rank's writer has
finished (`writer_flags` ride on the step's all-reduce; `written` commits) — before the next save starts, and
before the run's last save returns (`settle`). Where checkpoint.dir is a bucket the writer thread also uploads
this rank's files from the staging directory, and "finished" means written and uploaded: the commit in the bucket
(complete.json, then `latest`) waits for every rank's upload (bucket.py `Saves`).
"""
from __future__ import annotations

import errno
import functools
import os
import random
import shutil
import tempfile
import warnings
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist
import yaml

from model import ConfigError
from model import parallel as tp
from model.release import copy_tokenizer
from pretrain.checkpoints import ds_checkpoint, retention, safe_load, universal
from pretrain.checkpoints.async_save import Background
from pretrain.checkpoints.bucket import Saves
from pretrain.checkpoints.durable import publish
from pretrain.checkpoints.resume import compatibility_problem, grown_from, is_universal, newest_complete
from pretrain.distributed import every_rank, is_peer_loss
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


class OwnFiles:
    """The files this rank writes in the save under way, as it starts each: the save's progress on this rank, read
    with one stat (the file being written), never a walk of step_N.partial/, which holds every rank's files."""

    def __init__(self):
        self.begin()

    def begin(self) -> None:
        self.started, self.done, self.current = 0, 0, None   # files started, bytes of the finished ones, the last
        self.paths: list[str] = []   # every file started (what this rank uploads where checkpoint.dir is a bucket)

    def writing(self, path: str) -> None:
        self.finished()
        self.started, self.current = self.started + 1, path
        self.paths.append(path)

    def uploaded(self, path: str) -> None:
        """A file up in the bucket: progress too, for the watchdog (a long upload of a settled save is no hang)."""
        self.started, self.done = self.started + 1, self.done + size(path)

    def finished(self) -> None:
        if self.current is not None:
            self.done += size(self.current)
            self.current = None

    def progress(self) -> tuple[int, int]:
        """(files started, bytes written)."""
        current = self.current
        return self.started, self.done + (size(current) if current is not None else 0)


def kept(previous: str | None) -> str:
    return f"the previous checkpoint {previous} is kept as latest" if previous else "no earlier checkpoint"


def size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:   # not made yet, or removed meanwhile
        return 0


class Pending(NamedTuple):
    """A save written in the background, not yet committed."""
    step: int
    tag: str
    partial: str
    final: str
    previous: str | None


class Checkpointer:
    """Saves and restores a DeepSpeed engine together with a dict of Stateful objects of this rank."""

    def __init__(self, engine, directory: str, keep: int, stateful: dict, config: dict, tokenizer: str, rank: int,
                 world: int, faults: Faults = NO_FAULTS, keep_every: int | None = None, bucket: Saves | None = None,
                 async_save: bool = False, announce=lambda line: None):
        self.engine, self.dir, self.keep, self.stateful = engine, directory, keep, stateful
        self.bucket = bucket   # checkpoint.dir in a bucket: `directory` is the local staging directory (bucket.py)
        self.keep_every = keep_every   # every this many steps kept for good (retention.py)
        self.config, self.tokenizer, self.rank, self.world = config, tokenizer, rank, world
        self.faults = faults
        self.restored: set[str] = set()   # after load(): "engine" and the names of the Stateful objects restored
        self.loaded_from: str | None = None
        self.own = OwnFiles()
        self.background = Background() if async_save else None   # checkpoint.async_save: the writer thread's side
        self.announce = announce   # the run's log (rank 0's lines): async saves say when they are published
        writer = getattr(engine, "checkpoint_engine", None)   # DeepSpeed writes and reads each of its files through it
        if writer is not None:
            writer.save = self._own_file(writer.save)
            writer.load = self._checked(writer.load)   # it loads with weights_only=False: each file is checked first

    def _own_file(self, save):
        """DeepSpeed's checkpoint engine's save(state_dict, path), each file listed in `own` as it starts."""
        def listed(state_dict, path, *args, **kwargs):
            self._file(path, state_dict, lambda state, where: save(state, where, *args, **kwargs))
        return listed

    def _file(self, path: str, state, write) -> None:
        """One file of this rank's save: written now, or (async) copied to host memory and queued for the writer."""
        if self.background is not None and self.background.collecting is not None:
            self.background.add(path, state, write)
        else:
            self.own.writing(path)
            write(state, path)

    @staticmethod
    def _checked(load):
        """DeepSpeed's checkpoint engine's load(path, ...), refusing a file whose pickle would run code (safe_load)."""
        def checked(path, *args, **kwargs):
            safe_load.check(path)
            return load(path, *args, **kwargs)
        return checked

    def save(self, step: int, last: bool = False) -> str | None:
        """Write the checkpoint of `step` atomically; its path (its URL in a bucket). Collective. A failed write (a
        full disk, a quota, an I/O error) raises CheckpointError on the rank that saw it; the other ranks then wait in
        a collective until the launcher, seeing a rank exit with an error, ends them: the previous checkpoint stays
        complete and `latest`. A failed upload to a bucket returns None on every rank (rank 0 said why in one line).
        Async (checkpoint.async_save): the previous save is committed first (`settle`); this one returns once the
        state is in host memory, and is committed at a later step (`written`), or before it returns where `last`
        (the run's last save, a preemption's)."""
        if self.background is not None:
            self.settle()
        tag = f"step_{step:08d}"
        final, partial = os.path.join(self.dir, tag), self.partial_path(step)
        previous = self.latest_tag()
        self.own.begin()
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)           # a crashed earlier attempt at this step
        dist.barrier()
        try:
            if self.background is not None:
                self.background.begin(self.own, after_first=lambda: self.faults.saving("writing", step))
            self._write(partial, tag, step)
            if self.background is not None:                       # the snapshot is taken: the thread writes it
                upload = self._uploader(partial, tag, step) if self.bucket is not None else None
                self.background.start(Pending(step, tag, partial, final, previous), tag, upload)
                self.announce(f"checkpoint {tag}: in host memory ({self.background.host.bytes / 2**20:,.0f} MiB on "
                              f"rank {self.rank}), written{' and uploaded' if upload else ''} in the background")
            else:
                dist.barrier()                                    # every rank's files are written
                self.faults.saving("written", step)
                if self.bucket is not None:                       # upload, all agree, rank 0 commits in the bucket
                    committed = self.bucket.publish(partial, tag, step, self.own.paths, self.faults, previous,
                                                    self.keep, self.keep_every, self.own.uploaded)
                elif self.rank == 0:
                    self._commit(partial, final, tag, step)
                    self._prune()
        except (OSError, RuntimeError) as e:                      # torch.save reports ENOSPC as a RuntimeError
            if self.background is not None:
                self.background.abandon()
            if self.rank == 0:
                shutil.rmtree(partial, ignore_errors=True)        # give the space back
            if is_peer_loss(e):                                   # another rank died mid-save: not a disk problem
                raise
            free = shutil.disk_usage(self.dir).free / 2**20 if os.path.isdir(self.dir) else float("nan")
            cause = e.strerror if isinstance(e, OSError) and e.strerror else (str(e).splitlines() or [""])[0]
            full = "the disk is full, " if free < 1 or getattr(e, "errno", None) == errno.ENOSPC else ""
            raise CheckpointError(f"could not write checkpoint {tag} in {self.dir}: {full}{free:.1f} MiB free "
                                  f"({type(e).__name__}: {cause}); {kept(previous)}: free space or set "
                                  f"checkpoint.dir, then relaunch to resume") from None
        if self.background is not None:
            if last:
                self.settle()
            return self.bucket.store.where(tag) if self.bucket is not None else final
        dist.barrier()                                            # nobody runs on before the commit
        if self.bucket is not None:                               # the staging copy is uploaded (or given up)
            shutil.rmtree(partial, ignore_errors=True)
            return self.bucket.store.where(tag) if committed else None
        return final

    def _uploader(self, partial: str, tag: str, step: int):
        """An async save's upload, which its writer thread runs once this rank's files are written (Writing.upload).
        Collective, at the save: the bucket learns which rank uploads which file (Saves.prepare)."""
        mine, problem = self.bucket.prepare(partial, tag, self.own.paths + self.background.queued())
        return functools.partial(self.bucket.uploading, mine, problem, tag, step, self.faults, self.own.uploaded)

    # ---- saves in the background (checkpoint.async_save) --------------------------------------------------------
    def writer_flags(self) -> list[bool]:
        """[this rank still writing a save in the background, this rank's write failed]: for the step's all-reduce
        (MAX over the ranks: pretrain/distributed.py step_outcome), whose result goes to `written`."""
        return self.background.flags() if self.background is not None else [False, False]

    def written(self, flags: list[float]) -> None:
        """After a step's all-reduce of `writer_flags` (the same on every rank): commit the save in the background
        once no rank is writing it (in a bucket: writing or uploading), or report its failure. No wait for a writer;
        at that step only, one gather of the ranks' reports (async_save.Report)."""
        if self.background is None or self.background.pending is None:
            return
        writing, failed = flags
        if failed or not writing:   # every rank's report: why one failed, or (bucket) what each uploaded
            self._conclude(every_rank(self.background.wait(cancel=bool(failed))))

    def settle(self) -> None:
        """Wait for this rank's writer, then commit the save in the background once every rank's is done
        (collective)."""
        if self.background is not None and self.background.pending is not None:
            self._conclude(every_rank(self.background.wait()))

    def _conclude(self, reports: list) -> None:
        """Every rank's writer is done (async_save.Report of each): rank 0 commits; or one failed to write: every
        rank raises the same one line, the previous checkpoint stays `latest` and the written part is removed. In a
        bucket, a failed upload is the one line of Saves.conclude, and training goes on."""
        p = self.background.settled()
        failed = [(r, report.error) for r, report in enumerate(reports) if report.error]
        if not failed:
            self.faults.saving("written", p.step)
            if self.bucket is not None:
                committed = self.bucket.conclude(p.tag, p.step, [(r.problem, r.uploaded) for r in reports],
                                                 self.faults, p.previous, self.keep, self.keep_every)
                shutil.rmtree(p.partial, ignore_errors=True)      # the staging copy is uploaded (or given up)
                if committed and self.rank == 0:
                    self.announce(f"saved checkpoint {self.bucket.store.where(p.tag)}")
                return
            if self.rank == 0:
                try:
                    self._commit(p.partial, p.final, p.tag, p.step)
                    self._prune()
                    self.announce(f"saved checkpoint {p.final}")
                except OSError as e:
                    failed = [(0, f"{type(e).__name__}: {e.strerror or e} (committing)")]
            if not failed:
                return
        if self.rank == 0:
            shutil.rmtree(p.partial, ignore_errors=True)
        r, cause = failed[0]
        raise CheckpointError(f"could not write checkpoint {p.tag} in {self.dir} in the background: rank {r}: "
                              f"{cause}; {kept(p.previous)}: fix the cause (free space, or set checkpoint.dir), "
                              f"then relaunch to resume")

    def partial_path(self, step: int) -> str:
        """Where the save of `step` writes until it is committed (every rank's files; the hang watchdog reads only `own`)."""
        return os.path.join(self.dir, f"step_{step:08d}.partial")

    def _write(self, partial: str, tag: str, step: int) -> None:
        """This rank's files: DeepSpeed's (collective), the trainer state, and on rank 0 the config and tokenizer."""
        os.makedirs(partial, exist_ok=True)                       # also for ranks DeepSpeed gives nothing to write
        self.faults.saving("begin", step)
        self.engine.save_checkpoint(self.dir, tag=tag + ".partial", save_latest=False)
        self.faults.saving("engine", step)
        own = {name: obj.state_dict() for name, obj in self.stateful.items()}
        mine = os.path.join(partial, f"trainer_rank{self.rank}.pt")
        self._file(mine, {"step": step, "world": self.world, "rng": rng_state(), "stateful": own}, torch.save)
        if self.rank == 0:
            self.own.writing(os.path.join(partial, "config.yaml"))
            with open(os.path.join(partial, "config.yaml"), "w") as f:
                yaml.safe_dump(self.config, f, sort_keys=False)
            copy_tokenizer(self.tokenizer, partial)
        self.own.finished()

    def _commit(self, partial: str, final: str, tag: str, step: int) -> None:
        """Make the written files durable, record them, then publish: rename the directory, then point `latest`."""
        publish(partial, final, os.path.join(self.dir, "latest"), step,
                after_rename=lambda: self.faults.saving("renamed", step))

    def _prune(self) -> None:
        retention.prune(self.dir, self.keep, self.keep_every)

    def latest_tag(self) -> str | None:
        """The newest complete checkpoint: the one `latest` names if it verifies, else the newest that does."""
        if self.bucket is not None:
            return self.bucket.store.newest_complete(announce=self.rank == 0)
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
        if self.config and grown_from(path, self.config):
            return self._load_grown(path)
        directory, tag = os.path.split(path)
        with torch.no_grad():   # a pipeline's load re-broadcasts the tied embedding: no autograd (pipeline.py)
            load_path, _ = self.engine.load_checkpoint(directory, tag=tag)
        if load_path is None:
            raise ConfigError(f"no checkpoint could be loaded from {directory} (tag {tag})")
        state = safe_load.load(os.path.join(path, f"trainer_rank{self.rank}.pt"))
        if state["world"] != self.world:   # checked before launch already (compatibility_problem); a hand-made one
            raise ConfigError(f"checkpoint {path} was written by {state['world']} ranks, this run has "
                              f"{self.world}; convert it with tools/convert.py to change the layout")
        for name, obj in self.stateful.items():   # a checkpoint made by tools/convert.py has no data position
            if name in state["stateful"]:
                obj.load_state_dict(state["stateful"][name])
        set_rng_state(state["rng"])
        self.restored = {"engine", *state["stateful"]}
        return state["step"]

    def _load_grown(self, path: str) -> int:
        """checkpoint.extend_length: the weights grown to this run's max_seq_len (ds_checkpoint.load_grown), the
        optimizer state fresh for every weight (its moments are the old length's, and a grown weight has new rows),
        the step and the LR schedule at it; `restored` lacks "data", so the trainer places the data stream after the
        step's global batches."""
        if self.config["parallel"]["zero_stage"] == 3:
            raise ConfigError(f"checkpoint.extend_length loads {path} into ZeRO stages 0-2: set parallel.zero_stage "
                              "to 2 or less for the resume that grows the model (and back at the next)")
        ds_checkpoint.load_grown(self.engine.module, path, self.config["model"])
        if self.engine.zero_optimization() or self.engine.bfloat16_enabled():   # fp32 masters beside the weights
            self.engine.optimizer.refresh_fp32_params()
        step = safe_load.load(os.path.join(path, f"trainer_rank{self.rank}.pt"))["step"]
        with warnings.catch_warnings():   # the fresh engine's LR schedule moved to the step, no optimizer step
            warnings.simplefilter("ignore")
            self.engine.lr_scheduler.last_epoch = step - 1
            self.engine.lr_scheduler.step()
        if self.rank == 0:
            print(f"checkpoint.extend_length: {path} grown to model.max_seq_len={self.config['model']['max_seq_len']}"
                  f" (fresh optimizer state)", flush=True)
        self.restored = {"engine", "grown"}
        return step

    def _load_universal(self, path: str) -> int:
        """Weights and AdamW's moments in this run's layout, through DeepSpeed's universal loader (the engine was
        built with `checkpoint.load_universal`); the step, the loss guard and the data position from the trainer's
        state (a universal checkpoint without one, of a run in the old order: the trainer positions the data at the
        step); the RNG streams start from the seed."""
        with tempfile.TemporaryDirectory() as tmp:
            view = universal.view_for(path, self.engine.module, tmp)
            with torch.no_grad():
                load_path, _ = self.engine.load_checkpoint(tmp, tag=os.path.basename(view))
        if load_path is None:
            raise ConfigError(f"no checkpoint could be loaded from the universal checkpoint {path}")
        universal.restore_frozen(path, self.engine.module)
        state = safe_load.load(os.path.join(path, "trainer_state.pt"))
        self.restored = {"engine", "universal"}
        for name in ("guard", "data"):   # the data position of every rank merged: layout-free
            if state.get(name) and name in self.stateful:
                self.stateful[name].load_state_dict(state[name])
                self.restored.add(name)
        return state["step"]
