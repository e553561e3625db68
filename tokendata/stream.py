"""Streaming, resumable token batches from the WebDataset shards that tools/make_shards.py writes, from one shard set
or several blended by weight.

Public API (the shard format, the manifest, DataError and the checks against a model: tokendata/shards.py)
    TokenStream(sources, micro_batch_size, seq_len, dp_rank=0, dp_world=1, num_workers=0, seed=0, mix_shards=4,
                bad_shards="fail", pin_memory=False, cache_dir=None, decide=None, global_batch_size=None,
                canonical_streams=None, verify="hash", fetch_threads=8, preempt_signals=(), stages=(), ramp=None,
                stage_lengths=())
                            sources: a shard location (data.shard_dir), a list of Source / {"name", "path",
                            "weight"} (data.sources, tokendata/sources.py), or of Opened (read by the launch
                            check); global_batch_size: G, the samples of a full optimizer step over all ranks (default
                            micro_batch_size × dp_world); canonical_streams: C (None: a checkpoint's, else
                            tokendata.order.default_streams(G)); fetch_threads: shards a rank fetches at once (its
                            bound on shards in memory); decide(fn): fn's result as one rank computed it, on every rank
                            (the trainer's pretrain.distributed.from_rank0: the size check an older checkpoint's order
                            needs); preempt_signals: the rank's, which its DataLoader workers ignore; stages:
                            [(step, weights)] (data.stages); ramp: each step's G_s (tokendata/ramp.py; None: G);
                            stage_lengths: [(step, L)] (data.seq_len, data.stages[i].seq_len; L divides seq_len)
        iter(stream)        endless train micro-batches {"tokens": LongTensor (B, n+1), "ids": [B sample ids,
                            "<source name>/<key>" for a named source], "skipped_shards": [URLs of shards found bad
                            while this batch was read; usually []], "retries": fetches retried (network faults)}; each
                            G_s / (B × dp_world) of them in a row are this rank's share of step s's global batch;
                            in a stage of L < n each sample is B·n/L rows (B·n/L, L+1) (tokendata/lengths.py `rows`)
        skipped_shards      [(URL, reason)]: shards dropped before reading (only an older checkpoint's order does)
        bad_found()         the URLs of the shards found bad while reading, before a resume too
        retries             fetches retried in this process (validation); the workers' ride on batches
        notes               what the stream decided that a log should say, as lines
        state_dict(), load_state_dict(sd)      Stateful: the position, in any layout (below)
        start_at(step)      the position after `step` global batches (a checkpoint without a data position)
        progress()          per source: samples and tokens read by all ranks so far, and epochs (fractional)
        val_batches(max_batches=None, split="val", source=0)   finite, the same batches on every call and count on
                            every rank, of one source (an index)
        upcoming_shards(worker=0, source=0)    the shards a DataLoader worker of this rank fetches first

Order (tokendata/order.py): a function of the data settings (sources and weights, C, seed, mix_shards, seq_len) and the
manifests alone, defined on the model's samples of seq_len: shards of another length n (seq_len divides n or n divides
it) are cut or joined as read, and a stage of a shorter L cuts each sample into rows (tokendata/lengths.py). Global
batch g is the same G samples, in the same order, whatever dp_world (any divisor of G), num_workers, micro_batch_size
or accumulation read it; rank r trains on positions [rG/D, (r+1)G/D) of each, read by stream. The position is the picks
so far and each source's count, plus the shards found bad while reading; it is the same on every rank. A stream resumed
in another layout goes on at the next global batch; one stopped inside a global batch (never the trainer, which saves
between steps) resumes only in its own layout. Older checkpoints keep their order: a data state of canonical streams
dealt by shard (tokendata/shard_stream_order.py) resumes it on data-parallel sizes that divide its C; one of before
canonical streams (a count of micro-batches, tokendata/rank_order.py), in its own layout.

The trainer must call iter() again after load_state_dict; a stream has one live iterator (an older one raises).

Where shards are: a directory or a URL (http(s)://, pipe:COMMAND, s3:// and other fsspec schemes;
tokendata/remote.py). Nothing is requested at the start but each source's manifest. Every shard is fetched whole,
checked (data.verify) and parsed when its window is reached, then read sample by sample from the local disk; the order
never depends on where the bytes came from. cache_dir (optional) keeps local copies of remote shards.

Bad shards, found when read: a missing file (HTTP 404, 403…), a size other than the manifest's "bytes", a content hash
other than the manifest's (twice, the second time past cache_dir: verify="hash"), a tar that cannot parse, or sample
counts or sizes other than the manifest's. bad_shards="fail": a DataError naming its path, when a batch needs it;
"skip": a warning naming it goes to stderr (from the DataLoader worker), the batch that takes its stream's next sample
lists its path in "skipped_shards", and its draws take other samples of the same window (tokendata/order.py), so the
batches are the same in every layout. The position records the shards found bad: a resume does not fetch them again,
in the same layout or another (`merged_state`: the universal checkpoint merges every rank's).
"""
from __future__ import annotations

import itertools
import math

import numpy as np
import torch

from tokendata import rank_order, shard_stream_order
from tokendata.order import Position, blend_of, SourceOrder, check_streams, default_streams, layout, rank_slice
from tokendata.reading import Part, Plan, RankPieces, as_is, collate, join_pieces, one_line, start
from tokendata.shard_files import ShardReader
from tokendata.lengths import StageLengths, fit, rows
from tokendata.ramp import BatchRamp
from tokendata.shards import DTYPES, MAKE, DataError, need
from tokendata.sources import Opened, as_sources, good_shards, open_sources

ORDER = "canonical streams dealt by sample"
BAD_SHARDS = ("fail", "skip")
SETTING_KEYS = {"canonical_streams": "data.canonical_streams", "seed": "data.seed", "mix_shards": "mix_shards",
                "seq_len": "model.max_seq_len"}


def merged_state(states: list[dict]) -> dict | None:
    """One position for a run in any layout from its ranks' data states (each knows the shards its own readers found
    bad), or None where they are of the order of before canonical streams or one stopped inside a global batch."""
    if not states or any(rank_order.is_legacy(s) or s.get("micro_batches") for s in states):
        return None
    bad = [sorted(set().union(*(s["bad_read"][i] for s in states))) for i in range(len(states[0]["bad_read"]))]
    return dict(states[0], bad_read=bad)


class TokenStream:
    """Endless, resumable train batches for one data-parallel rank, plus its deterministic validation batches."""

    def __init__(self, sources, micro_batch_size, seq_len, dp_rank=0, dp_world=1, num_workers=0, seed=0,
                 mix_shards=4, bad_shards="fail", pin_memory=False, cache_dir=None, decide=None, global_batch_size=None,
                 canonical_streams=None, verify="hash", fetch_threads=8, preempt_signals=(), stages=(), ramp=None,
                 stage_lengths=()):
        need(micro_batch_size >= 1, f"micro_batch_size must be >= 1, got {micro_batch_size}")
        need(num_workers >= 0, f"num_workers must be >= 0, got {num_workers}")
        need(0 <= dp_rank < dp_world, f"dp_rank must be in [0, dp_world={dp_world}), got {dp_rank}")
        need(mix_shards >= 1, f"mix_shards must be >= 1, got {mix_shards}")
        need(fetch_threads >= 1, f"data.fetch_threads must be >= 1, got {fetch_threads}")
        need(bad_shards in BAD_SHARDS, f"bad_shards must be one of {', '.join(BAD_SHARDS)}, got {bad_shards!r}")
        G = global_batch_size or micro_batch_size * dp_world
        need(G % (micro_batch_size * dp_world) == 0, f"global_batch_size={G} is not divisible by micro_batch_size × "
                                                     f"dp_world = {micro_batch_size} × {dp_world}")
        self.asked_streams = canonical_streams   # None: the default, or a checkpoint's
        self.canonical_streams = C = canonical_streams or default_streams(G)
        check_streams(C, G)
        read = isinstance(sources, list) and sources and all(isinstance(s, Opened) for s in sources)  # by the launch check
        self.parts, self.verify = open_sources(sources if read else as_sources(sources), cache_dir, verify), verify
        self.manifest = m = self.parts[0].manifest
        self.lengths = fit(m, seq_len)   # samples of n tokens cut or joined into the model's seq_len (lengths.py)
        self.shard_dir, self.micro_batch_size, self.seq_len = self.parts[0].source.path, micro_batch_size, seq_len
        self.dp_rank, self.dp_world, self.num_workers, self.seed = dp_rank, dp_world, num_workers, seed
        self.mix_shards, self.bad_shards, self.global_batch_size = mix_shards, bad_shards, G
        self.fetch_threads, self.decide = fetch_threads, decide or (lambda fn: fn())
        self.pin_memory = pin_memory   # page-locked batches: the copy to a GPU does not make the host wait
        self.preempt_signals = tuple(preempt_signals)
        self.dtype, self.member = DTYPES[m["dtype"]]
        self.fmt = (self.member, (m["seq_len"] + 1) * np.dtype(self.dtype).itemsize)  # what each file sample holds
        self.retries = 0   # fetches retried in this process (validation); train batches carry theirs
        # every listed shard of each source's splits, sorted by name: nothing is requested before it is read
        self.shards = [{split: sorted((s["name"], s["samples"]) for s in info["shards"])
                        for split, info in p.manifest["splits"].items()} for p in self.parts]
        self.skipped_shards = []
        self.train = self.shards[0]["train"]
        self.ramp = ramp or BatchRamp.constant(G)   # the global batch of each step (train.batch_ramp); data.stages:
        self.blend = blend_of([p.source.weight for p in self.parts], [(self.ramp.samples_before(k), w) for k, w in stages])
        self.lo, self.hi, self.grad_accum = *rank_slice(G, dp_rank, dp_world), G // (micro_batch_size * dp_world)
        self.stage_lengths = StageLengths(seq_len, [(self.ramp.samples_before(k), L) for k, L in stage_lengths])
        self._order(C)
        self.notes = [f"data.num_workers={num_workers}, but the order has {C} canonical streams (data.canonical_"
                      f"streams) and a worker reads whole streams: {self.workers} workers read them"
                      ] if num_workers > self.workers else []
        self.notes += [f"the shards in {p.source.path} are of manifest format 1, without content hashes: checking "
                       f"their sizes only (data.verify=size); rebuild them with {MAKE} to have them hashed"
                       for p in self.parts if verify == "hash" and not p.files.hashing]
        self._pos, self._into = self.blend.start(), 0   # the position, and micro-batches into its next global batch
        self._bad = [set() for _ in self.parts]
        self._legacy = None   # micro-batches consumed in the old order, once an old data state is loaded
        self._v1 = None       # the order of canonical streams dealt by shard, once such a data state is loaded
        self._live = 0  # id of the one live iterator

    def _order(self, C):
        self.canonical_streams = C
        self.orders = [SourceOrder(self.model_samples(self._split(i, "train")), self.key(p.source), C, self.mix_shards)
                       for i, p in enumerate(self.parts)]
        self._urls = {p.files.url(name): (i, name)   # a train shard's URL -> (source, name)
                      for i, p in enumerate(self.parts) for name, _ in self.orders[i].shards}
        self.workers = min(self.num_workers, C)   # 0: read in this process

    def model_samples(self, shards):
        """[(name, file samples)] as the model's samples, none of shards too short to give one (tokendata/lengths.py)."""
        return [(name, self.lengths.samples(count)) for name, count in shards if self.lengths.samples(count)]

    def key(self, source):
        """The seed string of a source's shuffles: the seed, and the name of a named source."""
        return f"{self.seed}/{source.name}" if source.name else str(self.seed)

    def _split(self, i, split):
        shards, source = self.shards[i].get(split, []), self.parts[i].source
        if not shards and self.parts[i].manifest["splits"].get(split, {}).get("shards"):
            raise DataError(f"every {split} shard in {source.label} is bad (skipped: data.bad_shards=skip): "
                            f"rebuild it with {MAKE}")
        need(shards, f"no shards for split '{split}' in {source.label} (manifest.json lists none): rebuild it with "
                      f"{MAKE}" + (" --val-fraction > 0" if split == "val" else ""))
        return shards

    # ---- train stream ----

    def __iter__(self):
        self._live += 1
        return self._batches(self._live)

    def _batches(self, me):
        try:
            if self._legacy is not None:
                yield from self._legacy_batches(me)   # endless
            if self._v1 is not None:
                loader, share, workers = self._v1.loader(self._bad), self._v1.share, self._v1.workers
            else:
                loader = torch.utils.data.DataLoader(RankPieces(self._plan()), batch_size=None, collate_fn=as_is,
                                                     num_workers=self.workers,
                                                     prefetch_factor=2 if self.workers else None)
                share, workers = lambda got: join_pieces(got, self._batch() // self.dp_world, self.seq_len), self.workers
            pieces, B, skip = start(loader, self.preempt_signals), self.micro_batch_size, self._into
            while True:
                accum = self._batch() // (B * self.dp_world)   # of this global batch (it grows along a ramp)
                L = self.stage_lengths.at(self._v1.pos.samples if self._v1 is not None else self._pos.samples)
                got = share([next(pieces) for _ in range(max(1, workers))])
                for k in range(skip, accum):
                    self._check_live(me)
                    first = k == skip   # what the readers learned rides on the step's first micro-batch
                    batch = rows({"tokens": got["tokens"][k * B:(k + 1) * B], "ids": got["ids"][k * B:(k + 1) * B],
                                  "skipped_shards": got["skipped_shards"] if first else [],
                                  "retries": got["retries"] if first else 0}, L)
                    if first:
                        for url in batch["skipped_shards"]:
                            source, name = self._urls[url]
                            self._bad[source].add(name)
                    self._into = k + 1   # counted when handed over, so prefetched batches are not part of the position
                    if self._into == accum:
                        self._advance()
                        self._into = 0
                    yield self._as_tensors(batch)
                skip = 0
        except DataError as e:
            raise one_line(e) from None

    def _advance(self):
        """The position past one more global batch."""
        if self._v1 is not None:
            self._v1.advance()
        else:
            self.blend.picks(self._pos, self.ramp.size_at(self._pos.samples))

    def _batch(self) -> int:
        """G_s, the samples of the next global batch (step s's of train.batch_ramp), over all ranks."""
        return self.global_batch_size if self._v1 is not None else self.ramp.size_at(self._pos.samples)

    def _legacy_batches(self, me):
        for batch in start(rank_order.loader(self, self._legacy, self._bad[0]), self.preempt_signals):
            self._check_live(me)
            batch = rows(batch, self.stage_lengths.at(self._legacy // self.grad_accum * self.global_batch_size))
            self._legacy += 1
            self._bad[0].update(self._urls[url][1] for url in batch["skipped_shards"])
            yield self._as_tensors(batch)

    def _check_live(self, me):
        if me != self._live:
            raise RuntimeError("stale TokenStream iterator: a newer iter() or load_state_dict() replaced it")

    def _plan(self) -> Plan:
        parts = [Part(order, p.files, dict(shards["train"]), p.source.name, frozenset(bad))
                 for order, p, shards, bad in zip(self.orders, self.parts, self.shards, self._bad)]
        return Plan(parts, self.blend, self.canonical_streams, self.ramp, self.dp_rank, self.dp_world,
                    self._pos.copy(), self.fmt, self.dtype, self.member, self.bad_shards, self.fetch_threads,
                    self.parts[0].files.cache_dir, self.lengths)

    def collate(self, samples):
        return collate(samples, self.dtype, self.member)

    def _as_tensors(self, batch):
        tokens = torch.from_numpy(np.ascontiguousarray(batch["tokens"]))
        return dict(batch, tokens=tokens.pin_memory() if self.pin_memory else tokens)

    @property
    def legacy_order(self):
        """Whether this stream reads in the order of a run started before canonical streams (tokendata/rank_order.py)."""
        return self._legacy is not None

    @property
    def order_words(self) -> str:
        """The order this stream reads, for the log."""
        C, G = self.canonical_streams, self.global_batch_size
        if self._legacy is not None:
            return ("the order of a run started before canonical streams, bound to its layout (a relayout starts the "
                    "canonical order at its step)")
        if self._v1 is not None:
            return (f"{self._v1.C} canonical streams dealt by shard (the order of this run's checkpoints): the same "
                    f"global batches on any data-parallel size dividing {self._v1.C}")
        return (f"{C} canonical streams (data.canonical_streams), samples {self.lo}-{self.hi - 1} of each full global "
                f"batch on this rank: the same global batches on any data-parallel size dividing {G}")

    def upcoming_shards(self, worker=0, source=0):
        """The shards of `source` that the draws of DataLoader worker `worker` of this rank read first (in the next
        global batch), in the order of those draws: the ones it waits for first."""
        if self._v1 is not None:
            return self._v1.upcoming(worker, source, self._bad[source])
        lay, order, out = layout(self.blend, self._pos.copy(), self._batch(), self.canonical_streams), \
            self.orders[source], []
        lo, hi = rank_slice(self._batch(), self.dp_rank, self.dp_world)
        for i in range(lo, hi):
            c = int(lay.streams[i])
            if lay.sources[i] == source and c % max(1, self.workers) == worker:
                name = order.draw(c, int(lay.draws[i]), lambda shard: shard in self._bad[source])[0]
                out += [name] if name not in out else []
        return out

    def bad_found(self) -> set[str]:
        """The URLs of the shards found bad while reading (data.bad_shards=skip), before a resume too."""
        return {self.parts[i].files.url(name) for i, bad in enumerate(self._bad) for name in bad}

    def progress(self):
        """Per source {"name", "samples", "tokens", "epochs"}: what all ranks have read of it so far."""
        out = []
        for i, p in enumerate(self.parts):
            n = (self._v1.pos.counts[i] if self._v1 is not None else self._pos.counts[i]) if self._legacy is None \
                else self._legacy * self.micro_batch_size * self.dp_world
            total = sum(count for _, count in self.orders[i].shards)
            out.append({"name": p.source.name, "samples": n, "tokens": n * self.seq_len, "epochs": n / total})
        return out

    # ---- Stateful ----

    def state_dict(self):
        if self._legacy is not None:
            return rank_order.state_dict(self, self._legacy, self._bad[0])
        position = self._v1.state() if self._v1 is not None else {
            "order": ORDER, "samples": self._pos.samples, "counts": list(self._pos.counts)}
        return {**position, "micro_batches": self._into,
                **{key: getattr(self, key) for key in SETTING_KEYS if key not in position},
                "sources": self._fingerprint(), "bad_read": [sorted(bad) for bad in self._bad],
                "layout": {"dp_rank": self.dp_rank, "dp_world": self.dp_world,
                           "micro_batch_size": self.micro_batch_size, "global_batch_size": self.global_batch_size},
                "batch_ramp": self.ramp.key(),
                "position": self.progress()}   # for people reading a checkpoint

    def _fingerprint(self):
        return [{"name": p.source.name, "weight": p.source.weight, "train_samples":
                 p.manifest["splits"]["train"]["samples"]} for p in self.parts]

    def _started_with(self):
        """Each source's train shards as a run of an older order started with them: less those its size check at the
        start dropped (data.bad_shards=skip), decided by one rank."""
        if self.bad_shards != "skip" or self.verify == "none":
            return [shards["train"] for shards in self.shards]
        good, self.skipped_shards = self.decide(lambda: good_shards(self.parts, self.bad_shards)[:2])
        return [shards["train"] for shards in good]

    def load_state_dict(self, sd):
        self._live += 1  # an iterator made before this no longer matches the position
        self._v1 = None
        need(sd.get("batch_ramp") == self.ramp.key(), f"cannot resume the data stream: its steps' global batches "
             f"follow train.batch_ramp={sd.get('batch_ramp')}, this run's {self.ramp.key()} (in samples); set it back")
        if rank_order.is_legacy(sd):
            self.train = self._started_with()[0]
            self._legacy, bad = rank_order.check_state(self, sd)
            self._bad = [bad]
            return
        for key in ("samples", "counts", "micro_batches", "sources", "bad_read", "layout", *SETTING_KEYS):
            need(key in sd, f"data state has no '{key}': not a TokenStream.state_dict()")
        if self.asked_streams is None and sd["canonical_streams"] != self.canonical_streams:
            self._order(int(sd["canonical_streams"]))   # data.canonical_streams=null: the run's own
        for key, where in SETTING_KEYS.items():
            need(sd[key] == getattr(self, key),
                 f"cannot resume the data stream: its order has {where}={sd[key]}, this run has "
                 f"{getattr(self, key)}; the samples of every global batch depend on it: run with {where}={sd[key]}")
        theirs, ours = sd["sources"], self._fingerprint()
        describe = lambda sources: ", ".join(f"{s['name'] or 'data.shard_dir'} (weight {s['weight']:g}, "  # noqa
                                             f"{s['train_samples']} train samples)" for s in sources)
        need(theirs == ours, f"cannot resume the data stream: it read {describe(theirs)}, this run reads "
                             f"{describe(ours)}; a blend cannot change within a run: set data.sources back, or start "
                             f"a new run from a release of this one (train.init_from)")
        if sd["micro_batches"]:
            need(sd["layout"] == self.state_dict()["layout"],
                 f"cannot resume the data stream: it stopped inside a global batch, in the layout {sd['layout']}; "
                 f"resume it in that layout")
        if sd.get("order") == shard_stream_order.ORDER:
            self._v1 = shard_stream_order.Mode(self, sd, self._started_with())
        else:
            self._pos = Position(int(sd["samples"]), list(sd["counts"]))
        self._into = int(sd["micro_batches"])
        self._bad, self._legacy = [set(bad) for bad in sd["bad_read"]], None

    def start_at(self, step):
        """The position after `step` global batches (of the ramp's sizes), from the start."""
        self._live += 1   # (position_at(1, P): after the first P picks)
        self._pos, self._into, self._legacy, self._v1 = self.blend.position_at(1, self.ramp.samples_before(step)), 0, \
            None, None
        self._bad = [set() for _ in self.parts]

    # ---- validation ----

    def val_batches(self, max_batches=None, split="val", source=0):
        """The same batches on every call. Rank r takes the block of K = ceil(ceil(total / dp_world) / B) batches that
        starts at sample r*K*B in manifest order (the last rank wraps round to the start), so every rank runs the same
        number of batches, the blocks are disjoint until the wrap, and max_batches takes a prefix of each block."""
        files = self._split(source, split)  # checked here, not at the first next(): errors surface where the call is
        shards = self.model_samples(files)   # in the model's samples (tokendata/lengths.py)
        need(shards, f"{split} shards of {self.parts[source].source.label} too short to join to model.max_seq_len")
        total = sum(c for _, c in shards)
        full = math.ceil(math.ceil(total / self.dp_world) / self.micro_batch_size)
        n_batches = full if max_batches is None else min(full, max_batches)
        samples = self._samples_from(source, split, shards, dict(files), self.dp_rank * full * self.micro_batch_size
                                     % total)
        return (self._as_tensors(self.collate(list(itertools.islice(samples, self.micro_batch_size))))
                for _ in range(n_batches))

    def _samples_from(self, source, split, shards, files, start):
        """Model samples in manifest order from global index `start`, wrapping round (`shards`: [(name, model
        samples)]; `files`: name -> file samples); shards before it are not opened. A shard found bad here
        (bad_shards="skip") is passed over, so the rest of the split moves up."""
        reader, prefix = ShardReader(self.parts[source].files, self.fmt, self.bad_shards, split, len(shards)), \
            self.parts[source].source.name
        i = 0
        while start >= shards[i][1]:
            start -= shards[i][1]
            i += 1
        while True:
            name, count = shards[i]
            samples = self.lengths.regroup(reader.read(name, files[name]), self.member,
                                           np.dtype(self.dtype).itemsize)[start:]
            self.retries, reader.retries = self.retries + reader.retries, 0   # read in this process: counted here
            for sample in map(reader.tag, samples):
                yield dict(sample, __key__=f"{prefix}/{sample['__key__']}") if prefix else sample
            i, start = (i + 1) % len(shards), 0
