"""The train order of runs started before canonical streams (tokendata/order.py), kept so that their checkpoints go on
resuming exactly, in their own layout. A TokenStream switches to it when it loads such a data state (one without
"order"), and its later checkpoints keep it; a run that changes its layout (a universal checkpoint) starts the
canonical order at its step instead.

Order, a function of (manifest, seed, dp_world, num_workers, B, mix_shards):
    epoch e:  shards = the train shards shuffled by Random(f"{seed}/{e}"), the same list on every rank;
              rank r takes shards[r::dp_world]; worker w of W takes those[w::W];
              the worker reads its shards in groups of mix_shards and pools and shuffles each group's samples with
              Random(f"{seed}/{e}/{r}/{w}/{group index}").
    A worker's samples run on from epoch to epoch without end and are cut into batches of B; the DataLoader hands out
    batch j of the rank from worker j % W.
Resume: after k consumed batches logical worker w has produced len(range(w, k, W)) of them; a new iterator's
physical worker p plays logical worker (p + k) % W and skips its count x B samples by the manifest's counts.
"""
from __future__ import annotations

import functools
import itertools
import random

import torch
import webdataset as wds

from tokendata.reading import as_is, worker_info
from tokendata.shard_files import ShardReader
from tokendata.shard_stream_order import shuffled_samples
from tokendata.shards import need

# Not bad_shards: a run stopped by a bad shard must resume after switching to "skip".
STATE_KEYS = ("dp_rank", "dp_world", "num_workers", "micro_batch_size", "seq_len", "seed", "mix_shards")


def is_legacy(state: dict) -> bool:
    return "order" not in state


def split_by_dp_rank(src, rank, world):
    """Node splitter: this data-parallel rank's share of one epoch's shard list."""
    return itertools.islice(src, rank, None, world)


def split_by_loader_worker(src, worker, workers):
    """Worker splitter: one DataLoader worker's share of its rank's shards."""
    return itertools.islice(src, worker, None, workers)


class EpochShards(torch.utils.data.IterableDataset):
    """Pipeline source: what one (rank, worker) reads, epoch after epoch without end, starting `skip_batches` in:
    groups of up to `mix` consecutive shards of the worker's epoch list, as {"names", "skip", "order_seed"}."""

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
        physical, workers = worker_info()
        worker = (physical + self.skip_batches) % workers
        epoch, first, skip = self.start(worker, workers)
        while True:
            groups = self.groups(epoch, worker, workers)
            for i in range(first, len(groups)):
                yield {"names": [name for name, _ in groups[i]], "skip": skip,
                       "order_seed": f"{self.seed}/{epoch}/{self.rank}/{worker}/{i}"}
                skip = 0
            epoch, first = epoch + 1, 0


def legacy_samples(src, counts, files, fmt, bad_shards, known_bad):
    return shuffled_samples(src, counts, ShardReader(files, fmt, bad_shards, "train", len(counts), known_bad))


def source(stream, skip_batches: int, bad: set) -> EpochShards:
    """Shards found bad while reading (`bad`, names) count as empty, as they did when the run found them."""
    nodesplitter = functools.partial(split_by_dp_rank, rank=stream.dp_rank, world=stream.dp_world)
    shards = [(name, 0 if name in bad else count) for name, count in stream.train]
    return EpochShards(shards, stream.seed, nodesplitter, stream.mix_shards, skip_batches, stream.micro_batch_size)


def loader(stream, skip_batches: int, bad: set):
    """The DataLoader of micro-batches of a TokenStream in the old order, `skip_batches` in, with the shards found bad
    while reading (`bad`, names) empty and not reported again."""
    part = stream.parts[0]
    pipeline = wds.DataPipeline(
        source(stream, skip_batches, bad),
        wds.pipelinefilter(legacy_samples)(dict(stream.train), part.files, stream.fmt, stream.bad_shards, sorted(bad)),
        wds.batched(stream.micro_batch_size, partial=False, collation_fn=stream.collate),
    )
    return torch.utils.data.DataLoader(pipeline, batch_size=None, collate_fn=as_is, num_workers=stream.num_workers,
                                       prefetch_factor=2 if stream.num_workers else None)


def state_dict(stream, consumed: int, bad: set) -> dict:
    src, workers = source(stream, consumed, bad), max(1, stream.num_workers)
    position = []  # for people reading a checkpoint; only consumed_batches is used to resume
    for w in range(workers):
        epoch, i, skip = src.start(w, workers)
        group = [name for name, _ in src.groups(epoch, w, workers)[i]]
        position.append({"worker": w, "epoch": epoch, "shards": group, "sample": skip})
    return {"consumed_batches": consumed, **{k: getattr(stream, k) for k in STATE_KEYS}, "position": position,
            "bad_shards_read": sorted(bad)}


def check_state(stream, sd: dict) -> tuple[int, set]:
    """The batches consumed of an old-order data state and the shards found bad while reading (absent in the states
    of code before shard hashes), after checking that this stream reads in its layout."""
    for key in ("consumed_batches",) + STATE_KEYS:
        need(key in sd, f"data state has no '{key}': not a TokenStream.state_dict()")
    need(len(stream.parts) == 1 and stream.parts[0].source.name is None,
         "cannot resume the data stream: the checkpoint was written before data.sources existed, with one "
         "data.shard_dir: resume it with that shard_dir")
    for key in STATE_KEYS:
        need(sd[key] == getattr(stream, key),
             f"cannot resume the data stream: the checkpoint has {key}={sd[key]} but this run has "
             f"{key}={getattr(stream, key)}; it was written before canonical streams, and its sample order depends "
             f"on it: run with {key}={sd[key]}, or change the layout with checkpoint.relayout=true (the data order "
             f"then starts anew at that step)")
    return int(sd["consumed_batches"]), set(sd.get("bad_shards_read", ()))
