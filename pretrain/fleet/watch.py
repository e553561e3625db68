"""Every rank's phase times, gathered to rank 0 once a window, judged by the detector, logged and recorded.

At the last step of each window (`fleet.every` steps) every rank puts its own row, the mean seconds per step of each
phase (pretrain/observe/step_times.py `window()`, and the time inside the trainer's collectives from
pretrain/distributed.py) into a zero tensor of shape [world, phases] on its device; one all-reduce (sum) gives
rank 0 the whole table, which it reads after the step's own read (the step's work is done by then: the read waits only
for this small collective). The other ranks do not read it. Cost: one collective of world × 5 floats per window, and rank 0's wait for it (the record's gather_s).

Rank 0 then logs fleet/slowest_rank and fleet/slowest_rank_ratio (TensorBoard, metrics.jsonl), a line for each rank
named, and appends the window to <run_dir>/fleet/windows.jsonl: each rank's host, GPU index and phases, and who was
named. The first window of each launch is recorded, not judged: it holds the warm-up.

With fleet.exclude, rank 0 also keeps since when each host has had a rank named for slow compute (and still late);
once one has been named for fleet.exclude_after_s, the move off it (exclusion.py `plan`) is asked of the supervisor
(`ask`) and `after` returns the stop reason: the trainer stops every rank after the next step, with a checkpoint, as
for a preemption signal. A move that cannot be made (the last node, the rendezvous's node, a global batch the new
data-parallel size does not divide) is logged once, and the job goes on.
"""
from __future__ import annotations

import json
import os
import time

import torch

from pretrain import distributed
from pretrain.config import TrainConfig
from pretrain.distributed import Layout
from pretrain.fleet import exclusion, preflight
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
        self.exclude, self.after_s = cfg.fleet.exclude and lay.is_main, cfg.fleet.exclude_after_s
        self.run_dir, self.batch = cfg.train.run_dir, (cfg.train.global_batch_size, cfg.train.micro_batch_size)
        self.named_since: dict[str, float] = {}   # host: since when a rank of it is named for slow compute
        self.refused: set[str] = set()            # hosts whose move was refused (logged once)

    def after(self, step: int, times, log, read) -> str | None:
        """At a window's last step: gather, judge, log (`times`: the trainer's StepTimes; `log`: its Logger; `read`:
        its counted device-to-host read). Returns why every rank must stop (fleet.exclude, rank 0), or None."""
        if not self.every or step % self.every:
            return None
        began = time.perf_counter()
        steps, row = times.window()
        row["collective"] = distributed.COLLECTIVES.take() / max(steps, 1)
        t = torch.zeros(self.lay.world, len(PHASES))   # on CUDA a rank's row may miss its newest step: means per step
        t[self.lay.rank] = torch.tensor([row.get(p, 0.0) for p in PHASES])
        table = distributed.all_reduce(t.to(self.lay.device, non_blocking=True), self.lay)
        if not self.lay.is_main:
            return None
        rows = [dict(zip(PHASES, values)) for values in read(table)]
        return self.judge(step, rows, log, time.perf_counter() - began)

    def judge(self, step: int, rows: list[dict], log, gather_s: float = 0.0) -> str | None:
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
        return self.move_off(time.time(), log) if self.exclude else None

    def move_off(self, now: float, log) -> str | None:
        """fleet.exclude: the stop reason of a move off the host named longest, once due (module docstring)."""
        late = sorted({(self.where[r].host, r) for r, phase in self.detector.named if phase == "compute"})
        self.named_since = {host: self.named_since.get(host, now) for host, _ in late}
        host = exclusion.due({h: t for h, t in self.named_since.items() if h not in self.refused}, now, self.after_s)
        if host is None:
            return None
        hosts = list(dict.fromkeys(p.host for p in self.where))   # in rank order: the launchers' node order
        ranks = [r for h, r in late if h == host]
        why = (f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} named for slow compute for "
               f"{now - self.named_since[host]:.0f} s, fleet.exclude_after_s={self.after_s:g}")
        move = exclusion.plan(host, hosts, self.lay.world // len(hosts), self.lay.tp, self.lay.pp, *self.batch, why,
                              pinned=hosts[0], cp=self.lay.cp)
        if isinstance(move, exclusion.Refused):
            if host not in self.refused:
                log.info(move.line)
            self.refused.add(host)
            return None
        exclusion.ask(self.run_dir, move, hosts)
        log.info(f"{move.line()}: every rank stops after the next step, with a checkpoint")
        return f"{exclusion.REASON}: node {host} leaves ({why})"
