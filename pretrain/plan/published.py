"""The time model against measurements no one here made: the layout figures of Narayanan et al. 2021 (Megatron-LM,
arXiv 2104.04473), rows pinned from the paper's text in tests/data/megatron_2021_layouts.yaml.

    python -m pretrain.plan published tests/data/megatron_2021_layouts.yaml

Each row is predicted with the a100 preset, the calibrated GPU compute efficiency (eager), and the paper's engine
where it differs from this repository's (`MEGATRON_2021`); its throughput is the paper's own FLOP count, eq. (3),
F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) a step (recomputation included) ÷ the step ÷ the GPUs. Nothing is fitted
to a row: one efficiency for all of them, from this repository's own GPU records.

Where the paper's engine differs, and how the model takes it:
    attention       no flash attention in 2021: the n² scores are written and read (12 bytes an element: scores,
                    softmax, dropout mask and output, their gradients), `score_bytes`
    pipeline        L/p blocks a stage (`even_stages`); a stage's output crosses nodes split over its TP ranks and
                    re-gathered over NVLink (the scatter/gather optimization, §4.1)
    data parallel   Megatron's local DDP: one all-reduce after the last backward, not overlapped; fp16 gradients
                    accumulated into fp16 buffers (3 × 2 bytes a parameter a micro-batch)
    fused kernels   bias+GeLU, bias+dropout+add and the softmax are fused there: fewer memory passes than this
                    engine's eager kernels; not modeled apart (one efficiency, this engine's), so the predicted
                    TFLOP/s sit below the published ones while the orders are what is checked
    schedule        the figures use the default non-interleaved 1F1B schedule, which is the one modeled
"""
from __future__ import annotations

from dataclasses import dataclass

import yaml

from model.config import ConfigError
from pretrain.config import TrainConfig
from pretrain.plan.memory import Layout
from pretrain.plan.calibration import calibrated
from pretrain.plan.cluster import PRESETS
from pretrain.plan.step import Efficiency, predict
from pretrain.plan.workload import Engine

MEGATRON_2021 = Engine("Megatron-LM as in Narayanan et al. 2021", dp_overlap=False, reduce_every_micro_batch=False,
                       p2p_scatter_gather=True, score_bytes=12, accumulate_bytes=6, even_stages=True)


@dataclass
class Row:
    tp: int
    pp: int
    dp: int
    micro: int
    published: float      # TFLOP/s per GPU, read off the figure
    predicted: float      # TFLOP/s per GPU by the paper's FLOP count
    terms: dict           # the prediction's terms, shares of the step


@dataclass
class Series:
    figure: int
    what: str
    batch: int
    rows: list[Row]
    tie: float

    def pairs(self) -> list[tuple[Row, Row]]:
        """(faster, slower) for every pair the figure separates by more than the tie fraction."""
        return [(a, b) for a in self.rows for b in self.rows
                if a.published > b.published and a.published - b.published > self.tie * a.published]

    def disagreements(self) -> list[tuple[Row, Row]]:
        return [(a, b) for a, b in self.pairs() if not a.predicted > b.predicted]


def paper_flops(B: int, s: int, layers: int, h: int, V: int) -> float:
    """Eq. (3): FLOPs of one iteration, activation recomputation included."""
    return 96 * B * s * layers * h * h * (1 + s / (6 * h) + V / (16 * layers * h))


def row_config(model: dict, seq: int, vocab: int, batch: int, tp: int, pp: int, micro: int) -> TrainConfig:
    return TrainConfig.from_dict({
        "model": {"vocab_size": vocab, "d_model": model["hidden"], "n_layers": model["layers"],
                  "n_heads": model["heads"], "max_seq_len": seq, "mixer": "dot"},
        "data": {"shard_dir": "unused"},
        "parallel": {"tp": tp, "pp": pp, "zero_stage": 0, "activation_checkpointing": 1},
        "train": {"global_batch_size": batch, "micro_batch_size": micro, "max_steps": 1, "warmup_steps": 0,
                  "run_dir": "unused", "precision": "bf16"}})


def check(path: str, eff: Efficiency | None = None) -> list[Series]:
    """Every series of the figures in `path`, each row predicted."""
    with open(path) as f:
        spec = yaml.safe_load(f)
    eff = eff or calibrated("gpu").efficiency("gpu", compiled=False)
    a100, s, V, gpus = PRESETS["a100"], spec["seq_len"], spec["vocab"], spec["gpus"]
    out = []
    for fig in spec["figures"]:
        m = fig["model"]
        for series in fig["series"]:
            rows = []
            for tp, pp, dp, micro, published in series["rows"]:
                if tp * pp * dp != gpus:
                    raise ConfigError(f"{path}: figure {fig['figure']}: {tp}·{pp}·{dp} ≠ {gpus} GPUs")
                cfg = row_config(m, s, V, series["batch"], tp, pp, micro)
                p = predict(cfg, Layout(tp, pp, dp, 0), a100, eff, MEGATRON_2021, micro)
                tflops = paper_flops(series["batch"], s, m["layers"], m["hidden"], V) / p.step_s / gpus / 1e12
                rows.append(Row(tp, pp, dp, micro, published, tflops,
                                {k: v / p.step_s for k, v in p.terms.items() if v}))
            out.append(Series(fig["figure"], fig["what"], series["batch"], rows, spec["tie"]))
    return out


def order(rows: list[Row], key: str, tie: float) -> str:
    """The rows by `key`, fastest first; '≈' joins neighbours within the tie fraction (published only)."""
    ranked = sorted(rows, key=lambda r: -getattr(r, key))
    text = _name(ranked[0])
    for prev, r in zip(ranked, ranked[1:]):
        close = key == "published" and getattr(prev, key) - getattr(r, key) <= tie * getattr(prev, key)
        text += (" ≈ " if close else " > ") + _name(r)
    return text


def _name(r: Row) -> str:
    return f"(t{r.tp},p{r.pp},d{r.dp}" + (f",b{r.micro})" if r.micro > 1 else ")")


def report(path: str) -> str:
    """`python -m pretrain.plan published FILE`: each figure's published and predicted orders."""
    lines = [f"a100 preset, {calibrated('gpu').efficiency('gpu', False).source}; the engine: {MEGATRON_2021.name}"]
    for series in check(path):
        bad = series.disagreements()
        lines.append(f"figure {series.figure}, batch {series.batch}: {series.what}")
        lines.append(f"  published  {order(series.rows, 'published', series.tie)}")
        lines.append(f"  predicted  {order(series.rows, 'predicted', series.tie)}")
        lines.append("  TFLOP/s    " + ", ".join(f"{_name(r)} {r.published:.0f} / {r.predicted:.0f}"
                                                 for r in series.rows) + "  (published / predicted)")
        lines.append(f"  {len(series.pairs()) - len(bad)} of {len(series.pairs())} separated pairs in the published "
                     f"order" + ("" if not bad else ": not " + ", ".join(f"{_name(a)} > {_name(b)}" for a, b in bad)))
    return "\n".join(lines)
