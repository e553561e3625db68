"""train.batch_ramp (tokendata/ramp.py, pretrain/config/batch_ramp.py): each step's global batch against Megatron-LM's
formula computed in exact fractions; a ramped stream reads the canonical order's picks in sequence, the same in every
layout and across a relayout mid-ramp; the LR schedule in tokens; the plans of the full batch; the config's lines and
one-line errors."""
import collections
import math
from fractions import Fraction

import pytest

from model.config import ConfigError
from pretrain.config import load_config
from pretrain.engine import lr_lambda
from pretrain.plan import load_cluster
from pretrain.plan.memory import layout_of, plan as memory_plan
from pretrain.plan.search import candidates
from pretrain.prelaunch import main as config_main
from tokendata.ramp import BatchRamp
from tokendata.sources import Source
from tokendata.stream import TokenStream, merged_state
from tests.support.runs import BLEND, write_config

SEQ, G, C = 32, 16, 4


def megatron_sizes(start, increment, samples, full, steps):
    """The global batch of each step as Megatron-LM's RampupBatchsizeNumMicroBatchesCalculator.update gives it for
    the samples consumed so far, in exact fractions: start + increment·int(consumed / (samples / increments))."""
    per_increment, consumed, out = Fraction(samples, (full - start) // increment), 0, []
    for _ in range(steps):
        size = full if consumed > samples else start + increment * int(Fraction(consumed) / per_increment)
        out.append(size)
        consumed += size
    return out


@pytest.mark.parametrize("start,increment,samples,full", [(4, 4, 100, 16), (32, 32, 10_000, 1536), (1, 3, 7, 10),
                                                          (8, 8, 5, 64), (3, 1, 50, 7), (2, 6, 1000, 20)])
def test_each_steps_batch_is_megatrons_and_the_arithmetic_agrees_with_itself(start, increment, samples, full):
    ramp = BatchRamp(start, increment, samples, full)
    steps = ramp.ramp_steps + 5
    sizes = megatron_sizes(start, increment, samples, full, steps)
    assert [ramp.size(s) for s in range(steps)] == sizes
    before = [sum(sizes[:s]) for s in range(steps + 1)]
    assert [ramp.samples_before(s) for s in range(steps + 1)] == before
    assert all(size == full for size in sizes[ramp.ramp_steps:]) and all(size < full for size in sizes[:ramp.ramp_steps])
    for n in range(0, before[-1] + 1, max(1, before[-1] // 97)):   # the fewest steps holding n samples, by search
        assert ramp.steps_for(n) == min(s for s in range(steps + 1) if before[s] >= n)
    assert sum(steps for _, _, steps in ramp.phases()) == ramp.ramp_steps
    assert ramp.full_batches(steps) == before[-1] / full


def test_without_a_ramp_step_s_begins_at_s_times_g():
    ramp = BatchRamp.constant(G)
    assert not ramp.ramped and ramp.key() is None and ramp.phases() == []
    assert [ramp.samples_before(s) for s in range(5)] == [0, 16, 32, 48, 64] and ramp.steps_for(33) == 3


def streams(blend, dp, workers, micro, ramp, global_batch=G):
    spec = [Source(blend[n], w, n) for n, (_, _, w) in BLEND.items()]
    return [TokenStream(spec, micro, SEQ, dp_rank=r, dp_world=dp, num_workers=workers, seed=3,
                        global_batch_size=global_batch, canonical_streams=C, ramp=ramp) for r in range(dp)]


def batches(ranks, steps, first=0):
    """The sample ids of each of the next `steps` global batches (from step `first`), one stream per rank."""
    its, out = [iter(s) for s in ranks], []
    for step in range(first, first + steps):
        size = ranks[0].ramp.size(step)
        out.append([i for s, it in zip(ranks, its) for _ in range(size // (s.micro_batch_size * s.dp_world))
                    for i in next(it)["ids"]])
    return out


RAMP = BatchRamp(4, 4, 48, G)   # steps of 4, 4, 4, 4, 8, 8, 12, 12 (56 samples), then 16


def test_a_ramped_run_reads_the_unramped_orders_picks_in_sequence_in_every_layout(blend):
    """Step s of the ramp holds picks P_s … P_(s+1) − 1 of the canonical order: the samples of the unramped run's
    global batches of 4 (every ramp size is a multiple of 4) in that range, and where a ramp boundary meets one of the
    unramped run of 16 (after 16 and 32 picks), that run's batches; within a batch the picks are laid out stream by
    stream (tokendata/order.py), so the order inside a batch is its own. The same in every layout."""
    assert [RAMP.size(s) for s in range(12)] == [4, 4, 4, 4, 8, 8, 12, 12, 16, 16, 16, 16]
    ramped = batches(streams(blend, 1, 0, 4, RAMP), 12)   # 120 picks
    fours = batches(streams(blend, 1, 0, 4, None, global_batch=4), 30)
    for s, batch in enumerate(ramped):
        P, Q = RAMP.samples_before(s) // 4, RAMP.samples_before(s + 1) // 4
        assert len(batch) == RAMP.size(s) and sorted(batch) == sorted(sum(fours[P:Q], [])), s
    sixteens = batches(streams(blend, 1, 0, 16, None), 2)
    assert sorted(sum(ramped[:4], [])) == sorted(sixteens[0]) and sorted(sum(ramped[4:6], [])) == sorted(sixteens[1])
    assert len(set(sum(ramped, []))) == 120   # no sample twice in the first epoch of a and b; c wraps later
    for dp, workers, micro in ((2, 1, 2), (4, 2, 1)):   # every ramp size divides by micro × dp
        assert batches(streams(blend, dp, workers, micro, RAMP), 12) == ramped, (dp, workers, micro)


def test_a_ramped_stream_relayouts_mid_ramp_and_refuses_another_ramp(blend):
    straight = batches(streams(blend, 1, 0, 4, RAMP), 10)
    first = streams(blend, 2, 1, 2, RAMP)
    assert batches(first, 5) == straight[:5]   # to step 5, mid-ramp (between the batches of 8)
    state = merged_state([s.state_dict() for s in first])
    later = streams(blend, 4, 0, 1, RAMP)
    for s in later:
        s.load_state_dict(state)
    assert batches(later, 5, first=5) == straight[5:]
    other = streams(blend, 1, 0, 4, BatchRamp(4, 4, 96, G))[0]
    with pytest.raises(ValueError, match="train.batch_ramp"):
        other.load_state_dict(state)


def test_lr_schedule_runs_in_tokens_along_the_ramp(tmp_path):
    """warmup_steps=4 counts full batches: 64 samples, which the ramp passes in step 9 (P_9 = 72). Against the
    formula written out in x = P_s / G (the tokens before step s in full batches): x/4 in warmup, then the cosine to
    min_lr over the run's T = P_30 / G; without a ramp x = s."""
    cfg = load_config(write_config(tmp_path / "c.yaml", "x", tmp_path / "run", model={"max_seq_len": SEQ},
                                   train={"global_batch_size": G, "micro_batch_size": 4, "warmup_steps": 4,
                                          "max_steps": 30, "batch_ramp": {"start": 4, "increment": 4,
                                                                          "tokens": 48 * SEQ}}))
    ramp = cfg.batch_ramp()
    assert [ramp.size(s) for s in range(12)] == [RAMP.size(s) for s in range(12)]
    f, plain = lr_lambda(cfg.train, 30, ramp.full_batches), lr_lambda(cfg.train, 30)
    T = ramp.samples_before(30) / G   # the run's tokens in full batches
    for s in range(31):
        x = ramp.samples_before(s) / G
        want = x / 4 if x < 4 else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (x - 4) / (T - 4)))
        assert f(s) == pytest.approx(want if x < T else 0.1), s
    assert f(3) == pytest.approx(12 / 64) and plain(3) == pytest.approx(3 / 4)   # 12 samples in: 12/64 of warmup
    assert lr_lambda(cfg.train, 30, BatchRamp.constant(G).full_batches)(17) == plain(17)   # no ramp: in steps
    cfg.train.max_tokens = 100 * SEQ   # 100 samples: P_10 = 88 < 100 ≤ P_11 = 104
    assert cfg.total_steps() == 11


def ramp_config(tmp_path, **train):
    return write_config(tmp_path / "c.yaml", "x", tmp_path / "run", model={"max_seq_len": SEQ},
                        train={"global_batch_size": G, "micro_batch_size": 2, "max_steps": 40, **train})


def test_the_plans_use_the_largest_batch(tmp_path):
    """pretrain/plan/ reads train.global_batch_size (memory.py grad_accum, step.py tokens_per_step): the full batch.
    `--plan` prices the layouts of the unramped run that can run the ramp (pp 1, micro-batch × dp splitting every
    size along it), each as the unramped run's."""
    plain = load_config(ramp_config(tmp_path))
    ramped = load_config(ramp_config(tmp_path, batch_ramp={"start": 4, "increment": 4, "tokens": "2e6"}))
    assert ramped.batch_ramp().ramped and ramped.tokens_per_step == plain.tokens_per_step == G * SEQ
    assert memory_plan(ramped, layout_of(ramped, 2), 2, "cpu").peak == memory_plan(plain, layout_of(plain, 2), 2,
                                                                                     "cpu").peak
    cluster = load_cluster("h100")
    everything = {tuple(c.overrides): c.prediction.step_s for c in candidates(plain, 2, cluster)[0]}
    kept = {tuple(c.overrides): c.prediction.step_s for c in candidates(ramped, 2, cluster)[0]}
    dp = lambda overrides: 2 // math.prod(int(o.split("=")[1]) for o in overrides if o.startswith(("parallel.tp",  # noqa
                                                                                                   "parallel.cp", "parallel.pp")))
    micro = lambda overrides: int(overrides[-1].split("=")[1])   # noqa: E731
    assert kept and kept == {k: s for k, s in everything.items()   # no pipeline with a ramp; 4, 8, 12 must split
                             if "parallel.pp=1" in k and 4 % (micro(k) * dp(k)) == 0}


def test_python_m_pretrain_config_prints_the_ramp(tmp_path, capsys):
    path = ramp_config(tmp_path, batch_ramp={"start": 4, "increment": 4, "tokens": 48 * SEQ})
    assert config_main([path]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err == ["batch ramp: steps 0–4: global batch 4 (4 steps, 512 tokens)",
                   "batch ramp: steps 4–6: global batch 8 (2 steps, 512 tokens)",
                   "batch ramp: steps 6–8: global batch 12 (2 steps, 768 tokens)",
                   "batch ramp: from step 8 (1,792 tokens in): global batch 16"]


@pytest.mark.parametrize("ramp,overrides,words", [
    ({"start": 4, "increment": 4}, (), "must be null or {start, increment, tokens}"),
    ({"start": 4, "increment": 5, "tokens": 100}, (), "16 − 4 = 12 is not a multiple of increment=5"),
    ({"start": 32, "increment": 4, "tokens": 100}, (), "1 ≤ start ≤ train.global_batch_size=16"),
    ({"start": 4, "increment": 4, "tokens": "lots"}, (), "tokens='lots' must be a number > 0"),
    ({"start": 2, "increment": 2, "tokens": 1000}, ("--world-size", "2"), "its global batch 2 (of 2, 4, 6, 8, 12) is "
                                                                         "not divisible by"),
    ({"start": 4, "increment": 4, "tokens": 1000}, ("parallel.pp=2", "--world-size", "2", "--deepspeed"),
     "train.batch_ramp needs parallel.pp=1 (it is 2)")])
def test_bad_ramps_are_one_line_errors_naming_the_key(tmp_path, capsys, ramp, overrides, words):
    code = config_main([ramp_config(tmp_path, batch_ramp=ramp), *overrides])
    err = capsys.readouterr().err
    assert code == 2 and words in err and "train.batch_ramp" in err and len(err.strip().splitlines()) == 1, err
