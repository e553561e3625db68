"""Run a function on N real torch.distributed processes (gloo, this machine) and collect what each returns. The
processes are forked from the warm process of tests/support/warm_ranks.py (torch, DeepSpeed and the project imported once),
not spawned fresh; each unpickles the function by name and takes the caller's environment as it is now (a forked
process would otherwise keep the forkserver's, from when it started), as a spawned one would."""
from __future__ import annotations

import os
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pretrain.distributed import free_local_port
from tests.support import warm_ranks


def _entry(rank, world, port, out_dir, env, fn, args):
    os.environ.clear()
    os.environ.update(env)   # the caller's (a test's monkeypatch.setenv("SYNTHFORMER_KERNELS", "gpu") included)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)   # N processes share 2 cores
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        torch.save({"ok": result}, os.path.join(out_dir, f"{rank}.pt"))
    except BaseException:
        torch.save({"error": traceback.format_exc()}, os.path.join(out_dir, f"{rank}.pt"))
        raise
    finally:
        dist.destroy_process_group()


def run_distributed(fn, world: int, *args):
    """fn(rank, world, *args) on `world` gloo processes; returns the list of per-rank results."""
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            warm_ranks.context()   # the forkserver, its preload set before it starts
            mp.start_processes(_entry, args=(world, free_local_port(), out_dir, dict(os.environ), fn, args),
                               nprocs=world, start_method="forkserver")
        except mp.ProcessRaisedException:
            pass   # reported below with the rank's traceback
        results = []
        for r in range(world):
            path = os.path.join(out_dir, f"{r}.pt")
            res = torch.load(path, weights_only=False) if os.path.exists(path) else {"error": "no result"}
            if "error" in res:
                raise AssertionError(f"rank {r} failed:\n{res['error']}")
            results.append(res["ok"])
        return results
