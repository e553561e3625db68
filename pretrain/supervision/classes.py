"""Failure classes: what ended a rank, and whether a relaunch can fix it.

Every rank ends in one class and, before it exits, appends that class, its first error line and the step it reached to
<run_dir>/logs/rank<k>.exits.jsonl (`write`: one line a launch, so the file is the rank's history). A rank killed by -9 or the OOM killer writes nothing: its silence is its
record. The supervisor (relaunch.py) reads these files, not the launcher's exit status: DeepSpeed's launcher exits
with whichever failing rank it polls first (a data error on rank 3 can surface as rank 0's failed collective), and
torchrun's agent restarts on any non-zero exit. Of all the ranks' records, the cause names the launch before its echoes
(`conclude`): a class a relaunch cannot fix first, in PRECEDENCE's order; else the earliest record of a hang, an
unknown error or an outage (the first cause: a CUDA error on rank 3 before the hangs of the ranks that wait for it);
else a lost rank (an echo of a peer's death); the ranks that left no record are named. A rank's first record is its
own (`read`): what it records after it (a hang in its teardown) is left out, and its watchdog is stopped before it.

    class                 exit  relaunched   what it is
    done                     0  no           the launch trained what it was asked (train.max_steps, stop_after_steps)
    preempted                0  no           a signal (train.preempt_signals) or train.max_wall_minutes: a checkpoint of
                                             the step, then exit 0; the scheduler, or the user, relaunches
    exclude                  0  no           fleet.exclude: rank 0 stopped every rank with a checkpoint to move off a
                                             slow node; the supervisor relaunches without it (exclude.py), not as a
                                             failure (no --max-restarts counted)
    config or data error     2  no           ConfigError, DataError (a bad shard under data.bad_shards=fail: missing, a
                                             size, hash or parse that is wrong): the same command fails the same way
    training stopped         4  no           TrainingStopped (train.max_consecutive_skips non-finite steps in a row), a
                                             checkpoint that cannot be written (a full disk): replayed, it stops again
    hang                     3  yes          the watchdog (train.hang_timeout), or a collective that timed out
    unknown                  1  yes          anything else (a CUDA error, out of memory, a bug)
    transient                6  yes          an outage that outlasted the data retries (tokendata/remote.py's
                                             FetchFailed): relaunched after a longer wait; no shard recorded bad
    lost rank                5  yes          a collective failed because another rank died; a rank with no record

A relaunch that fails in the same class at the same step with the same first error line as the launch before it stops
the relaunches (a crash loop: relaunch.py), whatever the class but transient (an outage passes by itself); `steady`
takes out of the line the numbers that change from launch to launch (durations, process ids, addresses).
"""
from __future__ import annotations

import json
import os
import re
import socket
import time
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class FailureClass:
    name: str
    exit: int          # the rank's exit status, for launchers that read one
    relaunch: bool     # whether a relaunch can fix it
    meaning: str


DONE = FailureClass("done", 0, False, "the launch trained what it was asked (train.max_steps, train.stop_after_steps)")
PREEMPTED = FailureClass("preempted", 0, False, "a signal (train.preempt_signals) or train.max_wall_minutes: every "
                                                "rank saved the step and exited; the scheduler or the user relaunches")
CONFIG = FailureClass("config or data error", 2, False, "a bad setting, a bad or missing shard, a hash mismatch "
                                                        "(data.bad_shards=fail): the same command fails the same way")
STOPPED = FailureClass("training stopped", 4, False, "train.max_consecutive_skips non-finite steps in a row, or a "
                                                     "checkpoint that cannot be written: replayed, it stops again")
EXCLUDE = FailureClass("exclude", 0, False, "fleet.exclude: every rank saved the step and exited to move off a "
                                           "slow node; the supervisor relaunches without it (not a failure)")
HANG = FailureClass("hang", 3, True, "no progress for train.hang_timeout (the watchdog), or a collective timed out")
UNKNOWN = FailureClass("unknown", 1, True, "anything else: a CUDA error, out of memory, a bug (a crash loop stops it)")
TRANSIENT = FailureClass("transient", 6, True, "an outage of the data's server, store or network that outlasted the "
                                               "retries (tokendata/remote.py): relaunched after a longer wait")
LOST = FailureClass("lost rank", 5, True, "another rank died (kill -9, the OOM killer, a node lost); a rank that "
                                          "left no record")
PRECEDENCE = (CONFIG, STOPPED, HANG, UNKNOWN, TRANSIENT, LOST, EXCLUDE, PREEMPTED, DONE)   # the cause before its echoes
CAUSES = (HANG, UNKNOWN, TRANSIENT)   # what a relaunch can fix, the earliest of them first: the first cause wins
BY_NAME = {c.name: c for c in PRECEDENCE}
RANKED = {c.name: i for i, c in enumerate(PRECEDENCE)}
BY_EXIT = {c.exit: c for c in reversed(PRECEDENCE) if c.exit}          # where no rank left a record


def of_exit_status(code: int) -> FailureClass:
    """A launch's class from its exit status alone (no rank's record): 0 done, 2, 3, 4 theirs, a signal lost."""
    if code == 0:
        return DONE
    if code < 0 or code > 128:   # killed by a signal: -9 from Python, 137 from a shell
        return LOST
    return BY_EXIT.get(code, UNKNOWN)


def first_line(e: BaseException) -> str:
    """The line that says what went wrong: the message's first line, or for an error re-raised from a DataLoader
    worker ("Caught DataError in DataLoader worker process 0. Original Traceback …") the original's last line."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    if lines and lines[0].startswith("Caught ") and "DataLoader worker" in lines[0]:
        return lines[-1].split(": ", 1)[-1]
    return lines[0] if lines else type(e).__name__


@dataclass
class Ending:
    """One rank's record of how its launch ended."""
    rank: int
    cls: str                      # a FailureClass name
    line: str                     # the first error line (or what the rank did, for done and preempted)
    step: int | None              # the last step the rank finished (None: it had no trainer yet)
    restart: int = 0              # which launch of the run: 0 the first, k the k-th relaunch
    time: float = field(default_factory=time.time)
    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)
    collectives: dict = field(default_factory=dict)   # per process group: {desc, ranks, timeout_s, entered}
    world: int = field(default_factory=lambda: int(os.environ.get("WORLD_SIZE") or 0))   # the launch's ranks (0: ?)

    @property
    def failure(self) -> FailureClass:
        return BY_NAME[self.cls]


def path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, "logs", f"rank{rank}.exits.jsonl")


def write(run_dir: str, ending: Ending) -> str:
    """Append the rank's record: one line, written in one call (O_APPEND), so that a reader sees it whole or not."""
    target = path(run_dir, ending.rank)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    fd = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(asdict(ending)) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return target


def read(run_dir: str, restart: int, since: "dict[str, int] | float") -> list[Ending]:
    """The records of the launch that is relaunch number `restart`, one a rank: those appended after `since`, a `mark`
    taken before the launch (or, given epoch seconds, those written since then: `fresh`). An older launch's, or one
    of a launch by hand with the same number, is left out. A rank that wrote two keeps its first: what it recorded
    after it is an echo (the lost peer its main thread saw while its watchdog dumped the hang, a hang in its teardown
    after its error)."""
    folder = os.path.join(run_dir, "logs")
    found: dict[int, Ending] = {}
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if not name.endswith(".exits.jsonl"):
            continue
        for line in lines_after(os.path.join(folder, name), since):
            try:
                ending = Ending(**json.loads(line))
            except (ValueError, TypeError):   # a line cut short by a kill
                continue
            if ending.restart == restart and fresh(ending, since) and ending.cls in BY_NAME and \
                    ending.rank not in found:
                found[ending.rank] = ending
    return [found[rank] for rank in sorted(found)]


def mark(run_dir: str) -> dict[str, int]:
    """Where each rank's record file ends now, in bytes. `read` given it takes what was appended after: a launch's
    records, known by their place and their launch's number, whatever the clock of the node that wrote them says."""
    folder = os.path.join(run_dir, "logs")
    names = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    return {name: os.path.getsize(os.path.join(folder, name)) for name in names if name.endswith(".exits.jsonl")}


def lines_after(path: str, since: "dict[str, int] | float") -> list[str]:
    """The lines of a record file after its place in the mark `since` (a file shorter than that was replaced: all of
    it), or all of them where `since` is a time."""
    with open(path, "rb") as f:
        data = f.read()
    start = since.get(os.path.basename(path), 0) if isinstance(since, dict) else 0
    return data[start if start <= len(data) else 0:].decode(errors="replace").splitlines()


def fresh(ending: Ending, since: "dict[str, int] | float") -> bool:
    """Whether a record is of the launch that began at `since`: after a mark, by its place (lines_after); at epoch
    seconds, by its time, with 5 s to spare (wrong where a node's clock is off by more: a mark is not)."""
    return isinstance(since, dict) or ending.time >= since - 5


@dataclass
class Verdict:
    """What ended a launch: its class, the rank that names it (None: no record), and one line to print."""
    cls: FailureClass
    rank: int | None
    step: int | None
    line: str

    def key(self) -> tuple:
        """What a crash loop repeats: the class, the step and the first error line (`steady`)."""
        return self.cls.name, self.step, steady(self.line)


# What differs between two launches that fail alike, and what stands in for it: process ids, sequence numbers and
# collective counts (from the process's start), addresses and ports, dates and times, durations, and measurements (a
# number with a fraction: memory free, rates). Integers that name things stay: ranks, steps, process groups, settings,
# error codes.
VARYING = ((re.compile(r"\b0x[0-9a-fA-F]+"), "0x?"),
           (re.compile(r"\b\d{4}-\d\d-\d\d\b|\b\d\d:\d\d:\d\d(?:[.,]\d+)?"), "<time>"),
           (re.compile(r"\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?|\[[0-9a-fA-F:.]*\]:\d+"), "<address>"),
           (re.compile(r"\b(pid|PID|[Pp]rocess|tid|SeqNum|entered|the others)([ =:#]+)\d+"), r"\1\2N"),
           (re.compile(r"\b\d+(?:\.\d+)?(\s*)(ms|milliseconds|s|sec|seconds|min|minutes)\b"), r"N\1\2"),
           (re.compile(r"\b\d+\.\d+"), "N"))


def steady(line: str) -> str:
    """A failure's line without what changes from one launch to the next (VARYING): the same hang, twice, reads
    alike ("no progress for 1800 s" and "1801 s" are both "N s")."""
    for pattern, stand_in in VARYING:
        line = pattern.sub(stand_in, line)
    return line


def silent(endings: list[Ending]) -> list[int]:
    """The ranks of the launch that left no record (the world from the records, else up to the highest rank)."""
    world = max([e.world for e in endings] + [e.rank + 1 for e in endings])
    return sorted(set(range(world)) - {e.rank for e in endings})


def first_cause(endings: list[Ending]) -> Ending:
    """The record that names the launch: a class a relaunch cannot fix, first in PRECEDENCE; else the earliest of
    the CAUSES (a hang recorded after another rank's error is what that error left behind); else the echoes."""
    def order(e: Ending) -> tuple:
        cause = e.failure in CAUSES
        return RANKED[CAUSES[0].name] if cause else RANKED[e.cls], e.time if cause else 0, RANKED[e.cls], e.time
    return min(endings, key=order)


def conclude(endings: list[Ending], exit_status: int) -> Verdict:
    """The launch's class: the first cause among the ranks' records (`first_cause`), naming the ranks that left
    none; with no record, the exit status's (a rank killed by a signal leaves none); a failed launch whose records
    all say done or preempted lost a rank that left none."""
    if not endings:
        cls = of_exit_status(exit_status)
        why = ("the ranks left no record (killed before they could write one)" if cls is not DONE else "done")
        return Verdict(cls, None, None, f"{why}; the launch ended with exit status {exit_status}")
    best, quiet = first_cause(endings), silent(endings)
    who = f"{'rank' if len(quiet) == 1 else 'ranks'} {spans(quiet)}" if quiet else "a rank"
    if exit_status != 0 and best.failure in (DONE, PREEMPTED, EXCLUDE):
        return Verdict(LOST, quiet[0] if quiet else None, best.step,
                       f"{who} left no record and the launch ended with exit status {exit_status} (killed: kill -9, "
                       f"the OOM killer)")
    if best.failure is HANG:   # (with every record that counted its collectives: a waiting rank's lost rank too)
        verdict = Verdict(HANG, *culprit([e for e in endings if e.failure is HANG or e.collectives], best))
    else:
        verdict = Verdict(best.failure, best.rank, best.step, best.line)
    if quiet and verdict.cls.relaunch:   # killed before they could write one: maybe the cause
        verdict.line += f"; {who} left no record (killed: kill -9, the OOM killer, a node lost?)"
    return verdict


def culprit(hung: list[Ending], first: Ending) -> tuple[int, int, str]:
    """(rank, step, line) of a hang. Every rank's watchdog expires, the ranks waiting in a collective as well as the
    one they wait for, unless a waiting rank sees the hung one's exit first (then it records a lost rank, its own
    watchdog stopped: its collectives count all the same). Each rank recorded, per process group, how many
    collectives it entered: rank r waits for rank s where they share a group in which r entered more than s. The ranks
    someone waits for, and who wait for nobody, are the hang's cause. None such (a cycle, or every rank level): the
    first watchdog's line."""
    entered: dict[str, dict[int, int]] = {}
    for e in hung:
        for name, g in e.collectives.items():
            entered.setdefault(name, {})[e.rank] = g["entered"]
    waits: dict[int, set[int]] = {e.rank: set() for e in hung}
    evidence: dict[int, tuple[str, int, int]] = {}
    for name, counts in entered.items():
        for r, n in counts.items():
            for s, m in counts.items():
                if n > m:
                    waits[r].add(s)
                    evidence.setdefault(s, (name, m, n))
    waited_for = set().union(*waits.values())
    causes = sorted(s for s in waited_for if not waits.get(s))
    if not causes:
        return first.rank, first.step, (f"{first.line}; no rank stands out by the collectives it entered: compare "
                                        f"the stacks in the run's hang/ directory")
    by_rank = {e.rank: e for e in hung}
    who = ("rank " if len(causes) == 1 else "ranks ") + ", ".join(map(str, causes))
    name, m, n = evidence[causes[0]]
    waiting = [r for r in sorted(waits) if waits[r]]
    return causes[0], by_rank[causes[0]].step, (
        f"{who} hung; {'rank' if len(waiting) == 1 else 'ranks'} {spans(waiting)} "
        f"{'waits' if len(waiting) == 1 else 'wait'} for it in a collective "
        f"({who} entered {m} collectives of process group {name}, the others {n}); {by_rank[causes[0]].line}")


def spans(ranks: list[int]) -> str:
    """0-4, 6, 7 for [0, 1, 2, 3, 4, 6, 7]."""
    out, start = [], None
    for i, r in enumerate(ranks):
        start = r if start is None else start
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(f"{start}-{r}" if r - start > 1 else ", ".join(map(str, range(start, r + 1))))
            start = None
    return ", ".join(out)
