"""Every rank's phase times, gathered to rank 0 once a window, judged by the detector, logged and recorded.

At the last step of each window (`fleet.every` steps) every rank puts its own row, the mean seconds per step of each
phase (pretrain/observe/step_times.py `window()`, and the time inside the trainer's collectives from
pretrain/distributed.py) into a zero tensor of shape [world, phases] on its device; one all-reduce (sum) gives
rank 0 the whole table, which it reads after the step's own read (the step's work is done by then: the read waits only
for this small collective). The other ranks do not read it. Cost: one collective of world × 5 floats per window, and rank 0's wait for it (the record's gather_s).

Rank 0 then logs fleet/slowest_rank and fleet/slowest_rank_ratio (TensorBoard, metrics.jsonl), a line for each rank
named, and appends the window to <run_dir>/fleet/windows.jsonl: each rank's host, GPU index and phases, and who was
named. The first window of each launch is recorded, not judged: it holds the warm-up.
"""
from __future__ import annotations

import json
import os
import time

import torch

from pretrain import distributed
from pretrain.config import TrainConfig
from pretrain.distributed import Layout
from pretrain.fleet import preflight
from pretrain.fleet.detector import PHASES, Detector, places, slowest


class FleetError(RuntimeError):
    """The check before launch (fleet.preflight) named a rank or a link: the launch stops before its first step."""


class FleetWatch:
    def __init__(self, cfg: TrainConfig, lay: Layout, predicted_step_s: float | None):
        if cfg.fleet.preflight:   # before the first step; every rank gets the same verdict
            line, slow = preflight.check(lay, cfg.fleet.gpu_floor, cfg.fleet.link_floor)
            if slow:
                raise FleetError(f"{line}; replace them, or set fleet.preflight=false to train on them")
            if lay.is_main:
                print(line, flush=True)
        self.lay, self.every = lay, cfg.fleet.window_steps(predicted_step_s)
        self.where = places(lay.peers)
        self.detector = Detector(cfg.fleet.slow_factor, cfg.fleet.windows, self.where)
        self.path = os.path.join(cfg.train.run_dir, "fleet", "windows.jsonl")
        self.named: list = []   # every Straggler named in this run (rank 0)
        self.warm = False       # the first window of a launch holds its warm-up (allocations, first-touch): recorded,
                                # not judged

    def after(self, step: int, times, log, read) -> None:
        """At a window's last step: gather, judge, log (`times`: the trainer's StepTimes; `log`: its Logger; `read`:
        its counted device-to-host read)."""
        if not self.every or step % self.every:
            return
        began = time.perf_counter()
        steps, row = times.window()
        row["collective"] = distributed.COLLECTIVES.take() / max(steps, 1)
        t = torch.zeros(self.lay.world, len(PHASES))   # on CUDA a rank's row may miss its newest step: means per step
        t[self.lay.rank] = torch.tensor([row.get(p, 0.0) for p in PHASES])
        table = distributed.all_reduce(t.to(self.lay.device, non_blocking=True), self.lay)
        if not self.lay.is_main:
            return
        rows = [dict(zip(PHASES, values)) for values in read(table)]
        self.judge(step, rows, log, time.perf_counter() - began)

    def judge(self, step: int, rows: list[dict], log, gather_s: float = 0.0) -> None:
        named = self.detector.observe(step, rows) if self.warm else []
        self.warm = True
        self.named += named
        rank, ratio = slowest(rows)
        log.scalars(step, {"fleet/slowest_rank": rank, "fleet/slowest_rank_ratio": ratio})
        for s in named:
            log.info(s.line())
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, "steps": self.every, "slowest_rank": rank,
                                "slowest_rank_ratio": round(ratio, 4), "named": [s.record() for s in named],
                                "gather_s": round(gather_s, 6),
                                "ranks": [{"rank": r, "host": p.host, "gpu": p.gpu,
                                           **{k: round(v, 6) for k, v in row.items()}}
                                          for r, (p, row) in enumerate(zip(self.where, rows))]}) + "\n")
