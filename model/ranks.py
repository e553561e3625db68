"""Where this rank sits in the tensor-parallel and context-parallel groups: megatron-core's parallel_state where a
layout with TP, CP or PP initialised it, else TP = CP = 1. Looked up, never imported: a data-parallel launch does not import megatron-core at all.
"""
from __future__ import annotations

import sys

import torch.distributed as dist


def mcore():
    """megatron.core, imported on first use (only under a process group). The import sits in a try block because
    transformers' remote-code loader skips those when it checks that every imported package is installed: a Hugging
    Face export (model/hf.py) ships this file and must load without megatron-core."""
    try:
        import megatron.core
    except ImportError as e:
        raise ImportError(f"tensor parallelism needs megatron-core (pip install -r requirements.txt): {e}") from e
    return megatron.core


def under_process_group() -> bool:
    return dist.is_available() and dist.is_initialized()


def parallel_state():
    """megatron-core's parallel_state if a layout with TP, CP or PP initialised it, else None (TP = CP = 1)."""
    state = sys.modules.get("megatron.core.parallel_state") if under_process_group() else None
    return state if state is not None and state.model_parallel_is_initialized() else None


def tp_world() -> int:
    ps = parallel_state()
    return ps.get_tensor_model_parallel_world_size() if ps else 1


def tp_rank() -> int:
    ps = parallel_state()
    return ps.get_tensor_model_parallel_rank() if ps else 0


def tp_group():
    ps = parallel_state()
    return ps.get_tensor_model_parallel_group() if ps else None


def cp_world() -> int:
    """Ranks that split one sequence (parallel.cp; model/context.py)."""
    ps = parallel_state()
    return ps.get_context_parallel_world_size() if ps else 1


def cp_rank() -> int:
    ps = parallel_state()
    return ps.get_context_parallel_rank() if ps else 0


def cp_group():
    ps = parallel_state()
    return ps.get_context_parallel_group() if ps else None
