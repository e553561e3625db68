"""The train order (tokendata/order.py) through TokenStream, in this process with real DataLoader workers: the same
global batches, as multisets of sample ids, for every layout (data-parallel size, workers, micro-batch) over more than
one epoch, from one source or three blended; a position that goes on in another layout, across an epoch boundary too;
the blend's bound; the one-line errors of data.sources and data.canonical_streams."""
import collections
import json
import shutil

import pytest

from model.config import ConfigError
from pretrain.config import load_config
from pretrain.prelaunch import check_launch
from tokendata.order import Blend
from tokendata.shards import DataError
from tokendata.sources import Source
from tokendata.stream import TokenStream, merged_state
from tests.runs import BLEND, ROOT, write_config

SEQ, G, C = 32, 16, 16
LAYOUTS = [(dp, workers, micro) for dp in (1, 2, 4, 8) for workers in (1, 2) for micro in (1, 2)]


def data(blend, which):
    """One source (data.shard_dir: b, ~35 global batches an epoch) or the three blended (c wraps every ~13)."""
    return blend["b"] if which == "one source" else [Source(blend[n], w, n) for n, (_, _, w) in BLEND.items()]


def ranks(spec, dp, workers, micro, **kw):
    return [TokenStream(spec, micro, SEQ, dp_rank=r, dp_world=dp, num_workers=workers, seed=3, global_batch_size=G,
                        canonical_streams=C, **kw) for r in range(dp)]


def global_batches(streams, steps):
    """The multiset of sample ids of each of the next `steps` global batches, read by one stream per rank."""
    its, out = [iter(s) for s in streams], []
    for _ in range(steps):
        out.append(collections.Counter(i for s, it in zip(streams, its)
                                       for _ in range(G // (s.micro_batch_size * s.dp_world)) for i in next(it)["ids"]))
    return out


@pytest.mark.parametrize("which", ["one source", "three sources"])
def test_every_layout_reads_the_same_global_batches(blend, which):
    steps = 36 if which == "one source" else 30
    one = ranks(data(blend, which), 1, 0, G)   # one process, no workers, one micro-batch a step
    reference = global_batches(one, steps)
    assert max(p["epochs"] for p in one[0].progress()) > 1   # more than one epoch of b (one source), of c (three)
    assert all(sum(batch.values()) == G for batch in reference)
    for dp, workers, micro in LAYOUTS:
        got = global_batches(ranks(data(blend, which), dp, workers, micro), steps)
        bad = [g for g in range(steps) if got[g] != reference[g]]
        assert not bad, f"dp={dp} workers={workers} micro-batch={micro}: global batches {bad} differ"


def samples_of(batches):
    return collections.Counter(i for batch in batches for i in batch.elements())


@pytest.mark.parametrize("which", ["one source", "three sources"])
def test_a_position_goes_on_in_another_layout(blend, which):
    """20 global batches on 2 ranks, then 20 more on 4 ranks and on 1: the global batches of 40 on 1 rank. With one
    source (a: ~50 global batches an epoch) no sample is read twice; with three, only c's, once an epoch."""
    spec = blend["a"] if which == "one source" else data(blend, which)
    straight = global_batches(ranks(spec, 1, 0, G), 40)
    first = ranks(spec, 2, 2, 2)
    assert global_batches(first, 20) == straight[:20]
    position = merged_state([json.loads(json.dumps(s.state_dict())) for s in first])
    for dp, workers, micro in ((4, 2, 1), (1, 1, 4)):
        later = ranks(spec, dp, workers, micro)
        for s in later:
            s.load_state_dict(position)
        assert global_batches(later, 20) == straight[20:], (dp, workers, micro)
    seen = samples_of(straight)
    assert max(n for i, n in seen.items() if not i.startswith("c/")) == 1
    if which == "three sources":
        epochs = later[0].progress()[2]["epochs"]
        assert 2 <= max(n for i, n in seen.items() if i.startswith("c/")) <= int(epochs) + 1


def test_a_position_goes_on_in_another_layout_across_an_epoch_boundary(blend):
    """b's streams hold 4 or 5 of its shards an epoch: the relayout falls where the first have begun their epoch 2
    and the others have not."""
    spec = blend["b"]
    first_end = min(sum(n for _, n in ranks(spec, 1, 0, G)[0].orders[0].share(c, 0)) for c in range(C))  # 1 a batch
    stop = first_end + 1
    straight = global_batches(ranks(spec, 1, 0, G), stop + 8)
    first = ranks(spec, 4, 1, 2)
    global_batches(first, stop)
    state = merged_state([s.state_dict() for s in first])
    later = ranks(spec, 2, 2, 1)
    for s in later:
        s.load_state_dict(state)
    assert global_batches(later, 8) == straight[stop:]
    assert samples_of(straight[:first_end]).most_common(1)[0][1] == 1   # every sample once in the first epoch
    assert samples_of(straight).most_common(1)[0][1] == 2   # and then some again: the epoch boundary is crossed


@pytest.mark.parametrize("weights", [[0.5, 0.3, 0.2], [5, 3, 2], [0.9, 0.05, 0.03, 0.02], [1, 1], [1]])
@pytest.mark.parametrize("streams,global_batch", [(1, 8), (4, 4), (16, 16), (8, 64)])
def test_the_blend_keeps_every_source_within_one_sample_of_its_weight(weights, streams, global_batch):
    """After every global batch: |count − w·N| ≤ 1 − 1/(2m−2) (< 1) for each source, whatever C (a single
    stream included); every stream gives exactly G/C samples; each stream reads each source at about its weight's
    rate."""
    blend, w = Blend(weights, streams), [x / sum(weights) for x in weights]
    bound = 1 - 1 / (2 * len(w) - 2) if len(w) > 1 else 0
    pos, per = blend.start(), global_batch // streams
    for g in range(1, 301):
        before = list(pos.counts)
        split = blend.advance(pos, global_batch)
        assert all(sum(row) == per for row in split)
        assert [sum(row[s] for row in split) for s in range(len(w))] == [a - b for a, b in zip(pos.counts, before)]
        assert all(abs(pos.counts[s] - w[s] * pos.samples) <= bound + 1e-9 for s in range(len(w))), (g, pos.counts)
        assert [sum(row[s] for row in pos.streams) for s in range(len(w))] == pos.counts
        assert max(abs(n - w[s] * g * per) for row in pos.streams for s, n in enumerate(row)) <= 3, g
    again = blend.position_at(300, global_batch)   # a checkpoint without a position: the same one, from the start
    assert (again.samples, again.counts, again.streams) == (pos.samples, pos.counts, pos.streams)


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
    ("[{name: a, path: x, weight: 0}]", "data.sources[0].weight=0 must be a number > 0"),
    ("[{name: a, path: x, weight: -1}]", "data.sources[0].weight=-1 must be a number > 0"),
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
    for overrides, words in ((["data.canonical_streams=3"], "data.canonical_streams=3 must divide train.global_"
                                                             "batch_size=8"),
                             (["data.canonical_streams=2"], "data.canonical_streams=2 is not divisible by the data-"
                                                            "parallel size 4")):
        with pytest.raises(ConfigError) as e:
            check_launch(load_config(cfg, overrides + ["train.micro_batch_size=2"]), 4)
        assert str(e.value).startswith(words) and "\n" not in str(e.value), str(e.value)
