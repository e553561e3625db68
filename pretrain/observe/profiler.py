"""Profiler windows inside the run (logging.profile), as torchtitan's `profiling.*` and Megatron-LM's
`--profile-step-start/--profile-ranks` have them: torch.profiler records the optimizer steps start … start + steps − 1
(and, with `every`, as many steps each `every` steps) on the listed global ranks.

    logging:
      profile: {start: 20, steps: 3, ranks: [0, 8], memory: true}

Each window writes, under <run_dir>/profile/steps_<a>-<b>/:
    rank<k>.pt.trace.json   the trace: CPU ops (with their shapes), CUDA kernels on a GPU, each step as
                            ProfilerStep#<n>, and the step's laps as labelled ranges (synthformer/data_wait,
                            synthformer/fwd_bwd, synthformer/optimizer, synthformer/train_batch,
                            synthformer/step_outcome: pretrain/observe/step_times.py). Open it in Perfetto
                            (ui.perfetto.dev) or chrome://tracing, or `tensorboard --logdir <run_dir>/profile` where
                            TensorBoard's profiler plugin (torch-tb-profiler) is installed: one run per window, one
                            worker per rank.
    rank<k>.memory.pickle   on CUDA with `memory: true`: PyTorch's allocator history over the window
                            (torch.cuda.memory._record_memory_history / _dump_snapshot), for pytorch.org/memory_viz.
                            An out-of-memory error while it records dumps rank<k>.oom.pickle, the allocations that
                            were live when it struck, and the error goes on as before.

The step before a window runs under the profiler as its warm-up (its start-up cost stays out of the recorded steps).
Off (null, the default) nothing is imported or started: a step pays one comparison.
"""
from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pretrain.config.sections import ProfileSection


class ProfileWindows:
    def __init__(self, settings: ProfileSection | None, rank: int, device: torch.device, run_dir: str, times):
        self.on = settings is not None and rank in settings.ranks   # None: off
        self.rank, self.device, self.run_dir, self.times = rank, device, run_dir, times
        if settings is not None:
            self.start, self.steps, self.every = settings.start, settings.steps, settings.every
        self.memory = self.on and settings.memory and device.type == "cuda"
        self.prof, self.window, self.recording = None, None, False
        if self.on and settings.memory and device.type != "cuda":
            print(f"note: logging.profile.memory records CUDA's allocator; rank {rank} runs on {device.type}: the "
                  f"window has its trace, no memory snapshot", flush=True)

    def first_of(self, step: int) -> int | None:
        """The first step of the window `step` belongs to, or None."""
        if step < self.start:
            return None
        offset = (step - self.start) % self.every if self.every else step - self.start
        return step - offset if offset < self.steps else None

    @contextlib.contextmanager
    def step(self, step: int):
        """Around optimizer step `step` (1-based): opens a window at its warm-up step, closes it after its last."""
        if not self.on:
            yield
            return
        if self.prof is None and self.first_of(step + 1) == step + 1:   # `step` is the warm-up of a window
            self.open(step + 1, warmup=1)
        elif self.prof is None and self.first_of(step) == step:        # a window at step 1, or resumed at its start
            self.open(step, warmup=0)
        try:
            yield
        except torch.OutOfMemoryError:
            if self.recording:
                self.dump_memory("oom")
            raise
        if self.prof is not None:
            self.prof.step()
            if step == self.window[1]:
                self.close()

    def open(self, first: int, warmup: int) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule

        self.window = (first, first + self.steps - 1)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self.prof = profile(activities=activities, record_shapes=True,
                            schedule=schedule(wait=0, warmup=warmup, active=self.steps, repeat=1),
                            on_trace_ready=self.save)
        self.prof.__enter__()
        self.times.annotate = True   # the laps as labelled ranges (a warm-up step's are not kept)
        if self.memory:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
            self.recording = True

    def directory(self) -> str:
        path = os.path.join(self.run_dir, "profile", f"steps_{self.window[0]}-{self.window[1]}")
        os.makedirs(path, exist_ok=True)
        return path

    def save(self, prof) -> None:
        path = os.path.join(self.directory(), f"rank{self.rank}.pt.trace.json")
        prof.export_chrome_trace(path)
        if self.memory:
            self.dump_memory("memory")
        print(f"profiler: rank {self.rank} recorded steps {self.window[0]}-{self.window[1]}: {path}"
              + (f" and {path.replace('.pt.trace.json', '.memory.pickle')}" if self.memory else ""), flush=True)

    def dump_memory(self, name: str) -> None:
        torch.cuda.memory._dump_snapshot(os.path.join(self.directory(), f"rank{self.rank}.{name}.pickle"))

    def close(self) -> None:
        """End the open window (also when the run stops inside it: what it recorded is saved)."""
        if self.prof is None:
            return
        prof, self.prof = self.prof, None
        self.times.annotate = False
        self.times.open_range(None)
        prof.__exit__(None, None, None)
        if self.recording:
            torch.cuda.memory._record_memory_history(enabled=None)
            self.recording = False
