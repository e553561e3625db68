"""A stage's own sequence length (data.seq_len, data.stages[i].seq_len; tokendata/lengths.py `StageLengths`, `rows`):
a stage of L < M = model.max_seq_len trains each sample of the order (of M) as M/L rows of L, so its global batches
are the same samples, in the same order, as at M; checked against hand arithmetic on the shards' file samples
across boundaries 32 → 16 and 16 → 32 (shards of 32), over an epoch (each token once), and through a stream
stopped on 2 ranks and resumed on 3 on either side of a boundary, and along a batch ramp; the config's one-line
refusals name the key."""
import numpy as np
import pytest

from model.config import ConfigError
from pretrain.config import load_config
from pretrain.data import stage_lines
from tokendata.lengths import StageLengths, rows
from tokendata.ramp import BatchRamp
from tokendata.shards import DataError, read_manifest
from tokendata.sources import Source
from tokendata.stream import TokenStream, merged_state
from tests.unit.test_lengths import file_samples

N, G, C = 32, 24, 4   # the blend fixture's shards hold samples of 32 tokens


def test_rows_by_hand():
    tokens = np.arange(2 * 33).reshape(2, 33)   # two samples of M = 32: ids 0…32 and 33…65
    got = rows({"tokens": tokens, "ids": ["x", "y"], "retries": 1}, 16)
    assert got["ids"] == ["x/0of2", "x/1of2", "y/0of2", "y/1of2"] and got["retries"] == 1
    assert got["tokens"].tolist() == [list(range(0, 17)), list(range(16, 33)), list(range(33, 50)),
                                      list(range(49, 66))]
    eighths = rows({"tokens": tokens, "ids": ["x", "y"]}, 4)["tokens"]
    assert eighths.shape == (16, 5) and eighths[9].tolist() == [37, 38, 39, 40, 41]   # y's row 1: ids 4…8 of it
    assert rows({"tokens": tokens, "ids": ["x", "y"]}, 32)["tokens"] is tokens
    lengths = StageLengths(32, [(0, 16), (48, 32), (96, 8)])
    assert [lengths.at(p) for p in (0, 47, 48, 95, 96, 10 ** 6)] == [16, 16, 32, 32, 8, 8]
    with pytest.raises(DataError, match="seq_len=12 must divide model.max_seq_len=32"):
        StageLengths(32, [(24, 12)])


def streams(spec, M, dp, micro, lengths, workers=0, global_batch=G):
    return [TokenStream(spec, micro, M, dp_rank=r, dp_world=dp, num_workers=workers, seed=5,
                        global_batch_size=global_batch, canonical_streams=C, stages=[(3, [0.0, 1.0, 1.0])] if isinstance(spec, list) else (),
                        stage_lengths=lengths) for r in range(dp)]


def global_batches(ranks, steps):
    """(ids, tokens) of each of the next `steps` global batches, rank after rank."""
    its, out = [iter(s) for s in ranks], []
    for _ in range(steps):
        got = [next(it) for s, it in zip(ranks, its) for _ in range(s.global_batch_size // (s.micro_batch_size *
                                                                                        s.dp_world))]
        out.append(([i for b in got for i in b["ids"]], np.concatenate([b["tokens"].numpy() for b in got])))
    return out


def cut_by_hand(batches, M, L):
    """The global batches of M as a stage of L trains them: sample i's ids [pL, pL + L + 1) as its row p."""
    q = M // L
    return [([f"{k}/{p}of{q}" for k in ids for p in range(q)] if q > 1 else ids,
             np.array([row[p * L:p * L + L + 1] for row in tokens for p in range(q)]).reshape(-1, L + 1))
            for ids, tokens in batches]


# (model.max_seq_len, the stages' lengths [(step, L)], each step's L): shards of 32 cut (M = 32) or joined (M = 64)
CASES = {"32 to 16": (32, [(2, 16)], [32, 32, 16, 16, 16]),
         "16 to 32": (32, [(0, 16), (2, 32)], [16, 16, 32, 32, 32]),
         "64: 32 to 16 to 64": (64, [(1, 32), (2, 16), (4, 64)], [64, 32, 16, 16, 64])}


@pytest.mark.parametrize("case", CASES)
def test_each_stage_trains_the_samples_of_M_cut_into_its_rows(blend, case):
    """Five global batches of a staged stream against the stream without stage lengths, cut by hand; and each row
    against the shards' own file samples (by its id: a file sample's ids [pL, pL + L + 1) at M = 32)."""
    M, lengths, each = CASES[case]
    plain = global_batches(streams(blend["b"], M, 1, 6, ()), 5)
    staged = global_batches(streams(blend["b"], M, 1, 6, lengths), 5)
    ref = file_samples(blend["b"])
    for step, L in enumerate(each):
        (ids, tokens), (want_ids, want) = staged[step], cut_by_hand(plain[step:step + 1], M, L)[0]
        assert tokens.shape == (G * M // L, L + 1) and ids == want_ids and np.array_equal(tokens, want), step
        if M == N:
            for key, row in zip(ids, tokens):
                fid, p = (key.rsplit("/", 1)[0], int(key.rsplit("/", 1)[1].split("of")[0])) if L < M else (key, 0)
                assert np.array_equal(row, ref[fid][p * L:p * L + L + 1]), key


def test_an_epoch_across_a_change_of_length_trains_every_token_once(blend):
    """Source c (small: 5 global batches of 8 an epoch) read for its first epoch, 32 → 16 at step 2: the rows of the
    file samples drawn, put back together, are every file sample of the epoch once, each whole."""
    ref = file_samples(blend["c"])
    per_epoch = read_manifest(blend["c"])["splits"]["train"]["samples"]
    batches = global_batches(streams(blend["c"], N, 1, 8, [(2, 16)], global_batch=8), per_epoch // 8)
    assert per_epoch // 8 >= 4 and [len(ids) for ids, _ in batches[1:3]] == [8, 16]   # the change inside the epoch
    pieces = {}
    for ids, tokens in batches:
        for key, row in zip(ids, tokens):
            fid, p = (key.rsplit("/", 1)[0], int(key.rsplit("/", 1)[1][0])) if "of" in key else (key, None)
            assert (fid, p) not in pieces, key   # no row twice
            pieces[fid, p] = row
    whole = {}
    for (fid, p), row in pieces.items():
        whole.setdefault(fid, {})[p] = row
    assert len(whole) == per_epoch // 8 * 8 and set(whole) <= set(ref)   # no file sample twice, none of another
    for fid, got in whole.items():
        assert set(got) in ({None}, {0, 1}), fid   # whole, or both halves: no token skipped
        joined = got[None] if None in got else np.concatenate([got[0][:16], got[1]])
        assert np.array_equal(joined, ref[fid]), fid


@pytest.mark.parametrize("stop", [1, 2, 3])
@pytest.mark.parametrize("lengths", [[(2, 16)], [(0, 16), (2, 32)]], ids=["32 to 16", "16 to 32"])
def test_a_stream_stopped_on_2_ranks_resumes_on_3_on_either_side_of_a_boundary(blend, lengths, stop):
    """Three blended sources (weights changing at step 3, the length at step 2), DataLoader workers on the 2 ranks:
    stopped after `stop` global batches (inside the first stage, at the boundary, inside the second), the position
    loaded on 3 ranks: the global batches of one straight run, rows and all."""
    spec = [Source(blend[n], w, n) for n, w in (("a", 2.0), ("b", 1.0), ("c", 1.0))]
    straight = global_batches(streams(spec, N, 1, 6, lengths), 5)
    first = streams(spec, N, 2, 4, lengths, workers=2)
    got = global_batches(first, stop)
    later = streams(spec, N, 3, 2, lengths)
    for s in later:
        s.load_state_dict(merged_state([r.state_dict() for r in first]))
    got += global_batches(later, 5 - stop)
    for (ids, tokens), (want_ids, want) in zip(got, straight):
        assert ids == want_ids and np.array_equal(tokens, want)
    plain = global_batches(streams(spec, N, 1, 6, ()), 5)   # and the straight run is the plain order, cut
    L = dict(lengths)
    each = [L.get(0, N) if s < 2 else L[2] for s in range(5)]
    assert [ids for ids, _ in straight] == [cut_by_hand([b], N, n)[0][0] for b, n in zip(plain, each)]


ANY = ["data.shard_dir=x", "model.max_seq_len=128"]


@pytest.mark.parametrize("overrides, words", [
    (["data.stages=[{step: 5, seq_len: 256}]"], "data.stages[0].seq_len=256 exceeds model.max_seq_len=128: the "
     "model's position-indexed weights hold 128 positions; grow the model first (tools/convert.py extend-length --to "
     "256, or checkpoint.extend_length=true with model.max_seq_len=256)"),
    (["data.seq_len=48"], "data.seq_len=48 does not divide model.max_seq_len=128"),
    (["data.stages=[{step: 5, seq_len: 0}]"], "data.stages[0].seq_len=0 must be an integer ≥ 1"),
    (["data.stages=[{step: 5, seq_len: 32}, {step: 9, seq_len: 2}]", "parallel.cp=2"],
     "data.stages[1].seq_len=2 is not divisible by 2·parallel.cp = 4"),
    (["data.seq_len=2", "parallel.tp=4", "parallel.sequence_parallel=true"],
     "data.seq_len=2 is not divisible by parallel.tp=4, as parallel.sequence_parallel needs"),
    (["data.seq_len=4", "parallel.tp=2", "parallel.cp=2", "parallel.sequence_parallel=true"],   # chunks of 1 over tp 2
     "data.seq_len=4 is not divisible by 2·parallel.cp·parallel.tp = 8, as parallel.sequence_parallel needs"),
    (["data.stages=[{step: 5, seq_len: 64}]", "parallel.pp=2", "parallel.zero_stage=1"],
     "data.stages[0].seq_len=64 needs parallel.pp=1"),
])
def test_a_length_the_model_or_layout_cannot_train_is_one_line_naming_the_key(overrides, words):
    with pytest.raises(ConfigError) as e:
        load_config("configs/demo-cpu.yaml", [*ANY, *overrides])
    assert words in str(e.value) and "\n" not in str(e.value)


def test_the_config_check_prints_each_stages_length():
    cfg = load_config("configs/demo-cpu.yaml", [
        "data.shard_dir=null", "data.sources=[{name: web, path: a, weight: 3}, {name: code, path: b, weight: 1}]",
        "data.seq_len=32", "data.stages=[{step: 100, weights: {code: 1, web: 1}}, {step: 150, seq_len: 128}]",
        "train.max_steps=200", "train.global_batch_size=16", "model.max_seq_len=128"])
    assert stage_lines(cfg) == [   # 16 samples of 128 a step whatever the length: 3:1, then 1:1 twice
        "data stage 0: steps 0–100 at seq_len 32 (4 rows a sample of 128): web 1200 samples (153,600 tokens), code "
        "400 samples (51,200 tokens)",
        "data stage 1: steps 100–150 at seq_len 32 (4 rows a sample of 128): web 400 samples (51,200 tokens), code "
        "400 samples (51,200 tokens)",
        "data stage 2: steps 150–200 at seq_len 128: web 400 samples (51,200 tokens), code 400 samples (51,200 "
        "tokens)"]
    one = load_config("configs/demo-cpu.yaml", [*ANY, "data.seq_len=64", "train.max_steps=10", "train.warmup_steps=2"])
    assert stage_lines(one) == ["data stage 0: steps 0–10 at seq_len 64 (2 rows a sample of 128): data 160 samples "
                                "(20,480 tokens)"]


def ramped(blend, ramp, lengths):
    """(ids, tokens) of the first six steps' global batches of a stream along `ramp`."""
    it, out = iter(TokenStream(blend["b"], 8, N, seed=5, global_batch_size=G, canonical_streams=C, ramp=ramp,
                               stage_lengths=lengths)), []
    for step in range(6):
        got = [next(it) for _ in range(ramp.size(step) // 8)]
        out.append(([i for b in got for i in b["ids"]], np.concatenate([b["tokens"].numpy() for b in got])))
    return out


def test_along_a_batch_ramp_a_stage_begins_at_its_steps_batch(blend):
    """train.batch_ramp 8, 8, 8, 16, 16, then 24 (G): the length changes at step 3's global batch, inside the ramp;
    each step's rows are its samples (those of the ramped order without stage lengths) cut by hand."""
    ramp = BatchRamp(8, 8, 48, G)
    assert [ramp.size(s) for s in range(6)] == [8, 8, 8, 16, 16, 24]
    plain, staged = ramped(blend, ramp, ()), ramped(blend, ramp, [(3, 16)])
    for step, (ids, tokens) in enumerate(staged):
        want_ids, want = cut_by_hand([plain[step]], N, 16 if step >= 3 else N)[0]
        assert ids == want_ids and np.array_equal(tokens, want)
        assert len(ids) == ramp.size(step) * (2 if step >= 3 else 1)
