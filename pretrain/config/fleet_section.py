"""The `fleet` section: every rank's timings, the straggler detector, the check before launch and the exclusion of a
slow node (pretrain/fleet/; docs/operations.md "Slow jobs"). Beside sections.py, which is at its length."""
from __future__ import annotations

from dataclasses import dataclass

from model.fields import check_types, described, need

TARGET_WINDOW_S = 20.0   # fleet.every's default: a window of about this much predicted step time


@dataclass(kw_only=True)
class FleetSection:
    """fleet: per-rank phase times gathered to rank 0, and what is done with a slow rank."""
    every: int | None = described(f"optimizer steps per window: every rank's phase times (data wait, compute, "
                                   f"backward, optimizer, collectives) are gathered to rank 0 at each window's last "
                                   f"step (one small all-reduce); null = about {TARGET_WINDOW_S:g} s of the time "
                                   f"plan's predicted step (100 steps without a prediction); 0 = off", None)
    slow_factor: float = described("a rank is late in a window when its compute (or data wait) is ≥ this × the "
                                   "median of its peers'", 1.15)
    windows: int = described("a rank late this many windows in a row is named (log line, TensorBoard "
                             "fleet/*, <run_dir>/fleet/windows.jsonl)", 3)
    exclude: bool = described("when a node stays named for fleet.exclude_after_s, the supervisor checkpoints, "
                              "writes it to <run_dir>/fleet/excluded_nodes and relaunches without it at the smaller "
                              "data-parallel size (docs/operations.md); later relaunches keep it out until a person "
                              "removes its line. Needs launch/pretrain.sh's supervisor (not a scheduler's own "
                              "ranks); the first node (the rendezvous's) never leaves", False)
    exclude_after_s: float = described("seconds a node must stay named before fleet.exclude moves the job off it", 300.0)
    preflight: bool = described("run the check before launch (python -m pretrain.fleet: a fixed GEMM on every rank, "
                                "a collective over every node pair) before the first step; a rank or link named "
                                "stops the launch", False)
    gpu_floor: float = described("the check before launch names a rank whose GEMM rate is below this × the median", 0.9)
    link_floor: float = described("the check before launch names a link whose bandwidth is below this × the median", 0.8)

    def __post_init__(self):
        check_types(self, "fleet")
        need(self.every is None or self.every >= 0, "fleet.every", self.every, "null (about 20 s), 0 (off) or ≥ 1")
        need(self.slow_factor > 1, "fleet.slow_factor", self.slow_factor, "> 1, e.g. 1.15")
        need(self.windows >= 1, "fleet.windows", self.windows, "≥ 1")
        need(self.exclude_after_s >= 0, "fleet.exclude_after_s", self.exclude_after_s, "≥ 0 seconds")
        for name in ("gpu_floor", "link_floor"):
            need(0 < getattr(self, name) < 1, f"fleet.{name}", getattr(self, name), "between 0 and 1, e.g. 0.9")

    def window_steps(self, predicted_step_s: float | None) -> int:
        """fleet.every, or its default for a predicted step time (None: no prediction)."""
        if self.every is not None:
            return self.every
        return 100 if not predicted_step_s else max(1, round(TARGET_WINDOW_S / predicted_step_s))
