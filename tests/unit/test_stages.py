"""data.stages (tokendata/order.py `Staged`): each stage's picks follow its own weights from its start, each source's
draws carry on across a boundary, and a position mid-stage resumes the uninterrupted order, in any layout; a source
of weight 0 in data.sources joins in the stage that weighs it; a stage with decay: true starts train.decay=wsd's
decay at its step."""
import pytest

from model.fields import ConfigError
from pretrain.config.sections import DataSection
from pretrain.config import load_config
from pretrain.data import stage_lines
from pretrain.engine import lr_lambda
from tokendata.order import Blend, Position, Staged, blend_of, layout, rank_slice
from tokendata.sources import Source
from tokendata.stream import merged_state
from tests.unit import test_order as through
from tools.branch import branch_config

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
    ([{"step": 3, "weights": {"a": 1}, "seq_len": 1.5}], "data.stages[0].seq_len=1.5 must be an integer ≥ 1"),
    ([{"step": 3, "weights": {"a": 1}, "decay": 1}], "data.stages[0].decay=1 must be true"),
    ([{"step": 3, "weights": {"a": 1}, "decay": True}, {"step": 5, "weights": {"b": 1}, "decay": True}],
     "data.stages: decay=true on more than one stage"),
])
def test_bad_stages_name_the_key(stages, words):
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
        DataSection(sources=[{"name": "a", "path": "x", "weight": 1}, {"name": "b", "path": "y", "weight": 1}],
                    stages=stages)


def test_a_source_of_weight_0_joins_in_the_stage_that_weighs_it():
    """c has weight 0 in data.sources: stage 0 is a and b alone (as if c were not there), stage 1 draws c from its
    first sample on."""
    pos, alone = Position(0, [0, 0, 0]), Position(0, [0, 0])
    picks = blend_of([1.0, 1.0, 0.0], [(2 * G, [1.0, 0.0, 1.0])]).picks(pos, 4 * G)
    assert type(blend_of([1.0, 1.0, 0.0])) is Staged
    assert picks[:2 * G] == Blend([1.0, 1.0]).picks(alone, 2 * G) and pos.counts == [8, 4, 4]
    assert sorted(picks[2 * G:]) == [0] * 4 + [2] * 4
    with pytest.raises(ConfigError, match=r"data.sources\[1\].weight=0 \(source 'b'\) and no data.stages entry gives"):
        DataSection(sources=[{"name": "a", "path": "x", "weight": 1}, {"name": "b", "path": "y", "weight": 0}],
                    stages=[{"step": 3, "weights": {"a": 1}}])
    with pytest.raises(ConfigError, match="data.sources' weights are all 0"):
        DataSection(sources=[{"name": "a", "path": "x", "weight": 0}], stages=[{"step": 3, "weights": {"a": 1}}])


ANNEAL = ["train.decay=wsd", "train.max_steps=100", "train.warmup_steps=10", "data.shard_dir=null",
          "data.sources=[{name: web, path: a, weight: 1}, {name: hq, path: b, weight: 0}]"]


def test_a_decay_stage_starts_the_wsd_decay_at_its_step():
    """decay: true at step 80 gives the schedule of train.decay_steps=20 (the decay's last 20 steps), the LR at 1 to
    step 80 and at min_lr/lr from step 100; the saved config loads again."""
    cfg = load_config("configs/demo-cpu.yaml", [*ANNEAL, "data.stages=[{step: 80, weights: {hq: 1}, decay: true}]"])
    same = load_config("configs/demo-cpu.yaml", [*ANNEAL[:-1], "train.decay_steps=20",
                                                  "data.sources=[{name: web, path: a, weight: 1}]"])
    got, want = lr_lambda(cfg.train, cfg.total_steps()), lr_lambda(same.train, same.total_steps())
    assert cfg.train.decay_steps == 20 and [got(s) for s in range(101)] == [want(s) for s in range(101)]
    assert got(80) == 1.0 > got(81) and got(100) == cfg.train.min_lr / cfg.train.lr
    assert type(cfg).from_dict(cfg.to_dict()).train.decay_steps == 20
    assert stage_lines(cfg)[1].startswith("data stage 1: steps 80–100 (the LR decays: train.decay=wsd): web 0 samples")


@pytest.mark.parametrize("overrides, words", [
    (["train.decay=cosine"], "data.stages: the stage of step 80 has decay: true (train.decay=wsd's decay starts "
                             "there), but train.decay='cosine': set train.decay=wsd"),
    (["train.decay_steps=5"], "but train.decay_steps=5: set train.decay_steps=null"),
    (["train.warmup_steps=90"], "the decay must start after the warmup and before the run ends: give it a step in 90"),
])
def test_a_bad_decay_stage_says_what_to_set(overrides, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        load_config("configs/demo-cpu.yaml", [*ANNEAL, "data.stages=[{step: 80, weights: {hq: 1}, decay: true}]",
                                              *overrides])


def test_prelaunch_prints_what_each_source_gives_in_each_stage():
    cfg = load_config("configs/demo-cpu.yaml", [
        "data.shard_dir=null", "data.sources=[{name: web, path: a, weight: 3}, {name: code, path: b, weight: 1}]",
        "data.stages=[{step: 100, weights: {code: 1, web: 1}}, {step: 150, weights: {code: 1}}]",
        "train.max_steps=200", "train.global_batch_size=16", "model.max_seq_len=128"])
    assert stage_lines(cfg) == [   # 16 samples a step: 3:1, then 1:1, then code alone
        "data stage 0: steps 0–100: web 1200 samples (153,600 tokens), code 400 samples (51,200 tokens)",
        "data stage 1: steps 100–150: web 400 samples (51,200 tokens), code 400 samples (51,200 tokens)",
        "data stage 2: steps 150–200: web 0 samples (0 tokens), code 800 samples (102,400 tokens)"]


@pytest.mark.parametrize("dp, c_weight", [(3, 0.2), (1, 0.0)])
def test_a_staged_stream_resumes_mid_stage_in_another_layout(blend, dp, c_weight):
    """Through TokenStream (real shards, DataLoader workers): stage 1 (c alone) from step 3, stage 2 (a and b 1:1)
    from step 6. Four global batches on 2 ranks, then five on 3 ranks (or on 1, c of weight 0 in stage 0: c joins
    at stage 1): the nine of one rank, in order; and a's samples in stage 2 go on from its draws of stage 0 (no
    sample of a again before its epoch ends)."""
    stages = [(3, [0.0, 0.0, 1.0]), (6, [1.0, 1.0, 0.0])]
    spec = [Source(s.path, c_weight if s.name == "c" else s.weight, s.name) for s in through.data(blend, "three sources")]
    ranks, global_batches = through.ranks, through.global_batches
    straight = global_batches(ranks(spec, 1, 0, through.G, stages=stages), 9)
    first = ranks(spec, 2, 1, 8, stages=stages)
    assert global_batches(first, 4) == straight[:4]
    assert c_weight or not any(i.startswith("c/") for batch in straight[:3] for i in batch)
    state = merged_state([s.state_dict() for s in first])
    later = ranks(spec, dp, 0, 4, stages=stages)
    for s in later:
        s.load_state_dict(state)
    assert global_batches(later, 5) == straight[4:]
    assert all(i.startswith("c/") for batch in straight[3:6] for i in batch)
    assert not any(i.startswith("c/") for batch in straight[6:] for i in batch)
    a = [i for batch in straight for i in batch if i.startswith("a/")]
    n = later[0].parts[0].manifest["splits"]["train"]["samples"]
    assert len(a) < n and len(set(a)) == len(a)   # one epoch of a, never restarted at the boundaries


def test_a_branch_of_a_run_with_a_decay_stage_decays_from_its_own_step(tmp_path):
    """tools/branch.py from step 40 of a parent whose stage of step 80 has decay: true: the branch decays over the
    parent's 20 decay steps from 40, and keeps the stage's mix (its decay flag dropped)."""
    parent = load_config("configs/demo-cpu.yaml", [*ANNEAL, "data.stages=[{step: 80, weights: {hq: 1}, decay: true}]",
                                                   f"train.run_dir={tmp_path / 'parent'}"])
    cfg = branch_config(parent, 40, str(tmp_path / "branch"), None, None, [])
    assert (cfg.train.max_steps, cfg.train.decay_steps) == (60, 20)
    assert cfg.data.stages == [{"step": 80, "weights": {"hq": 1}}]
