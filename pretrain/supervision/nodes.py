"""What the supervisors and the ranks of a run tell each other through its directory, beside the ranks' records
(classes.py), so that every node acts on the same launch:

    <run_dir>/logs/launch.json   the launch's number and cause, written by the supervisor before each launch and
                                 removed after it (`announce`, `withdraw`). A rank whose launcher did not pass the
                                 supervisor's environment on reads them there (`launch_of`): DeepSpeed over ssh
                                 (HOSTFILE, pdsh) passes to the other nodes only variables named MLFLOW*, PYTHON*,
                                 MV2*, UCX* and NCCL*, so SYNTHFORMER_RESTARTS never arrives there. A stop signal to
                                 the supervisor is written there too (`request_stop`): such ranks are not under it,
                                 and their global rank 0 polls the file for it (supervision/rank.py watch_stop).
    <run_dir>/logs/nodes.jsonl   a line per event of a launch that the other nodes must know of (`tell`): a rank's
                                 failure (as it writes its failure record), and each node's launch that ended, with
                                 its exit status. With one supervisor a node (`--nodes N`), each watches it (`Board`):
                                 a failure anywhere stops its own launcher (after a grace for its own ranks' records),
                                 so that no node waits out hang_timeout for a peer that is gone; and it judges and
                                 relaunches once every node's launch has ended, so that all read the same records and
                                 start again together.

A line belongs to a launch by its number and its place in the file, never by its time: the nodes' clocks may
disagree. Each supervisor of a job writes a "joined" line as it begins and a "closed" line as it ends; the job's lines
begin at its first node's "joined" line. A node whose supervisor started late (its peers' first launch may already have
failed and ended) reads back from its own "joined" line to the first of its peers', and no further: it stops at a line
of its own supervisor's (an earlier job's), at a "closed" line, at a second "joined" line of one node, or at one of
another job where the scheduler names jobs (`job`, `session`). A supervisor writes its "closed" line on any way out
but SIGKILL (a scheduler's SIGTERM stops it first); an earlier job whose supervisors were all killed so, started by
hand without SYNTHFORMER_JOB_ID, is the one case a late node may read back into.
"""
from __future__ import annotations

import json
import os
import socket

RESTARTS, RESTART_CAUSE = "SYNTHFORMER_RESTARTS", "SYNTHFORMER_RESTART_CAUSE"


def launch_path(run_dir: str) -> str:
    return os.path.join(run_dir, "logs", "launch.json")


def board_path(run_dir: str) -> str:
    return os.path.join(run_dir, "logs", "nodes.jsonl")


def announce(run_dir: str, restart: int, cause: str | None, stop: str | None = None) -> None:
    """Before launch `restart`: its number and cause, for ranks that the supervisor's environment does not reach."""
    path = launch_path(run_dir)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    part = f"{path}.{socket.gethostname()}.{os.getpid()}"   # every node's supervisor writes the same: each its own
    with open(part, "w") as f:
        json.dump({"restart": restart, "cause": cause, "stop": stop}, f)
    os.replace(part, path)


def request_stop(run_dir: str, restart: int, why: str) -> None:
    """A stop signal to the supervisor during launch `restart` (`why`: its name), for the ranks not under it."""
    told = told_launch(run_dir) or {}
    announce(run_dir, restart, told.get("cause") if told.get("restart") == restart else None, why)


def stop_requested(run_dir: str, restart: int) -> str | None:
    told = told_launch(run_dir)
    return told.get("stop") if told is not None and told.get("restart") == restart else None


def from_run_dir(run_dir: str) -> bool:
    """Whether this rank takes its launch from the run directory: the supervisor's environment did not reach it, and
    a supervisor wrote one there."""
    return not any(os.environ.get(name) for name in (RESTARTS, "SLURM_RESTART_COUNT")) and \
        told_launch(run_dir) is not None


def withdraw(run_dir: str, restart: int) -> None:
    """After launch `restart`: its file gone (unless a later launch's replaced it), so that a rank started later
    without a supervisor does not take an old number."""
    told = told_launch(run_dir)
    if told is not None and told.get("restart") == restart:
        try:
            os.remove(launch_path(run_dir))
        except FileNotFoundError:   # another node's supervisor withdrew it first
            pass


def told_launch(run_dir: str) -> dict | None:
    try:
        with open(launch_path(run_dir)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def launch_of(run_dir: str) -> tuple[int, str | None]:
    """(which launch of the run this rank's is: 0 the first, k the k-th relaunch; the relaunch's cause or None): from
    this node's supervisor (SYNTHFORMER_RESTARTS, SYNTHFORMER_RESTART_CAUSE), else SLURM's requeue count, else what
    the supervisor wrote in the run directory for ranks on other nodes, else the first launch."""
    cause = os.environ.get(RESTART_CAUSE) or None
    for name in (RESTARTS, "SLURM_RESTART_COUNT"):
        if os.environ.get(name):
            return int(os.environ[name]), cause
    told = told_launch(run_dir)
    if told is not None:
        return int(told["restart"]), told.get("cause") or cause
    return 0, cause


def tell(run_dir: str, restart: int, event: str, **what) -> None:
    """One line on the run's board, in one write (O_APPEND): `event` ("joined", "failed", "ended", "closed") of launch `restart`."""
    path = board_path(run_dir)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps({"restart": restart, "event": event, "host": socket.gethostname(), **what})
                      + "\n").encode())
    finally:
        os.close(fd)


class Board:
    """The board's lines of this job (from its first node's "joined" line on), read as they come: one small file, so
    that polling it costs the shared filesystem one read a poll, whatever the number of ranks. Making one says that
    node `node` of `count` joined, at launch `restart`."""

    def __init__(self, run_dir: str, node: int, count: int, restart: int, mark: dict[str, int]):
        """`mark`: where the ranks' records end now (classes.mark). `self.mark`: the first joined node's, so that
        every node reads the same records of the job's launches, a late one too."""
        self.path, self.node = board_path(run_dir), node
        me = f"{socket.gethostname()}.{os.getpid()}.{os.urandom(4).hex()}"
        tell(run_dir, restart, "joined", node=node, id=me, mark=mark, job=job())
        with open(self.path, "rb") as f:
            data = f.read()
        self.offset, first = session(data, me, node, count)
        self.mark: dict[str, int] = first.get("mark", mark)
        self.lines: list[dict] = []

    def close(self, restart: int) -> None:
        """This node's supervisor ends: a later job's late joiner reads back no further than this."""
        tell(os.path.dirname(os.path.dirname(self.path)), restart, "closed", node=self.node)

    def poll(self) -> list[dict]:
        """Every line since this was made (whole lines only: one being written waits for the next poll)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return self.lines
        data = data[:data.rfind(b"\n") + 1]
        self.offset += len(data)
        for line in data.decode(errors="replace").splitlines():
            try:
                self.lines.append(json.loads(line))
            except ValueError:   # two nodes' lines run together (O_APPEND is not atomic over NFS): left out
                continue
        return self.lines

    def failure(self, restart: int, node: int) -> dict | None:
        """The first failure of launch `restart` on the board: a rank's, or another node's launch that failed."""
        return next((line for line in self.poll() if line.get("restart") == restart and (
            line.get("event") == "failed" or line.get("event") == "ended" and line.get("node") != node
            and line.get("status") and not line.get("stopped"))), None)

    def ended(self, restart: int) -> set[int]:
        """The nodes whose launch `restart` has ended."""
        return {line["node"] for line in self.poll() if line.get("restart") == restart and line.get("event") == "ended"
                and "node" in line}


def job() -> str:
    """What every node of one job has alike and a later job has not, where the scheduler gives it: SLURM's job id and
    requeue count, or SYNTHFORMER_JOB_ID (set it alike on every node of a job started by hand); else ''."""
    return ".".join(os.environ.get(name, "") for name in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "SYNTHFORMER_JOB_ID"))


def session(data: bytes, me: str, node: int, count: int) -> tuple[int, dict]:
    """(where this job's lines begin in the board's bytes `data`, its first "joined" line): at the earliest of the other nodes' "joined" lines
    found reading back from this node's own (`me`), until a line of this node's supervisor (an earlier job's), a
    "closed" line, a node's second "joined" line or one of another job (`job`), or once the other `count - 1` nodes have joined; at its own line
    where none is found.)"""
    lines, at = [], 0
    for raw in data.splitlines(keepends=True):
        try:
            lines.append((at, json.loads(raw)))
        except ValueError:
            pass
        at += len(raw)
    mine = next((i for i, (_, line) in enumerate(lines) if line.get("id") == me), None)
    if mine is None:   # its line ran into another node's (O_APPEND over NFS): from where the file ends
        return len(data), {}
    (start, first), joined = lines[mine], set()
    for at, line in reversed(lines[:mine]):
        if len(joined) == count - 1 or line.get("event") == "closed" or (
                line.get("node") == node and "rank" not in line):
            break
        if line.get("event") == "joined":
            if line.get("node") in joined or line.get("job", "") != first.get("job", ""):
                break
            joined.add(line.get("node"))
            start, first = at, line
    return start, first


def failure_words(line: dict) -> str:
    """What a failure on the board says, for the supervisor's note."""
    if line.get("event") == "failed":
        return f"rank {line.get('rank')} on {line.get('host')} failed ({line.get('cls')}): {line.get('line')}"
    return f"node {line.get('node')} ({line.get('host')}): its launch ended with exit status {line.get('status')}"
