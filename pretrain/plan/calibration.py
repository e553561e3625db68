"""The calibrated part of the time model: the compute efficiency e of each mode, and each variant's efficiency
relative to dot, fitted on step times this repository's engine measured (pretrain/plan/calibration.yaml, the one file
each new GPU record updates).

For a point (a config on one GPU, or the CPU bench's ranks) the time model predicts T(e) = C/e + R: C the work priced
at e = 1 (GEMMs, the mixers' FLOPs; their time scales as 1/e while they are compute-bound), R what e does not change
(memory-bound kernels, communication, the optimizer). The point's own e solves T(e) = measured (a few secant steps
in 1/e); a mode's e is the median over its dot points, family by family (GPUs share e, their presets carry the
peak and the bandwidth; the CPU has its own). A variant's r_v is the median over its points of their own e (solved
with r = 1) ÷ their mode's e. A mode without dot points borrows the other mode's e; a variant without points in a
mode borrows the other mode's r_v; a variant with none is priced as dot, and the plan says so.

Held out (`held_out`): fitted without one record, the record's points predicted, for each record in turn; and fitted
on the H100 records alone, the H200 points predicted (same peak, 1.43× the memory bandwidth).
"""
from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, field
from functools import lru_cache

import yaml

from model.config import ConfigError
from pretrain.config import TrainConfig
from pretrain.config import files
from pretrain.engine import deepspeed_config
from pretrain.memory_plan import layout_of
from pretrain.plan.cluster import PRESETS
from pretrain.plan.step import Efficiency, predict
from pretrain.plan.workload import engine_of

CALIBRATION = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calibration.yaml")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass(frozen=True)
class Point:
    record: str
    device: str                  # a cluster preset: h100, h200, cpu
    config: str
    overrides: tuple[str, ...]
    compiled: bool
    step_s: float
    world: int = 1
    what: str = ""

    @property
    def family(self) -> str:
        return PRESETS[self.device].family


def load(path: str = CALIBRATION) -> list[Point]:
    with open(path) as f:
        tree = yaml.safe_load(f)
    out = []
    for i, p in enumerate(tree.get("points") or []):
        try:
            out.append(Point(p["record"], p["device"], p["config"], tuple(p.get("overrides") or ()),
                             bool(p.get("compiled", False)), float(p["step_s"]), int(p.get("world", 1)),
                             p.get("what", "")))
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"{path}: point {i + 1} lacks or mistypes {e}; each point needs record, device, "
                              f"config, step_s") from None
        if out[-1].device not in PRESETS:
            raise ConfigError(f"{path}: point {i + 1}: device={out[-1].device!r} is not a preset: {', '.join(PRESETS)}")
    return out


@lru_cache(maxsize=16)
def _base(config: str) -> dict:
    """The config file's tree, its `base:` chain merged (its keys are checked when the point's config is built)."""
    return files.read(os.path.join(ROOT, config), lambda tree, source: None)


@lru_cache(maxsize=256)
def _setting(point: Point):
    tree = _base(point.config)   # each file read once: the points differ by their overrides
    for item in point.overrides:
        section, name, value = files.override(item)
        tree = files.merge(tree, {section: {name: value}})
    cfg = TrainConfig.from_dict(tree, source=f"{CALIBRATION}: {point.what}")
    lay = layout_of(cfg, point.world)
    return cfg, lay, engine_of(cfg, deepspeed_config(cfg, lay.dp))


def predicted(point: Point, eff: Efficiency) -> float:
    """The time model's step for the point's config, layout and device at efficiency `eff`."""
    cfg, lay, engine = _setting(point)
    cluster = PRESETS[point.device]
    return predict(cfg, lay, cluster, eff, engine, gpu=cluster.device == "cuda").step_s


def own_efficiency(point: Point) -> float:
    """The e at which the model predicts the point's measured step (r = 1 for its variant)."""
    inv = [1.0, 2.0]   # 1/e: secant steps on T(1/e), nearly linear
    T = [predicted(point, Efficiency(1 / x)) for x in inv]
    for _ in range(3):
        slope = (T[1] - T[0]) / (inv[1] - inv[0])
        x = inv[1] + (point.step_s - T[1]) / slope
        if x <= 0:
            raise ConfigError(f"{point.record}: {point.step_s} s is faster than the model allows at any efficiency")
        inv, T = [inv[1], x], [T[1], predicted(point, Efficiency(1 / x))]
        if abs(T[1] - point.step_s) < 1e-4 * point.step_s:
            break
    return 1 / inv[1]


def _mixer(point: Point) -> str:
    m = _setting(point)[0].model.mixer
    return m if isinstance(m, str) else "+".join(dict.fromkeys(m))


@dataclass
class Fit:
    compute: dict = field(default_factory=dict)     # (family, compiled) → e
    relative: dict = field(default_factory=dict)    # (family, compiled) → {mixer: r_v}
    points: int = 0

    def efficiency(self, family: str, compiled: bool) -> Efficiency:
        e = self.compute.get((family, compiled)) or self.compute.get((family, not compiled))
        if e is None:
            raise ConfigError(f"pretrain/plan/calibration.yaml has no {family} point: no efficiency to predict with")
        rel = {**self.relative.get((family, not compiled), {}), **self.relative.get((family, compiled), {})}
        mode = "compiled blocks" if compiled else "eager"
        return Efficiency(e, rel, f"e = {e:.3f} ({family}, {mode}; {self.points} points)")


def fit(points: list[Point]) -> Fit:
    own = [(p, own_efficiency(p), _mixer(p)) for p in points]
    out = Fit(points=len(points))
    for key in {(p.family, p.compiled) for p in points}:
        dots = [e for p, e, m in own if (p.family, p.compiled) == key and m == "dot"]
        if dots:
            out.compute[key] = statistics.median(dots)
    for key in {(p.family, p.compiled) for p in points}:
        e = out.compute.get(key) or out.compute.get((key[0], not key[1]))
        if e is None:
            continue
        by_mixer: dict[str, list[float]] = {}
        for p, e_p, m in own:
            if (p.family, p.compiled) == key and m != "dot":
                by_mixer.setdefault(m, []).append(e_p / e)
        out.relative[key] = {m: statistics.median(r) for m, r in by_mixer.items()}
    return out


_FIT: Fit | None = None


def calibrated() -> Fit:
    """The fit of pretrain/plan/calibration.yaml (computed once per process)."""
    global _FIT
    if _FIT is None:
        _FIT = fit(load())
    return _FIT


def held_out(points: list[Point]) -> tuple[list[tuple[Point, float]], list[tuple[Point, float]]]:
    """([(point, predicted ÷ measured − 1)] for each record left out of the fit in turn, the same fitted on the H100
    records alone and checked on the H200 points)."""
    records = dict.fromkeys(p.record for p in points)
    by_record = []
    for record in records:
        f = fit([p for p in points if p.record != record])
        by_record += [(p, predicted(p, f.efficiency(p.family, p.compiled)) / p.step_s - 1) for p in points
                      if p.record == record and any(fam == p.family for fam, _ in f.compute)]
    f = fit([p for p in points if p.device == "h100"])
    across = [(p, predicted(p, f.efficiency(p.family, p.compiled)) / p.step_s - 1) for p in points
              if p.device == "h200"]
    return by_record, across


def report(points: list[Point] | None = None) -> str:
    """`python -m pretrain.plan calibration`: the fit, each point against it, and the held-out errors."""
    points = points or load()
    f = fit(points)
    lines = ["compute efficiency e (a fraction of the preset's peak, after the memory-bound terms):"]
    lines += [f"  {fam} {'compiled blocks' if comp else 'eager'}: e = {e:.3f}" + "".join(
        f", {m} r = {r:.2f}" for m, r in sorted(f.relative.get((fam, comp), {}).items()))
        for (fam, comp), e in sorted(f.compute.items())]
    by_record, across = held_out(points)
    for title, rows in (("held out, one record at a time (fitted on the others):", by_record),
                        ("held out, fitted on the H100 records, checked on the H200 points:", across)):
        lines.append(title)
        lines += [f"  {p.record:<26} {p.device:<5} {'compiled' if p.compiled else 'eager':<9} {_mixer(p):<10} "
                  f"{p.step_s * 1e3:7.1f} ms measured, {100 * err:+6.1f}%   {p.what}" for p, err in rows]
        if rows:
            errs = [abs(e) for _, e in rows]
            lines.append(f"  mean |error| {100 * statistics.mean(errs):.1f}%, largest {100 * max(errs):.1f}% "
                         f"({len(rows)} points)")
    return "\n".join(lines)
