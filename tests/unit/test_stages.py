"""data.stages (tokendata/order.py `Staged`): each stage's picks follow its own weights from its start, each source's
draws carry on across a boundary, and a position mid-stage resumes the uninterrupted order."""
import pytest

from model.fields import ConfigError
from pretrain.config.sections import DataSection
from pretrain.config import load_config
from pretrain.data import stage_lines
from tokendata.order import Blend, Position, Staged, blend_of, layout, rank_slice
from tokendata.stream import merged_state
from tests.unit import test_order as through

G = 4
STAGED = [(2 * G, [3.0, 1.0, 0.0]), (4 * G, [0.0, 0.0, 1.0])]   # stage 1 from step 2, stage 2 from step 4


def staged():
    return Staged([1.0, 1.0, 0.0], STAGED)


def test_counts_at_boundaries_match_hand_arithmetic():
    pos, blend = Position(0, [0, 0, 0]), staged()
    blend.picks(pos, 2 * G)
    assert pos.counts == [4, 4, 0]        # stage 0: 8 picks at 1:1
    blend.picks(pos, 2 * G)
    assert pos.counts == [4 + 6, 4 + 2, 0]   # stage 1: 8 picks at 3:1
    blend.picks(pos, 3)
    assert pos.counts == [10, 6, 3]       # stage 2: source c alone


def test_draws_continue_across_a_boundary():
    blend, pos = staged(), Position(0, [0, 0, 0])
    seen = {0: [], 1: [], 2: []}
    for _ in range(6):
        lay = layout(blend, pos, G, 1)   # one stream: a draw is the source's draw number t
        for s, t in zip(lay.sources.tolist(), lay.draws.tolist()):
            seen[s].append(t)
    for s, draws in seen.items():
        assert sorted(draws) == list(range(len(draws)))   # 0, 1, 2, … never restarted at a boundary
    assert len(seen[0]) == 10 and len(seen[2]) == 8


@pytest.mark.parametrize("streams", [1, 2, 4])
def test_same_global_batches_for_every_dp(streams):
    for step in range(6):
        lay = layout(staged(), staged().position_at(step, G), G, streams)
        whole = list(zip(lay.sources.tolist(), lay.draws.tolist()))
        for dp in (1, 2, 4):
            parts = [whole[slice(*rank_slice(G, r, dp))] for r in range(dp)]
            assert sum(parts, []) == whole


def test_resume_mid_stage_equals_the_uninterrupted_order():
    blend, pos = staged(), Position(0, [0, 0, 0])
    whole = blend.picks(pos, 7 * G)
    for step in (1, 3, 5):   # stage 0, mid-stage 1, in stage 2
        again = staged().position_at(step, G)
        assert staged().picks(again, (7 - step) * G) == whole[step * G:]


def test_no_stages_is_todays_blend():
    assert type(blend_of([1.0, 2.0])) is Blend
    a, b = Position(0, [0, 0]), Position(0, [0, 0])
    assert Staged([1.0, 2.0], []).picks(a, 50) == Blend([1.0, 2.0]).picks(b, 50)


@pytest.mark.parametrize("stages, words", [
    ([{"step": 3, "weights": {"c": 1}}], "data.stages[0].weights names 'c'"),
    ([{"step": 3, "weights": {"a": 1}}, {"step": 3, "weights": {"b": 1}}], "data.stages[1].step=3 must be"),
    ([{"step": 3, "weights": {"a": 0}}], "data.stages[0].weights are all 0"),
    ([{"step": 3}], "data.stages[0] must be a mapping"),
])
def test_bad_stages_name_the_key(stages, words):
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
        DataSection(sources=[{"name": "a", "path": "x", "weight": 1}, {"name": "b", "path": "y", "weight": 1}],
                    stages=stages)


def test_prelaunch_prints_what_each_source_gives_in_each_stage():
    cfg = load_config("configs/demo-cpu.yaml", [
        "data.shard_dir=null", "data.sources=[{name: web, path: a, weight: 3}, {name: code, path: b, weight: 1}]",
        "data.stages=[{step: 100, weights: {code: 1, web: 1}}, {step: 150, weights: {code: 1}}]",
        "train.max_steps=200", "train.global_batch_size=16", "model.max_seq_len=128"])
    assert stage_lines(cfg) == [   # 16 samples a step: 3:1, then 1:1, then code alone
        "data stage 0: steps 0–100: web 1200 samples (153,600 tokens), code 400 samples (51,200 tokens)",
        "data stage 1: steps 100–150: web 400 samples (51,200 tokens), code 400 samples (51,200 tokens)",
        "data stage 2: steps 150–200: web 0 samples (0 tokens), code 800 samples (102,400 tokens)"]


def test_a_staged_stream_resumes_mid_stage_in_another_layout(blend):
    """Through TokenStream (real shards, DataLoader workers): stage 1 (c alone) from step 3, stage 2 (a and b 1:1)
    from step 6. Four global batches on 2 ranks, then five on 3 ranks: the nine of one rank, in order; and a's
    samples in stage 2 go on from its draws of stage 0 (no sample of a again before its epoch ends)."""
    stages = [(3, [0.0, 0.0, 1.0]), (6, [1.0, 1.0, 0.0])]
    spec, ranks, global_batches = through.data(blend, "three sources"), through.ranks, through.global_batches
    straight = global_batches(ranks(spec, 1, 0, through.G, stages=stages), 9)
    first = ranks(spec, 2, 1, 8, stages=stages)
    assert global_batches(first, 4) == straight[:4]
    state = merged_state([s.state_dict() for s in first])
    later = ranks(spec, 3, 0, 4, stages=stages)
    for s in later:
        s.load_state_dict(state)
    assert global_batches(later, 5) == straight[4:]
    assert all(i.startswith("c/") for batch in straight[3:6] for i in batch)
    assert not any(i.startswith("c/") for batch in straight[6:] for i in batch)
    a = [i for batch in straight for i in batch if i.startswith("a/")]
    n = later[0].parts[0].manifest["splits"]["train"]["samples"]
    assert len(a) < n and len(set(a)) == len(a)   # one epoch of a, never restarted at the boundaries
