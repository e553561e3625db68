"""The trainer's data: this rank's train stream from the config (one shard set, or sources blended by weight), its
validation (per source, and combined with the sources' weights), and what the log says of the data as it is read
(tokens of each source, its epochs, a line when a source starts its next one)."""
from __future__ import annotations

import math
import signal

import torch

from pretrain import distributed
from pretrain.config import TrainConfig
from pretrain.config.stage_lengths import length_list
from pretrain.distributed import Layout
from tokendata.order import blend_of
from tokendata.lengths import StageLengths
from tokendata.stream import TokenStream


def train_stream(cfg: TrainConfig, lay: Layout, sources: tuple = ()) -> TokenStream:
    """This rank's TokenStream, of the sources the launch check read (`sources`, else read here). An older
    checkpoint's order has the shards' sizes checked by global rank 0 alone, its verdict broadcast. Its DataLoader
    workers ignore train.preempt_signals: the rank stops after its step, they read on until it does."""
    return TokenStream(list(sources) or cfg.data.source_list(), cfg.train.micro_batch_size, cfg.model.max_seq_len,
                       dp_rank=lay.dp_rank, dp_world=lay.dp, num_workers=cfg.data.num_workers, seed=cfg.data.seed,
                       bad_shards=cfg.data.bad_shards, pin_memory=lay.device.type == "cuda",
                       cache_dir=cfg.data.cache_dir, decide=lambda check: distributed.from_rank0(check, lay),
                       global_batch_size=cfg.train.global_batch_size, canonical_streams=cfg.data.canonical_streams,
                       verify=cfg.data.verify, fetch_threads=cfg.data.fetch_threads,
                       preempt_signals=[getattr(signal, name) for name in cfg.train.preempt_signals],
                       stages=cfg.data.stage_list(), ramp=cfg.batch_ramp(), stage_lengths=length_list(cfg.data))


def stage_lines(cfg: TrainConfig) -> list[str]:
    """data.stages (and data.seq_len), one line each: its steps, its length, and the samples (of model.max_seq_len)
    and tokens each source gives in it (the order's own arithmetic, tokendata/order.py `Staged`; to train.max_steps).
    None without stages or data.seq_len."""
    named, M = cfg.data.sources or [{"name": None, "weight": 1.0}], cfg.model.max_seq_len
    stages, P = cfg.data.stage_list(), cfg.batch_ramp().samples_before   # P(step): picks before it
    if not stages and cfg.data.seq_len is None:
        return []
    said = length_list(cfg.data)   # [(first step, L)] of the stages that set a length
    blend, lengths = blend_of([s["weight"] for s in named], [(P(step), w) for step, w in stages]), StageLengths(M, said)
    ends, pos, lines = [step for step, _ in stages], blend.start(), []
    ends.append(max([cfg.train.max_steps] + ends))
    for k, (first, last) in enumerate(zip([0] + ends[:-1], ends)):
        before = list(pos.counts)
        blend.picks(pos, P(last) - P(first))
        gives = ", ".join(f"{name or 'data'} {c - b} samples ({(c - b) * M:,} tokens)"
                          for name, c, b in zip([s["name"] for s in named], pos.counts, before))
        decay = " (the LR decays: train.decay=wsd)" if k and cfg.data.stages[k - 1].get("decay") else ""
        L = lengths.at(first)   # said where a stage sets a length
        at = (f" at seq_len {L}" + (f" ({M // L} rows a sample of {M})" if L < M else "")) if said else ""
        lines.append(f"data stage {k}: steps {first}–{last}{decay}{at}: {gives}")
    return lines


def named(stream: TokenStream) -> bool:
    """Whether the run reads data.sources (named, blended) rather than one data.shard_dir."""
    return stream.parts[0].source.name is not None


def data_words(stream: TokenStream) -> list[str]:
    """What the log says of the data when a run starts."""
    blend = ", ".join(f"{p.source.name} {w:.3g}" for p, w in zip(stream.parts, stream.blend.w))
    known = sorted(stream.bad_found())
    return ([f"data: sources blended by weight: {blend}" if named(stream) else f"data: {stream.shard_dir}"] +
            [f"data order: {stream.order_words}"] + stream.notes +
            ([f"data: skipping {len(known)} shards found bad before this checkpoint (data.bad_shards=skip): "
              + "; ".join(known)] if known else []))


class DataLog:
    """Per source: the tokens trained on and the epochs read (fractional), for TensorBoard and metrics.jsonl, and a line
    when a source begins its next epoch (a source that runs out starts it on its own)."""

    def __init__(self, stream: TokenStream):
        self.stream = stream
        self.epochs = [math.floor(p["epochs"]) for p in stream.progress()]

    def values(self) -> dict:
        out = {}
        for p in self.stream.progress():
            prefix = f"data/{p['name']}" if p["name"] else "data"
            out.update({f"{prefix}/tokens": p["tokens"], f"{prefix}/epochs": p["epochs"]})
        return out

    def news(self, step: int) -> list[str]:
        lines = []
        for i, p in enumerate(self.stream.progress()):
            if math.floor(p["epochs"]) > self.epochs[i]:
                self.epochs[i] = math.floor(p["epochs"])
                what = f"source {p['name']}" if p["name"] else "the data"
                lines.append(f"data: {what} is in its epoch {self.epochs[i] + 1} by step {step} ({p['samples']} "
                             f"samples read: {p['epochs']:.2f} epochs)")
        return lines


def validation(stream: TokenStream, val_loss, cfg: TrainConfig, lay: Layout, log, step: int, read) -> dict:
    """Every source's validation loss (the same samples every time) and, for a blend, their combination weighted by the
    sources' weights as val/loss; logged to TensorBoard and metrics.jsonl with a description, and said in one line.
    `val_loss(batches)`: the mean loss over DP ranks on the device; `read`: the trainer's one way to the host."""
    dev, B = lay.device, cfg.train.micro_batch_size
    losses, covered = [], []
    for i in range(len(stream.parts)):
        val = [(b["tokens"][:, :-1].to(dev), b["tokens"][:, 1:].to(dev))
               for b in stream.val_batches(cfg.data.val_batches, source=i)]
        losses.append(val_loss(val).reshape(1))
        total = sum(count for _, count in stream.model_samples(stream.shards[i]["val"]))   # of model.max_seq_len
        covered.append((min(total, len(val) * B * lay.dp), total))
    losses = read(torch.cat(losses))   # one wait for the device
    loss = sum(w * x for w, x in zip(stream.blend.w, losses))
    result = {"val/loss": loss, "val/ppl": math.exp(min(loss, 50))}
    how = f"(data.val_batches={cfg.data.val_batches} × micro-batch {B} × {lay.dp} data-parallel ranks)"
    if not named(stream):
        (n, total), = covered
        what = f"over {n} of the {total} validation samples {how}"
        log.scalars(step, result, {tag: f"{tag} {what}, the same samples every time" for tag in result})
        log.info(f"validation at step {step}: loss {loss:.4f}, perplexity {result['val/ppl']:.2f} {what}")
        return result
    described = {tag: f"{tag}: the sources' validation losses weighted by their data.sources weights "
                      f"({', '.join(f'{w:.3g} × {p.source.name}' for p, w in zip(stream.parts, stream.blend.w))}), "
                      f"the same samples every time" for tag in result}
    for p, x, (n, total) in zip(stream.parts, losses, covered):
        name = p.source.name
        mine = {f"val/{name}/loss": x, f"val/{name}/ppl": math.exp(min(x, 50))}
        result.update(mine)
        described.update({tag: f"{tag} over {n} of the {total} validation samples of source {name} {how}, the same "
                               f"samples every time" for tag in mine})
    log.scalars(step, result, described)
    each = ", ".join(f"{p.source.name} {x:.4f} (weight {w:.3g})" for p, x, w in zip(stream.parts, losses,
                                                                                 stream.blend.w))
    log.info(f"validation at step {step}: loss {loss:.4f}, perplexity {result['val/ppl']:.2f}, the sources' losses "
             f"weighted by their data.sources weights: {each} {how}")
    return result
