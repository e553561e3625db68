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

from model import parallel as tp, release
from model.accounting import train_flops_per_token
from model.generate import sample
from pretrain import distributed
from pretrain.observe import live_model, monitor
from pretrain.plan import memory as memory_plan
from pretrain.checkpoints.checkpointer import Checkpointer
from pretrain.checkpoints import bucket
from pretrain.checkpoints.resume import deepspeed_clipped, is_universal
from pretrain.config import TrainConfig, load_config
from pretrain.data import DataLog, data_words, train_stream, validation
from pretrain.config.deepspeed_dict import clips_on_device
from pretrain.engine import accumulation, build_engine
from pretrain.observe.device_peaks import device_name, peak_tflops
from pretrain.faults import Faults
from pretrain.fleet.watch import FleetWatch
from pretrain.step_guard import GuardedAdamW, LossGuard
from pretrain.observe.metrics import Logger, keep_rows_up_to, layer_maps, memory_mb
from pretrain.observe import ProfileWindows, StepTimes
from pretrain.plan.run_prediction import StepCheck
from pretrain.prelaunch import check_launch
from pretrain.supervision.rank import run_rank, supervise
from tokendata import tokenizer as tokenizers
from tokendata.shards import opening, tokenizer_path

IMAGE_TOKENS = 64     # positions of the attention images: a causal map's top-left block is exact on its own
OPENING_TOKENS = 12   # the default text sample's prompt: the opening of a validation document


class Trainer:
    def __init__(self, cfg: TrainConfig):
        self.cfg, self.ramp = cfg, cfg.batch_ramp()   # the global batch of each step (train.batch_ramp)
        checked = check_launch(cfg, distributed.world_size())   # config, manifests, checkpoint: before any group
        self.layout = lay = distributed.init(cfg)
        torch.manual_seed(cfg.train.seed)
        tp.rng_tracker.set_seed(cfg.train.seed)   # dropout on TP-sharded activations: seed + 2718 + tp_rank
        self.stream = train_stream(cfg, lay, checked.sources)   # pretrain/data.py: one shard set, or a blend
        self.retries_read = 0   # network fetches the train batches' workers retried
        # a tokenizer is read from local files: one beside remote shards is fetched into the run directory
        self.tokenizer = tokenizers.local_copy(cfg.data.tokenizer or tokenizer_path(self.stream.manifest),
                                               cfg.train.run_dir)
        self.peak_tflops = peak_tflops(lay.device, cfg.train.precision, cfg.logging.peak_tflops_per_device)
        resume = bucket.resume_from(cfg.checkpoint, cfg.to_dict(), lay.world, announce=lay.rank == 0)
        self.engine = build_engine(cfg, lay, load_universal=resume is not None and is_universal(resume),
                                   device_clip=clips_on_device(cfg, deepspeed_clipped(resume)))
        self.pipeline = cfg.parallel.pp > 1   # one module per rank, or this rank's stage of a PipelineEngine
        self.forward_backward, self.val_loss = ((self.pipeline_forward_backward, self.pipeline_val_loss)
                                                if self.pipeline else (self.plain_forward_backward, self.plain_val_loss))
        self.host_reads = 0   # device values the trainer has waited for (one per step outside logging steps)
        self.guard = LossGuard(cfg.train.max_consecutive_skips, cfg.train.spike_z, cfg.train.spike_window)
        self.faults = Faults.from_environment(lay.rank, cfg.train.run_dir)   # the fault tests' hooks; none by default
        self.log = Logger(lay.is_main, cfg.logging.tensorboard_dir, cfg.train.run_dir, cfg.logging.wandb, cfg.to_dict())
        saves = bucket.Saves(cfg.checkpoint.dir, cfg.checkpoint.staging_dir, lay) \
            if bucket.is_bucket(cfg.checkpoint.dir) else None   # checkpoint.dir in a bucket: staged, then uploaded
        self.checkpointer = Checkpointer(self.engine, cfg.checkpoint.staging_dir if saves else cfg.checkpoint.dir,
                                         cfg.checkpoint.keep, {"data": self.stream, "guard": self.guard},
                                         cfg.to_dict(), self.tokenizer, lay.rank, lay.world, self.faults,
                                         keep_every=cfg.checkpoint.keep_every, bucket=saves,
                                         async_save=cfg.checkpoint.async_save, announce=self.log.info)
        self.log.info(memory_plan.report(cfg, lay.world, device=lay.device.type) if lay.is_main else None)
        self.step_check = StepCheck.for_run(cfg, lay.world, device_name(lay.device)) if lay.is_main else None
        self.log.info(self.step_check and self.step_check.line)   # the time plan's step (pretrain/plan/run_prediction.py)
        self.log.info(checked.vocab_note)   # a note, or None (padded ids)
        self.times = StepTimes(lay.device, lay.grad_accum, self.pipeline)   # perf/*_s (pretrain/observe/)
        predicted = distributed.from_rank0(lambda: self.step_check.prediction and self.step_check.prediction.step_s, lay)
        self.fleet = FleetWatch(cfg, lay, predicted)   # every rank's phases, stragglers named (pretrain/fleet/)
        self.profile = ProfileWindows(cfg.logging.profile, lay.rank, lay.device, cfg.train.run_dir, self.times)
        if self.stream.skipped_shards:
            self.log.info(f"skipping {len(self.stream.skipped_shards)} bad shards (data.bad_shards=skip): " +
                          "; ".join(f"{path} ({why})" for path, why in self.stream.skipped_shards))
        self.started, self.stop_reason, self.stopped_by = time.time(), None, None
        for name in cfg.train.preempt_signals:   # SLURM and other schedulers warn before they kill
            signal.signal(getattr(signal, name), self.on_signal)
        self.step = self.checkpointer.load(resume)
        if self.step == 0 and cfg.train.init_from:
            self.step = self.continue_release(cfg.train.init_from)
        elif self.step and "data" not in self.checkpointer.restored:   # a checkpoint written by tools/convert.py
            self.skip_data(self.step)
        self.data_log = DataLog(self.stream)   # tokens and epochs of each source, from the position resumed
        rewind = lay.is_main and bucket.rewinds(resume, cfg.checkpoint, cfg.to_dict(), lay.world)
        self.log.resume_at(self.step, rewind)  # each step once in metrics.jsonl: replayed rows move aside
        self.log.branch(self.step)   # a decay branch (tools/branch.py) names its parent run and step
        self.eta = monitor.Eta.for_config(cfg, self.step)   # elapsed time and time left in the step line
        self.ids_file = None
        if cfg.logging.sample_ids:
            os.makedirs(os.path.join(cfg.train.run_dir, "sample_ids"), exist_ok=True)
            path = os.path.join(cfg.train.run_dir, "sample_ids", f"rank{lay.rank}.jsonl")
            keep_rows_up_to(path, self.step)
            self.ids_file = open(path, "a")
        if self.pipeline and lay.grad_accum < 4 * lay.pp:   # 1F1B idles (pp−1) of every m + pp − 1 slots
            self.log.info(f"warning: {lay.grad_accum} micro-batches a step through {lay.pp} pipeline stages: each "
                          f"stage idles {(lay.pp - 1) / (lay.grad_accum + lay.pp - 1):.0%} of a step (the pipeline "
                          f"bubble, (pp − 1)/(micro-batches + pp − 1)); give it ≥ {4 * lay.pp} micro-batches by "
                          f"raising train.global_batch_size or lowering train.micro_batch_size")
        n_params = sum(p.numel() for p in self.engine.module.parameters())
        mixer = f"{cfg.model.mixer}" + (f" within documents (eos {cfg.model.eos_id})" if cfg.model.document_mask else "")
        compiled = (", compiled blocks" + (", embedding and loss" if lay.pp == 1 else "")) if cfg.train.compile else ""
        self.log.info(f"{lay.world} ranks (tp={lay.tp}, cp={lay.cp}, pp={lay.pp}, dp={lay.dp}) on {lay.device}, "
                      f"ZeRO-{cfg.parallel.zero_stage}, {cfg.train.precision}{compiled}; model {mixer}, "
                      f"{n_params / 1e6:.2f}M parameters on rank 0; {self.start_words()}")
        self.log.info(monitor.deepspeed_readback(self.engine, cfg.deepspeed.passed()))
        for line in data_words(self.stream):
            self.log.info(line)
        self.watchdog = supervise(self)   # timeouts, a restart logged, the hang watchdog (supervision/rank.py)

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
        if "universal" in self.checkpointer.restored:
            return f"resumed at step {self.step} from the universal checkpoint {self.checkpointer.loaded_from}"
        if "engine" in self.checkpointer.restored:
            return f"resumed at step {self.step}"
        return f"starting from a release at step {self.step}" if self.step else "starting fresh"

    def skip_data(self, step: int) -> None:
        """Position the data stream after `step` optimizer steps: global batches, the same in every layout."""
        self.stream.start_at(step)

    # ---- the loop ------------------------------------------------------------------------------------------
    def train(self) -> dict:
        cfg, total = self.cfg, self.cfg.total_steps()
        if self.step >= total:
            self.log.info(f"the run is finished: its checkpoint is at step {self.step} of {total} (train.max_steps="
                          f"{cfg.train.max_steps}); nothing to do. Raise train.max_steps to train on")
            return {}
        if self.step == 0 or "engine" not in self.checkpointer.restored:
            self.eta.timed("validation", self.validate)
        stop = total if cfg.train.stop_after_steps is None else min(total, self.step + cfg.train.stop_after_steps)
        batches = self.micro_batches(iter(self.stream))
        window_t, window_tokens = time.time(), 0
        while self.step < stop:
            with self.profile.step(self.step + 1):   # logging.profile's windows; nothing when off
                loss, skipped, preempted = self.train_step(batches)
            self.step += 1
            self.stop_reason = self.fleet.after(self.step, self.times, self.log, self.read) or self.stop_reason
            note = self.guard.record(self.step, loss, skipped is not None, skipped or "")   # raises after K in a row
            if note:
                self.log.scalars(self.step, {"train/skipped_steps": self.guard.total})
                self.log.info(note)
            window_tokens += self.ramp.size(self.step - 1) * cfg.model.max_seq_len   # the step just taken
            if self.step % cfg.logging.every == 0 or self.step == total:
                self.log_step(loss, window_tokens / (time.time() - window_t))
                window_t, window_tokens = time.time(), 0
            if cfg.logging.val_every and self.step % cfg.logging.val_every == 0 and self.step != total:
                self.eta.timed("validation", self.validate)
            if cfg.logging.eval_every and self.step % cfg.logging.eval_every == 0 and self.step != total:
                self.eta.timed("eval", self.log_scores)
            if cfg.logging.image_every and self.step % cfg.logging.image_every == 0:
                self.eta.timed("samples", self.log_samples)
            if self.step % cfg.checkpoint.every == 0 or self.step == stop or preempted:
                path = self.eta.timed("checkpoint", self.checkpointer.save, self.step,
                                       self.step == stop or preempted is not None)
                self.log.info(path and not cfg.checkpoint.async_save and f"saved checkpoint {path}")   # async: commit
            if preempted:
                self.log.info(f"stopped at step {self.step} ({preempted}): checkpoint saved; relaunch the same "
                              f"command to continue")
                self.stopped_by = preempted
                return {}
        result = self.validate()
        self.eta.timed("eval", self.log_scores)
        first_step, first_ppl = self.first_val()
        self.log.info(f"done: validation perplexity {result['val/ppl']:.2f} at step {self.step} "
                      f"(step {first_step}: {first_ppl:.2f}); "
                      f"TensorBoard logs: {cfg.logging.tensorboard_dir}")
        return result

    def on_signal(self, signum, frame) -> None:
        self.stop_reason = signal.Signals(signum).name   # acted on after the current step, by every rank together

    def micro_batches(self, batches):
        """(inputs, targets) on this rank's device, recording the sample ids when asked."""
        for batch in batches:
            self.retries_read += batch["retries"]
            if self.ids_file:
                self.ids_file.write(json.dumps({"step": self.step + 1, "ids": batch["ids"]}) + "\n")
                self.ids_file.flush()
            tokens = batch["tokens"].to(self.layout.device, non_blocking=True)   # pinned on CUDA: no wait
            yield tokens[:, :-1], tokens[:, 1:]

    def train_step(self, micro_batches) -> tuple[float, str | None, str | None]:
        """One optimizer step: (its loss, averaged over the micro-batches and DP ranks; why the update was skipped,
        or None; why every rank must stop now, or None). How a step is skipped: pretrain/step_guard.py.

        The host waits for the device once: the loss, GuardedAdamW's skip count and the stop flags come back in
        one read (`step_outcome`). DeepSpeed's skip count is a number it has already read itself."""
        self.times.start()
        self.engine.train()
        self.faults.before_step(self.step + 1)
        ds_skips, guarded_skips = self.engine.skipped_steps, self.guarded_skips().clone()
        loss, spike = self.forward_backward(micro_batches)
        loss, guarded, preempted = self.step_outcome(loss, self.guarded_skips() - guarded_skips)
        self.times.end()
        if spike:
            return loss, "loss spike", preempted
        skipped = guarded or self.engine.skipped_steps > ds_skips
        return loss, "non-finite loss or gradient" if skipped else None, preempted

    def plain_forward_backward(self, micro_batches) -> tuple[torch.Tensor, bool]:
        """The step's micro-batches through the engine: (their mean loss on this rank, on the device; whether one was a
        loss spike, which is turned into a non-finite gradient so that the step is dropped)."""
        losses, spike = [], False
        for _ in accumulation(self.engine, self.ramp.size(self.step)):   # train.batch_ramp: the count grows
            inputs, targets = next(micro_batches)
            self.times.lap("data_wait")
            loss = self.faults.loss(self.engine(inputs, targets), self.step + 1)
            self.faults.slow(lambda: self.engine(inputs, targets), self.step + 1)   # a test's slow GPU; none by default
            self.times.split("compute")   # the forward alone: this rank's own work (pretrain/fleet/)
            this_spike = self.guard.spike_z is not None and self.guard.is_spike(self.read(
                distributed.dp_mean(loss, self.layout))[0])   # opt-in: a host read per micro-batch
            spike |= this_spike
            self.engine.backward(loss * float("nan") if this_spike else loss)
            self.times.lap("fwd_bwd")
            self.engine.step()
            self.times.lap("optimizer")
            losses.append(loss.detach())
        return torch.stack(losses).mean(), spike

    def pipeline_forward_backward(self, micro_batches) -> tuple[torch.Tensor, bool]:
        """The PipelineEngine schedules all micro-batches and returns their loss, already averaged over DP ranks
        (the same on every rank, so averaging it again changes nothing)."""
        loss = self.engine.train_batch(self.times.fetches(micro_batches, "train_batch"))
        self.times.lap("train_batch")
        return loss, False

    def plain_val_loss(self, batches) -> torch.Tensor:
        return distributed.dp_mean(torch.stack([self.engine(x, y) for x, y in batches]).mean(), self.layout)

    def pipeline_val_loss(self, batches) -> torch.Tensor:   # averaged over DP ranks by the PipelineEngine
        return self.engine.eval_batch(iter(batches), num_micro_batches=len(batches))

    def guarded(self) -> GuardedAdamW | None:
        """The trainer's GuardedAdamW where it drops non-finite steps and clips (pretrain/engine.py
        guards_steps_itself), else None. Under ZeRO, DeepSpeed's optimizer wraps ours (as .optimizer)."""
        for opt in (self.engine.optimizer, getattr(self.engine.optimizer, "optimizer", None)):
            if isinstance(opt, GuardedAdamW):
                return opt
        return None

    def guarded_skips(self) -> torch.Tensor:   # on the device; zero where DeepSpeed drops the steps
        guarded = self.guarded()
        return guarded.skipped if guarded is not None else torch.zeros((), device=self.layout.device)

    def step_outcome(self, loss: torch.Tensor, guarded: torch.Tensor) -> tuple[float, bool, str | None]:
        """(the loss's mean over DP ranks, whether GuardedAdamW dropped the step, why every rank must stop now or
        None), in one read. Stopping is collective: a signal on any rank, or the wall-clock limit on any rank's
        clock (the clocks differ slightly), stops all of them after the same step."""
        limit = self.cfg.train.max_wall_minutes
        over = limit is not None and time.time() - self.started > 60 * limit
        flags = [self.stop_reason is not None, over, *self.checkpointer.writer_flags()]   # async saves: writing, failed
        loss, guarded, signalled, over, *writes = self.read(distributed.step_outcome(loss, guarded, flags, self.layout))
        self.checkpointer.written(writes)   # a save in the background is committed once no rank writes it
        if signalled:
            return loss, bool(guarded), self.stop_reason or "a signal on another rank"
        return loss, bool(guarded), f"train.max_wall_minutes={limit} reached" if over else None

    def read(self, values: torch.Tensor) -> list[float]:
        """Device values to the host: the trainer's only waits for the device, counted."""
        self.host_reads += 1
        return values.tolist()

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

    def data_faults(self) -> tuple[int, int]:
        """(bad shards left out so far: at the start, every rank alike, + found while reading by any DP rank, before
        a resume too; fetches retried after network faults by this run's processes, summed over DP)."""
        found, retries = self.read(distributed.dp_sum([len(self.stream.bad_found()),
                                                       self.retries_read + self.stream.retries], self.layout))
        if found:   # a shard that two ranks found bad counts once (a second collective, once one is found)
            found = len(distributed.dp_union(self.stream.bad_found(), self.layout))
        return len(self.stream.skipped_shards) + round(found), round(retries)

    # ---- reporting -----------------------------------------------------------------------------------------
    def log_step(self, loss: float, tokens_per_s: float) -> None:
        cfg, lay = self.cfg, self.layout
        lr = self.engine.get_lr()[0]
        guarded = self.guarded()   # it has the global norm of every step: one read, on logging steps only
        grad_norm = self.read(guarded.grad_norm.reshape(1))[0] if guarded else self.engine.get_global_grad_norm()
        if grad_norm is not None and grad_norm < 0:   # DeepSpeed writes -1 for a non-finite norm (a skipped step)
            grad_norm = float("inf")
        L = self.stream.stage_lengths.at(self.ramp.samples_before(self.step - 1))   # the step's data stage's length
        tflops = train_flops_per_token(cfg.model, L) * tokens_per_s / lay.world / 1e12
        values = {"train/loss": loss, "train/ppl": math.exp(min(loss, 50)), "train/lr": lr,
                  "perf/tokens_per_s": tokens_per_s, "perf/tflops_per_device": tflops,
                  "progress/samples_seen": self.ramp.samples_before(self.step),
                  "progress/tokens_seen": self.ramp.samples_before(self.step) * cfg.model.max_seq_len,
                  "memory/peak_mb": memory_mb(lay.device), "train/skipped_steps": self.guard.total,
                  **self.times.values(),   # where the steps' time went (pretrain/observe/step_times.py)
                  **dict(zip(("data/skipped_shards", "data/retries"), self.data_faults())), **self.data_log.values()}
        if grad_norm is not None:   # none where DeepSpeed computes none
            values["train/grad_norm"] = float(grad_norm)
        if self.peak_tflops:   # no MFU against a made-up peak (a CPU, or a GPU the table does not know)
            values["perf/mfu"] = tflops / self.peak_tflops
        plan_line = self.step_check.observe(values, cfg.tokens_per_step / tokens_per_s) if self.step_check else None
        self.eta.mark(self.step)
        self.log.scalars(self.step, {**values, **self.eta.scalars(self.step)})
        mfu = f"{100 * values['perf/mfu']:.3g}%" if self.peak_tflops else "n/a"   # a tiny model: 0.0008%, not 0.0%
        norm = f"{grad_norm:.3f}" if grad_norm is not None else "n/a"
        self.log.info(f"step {self.step}/{cfg.total_steps()} | loss {loss:.4f} | lr {lr:.2e} | "
                      f"grad norm {norm} | {tokens_per_s:,.0f} tok/s | "
                      f"{tflops:.3g} TFLOP/s | MFU {mfu} | {self.eta.words(self.step)}")
        self.log.info(plan_line)
        for line in self.data_log.news(self.step):   # a source that began its next epoch
            self.log.info(line)

    @torch.no_grad()
    @torch.compiler.set_stance("force_eager")   # compiled blocks (train.compile) serve training steps only
    def validate(self) -> dict:
        self.engine.eval()   # every source's validation, and for a blend their weighted combination (pretrain/data.py)
        return validation(self.stream, self.val_loss, self.cfg, self.layout, self.log, self.step, self.read)

    @torch.no_grad()
    @torch.compiler.set_stance("force_eager")   # decoding's changing lengths would recompile the blocks
    @tp.whole_sequences()   # any length: under sequence parallelism, too, every TP rank runs the whole sequence
    def log_samples(self) -> None:
        """Attention maps of the first validation sequence (its first IMAGE_TOKENS positions, every head: gathered
        over TP) and a text sample, from the whole model: under PP, the stages' weights joined on the ranks of the
        first stage. Every rank that holds part of that model computes (TP, ZeRO-3 collectives); rank 0 writes."""
        model = live_model.whole_model(self.engine, self.cfg, self.layout)
        if model is None:
            return
        cfg, dev = self.cfg, self.layout.device
        model.eval()
        first = next(iter(self.stream.val_batches(1)))["tokens"][:1, :-1]
        maps = [tp.gather_heads(A) for A in model.attention_maps(first[:, :IMAGE_TOKENS].to(dev))]
        self.log.attention(self.step, layer_maps(cfg.model, maps))
        sp = tokenizers.load(self.tokenizer)
        ids = (sp.encode(cfg.logging.sample_prompt) if cfg.logging.sample_prompt is not None
               else opening(first[0], sp.eos_id(), OPENING_TOKENS))   # the opening of a validation document
        out = sample(model, torch.tensor([ids], device=dev), cfg.logging.sample_tokens, temperature=0.8, top_k=50,
                     seed=self.step)
        text = sp.decode(out[0].tolist())
        self.log.text(self.step, "sample", text)
        self.log.info(f"sample: {text!r}")
        self.engine.train()

    @tp.whole_sequences()
    def log_scores(self) -> None:   # logging.eval_tasks on the live weights (pretrain/observe/live_model.py)
        if self.cfg.logging.eval_tasks:
            live_model.log_scores(self.step, live_model.whole_model(self.engine, self.cfg, self.layout), self.cfg,
                                  self.tokenizer, self.log)

    def close(self) -> None:
        if self.watchdog is not None:   # (already stopped before the rank's record: supervision/rank.py)
            self.watchdog.stop()
        self.profile.close()
        self.log.close()
        if self.ids_file:
            self.ids_file.close()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    argv = [a for a in argv if not a.startswith("--local_rank")]   # the DeepSpeed launcher may add it
    return run_rank(lambda: load_config(argv[0], argv[1:]), Trainer)   # its log, its failure record: supervision/


if __name__ == "__main__":
    sys.exit(main())
