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

On a CPU the host does not run ahead of the device: each op is dispatched and run by the same thread, so a step is
T = C/e + R + k·h + H, h the host's time a micro-batch on a stage (k: how many the schedule puts on the critical
path), H its time a step (the engine's and the optimizer's bookkeeping). e, h and H are fitted together by least
squares on the CPU points marked `fit: true`; the points marked `fit: false` are held out of every fit (the tests
check the predicted order of all of them against the measured one).

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
from pretrain.config.deepspeed_dict import deepspeed_config
from pretrain.plan.memory import layout_of
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
    fit: bool = True             # False: held out of the fit (the CPU layouts whose order the tests check)

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
                             p.get("what", ""), bool(p.get("fit", True))))
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
    host: dict = field(default_factory=dict)        # (family, compiled) → (seconds a micro-batch, a step)
    points: int = 0

    def efficiency(self, family: str, compiled: bool) -> Efficiency:
        key = (family, compiled) if (family, compiled) in self.compute else (family, not compiled)
        if key not in self.compute:
            raise ConfigError(f"pretrain/plan/calibration.yaml has no {family} point: no efficiency to predict with")
        e = self.compute[key]
        rel = {**self.relative.get((family, not compiled), {}), **self.relative.get((family, compiled), {})}
        mode = "compiled blocks" if compiled else "eager"
        host = self.host.get(key, (0.0, 0.0))
        extra = f"; host {1e3 * host[0]:.1f} ms a micro-batch, {1e3 * host[1]:.0f} ms a step" if any(host) else ""
        return Efficiency(e, rel, f"e = {e:.3f} ({family}, {mode}; {self.points} points{extra})", *host)


def linear_terms(point: Point) -> tuple[float, float, float]:
    """(A, B, k) of the point's predicted step T = A/e + B + k·h + H, h the host's time a micro-batch on a stage,
    H a step's (the model is linear in 1/e, h and H while its GEMMs stay compute-bound and its slowest stage
    the same): read off three predictions."""
    T0, T1 = predicted(point, Efficiency(1.0)), predicted(point, Efficiency(0.5))
    return T1 - T0, 2 * T0 - T1, predicted(point, Efficiency(1.0, host_micro_batch=1.0)) - T0


def fit_host(points: list[Point]) -> tuple[float, float, float]:
    """(e, h, H) by least squares over `points` (a CPU's: the host does not hide behind the device there)."""
    import numpy as np

    rows = [linear_terms(p) for p in points]
    A = np.array([[a, k, 1.0] for a, _, k in rows])
    y = np.array([p.step_s - b for p, (_, b, _) in zip(points, rows)])
    x, h, H = np.linalg.lstsq(A, y, rcond=None)[0]
    if x <= 0 or h < 0 or H < 0:
        raise ConfigError(f"pretrain/plan/calibration.yaml: the CPU points fit no positive efficiency and host times "
                          f"(1/e {x:.3g}, {h:.3g} s a micro-batch, {H:.3g} s a step); measure them again")
    return 1 / x, float(h), float(H)


def fit(points: list[Point]) -> Fit:
    points = [p for p in points if p.fit]
    out = Fit(points=len(points))
    for key in {(p.family, p.compiled) for p in points if p.family == "cpu"}:   # e and the host's time together
        mine = [p for p in points if (p.family, p.compiled) == key]
        e, h, H = fit_host(mine)
        out.compute[key], out.host[key] = e, (h, H)
        out.relative[key] = {_mixer(p): 1.0 for p in mine}   # the CPU's e is its measured model's own
    points = [p for p in points if p.family != "cpu"]
    own = [(p, own_efficiency(p), _mixer(p)) for p in points]
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


@lru_cache(maxsize=4)
def calibrated(family: str | None = None) -> Fit:
    """The fit of pretrain/plan/calibration.yaml (once per process), of one device family's points where given (the
    families share no parameter: a GPU plan need not fit the CPU's)."""
    return fit([p for p in load() if family is None or p.family == family])


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
    for (fam, comp), e in sorted(f.compute.items()):
        line = f"  {fam} {'compiled blocks' if comp else 'eager'}: e = {e:.3f}" + "".join(
            f", {m} r = {r:.2f}" for m, r in sorted(f.relative.get((fam, comp), {}).items()))
        h, H = f.host.get((fam, comp), (0.0, 0.0))
        lines.append(line + (f", host {1e3 * h:.1f} ms a micro-batch and {1e3 * H:.0f} ms a step" if h or H else ""))
    cpu = [p for p in points if p.family == "cpu"]
    if cpu:
        eff = f.efficiency("cpu", compiled=False)
        lines.append("the CPU points, fastest measured first (fit: false, held out of the fit):")
        lines += [f"  {p.what:<26} {p.step_s * 1e3:6.1f} ms measured, {predicted(p, eff) * 1e3:6.1f} ms predicted"
                  f"{'' if p.fit else ', held out'}" for p in sorted(cpu, key=lambda p: p.step_s)]
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
