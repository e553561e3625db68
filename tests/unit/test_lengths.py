"""Shards written at n train a model of any L that divides n or that n divides (tokendata/lengths.py): the samples of
an L = n/2 and an L = 2n stream are exactly the n read's tokens, cut or joined as defined, each once an epoch; a
position resumed in another data-parallel layout goes on with the same global batches; validation is cut the same way;
a length that neither divides is a one-line error naming both."""
import json

import numpy as np
import pytest

from tokendata.lengths import Lengths, fit
from tokendata.shards import DataError, read_manifest, shard_samples
from tokendata.stream import TokenStream, merged_state

N, G, C = 32, 24, 4   # the blend fixture's shards hold samples of 32 tokens


def file_samples(shard_dir, split="train"):
    """{file sample id: its n + 1 ids} of a split, read the plain way (tokendata.shards.shard_samples)."""
    m = read_manifest(shard_dir)
    return {key: ids for shard in m["splits"][split]["shards"] for key, ids in shard_samples(m, shard)}


def expected(key, ref):
    """A model sample's ids by the rule of tokendata/lengths.py, from the n read's file samples."""
    if "/" in key:   # "<file id>/<i>of<k>": ids [iL, iL + L + 1) of the file sample
        fid, piece = key.rsplit("/", 1)
        i, k = map(int, piece.split("of"))
        L = N // k
        return ref[fid][i * L:i * L + L + 1]
    if "+" in key:   # "<first file id>+<k>": k consecutive file samples, each's boundary id dropped but the last's
        fid, k = key.rsplit("+", 1)
        stem, first = fid.rsplit("-", 1)
        parts = [ref[f"{stem}-{int(first) + i:06d}"] for i in range(int(k))]
        return np.concatenate([p[:N] for p in parts[:-1]] + [parts[-1]])
    return ref[key]


def ranks(shard_dir, L, dp, micro, workers=0):
    return [TokenStream(shard_dir, micro, L, dp_rank=r, dp_world=dp, num_workers=workers, seed=5, global_batch_size=G,
                        canonical_streams=C) for r in range(dp)]


def global_batches(streams, steps):
    """(ids, tokens) of each of the next `steps` global batches, in order, one iterator per rank."""
    its, out = [iter(s) for s in streams], []
    for _ in range(steps):
        got = [next(it) for s, it in zip(streams, its) for _ in range(G // (s.micro_batch_size * s.dp_world))]
        out.append(([i for b in got for i in b["ids"]], np.concatenate([b["tokens"].numpy() for b in got])))
    return out


@pytest.mark.parametrize("L", [N // 2, 2 * N])
def test_a_cut_or_joined_epoch_is_the_n_reads_tokens_each_once(blend, L):
    ref = file_samples(blend["c"])
    lengths = Lengths(N, L)
    m = read_manifest(blend["c"])
    per_epoch = sum(lengths.samples(s["samples"]) for s in m["splits"]["train"]["shards"])
    stream = ranks(blend["c"], L, 1, G)[0]
    batches = global_batches([stream], -(-per_epoch // G))
    ids = [i for b, _ in batches for i in b]
    within = ids[:per_epoch // G * G]   # the batches wholly inside the first epoch: no sample twice
    assert len(set(within)) == len(within)
    assert len(set(ids)) == per_epoch   # and by the batch the epoch ends in, every model sample
    for b, tokens in batches:
        assert tokens.shape == (G, L + 1)
        for key, row in zip(b, tokens):
            assert np.array_equal(row, expected(key, ref)), key
    if L < N:   # every file sample's ids, none lost: the k pieces of each put back together
        pieces = {}
        for key, row in zip(ids, np.concatenate([t for _, t in batches])):
            fid, piece = key.rsplit("/", 1)
            pieces.setdefault(fid, {})[int(piece.split("of")[0])] = row
        assert set(pieces) == set(ref)
        for fid, got in pieces.items():
            assert np.array_equal(np.concatenate([got[0][:L], got[1]]), ref[fid])
    else:   # each shard's file samples in pairs: 2j and 2j+1
        assert all(int(k.rsplit("+", 1)[0].rsplit("-", 1)[1]) % 2 == 0 for k in ids)


@pytest.mark.parametrize("L", [N // 2, 2 * N])
def test_a_position_resumes_exactly_in_another_layout(blend, L):
    """Five global batches on 2 ranks (workers reading), then five more on 3 and on 1: those of one straight run."""
    straight = global_batches(ranks(blend["b"], L, 1, G), 10)
    first = ranks(blend["b"], L, 2, 4, workers=2)
    got = global_batches(first, 5)
    assert [b for b, _ in got] == [b for b, _ in straight[:5]]
    position = merged_state([json.loads(json.dumps(s.state_dict())) for s in first])
    for dp, micro in ((3, 4), (1, 12)):
        later = ranks(blend["b"], L, dp, micro)
        for s in later:
            s.load_state_dict(position)
        again = global_batches(later, 5)
        assert [b for b, _ in again] == [b for b, _ in straight[5:]], (dp, micro)
        assert all(np.array_equal(t, u) for (_, t), (_, u) in zip(again, straight[5:]))


@pytest.mark.parametrize("L", [N // 2, 2 * N])
def test_validation_is_cut_and_joined_the_same_way(blend, L):
    ref = file_samples(blend["b"], "val")
    stream = ranks(blend["b"], L, 1, 4)[0]
    batches = list(stream.val_batches(max_batches=3))
    assert len(batches) == 3
    for b in batches:
        assert b["tokens"].shape == (4, L + 1)
        for key, row in zip(b["ids"], b["tokens"].numpy()):
            assert np.array_equal(row, expected(key, ref)), key


def test_a_length_neither_divides_is_one_line_naming_both():
    with pytest.raises(DataError) as e:
        fit({"seq_len": 32, "shard_dir": "/data/shards"}, 48)
    assert "\n" not in str(e.value)
    for needle in ("32 tokens", "model.max_seq_len=48", "/data/shards", "--seq-len 48"):
        assert needle in str(e.value)
    m = {"seq_len": 32, "shard_dir": "x", "splits": {"train": {"shards": [{"samples": 2}, {"samples": 3}]}}}
    assert fit(m, 8).cut == 4 and fit(m, 96).join == 3
    with pytest.raises(DataError) as e:   # samples are joined within a shard: one of 3 at most, not 4
        fit(m, 128)
    assert "\n" not in str(e.value) and "--samples-per-shard ≥ 4" in str(e.value)
