#!/usr/bin/env python
"""Checkpoints in a bucket, measured: one save of a real DeepSpeed engine of synth-125m's widths (configs/synth-125m.yaml
at n 256, micro-batch 1, 1 rank) to a local S3-protocol server (moto's, on 127.0.0.1), through the trainer's own path
(pretrain/checkpoints/bucket.py: write to the staging directory, upload, commit), and its download for a resume.

    PYTHONPATH=. python benchmarks/bench_bucket.py [--zero-stage 1] [--precision bf16] [--json]

Prints the bytes of the checkpoint, the local write, the upload and commit, and the download (seconds and MB/s). The
server is on this machine: the figures measure the client's work and the local disk, not a network; on a cluster
the upload is bounded by the link to the store instead.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--zero-stage", type=int, default=1, help="parallel.zero_stage of the engine (default 1)")
    p.add_argument("--precision", default="bf16", help="train.precision (default bf16, the config's)")
    p.add_argument("--steps", type=int, default=1, help="optimizer steps before the save (default 1: AdamW's moments "
                   "exist, as in any checkpoint of a run; 0: model states and an empty optimizer)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from benchmarks.bench_lib import local_s3, one_rank_125m
    from pretrain import distributed
    from pretrain.checkpoints.bucket import Bucket, Saves
    from pretrain.checkpoints.checkpointer import Checkpointer
    from pretrain.engine import build_engine

    server, where = local_s3()
    try:
        with tempfile.TemporaryDirectory(prefix="bench-bucket-") as tmp:
            Bucket("s3://bench").fs.mkdir("bench")
            cfg, lay = one_rank_125m(f"{tmp}/run", [f"parallel.zero_stage={args.zero_stage}",
                                                    f"train.precision={args.precision}", "checkpoint.dir=s3://bench/run"])
            engine = build_engine(cfg, lay)
            n_params = sum(p.numel() for p in engine.module.parameters())
            for _ in range(args.steps):   # AdamW's moments exist after a step, as in any checkpoint of a run
                tokens = torch.randint(cfg.model.vocab_size, (1, 257), device=lay.device)
                loss = engine(tokens[:, :-1], tokens[:, 1:])
                engine.backward(loss)
                engine.step()
            saves = Saves(cfg.checkpoint.dir, cfg.checkpoint.staging_dir, lay)
            timed = {}

            def publish(*a, **kw):   # the upload and commit, timed apart from the local write
                t = time.perf_counter()
                ok = Saves.publish(saves, *a, **kw)
                timed["upload_s"] = time.perf_counter() - t
                return ok
            saves.publish = publish
            checkpointer = Checkpointer(engine, cfg.checkpoint.staging_dir, 3, {}, cfg.to_dict(), None, 0, 1,
                                        bucket=saves)
            print(f"synth-125m widths at n 256: {n_params / 1e6:.1f}M parameters, ZeRO-{args.zero_stage}, "
                  f"{args.precision}; saving to {cfg.checkpoint.dir} (moto on {where})", file=sys.stderr)
            t = time.perf_counter()
            assert checkpointer.save(1), "the upload failed"
            save_s = time.perf_counter() - t
            files = saves.store.files()["step_00000001"]
            nbytes = sum(files.values())
            t = time.perf_counter()
            saves.store.download("step_00000001", os.path.join(tmp, "download"))
            download_s = time.perf_counter() - t
        mb = nbytes / 1e6
        result = {"parameters": n_params, "files": len(files), "bytes": nbytes,
                  "write_s": round(save_s - timed["upload_s"], 2), "upload_s": round(timed["upload_s"], 2),
                  "upload_MB_s": round(mb / timed["upload_s"], 1), "download_s": round(download_s, 2),
                  "download_MB_s": round(mb / download_s, 1)}
        if args.json:
            print(json.dumps(result))
        else:
            print(f"{result['files']} files, {mb:.0f} MB: local write {result['write_s']} s, upload + commit "
                  f"{result['upload_s']} s ({result['upload_MB_s']} MB/s), download {result['download_s']} s "
                  f"({result['download_MB_s']} MB/s)")
    finally:
        distributed.shutdown()
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
