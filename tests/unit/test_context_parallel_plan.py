"""parallel.cp in the memory plan, the time plan and `--plan`, against numbers computed by hand
(pretrain/plan/context_parallel.py)."""
from pathlib import Path

import pytest

from model import ModelConfig
from model.config import ConfigError
from pretrain.config import load_config
from pretrain.config.deepspeed_dict import deepspeed_config
from pretrain.plan import PRESETS, context_parallel as cpp
from pretrain.plan.memory import Layout, layout_of, layouts, plan
from pretrain.plan.search import candidates, with_overrides
from pretrain.plan.step import Efficiency, predict
from pretrain.plan.workload import engine_of

DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo-cpu.yaml"
# one block, d 8, 2 heads of 4, n 16, d_ffn 32, no dropout, fp32
TINY = dict(vocab_size=32, d_model=8, n_layers=1, n_heads=2, d_ffn=32, max_seq_len=16)


def test_a_dense_block_under_cp_2_by_hand():
    """cp 2, n 16: s = 4, P = 8 positions a rank, its chunks (1 and 2, or 0 and 3) read K = 5·4 = 20 keys."""
    cfg = ModelConfig(mixer="dense", **TINY)
    assert cpp.spans(16, 2) == (4, 8, 20)
    terms = {t.name: t.bytes for t in cpp.layer_terms(cfg, 0, 1, 16, 2, 1, 4, False)}
    N, d, a = 8, 8, 4
    norms = 2 * (a * N * d + 2 * 4 * N)                      # two layer norms' inputs and fp32 statistics
    outside = norms + a * N * d + a * N * d + 2 * a * N * 32  # + the mixer's and the MLP's normed inputs, the hidden
    assert terms["outside the mixer, n/cp = 8 positions"] == outside
    assert terms["dense: hidden features σ(W_1 X)"] == a * N * d
    assert terms["output projection input"] == a * N * d
    assert terms["gathered values of keys j < t1, B·K·F = 1·20·8"] == a * 20 * 8          # V alone: F = Hl·d_h = 8
    assert terms["softmax A of the chunks' rows, (B or 1)·Hl·s·K = 1·2·4·20"] == a * 2 * 4 * 20
    assert sum(terms.values()) == outside + 2 * a * N * d + a * 160 + a * 160


def test_dot_gathers_keys_and_values_a_synthesizer_values_alone():
    """F: dense Hl·d_h, dot 2·Hl·d_h (K and V), SGU its LN(Z2) (d_inner/tp); bytes sent a step: two rounds a layer to
    cp − 1 peers, forward and backward alike."""
    dense, dot = (ModelConfig(mixer=m, **TINY) for m in ("dense", "dot"))
    assert cpp.gathered_width(dense, 0, 1) == 8 and cpp.gathered_width(dot, 0, 1) == 16
    assert cpp.gathered_width(dot, 0, 2) == 8                                           # heads split over TP
    sent = cpp.sent_per_step(dense, 2, 16, 4, 1, 4)   # B 2, cp 4: s = 2, three peers
    assert sent == {"forward": 2 * 3 * 2 * 2 * 8 * 4, "backward": 2 * 3 * 2 * 2 * 8 * 4}
    assert cpp.sent_per_step(dot, 2, 16, 4, 1, 4)["forward"] == 2 * sent["forward"]
    assert cpp.gathered_width(ModelConfig(mixer="sgu", **TINY), 0, 1) == 8          # LN(Z2): d_inner = d
    assert cpp.gathered_width(ModelConfig(block="gmlp", mixer="sgu", **TINY), 0, 2) == 32 // 2 // 2   # gMLP: d_ffn/2, /tp
    with pytest.raises(ValueError, match="multiple of 6"):
        cpp.spans(16, 3)


def test_a_batch_shared_map_keeps_its_rows_and_their_copy_over_the_batch():
    """random: A is the batch's (1·Hl·s·K), and the broadcast A V keeps it copied over the batch (B·Hl·s·K);
    dense's A is per sample (B·Hl·s·K). In random+dot, random's logits are a view of R (nothing kept), dot's are
    kept by α."""
    rows = {m: {t.name: t.bytes for t in cpp.layer_terms(ModelConfig(mixer=m, **TINY), 0, 3, 16, 2, 1, 4, False)}
            for m in ("random", "dense", "random+dot")}
    assert rows["random"]["softmax A of the chunks' rows, (B or 1)·Hl·s·K = 1·2·4·20"] == 4 * 2 * 4 * 20
    assert rows["random"]["the batch's map A copied over the batch by A V, (B or 1)·Hl·s·K = 3·2·4·20"] == \
        4 * 3 * 2 * 4 * 20
    assert rows["dense"]["softmax A of the chunks' rows, (B or 1)·Hl·s·K = 3·2·4·20"] == 4 * 3 * 2 * 4 * 20
    # dense's σ(W_1 X) (B·Hl·P·d_h) made contiguous and its W_2 rows (B·Hl·K·d_h) copied over the batch
    assert rows["dense"]["dense: q contiguous and the batch's keys copied over the batch"] == 4 * 3 * 2 * 4 * (8 + 20)
    mixed = [name for name in rows["random+dot"] if "kept by α" in name]
    assert mixed == ["dot: logits S rows, kept by α, (B or 1)·Hl·s·K = 3·2·4·20"]


def test_the_memory_plan_of_a_cp_layout():
    """The demo at cp 2 × dp 2, ZeRO-1: its activations are context_parallel's, its optimizer states partitioned over
    dp·cp = 4 ranks, and the layouts of 4 ranks include it."""
    cfg = load_config(DEMO, ["parallel.cp=2", "parallel.zero_stage=1"])
    lay = layout_of(cfg, 4)
    assert lay == Layout(1, 1, 2, 1, 2) and lay.world == 4 and lay.shards == 4 and str(lay).startswith("tp 1 × cp 2")
    stage = plan(cfg, lay, device="cpu").stages[0]
    m = cfg.model
    want = cpp.cp_activations(m, cfg.train.micro_batch_size, m.max_seq_len, 2)
    assert stage.activations.total == want.total and stage.activations.transient == want.transient
    T = stage.params[0]
    moments = next(t for t in stage.states if t.name.startswith("AdamW moments"))
    assert moments.bytes == 8 * T // 4
    assert any(note.startswith("context parallelism") for note in stage.notes)
    assert Layout(1, 1, 2, 1, 2) in layouts(cfg, 4) and Layout(1, 1, 1, 1, 4) in layouts(cfg, 4)


def test_the_time_plan_counts_the_gathers():
    """cp 2 of the demo on the cpu preset: per block two rounds, each an all-gather forward and a reduce-scatter
    backward of 2·B·s·F·4 bytes over 2 ranks, (2 − 1)·(α + B·s·F·4/β); the GEMMs of half the tokens."""
    base = load_config(DEMO, ["parallel.zero_stage=1", "model.mixer=dense"])
    cfg = with_overrides(base, ["parallel.cp=2"])
    cpu, eff = PRESETS["cpu"], Efficiency(0.5)
    one = predict(base, Layout(1, 1, 2, 1), cpu, eff, engine_of(base, deepspeed_config(base, 2)), gpu=False)
    two = predict(cfg, Layout(1, 1, 2, 1, 2), cpu, eff, engine_of(cfg, deepspeed_config(cfg, 2)), gpu=False)
    m = cfg.model
    B, s = cfg.train.micro_batch_size, m.max_seq_len // 4
    link = cpu.intra_node
    per_layer = 2 * 2 * (link.latency_s + B * s * m.d_model * 4 / link.bytes_per_s)
    assert one.terms["cp"] == 0
    assert two.terms["cp"] == pytest.approx(two.micro_batches * m.n_layers * per_layer)
    assert two.terms["compute"] == pytest.approx(one.terms["compute"] / 2, rel=0.02)   # each rank half the tokens
    assert two.gpus == 4


def test_plan_ranks_layouts_with_cp():
    """`--plan` prices cp layouts beside the others, once the launch accepts parallel.cp > 1."""
    cfg = load_config(DEMO, [])
    try:
        with_overrides(cfg, ["parallel.cp=2"]).check_runtime(4, cuda=False)
    except ConfigError as e:
        pytest.skip(f"the launch refuses cp > 1 on this branch: {e}")
    ranked, _ = candidates(cfg, 4, PRESETS["cpu"])
    assert any(c.layout.cp == 2 for c in ranked) and "parallel.cp=2" in \
        next(c for c in ranked if c.layout.cp == 2).overrides


def test_an_sgu_block_under_cp_2_by_hand():
    """SGU (d_inner = d = 8, 2 heads of c = 4): per position U X before and after GELU (2·2·8), LN(Z2), the gate and
    their product (3·8); gathered LN(Z2) of K = 20 keys; its W rows, copied over the batch (B·Hl·s·K) by the broadcast
    product W · LN(Z2)."""
    terms = {t.name: t.bytes for t in cpp.layer_terms(ModelConfig(mixer="sgu", **TINY), 0, 2, 16, 2, 1, 4, False)}
    assert terms["sgu: U X before and after GELU, LN(Z2), the gate, their product"] == 4 * 7 * 2 * 8 * 8
    assert terms["gathered LN(Z2) of keys j < t1, B·K·F = 2·20·8"] == 4 * 2 * 20 * 8
    assert terms["sgu: W rows ⊙ causal, per sample, (B or 1)·Hl·s·K = 2·2·4·20"] == 4 * 2 * 2 * 4 * 20


def test_a_recomputed_block_under_cp_keeps_its_input_and_the_gathered_rows():
    """parallel.activation_checkpointing under cp: a checkpointed dense block keeps its input, P = 8 positions of
    d = 8 (P/tp under sequence parallelism), and its ContextCache, every chunk's values B·n·F = 2·16·8, which the
    second chunk's recomputation reads; a pipeline stage recomputes both chunks in one region and keeps its input
    alone."""
    cfg, a = ModelConfig(mixer="dense", **TINY), 4
    kept = {t.name: t.bytes for t in cpp.cp_activations(cfg, 2, 16, 2, 1, a, checkpoint_every=1).kept}
    assert kept["1 layer(s) (dense, checkpointed: its input and its gathered rows) under cp 2"] == \
        a * 2 * 8 * 8 + a * 2 * 16 * 8
    kept = {t.name: t.bytes for t in cpp.cp_activations(cfg, 2, 16, 2, 2, a, checkpoint_every=1, sp=2).kept}
    assert kept["1 layer(s) (dense, checkpointed: its input and its gathered rows) under cp 2"] == \
        a * 2 * 8 * 8 // 2 + a * 2 * 16 * 4   # heads over tp 2: F = Hl·d_h = 4
    kept = {t.name: t.bytes for t in cpp.cp_activations(cfg, 2, 16, 2, 1, a, checkpoint_every=1, pipeline=True).kept}
    assert kept["1 layer(s) (dense, checkpointed: its input) under cp 2"] == a * 2 * 8 * 8
