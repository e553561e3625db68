"""`--plan`: every layout of N GPUs that the launch accepts and the memory plan fits, ranked by predicted step time.

    python -m pretrain.config CONFIG --world-size N --plan [--cluster h100|h200|a100|cpu|FILE]

The search: each (tp, cp, pp, dp, ZeRO) layout the trainer accepts (pretrain/plan/memory.py `layouts`, then the launch's
own checks), each micro-batch that divides the global batch over dp (the accumulation follows; the global batch never
changes), activation checkpointing off and on every layer. Each candidate gets the memory plan's peak and its
verdict against the GPU's memory (`memory_verdict`), and the time model's prediction (pretrain/plan/step.py) with
the calibrated efficiency (pretrain/plan/calibration.py). Where a layout needs more canonical streams than the
default (data.canonical_streams: dp must divide them) and the config leaves them unset, the candidate sets them to dp:
a fresh run's choice, since they fix the sample order.
"""
from __future__ import annotations

from dataclasses import dataclass

from model.config import ConfigError
from pretrain.config import TrainConfig
from pretrain.config.batch_ramp import splits
from pretrain.config.deepspeed_dict import deepspeed_config
from pretrain.plan.memory import GIB, Layout, layout_of, layouts, plan as memory_plan
from pretrain.plan.calibration import calibrated
from pretrain.plan.cluster import Cluster
from pretrain.plan.step import Prediction, predict
from pretrain.plan.workload import engine_of
from tokendata.order import default_streams

UNCHECKED = ("The communication terms (TP all-reduces, CP gathers, pipeline sends, data-parallel and ZeRO collectives) "
             "have not been checked on a multi-GPU run of this engine: they are the model's (docs/DESIGN.md, the time "
             "model), "
             "its layout orders checked against Narayanan et al. 2021's measurements only.")
TIE = 0.02   # steps this close are one to the model: the recommendation takes the simplest of them
TERM_NAMES = {"compute": "compute", "memory": "memory-bound", "tp": "TP comm", "cp": "CP comm", "pp": "PP sends",
              "bubble": "bubble",
              "dp": "DP comm", "optimizer": "optimizer", "host": "host overhead"}


@dataclass(frozen=True)
class MemoryVerdict:
    fits: bool
    spare_bytes: int      # GPU memory − the plan's peak (negative: short by that much)
    text: str


def memory_verdict(peak_bytes: int, gpu_bytes: int, layout: Layout) -> MemoryVerdict:
    """Whether a layout's peak fits one GPU, by the memory plan's own test (peak ≤ the GPU's memory). At the merge
    this becomes issue 42's `verdict(peak_bytes, gpu_bytes, layout)` (CUDA context, NCCL buffers, the allocator's
    headroom), and its text and headroom show here unchanged."""
    spare = gpu_bytes - peak_bytes
    text = f"fits, {spare / GIB:.1f} GiB spare" if spare >= 0 else f"short by {-spare / GIB:.1f} GiB"
    return MemoryVerdict(spare >= 0, spare, text)


@dataclass
class Candidate:
    overrides: list[str]
    prediction: Prediction
    verdict: MemoryVerdict

    @property
    def layout(self) -> Layout:
        return self.prediction.layout


def with_overrides(cfg: TrainConfig, overrides: list[str]) -> TrainConfig:
    tree = cfg.to_dict()
    for item in overrides:
        key, value = item.split("=")
        section, name = key.split(".")
        tree[section][name] = None if value == "null" else int(value)
    return TrainConfig.from_dict(tree)


def candidates(cfg: TrainConfig, world: int, cluster: Cluster) -> tuple[list[Candidate], int]:
    """(every candidate that fits, ranked fastest first; how many were priced in all). Per layout and checkpointing
    the micro-batches rise until one does not fit: a larger one holds more."""
    eff = calibrated(cluster.family).efficiency(cluster.family, cfg.train.compile)
    gpu_bytes, device = int(cluster.gpu.memory_gib * GIB), cluster.device
    G, fitting, priced, ramp = cfg.train.global_batch_size, [], 0, cfg.batch_ramp()   # planned at the full batch G
    for lay in layouts(with_overrides(cfg, ["train.micro_batch_size=1"]), world):   # any micro-batch that divides
        streams = []
        if cfg.data.canonical_streams is None and default_streams(G) % lay.dp and G % lay.dp == 0:
            streams = [f"data.canonical_streams={lay.dp}"]
        micros = [b for b in range(1, G // lay.dp + 1) if G % (b * lay.dp) == 0 and splits(ramp, b * lay.dp)]
        if not micros:   # train.batch_ramp: a size along the ramp that no micro-batch splits over these ranks
            continue
        for ckpt in dict.fromkeys([cfg.parallel.activation_checkpointing, 0, 1]):
            base = [f"parallel.tp={lay.tp}", f"parallel.cp={lay.cp}", f"parallel.pp={lay.pp}",
                    f"parallel.zero_stage={lay.zero}",
                    f"parallel.activation_checkpointing={ckpt}"] + streams
            try:   # the launch's own checks; the micro-batch only changes the accumulation, which divides
                alt = with_overrides(cfg, base + [f"train.micro_batch_size={micros[0]}"])
                alt.check_runtime(world, cuda=device == "cuda")
            except ConfigError:
                continue
            ds = deepspeed_config(alt, lay.dp)
            engine = engine_of(alt, ds)
            for micro in micros:
                verdict = memory_verdict(memory_plan(alt, lay, micro, device, ds).peak, gpu_bytes, lay)
                priced += 1
                if not verdict.fits:
                    break
                fitting.append(Candidate(base + [f"train.micro_batch_size={micro}"],
                                         predict(alt, lay, cluster, eff, engine, micro, gpu=device == "cuda"), verdict))
    return sorted(fitting, key=lambda c: c.prediction.step_s), priced


def recommended(ranked: list[Candidate]) -> Candidate:
    """Of the candidates within TIE of the fastest, the simplest: the fewest model-parallel ranks, the lowest ZeRO
    stage (fewer collectives, and less of what the model leaves out), no recomputation, then the fastest."""
    close = [c for c in ranked if c.prediction.step_s <= (1 + TIE) * ranked[0].prediction.step_s]
    return min(close, key=lambda c: (c.layout.tp * c.layout.cp * c.layout.pp, c.layout.zero,
                                     c.prediction.checkpointing, c.prediction.step_s))


def largest_terms(p: Prediction, k: int = 3) -> str:
    return ", ".join(f"{TERM_NAMES[name]} {100 * share:.0f}%" for name, share in p.dominant(k) if share >= 0.005)


def row(i: int | str, c: Candidate, mark: str = "") -> str:
    p, lay = c.prediction, c.layout
    ckpt = "on" if p.checkpointing else "off"
    return (f"{i!s:>4}  {lay.tp:>2} {lay.cp:>2} {lay.pp:>2} {lay.dp:>4}  ZeRO-{lay.zero}  {p.micro:>5} "
            f"{p.micro_batches:>5}  {ckpt:>4}  {p.step_s:8.3f} s {p.tokens_per_s_per_gpu:>9,.0f} {100 * p.mfu:5.1f}%  "
            f"{c.verdict.text:<22} {largest_terms(p)}{mark}")


def report(cfg: TrainConfig, world: int, cluster: Cluster, top: int = 15) -> str:
    """The ranked table `--plan` prints."""
    ranked, priced = candidates(cfg, world, cluster)
    eff = calibrated(cluster.family).efficiency(cluster.family, cfg.train.compile)
    mixer = cfg.model.mixer if isinstance(cfg.model.mixer, str) else "per-layer mixers"
    lines = [f"layouts of {world} GPUs for {mixer} (d {cfg.model.d_model}, {cfg.model.n_layers} layers, n "
             f"{cfg.model.max_seq_len}), global batch {cfg.train.global_batch_size}, {cfg.train.precision}"
             f"{', compiled blocks' if cfg.train.compile else ''}",
             f"on {cluster.describe()}",
             f"compute: {eff.source}, pretrain/plan/calibration.yaml",
             f"{len(ranked)} of {priced} candidates fit; the fastest {min(top, len(ranked))}, by predicted step:",
             "rank  tp cp pp   dp  ZeRO   micro accum  ckpt      step   tok/s/GPU   MFU  memory                 "
             "largest terms"]
    if not ranked:
        lines.append("  none fits: raise the world size, or lower train.global_batch_size per GPU")
        return "\n".join(lines + [UNCHECKED])
    configured = (layout_of(cfg, world), cfg.train.micro_batch_size, cfg.parallel.activation_checkpointing)
    mine = next((c for c in ranked if (c.layout, c.prediction.micro, c.prediction.checkpointing) == configured), None)
    best = recommended(ranked)
    shown = ranked[:top] + [c for c in (best, mine) if c is not None and c not in ranked[:top]]
    for c in shown:
        mark = ("   ← recommended" if c is best else "") + ("   ← the config's" if c is mine else "")
        lines.append(row(ranked.index(c) + 1, c, mark))
    if mine is None:
        lines.append(f"  the config's layout ({configured[0]}, micro-batch {configured[1]}) is not among them: it "
                     f"does not fit, or the launch refuses it")
    elif mine is not best:
        lines.append(f"the recommended layout is {mine.prediction.step_s / best.prediction.step_s:.2f}× as fast as "
                     f"the config's")
    lines.append(f"recommended: the simplest layout within {100 * TIE:.0f}% of the fastest (the model cannot order "
                 f"closer steps); its overrides:")
    lines.append("  " + " ".join(best.overrides))
    lines += [f"note: {n}" for n in best.prediction.notes]
    lines.append(UNCHECKED)
    return "\n".join(lines)
