"""The train order (tokendata/order.py) through TokenStream, in this process with real DataLoader workers: the same
global batches, sample for sample and in order, for every layout (data-parallel sizes that divide the global batch
but not the streams, several samples of a stream in a batch, workers, micro-batch) over more than one epoch, from one
source or three blended; a position that goes on in another layout, across an epoch boundary too; the blend's bound;
a data state of the order dealt by shard (written by the code before it) that goes on in its own order; the one-line
errors of data.sources and data.canonical_streams."""
import collections
import json
import os
import shutil

import pytest

from model.config import ConfigError
from pretrain.config import load_config
from pretrain.prelaunch import check_launch
from tokendata.order import Blend, layout
from tokendata.shards import DataError
from tokendata.sources import Source
from tokendata.stream import TokenStream, merged_state
from tests.support.runs import BLEND, ROOT, write_config

SEQ, G, C = 32, 48, 8   # 6 samples of every stream in a global batch
LAYOUTS = [(2, 2, 4), (3, 1, 2), (4, 0, 3), (6, 0, 1), (8, 1, 6), (12, 0, 2), (16, 0, 3), (48, 0, 1)]


def data(blend, which):
    """One source (data.shard_dir: b, ~11 global batches an epoch) or the three blended (c wraps every ~4)."""
    return blend["b"] if which == "one source" else [Source(blend[n], w, n) for n, (_, _, w) in BLEND.items()]


def ranks(spec, dp, workers, micro, **kw):
    return [TokenStream(spec, micro, SEQ, dp_rank=r, dp_world=dp, num_workers=workers, seed=3, global_batch_size=G,
                        canonical_streams=kw.pop("streams", C), **kw) for r in range(dp)]


def global_batches(streams, steps):
    """The sample ids of each of the next `steps` global batches, in order, read by one stream per rank."""
    its, out = [iter(s) for s in streams], []
    for _ in range(steps):
        out.append([i for s, it in zip(streams, its) for _ in range(G // (s.micro_batch_size * s.dp_world))
                    for i in next(it)["ids"]])
    return out


@pytest.mark.parametrize("which", ["one source", "three sources"])
def test_every_layout_reads_the_same_global_batches_in_order(blend, which):
    one = ranks(data(blend, which), 1, 0, G)   # one process, no workers, one micro-batch a step
    reference = global_batches(one, 13)
    assert max(p["epochs"] for p in one[0].progress()) > 1   # more than one epoch of b (one source), of c (three)
    assert all(len(batch) == G for batch in reference)
    for dp, workers, micro in LAYOUTS:   # 3, 6, 12, 16 and 48 do not divide the 8 streams
        got = global_batches(ranks(data(blend, which), dp, workers, micro), 13)
        bad = [g for g in range(13) if got[g] != reference[g]]
        assert not bad, f"dp={dp} workers={workers} micro-batch={micro}: global batches {bad} differ"


def counts_by_source(batches):
    return collections.Counter(i for batch in batches for i in batch)


@pytest.mark.parametrize("which", ["one source", "three sources"])
def test_a_position_goes_on_in_another_layout(blend, which):
    """8 global batches on 2 ranks, then 8 more on 3 ranks and on 1: the global batches of 16 on 1 rank, in order.
    Each source's samples are drawn epoch by epoch: after every global batch, each was drawn ⌊t/n⌋ or ⌈t/n⌉ times."""
    spec = blend["a"] if which == "one source" else data(blend, which)
    straight = global_batches(ranks(spec, 1, 0, G), 16)
    first = ranks(spec, 2, 2, 8)
    assert global_batches(first, 8) == straight[:8]
    position = merged_state([json.loads(json.dumps(s.state_dict())) for s in first])
    for dp, workers, micro in ((3, 1, 4), (1, 1, 12)):
        later = ranks(spec, dp, workers, micro)
        for s in later:
            s.load_state_dict(position)
        assert global_batches(later, 8) == straight[8:], (dp, workers, micro)
    sizes = {p.source.name: p.manifest["splits"]["train"]["samples"] for p in later[0].parts}
    for g in range(1, 17):
        seen = counts_by_source(straight[:g])
        for name, n in sizes.items():
            mine = [k for i, k in seen.items() if name is None or i.startswith(f"{name}/")]
            drawn = sum(mine)
            assert set(mine) | {drawn // n} <= {drawn // n, -(-drawn // n)} and len(mine) == min(n, drawn), (g, name)


def test_a_position_goes_on_in_another_layout_across_an_epoch_boundary(blend):
    """b's epoch ends inside global batch n // G: the relayout falls just before it."""
    spec = blend["b"]
    stop = ranks(spec, 1, 0, G)[0].orders[0].n // G
    straight = global_batches(ranks(spec, 1, 0, G), stop + 4)
    first = ranks(spec, 4, 1, 2)
    global_batches(first, stop)
    state = merged_state([s.state_dict() for s in first])
    later = ranks(spec, 6, 0, 4)
    for s in later:
        s.load_state_dict(state)
    assert global_batches(later, 4) == straight[stop:]
    assert counts_by_source(straight[:stop]).most_common(1)[0][1] == 1   # every sample once in the first epoch
    assert counts_by_source(straight).most_common(1)[0][1] == 2   # and then some again: the epoch boundary is crossed


@pytest.mark.parametrize("weights", [[0.5, 0.3, 0.2], [5, 3, 2], [0.9, 0.05, 0.03, 0.02], [1, 1], [1]])
@pytest.mark.parametrize("streams,global_batch", [(1, 8), (4, 4), (16, 16), (8, 64), (64, 96)])
def test_the_blend_keeps_every_source_within_one_sample_of_its_weight(weights, streams, global_batch):
    """After every global batch: |count − w·N| ≤ 1 − 1/(2m−2) (< 1) for each source, whatever C (a single stream
    included); each stream's draws of each source are within one of every other stream's (round robin), and its band
    of a batch starts within 2m of c·G/C."""
    blend, w = Blend(weights), [x / sum(weights) for x in weights]
    bound = 1 - 1 / (2 * len(w) - 2) if len(w) > 1 else 0
    pos, per_stream = blend.start(), collections.Counter()
    for g in range(1, 201):
        before = list(pos.counts)
        lay = layout(blend, pos, global_batch, streams)
        assert [int((lay.sources == s).sum()) for s in range(len(w))] == [a - b for a, b in zip(pos.counts, before)]
        assert all(abs(pos.counts[s] - w[s] * pos.samples) <= bound + 1e-9 for s in range(len(w))), (g, pos.counts)
        per_stream.update(zip(lay.streams.tolist(), lay.sources.tolist()))
        for s in range(len(w)):
            mine = [per_stream[c, s] for c in range(streams)]
            assert max(mine) - min(mine) <= 1 and sum(mine) == pos.counts[s]
        starts = [int((lay.streams < c).sum()) for c in range(streams)]
        assert all(abs(x - c * global_batch / streams) <= 2 * len(w) for c, x in enumerate(starts)), starts
    again = blend.position_at(200, global_batch)   # a checkpoint without a position: the same one, from the start
    assert (again.samples, again.counts) == (pos.samples, pos.counts)


def test_a_data_state_of_the_order_dealt_by_shard_goes_on_in_it(blend):
    """tests/data/canonical_v1.json: what the code before this order wrote (3 sources, G 16, C 8, 2 ranks) after 30
    global batches, and the 12 it read next. Resumed here on 2, 4 and 8 ranks, the same 12, in order; on 3 ranks, a
    one-line error naming the sizes it can use."""
    ref = json.load(open(os.path.join(ROOT, "tests", "data", "canonical_v1.json")))
    spec = [Source(blend[n], w, n) for n, (_, _, w) in BLEND.items()]
    for dp, workers in ((2, 1), (4, 0), (8, 1)):
        streams = [TokenStream(spec, 16 // dp, SEQ, dp_rank=r, dp_world=dp, num_workers=workers, seed=3,
                               global_batch_size=16) for r in range(dp)]   # data.canonical_streams=null: the state's
        for s in streams:
            s.load_state_dict(ref["state"])
        its = [iter(s) for s in streams]
        assert [[i for it in its for i in next(it)["ids"]] for _ in range(12)] == ref["batches"], dp
        assert streams[0].state_dict()["order"] == "canonical streams" and streams[0].canonical_streams == 8
    with pytest.raises(DataError) as e:   # 16 ranks: more than its 8 streams
        TokenStream(spec, 1, SEQ, dp_world=16, seed=3, global_batch_size=16).load_state_dict(ref["state"])
    assert "\n" not in str(e.value) and "it can resume on 1, 2, 4, 8 data-parallel ranks" in str(e.value), e.value
    assert TokenStream(spec, 1, SEQ, dp_world=16, seed=3, global_batch_size=16).canonical_streams == 16   # a new run


# ---- errors: one line, naming the source and the key ----

def edited_copy(blend, tmp_path, name, **changes):
    """A copy of source c whose manifest.json says `changes`."""
    d = tmp_path / name
    shutil.copytree(blend["c"], d)
    manifest = json.loads((d / "manifest.json").read_text())
    manifest.update(changes)
    (d / "manifest.json").write_text(json.dumps(manifest))
    return str(d)


def test_sources_must_share_tokenizer_vocabulary_seq_len_and_eos(blend, tmp_path):
    cases = {"tokenizer_sha256": "0" * 64, "vocab_size": 1024, "seq_len": 64, "eos_id": 7}
    for key, value in cases.items():
        odd = edited_copy(blend, tmp_path, key, **{key: value})
        with pytest.raises(DataError) as e:
            TokenStream([Source(blend["a"], 1, "a"), Source(odd, 1, "odd")], 4, SEQ)
        msg = str(e.value)
        assert "\n" not in msg and f"source 'odd' ({odd}) has {key}={value!r}" in msg, msg
        assert f"source 'a' ({blend['a']})" in msg and "every source must share one" in msg, msg
    empty = edited_copy(blend, tmp_path, "empty", splits={"train": {"samples": 0, "tokens": 0, "shards": []}})
    with pytest.raises(DataError) as e:
        TokenStream([Source(blend["a"], 1, "a"), Source(empty, 1, "none")], 4, SEQ)
    assert str(e.value) == (f"source 'none' ({empty}) has no train shards (its manifest.json lists none): rebuild "
                            f"it with tools/make_shards.py")


@pytest.mark.parametrize("sources,words", [
    ("[{name: a, path: x, weight: 0}]", "data.sources' weights are all 0"),
    ("[{name: a, path: x, weight: 1}, {name: b, path: y, weight: 0}]",
     "data.sources[1].weight=0 (source 'b') and no data.stages entry gives it a weight > 0"),
    ("[{name: a, path: x, weight: -1}]", "data.sources[0].weight=-1 must be a number ≥ 0"),
    ("[{name: a, path: x, weight: 1}, {name: b, path: y, wieght: 1}]",
     "unknown config key 'data.sources[1].wieght'; did you mean 'data.sources[1].weight'?"),
    ("[{name: a, path: x}]", "data.sources[0] has no 'weight'"),
    ("[{name: a, path: x, weight: 1}, {name: a, path: y, weight: 1}]", "data.sources[1].name='a' is used twice"),
    ("[{name: a/b, path: x, weight: 1}]", "data.sources[0].name='a/b' must be letters"),
    ("[]", "data.sources must be a non-empty list"),
])
def test_data_sources_errors_are_one_line(sources, words):
    with pytest.raises(ConfigError) as e:
        load_config(f"{ROOT}/configs/demo-cpu.yaml", ["data.shard_dir=null", f"data.sources={sources}"])
    assert "\n" not in str(e.value) and str(e.value).startswith(words), str(e.value)


def test_the_launch_check_reads_every_source_and_the_streams_fit_the_layout(blend, tmp_path):
    sources = [{"name": n, "path": blend[n], "weight": w} for n, (_, _, w) in BLEND.items()]
    cfg = write_config(tmp_path / "c.yaml", None, tmp_path / "run", data={"sources": sources})
    assert check_launch(load_config(cfg), 2).dp == 2
    with pytest.raises(DataError) as e:
        check_launch(load_config(cfg, [f"data.sources={json.dumps(sources[:2] + [dict(sources[2], path='/no')])}"]), 2)
    assert str(e.value).startswith("source 'c': shard directory /no does not exist"), str(e.value)
    assert check_launch(load_config(cfg, ["data.canonical_streams=3", "train.micro_batch_size=2"]), 4).dp == 4
    for overrides, world, words in ((["data.canonical_streams=9"], 2, "data.canonical_streams=9 must be between 1 "
                                                                      "and train.global_batch_size=8"),
                                    ([], 3, "train.global_batch_size=8 is not divisible by the data-parallel size 3: "
                                            "its samples are split evenly over the ranks; data-parallel sizes it can "
                                            "use: 1, 2, 4, 8")):
        with pytest.raises(ConfigError) as e:
            check_launch(load_config(cfg, overrides + ["train.micro_batch_size=1"]), world)
        assert str(e.value).startswith(words) and "\n" not in str(e.value), str(e.value)
