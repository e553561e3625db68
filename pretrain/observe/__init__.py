"""Seeing inside a run: where each optimizer step's time goes, and profiler windows of chosen steps and ranks.

    step_times.py   StepTimes: a step's laps (data wait, forward + backward, optimizer; a pipeline's train_batch),
                    timed by the wall clock on CPU and by CUDA events read one step late on a GPU; perf/*_s
    profiler.py     ProfileWindows: logging.profile's torch.profiler windows, and CUDA memory snapshots

The trainer makes one of each and calls them from its loop (pretrain/train.py); docs/monitoring.md says how to read
what they write.
"""
from pretrain.observe.profiler import ProfileWindows
from pretrain.observe.step_times import StepTimes

__all__ = ["ProfileWindows", "StepTimes"]
