"""The training system: config (config/), the checks before a launch (prelaunch.py), process groups
(distributed.py), the engine (engine.py, pipeline.py, health.py), checkpoints (checkpoints/), logging (metrics.py)
and the loop (train.py). The data it trains on comes from tokendata/; it imports nothing above itself."""
import warnings

# megatron-core announces at import that optional CUDA extensions are missing; they are not used here.
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
warnings.filterwarnings("ignore", message=".*CUDA_DEVICE_MAX_CONNECTIONS.*")
warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.* is deprecated.*")
warnings.filterwarnings("ignore", message=".*reduce_scatter_tensor.* is deprecated.*")
