#!/usr/bin/env python
"""Convert Synthformer checkpoints: DeepSpeed training checkpoints ↔ release directories ↔ Hugging Face.

    python tools/convert.py to-release   CHECKPOINT OUT [--dtype fp32|bf16]
        a DeepSpeed checkpoint of any (TP, PP, DP, ZeRO stage) → a release directory (full tensors, canonical names,
        model.safetensors + config.json + tokenizer.model + train_config.yaml). CHECKPOINT: a run directory, its
        checkpoints/ directory (the newest, from `latest`) or one step_* directory; also in a bucket
        (s3://bucket/prefix[/step_*], downloaded first; credentials from the backend's own settings, e.g. AWS_*).
    python tools/convert.py to-deepspeed RELEASE OUT [section.key=value ...] --tp T --pp P [--config YAML]
        a release → a DeepSpeed checkpoint in layout (T, P, DP=1) under OUT, resumable by a run with
        `checkpoint.dir=OUT` and the same layout (fresh optimizer state; the LR schedule and data position follow the
        release's step). To start a run in *any* layout (also DP > 1) from a release, use `train.init_from=RELEASE`.
    python tools/convert.py to-universal CHECKPOINT [OUT]
        a DeepSpeed checkpoint of any (TP, PP, DP, ZeRO stage) → a universal checkpoint (DeepSpeed's format: full fp32
        weights and both AdamW moments per parameter) in the checkpoint directory OUT (default: CHECKPOINT's own). A
        run with checkpoint.dir=OUT resumes from it in any layout with ZeRO-1/2, optimizer state included:
        stop the run, convert, relaunch with the new parallel.* settings. launch/pretrain.sh does the conversion
        itself with checkpoint.relayout=true. From a bucket, OUT defaults to the bucket's checkpoint directory.
    python tools/convert.py to-hf        RELEASE OUT      a release → a Hugging Face directory (trust_remote_code)
    python tools/convert.py from-hf      HF_DIR OUT       a Hugging Face export → a release
    python tools/convert.py extend-length SOURCE OUT --to N
        a release or a DeepSpeed checkpoint of max_seq_len ℓ → a release of max_seq_len N > ℓ, every position-indexed
        weight resampled (model/extend.py; the rule per weight: docs/DESIGN.md §1). Continue training it with
        `train.init_from=OUT model.max_seq_len=N`: fresh optimizer state, the LR schedule and data position carry on.

Errors are one line (exit 2): a path that is not a checkpoint, a layout that does not divide the model, weights that do
not match their config.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

from tqdm import tqdm

from model import ConfigError
from model import release
from tokendata.remote import DataError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # where to_deepspeed's ranks run


def to_release(args) -> str:
    from pretrain.checkpoints import bucket, ds_checkpoint

    tag_dir = ds_checkpoint.resolve(bucket.local_checkpoint(args.checkpoint, args.staging))
    print(f"reading {tag_dir}")
    cfg, tensors = ds_checkpoint.read_weights(tag_dir, progress=lambda r: tqdm(r, desc="model-parallel ranks",
                                                                                 disable=args.quiet))
    step = ds_checkpoint.step_of(tag_dir)
    training = {"step": step, "tokens": cfg.tokens_before(step), "source": os.path.abspath(tag_dir),
                "layout": {"tp": cfg.parallel.tp, "pp": cfg.parallel.pp, "zero_stage": cfg.parallel.zero_stage}}
    release.save_release(args.out, cfg.model, tensors, dtype={"fp32": "float32", "bf16": "bfloat16"}[args.dtype],
                         tokenizer=release.find_tokenizer(tag_dir),
                         train_config=os.path.join(tag_dir, "config.yaml"), training=training)
    n = sum(t.numel() for t in tensors.values())
    return f"wrote release {args.out}: {len(tensors)} tensors, {n / 1e6:.2f}M parameters, step {step}, {args.dtype}"


def to_universal(args) -> str:
    from pretrain.checkpoints import bucket, ds_checkpoint, universal

    tag_dir = ds_checkpoint.resolve(bucket.local_checkpoint(args.checkpoint, args.staging))
    in_bucket = bucket.is_bucket(args.checkpoint)   # a tag, or a checkpoint directory, in a bucket
    out = args.out or (bucket.directory_of(args.checkpoint) if in_bucket else os.path.dirname(os.path.normpath(tag_dir)))
    print(f"reading {args.checkpoint if in_bucket else tag_dir}")
    path = universal.convert(tag_dir, args.staging if bucket.is_bucket(out) else out)
    path = bucket.publish_universal(path, out) if bucket.is_bucket(out) else path
    cfg = ds_checkpoint.read_config(tag_dir)
    return f"wrote universal checkpoint {path} (from tp={cfg.parallel.tp}, pp={cfg.parallel.pp}, " \
           f"ZeRO-{cfg.parallel.zero_stage}); resume it in any layout with checkpoint.dir={out}"


def training_config(args):
    """The training config of the target layout: the release's own (or --config), with the layout and init_from."""
    from pretrain.config import load_config

    path = args.config or os.path.join(args.release, "train_config.yaml")
    if not os.path.isfile(path):
        raise ConfigError(f"{args.release} has no train_config.yaml (a Hugging Face import?): pass --config YAML "
                          f"with the training settings to use")
    overrides = [f"parallel.tp={args.tp}", f"parallel.pp={args.pp}", f"train.init_from={args.release}",
                 f"checkpoint.dir={args.out}", "checkpoint.resume=none", *args.overrides]
    return load_config(path, overrides)


def to_deepspeed(args) -> str:
    args.release, args.out = os.path.abspath(args.release), os.path.abspath(args.out)   # workers run in ROOT
    args.config = args.config and os.path.abspath(args.config)
    release.read_release(args.release)                      # one-line errors before any process starts
    cfg = training_config(args)
    world = args.tp * args.pp
    cfg.check_runtime(world, cuda=False)
    from pretrain.distributed import free_local_port

    port = str(free_local_port())
    worker_args = [args.release, args.out, *args.overrides, f"--tp={args.tp}", f"--pp={args.pp}",
                   *([f"--config={args.config}"] if args.config else [])]   # positionals first: argparse
    procs = []
    for rank in range(world):                               # conversion needs no GPU: gloo processes on this host
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
               "LOCAL_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "DS_ACCELERATOR": "cpu"}
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "_rank", *worker_args],
                                      cwd=ROOT, env=env))
    codes = [p.wait() for p in procs]
    if any(codes):
        raise ConfigError(f"writing the DeepSpeed checkpoint failed (exit codes {codes}); see the messages above")
    return f"wrote DeepSpeed checkpoint (tp={args.tp}, pp={args.pp}) under {args.out}; continue training with " \
           f"checkpoint.dir={args.out} parallel.tp={args.tp} parallel.pp={args.pp}"


def rank_main(args) -> None:
    """One process of to-deepspeed: build the engine in the target layout from the release, save it."""
    from pretrain import distributed
    from pretrain.checkpoints.checkpointer import Checkpointer
    from pretrain.engine import build_engine

    cfg = training_config(args)
    lay = distributed.init(cfg)
    try:
        engine = build_engine(cfg, lay)
        step = release.read_meta(args.release).get("training", {}).get("step", 0)
        tokenizer = release.find_tokenizer(args.release)
        Checkpointer(engine, args.out, 10**9, {}, cfg.to_dict(), tokenizer, lay.rank, lay.world).save(step)
    finally:
        distributed.shutdown()


def to_hf(args) -> str:
    from model.hf import release_to_hf

    release_to_hf(args.release, args.out)
    return f"wrote Hugging Face directory {args.out} (load with trust_remote_code=True)"


def from_hf(args) -> str:
    from model.hf import hf_to_release

    hf_to_release(args.hf_dir, args.out)
    return f"wrote release {args.out}"


def read_any(source: str):
    """(model config, full tensors, training record, tokenizer, train_config.yaml path or None) of a release or of a
    DeepSpeed checkpoint (a run directory, its checkpoints/ directory or a step_* directory)."""
    if release.is_release(source):
        cfg, tensors, meta = release.read_release(source)
        return cfg, tensors, meta.get("training", {}), release.find_tokenizer(source), \
            os.path.join(source, "train_config.yaml")
    from pretrain.checkpoints import ds_checkpoint

    tag_dir = ds_checkpoint.resolve(source)
    print(f"reading {tag_dir}")
    cfg, tensors = ds_checkpoint.read_weights(tag_dir)
    step = ds_checkpoint.step_of(tag_dir)
    training = {"step": step, "tokens": cfg.tokens_before(step), "source": os.path.abspath(tag_dir)}
    return cfg.model, tensors, training, release.find_tokenizer(tag_dir), os.path.join(tag_dir, "config.yaml")


def extend_length(args) -> str:
    import tempfile

    import yaml

    from model.extend import extend_length as extend

    cfg, tensors, training, tokenizer, train_config = read_any(args.source)
    ell = cfg.max_seq_len
    new, out = extend(cfg, tensors, args.to)
    changed = [name for name in tensors if out[name].shape != tensors[name].shape]
    sizes = {"max_seq_len": new.max_seq_len, **({"factorized_a": new.factorized_a, "factorized_b": new.factorized_b}
                                                  if cfg.factorized_a != new.factorized_a else {})}
    with tempfile.TemporaryDirectory() as tmp:
        if train_config and os.path.isfile(train_config):   # its model section at the new length: to-deepspeed reads it
            with open(train_config) as f:
                settings = yaml.safe_load(f) or {}
            settings.setdefault("model", {}).update(sizes)
            train_config = os.path.join(tmp, "train_config.yaml")
            with open(train_config, "w") as f:
                yaml.safe_dump(settings, f, sort_keys=False)
        release.save_release(args.out, new, out, tokenizer=tokenizer, train_config=train_config,
                             training=dict(training, extended={"from": ell, "to": new.max_seq_len}))
    keys = " ".join(f"model.{k}={v}" for k, v in sizes.items())
    return (f"wrote release {args.out}: max_seq_len {ell} → {new.max_seq_len}, {len(changed)} position-indexed tensors "
            f"resampled; continue training with train.init_from={args.out} {keys} (fresh optimizer state; the LR "
            f"schedule and data position carry on from step {training.get('step', 0)})")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # the metavar lists the commands a user runs: `_rank` (to-deepspeed's per-rank worker) stays out of --help
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    r = sub.add_parser("to-release", help="DeepSpeed checkpoint (any TP/PP/DP/ZeRO) → release directory")
    r.add_argument("checkpoint", help="run directory, its checkpoints/ directory, or a step_* directory")
    r.add_argument("out", help="release directory to write")
    r.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="dtype of the saved tensors")
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    u = sub.add_parser("to-universal", help="DeepSpeed checkpoint → universal checkpoint (resumable in any layout, "
                                            "with the optimizer state)")
    u.add_argument("checkpoint", help="run directory, its checkpoints/ directory, or a step_* directory")
    u.add_argument("out", nargs="?", help="checkpoint directory to write it in (default: the checkpoint's own)")
    for name in ("to-deepspeed", "_rank"):
        d = sub.add_parser(name, **({"help": "release → DeepSpeed checkpoint at (TP, PP)"} if name[0] != "_" else {}))
        d.add_argument("release", help="release directory")
        d.add_argument("out", help="checkpoint directory to write (use it as checkpoint.dir)")
        d.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the target layout")
        d.add_argument("--pp", type=int, default=1, help="pipeline-parallel size of the target layout")
        d.add_argument("--config", help="training config YAML (default: the release's train_config.yaml)")
        d.add_argument("overrides", nargs="*", help="config overrides section.key=value")
    h = sub.add_parser("to-hf", help="release → Hugging Face directory (AutoModelForCausalLM, trust_remote_code)")
    h.add_argument("release", help="release directory")
    h.add_argument("out", help="Hugging Face directory to write")
    f = sub.add_parser("from-hf", help="Hugging Face export → release directory")
    f.add_argument("hf_dir", help="Hugging Face directory written by to-hf")
    f.add_argument("out", help="release directory to write")
    e = sub.add_parser("extend-length", help="release or DeepSpeed checkpoint → release of a larger max_seq_len, "
                                             "position-indexed weights resampled")
    e.add_argument("source", help="release directory, or a run directory, its checkpoints/ or a step_* directory")
    e.add_argument("out", help="release directory to write")
    e.add_argument("--to", type=int, required=True, metavar="N", help="the new max_seq_len (larger than the model's)")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    run = {"to-release": to_release, "to-universal": to_universal, "to-deepspeed": to_deepspeed, "to-hf": to_hf,
           "from-hf": from_hf, "extend-length": extend_length, "_rank": rank_main}[args.command]
    try:
        with tempfile.TemporaryDirectory(prefix="synthformer-convert-") as args.staging:   # a checkpoint in a bucket
            message = run(args)                                                           # is downloaded here
        if message:
            print(message)
    except (ConfigError, FileNotFoundError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
