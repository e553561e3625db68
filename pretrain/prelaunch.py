"""What a launch checks before any process starts: the config against the world size, the shards against the model,
and the checkpoint it would resume against the run. launch/pretrain.sh runs these checks once
(`python -m pretrain.config CONFIG … --world-size N`, this module's `main`), so that a mistake is one line at once,
not one per rank after DeepSpeed started; the trainer runs them again on every rank before its process group, for
launches without the script.

    python -m pretrain.config configs/demo-cpu.yaml train.lr=1e-3 [--print] [--deepspeed] [--world-size 2]
    python -m pretrain.config configs/synth-1.3b.yaml --world-size 64 --memory [--gpu-memory 80GiB]
    python -m pretrain.config configs/synth-1.3b.yaml --world-size 64 --plan [--cluster h100]
    python -m pretrain.config --keys [SECTION] [--markdown]      every key: type, default, description
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import yaml

from model import ConfigError
from pretrain.checkpoints import bucket, universal
from pretrain.checkpoints.resume import architecture_problem, data_problem, layout_problem
from pretrain.config import Runtime, TrainConfig, load_config, reference
from pretrain.config.deepspeed_dict import deepspeed_config
from pretrain.data import stage_lines
from pretrain.config.batch_ramp import ramp_lines
from pretrain.plan.memory import parse_size, report
from pretrain.observe.monitor import requirements
from pretrain.plan import load_cluster, run_prediction, search
from tokendata import remote
from tokendata.lengths import fit
from tokendata.shards import check_vocab

# The exit status of the check when the data's server is out: the failure class `transient` of the ranks
# (pretrain/supervision/classes.py, a floor above this module; tests/unit/test_fetch_outage.py holds them equal), which
# launch/pretrain.sh retries after a wait and launch/slurm.sbatch requeues. Any other failed check exits 2.
TRANSIENT_EXIT = 6
from tokendata.sources import as_sources, open_sources


def check_launch(cfg: TrainConfig, world_size: int, relayout: bool = False) -> Runtime:
    """Runtime of the launch, with the sources it read (the trainer reads no manifest again) and the vocabulary's
    note; a ConfigError or DataError (one line naming key, file and fix) for what cannot run.
    `relayout`: this is the one process before the launch (launch/pretrain.sh), which converts a checkpoint of
    another layout to a universal one when the config sets checkpoint.relayout."""
    runtime = cfg.check_runtime(world_size)
    requirements(cfg)   # logging.wandb, logging.eval_tasks: their optional packages installed
    remote.configure(cfg.data.ca_bundle, cfg.data.http_headers_from_env,   # of every HTTP(S) request from here on
                     cfg.data.headers_over_http)
    sources = open_sources(as_sources(cfg.data.source_list()))   # every source's manifest, once, checked together
    notes = [check_vocab(source.manifest, cfg.model.vocab_size) for source in sources]
    for source in sources:
        fit(source.manifest, cfg.model.max_seq_len)   # the model's length from the shards' (cut or joined)
        check_eos(source.manifest, cfg.model)
    runtime = runtime._replace(sources=tuple(sources), vocab_note=next((n for n in notes if n), None))
    resume = bucket.resume_from(cfg.checkpoint, cfg.to_dict(), world_size)   # in a bucket: downloaded to staging
    if resume is None:
        return runtime
    problem = architecture_problem(resume, cfg.to_dict())
    if not problem and layout_problem(resume, cfg.to_dict(), world_size) and cfg.checkpoint.relayout and relayout \
            and cfg.checkpoint.resume == "auto" and os.environ.get("NODE_RANK", "0") == "0":
        print(f"checkpoint.relayout: converting {resume} to a universal checkpoint in {cfg.checkpoint.dir} "
              f"(weights and optimizer state, for any layout)", file=sys.stderr, flush=True)
        in_bucket = bucket.is_bucket(cfg.checkpoint.dir)
        resume = universal.convert(resume, cfg.checkpoint.staging_dir if in_bucket else cfg.checkpoint.dir)
        print(f"wrote {bucket.publish_universal(resume, cfg.checkpoint.dir) if in_bucket else resume}; the ranks "
              f"resume from it", file=sys.stderr, flush=True)
    problem = problem or layout_problem(resume, cfg.to_dict(), world_size) or data_problem(resume, runtime.dp)
    if problem:
        raise ConfigError(problem)
    return runtime


def check_eos(manifest: dict, model) -> None:
    """Under model.document_mask the model ends documents at model.eos_id: the shards' eos, or a ConfigError."""
    eos = manifest.get("eos_id")
    if model.document_mask and eos != model.eos_id:
        raise ConfigError(f"model.document_mask ends documents at model.eos_id={model.eos_id}, but the shards in "
                          f"{manifest['shard_dir']} end them with eos_id={eos} (their manifest.json): "
                          f"set model.eos_id={eos}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pretrain.config",
                                description="Load, validate and print a training config.")
    p.add_argument("config", nargs="?", help="YAML file, e.g. configs/demo-cpu.yaml")
    p.add_argument("overrides", nargs="*", help="section.key=value, value parsed as YAML (train.lr=3e-4 "
                                                "model.mixer=[random,dot])")
    p.add_argument("--print", action="store_true", help="print the resolved config as YAML (the default output)")
    p.add_argument("--deepspeed", action="store_true", help="print the generated DeepSpeed config (JSON)")
    p.add_argument("--world-size", type=int, default=None, help="check a launch of this many ranks: the config, "
                                                                "the shards, a checkpoint it would resume (with "
                                                                "--deepspeed: the config only; default 1)")
    p.add_argument("--run-dir", action="store_true", help="print only the run's directory (train.run_dir), after the "
                                                          "checks: where the ranks' logs and records go")
    p.add_argument("--memory", action="store_true", help="print the memory plan per rank (pretrain/plan/memory.py): "
                   "model states, DeepSpeed's buffers, activations, the peak; reads no shard")
    p.add_argument("--gpu-memory", default=None, help="with --memory: the memory of one GPU (80GiB, 80GB, 81920MiB): "
                                                      "whether the run fits, the largest micro-batch that does, and "
                                                      "the (tp, pp, ZeRO) layouts of --world-size ranks that fit")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="with --memory: the device the ranks "
                   "run on (default cuda; on a CPU a buffer counts only with the pages written)")
    p.add_argument("--plan", action="store_true", help="rank every layout of --world-size GPUs that fits by predicted "
                   "step time (pretrain/plan/): tokens/s per GPU, MFU, memory headroom, the largest terms, the best "
                   "layout's overrides; reads no shard")
    p.add_argument("--cluster", default=None, help="the cluster of --plan and of the launch check's predicted step: "
                   "h100, h200, a100, cpu, or a cluster YAML (pretrain/plan/cluster.py); default logging.cluster, "
                   "else this machine's GPU, else h100")
    p.add_argument("--keys", nargs="?", const="", metavar="SECTION", help="print every config key (or those of "
                   "SECTION: logging, or a key prefix: logging.profile) with its type, default and description; "
                   "needs no config")
    p.add_argument("--markdown", action="store_true", help="with --keys: as markdown (docs/config.md)")
    args = p.parse_args(argv)
    if args.keys is not None:
        try:
            print(reference.markdown() if args.markdown else reference.text(args.keys or None), end="")
        except KeyError:
            print(f"error: no config key starts with '{args.keys}'; sections: {', '.join(TrainConfig.SECTIONS)}",
                  file=sys.stderr)
            return 2
        return 0
    if args.config is None:
        p.error("the following arguments are required: config")
    try:
        cfg = load_config(args.config, args.overrides)
        if args.memory or args.gpu_memory:   # the plan before a launch: the config alone, no shard read
            budget = parse_size(args.gpu_memory) if args.gpu_memory else None
            cfg.check_runtime(args.world_size or 1, cuda=args.device == "cuda")
            print(report(cfg, args.world_size or 1, budget, args.device))
            return 0
        if args.plan:   # every layout that fits, by predicted step time; the config alone
            gpu = run_prediction.device_cluster_name()   # a CPU-only login node plans for GPUs: h100 unless told
            cluster = run_prediction.cluster_of(cfg, "" if gpu == "cpu" else gpu, args.cluster) or load_cluster("h100")
            print(search.report(cfg, args.world_size or 1, cluster))
            return 0
        if args.deepspeed:                # the DeepSpeed config of a launch of that many ranks
            rt = cfg.check_runtime(args.world_size or 1)
        elif args.world_size is not None:   # the check before a launch: config, shards, a checkpoint to resume
            check_launch(cfg, args.world_size, relayout=True)
            lines = stage_lines(cfg)   # data.stages, data.seq_len: each stage's steps, length and tokens
            print("\n".join(lines), file=sys.stderr, end="\n" if lines else "")
            print(run_prediction.StepCheck.for_run(cfg, args.world_size, run_prediction.device_cluster_name(), args.cluster).line,
                  file=sys.stderr)
        print("\n".join(ramp_lines(cfg.batch_ramp(), cfg.model.max_seq_len)), file=sys.stderr,
              end="\n" if cfg.train.batch_ramp else "")   # train.batch_ramp: each size's steps and tokens
        if args.run_dir:
            print(cfg.train.run_dir)
        elif args.print or not args.deepspeed:
            print(yaml.safe_dump(cfg.to_dict(), sort_keys=False, allow_unicode=True), end="")
        if args.deepspeed:
            print(("---\n" if args.print else "") + json.dumps(deepspeed_config(cfg, rt.dp), indent=2))
    except remote.FetchFailed as e:   # an outage outlasted the retries: the launch can be tried again later
        print(f"error: {e} (an outage, not a bad setting: try the launch again when the server is back)",
              file=sys.stderr)
        return TRANSIENT_EXIT
    except (ConfigError, ValueError) as e:   # ValueError: a DataError of the shards
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
