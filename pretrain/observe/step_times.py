"""Where an optimizer step's time goes: waiting for data, forward + backward, the optimizer; for pipeline runs the
time around DeepSpeed's `train_batch`. Logged per logging step as the mean over the steps since the last one, in
seconds per optimizer step (metrics.jsonl, TensorBoard, W&B):

    perf/step_s            the whole train_step: from its first fetch to the step's outcome on the host
    perf/data_wait_s       fetching micro-batches (the DataLoader, the copy to the device)
    perf/fwd_bwd_s         forward and backward of every micro-batch, with what DeepSpeed does in backward (ZeRO's
                           gradient reduce-scatter/all-reduce, TP's all-reduces)
    perf/optimizer_s       engine.step() of every micro-batch: the AdamW update at the last one, with ZeRO's
                           all-gather of the updated weights and the gradient clipping
    perf/pipeline_step_s   pipeline runs (parallel.pp > 1): the whole train_batch, its fetches included: DeepSpeed's
                           1F1B schedule interleaves forwards, backwards, the stages' sends and receives, the bubble,
                           the gradient all-reduce and the optimizer step, so only the fetches are split out of it

Every rank also keeps its own sums for fleet health (pretrain/fleet/), read by `window()` once per fleet window:
data_wait, compute (the forward passes alone, marked by `split("compute")` inside the forward+backward lap: a
data-parallel forward holds no collective, so a slow peer cannot show in it), backward (the rest of that lap,
DeepSpeed's gradient reduction with its waits included) and optimizer; a pipeline step's train_batch is its compute.

The marks cut a step into consecutive laps: `start()`, then `lap(phase)` gives the time since the previous mark to
`phase`, then `end()`. On CPU a mark is the wall clock (every op and gloo collective has finished when the host
goes on). On CUDA a mark is a CUDA event on the current stream: the laps are device time, so a fetch counts only
for as long as the device sat idle for it, and a kernel counts where it ran, not where the host queued it. Events
are read one step late (`end()` reads the steps before this one, whose events the host's read of this step's outcome
has passed), with `query()`, which never waits: timing adds no host sync to the hot path.
"""
from __future__ import annotations

import time
from collections import Counter

import torch

NAMES = {"data_wait": "perf/data_wait_s", "fwd_bwd": "perf/fwd_bwd_s", "optimizer": "perf/optimizer_s"}
# the lap after each lap (profiler ranges only): a plain step's micro-batches cycle through the first three; the last
# engine.step() and the pipeline's train_batch are followed by the step's outcome (a collective and the host's read)
# the fleet phase of each lap (pretrain/fleet/detector.py PHASES): a pipeline's train_batch is all its compute
# and the step's outcome (the trainer's collective and its read) is the collective phase's, timed at pretrain/distributed.py
FLEET = {"data_wait": "data_wait", "fwd_bwd": "backward", "optimizer": "optimizer", "train_batch": "compute"}
NEXT = {"data_wait": "fwd_bwd", "fwd_bwd": "optimizer", "optimizer": "data_wait", "train_batch": "step_outcome"}


class StepTimes:
    def __init__(self, device: torch.device, micro_batches: int, pipeline: bool):
        self.cuda = device.type == "cuda"
        self.micro_batches, self.first = micro_batches, "train_batch" if pipeline else "data_wait"
        self.marks: list = []            # this step's (phase, mark): the phase of the lap that ends at the mark
        self.pending: list[list] = []    # finished steps whose events are not read yet (CUDA)
        self.sums, self.steps = Counter(), 0
        self.ranges: list = []           # the open record_function range while a profiler window records
        self.annotate = False            # set by the profiler window (pretrain/observe/profiler.py)
        self.updates = 0                 # engine.step() calls in this step
        self.splits: list = []           # this step's (phase, mark before, mark after) inside a lap (fleet only)
        self.fleet, self.fleet_steps = Counter(), 0   # per-rank sums for pretrain/fleet/, since the last window()

    def now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        self.marks, self.updates, self.splits = [("start", self.now())], 0, []
        self.open_range(self.first)

    def lap(self, phase: str, then: str | None = None) -> None:
        """The time since the previous mark was spent in `phase`; `then` names the next lap in a profiler trace
        (default: NEXT's)."""
        self.marks.append((phase, self.now()))
        self.updates += phase == "optimizer"
        last = phase == "optimizer" and self.updates == self.micro_batches
        self.open_range(then or ("step_outcome" if last else NEXT[phase]))

    def split(self, phase: str) -> None:
        """The time since the last lap's mark was `phase` for fleet health (the lap itself goes on)."""
        self.splits.append((phase, self.marks[-1][1], self.now()))

    def end(self) -> None:
        self.open_range(None)
        self.marks.append(("step_outcome", self.now()))
        self.pending.append((self.marks, self.splits))
        self.marks, self.splits = [], []
        self.read(keep=1 if self.cuda else 0)

    def read(self, keep: int = 0) -> None:
        """Add the laps of the finished steps, all but the newest `keep`, whose last event has completed."""
        while len(self.pending) > keep and self.complete(self.pending[0][0][-1][1]):
            marks, splits = self.pending.pop(0)
            for (_, before), (phase, after) in zip(marks, marks[1:]):
                self.sums[phase] += self.seconds(before, after)
                if phase in FLEET:
                    self.fleet[FLEET[phase]] += self.seconds(before, after)
            for phase, before, after in splits:   # carved out of the forward+backward lap
                self.fleet[phase] += self.seconds(before, after)
                self.fleet["backward"] -= self.seconds(before, after)
            self.sums["step"] += self.seconds(marks[0][1], marks[-1][1])
            self.steps += 1
            self.fleet_steps += 1

    def complete(self, mark) -> bool:
        return not self.cuda or mark.query()

    def seconds(self, before, after) -> float:
        return before.elapsed_time(after) / 1e3 if self.cuda else after - before

    def values(self) -> dict[str, float]:
        """The mean seconds per optimizer step of each phase over the steps read since the last call ({} if none:
        on CUDA the first logging step's events may all be a step behind)."""
        self.read()
        if not self.steps:
            return {}
        n, sums = self.steps, self.sums
        out = {"perf/step_s": sums["step"] / n}
        if "train_batch" in sums:   # a pipeline step: its fetches are inside train_batch
            out["perf/pipeline_step_s"] = (sums["train_batch"] + sums["data_wait"]) / n
            out["perf/data_wait_s"] = sums["data_wait"] / n
        else:
            out.update({name: sums[phase] / n for phase, name in NAMES.items()})
        self.sums, self.steps = Counter(), 0
        return out

    def window(self) -> tuple[int, dict[str, float]]:
        """(steps read, this rank's seconds per step of each fleet phase) since the last call, for pretrain/fleet/."""
        self.read()
        n, sums = self.fleet_steps, self.fleet
        self.fleet, self.fleet_steps = Counter(), 0
        return n, {phase: sums[phase] / n for phase in sums} if n else {}

    def fetches(self, batches, phase: str):
        """`batches` for an engine that pulls them itself (the PipelineEngine): each fetch is a data_wait lap and the
        time between fetches goes to `phase`."""
        while True:
            self.lap(phase, then="data_wait")
            batch = next(batches)
            self.lap("data_wait", then=phase)
            yield batch

    def open_range(self, phase: str | None) -> None:
        """While a profiler window records, each lap is also a labelled range in its trace (`synthformer/<phase>`)."""
        while self.ranges:
            self.ranges.pop().__exit__(None, None, None)
        if self.annotate and phase is not None:
            rf = torch.profiler.record_function(f"synthformer/{phase}")
            rf.__enter__()
            self.ranges.append(rf)
