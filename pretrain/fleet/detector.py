"""The straggler detector: pure arithmetic on each rank's recorded phase times, one window at a time.

A window is `fleet.every` optimizer steps; for each rank it holds the mean seconds per step of its phases (PHASES).
Every rank waits for the slowest at each collective, so a rank is judged by the phases that are its own work:

    compute     its forward passes (device time on CUDA): a data-parallel forward holds no collective, so a peer's
                delay cannot show in it (its backward holds DeepSpeed's gradient reduction: every rank's backward
                absorbs the slowest rank's delay, and the column is kept for the reader, not judged)
    data_wait   its fetches: a slow source (storage, a busy CPU feeding the loader) makes its rank late

A rank is *late* in a phase in a window when

    phase[r] ≥ slow_factor × median(phase[peers])      (peers: every other rank)

and, for data wait, the excess phase[r] − median(peers) is also ≥ (slow_factor − 1) × median(peers' compute): a fetch
of 2 ms against 1 ms is twice as slow and costs nothing. A rank late in the same phase for `windows` windows in a row
is named, once, in one line with its host, its GPU index (local rank) and its phases; it is named again only after a
window in which it was not late. Data-wait stragglers and compute stragglers are told apart by the phase that is late.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

PHASES = ("data_wait", "compute", "backward", "optimizer", "collective")
JUDGED = ("compute", "data_wait")   # the phases a rank is named for (see the module's docstring)


@dataclass(frozen=True)
class Place:
    """Where a rank runs: its host and its GPU index there (its local rank)."""
    host: str
    gpu: int


def places(peers: tuple) -> list[Place]:
    """Each rank's Place from pretrain/distributed.py Layout.peers ((host, pid) per rank): a rank's GPU index is its
    position among its host's ranks, in rank order (the launchers' LOCAL_RANK)."""
    seen: dict[str, int] = {}
    out = []
    for host, _pid in peers:
        out.append(Place(host, seen.get(host, 0)))
        seen[host] = seen.get(host, 0) + 1
    return out


@dataclass
class Straggler:
    """A rank named: late in `phase` by `ratio` (its time ÷ its peers' median) for `windows` windows in a row."""
    rank: int
    place: Place
    phase: str
    ratio: float
    windows: int
    step: int
    phases: dict[str, float] = field(default_factory=dict)

    def line(self) -> str:
        what = "slow compute" if self.phase == "compute" else "slow data (waits for its loader)"
        times = ", ".join(f"{p} {1e3 * self.phases[p]:.1f} ms" for p in PHASES if p in self.phases)
        return (f"fleet: rank {self.rank} (host {self.place.host}, GPU {self.place.gpu}) {what}: its {self.phase} is "
                f"{self.ratio:.2f}× its peers' median for {self.windows} windows to step {self.step}; per step: {times}")

    def record(self) -> dict:
        return {"rank": self.rank, "host": self.place.host, "gpu": self.place.gpu, "phase": self.phase,
                "ratio": round(self.ratio, 4), "windows": self.windows, "step": self.step,
                "phases": {p: round(v, 6) for p, v in self.phases.items()}}


def peer_median(values: list[float], rank: int) -> float:
    return statistics.median(v for r, v in enumerate(values) if r != rank)


def ratios(table: list[dict[str, float]], phase: str) -> list[float]:
    """Each rank's `phase` ÷ the median of its peers' (inf where the peers' median is 0 and the rank's is not)."""
    values = [row[phase] for row in table]
    out = []
    for r, v in enumerate(values):
        m = peer_median(values, r)
        out.append(v / m if m > 0 else (float("inf") if v > 0 else 1.0))
    return out


class Detector:
    """Feed it windows (`observe`); it names the ranks late `windows` windows in a row (see the module docstring)."""

    def __init__(self, slow_factor: float, windows: int, where: list[Place]):
        self.slow_factor, self.windows, self.where = slow_factor, windows, where
        self.streak = {(r, p): 0 for r in range(len(where)) for p in JUDGED}
        self.named: set[tuple[int, str]] = set()   # (rank, phase) named and still late

    def late(self, table: list[dict[str, float]], phase: str) -> list[tuple[bool, float]]:
        """(late?, ratio) of each rank in `phase` in one window."""
        rs = ratios(table, phase)
        if phase != "data_wait":
            return [(x >= self.slow_factor, x) for x in rs]
        computes = [row["compute"] for row in table]
        waits = [row["data_wait"] for row in table]
        return [(x >= self.slow_factor and
                 waits[r] - peer_median(waits, r) >= (self.slow_factor - 1) * peer_median(computes, r), x)
                for r, x in enumerate(rs)]

    def observe(self, step: int, table: list[dict[str, float]]) -> list[Straggler]:
        """One window: `table[r]` is rank r's mean seconds per step of each phase. Returns the ranks named now."""
        if len(table) < 2:
            return []
        out = []
        for phase in JUDGED:
            for r, (is_late, ratio) in enumerate(self.late(table, phase)):
                key = (r, phase)
                self.streak[key] = self.streak[key] + 1 if is_late else 0
                if not is_late:
                    self.named.discard(key)
                elif self.streak[key] >= self.windows and key not in self.named:
                    self.named.add(key)
                    out.append(Straggler(r, self.where[r], phase, ratio, self.streak[key], step, dict(table[r])))
        return out


def slowest(table: list[dict[str, float]]) -> tuple[int, float]:
    """(the rank whose compute is the largest multiple of its peers' median, that multiple): fleet/slowest_rank and
    fleet/slowest_rank_ratio in TensorBoard."""
    rs = ratios(table, "compute") if len(table) > 1 else [1.0]
    rank = max(range(len(rs)), key=rs.__getitem__)
    return rank, rs[rank]
