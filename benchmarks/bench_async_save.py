#!/usr/bin/env python
"""The stall of a checkpoint save, sync against async (checkpoint.async_save), on a real DeepSpeed engine of
synth-125m's widths (configs/synth-125m.yaml at n 256, fp32, micro-batch 1, 1 rank: the writer's thread competes with no
second rank for the cores), a save every 3 steps, through the trainer's own Checkpointer.

    PYTHONPATH=. python benchmarks/bench_async_save.py [--saves 5] [--every 3] [--bucket] [--json]

The stall of a save is the time the training loop spends in checkpoint code from the save call until its checkpoint
is committed: sync, the save call itself; async, the call (the host snapshot) plus the commit at the step that makes
it (and each step's poll before). Both modes run in one process on one engine, alternately save by save, so that the
machine's load falls on both alike. Reported: median and spread (min–max) of each, async ÷
sync (goal ≤ 0.10), and the step times while a background write runs beside the others (on 2 CPU cores the writer
takes a core from the step: that measures the machine, it is no goal).

--bucket: both modes save to a local S3-protocol server (moto's, on 127.0.0.1) through checkpoint.dir's bucket path
(write to a staging directory, upload, commit once uploaded): sync uploads in the save call, async in the writer
thread. Also reported: the bytes of a checkpoint, and per async save the seconds from the save call until it is
committed (write and upload in the background) and the steps run meanwhile. The server is on this machine: the
upload measures the client's work, not a network.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--saves", type=int, default=5, help="saves of each mode (default 5)")
    p.add_argument("--every", type=int, default=3, help="steps between saves (default 3)")
    p.add_argument("--bucket", action="store_true", help="save to a local S3 server (moto) instead of a directory")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p.parse_args(argv)


def spread(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3), "max": round(max(values), 3)}


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from benchmarks.bench_lib import local_s3, one_rank_125m
    from pretrain import distributed
    from pretrain.checkpoints.bucket import Bucket, Saves
    from pretrain.checkpoints.checkpointer import Checkpointer
    from pretrain.engine import build_engine

    server = local_s3()[0] if args.bucket else None
    try:
        with tempfile.TemporaryDirectory(prefix="bench-async-") as tmp:
            # fp32: a CPU without bf16 instructions emulates bf16 GEMMs (~90 s a step here against ~2 s), and the
            # steps beside a background write are what the stall is measured against
            cfg, lay = one_rank_125m(f"{tmp}/run", ["parallel.zero_stage=1", "train.precision=fp32"])
            engine = build_engine(cfg, lay)

            def step() -> float:
                t = time.perf_counter()
                tokens = torch.randint(cfg.model.vocab_size, (1, 257), device=lay.device)
                engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
                engine.step()
                return time.perf_counter() - t

            if args.bucket:
                Bucket("s3://bench").fs.mkdir("bench")

            def bucket(mode):   # checkpoint.dir: s3://bench/<mode>, staged in the mode's directory
                return Saves(f"s3://bench/{mode}", os.path.join(tmp, mode), lay) if args.bucket else None
            savers = {mode: Checkpointer(engine, os.path.join(tmp, mode), 2, {}, cfg.to_dict(), None, 0, 1,
                                         async_save=mode == "async", bucket=bucket(mode)) for mode in ("sync", "async")}
            background = []   # async: (seconds from the save call to the commit, steps run meanwhile)
            print(f"synth-125m widths at n 256, {sum(p.numel() for p in engine.module.parameters()) / 1e6:.1f}M "
                  f"parameters, {args.saves} saves of each mode, one every {args.every} steps", file=sys.stderr)
            plain, calls, beside = [], {"sync": [], "async": []}, []
            stalls = {"sync": [], "async": []}
            n = 0
            for k in range(2 * args.saves):
                mode = ("sync", "async")[k % 2]
                saver = savers[mode]
                for _ in range(args.every):
                    plain.append(step())
                n += args.every
                t = called = time.perf_counter()
                saver.save(n)
                call = time.perf_counter() - t
                calls[mode].append(call)
                extra = []   # async: the steps until the commit, and the commit
                while mode == "async" and saver.background.pending is not None:
                    s = step()
                    n += 1
                    beside.append(s)
                    t = time.perf_counter()
                    saver.written([float(f) for f in saver.writer_flags()])
                    extra.append((s, time.perf_counter() - t))
                stalls[mode].append(call + sum(c for _, c in extra))
                if mode == "async":
                    background.append((time.perf_counter() - called, len(extra)))
                print(f"  save {k // 2 + 1} {mode}: stall {stalls[mode][-1]:.2f} s (call {call:.2f} s, "
                      f"{len(extra)} steps beside a write)", file=sys.stderr)
            if args.bucket:   # the newest checkpoint committed in the sync bucket, at its recorded sizes
                listing = savers["sync"].bucket.store.files()
                checkpoint_bytes = sum(listing[max(t for t in listing if t.startswith("step_"))].values())
        result = {"step_s": spread(plain), "stall_sync_s": spread(stalls["sync"]),
                  "stall_async_s": spread(stalls["async"]), "snapshot_s": spread(calls["async"]),
                  "step_beside_write_s": spread(beside) if beside else None,
                  "async_over_sync": round(statistics.median(stalls["async"]) / statistics.median(stalls["sync"]), 3)}
        if args.bucket:
            result["bucket"] = {"bytes": checkpoint_bytes, "async_save_to_commit_s": spread([b for b, _ in background]),
                                "steps_before_commit": spread([float(n) for _, n in background])}
        if args.json:
            print(json.dumps(result))
        else:
            print(f"step {result['step_s']} s; stall per save: sync {result['stall_sync_s']} s, async "
                  f"{result['stall_async_s']} s (snapshot {result['snapshot_s']} s); async ÷ sync "
                  f"{result['async_over_sync']} (goal ≤ 0.10); a step beside a background write "
                  f"{result['step_beside_write_s']} s")
            if args.bucket:
                print(f"to a local S3 server: {result['bucket']['bytes'] / 1e6:.0f} MB a checkpoint; async, save "
                      f"call to commit {result['bucket']['async_save_to_commit_s']} s over "
                      f"{result['bucket']['steps_before_commit']} steps")
    finally:
        distributed.shutdown()
        if server is not None:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
