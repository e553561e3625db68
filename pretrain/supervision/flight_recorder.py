"""PyTorch's flight recorder: a ring buffer, per rank, of the last collectives each process group enqueued (operation,
sizes, sequence number, state, Python stack), kept by torch.distributed itself (NCCL; gloo too since torch 2.8).

launch/pretrain.sh turns it on (TORCH_FR_BUFFER_SIZE) and `enable` does where it did not (torch < 2.7 reads the older
names, TORCH_NCCL_TRACE_BUFFER_SIZE and TORCH_NCCL_DEBUG_INFO_TEMP_FILE), and points NCCL's own dump-on-timeout at
the run (TORCH_FR_DUMP_TEMP_FILE, TORCH_NCCL_DUMP_ON_TIMEOUT). The hang
watchdog asks for a dump before it ends a rank (`dump`). Every rank's file lands in <run_dir>/hang/flight_recorder/,
named rank_<k>, which is the layout torch's analyser reads:

    python -m torch.distributed.flight_recorder.fr_trace RUN_DIR/hang/flight_recorder --prefix rank_
"""
from __future__ import annotations

import os
import pickle
import sys

BUFFER = 2000          # entries kept per rank (torch's own default is 0: off)
FOLDER, PREFIX = os.path.join("hang", "flight_recorder"), "rank_"


def folder(run_dir: str) -> str:
    return os.path.join(run_dir, FOLDER)


def enable(run_dir: str) -> None:
    """Before the first process group: on, unless the environment says otherwise, with NCCL's own dumps (on a
    collective's timeout) written where the watchdog writes its own; that folder made now, before any timeout."""
    import torch

    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(BUFFER))
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", os.path.join(folder(run_dir), PREFIX))
    if tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 7):   # the older names (a warning in newer)
        os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", os.environ["TORCH_FR_BUFFER_SIZE"])
        os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", os.environ["TORCH_FR_DUMP_TEMP_FILE"])
    for name in ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):   # torch's writer makes no folder:
        if os.environ.get(name):                                                  # without one, a timeout's dump
            try:                                                                  # is only a logged failure
                os.makedirs(os.path.dirname(os.environ[name]) or ".", exist_ok=True)
            except OSError as e:
                print(f"warning: no folder for the flight recorder's dumps ({name}): {e}", file=sys.stderr)


def dump(run_dir: str, rank: int) -> str | None:
    """Write this rank's flight recorder to <run_dir>/hang/flight_recorder/rank_<rank> (torch's pickle format);
    its path, or None without process groups or where this torch has no recorder. NCCL's dump (its communicators' state included) where the
    rank uses NCCL, else the backend-neutral one."""
    import torch.distributed as dist
    from torch._C import _distributed_c10d as c10d

    if not dist.is_initialized():
        return None
    nccl = dist.get_backend() == "nccl"   # NCCL and gloo keep a recorder each
    dumper = getattr(c10d, "_dump_nccl_trace" if nccl else "_dump_fr_trace", None)
    if dumper is None:
        return None
    # each entry's Python stack is symbolized by torch._inductor's code, an import of tens of seconds where nothing has
    # made it yet: then the entries go without it (every thread's stack is in hang/rank<k>.txt anyway)
    data = with_groups(dumper(True, "torch._inductor" in sys.modules, False), rank)
    target = os.path.join(folder(run_dir), f"{PREFIX}{rank}")
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with open(target + ".tmp", "wb") as f:
        f.write(data)
    os.replace(target + ".tmp", target)
    return target


def with_groups(data: bytes, rank: int) -> bytes:
    """The dump with its table of process groups (name, description, ranks), which torch's analyser matches the
    entries by: gloo's recorder leaves it empty (torch 2.13), so it is filled from torch's registry of groups."""
    from torch.distributed import distributed_c10d as c10d

    dump = pickle.loads(data)
    if any(name and g.get("name") for name, g in dump.get("pg_config", {}).items()):   # NCCL's has it
        return data
    dump["pg_config"] = {g.group_name: {"name": g.group_name, "desc": getattr(g, "group_desc", "") or "undefined",
                                        "ranks": str(sorted(c10d._world.pg_group_ranks.get(g, {})))}
                         for g in c10d._world.pg_map}
    dump.setdefault("rank", rank)
    return pickle.dumps(dump)
