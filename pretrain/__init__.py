"""The training system: config, data, engine, checkpoints, logging, and the loop (pretrain/train.py)."""
import warnings

# megatron-core announces at import that optional CUDA extensions are missing; they are not used here.
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
warnings.filterwarnings("ignore", message=".*CUDA_DEVICE_MAX_CONNECTIONS.*")
warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.* is deprecated.*")
warnings.filterwarnings("ignore", message=".*reduce_scatter_tensor.* is deprecated.*")
