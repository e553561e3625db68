"""Pretrain a Synthesizer LM: `deepspeed --module pretrain.train CONFIG [section.key=value ...]` (or
launch/pretrain.sh). The constructor builds everything; `train()` is the loop.

Order of construction: process groups (TP through megatron-core) → data → model (full init from one seed,
each rank keeps its TP slice) → DeepSpeed engine (ZeRO over the data-parallel group, AdamW, LR schedule) →
checkpointer (resumes automatically from the newest checkpoint in the run) → logger.
"""
from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
import warnings

import torch
import torch.distributed as dist

from model import ConfigError, SynthesizerLM, build_model
from model.accounting import model_stats
from model import parallel as tp, release
from model.generate import sample
from pretrain import distributed, faults
from pretrain.checkpoint import CheckpointError, Checkpointer
from pretrain.config import TrainConfig, deepspeed_config, load_config, lr_lambda
from pretrain.data import DataError, TokenStream, check_vocab, read_manifest
from pretrain.health import GuardedAdamW, LossGuard, TrainingStopped
from pretrain.metrics import Logger, attention_grid, memory_mb
from pretrain.pipeline import build_pipeline


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices; not biases, norms or mixture logits θ. Frozen parameters (random_fixed's R) stay out."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        plain = p.dim() < 2 or name.endswith("bias") or ".ln_" in name or name.startswith("ln_") \
            or name.endswith("theta") or "norm_" in name
        (no_decay if plain else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(cfg: TrainConfig, groups: list[dict], device: torch.device) -> torch.optim.Optimizer | None:
    """The AdamW handed to DeepSpeed, or None where DeepSpeed builds it from its config (FusedAdam on CUDA).
    ZeRO-0 fp32 has no DeepSpeed step guard: GuardedAdamW (pretrain/health.py). Elsewhere off CUDA: torch's fused
    AdamW, one vectorized pass over each flat ZeRO partition, ~6× faster than the per-op AdamW that DeepSpeed's
    `torch_adam` builds (tools/bench.py: a random synthesizer's H·L² weights a layer made that the bottleneck)."""
    t, cuda = cfg.train, device.type == "cuda"
    adamw = dict(lr=t.lr, betas=t.betas, eps=t.eps, weight_decay=t.weight_decay, fused=device.type in ("cpu", "cuda"))
    if cfg.parallel.zero_stage == 0 and t.precision == "fp32":
        return GuardedAdamW(groups, device, **adamw)
    return None if cuda else torch.optim.AdamW(groups, **adamw)


def build_engine(cfg: TrainConfig, lay: distributed.Layout):
    """The DeepSpeed engine over this rank's model, in a fixed order: model (full init from one seed, this rank's
    TP slice) → activation checkpointing → pipeline stages (PP > 1) → DeepSpeed (ZeRO, AdamW, LR schedule)."""
    every = cfg.parallel.activation_checkpointing
    if cfg.parallel.pp > 1:   # DeepSpeed's PipelineModule brings its own grid (topology) as the mpu
        model, mpu = build_pipeline(cfg.model, lay.tp, lay.pp, lay.dp, cfg.parallel.partition, every), None
    else:
        model, mpu = build_model(cfg.model), distributed.MegatronMPU()
        for i, block in enumerate(model.blocks):
            block.checkpoint = every > 0 and i % every == 0
    if cfg.train.init_from:   # full tensors of a release; each rank keeps its TP slice of its stage's tensors
        release.load_into(model, release.read_release(cfg.train.init_from)[1],
                          rename=getattr(model, "canonical_name", lambda name: name))
    return initialize(model, cfg, lay, mpu)


def initialize(model: torch.nn.Module, cfg: TrainConfig, lay: distributed.Layout, mpu=None):
    """deepspeed.initialize over `model` with the run's parameter groups, AdamW, DeepSpeed config and LR schedule
    (also what tools/bench.py gives its GPT-2 peer, so both train alike)."""
    import deepspeed

    schedule = lr_lambda(cfg.train, cfg.total_steps())
    groups, ds_config = param_groups(model, cfg.train.weight_decay), deepspeed_config(cfg, lay.dp)
    optimizer = build_optimizer(cfg, groups, lay.device)
    if optimizer is not None:
        del ds_config["optimizer"]
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=groups, optimizer=optimizer, config=ds_config, mpu=mpu,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule))
    return engine


def train_flops_per_token(cfg: TrainConfig) -> int:
    """From the accounting of a shape-only (meta) copy of the whole model: no memory, no init."""
    with torch.device("meta"):
        return model_stats(SynthesizerLM(cfg.model))["total"]["train_flops_per_token"]


class Trainer:
    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        check_vocab(read_manifest(cfg.data.shard_dir), cfg.model.vocab_size)   # before any process group
        self.layout = lay = distributed.init(cfg)
        torch.manual_seed(cfg.train.seed)
        tp.rng_tracker.set_seed(cfg.train.seed)   # dropout on TP-sharded activations: seed + 2718 + tp_rank
        self.stream = TokenStream(cfg.data.shard_dir, cfg.train.micro_batch_size, cfg.model.max_seq_len,
                                  dp_rank=lay.dp_rank, dp_world=lay.dp, num_workers=cfg.data.num_workers,
                                  seed=cfg.data.seed, bad_shards=cfg.data.bad_shards)
        self.bad_shards_read: set[str] = set()   # shards found bad while reading (data.bad_shards=skip)
        self.flops_per_token = train_flops_per_token(cfg)
        self.engine = build_engine(cfg, lay)
        self.pipeline = cfg.parallel.pp > 1
        self.guard = LossGuard(cfg.train.max_consecutive_skips, cfg.train.spike_z, cfg.train.spike_window)
        self.checkpointer = Checkpointer(self.engine, cfg.checkpoint.dir, cfg.checkpoint.keep,
                                         {"data": self.stream, "guard": self.guard}, cfg.to_dict(), cfg.data.tokenizer,
                                         lay.rank, lay.world)
        self.log = Logger(lay.is_main, cfg.logging.tensorboard_dir, cfg.train.run_dir)
        if self.stream.skipped_shards:
            self.log.info(f"skipping {len(self.stream.skipped_shards)} bad shards (data.bad_shards=skip): " +
                          "; ".join(f"{path} ({why})" for path, why in self.stream.skipped_shards))
        self.started, self.stop_reason = time.time(), None
        for name in cfg.train.preempt_signals:   # SLURM and other schedulers warn before they kill
            signal.signal(getattr(signal, name), self.on_signal)
        self.step = self.checkpointer.load(cfg.checkpoint.resume)
        if self.step == 0 and cfg.train.init_from:
            self.step = self.continue_release(cfg.train.init_from)
        elif self.step and "data" not in self.checkpointer.restored:   # a checkpoint written by tools/convert.py
            self.skip_data(self.step)
        self.ids_file = None
        if cfg.logging.sample_ids:
            os.makedirs(os.path.join(cfg.train.run_dir, "sample_ids"), exist_ok=True)
            self.ids_file = open(os.path.join(cfg.train.run_dir, "sample_ids", f"rank{lay.rank}.jsonl"), "a")
        n_params = sum(p.numel() for p in self.engine.module.parameters())
        self.log.info(f"{lay.world} ranks (tp={lay.tp}, pp={lay.pp}, dp={lay.dp}) on {lay.device}, "
                      f"ZeRO-{cfg.parallel.zero_stage}, {cfg.train.precision}; model {cfg.model.mixer}, "
                      f"{n_params / 1e6:.2f}M parameters on rank 0; "
                      f"{self.start_words()}")

    def continue_release(self, path: str) -> int:
        """Carry on from a release's training step: its LR schedule position and its data position."""
        step = release.read_meta(path).get("training", {}).get("step", 0)
        if step:
            self.skip_data(step)
            scheduler = self.engine.lr_scheduler
            with warnings.catch_warnings():   # stepping the schedule without an optimizer step is the point here
                warnings.simplefilter("ignore")
                scheduler.last_epoch = step - 1
                scheduler.step()
        self.log.info(f"initialised from release {path} (trained {step} steps)")
        return step

    def start_words(self) -> str:
        if "engine" in self.checkpointer.restored:
            return f"resumed at step {self.step}"
        return f"starting from a release at step {self.step}" if self.step else "starting fresh"

    def skip_data(self, step: int) -> None:
        """Position the data stream after `step` optimizer steps of this layout (same settings: same samples)."""
        self.stream.load_state_dict({**self.stream.state_dict(), "consumed_batches": step * self.layout.grad_accum})

    # ---- the loop ------------------------------------------------------------------------------------------
    def train(self) -> dict:
        cfg, total = self.cfg, self.cfg.total_steps()
        if self.step == 0 or "engine" not in self.checkpointer.restored:
            self.validate()
        stop = total if cfg.train.stop_after_steps is None else min(total, self.step + cfg.train.stop_after_steps)
        batches = self.micro_batches(iter(self.stream))
        window_t, window_tokens = time.time(), 0
        while self.step < stop:
            loss, skipped = self.train_step(batches)
            self.step += 1
            note = self.guard.record(self.step, loss, skipped is not None, skipped or "")   # raises after K in a row
            if note:
                self.log.scalars(self.step, {"train/skipped_steps": self.guard.total})
                self.log.info(note)
            window_tokens += cfg.tokens_per_step
            if self.step % cfg.logging.every == 0 or self.step == total:
                self.log_step(loss, window_tokens / (time.time() - window_t))
                window_t, window_tokens = time.time(), 0
            if cfg.logging.val_every and self.step % cfg.logging.val_every == 0 and self.step != total:
                self.validate()
            if cfg.logging.image_every and self.step % cfg.logging.image_every == 0:
                self.log_samples()
            preempted = self.preempted()
            if self.step % cfg.checkpoint.every == 0 or self.step == stop or preempted:
                path = self.checkpointer.save(self.step)
                self.log.info(f"saved checkpoint {path}")
            if preempted:
                self.log.info(f"stopped at step {self.step} ({preempted}): checkpoint saved; relaunch the same "
                              f"command to continue")
                return {}
        result = self.validate()
        first_step, first_ppl = self.first_val()
        self.log.info(f"done: validation perplexity {result['val/ppl']:.2f} at step {self.step} "
                      f"(step {first_step}: {first_ppl:.2f}); "
                      f"TensorBoard logs: {cfg.logging.tensorboard_dir}")
        return result

    def on_signal(self, signum, frame) -> None:
        self.stop_reason = signal.Signals(signum).name   # acted on after the current step, by every rank together

    def preempted(self) -> str | None:
        """Why every rank must stop now (a signal on any rank, or the wall-clock limit), else None. Collective: the
        ranks' clocks differ slightly, so the limit is reached when it is on any rank, and all say so alike."""
        limit = self.cfg.train.max_wall_minutes
        over = limit is not None and time.time() - self.started > 60 * limit
        flags = torch.tensor([float(self.stop_reason is not None), float(over)], device=self.layout.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        signalled, over = flags.tolist()
        if signalled:
            return self.stop_reason or "a signal on another rank"
        return f"train.max_wall_minutes={limit} reached" if over else None

    def micro_batches(self, batches):
        """(inputs, targets) on this rank's device, recording the sample ids when asked."""
        for batch in batches:
            self.bad_shards_read.update(batch["skipped_shards"])
            if self.ids_file:
                self.ids_file.write(json.dumps({"step": self.step + 1, "ids": batch["ids"]}) + "\n")
                self.ids_file.flush()
            tokens = batch["tokens"].to(self.layout.device)
            yield tokens[:, :-1], tokens[:, 1:]

    def train_step(self, micro_batches) -> tuple[float, str | None]:
        """One optimizer step over grad_accum micro-batches: (the loss averaged over them and the DP ranks, why the
        update was skipped or None). How a step is skipped: pretrain/health.py."""
        engine, lay = self.engine, self.layout
        engine.train()
        skipped_before = self.skipped_so_far()
        nonfinite = "non-finite loss or gradient"
        if self.pipeline:   # the PipelineEngine schedules all micro-batches and reduces the loss itself
            loss = engine.train_batch(micro_batches).item()
            return loss, nonfinite if self.skipped_so_far() > skipped_before else None
        losses, spike = [], False
        for _ in range(lay.grad_accum):
            inputs, targets = next(micro_batches)
            loss = faults.poison_loss(engine(inputs, targets), self.step + 1, lay.rank)
            this_spike = self.guard.spike_z is not None and self.guard.is_spike(self.dp_mean(loss))
            spike |= this_spike
            engine.backward(loss * float("nan") if this_spike else loss)   # NaN gradients: the step is dropped
            engine.step()
            losses.append(loss.detach())
        loss = self.dp_mean(torch.stack(losses).mean())
        if spike:
            return loss, "loss spike"
        return loss, nonfinite if self.skipped_so_far() > skipped_before else None

    def skipped_so_far(self) -> int:
        """Optimizer steps dropped for a non-finite gradient: by DeepSpeed's optimizers, or by GuardedAdamW."""
        return self.engine.skipped_steps + getattr(self.engine.optimizer, "skipped", 0)

    def first_val(self) -> tuple[int, float]:
        """(step, validation perplexity) of this run's first evaluation (also after a resume), from metrics.jsonl:
        step 0, or the step a release started it at."""
        path = os.path.join(self.cfg.train.run_dir, "metrics.jsonl")
        if os.path.exists(path):
            for line in open(path):
                row = json.loads(line)
                if "val/ppl" in row:
                    return row["step"], row["val/ppl"]
        return 0, float("nan")

    def micro_batches_plain(self, batches) -> list:
        return [(b["tokens"][:, :-1].to(self.layout.device), b["tokens"][:, 1:].to(self.layout.device))
                for b in batches]

    def dp_mean(self, x: torch.Tensor) -> float:
        from megatron.core import parallel_state

        x = x.detach().float().clone()
        dist.all_reduce(x, group=parallel_state.get_data_parallel_group())
        return x.item() / self.layout.dp

    def skipped_shards(self) -> int:
        """Bad shards left out so far: at the start (every rank alike) + found while reading (summed over DP)."""
        found = round(self.dp_mean(torch.tensor(float(len(self.bad_shards_read)))) * self.layout.dp)
        return len(self.stream.skipped_shards) + found

    # ---- reporting -----------------------------------------------------------------------------------------
    def log_step(self, loss: float, tokens_per_s: float) -> None:
        cfg, lay = self.cfg, self.layout
        lr = self.engine.get_lr()[0]
        grad_norm = self.engine.get_global_grad_norm()
        tflops = self.flops_per_token * tokens_per_s / lay.world / 1e12
        values = {"train/loss": loss, "train/ppl": math.exp(min(loss, 50)), "train/lr": lr,
                  "train/grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
                  "perf/tokens_per_s": tokens_per_s, "perf/tflops_per_device": tflops,
                  "perf/mfu": tflops / cfg.logging.peak_tflops_per_device,
                  "progress/samples_seen": self.step * cfg.train.global_batch_size,
                  "progress/tokens_seen": self.step * cfg.tokens_per_step,
                  "memory/peak_mb": memory_mb(lay.device), "train/skipped_steps": self.guard.total,
                  "data/skipped_shards": self.skipped_shards()}
        self.log.scalars(self.step, values)
        self.log.info(f"step {self.step}/{cfg.total_steps()} | loss {loss:.4f} | lr {lr:.2e} | "
                      f"grad norm {values['train/grad_norm']:.3f} | {tokens_per_s:,.0f} tok/s | "
                      f"MFU {100 * values['perf/mfu']:.1f}%")

    @torch.no_grad()
    def validate(self) -> dict:
        self.engine.eval()
        val = self.micro_batches_plain(self.stream.val_batches(self.cfg.data.val_batches))
        if self.pipeline:
            loss = self.engine.eval_batch(iter(val), num_micro_batches=len(val)).item()
        else:
            loss = self.dp_mean(torch.stack([self.engine(x, y) for x, y in val]).mean())
        result = {"val/loss": loss, "val/ppl": math.exp(min(loss, 50))}
        self.log.scalars(self.step, result)
        self.log.info(f"validation at step {self.step}: loss {loss:.4f}, perplexity {result['val/ppl']:.2f}")
        return result

    @torch.no_grad()
    def log_samples(self) -> None:
        """Attention-map images of the first validation sequence and a text sample (all ranks compute: TP/ZeRO-3)."""
        import sentencepiece as spm

        if self.pipeline:   # maps and sampling need the whole model in one process group step
            return
        model, cfg = self.engine.module, self.cfg
        model.eval()
        first = next(iter(self.stream.val_batches(1)))["tokens"][:1, :-1].to(self.layout.device)
        self.log.images(self.step, "attention", attention_grid(model.attention_maps(first)))
        sp = spm.SentencePieceProcessor(model_file=cfg.data.tokenizer)
        prompt = torch.tensor([sp.encode(cfg.logging.sample_prompt)], device=self.layout.device)
        out = sample(model, prompt, cfg.logging.sample_tokens, temperature=0.8, top_k=50, seed=self.step)
        text = sp.decode(out[0].tolist())
        self.log.text(self.step, "sample", text)
        self.log.info(f"sample: {text!r}")

    def close(self) -> None:
        self.log.close()
        if self.ids_file:
            self.ids_file.close()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    argv = [a for a in argv if not a.startswith("--local_rank")]   # the DeepSpeed launcher may add it
    try:
        cfg = load_config(argv[0], argv[1:])
        trainer = Trainer(cfg)
    except (ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        trainer.train()
    except (TrainingStopped, CheckpointError, DataError) as e:   # one line; the launcher ends the other ranks
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        trainer.close()
        distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
