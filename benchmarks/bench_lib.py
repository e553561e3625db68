"""Helpers of benchmarks/bench.py: what runs inside one measurement process (`_one`); what the parent does with the
results (statistics, tables, the served processes it alternates) is benchmarks/bench_report.py.

Inside a measurement process (a fresh interpreter per point, so no two points share allocator state):
    Memory        RSS (CPU) or allocator (CUDA) readings (benchmarks/bench_memory.py): after imports, after the
                  engine is built, at rest after the warm-up, peak per repetition and per phase of a step
    measure()     warm-up calls, then `reps` repetitions of `steps` timed calls (or, served, one per request of the
                  parent): per repetition the rate, the time per call and the peak memory; and each call's own time
                  (StepClock: CUDA events on a GPU, so that no step waits for the host to read a clock)
    run_point()   one point of a plan: "train" (our engine, pretrain.engine.build_engine), "peer" (Hugging Face GPT-2
                  under the same DeepSpeed config), "data" (tokendata.stream.TokenStream alone, data.verify
                  spec["verify"]) or "shards" (tools/make_shards.py on a text file, spec["workers"] processes)
"""
from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from functools import partial

from benchmarks import bench_data
from benchmarks.bench_memory import Memory
from benchmarks.bench_sched import Foreground, runqueue_s

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULT_MARK = "BENCH_RESULT "   # the child's one result line on stdout (DeepSpeed logs to stdout as well)
READY_MARK, REP_MARK = "BENCH_READY", "BENCH_REP "   # a served child: warmed up; one repetition's rate


# ---- inside one measurement process --------------------------------------------------------------------------------
class StepClock:
    """Each timed call's own duration: on CUDA an event recorded after each call on the stream (read once the
    repetition is over: the host never waits inside it), elsewhere the host's clock."""

    def __init__(self, device=None):
        import torch

        self.cuda = device is not None and getattr(device, "type", device) == "cuda"
        self.torch, self.marks = torch, []

    def mark(self) -> None:
        if self.cuda:
            event = self.torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def durations(self) -> list[float]:
        """Seconds between consecutive marks (after the device has finished them); the marks are cleared."""
        marks, self.marks = self.marks, []
        if self.cuda:
            return [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:])]
        return [b - a for a, b in zip(marks, marks[1:])]


def measure(call, sync, units_per_call: float, warmup: int, reps: int, steps: int, mem: Memory | None = None,
            serve: bool = False, foreground: bool = False, clock: StepClock | None = None) -> dict:
    """`warmup` untimed calls (one-time allocations, JIT, DataLoader start), then `reps` × `steps` timed calls.
    Per repetition: units/s, seconds per call, and (with `mem`) the peak memory of the repetition; `step_each`: every
    timed call's own seconds (`clock`'s, default the host's), for the spread of a point timed in one repetition.
    `serve`: after the warm-up, one repetition per "rep" line on stdin (its rate printed after REP_MARK) until
    "done" — the parent alternates the repetitions of two such processes."""
    for _ in range(warmup):
        call()
    sync()
    if mem:
        mem.rest()
    rate, seconds, peak, queued, each = [], [], [], [], []
    clock = clock or StepClock()
    held = []

    def repetition():
        if mem:
            mem.reset_peak()
        if foreground:
            sync()   # the ranks start the repetition together, whatever each slept after the last one
        with Foreground(foreground) as fg:
            t0, q0 = time.perf_counter(), runqueue_s()
            clock.mark()
            for _ in range(steps):
                call()
                clock.mark()
            sync()
            dt = time.perf_counter() - t0
        each.extend(clock.durations())
        held.append(fg.held)
        if fg.held:
            time.sleep(2 * dt)   # the machine's other processes catch up, and the ranks start the next one together
        rate.append(units_per_call * steps / dt)
        seconds.append(dt / steps)
        queued.append((runqueue_s() - q0) / steps)
        if mem:
            peak.append(mem.peak())
            mem.cuda["reps"].append(mem.cuda_reading(peak[-1]))

    if serve:
        print(READY_MARK, flush=True)
        for line in sys.stdin:
            if line.strip() != "rep":
                break
            repetition()
            print(REP_MARK + json.dumps({"rate": rate[-1]}), flush=True)
    else:
        for _ in range(reps):
            repetition()
    out = {"rate": rate, "step_s": seconds, "step_each": each, "runqueue_s": queued, "foreground": held}
    if mem:   # step memory: what a step adds to the engine at rest (gradients, activations, temporaries)
        out.update(step_mb=[p - mem.at_rest for p in peak], total_mb=[p - mem.after_init for p in peak],
                   peak_mb=max(peak), after_init_mb=mem.after_init, after_engine_mb=mem.after_engine,
                   at_rest_mb=mem.at_rest, tensors_at_rest_mb=mem.tensors_at_rest,
                   phase_mb={k: v - mem.at_rest for k, v in mem.phases.items()},
                   cuda_memory=mem.cuda if mem.device.type == "cuda" else None)
    return out


def peer_engine(cfg, lay):
    """Hugging Face GPT-2 (SDPA attention) of our model's shape, under the DeepSpeed config, parameter groups and LR
    schedule that pretrain.engine.build_engine gives our model: ZeRO stage, AdamW settings, clipping, precision."""
    import torch
    import torch.nn.functional as F
    from transformers import GPT2Config, GPT2LMHeadModel

    from pretrain.engine import initialize

    m = cfg.model
    gpt = GPT2LMHeadModel(GPT2Config(
        vocab_size=m.vocab_size, n_positions=m.max_seq_len, n_embd=m.d_model, n_layer=m.n_layers, n_head=m.n_heads,
        n_inner=m.d_ffn, activation_function="gelu", layer_norm_epsilon=m.norm_eps,   # our MLP: exact GELU, 4·d
        resid_pdrop=m.dropout, embd_pdrop=m.dropout, attn_pdrop=m.mixer_dropout, attn_implementation="sdpa"))
    assert gpt.config._attn_implementation == "sdpa", gpt.config._attn_implementation

    class PeerLM(torch.nn.Module):
        """forward(inputs, targets) → mean cross-entropy, the call our engine takes."""

        def __init__(self):
            super().__init__()
            self.gpt = gpt

        def forward(self, inputs, targets):
            logits = self.gpt(input_ids=inputs).logits                     # (B, n, V)
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    return initialize(PeerLM(), cfg, lay)


class PlainLoop:
    """The training step a PyTorch user writes for the same model, the fair reference for our engine: fp32 master
    weights, torch.autocast at train.precision, torch's fused AdamW with the run's parameter groups, gradient
    clipping at train.grad_clip, gradients accumulated over the micro-batches, and the run's LR schedule
    (pretrain/engine.py lr_lambda, warm-up included, stepped after each optimizer step as DeepSpeed steps it), so that
    it and the engine differ only in the engine. Called like the engine. `schedule=False`: train.lr from step 0 (how
    the loop ran before, for the H200 record's point: benchmarks/compile_check.py --harness)."""

    def __init__(self, cfg, lay, schedule: bool = True):
        import torch

        from model import build_model
        from pretrain.engine import lr_lambda, param_groups

        t = cfg.train
        self.torch, self.device, self.clip, self.accum = torch, lay.device, t.grad_clip, lay.grad_accum
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(t.precision)
        self.module = build_model(cfg.model).to(lay.device)
        self.model = self.module
        self.optimizer = torch.optim.AdamW(param_groups(self.module, t.weight_decay), lr=t.lr, betas=t.betas,
                                           eps=t.eps, fused=lay.device.type in ("cpu", "cuda"))
        factor = lr_lambda(t, cfg.total_steps()) if schedule else (lambda step: 1.0)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, factor)
        self.micro = 0

    def compile(self):
        self.model = self.torch.compile(self.module)

    def __call__(self, inputs, targets):
        with self.torch.autocast(self.device.type, dtype=self.dtype or self.torch.float32,
                                 enabled=self.dtype is not None):
            return self.model(inputs, targets)

    def backward(self, loss):
        (loss / self.accum).backward()

    def step(self):   # at the end of each accumulation, as DeepSpeed's engine.step()
        self.micro += 1
        if self.micro % self.accum:
            return
        if self.clip:
            self.torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()


def training_step(spec: dict):
    """A training step of spec's config (our engine, the GPT-2 peer, or the plain loop) on random tokens, in this
    process (one rank of spec's world: the parent sets RANK/WORLD_SIZE/... in the environment), compiled where spec
    says so. Each micro-batch is a fresh one (drawn once the engine is built, on the device: `batches`; past
    warm-up + reps × steps optimizer steps they come round again), the same for every kind of engine; spec
    "same_batch": one batch every step, and "schedule": false, the plain loop at train.lr from step 0 (how the H200
    record's loop ran). Returns (step, sync, engine, cfg, layout, memory): `step()` is one optimizer step of
    grad_accum micro-batches, as Trainer.train_step does them; `sync()` waits for the device and the other ranks."""
    import torch
    import torch.distributed as dist

    from pretrain import distributed
    from pretrain.config import load_config
    from pretrain.engine import build_engine

    compiled = spec.get("compile") and spec["kind"] == "train"   # our engine compiles as the trainer does
    cfg = load_config(spec["config"], spec["overrides"] + (["train.compile=true"] if compiled else []))
    lay = distributed.init(cfg)
    if spec.get("threads"):   # else the trainer's choice: CPU count ÷ ranks on the host
        torch.set_num_threads(spec["threads"])
    import torch._dynamo  # noqa: F401  torch.optim imports it at the engine's first parameter group: its code is
    mem = Memory(lay.device)   # the process's, in the baseline after init, not in a step's memory
    torch.manual_seed(cfg.train.seed)
    loop = partial(PlainLoop, schedule=spec.get("schedule", True))
    engine = {"peer": peer_engine, "loop": loop}.get(spec["kind"], build_engine)(cfg, lay)
    if spec.get("compile") and not compiled:   # the plain loop: torch.compile of the whole model, as a user would
        engine.compile()
    mem.engine_built()
    B, n = cfg.train.micro_batch_size, cfg.model.max_seq_len
    # Same tokens on the ranks of one TP group (they must see one batch), different ones across data-parallel ranks.
    g = torch.Generator().manual_seed(lay.dp_rank)
    steps = 1 if spec.get("same_batch") else spec.get("warmup", 1) + spec.get("reps", 1) * spec.get("steps", 1)

    def batch():
        tokens = torch.randint(cfg.model.vocab_size, (B, n + 1), generator=g)
        if spec.get("documents"):   # the documents part: an eos where a document of that mean length would end
            tokens[torch.rand(B, n + 1, generator=g) < 1 / spec["documents"]] = spec["eos"]
        return tokens.to(lay.device)

    batches = [batch() for _ in range(steps * lay.grad_accum)]
    drawn = itertools.cycle(batches)
    losses = []   # each step's loss, detached: read once after the timing (no host read inside a step)

    def step():
        if lay.pp > 1:   # the PipelineEngine runs the step's micro-batches itself (its phases are not told apart)
            micro = [next(drawn) for _ in range(lay.grad_accum)]
            losses.append(engine.train_batch(iter([(t[:, :-1], t[:, 1:]) for t in micro])).detach())
            mem.phase("pipeline step")
            return
        for _ in range(lay.grad_accum):
            tokens = next(drawn)
            loss = engine(tokens[:, :-1], tokens[:, 1:])
            losses.append(loss.detach())
            mem.phase("forward")
            engine.backward(loss)
            mem.phase("backward")
            engine.step()
            mem.phase("optimizer step")

    def sync():
        if lay.device.type == "cuda":
            torch.cuda.synchronize()
        if lay.world > 1:
            dist.barrier()

    step.losses, step.batches = losses, batches
    return step, sync, engine, cfg, lay, mem


def run_train(spec: dict) -> dict:
    """The rates (and memory) of `training_step` over spec's warm-up, repetitions and steps."""
    from model.accounting import train_flops_per_token
    from pretrain import distributed

    step, sync, engine, cfg, lay, mem = training_step(spec)
    out = measure(step, sync, cfg.tokens_per_step, spec["warmup"], spec["reps"], spec["steps"], mem,
                  foreground=spec.get("foreground", False), serve=spec.get("serve", False),
                  clock=StepClock(lay.device))
    per_rep = len(step.losses) // max(1, spec["warmup"] + spec["reps"] * spec["steps"]) * spec["steps"]
    timed = [float(x) for x in step.losses[-per_rep * spec["reps"]:]]   # each repetition's mean loss
    out["loss"] = [sum(timed[i:i + per_rep]) / per_rep for i in range(0, len(timed), per_rep)]
    out.update(params=sum(p.numel() for p in engine.module.parameters()), device=str(lay.device),
               world=lay.world, tp=lay.tp, dp=lay.dp, grad_accum=lay.grad_accum, tokens_per_step=cfg.tokens_per_step)
    if spec["kind"] in ("train", "loop"):
        out["train_flops_per_token"] = train_flops_per_token(cfg.model)
    out["rank"] = lay.rank
    distributed.shutdown()
    return out


def run_data(spec: dict) -> dict:
    """Batches of tokendata.stream.TokenStream read by its DataLoader workers, nothing else: from the shards on disk,
    or (spec["http"]) from tools/serve_shards.py processes on 127.0.0.1: one, or with spec["blend"] three, each serving
    the shards as one source of a 0.5 / 0.3 / 0.2 blend (data.sources)."""
    from tokendata.sources import Source
    from tokendata.stream import TokenStream
    from tokendata.shards import read_manifest

    servers = []
    try:
        for _ in range((3 if spec.get("blend") else 1) if spec.get("http") else 0):
            servers.append(subprocess.Popen([sys.executable, os.path.join(ROOT, "tools", "serve_shards.py"),
                                             spec["shard_dir"], "--port", "0"], stdout=subprocess.PIPE, text=True))
        # "serving DIR at http://HOST:PORT ..."
        urls = [server.stdout.readline().split(" at ")[1].split()[0] for server in servers] or [spec["shard_dir"]]
        location = [Source(url, w, name) for url, w, name in zip(urls, (0.5, 0.3, 0.2), ("one", "two", "three"))] \
            if spec.get("blend") else urls[0]
        seq_len = read_manifest(spec["shard_dir"])["seq_len"]
        stream = TokenStream(location, spec["batch"], seq_len, num_workers=spec["workers"],
                             seed=0, verify=spec.get("verify", "hash"))
        batches = iter(stream)
        out = measure(lambda: next(batches), lambda: None, spec["batch"] * seq_len, spec["warmup"], spec["reps"],
                      spec["steps"])
    finally:
        for server in servers:
            server.kill()
    out.update(seq_len=seq_len, rank=0)
    return out


def run_shards(spec: dict) -> dict:
    """MB/s of text that tools/make_shards.py turns into shards (read, encoded by spec["workers"] processes of one
    thread each, windowed, written, hashed), per repetition: each a whole run into a fresh directory."""
    import shutil
    import tempfile

    from tools.make_shards import make_shards

    rates = []
    for _ in range(spec["reps"]):
        out = tempfile.mkdtemp(prefix="bench-shards-")
        try:
            m = make_shards([spec["input"]], spec["tokenizer"], out, spec["seq_len"], threads=1, progress=False,
                            workers=spec["workers"], batch_chars=spec["batch_chars"])
        finally:
            shutil.rmtree(out, ignore_errors=True)
        rates.append(m["stats"]["text_bytes"] / 1e6 / m["stats"]["seconds"])
    return {"rate": rates, "rank": 0}


def run_point(spec: dict) -> None:
    """The `_one` subcommand: measure one point and print it as one marked JSON line (every rank its own; the parent
    reports rank 0's, with the others' under `by_rank`)."""
    from benchmarks.bench_runs import run_training

    runs = {"data": run_data, "shards": run_shards, "run": run_training,
            "reader": bench_data.run_reader, "startup": bench_data.run_startup}
    out = runs.get(spec["kind"], run_train)(spec)
    print(RESULT_MARK + json.dumps(out), flush=True)


def one_rank_125m(run_dir: str, overrides: list[str]):
    """(config, layout) of a 1-rank process group on this machine for synth-125m's widths at n 256, micro-batch 1
    (configs/synth-125m.yaml and `overrides`): the checkpoint benchmarks' engine (bench_bucket.py,
    bench_async_save.py)."""
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(name, value)
    from pretrain import distributed
    from pretrain.config import load_config

    os.environ.setdefault("MASTER_PORT", str(distributed.free_local_port()))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = load_config(os.path.join(root, "configs", "synth-125m.yaml"),
                      ["model.max_seq_len=256", "train.micro_batch_size=1", "train.global_batch_size=1",
                       f"train.run_dir={run_dir}", "data.num_workers=0", *overrides])
    return cfg, distributed.init(cfg)


def local_s3():
    """moto's S3-protocol server on 127.0.0.1, started, and this process's AWS variables pointing at it: the checkpoint
    benchmarks' bucket (bench_bucket.py, bench_async_save.py --bucket). (server: `.stop()` it, "host:port")."""
    # moto joins a large multipart upload's parts slowly on a loaded machine: a client that gives up on the reply
    # after botocore's 60 s sends the completion again, which moto has already consumed (fsspec reads FSSPEC_S3)
    os.environ.setdefault("FSSPEC_S3", json.dumps({"config_kwargs": {"read_timeout": 900}}))
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)   # a line per request of the server
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
                       "AWS_ENDPOINT_URL": f"http://{host}:{port}"})
    return server, f"{host}:{port}"
