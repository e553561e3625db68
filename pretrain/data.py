"""Streaming, resumable token batches from the WebDataset shards that tools/make_shards.py writes.

Public API (the shard format, the manifest and DataError: pretrain/shards.py)
    TokenStream(shard_dir, micro_batch_size, seq_len, dp_rank=0, dp_world=1, num_workers=0, seed=0, mix_shards=4,
                bad_shards="fail")
        iter(stream)        endless train batches {"tokens": LongTensor (B, n+1), "ids": [B sample-id strings],
                            "skipped_shards": [paths of shards found bad while this batch was read; usually []]}
        skipped_shards      [(path, reason)]: the train and val shards dropped at construction (bad_shards="skip")
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

Bad shards: a damaged shard is a DataError naming its path (bad_shards="fail"), or is left out (bad_shards="skip").
    At construction, without opening a shard: an empty file, or a size other than the manifest's "bytes" (when
    recorded; older manifests lack it), makes a shard bad. With "skip" it is dropped from its split before any order
    is computed and listed in stream.skipped_shards, so the same files give the same order and resume stays exact.
    While reading, a shard that tarfile cannot parse, or whose sample count or sample sizes differ from the manifest,
    is bad: with "skip" its samples are dropped, a warning naming it goes to stderr (from the DataLoader worker) and
    the next batch lists its path in "skipped_shards" (workers are other processes: the batch is how the trainer
    learns of it); each worker of an iterator reports a shard once and does not reopen it, so the trainer should
    count distinct paths. Positions are still counted by the manifest, so a shard found bad only while reading shifts
    that worker's later samples, and a resume is exact only for shards found bad at construction (the size check
    catches truncated and empty files, the usual damage; tar has no checksum over the data, so garbage inside a
    sample's tokens is not found at all).
"""

import functools
import itertools
import math
import os
import random
import sys

import numpy as np
import torch
import webdataset as wds
from webdataset.tariterators import group_by_keys, tar_file_expander, url_opener

from pretrain.shards import DTYPES, MAKE, DataError, need, read_manifest

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


def _fix(shard_dir):
    return f"rebuild {shard_dir} with {MAKE}, or set data.bad_shards=skip to train without it"


def _read_tar(path, count, member, nbytes):
    """The samples of one shard in file order, as raw bytes (webdataset's own tar reader), each checked to hold
    `member` of `nbytes` bytes; any fault in the file is a DataError naming it."""
    fix = _fix(os.path.dirname(path))
    try:
        samples = list(group_by_keys(tar_file_expander(url_opener([{"url": path}]))))
    except Exception as e:  # tarfile/OS/webdataset errors; webdataset appends its stream and url to e.args
        cause = str(e.args[0]).split(" @ ")[0] if e.args else ""
        raise DataError(f"shard {path} is unreadable ({type(e).__name__}: {cause}): {fix}") from None
    # tarfile ends quietly at a damaged header after the first, so a cut or corrupted shard may just look short
    need(len(samples) == count, f"shard {path} holds {len(samples)} samples but manifest.json says {count}: {fix}")
    for s in samples:
        size = len(s.get(member, b""))
        need(size == nbytes, f"shard {path}: sample {s.get('__key__')} has {size} bytes of {member}, not "
                              f"{nbytes} (seq_len+1 tokens): {fix}")
    return samples


class ShardReader:
    """Reads the shards of one iterator. Under bad_shards="skip" a bad shard gives no samples, is warned about on
    stderr once and not reopened, and its path rides on the next sample out (`tag`), so the batch that takes that
    sample reports it: the only way out of a DataLoader worker that keeps the batch order."""

    def __init__(self, fmt, bad_shards, split, n_shards):
        self.fmt, self.bad_shards, self.split, self.n_shards = fmt, bad_shards, split, n_shards
        self.bad, self.skipped = set(), []  # paths found bad; those not yet handed to a batch

    def read(self, path, count):
        if path in self.bad:
            return []
        try:
            return _read_tar(path, count, *self.fmt)
        except DataError as e:
            if self.bad_shards != "skip":
                raise
            what = str(e).removesuffix(f": {_fix(os.path.dirname(path))}")
            print(f"warning: {what}; skipping it (data.bad_shards=skip)", file=sys.stderr, flush=True)
        self.bad.add(path)
        self.skipped.append(path)
        need(len(self.bad) < self.n_shards,  # else the reader would go round for ever without a sample
              f"every {self.split} shard in {os.path.dirname(path)} is bad (see the warnings above): rebuild it "
              f"with {MAKE}")
        return []

    def tag(self, sample):
        if self.skipped:
            sample, self.skipped = dict(sample, __skipped__=self.skipped), []
        return sample


class EpochShards(torch.utils.data.IterableDataset):
    """Pipeline source: what one (rank, worker) reads, epoch after epoch without end, starting `skip_batches` in.

    Yields groups of up to `mix` consecutive shards of the worker's epoch list, as {"urls", "names", "skip",
    "order_seed"}: a group's samples are pooled and shuffled together, because one shard holds consecutive text and a
    batch drawn from one shard alone would be one passage. The first group may start part-way (skip > 0).
    """

    def __init__(self, shard_dir, shards, seed, nodesplitter, mix, skip_batches, batch_size):
        self.shard_dir, self.shards, self.seed = shard_dir, shards, seed  # shards: [(name, samples)] sorted by name
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
                names = [name for name, _ in groups[i]]
                yield {"urls": [os.path.join(self.shard_dir, n) for n in names], "names": names, "skip": skip,
                       "order_seed": f"{self.seed}/{epoch}/{self.rank}/{worker}/{i}"}
                skip = 0
            epoch, first = epoch + 1, 0


def shuffled_samples(src, counts, fmt, bad_shards):
    """Each group's samples pooled in a seeded random order, minus the first `skip` of it (still bytes, not decoded).
    A bad shard (bad_shards="skip") adds no samples: the group is smaller, its order still a function of the seed."""
    reader = ShardReader(fmt, bad_shards, "train", len(counts))
    for group in src:
        samples = [s for url, name in zip(group["urls"], group["names"]) for s in reader.read(url, counts[name])]
        order = list(range(len(samples)))
        random.Random(group["order_seed"]).shuffle(order)
        for j in order[group["skip"]:]:
            yield reader.tag(samples[j])


def collate(samples, dtype, member):
    """A batch whose tokens are a numpy array, not yet a tensor: a DataLoader worker sends it pickled through its pipe.
    A tensor would travel as a shared-memory file descriptor served by a thread of the worker, and a rank killed in
    mid-handover (kill -9) would leave that thread printing a ConnectionResetError traceback."""
    rows = [np.frombuffer(s[member], dtype=dtype) for s in samples]  # the bytes are decoded only here, when kept
    return {"tokens": np.stack(rows).astype(np.int64), "ids": [s["__key__"] for s in samples],
            "skipped_shards": [p for s in samples for p in s.get("__skipped__", ())]}


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
                 mix_shards=4, bad_shards="fail", pin_memory=False):
        need(micro_batch_size >= 1, f"micro_batch_size must be >= 1, got {micro_batch_size}")
        need(num_workers >= 0, f"num_workers must be >= 0, got {num_workers}")
        need(0 <= dp_rank < dp_world, f"dp_rank must be in [0, dp_world={dp_world}), got {dp_rank}")
        self.manifest = m = read_manifest(shard_dir)
        need(m["seq_len"] == seq_len,
             f"shards in {shard_dir} hold sequences of {m['seq_len']} tokens but model.max_seq_len={seq_len}: "
             f"set model.max_seq_len={m['seq_len']}, or rebuild the shards with tools/make_shards.py "
             f"--seq-len {seq_len}")
        self.shard_dir, self.micro_batch_size, self.seq_len = shard_dir, micro_batch_size, seq_len
        self.dp_rank, self.dp_world, self.num_workers, self.seed = dp_rank, dp_world, num_workers, seed
        need(mix_shards >= 1, f"mix_shards must be >= 1, got {mix_shards}")
        self.mix_shards = mix_shards
        need(bad_shards in BAD_SHARDS, f"bad_shards must be one of {', '.join(BAD_SHARDS)}, got {bad_shards!r}")
        self.bad_shards = bad_shards
        self.pin_memory = pin_memory   # page-locked batches: the copy to a GPU does not make the host wait
        self.dtype, self.member = DTYPES[m["dtype"]]
        self.fmt = (self.member, (seq_len + 1) * np.dtype(self.dtype).itemsize)  # what each sample must hold
        self.skipped_shards = []  # (path, reason) of the shards the size check dropped
        self.shards = {split: self._checked(split) for split in m["splits"]}
        self.train = self._split("train")
        needed = dp_world * max(1, num_workers)
        dropped = len(m["splits"]["train"]["shards"]) - len(self.train)
        need(len(self.train) >= needed,
              f"{shard_dir} has {len(self.train)} train shards" + (f" ({dropped} skipped as bad)" if dropped else "")
              + f" but dp_world={dp_world} x num_workers={num_workers} "
              f"needs at least {needed}: rebuild with a smaller --samples-per-shard or use fewer data workers")
        self._consumed = 0  # batches handed to the trainer: the whole resumable position
        self._live = 0  # id of the one live iterator

    def _checked(self, split):
        """The split's [(name, samples)] sorted by name, less the shards whose file size shows damage: "fail" refuses
        them, "skip" drops them here, before any order is computed. Only sizes are read: no shard is opened."""
        good = []
        for s in self.manifest["splits"][split]["shards"]:
            path = os.path.join(self.shard_dir, s["name"])
            size = os.path.getsize(path) if os.path.isfile(path) else None  # a missing shard is named by _split
            if size == 0:
                reason = "is empty (0 bytes)"
            elif size is not None and s.get("bytes", size) != size:
                reason = f"has {size} bytes, manifest.json says {s['bytes']}" + (
                    " (truncated?)" if size < s["bytes"] else " (overwritten?)")
            else:
                good.append((s["name"], s["samples"]))
                continue
            need(self.bad_shards == "skip", f"shard {path} {reason}: {_fix(self.shard_dir)}")
            self.skipped_shards.append((path, reason))
        return sorted(good)

    def _split(self, split):
        shards = self.shards.get(split, [])
        if not shards and self.manifest["splits"].get(split, {}).get("shards"):
            raise DataError(f"every {split} shard in {self.shard_dir} is bad (skipped: data.bad_shards=skip): "
                            f"rebuild it with {MAKE}")
        need(shards, f"no shards for split '{split}' in {self.shard_dir} (manifest.json lists none): rebuild it with "
                      f"{MAKE}" + (" --val-fraction > 0" if split == "val" else ""))
        for name, _ in shards:
            path = os.path.join(self.shard_dir, name)
            need(os.path.isfile(path), f"shard {path} listed in manifest.json is missing: rebuild {self.shard_dir}")
        return shards

    # ---- train stream ----

    def _source(self, skip_batches):
        nodesplitter = functools.partial(split_by_dp_rank, rank=self.dp_rank, world=self.dp_world)
        return EpochShards(self.shard_dir, self.train, self.seed, nodesplitter, self.mix_shards, skip_batches,
                           self.micro_batch_size)

    def _loader(self, skip_batches):
        pipeline = wds.DataPipeline(
            self._source(skip_batches),
            wds.pipelinefilter(shuffled_samples)(dict(self.train), self.fmt, self.bad_shards),
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
        return {"consumed_batches": self._consumed, **{k: getattr(self, k) for k in STATE_KEYS}, "position": position}

    def load_state_dict(self, sd):
        for key in ("consumed_batches",) + STATE_KEYS:
            need(key in sd, f"data state has no '{key}': not a TokenStream.state_dict()")
        for key in STATE_KEYS:
            need(sd[key] == getattr(self, key),
                  f"cannot resume the data stream: the checkpoint has {key}={sd[key]} but this run has "
                  f"{key}={getattr(self, key)}; the sample order depends on it, so an explicit remap of the data "
                  f"position is needed (not supported): run with {key}={sd[key]}")
        self._consumed = int(sd["consumed_batches"])
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
        reader = ShardReader(self.fmt, self.bad_shards, split, len(shards))
        i = 0
        while start >= shards[i][1]:
            start -= shards[i][1]
            i += 1
        while True:
            name, count = shards[i]
            for sample in reader.read(os.path.join(self.shard_dir, name), count)[start:]:
                yield reader.tag(sample)
            i, start = (i + 1) % len(shards), 0
