"""Streaming, resumable token batches from the WebDataset shards that tools/make_shards.py writes, from one shard set
or several blended by weight.

Public API (the shard format, the manifest, DataError and the checks against a model: tokendata/shards.py)
    TokenStream(sources, micro_batch_size, seq_len, dp_rank=0, dp_world=1, num_workers=0, seed=0, mix_shards=4,
                bad_shards="fail", pin_memory=False, cache_dir=None, decide=None, global_batch_size=None,
                canonical_streams=None, verify="hash")
                            sources: a shard location (data.shard_dir) or a list of Source / {"name", "path",
                            "weight"} (data.sources, tokendata/sources.py); global_batch_size: G, the samples of one
                            optimizer step over all ranks (default micro_batch_size × dp_world); canonical_streams: C
                            (default tokendata.order.default_streams(G)); decide(fn): fn's result as one rank computed
                            it, on every rank, for the size check (the trainer's pretrain.distributed.from_rank0)
        iter(stream)        endless train micro-batches {"tokens": LongTensor (B, n+1), "ids": [B sample ids,
                            "<source name>/<key>" for a named source], "skipped_shards": [URLs of shards found bad
                            while this batch was read; usually []], "retries": fetches retried (network faults)}; each
                            G / (B × dp_world) of them in a row are this rank's share of one global batch
        skipped_shards      [(URL, reason)]: the train and val shards dropped at construction (bad_shards="skip")
        retries             fetches retried in this process (size checks, validation); the workers' ride on batches
        notes               what the stream decided that a log should say (workers left idle; format-1 shards,
                            which have no content hashes, checked by size only), as lines
        verify              "hash" | "size" | "none": what is checked of each shard (tokendata/shard_files.py)
        state_dict(), load_state_dict(sd)      Stateful: the position, in any layout (below)
        start_at(step)      the position after `step` global batches (a checkpoint without a data position)
        progress()          per source: samples and tokens read by all ranks so far, and epochs (fractional)
        val_batches(max_batches=None, split="val", source=0)   finite, the same batches on every call and count on
                            every rank, of one source (an index)
        worker_streams(worker), upcoming_shards(worker=0, source=0)    the canonical streams a DataLoader worker of
                            this rank serves, and the shards it fetches first from the position

Order (tokendata/order.py): a function of the data settings (sources and weights, C, seed, mix_shards, seq_len) and
the manifests alone. Global batch g is the same G samples, in the same order, whatever dp_world, num_workers,
micro_batch_size or accumulation read it; rank r's share is that of its C/dp_world canonical streams, which its
workers split (a worker left without a stream is not started: `notes`). The position is per stream: the slots taken
and each source's count, plus the shards found bad while reading; it is the same on every rank. A stream resumed in
another layout goes on at the next global batch; one stopped inside a global batch (never the trainer, which saves
between steps) resumes only in its own layout. Checkpoints written before canonical streams hold the old position
(a count of micro-batches): loading one switches the stream to the old order (tokendata/legacy.py), in its layout.

The trainer must call iter() again after load_state_dict; a stream has one live iterator (an older one raises).

Where shards are: a directory or a URL (http(s)://, pipe:COMMAND, s3:// and other fsspec schemes;
tokendata/remote.py). Every shard is fetched whole and parsed from memory, so a fetch retried after a network fault
hands out each sample once; the order never depends on where the bytes came from. Each train shard is fetched once an
epoch, by the one reader whose stream it is dealt to, while the group before it is handed out. cache_dir (optional)
keeps local copies keyed by shard name and size.

Bad shards: a damaged shard is a DataError naming its path (bad_shards="fail"), or is left out (bad_shards="skip").
    At construction, without opening a shard: a missing file (HTTP 404, 403…), an empty one, or a size other than the
    manifest's "bytes" makes a shard bad. With "skip" it is dropped from its split before any order is computed and
    listed in stream.skipped_shards, so the same files give the same order in every layout.
    While reading, a shard whose content hash differs from the manifest's (twice, the second time past cache_dir:
    verify="hash"), that tarfile cannot parse, or whose sample count or sample sizes differ from the manifest, is bad: with "skip" its samples are dropped, a warning naming it goes to stderr (from the DataLoader worker) and
    the batch that takes its stream's next sample lists its path in "skipped_shards" (count distinct paths). Which
    stream reads a shard does not depend on the layout, so global batches stay the same in every layout; the position
    records the shards found bad, so a resume in the same layout is exact, and in another layout too when the position
    of every rank is merged (`merged_state`: the universal checkpoint does it).
"""
from __future__ import annotations

import itertools
import math

import numpy as np
import torch

from tokendata import legacy
from tokendata.order import Blend, Position, SourceOrder, check_streams, default_streams, rank_streams
from tokendata.reading import Part, Plan, RankPieces, as_is, collate
from tokendata.shard_files import ShardReader
from tokendata.shards import DTYPES, MAKE, DataError, check_seq_len, need
from tokendata.sources import as_sources, good_shards, open_sources

ORDER = "canonical streams"
BAD_SHARDS = ("fail", "skip")
SETTING_KEYS = {"canonical_streams": "data.canonical_streams", "seed": "data.seed", "mix_shards": "mix_shards",
                "seq_len": "model.max_seq_len"}


def _one_line(e):
    """A DataError the DataLoader re-raises from a worker holds the worker's traceback; its own is the last line."""
    last, prefix = str(e).rstrip().rsplit("\n", 1)[-1], f"{DataError.__module__}.DataError: "
    return DataError(last[len(prefix):]) if "\n" in str(e) and last.startswith(prefix) else e


def merged_state(states: list[dict]) -> dict | None:
    """One position for a run in any layout from its ranks' data states (each knows the shards its own streams found
    bad), or None where they are not of the canonical order or one stopped inside a global batch."""
    if not states or any(legacy.is_legacy(s) or s.get("micro_batches") for s in states):
        return None
    bad = [sorted(set().union(*(s["bad_read"][i] for s in states))) for i in range(len(states[0]["bad_read"]))]
    return dict(states[0], bad_read=bad)


class TokenStream:
    """Endless, resumable train batches for one data-parallel rank, plus its deterministic validation batches."""

    def __init__(self, sources, micro_batch_size, seq_len, dp_rank=0, dp_world=1, num_workers=0, seed=0,
                 mix_shards=4, bad_shards="fail", pin_memory=False, cache_dir=None, decide=None,
                 global_batch_size=None, canonical_streams=None, verify="hash"):
        need(micro_batch_size >= 1, f"micro_batch_size must be >= 1, got {micro_batch_size}")
        need(num_workers >= 0, f"num_workers must be >= 0, got {num_workers}")
        need(0 <= dp_rank < dp_world, f"dp_rank must be in [0, dp_world={dp_world}), got {dp_rank}")
        need(mix_shards >= 1, f"mix_shards must be >= 1, got {mix_shards}")
        need(bad_shards in BAD_SHARDS, f"bad_shards must be one of {', '.join(BAD_SHARDS)}, got {bad_shards!r}")
        G = global_batch_size or micro_batch_size * dp_world
        need(G % (micro_batch_size * dp_world) == 0, f"global_batch_size={G} is not divisible by micro_batch_size × "
                                                     f"dp_world = {micro_batch_size} × {dp_world}")
        self.canonical_streams = C = canonical_streams or default_streams(G)
        check_streams(C, G, dp_world)
        self.parts, self.verify = open_sources(as_sources(sources), cache_dir, verify), verify
        self.manifest = m = self.parts[0].manifest
        check_seq_len(m, seq_len, training=True)   # a sample holds exactly seq_len + 1 tokens
        self.shard_dir, self.micro_batch_size, self.seq_len = self.parts[0].source.path, micro_batch_size, seq_len
        self.dp_rank, self.dp_world, self.num_workers, self.seed = dp_rank, dp_world, num_workers, seed
        self.mix_shards, self.bad_shards, self.global_batch_size = mix_shards, bad_shards, G
        self.pin_memory = pin_memory   # page-locked batches: the copy to a GPU does not make the host wait
        self.dtype, self.member = DTYPES[m["dtype"]]
        self.fmt = (self.member, (seq_len + 1) * np.dtype(self.dtype).itemsize)  # what each sample must hold
        self.retries = 0   # fetches retried in this process (size checks, validation); train batches carry theirs
        # the good shards of each source's splits, and (URL, reason) of those the size check dropped. decide(fn): fn's
        # result as one rank computed it, on every rank (all train on one list, checked by one rank's requests)
        self.shards, self.skipped_shards = (decide or (lambda fn: fn()))(self._check_shards)
        self.orders = [SourceOrder(self._split(i, "train"), self._key(p.source), C, mix_shards)
                       for i, p in enumerate(self.parts)]
        self.train = self.shards[0]["train"]
        self.blend = Blend([p.source.weight for p in self.parts], C)
        self.streams = rank_streams(C, dp_rank, dp_world)
        self.per_stream, self.grad_accum = G // C, G // (micro_batch_size * dp_world)
        self.workers = min(num_workers, len(self.streams))   # 0: read in this process
        self.notes = [f"data.num_workers={num_workers}, but each rank serves {len(self.streams)} of the "
                      f"{C} canonical streams (data.canonical_streams): {self.workers} workers read them"
                      ] if num_workers > self.workers else []
        self.notes += [f"the shards in {p.source.path} are of manifest format 1, without content hashes: checking their "
                       f"sizes only (data.verify=size); rebuild them with {MAKE} to have them hashed"
                       for p in self.parts if verify == "hash" and not p.files.hashing]
        self._urls = {p.files.url(name): (i, name)   # a train shard's URL -> (source, name)
                      for i, p in enumerate(self.parts) for name, _ in self.orders[i].shards}
        self._pos, self._into = self.blend.start(), 0   # the position, and micro-batches into its next global batch
        self._bad = [set() for _ in self.parts]
        self._legacy = None   # micro-batches consumed in the old order, once an old data state is loaded
        self._live = 0  # id of the one live iterator

    def _check_shards(self):
        good, skipped, retries = good_shards(self.parts, self.bad_shards)
        self.retries += retries
        return good, skipped

    def _key(self, source):
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
            loader = torch.utils.data.DataLoader(RankPieces(self._plan()), batch_size=None, collate_fn=as_is,
                                                 num_workers=self.workers,
                                                 prefetch_factor=2 if self.workers else None)
            pieces, B, skip = iter(loader), self.micro_batch_size, self._into
            while True:
                share = self._share([next(pieces) for _ in range(max(1, self.workers))])
                for k in range(skip, self.grad_accum):
                    self._check_live(me)
                    first = k == skip   # what the readers learned rides on the step's first micro-batch
                    batch = {"tokens": share["tokens"][k * B:(k + 1) * B], "ids": share["ids"][k * B:(k + 1) * B],
                             "skipped_shards": share["skipped_shards"] if first else [],
                             "retries": share["retries"] if first else 0}
                    if first:
                        for url in batch["skipped_shards"]:
                            source, name = self._urls[url]
                            self._bad[source].add(name)
                    self._into = k + 1   # counted when handed over, so prefetched batches are not part of the position
                    if self._into == self.grad_accum:
                        self.blend.advance(self._pos, self.global_batch_size)
                        self._into = 0
                    yield self._as_tensors(batch)
                skip = 0
        except DataError as e:
            raise _one_line(e) from None

    def _legacy_batches(self, me):
        for batch in legacy.loader(self, self._legacy, self._bad[0]):
            self._check_live(me)
            self._legacy += 1
            self._bad[0].update(self._urls[url][1] for url in batch["skipped_shards"])
            yield self._as_tensors(batch)

    def _check_live(self, me):
        if me != self._live:
            raise RuntimeError("stale TokenStream iterator: a newer iter() or load_state_dict() replaced it")

    def _plan(self) -> Plan:
        parts = [Part(order, p.files, dict(order.shards), p.source.name, frozenset(bad))
                 for order, p, bad in zip(self.orders, self.parts, self._bad)]
        return Plan(parts, self.blend, self.streams, self.global_batch_size, self._pos.copy(), self.fmt, self.dtype,
                    self.member, self.bad_shards)

    def _share(self, pieces):
        """This rank's share of one global batch, in stream order, from one piece of each worker."""
        L, tokens, ids = self.per_stream, {}, {}
        for piece in pieces:   # each stream gives G/C samples to a global batch
            for j, c in enumerate(piece["streams"]):
                tokens[c], ids[c] = piece["tokens"][j * L:(j + 1) * L], piece["ids"][j * L:(j + 1) * L]
        return {"tokens": np.concatenate([tokens[c] for c in self.streams]),
                "ids": [i for c in self.streams for i in ids[c]],
                "skipped_shards": [u for piece in pieces for u in piece["skipped_shards"]],
                "retries": sum(piece["retries"] for piece in pieces)}

    def collate(self, samples):
        return collate(samples, self.dtype, self.member)

    def _as_tensors(self, batch):
        tokens = torch.from_numpy(batch["tokens"])
        return dict(batch, tokens=tokens.pin_memory() if self.pin_memory else tokens)

    @property
    def legacy_order(self):
        """Whether this stream reads in the order of a run started before canonical streams (tokendata/legacy.py)."""
        return self._legacy is not None

    def worker_streams(self, worker):
        return self.streams[worker::max(1, self.workers)]

    def upcoming_shards(self, worker=0, source=0):
        order, bad = self.orders[source], frozenset(self._bad[source])
        return [name for c in self.worker_streams(worker)
                for name in next(order.walk(c, self._pos.streams[c][source], bad))["names"]]

    def progress(self):
        """Per source {"name", "samples", "tokens", "epochs"}: what all ranks have read of it so far."""
        out = []
        for i, p in enumerate(self.parts):
            n = self._pos.counts[i] if self._legacy is None else self._legacy * self.micro_batch_size * self.dp_world
            total = sum(count for _, count in self.orders[i].shards)
            out.append({"name": p.source.name, "samples": n, "tokens": n * self.seq_len, "epochs": n / total})
        return out

    # ---- Stateful ----

    def state_dict(self):
        if self._legacy is not None:
            return legacy.state_dict(self, self._legacy, self._bad[0])
        return {"order": ORDER, "samples": self._pos.samples, "counts": list(self._pos.counts),
                "stream_counts": [list(c) for c in self._pos.streams], "micro_batches": self._into,
                **{key: getattr(self, key) for key in SETTING_KEYS}, "sources": self._fingerprint(),
                "bad_read": [sorted(bad) for bad in self._bad],
                "layout": {"dp_rank": self.dp_rank, "dp_world": self.dp_world,
                           "micro_batch_size": self.micro_batch_size, "global_batch_size": self.global_batch_size},
                "position": self.progress()}   # for people reading a checkpoint

    def _fingerprint(self):
        return [{"name": p.source.name, "weight": p.source.weight, "train_samples":
                 p.manifest["splits"]["train"]["samples"]} for p in self.parts]

    def load_state_dict(self, sd):
        self._live += 1  # an iterator made before this no longer matches the position
        if legacy.is_legacy(sd):
            self._legacy, bad = legacy.check_state(self, sd)
            self._bad = [bad]
            return
        for key in ("samples", "counts", "stream_counts", "micro_batches", "sources", "bad_read", "layout",
                    *SETTING_KEYS):
            need(key in sd, f"data state has no '{key}': not a TokenStream.state_dict()")
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
        self._pos = Position(int(sd["samples"]), list(sd["counts"]), [list(c) for c in sd["stream_counts"]])
        self._into = int(sd["micro_batches"])
        self._bad, self._legacy = [set(bad) for bad in sd["bad_read"]], None

    def start_at(self, step):
        """The position after `step` global batches of this global batch size, from the start."""
        self._live += 1
        self._pos, self._into, self._legacy = self.blend.position_at(step, self.global_batch_size), 0, None
        self._bad = [set() for _ in self.parts]

    # ---- validation ----

    def val_batches(self, max_batches=None, split="val", source=0):
        """The same batches on every call. Rank r takes the block of K = ceil(ceil(total / dp_world) / B) batches that
        starts at sample r*K*B in manifest order (the last rank wraps round to the start), so every rank runs the same
        number of batches, the blocks are disjoint until the wrap, and max_batches takes a prefix of each block."""
        shards = self._split(source, split)  # checked here, not at the first next(): errors surface where the call is
        total = sum(c for _, c in shards)
        full = math.ceil(math.ceil(total / self.dp_world) / self.micro_batch_size)
        n_batches = full if max_batches is None else min(full, max_batches)
        samples = self._samples_from(source, split, shards, self.dp_rank * full * self.micro_batch_size % total)
        return (self._as_tensors(self.collate(list(itertools.islice(samples, self.micro_batch_size))))
                for _ in range(n_batches))

    def _samples_from(self, source, split, shards, start):
        """Samples in manifest order from global index `start`, wrapping round; shards before it are not opened. A
        shard found bad here (bad_shards="skip") is passed over, so the rest of the split moves up."""
        reader, prefix = ShardReader(self.parts[source].files, self.fmt, self.bad_shards, split, len(shards)), \
            self.parts[source].source.name
        i = 0
        while start >= shards[i][1]:
            start -= shards[i][1]
            i += 1
        while True:
            name, count = shards[i]
            samples = reader.read(name, count)[start:]
            self.retries, reader.retries = self.retries + reader.retries, 0   # read in this process: counted here
            for sample in map(reader.tag, samples):
                yield dict(sample, __key__=f"{prefix}/{sample['__key__']}") if prefix else sample
            i, start = (i + 1) % len(shards), 0
