"""What a run reports, and how it sees inside itself. Every report of the run has its home here.

    metrics.py      Logger: console lines, TensorBoard (scalars, attention maps, text), metrics.jsonl; memory
    monitor.py      Weights & Biases (WandbRun), the time left (Eta), the `deepspeed:` readback, missing extras
    live_model.py   the live model as one piece, for attention maps, text samples and downstream scores
    downstream.py   lm-evaluation-harness tasks on a model in memory (LiveLM, score): the trainer's live scores,
                    and the core of evaluation/lm_eval_adapter.py's `synthformer` model
    device_peaks.py each device's peak TFLOP/s: the MFU denominator
    step_times.py   StepTimes: a step's laps (data wait, forward + backward, optimizer; a pipeline's train_batch),
                    timed by the wall clock on CPU and by CUDA events read one step late on a GPU; perf/*_s
    profiler.py     ProfileWindows: logging.profile's torch.profiler windows, and CUDA memory snapshots

The trainer makes one StepTimes and one ProfileWindows and calls them from its loop (pretrain/train.py);
docs/monitoring.md says how to read what they write.
"""
from pretrain.observe.profiler import ProfileWindows
from pretrain.observe.step_times import StepTimes

__all__ = ["ProfileWindows", "StepTimes"]
