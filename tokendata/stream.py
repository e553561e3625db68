"""Streaming, resumable token batches from the WebDataset shards that tools/make_shards.py writes.

Public API (the shard format, the manifest, DataError and the checks against a model: tokendata/shards.py)
    TokenStream(shard_dir, micro_batch_size, seq_len, dp_rank=0, dp_world=1, num_workers=0, seed=0, mix_shards=4,
                bad_shards="fail", pin_memory=False, cache_dir=None, decide=None, verify="hash")
                            decide(fn): fn's result as one rank computed it, on every rank, for the size check
                            (the trainer's pretrain.distributed.from_rank0; None: this process checks alone)
        iter(stream)        endless train batches {"tokens": LongTensor (B, n+1), "ids": [B sample-id strings],
                            "skipped_shards": [URLs of shards found bad while this batch was read; usually []],
                            "retries": fetches retried (network faults) while this batch was read; usually 0}
        skipped_shards      [(URL, reason)]: the train and val shards dropped at construction (bad_shards="skip")
        notes               [lines for the log]: what the reading does differently from what was asked (format-1
                            shards have no content hashes: verify="hash" checks their sizes only)
        verify              "hash" | "size" | "none": what is checked of each shard (tokendata/shard_files.py)
        bad_shards_read     names of the shards that the handed-out batches reported bad (kept in state_dict)
        retries             fetches retried in this process (size checks, validation); the workers' ride on batches
        state_dict(), load_state_dict(sd)      Stateful: the batches this rank has consumed, plus the settings they
                                               depend on; a new iterator continues exactly where the saved one was
        val_batches(max_batches=None)          finite, the same batches on every call, the same count on every rank
        worker_shards(epoch, worker) -> [names]    the train shards one DataLoader worker of this rank reads in an epoch

Order of the train stream, a function of (manifest, seed, dp_world, num_workers, B, mix_shards) only:
    epoch e:  shards = the train shards shuffled by Random(f"{seed}/{e}"), the same list on every rank;
              rank r takes shards[r::dp_world] (the node splitter, by the data-parallel rank we are given: webdataset's
              split_by_node would use torch.distributed's global rank, wrong under tensor/pipeline parallelism);
              worker w of W takes those[w::W] (the worker splitter);
              the worker reads its shards in groups of mix_shards and pools and shuffles each group's samples with
              Random(f"{seed}/{e}/{r}/{w}/{group index}") (a shard is consecutive text: mixing a few varies a batch).
    A worker's samples run on from epoch to epoch without end and are cut into batches of B. The DataLoader
    (batch_size=None: batches are made in the workers) hands out batch j of the rank from worker j % W; since no
    worker's stream ends, that round robin is never broken and every rank can always take one more step.
Resume: after k consumed batches logical worker w has produced len(range(w, k, W)) of them. A new iterator's DataLoader
serves its physical worker 0 first, so physical worker p plays logical worker (p + k) % W, and each worker skips its
count x B samples: whole groups (and epochs) by the manifest's counts without opening them, then the head of one group,
read as bytes but not decoded. Changing dp_world, num_workers, B, seq_len, seed or mix_shards changes the order, so
load_state_dict refuses it: resuming under a new layout needs an explicit remap of the position.

The trainer must call iter() again after load_state_dict; a stream has one live iterator (an older one raises).

Where shards are: shard_dir is a directory or a URL (http(s)://, pipe:COMMAND, s3:// and other fsspec
schemes; tokendata/remote.py). Every shard is fetched whole and parsed from memory, so a fetch retried after a network
fault (resumed at the byte it reached) hands out each sample once; the order above never depends on where the bytes came
from, so the same sample ids and exact resume hold for every source. A worker fetches its next group of shards in a
thread while it hands out the current one. cache_dir (optional) keeps local copies keyed by shard name and size.

Bad shards: a damaged shard is a DataError naming its path (bad_shards="fail"), or is left out (bad_shards="skip").
    At construction, without opening a shard: a missing file (HTTP 404, 403…), an empty one, or a size other than
    the manifest's "bytes" (when recorded; older manifests lack it; a pipe: command cannot tell) makes a shard bad. With "skip" it is dropped from its split before any order
    is computed and listed in stream.skipped_shards, so the same files give the same order and resume stays exact.
    While reading, a shard whose content hash differs from the manifest's (twice: verify="hash"), that tarfile cannot
    parse, or whose sample count or sample sizes differ from the manifest, is bad: with "skip" its samples are
    dropped, a warning naming it goes to stderr (from the DataLoader worker) and the next batch lists its path in
    "skipped_shards" (workers are other processes: the batch is how the trainer learns of it); each worker of an
    iterator reports a shard once and does not reopen it, so the trainer should count distinct paths.
    The same after a resume: a shard found bad while reading gives no samples, in this epoch and every later one,
    wherever it is dealt; the stream keeps the names of those that the batches it handed out reported
    (state_dict()["bad_shards_read"]), and a resumed stream counts them as empty shards when it finds its position
    and does not open them again. So the resumed batches are the uninterrupted run's batches, sample for sample, also
    when the bad shard was found before the checkpoint (a shard that was not reported by then lies after the
    position: the resumed run finds it as the uninterrupted one did).
"""

import functools
import itertools
import math
import random
import threading
from concurrent.futures import Future

import numpy as np
import torch
import webdataset as wds

from tokendata import remote
from tokendata.shard_files import ShardFiles, ShardReader, fix
from tokendata.shards import DTYPES, MAKE, DataError, check_seq_len, need, read_manifest

# Not bad_shards: a run stopped by a bad shard must resume after switching to "skip".
STATE_KEYS = ("dp_rank", "dp_world", "num_workers", "micro_batch_size", "seq_len", "seed", "mix_shards")
BAD_SHARDS = ("fail", "skip")


# ---- pipeline stages (module level, so DataLoader workers can pickle them under any start method) ----

def split_by_dp_rank(src, rank, world):
    """Node splitter: this data-parallel rank's share of one epoch's shard list."""
    return itertools.islice(src, rank, None, world)


def split_by_loader_worker(src, worker, workers):
    """Worker splitter: one DataLoader worker's share of its rank's shards."""
    return itertools.islice(src, worker, None, workers)


def _worker():
    info = torch.utils.data.get_worker_info()
    return (info.id, info.num_workers) if info is not None else (0, 1)


class EpochShards(torch.utils.data.IterableDataset):
    """Pipeline source: what one (rank, worker) reads, epoch after epoch without end, starting `skip_batches` in.

    Yields groups of up to `mix` consecutive shards of the worker's epoch list, as {"names", "skip", "order_seed"}: a group's samples are pooled and shuffled together, because one shard holds consecutive text and a
    batch drawn from one shard alone would be one passage. The first group may start part-way (skip > 0).
    """

    def __init__(self, shards, seed, nodesplitter, mix, skip_batches, batch_size):
        self.shards, self.seed = shards, seed  # shards: [(name, samples)] sorted by name
        self.nodesplitter, self.mix, self.skip_batches, self.batch_size = nodesplitter, mix, skip_batches, batch_size
        self.rank = nodesplitter.keywords["rank"]

    def shards_for(self, epoch, worker, workers):
        order = list(self.shards)
        random.Random(f"{self.seed}/{epoch}").shuffle(order)  # the same permutation on every rank and worker
        return list(split_by_loader_worker(self.nodesplitter(order), worker, workers))

    def groups(self, epoch, worker, workers):
        mine = self.shards_for(epoch, worker, workers)
        return [mine[i : i + self.mix] for i in range(0, len(mine), self.mix)]

    def start(self, worker, workers):
        """(epoch, group index, samples to skip in that group) of this worker's next sample: manifest counts only."""
        skip = len(range(worker, self.skip_batches, workers)) * self.batch_size
        epoch = 0
        while True:
            for i, group in enumerate(self.groups(epoch, worker, workers)):
                n = sum(count for _, count in group)
                if skip < n:
                    return epoch, i, skip
                skip -= n
            epoch += 1

    def __iter__(self):
        physical, workers = _worker()
        # A new DataLoader serves its worker 0 first, but after k batches the next one is logical worker k % W's: so
        # physical worker p plays logical worker (p + k) % W, and the round robin goes on exactly as before.
        worker = (physical + self.skip_batches) % workers
        epoch, first, skip = self.start(worker, workers)
        while True:
            groups = self.groups(epoch, worker, workers)
            for i in range(first, len(groups)):
                yield {"names": [name for name, _ in groups[i]], "skip": skip,
                       "order_seed": f"{self.seed}/{epoch}/{self.rank}/{worker}/{i}"}
                skip = 0
            epoch, first = epoch + 1, 0


def shuffled_samples(src, counts, files, fmt, bad_shards, known_bad=()):
    """Each group's samples pooled in a seeded random order, minus the first `skip` of it (still bytes, not decoded).
    A bad shard (bad_shards="skip") adds no samples: the group is smaller, its order still a function of the seed.
    The next group's shards are fetched by a thread while this one's samples are handed out: over a network the
    worker does not wait a whole download at each group boundary (memory: two groups of shards)."""
    reader = ShardReader(files, fmt, bad_shards, "train", len(counts), known_bad)
    fetch = lambda group: [reader.fetch(name, counts[name]) for name in group["names"]]  # noqa: E731
    groups = iter(src)
    group = next(groups)
    fetched = in_background(fetch, group)
    while True:
        results = fetched.result()
        upcoming = next(groups)   # endless
        fetched = in_background(fetch, upcoming)
        samples = [s for name, r in zip(group["names"], results) for s in reader.accept(name, r)]
        order = list(range(len(samples)))
        random.Random(group["order_seed"]).shuffle(order)
        for j in order[group["skip"]:]:
            yield reader.tag(samples[j])
        group = upcoming


def in_background(fn, *args) -> Future:
    """fn(*args) in a daemon thread: a process that is done exits without waiting for a fetch it no longer needs."""
    future = Future()

    def run():
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # handed to whoever waits for the result
            future.set_exception(e)

    threading.Thread(target=run, daemon=True, name="shard-prefetch").start()
    return future


def collate(samples, dtype, member):
    """A batch whose tokens are a numpy array, not yet a tensor: a DataLoader worker sends it pickled through its pipe.
    A tensor would travel as a shared-memory file descriptor served by a thread of the worker, and a rank killed in
    mid-handover (kill -9) would leave that thread printing a ConnectionResetError traceback."""
    rows = [np.frombuffer(s[member], dtype=dtype) for s in samples]  # the bytes are decoded only here, when kept
    return {"tokens": np.stack(rows).astype(np.int64), "ids": [s["__key__"] for s in samples],
            "skipped_shards": [p for s in samples for p in s.get("__skipped__", ())],
            "retries": sum(s.get("__retries__", 0) for s in samples)}


def as_is(batch):
    """The DataLoader's collate_fn: its default would turn the numpy tokens into a tensor inside the worker."""
    return batch


def _one_line(e):
    """A DataError the DataLoader re-raises from a worker holds the worker's traceback; its own is the last line."""
    last, prefix = str(e).rstrip().rsplit("\n", 1)[-1], f"{DataError.__module__}.DataError: "
    return DataError(last[len(prefix):]) if "\n" in str(e) and last.startswith(prefix) else e


class TokenStream:
    """Endless, resumable train batches for one data-parallel rank, plus its deterministic validation batches."""

    def __init__(self, shard_dir, micro_batch_size, seq_len, dp_rank=0, dp_world=1, num_workers=0, seed=0,
                 mix_shards=4, bad_shards="fail", pin_memory=False, cache_dir=None, decide=None, verify="hash"):
        need(micro_batch_size >= 1, f"micro_batch_size must be >= 1, got {micro_batch_size}")
        need(num_workers >= 0, f"num_workers must be >= 0, got {num_workers}")
        need(0 <= dp_rank < dp_world, f"dp_rank must be in [0, dp_world={dp_world}), got {dp_rank}")
        self.manifest = m = read_manifest(shard_dir)
        check_seq_len(m, seq_len, training=True)   # a sample holds exactly seq_len + 1 tokens
        self.shard_dir, self.micro_batch_size, self.seq_len = shard_dir, micro_batch_size, seq_len
        self.dp_rank, self.dp_world, self.num_workers, self.seed = dp_rank, dp_world, num_workers, seed
        need(mix_shards >= 1, f"mix_shards must be >= 1, got {mix_shards}")
        self.mix_shards = mix_shards
        need(bad_shards in BAD_SHARDS, f"bad_shards must be one of {', '.join(BAD_SHARDS)}, got {bad_shards!r}")
        self.bad_shards = bad_shards
        self.pin_memory = pin_memory   # page-locked batches: the copy to a GPU does not make the host wait
        self.dtype, self.member = DTYPES[m["dtype"]]
        self.fmt = (self.member, (seq_len + 1) * np.dtype(self.dtype).itemsize)  # what each sample must hold
        self.files = ShardFiles(shard_dir, m, cache_dir, verify)
        self.verify = verify
        self.notes = [f"the shards in {shard_dir} are of manifest format 1, without content hashes: checking their "
                      f"sizes only (data.verify=size); rebuild them with {MAKE} to have them hashed"
                      ] if verify == "hash" and not self.files.hashing else []
        self.bad_shards_read: set[str] = set()   # names of shards the handed-out batches reported bad
        self._names = {self.files.url(name): name for name in self.files.records}
        self.retries = 0   # fetches retried in this process (size checks, validation); train batches carry theirs
        # the good shards of each split and (URL, reason) of those the size check dropped. decide(fn): fn's result as
        # one rank computed it, on every rank (the trainer's: all train on one list, checked by one rank's requests)
        self.shards, self.skipped_shards = (decide or (lambda fn: fn()))(self._check_shards)
        self.train = self._split("train")
        needed = dp_world * max(1, num_workers)
        dropped = len(m["splits"]["train"]["shards"]) - len(self.train)
        need(len(self.train) >= needed,
              f"{shard_dir} has {len(self.train)} train shards" + (f" ({dropped} skipped as bad)" if dropped else "")
              + f" but dp_world={dp_world} x num_workers={num_workers} "
              f"needs at least {needed}: rebuild with a smaller --samples-per-shard or use fewer data workers")
        self._consumed = 0  # batches handed to the trainer: the whole resumable position
        self._live = 0  # id of the one live iterator

    def _check_shards(self):
        """({split: [(name, samples)] sorted by name}, [(URL, reason) skipped]): every listed shard less
        those that are missing or whose size shows damage: "fail" refuses them, "skip" drops them here, before any
        order is computed. Only sizes are read (remote ones by parallel HEAD requests or their store's size call): no
        shard is opened."""
        listed = {split: s["shards"] for split, s in self.manifest["splits"].items()}
        urls = [self.files.url(s["name"]) for shards in listed.values() for s in shards]
        sizes, retries = remote.sizes(urls) if self.verify != "none" else (dict.fromkeys(urls), 0)
        self.retries += retries
        good, skipped = {split: [] for split in listed}, []
        for split, shards in listed.items():
            for s in shards:
                path = self.files.url(s["name"])
                size = sizes[path]   # None: the source cannot tell (a pipe: command); checked when read
                if isinstance(size, remote.Missing):
                    reason = ("is missing (listed in manifest.json)" if size == "not found" else
                              f"cannot be read: {size}")
                elif size == 0:
                    reason = "is empty (0 bytes)"
                elif size is not None and s.get("bytes", size) != size:
                    reason = f"has {size} bytes, manifest.json says {s['bytes']}" + (
                        " (truncated?)" if size < s["bytes"] else " (overwritten?)")
                else:
                    good[split].append((s["name"], s["samples"]))
                    continue
                need(self.bad_shards == "skip", f"shard {path} {reason}: {fix(self.shard_dir)}")
                skipped.append((path, reason))
        return {split: sorted(shards) for split, shards in good.items()}, skipped

    def _split(self, split):
        shards = self.shards.get(split, [])
        if not shards and self.manifest["splits"].get(split, {}).get("shards"):
            raise DataError(f"every {split} shard in {self.shard_dir} is bad (skipped: data.bad_shards=skip): "
                            f"rebuild it with {MAKE}")
        need(shards, f"no shards for split '{split}' in {self.shard_dir} (manifest.json lists none): rebuild it with "
                      f"{MAKE}" + (" --val-fraction > 0" if split == "val" else ""))
        return shards

    # ---- train stream ----

    def _source(self, skip_batches):
        """The order; a shard found bad while reading counts as empty (it gives no samples wherever it is read)."""
        nodesplitter = functools.partial(split_by_dp_rank, rank=self.dp_rank, world=self.dp_world)
        shards = [(name, 0 if name in self.bad_shards_read else count) for name, count in self.train]
        return EpochShards(shards, self.seed, nodesplitter, self.mix_shards, skip_batches, self.micro_batch_size)

    def _loader(self, skip_batches):
        pipeline = wds.DataPipeline(
            self._source(skip_batches),
            wds.pipelinefilter(shuffled_samples)(dict(self.train), self.files, self.fmt, self.bad_shards,
                                                 sorted(self.bad_shards_read)),
            wds.batched(self.micro_batch_size, partial=False, collation_fn=self._collate),
        )
        return torch.utils.data.DataLoader(pipeline, batch_size=None, collate_fn=as_is,
                                           num_workers=self.num_workers, prefetch_factor=2 if self.num_workers else None)

    def __iter__(self):
        self._live += 1
        return self._batches(self._live)

    def _batches(self, me):
        try:
            for batch in self._loader(skip_batches=self._consumed):
                if me != self._live:
                    raise RuntimeError("stale TokenStream iterator: a newer iter() or load_state_dict() replaced it")
                self._consumed += 1  # counted when handed over, so prefetched batches are not part of the position
                self.bad_shards_read.update(self._names[url] for url in batch["skipped_shards"])
                yield self._as_tensors(batch)
        except DataError as e:
            raise _one_line(e) from None

    def _collate(self, samples):
        return collate(samples, self.dtype, self.member)

    def _as_tensors(self, batch):
        tokens = torch.from_numpy(batch["tokens"])
        return dict(batch, tokens=tokens.pin_memory() if self.pin_memory else tokens)

    def worker_shards(self, epoch, worker):
        return [name for name, _ in self._source(0).shards_for(epoch, worker, max(1, self.num_workers))]

    # ---- Stateful ----

    def state_dict(self):
        src, workers = self._source(self._consumed), max(1, self.num_workers)
        position = []  # for people reading a checkpoint; only consumed_batches is used to resume
        for w in range(workers):
            epoch, i, skip = src.start(w, workers)
            group = [name for name, _ in src.groups(epoch, w, workers)[i]]
            position.append({"worker": w, "epoch": epoch, "shards": group, "sample": skip})
        return {"consumed_batches": self._consumed, **{k: getattr(self, k) for k in STATE_KEYS}, "position": position,
                "bad_shards_read": sorted(self.bad_shards_read)}

    def load_state_dict(self, sd):
        for key in ("consumed_batches",) + STATE_KEYS:
            need(key in sd, f"data state has no '{key}': not a TokenStream.state_dict()")
        for key in STATE_KEYS:
            need(sd[key] == getattr(self, key),
                  f"cannot resume the data stream: the checkpoint has {key}={sd[key]} but this run has "
                  f"{key}={getattr(self, key)}; the sample order depends on it, so an explicit remap of the data "
                  f"position is needed (not supported): run with {key}={sd[key]}")
        self._consumed = int(sd["consumed_batches"])
        self.bad_shards_read = set(sd.get("bad_shards_read", ()))   # absent in checkpoints of older code
        self._live += 1  # an iterator made before this no longer matches the position

    # ---- validation ----

    def val_batches(self, max_batches=None, split="val"):
        """The same batches on every call. Rank r takes the block of K = ceil(ceil(total / dp_world) / B) batches that
        starts at sample r*K*B in manifest order (the last rank wraps round to the start), so every rank runs the same
        number of batches, the blocks are disjoint until the wrap, and max_batches takes a prefix of each block."""
        shards = self._split(split)  # checked here, not at the first next(): errors surface where the call is
        total = sum(c for _, c in shards)
        full = math.ceil(math.ceil(total / self.dp_world) / self.micro_batch_size)
        n_batches = full if max_batches is None else min(full, max_batches)
        samples = self._samples_from(split, shards, self.dp_rank * full * self.micro_batch_size % total)
        return (self._as_tensors(self._collate(list(itertools.islice(samples, self.micro_batch_size))))
                for _ in range(n_batches))

    def _samples_from(self, split, shards, start):
        """Samples in manifest order from global index `start`, wrapping round; shards before it are not opened. A
        shard found bad here (bad_shards="skip") is passed over, so the rest of the split moves up."""
        reader = ShardReader(self.files, self.fmt, self.bad_shards, split, len(shards))
        i = 0
        while start >= shards[i][1]:
            start -= shards[i][1]
            i += 1
        while True:
            name, count = shards[i]
            samples = reader.read(name, count)[start:]
            self.retries, reader.retries = self.retries + reader.retries, 0   # read in this process: counted here
            for sample in samples:
                yield reader.tag(sample)
            i, start = (i + 1) % len(shards), 0
