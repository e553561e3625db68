"""The data order at cluster scale, by its arithmetic (tokendata/order.py) where no process is needed, through the
reader where one is:
- every layout of the table (global batches 96 … 4096 samples, data-parallel sizes 1 … 1024 that divide them)
  launches with the default data.canonical_streams, and its ranks' parts, read back to back, are the global batch of
  one rank, each rank reading few streams;
- no sample of a source is drawn twice before every sample of it has been drawn once: sources of 1 shard, of fewer
  shards than streams and of many; the issue's simulation (a 10-shard source at weight 0.01, 64 streams) by the
  arithmetic and, scaled down, through the reader;
- the start of a run from an HTTP server with 100,000 shards: the requests (the manifest, once; no request per shard;
  the shards of the first windows), and the shards the reader holds in memory at once (at most data.fetch_threads)."""
import collections
import os

import numpy as np
import pytest
import torch
import yaml

from benchmarks.bench_data import Synthetic, SyntheticServer
from pretrain.config import load_config
from pretrain.data import train_stream
from pretrain.distributed import Layout
from pretrain.prelaunch import check_launch
from tokendata import shard_pool
from tokendata.order import Blend, SourceOrder, default_streams, layout, rank_slice
from tokendata.sources import Source
from tokendata.stream import TokenStream
from tests.support.runs import ROOT

BATCHES = (96, 192, 256, 384, 512, 768, 1024, 1536, 2048, 4096)
SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024)
DEMO = os.path.join(ROOT, "configs", "demo-cpu.yaml")


def sources_of(counts: dict, streams: int, mix: int = 4) -> list[SourceOrder]:
    """SourceOrders of synthetic sources: {name: (shards, samples a shard)}."""
    return [SourceOrder([(f"{name}-{i:06d}", per) for i in range(n)], f"0/{name}", streams, mix)
            for name, (n, per) in counts.items()]


def test_every_layout_of_the_table_launches_with_the_default_and_reads_its_part():
    """Each cell: the launch check of the demo config at that global batch and data-parallel size accepts it; two
    global batches from a position inside the run (three sources, 0.5 / 0.3 / 0.2), read rank by rank (each rank's positions, the source, stream and draw of
    each), are those of one rank, in order; no rank reads more than C/D + 2 + 4m·C/G streams a batch."""
    table, m = [], 3
    for G in BATCHES:
        C = default_streams(G)
        blend = Blend([0.5, 0.3, 0.2])
        pos = blend.position_at(3, G)
        batches = [layout(blend, pos, G, C) for _ in range(2)]
        cfg = load_config(DEMO, [f"train.global_batch_size={G}"])
        row = []
        for D in SIZES:
            if G % D:
                row.append("")
                continue
            cfg.train.micro_batch_size = G // D   # one micro-batch a step: the launch check of that config
            assert cfg.check_runtime(D).dp == D and cfg.canonical_streams() == C
            most = 0
            for lay in batches:
                parts = [[], [], []]
                for r in range(D):
                    lo, hi = rank_slice(G, r, D)
                    for part, column in zip(parts, (lay.sources, lay.streams, lay.draws)):
                        part.append(column[lo:hi])
                    most = max(most, len(np.unique(lay.streams[lo:hi])))
                whole = (lay.sources, lay.streams, lay.draws)
                assert all(np.array_equal(np.concatenate(p), w) for p, w in zip(parts, whole)), (G, D)
            assert most <= C / D + 2 + 4 * m * C / G, (G, D, C, most)
            row.append(str(most))
        table.append((G, C, row))
    print("\nglobal batch G, default C, and for each data-parallel size the most streams a rank reads (blank: D does "
          "not divide G)\n" + "G     C   " + " ".join(f"{d:>4}" for d in SIZES))
    for G, C, row in table:
        print(f"{G:<5} {C:<3} " + " ".join(f"{x:>4}" for x in row))


def epochs_are_exact(drawn: collections.Counter, n: int) -> bool:
    """After T draws of a source of n samples, each sample was drawn ⌊T/n⌋ or ⌈T/n⌉ times."""
    T = sum(drawn.values())
    return len(drawn) == min(n, T) and set(drawn.values()) <= {T // n, -(-T // n)}


@pytest.mark.parametrize("C,G", [(64, 64), (8, 48), (96, 192)])
def test_no_sample_is_drawn_twice_before_every_sample_of_its_source_is_drawn_once(C, G):
    """A source of 1 shard, one of fewer shards than streams (and of shards of unequal sizes), one of many, blended,
    over more than two epochs of each: after every global batch, every sample of a source was drawn ⌊T/n⌋ or ⌈T/n⌉
    times (T: the source's draws so far)."""
    orders = sources_of({"one": (1, 700), "few": (5, 130), "many": (300, 9)}, C)
    orders[1].shards[-1] = (orders[1].shards[-1][0], 61)   # a short last shard, as make_shards writes
    orders = [SourceOrder(o.shards, o.key, C, 4) for o in orders]
    blend, drawn = Blend([0.2, 0.3, 0.5]), [collections.Counter() for _ in orders]
    pos = blend.start()
    while min(c.total() / o.n for c, o in zip(drawn, orders)) < 2.5:
        lay = layout(blend, pos, G, C)
        for s, c, j in zip(lay.sources.tolist(), lay.streams.tolist(), lay.draws.tolist()):
            drawn[s][orders[s].draw(c, j)] += 1
        assert all(epochs_are_exact(d, o.n) for d, o in zip(drawn, orders)), [o.key for d, o in zip(drawn, orders)
                                                                                if not epochs_are_exact(d, o.n)]


def test_the_issues_simulation_draws_every_sample_once():
    """The issue's simulation: a source of 10 shards and 10,000 samples at weight 0.01 beside one at 0.99, 64 streams,
    global batch 64: its first 5,002 draws (about 500,200 picks) are 5,002 samples, each once."""
    orders = sources_of({"big": (1000, 1000), "small": (10, 1000)}, 64)
    blend = Blend([0.99, 0.01])
    pos, small = blend.start(), collections.Counter()
    while small.total() < 5002:
        lay = layout(blend, pos, 64, 64)
        for c, j in zip(lay.streams[lay.sources == 1].tolist(), lay.draws[lay.sources == 1].tolist()):
            small[orders[1].draw(c, j)] += 1
    print(f"\n{small.total()} draws of the small source: {len(small)} distinct samples, the most drawn "
          f"{small.most_common(1)[0][1]} times")
    assert len(small) == small.total() >= 5002 and small.most_common(1)[0][1] == 1


def test_the_issues_simulation_scaled_down_through_the_reader(tmp_path):
    """A source of 10 shards of 100 samples at weight 0.1 beside a big one, 64 streams, global batch 64, read by
    TokenStream (1 rank, 2 DataLoader workers) from real shard files: its first 512 draws are 512 samples, each once
    (the order dealt by shard read its 10 shards in several epochs side by side: samples again within 500 draws)."""
    small, big = Synthetic(10, 100, 4, 512), Synthetic(200, 100, 4, 512)
    spec = [Source(big.write(str(tmp_path / "big")), 0.9, "big"), Source(small.write(str(tmp_path / "small")), 0.1,
                                                                           "small")]
    s = TokenStream(spec, 16, 4, num_workers=2, seed=5, global_batch_size=64, canonical_streams=64)
    seen, it = collections.Counter(), iter(s)
    while seen.total() < 512:
        seen.update(i for i in next(it)["ids"] if i.startswith("small/"))
    assert len(seen) == seen.total() and s.progress()[1]["epochs"] < 1, seen.most_common(3)


@pytest.fixture(scope="module")
def hundred_thousand():
    """A synthetic source of 100,000 train shards (2 samples of 16 tokens each), its manifest ~16 MB."""
    return Synthetic(100_000, 2, 16, 512)


def test_the_start_at_100000_shards_asks_for_the_manifest_once_and_no_shard_before_reading(hundred_thousand,
                                                                                          tmp_path):
    """The trainer's start on one rank from a server of 100,000 shards: the launch check and the train stream read
    the manifest once, no shard is asked for its size (no HEAD), and the first global batch fetches only the shards of
    the windows its streams read and of the ones after them; the reader holds at most data.fetch_threads shards in
    memory at once."""
    shard_pool.reset_stats()   # the readers of this file's earlier tests (8 threads) may still be fetching
    with SyntheticServer(hundred_thousand) as srv:
        path = tmp_path / "c.yaml"
        cfg = yaml.safe_load(open(DEMO))
        cfg["model"].update(vocab_size=512, max_seq_len=16)
        cfg["data"].update(shard_dir=srv.url, num_workers=0, fetch_threads=4)
        cfg["train"].update(global_batch_size=256, micro_batch_size=16, run_dir=str(tmp_path / "run"))
        path.write_text(yaml.safe_dump(cfg))
        config = load_config(str(path))
        checked = check_launch(config, 1)
        lay = Layout(rank=0, world=1, dp_rank=0, dp=1, tp=1, pp=1, grad_accum=16, device=torch.device("cpu"))
        stream = train_stream(config, lay, checked.sources)
        batches = iter(stream)
        ids = [i for _ in range(16) for i in next(batches)["ids"]]
        requests, held, fetched = dict(srv.requests), shard_pool.STATS["peak_in_flight"], dict(srv.shards)
    C, order = stream.canonical_streams, stream.orders[0]
    first = layout(stream.blend, stream.blend.start(), 256, C)
    windows = {(c, *order.where(c, j)[:2]) for c, j in zip(first.streams.tolist(), first.draws.tolist())}
    ahead = {(c, e, k + 1) for c, e, k in windows}
    expected = {n for w in windows | ahead for n in order.window_shards(*w)}
    needed = {order.draw(c, j)[0] for c, j in zip(first.streams.tolist(), first.draws.tolist())}
    print(f"\nrequests at the start from 100,000 shards: {requests}; {len(expected)} shards in the first windows of "
          f"the {C} streams and the next ones")
    assert len(ids) == 256 and set(requests) == {("GET", "manifest"), ("GET", "shard")}
    assert requests["GET", "manifest"] == 1 and set(fetched.values()) == {1}   # each shard once, none before use
    assert needed <= set(fetched) <= expected
    assert len(expected) <= C * 2 * (order.window // 2 + 2)   # windows of mix shards (+ the ones they straddle)
    assert 1 <= held <= 4   # data.fetch_threads: the shards fetched at once, the only ones in memory
