"""The supervisor's side of fleet.exclude: the launch command without a slow node (pretrain/fleet/exclusion.py plans
the move; the trainer's rank 0 asks for it, and every rank saves the step and exits in the class `exclude`).

    one launcher a node (--nodes N: NNODES launchers, SLURM's one task a node)
        every node's supervisor reads the same request. The node that leaves says so and exits 0; the others take
        their new node ranks (their places in the kept host list) and rewrite their launch command: DeepSpeed's
        per-node hostfile cut to the kept count and its --node_rank, or torchrun's --nnodes and --node-rank. The new
        node 0 converts the checkpoint to a universal one (`python -m pretrain.config … checkpoint.relayout=true
        --world-size W`, as launch/pretrain.sh does before a launch) and says so on the run's board; the others wait
        for that line. A node in <run_dir>/fleet/excluded_nodes does not launch (`kept_out`).
    one launcher over ssh (HOSTFILE)
        the hostfile without the excluded hosts, written to <run_dir>/fleet/hostfile, replaces it in the command,
        before every launch (`honour`): later relaunches keep the node out until its line is deleted.

Every relaunch after a move resumes with checkpoint.relayout=true (and train.micro_batch_size where the move shrank
it): the same global batches at the smaller data-parallel size, the optimizer state relaid out.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass

from pretrain.fleet import exclusion
from pretrain.node import node_name
from pretrain.supervision import nodes

RELAID_WAIT_S = 1800.0   # how long a kept node waits for node 0's conversion to a universal checkpoint, at most
RELAYOUT = "checkpoint.relayout=true"


@dataclass
class Moved:
    """What the supervisor does after a move: launch `command` as node `rank` of `count`, or (command None) stop
    with exit status `status`."""
    command: list[str] | None
    count: int = 1
    rank: int = 0
    status: int = 0


def kept_out(run_dir: str | None) -> str | None:
    """The line of a node that must not launch in this run (it is in the run's excluded nodes), or None."""
    me = node_name()
    if not run_dir or me not in exclusion.excluded(run_dir):
        return None
    return (f"node {me} is excluded from this run ({os.path.join(run_dir, exclusion.EXCLUDED)}): not launching here; "
            f"delete its line there to let it back")


def flag(command: list[str], names: tuple[str, ...]) -> int | None:
    """The index of the value of the first of `names` in `command`, or None."""
    return next((i + 1 for i, a in enumerate(command[:-1]) if a in names), None)


def host_lines(path: str) -> list[str]:
    """A DeepSpeed hostfile's host lines (`host slots=k`), comments and blank lines left out."""
    with open(path) as f:
        return [line for line in f if line.split("#", 1)[0].strip()]


def honour(command: list[str], run_dir: str | None) -> list[str]:
    """A DeepSpeed launch over ssh (--hostfile without --no_ssh) without the run's excluded hosts."""
    at = flag(command, ("--hostfile",))
    if not run_dir or at is None or "--no_ssh" in command or not exclusion.excluded(run_dir):
        return command
    lines = host_lines(command[at])
    hosts = [line.split()[0] for line in lines]
    keep = exclusion.hosts_for_launch(run_dir, hosts)
    if keep == hosts:
        return command
    path = os.path.join(run_dir, "fleet", "hostfile")
    with open(path, "w") as f:
        f.write("".join(line for line, host in zip(lines, hosts) if host in keep))
    return command[:at] + [path] + command[at + 1:]


def rewrite(command: list[str], count: int, rank: int, micro_batch: int) -> list[str]:
    """The launch command as node `rank` of `count` (one launcher a node), resuming with a relayout."""
    out = list(command)
    at = flag(out, ("--hostfile",))
    if at is not None and "--no_ssh" in out:   # DeepSpeed's per-node hostfile gives the world's shape only
        lines = host_lines(out[at])
        path = f"{out[at].removesuffix('.kept')}.kept"
        with open(path, "w") as f:
            f.write("".join(lines[:count]))
        out[at] = path
    for names, value in ((("--node_rank", "--node-rank"), rank), (("--nnodes",), count)):
        i = flag(out, names)
        if i is not None:
            out[i] = str(value)
    out = [a for a in out if not a.startswith(("checkpoint.relayout=", "train.micro_batch_size="))]
    return out + [RELAYOUT, f"train.micro_batch_size={micro_batch}"]


def trainer_args(command: list[str]) -> list[str]:
    return [a for a in command[command.index("pretrain.train") + 1:] if not a.startswith("--local_rank")]


def relay_out(command: list[str], world: int, restart: int, run_dir: str, board: nodes.Board | None,
              rank: int) -> bool:
    """The checkpoint converted for `world` ranks (node 0: the check before a launch does it), or node 0's word that
    it is; False where that failed."""
    if rank == 0:
        check = [sys.executable, "-m", "pretrain.config", *trainer_args(command), "--world-size", str(world)]
        ok = subprocess.run(check, env={**os.environ, "NODE_RANK": "0"}, stdout=subprocess.DEVNULL).returncode == 0
        if board is not None:
            nodes.tell(run_dir, restart, "relaid", node=0, ok=ok)
        return ok
    deadline = time.monotonic() + RELAID_WAIT_S
    while time.monotonic() < deadline:
        said = [line for line in board.poll() if line.get("event") == "relaid" and line.get("restart") == restart]
        if said:
            return bool(said[0].get("ok"))
        time.sleep(1.0)
    return False


def move(run_dir: str, command: list[str], count: int, rank: int, board: nodes.Board | None,
         restart: int) -> Moved:
    """After a launch that ended in the class `exclude`: the next launch's command and place, or a stop."""
    asked = exclusion.asked(run_dir)
    if asked is None:
        say(f"error: the launch stopped for fleet.exclude, but {os.path.join(run_dir, exclusion.REQUESTS)} holds no "
            f"move; relaunch by hand")
        return Moved(None, status=1)
    plan, hosts = asked
    me, per_node = node_name(), board is not None
    if not per_node or plan.hosts[0] == me:   # one writer of the run's excluded nodes
        exclusion.record(run_dir, plan)
    say(plan.line())
    if per_node and me == plan.host:
        say(f"node {me} leaves the job (fleet.exclude; {os.path.join(run_dir, exclusion.EXCLUDED)}): this node's "
            f"supervisor ends here")
        return Moved(None, status=0)
    if per_node and me not in plan.hosts:
        say(f"error: this node's name {me} is not among the job's nodes ({', '.join(hosts)}): set SYNTHFORMER_NODE "
            f"to the name its ranks report; relaunch by hand")
        return Moved(None, status=1)
    count, rank = (len(plan.hosts), plan.hosts.index(me)) if per_node else (count, rank)
    new = rewrite(honour(command, run_dir), count, rank, plan.micro_batch)
    if not relay_out(new, plan.world, restart, run_dir, board, rank):
        say(f"error: converting the checkpoint for {plan.world} ranks failed (see above); relaunch by hand with "
            f"{RELAYOUT}")
        return Moved(None, status=1)
    return Moved(new, count, rank)


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
