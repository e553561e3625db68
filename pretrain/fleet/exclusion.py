"""Moving a job off a slow node (fleet.exclude): which node leaves, the data-parallel size without it, and the file
that keeps it out of later launches. Pure logic on host lists and the run directory; the supervisor acts on it.

    which node   the host of a rank named by the detector (pretrain/fleet/detector.py) for at least
                 fleet.exclude_after_s, continuously; of several, the one named longest (then the first in host order).
    the new size every remaining node keeps its ranks: world' = world − ranks of the node, dp' = world' / (tp × pp).
                 The global batch stays (the canonical streams give the same global batches at any dp that divides
                 it, tokendata/order.py): it must be a multiple of dp' × micro-batch; where the micro-batch does not
                 fit, the largest smaller micro-batch that does (more accumulation, the same batches). Where dp' does
                 not divide the global batch at all, or no node would be left, nothing leaves: `Refused` says why, in
                 one line, and the job goes on at the slow node's speed.
                 The first node holds the rendezvous (MASTER_ADDR) of every launcher: it never leaves (`pinned`).
    the file     <run_dir>/fleet/excluded_nodes: one host a line, `host  # why`, appended. A launch reads it and leaves
                 those hosts out of its host list; a person lets a node back by deleting its line.
    the request  <run_dir>/fleet/exclude_requests.jsonl: the trainer's rank 0, once a move is due, appends it (`ask`)
                 and stops every rank after the next step with a checkpoint (its stop reason begins with REASON); the
                 supervisors read the newest line (`asked`) and relaunch without the node (supervision/exclude.py).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass

EXCLUDED = os.path.join("fleet", "excluded_nodes")
REQUESTS = os.path.join("fleet", "exclude_requests.jsonl")
REASON = "fleet.exclude"   # how the stop reason of a move begins (supervision/rank.py records the class `exclude`)


@dataclass(frozen=True)
class Exclusion:
    """The move off one node: the host that leaves, the hosts kept (in order), the new world, dp and micro-batch."""
    host: str
    hosts: tuple[str, ...]
    world: int
    dp: int
    micro_batch: int
    why: str

    def line(self) -> str:
        return (f"fleet.exclude: node {self.host} leaves ({self.why}); relaunching on {len(self.hosts)} nodes, "
                f"{self.world} ranks, data parallel {self.dp}, micro-batch {self.micro_batch}, the same global batch")


@dataclass(frozen=True)
class Refused:
    """Why no node leaves: one line for the log."""
    line: str


def due(named_since: dict[str, float], now: float, after_s: float) -> str | None:
    """The host to move off: of the hosts named continuously since `named_since[host]` (a time), the one named
    longest, if that is ≥ after_s; else None."""
    ready = [(since, host) for host, since in named_since.items() if now - since >= after_s]
    return min(ready)[1] if ready else None


def plan(host: str, hosts: list[str], ranks_per_node: int, tp: int, pp: int, global_batch: int, micro_batch: int,
         why: str, pinned: str | None = None, cp: int = 1) -> Exclusion | Refused:
    """The launch without `host` (see the module's docstring); `pinned`: a node that must stay (the rendezvous's);
    `cp`: the context-parallel size, which divides the world as tp and pp do."""
    if host not in hosts:
        return Refused(f"fleet.exclude: node {host} is not in the host list ({', '.join(hosts)}); nothing leaves")
    if host == pinned:
        return Refused(f"fleet.exclude: node {host} stays: it holds the launch's rendezvous (MASTER_ADDR, the first "
                       f"node); move the job off it by hand (docs/operations.md, Slow jobs)")
    kept = tuple(h for h in hosts if h != host)
    if not kept:
        return Refused(f"fleet.exclude: node {host} is the only node; nothing leaves (the job stays at its speed)")
    world = len(kept) * ranks_per_node
    dp = world // (tp * cp * pp)
    if global_batch % dp:
        return Refused(f"fleet.exclude: node {host} stays: without it data parallel would be {dp}, which does not "
                       f"divide train.global_batch_size={global_batch}, so the global batches would change; choose a "
                       f"global batch that every likely dp divides (a multiple of their product), or exclude by hand")
    micro = next(m for m in range(min(micro_batch, global_batch // dp), 0, -1) if (global_batch // dp) % m == 0)
    return Exclusion(host, kept, world, dp, micro, why)


def excluded(run_dir: str) -> list[str]:
    """The hosts kept out of this run's launches, in the order they were excluded."""
    path = os.path.join(run_dir, EXCLUDED)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [line.split("#", 1)[0].strip() for line in f if line.split("#", 1)[0].strip()]


def record(run_dir: str, move: Exclusion) -> str:
    """Append the host that leaves to the run's excluded nodes; the file's path."""
    path = os.path.join(run_dir, EXCLUDED)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if move.host not in excluded(run_dir):
        with open(path, "a") as f:
            f.write(f"{move.host}  # {time.strftime('%Y-%m-%d %H:%M:%S')}: {move.why}; delete this line to let it "
                    f"back\n")
    return path


def hosts_for_launch(run_dir: str, hosts: list[str]) -> list[str]:
    """The host list of a launch of this run: `hosts` without the excluded ones."""
    out = set(excluded(run_dir))
    return [h for h in hosts if h not in out]


def ask(run_dir: str, move: Exclusion, hosts: list[str]) -> None:
    """The trainer's request for `move` (from the launch's `hosts`), for the supervisors: one line, appended."""
    path = os.path.join(run_dir, REQUESTS)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps({"time": time.time(), "from": list(hosts), **asdict(move)}) + "\n")


def asked(run_dir: str) -> tuple[Exclusion, list[str]] | None:
    """The newest request: (the move, the hosts of the launch it was planned on), or None."""
    path = os.path.join(run_dir, REQUESTS)
    rows = [line for line in open(path) if line.strip()] if os.path.exists(path) else []
    if not rows:
        return None
    row = json.loads(rows[-1])
    hosts = row.pop("from")
    row.pop("time")
    return Exclusion(**{**row, "hosts": tuple(row["hosts"])}), hosts
