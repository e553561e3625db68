"""The time model (pretrain/plan/): each term against a hand computation, the layout orders of Narayanan et al. 2021
against their published measurements, the CPU layouts' order against the step times the bench measured once
(pretrain/plan/calibration.yaml), the calibration, `--plan`, the cluster files and the run's own check."""
import os
import re
from dataclasses import replace

import pytest

from model.config import ConfigError
from pretrain.config import load_config
from pretrain.plan.memory import Layout
from pretrain.plan import PRESETS, load_cluster, terms
from pretrain.plan.calibration import calibrated, fit_host, load, predicted
from pretrain.plan.cluster import Link
from pretrain.plan.run_prediction import StepCheck, expected
from pretrain.plan.published import MEGATRON_2021, check, paper_flops
from pretrain.plan.step import Efficiency, LayerWork, layer_memory_bytes, optimizer_bytes_per_param, predict
from pretrain.plan.workload import engine_of
from pretrain.config.deepspeed_dict import deepspeed_config
from pretrain.prelaunch import main as config_main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAPER = os.path.join(ROOT, "tests", "data", "megatron_2021_layouts.yaml")
DEMO = os.path.join(ROOT, "configs", "demo-cpu.yaml")


# ---- each term against a hand computation ------------------------------------------------------------------------
def test_gemm_terms_against_hand_computation():
    # 2×2 output tiles of 128 on 3 multiprocessors: two waves, the second one third full → 4 of 6 slots busy
    assert terms.wave_utilization(256, 256, 3) == pytest.approx(4 / 6)
    gpu = terms.Rate(flops=0.5e15, sms=132, bandwidth=3e12, element_bytes=2)
    # compute-bound: 2·1024³ FLOPs at e·P over 64 of 132 multiprocessors
    assert terms.gemm_time(1024, 1024, 1024, gpu) == pytest.approx(2 * 1024**3 / (0.5e15 * 64 / 132))
    # one row: memory-bound, the 4096² weight read dominates: 2 bytes × (4096 + 4096² + 4096) at 3 TB/s
    assert terms.gemm_time(1, 4096, 4096, gpu) == pytest.approx(2 * (4096 + 4096**2 + 4096) / 3e12)
    # a layer's three training GEMMs: forward (M × N out), ∂X (M × K), ∂W (K × N)
    cpu = terms.Rate(flops=1e11, sms=1, bandwidth=1e10, element_bytes=4)
    assert terms.train_gemms_time(1024, 128, 384, cpu) == pytest.approx(3 * 2 * 1024 * 128 * 384 / 1e11)
    assert terms.memory_time(5e9, 1e10) == 0.5


def test_collective_terms_against_hand_computation():
    link = Link(100, 5)   # 100 GB/s, 5 µs a ring step
    assert terms.all_reduce_time(1e9, 8, link) == pytest.approx(2 * 7 * (5e-6 + 1e9 / 8 / 1e11))
    assert terms.reduce_scatter_time(1e9, 8, link, calls=3) == pytest.approx(7 * (3 * 5e-6 + 1e9 / 8 / 1e11))
    assert terms.all_reduce_time(1e9, 1, link) == 0.0
    assert terms.send_time(2e6, link) == pytest.approx(5e-6 + 2e6 / 1e11)
    assert terms.buckets(1.3e9, 5e8) == 3 and terms.buckets(10, 5e8) == 1
    assert terms.exposed(3.0, 5.0) == 0.0 and terms.exposed(5.0, 3.0) == 2.0
    # a group's link: NVLink within a node; across nodes the NICs of its ranks in a node, at the network's latency
    h100 = PRESETS["h100"]
    assert h100.group_link(8, 1) is h100.intra_node
    assert (h100.group_link(16, 1).gbps, h100.group_link(16, 1).latency_us) == (min(450, 8 * 50), 14)
    assert h100.group_link(8, 8).gbps == 50     # one rank a node: its own NIC
    assert h100.group_link(4, 16).gbps == 50 and h100.group_link(4, 2).gbps == 450


def test_pipeline_and_optimizer_terms_against_hand_computation():
    step, bubble = terms.pipeline_time([1.0, 1.0, 1.0, 1.0], 8)   # p = 4 equal stages, m = 8
    assert (step, bubble) == (7 * 1.0 + 4.0, 3.0) and bubble / 8 == (4 - 1) / 8
    assert terms.pipeline_time([1.0, 2.0], 4) == (3 * 2.0 + 3.0, 1.0)   # the slowest stage paces the rest

    def config(*over):
        return load_config(os.path.join(ROOT, "configs", "synth-1.3b.yaml"), list(over))

    # ZeRO-1, bf16 weights, fp32 master: flat copy 2·2, cast 2 + 4, AdamW 8·4, copy back 4 + 2
    assert optimizer_bytes_per_param(config()) == 4 + 6 + 32 + 6
    # train.autocast (ZeRO-0, fp32 weights are the master): AdamW alone, 8·4
    assert optimizer_bytes_per_param(config("parallel.zero_stage=0", "parallel.tp=1", "train.autocast=true")) == 32
    # bf16 master weights and moments: flat copy 2·2, no cast, AdamW 8·2, copy back 2 + 2
    assert optimizer_bytes_per_param(config("train.master_weights=bf16")) == 4 + 16 + 4
    # a block keeping 1000 bytes: 4 passes, 5 when recomputed; the paper's engine also moves its n² scores
    w = LayerWork("dot", (), 0.0, 1 / 3, 4, 1000, 2)
    assert layer_memory_bytes(w, False, engine_of(config(), {}), 2, 64) == 4 * 1000
    assert layer_memory_bytes(w, True, engine_of(config(), {}), 2, 64) == 5 * 1000
    assert layer_memory_bytes(w, False, MEGATRON_2021, 2, 64) == 4 * 1000 + 12 * 2 * 4 * 64 * 64


def test_a_step_is_its_terms_and_compute_is_the_flop_count():
    """On the CPU preset (one multiprocessor: no wave losses) a compute-bound model's compute term is the project's
    FLOP count at e·P; recomputation adds the blocks' forward; TP adds 4 all-reduces a block of b·n·d·4 bytes."""
    cfg = load_config(DEMO, ["model.mixer=dot"])
    cpu, eff = PRESETS["cpu"], Efficiency(0.5)
    lay = Layout(1, 1, 2, 2)
    p = predict(cfg, lay, cpu, eff, engine_of(cfg, deepspeed_config(cfg, 2)), gpu=False)
    assert p.step_s == pytest.approx(sum(p.terms.values()))
    m, tokens = p.micro_batches, cfg.train.micro_batch_size * cfg.model.max_seq_len
    assert p.terms["compute"] == pytest.approx(m * tokens * p.flops_per_step / cfg.tokens_per_step / (0.5 * 1e11))
    assert p.terms["bubble"] == 0 and p.terms["tp"] == 0
    tp = Layout(2, 1, 1, 1)
    cfg2 = load_config(DEMO, ["model.mixer=dot", "parallel.tp=2", "parallel.zero_stage=1"])
    q = predict(cfg2, tp, cpu, eff, engine_of(cfg2, deepspeed_config(cfg2, 1)), gpu=False)
    B = cfg2.train.micro_batch_size * cfg2.model.max_seq_len * cfg2.model.d_model * 4   # fp32 activations
    # a block: 2 row-parallel layers, each one all-reduce forward and its pair backward; the embedding's and the head
    # input's gradient; the loss's 3 small ones (latency alone)
    reduces = cfg2.model.n_layers * 2 * 2 + 2
    hand = reduces * 2 * (2 - 1) * (cpu.intra_node.latency_s + B / 2 / cpu.intra_node.bytes_per_s)
    assert q.terms["tp"] == pytest.approx(q.micro_batches * (hand + 3 * cpu.intra_node.latency_s))


def test_pipeline_sends_against_hand_computation():
    """pp 2 of the demo on the cpu preset: each stage one boundary, its activation forward and gradient backward a
    micro-batch, b·n·d·4 bytes each, over the link within a node; ZeRO-1 over one data-parallel rank costs nothing."""
    cfg = load_config(DEMO, ["parallel.pp=2", "parallel.zero_stage=1"])
    cpu = PRESETS["cpu"]
    p = predict(cfg, Layout(1, 2, 1, 1), cpu, Efficiency(0.5), engine_of(cfg, deepspeed_config(cfg, 1)), gpu=False)
    B = cfg.train.micro_batch_size * cfg.model.max_seq_len * cfg.model.d_model * 4
    assert p.terms["pp"] == pytest.approx(p.micro_batches * 2 * (cpu.intra_node.latency_s + B / cpu.intra_node.bytes_per_s))
    assert p.terms["dp"] == 0 and p.micro_batches == 2 and p.terms["bubble"] > 0


# ---- the paper's layout figures ------------------------------------------------------------------------------------
def test_layout_orders_of_narayanan_et_al_2021():
    """Every pair of rows that the paper's figures 13–16 separate by more than their reading's tie comes out in the
    published order, with one efficiency for every row (no row tuned)."""
    series = check(PAPER)
    assert {s.figure for s in series} == {13, 14, 15, 16} and len(series) == 9
    for s in series:
        assert len(s.pairs()) >= 4, (s.figure, s.batch)   # the order checked is not a trivial one
        assert not s.disagreements(), [(s.figure, s.batch, (a.tp, a.pp, a.dp, a.micro), (b.tp, b.pp, b.dp, b.micro))
                                       for a, b in s.disagreements()]
    # eq. (3) by hand: the 1T model of Table 1 at batch 3072 (l 128, h 25600)
    assert paper_flops(3072, 2048, 128, 25600, 51200) == pytest.approx(
        96 * 3072 * 2048 * 128 * 25600**2 * (1 + 2048 / (6 * 25600) + 51200 / (16 * 128 * 25600)))


# ---- this repository's own measurements ----------------------------------------------------------------------------
def test_cpu_layouts_in_the_measured_order():
    """The step times the bench measured once for the demo model at 2 CPU ranks (benchmarks/bench.py --only
    layouts), against the time model's order on the cpu preset; the layouts span ≥ 1.5×. e and the host's times are
    fitted on the points marked `fit: true` alone; every pair the check counts has a held-out point in it."""
    points = [p for p in load() if p.device == "cpu"]
    held = [p for p in points if not p.fit]
    assert len(points) >= 4 and len(held) >= 4 and len(points) - len(held) >= 3
    assert max(p.step_s for p in points) >= 1.5 * min(p.step_s for p in points)
    eff = calibrated("cpu").efficiency("cpu", compiled=False)
    assert eff.host_micro_batch > 0 and eff.host_step > 0
    pred = {p: predicted(p, eff) for p in points}
    pairs = [(a, b) for a in points for b in points if (not a.fit or not b.fit) and a.step_s < b.step_s / (1 + CPU_TIE)]
    assert len(pairs) >= 10   # the order checked is not a trivial one
    wrong = [(a.what, b.what) for a, b in pairs if not pred[a] < pred[b]]
    assert not wrong, wrong


CPU_TIE = 0.15   # measured steps closer than this are not ordered (the shared machine's repetitions spread so)


def test_host_terms_and_their_fit():
    """On a CPU the host's time a micro-batch is on every stage's critical path and its time a step is added once;
    fit_host recovers e and both host times from steps the model itself predicts."""
    cfg = load_config(DEMO, ["parallel.zero_stage=1", "train.micro_batch_size=1"])
    engine, cpu = engine_of(cfg, deepspeed_config(cfg, 2)), PRESETS["cpu"]
    bare = predict(cfg, Layout(1, 1, 2, 8), cpu, Efficiency(0.5), engine, gpu=False)
    host = predict(cfg, Layout(1, 1, 2, 8), cpu, Efficiency(0.5, host_micro_batch=0.01, host_step=0.1), engine,
                   gpu=False)
    assert host.terms["host"] == pytest.approx(8 * 0.01 + 0.1) and bare.terms["host"] == 0
    assert host.step_s - bare.step_s == pytest.approx(8 * 0.01 + 0.1)
    truth = Efficiency(0.4, host_micro_batch=0.02, host_step=0.15)
    points = [replace(p, step_s=predicted(p, truth)) for p in load() if p.device == "cpu"][:4]
    assert fit_host(points) == pytest.approx((0.4, 0.02, 0.15), rel=1e-6)


def test_calibration_fits_each_mode_and_the_variants_measured():
    fit = calibrated("gpu")
    assert 0.2 < fit.compute[("gpu", False)] < 0.8 and 0.2 < fit.compute[("gpu", True)] < 0.8
    eager = fit.efficiency("gpu", compiled=False)
    assert 0.5 < eager.relative["dense+dot"] < 1.0   # the flagship is measured slower per FLOP than dot
    assert "dense" in eager.relative and "random" not in eager.relative   # random: never measured on a GPU


# ---- --plan, cluster files, the run's line ---------------------------------------------------------------------------
def test_plan_ranks_layouts_and_says_what_is_unchecked(capsys):
    assert config_main([os.path.join(ROOT, "configs", "synth-1.3b.yaml"), "--world-size", "8", "--plan"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if "ZeRO-" in line and " s " in line]
    steps = [float(line.split(" s ")[0].split()[-1]) for line in rows if "← the config's" not in line][:15]
    assert len(steps) == 15 and steps == sorted(steps)
    assert "← recommended" in out and "parallel.tp=" in out.split("its overrides:")[1]
    assert "have not been checked on a multi-GPU run of this engine" in out


def test_cluster_files_and_their_errors(tmp_path):
    good = tmp_path / "pods.yaml"
    good.write_text("preset: h100\nname: pods\ninter_node: {gbps: 25}\ngpus_per_node: 4\n")
    c = load_cluster(str(good))
    assert (c.name, c.inter_node.gbps, c.inter_node.latency_us, c.gpus_per_node, c.gpu.bf16_tflops) == \
        ("pods", 25, 14, 4, 989.4)
    for text, needle in (("preset: h100\ninter_node: {bandwith: 25}\n", "inter_node.bandwith"),
                         ("preset: b200\n", "preset='b200'"), ("preset: a100\ngpu: {sms: -1}\n", "gpu.sms=-1")):
        good.write_text(text)
        with pytest.raises(ConfigError, match=re.escape(needle)):
            load_cluster(str(good))
    with pytest.raises(ConfigError, match="neither a preset"):
        load_cluster("h300")


def test_the_runs_line_then_measured_over_predicted():
    cfg = load_config(DEMO)
    check_ = StepCheck.for_run(cfg, 2, "cpu")
    line = check_.line
    assert "predicted step" in line and "not checked on a multi-GPU run" in line
    predicted_s = expected(cfg, 2, PRESETS["cpu"]).step_s
    first, none = check_.values(10.0)   # the first logged window holds the start: no ratio yet
    assert first == {"perf/predicted_step_s": predicted_s} and none is None
    values, said = check_.values(2 * predicted_s)
    assert values["perf/measured_over_predicted"] == pytest.approx(2.0) and "2.00" in said
    assert check_.values(predicted_s)[1] is None   # said once
    unknown = StepCheck.for_run(cfg, 2, "NVIDIA B200")   # no preset: no prediction, and the line says why
    assert unknown.prediction is None and "no cluster preset" in unknown.line and unknown.values(1.0) == ({}, None)
    # in the trainer: perf/step_s (the observability split) is the measured step where it was logged
    values = {"perf/step_s": 3 * predicted_s}
    assert check_.observe(values, 1e9) is None and values["perf/measured_over_predicted"] == pytest.approx(3.0)



def test_the_bench_measures_the_cpu_layouts_less_their_waits_for_a_cpu():
    """benchmarks/bench.py --only layouts (planned here, measured once): every layout of the demo model at 2 ranks,
    each step less its ranks' waits for a CPU, ÷ the demo's own layout's."""
    from benchmarks.bench import parse_args
    from benchmarks.bench_points import LAYOUTS, plan

    p = plan(parse_args(["--only", "layouts"]))
    assert len(LAYOUTS) >= 4 and len(p.points) == len(LAYOUTS)
    assert all(s["world"] == 2 and s["config"] == "configs/demo-cpu.yaml" for s in p.points.values())
    first = p.entries[0]
    assert first["ratio_to"] is None and first["field"] == "uncontended_step_s"
    assert all(e["ratio_to"] == first["id"] for e in p.entries[1:])
