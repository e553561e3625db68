"""The training system, in floors (tests/unit/test_structure.py PRETRAIN_FLOORS); each imports only the floors below it:

    5  train.py          the trainer: builds everything in one place and runs the loop
    4  engine.py         the DeepSpeed engine, built (only the trainer imports it)
       supervision/      failure classes, the supervisor and relaunches, the hang watchdog, rank logs
       prelaunch.py      the checks before a launch (`python -m pretrain.config`: memory, time plan, resume)
    3  data.py           the rank's TokenStream and loader
       step_guard.py     which optimizer steps to skip (non-finite, spikes) and GuardedAdamW
       checkpoints/      atomic saves, resume, reading any layout, universal checkpoints
    2  distributed.py    process groups, the MPU adapter, the trainer's collectives
       float8.py         FP8 linears (train.fp8)
       plan/             before a launch: the memory plan, its verdict, the time model
       observe/          reporting: TensorBoard and metrics.jsonl, W&B and the ETA, step times, profiler windows,
                         the live model's samples and downstream scores, device peaks (MFU)
    1  config/           typed sections, YAML and overrides, the `deepspeed:` pass-through, the DeepSpeed dict
    0  timeouts.py       the one collective timeout of every process group
       faults.py         test hooks that fail a run on purpose
       pipeline.py       the model as DeepSpeed pipeline stages

The data it trains on comes from tokendata/; it imports nothing above itself."""
import warnings

# megatron-core announces at import that optional CUDA extensions are missing; they are not used here.
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
warnings.filterwarnings("ignore", message=".*CUDA_DEVICE_MAX_CONNECTIONS.*")
warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.* is deprecated.*")
warnings.filterwarnings("ignore", message=".*reduce_scatter_tensor.* is deprecated.*")
