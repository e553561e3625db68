"""The supervisor: `python -m pretrain.supervision --max-restarts N --run-dir DIR -- COMMAND…` runs a launch command
(the DeepSpeed launcher, torchrun with --max-restarts 0, or one node's launcher of several), and when it ends reads
what each rank wrote of how it ended (classes.py) to decide, rather than the launcher's exit status:

- it prints the failed rank's first error line and its log file (`error: rank 3 failed first (config or data error):
  …; its log: DIR/logs/rank3.log`); for a hang, the rank the others wait for;
- it relaunches only the classes a relaunch can fix (hang, lost rank, unknown, transient), after a backoff (--backoff,
  doubling with each failure in a row, at most MAX_BACKOFF_S; TRANSIENT_FACTOR times longer after an outage, at most
  TRANSIENT_MAX_S; a launch that ran STABLE_S before failing starts again from --backoff), at most N times; the
  relaunch resumes from the newest checkpoint by itself and is told its number and cause (SYNTHFORMER_RESTARTS,
  SYNTHFORMER_RESTART_CAUSE), which the trainer logs at the step it resumed;
- a relaunch that fails in the same class, at the same step, with the same first error line as the launch before it
  stops the relaunches (a crash loop: the relaunch cannot help): the line without the numbers that change by the
  second (classes.steady), and for a launch whose ranks left no record (kill -9, the OOM killer) the step of the
  newest complete checkpoint, which both resumed from; an outage that lasts is no loop;
- each launch's verdict is appended to DIR/logs/launches.jsonl, which is how a requeued SLURM job (a new process:
  `--classify`) knows the launch before it;
- a preemption signal reaches the ranks once, as a request to stop (run_once): the launchers never act on it.

A launch's records are those its ranks appended after the supervisor began (classes.mark), with its number: no clock
is compared, so a node whose clock is off is still read. The number and cause of each launch are also written in the
run directory (nodes.py), for ranks on nodes that the supervisor's environment does not reach (DeepSpeed over ssh).

Every node of a multi-node job can run its own supervisor around its own launcher (--nodes N --node-rank I, as
launch/pretrain.sh does with NNODES and NODE_RANK); they read the same records (the run directory is shared) and so
decide alike. A failure on any node (a rank's failure record, or a node's launch that failed) stops every node's
launcher within POLL_S + --stop-grace s (nodes.py's board), rather than after hang_timeout; each node then waits for
the others' launches to end, and all judge the same records and relaunch together. Without --run-dir the run's
directory is found from the trainer's arguments in the command; a command without them (not a launch of
pretrain.train) is judged by its exit status alone (0 done, 2 config or data error, 3 hang, 4 training stopped, else
relaunched), with no crash-loop check.

A launch whose ranks stopped to move off a slow node (the class `exclude`: fleet.exclude) is relaunched without that
node at once, by exclude.py, whatever --max-restarts says: it is no failure.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import psutil

from pretrain.supervision import classes, exclude, nodes
from pretrain.supervision.ranklog import log_path

MAX_BACKOFF_S = 300
TRANSIENT_FACTOR, TRANSIENT_MAX_S = 6, 900   # after an outage: 6 × the wait (60 s for --backoff 10), at most 15 min
STABLE_S = 600                # a launch that ran this long before failing starts the backoff again from --backoff
RESTARTS, RESTART_CAUSE = nodes.RESTARTS, nodes.RESTART_CAUSE
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
POLL_S = 2.0                  # with --nodes: how often the run's board (nodes.py) is read
STOP_GRACE_S = 15.0           # with --nodes: from a failure on the board to stopping this node's launcher
NODES_WAIT_S = 120.0          # with --nodes: how long a node waits for the others' launches to end, at most


@dataclass(frozen=True)
class Node:
    """This supervisor as one of `count`, one a node: its node rank, and the seconds between a failure on the board
    and stopping its own launcher (its own ranks' records are written first: a hang's stacks and dumps take a while)."""
    count: int
    rank: int
    grace: float = STOP_GRACE_S


def run_dir_of(command: list[str]) -> str | None:
    """The run's directory (train.run_dir) from the trainer's arguments in a launch command (`… pretrain.train CONFIG
    overrides`), asked of `python -m pretrain.config` (this process stays without torch); None where there are none."""
    if "pretrain.train" not in command:
        return None
    args = [a for a in command[command.index("pretrain.train") + 1:] if not a.startswith("--local_rank")]
    r = subprocess.run([sys.executable, "-m", "pretrain.config", *args, "--run-dir"], capture_output=True, text=True)
    lines = r.stdout.strip().splitlines()
    return lines[-1] if r.returncode == 0 and lines else None


def history_path(run_dir: str) -> str:
    return os.path.join(run_dir, "logs", "launches.jsonl")


def previous(run_dir: str | None, restart: int) -> dict | None:
    """The verdict of launch `restart` − 1, from the run's history."""
    path = history_path(run_dir) if run_dir else None
    if not path or not os.path.exists(path):
        return None
    rows = [json.loads(line) for line in open(path) if line.strip()]
    return next((row for row in reversed(rows) if row["restart"] == restart - 1), None)


def judge(run_dir: str | None, restart: int, since: dict | float, code: int,
          errors: list[str]) -> tuple[classes.Verdict, str | None]:
    """(the launch's verdict, why it must not be relaunched, or None), its row appended to the run's history. `since`:
    where the launch's records begin (classes.read)."""
    if run_dir:
        verdict = classes.conclude(classes.read(run_dir, restart, since), code)
    else:
        verdict = classes.conclude([], code)
    if verdict.rank is None and errors and verdict.cls is not classes.DONE:   # the launcher's first `error:` line
        verdict.line = errors[0].removeprefix("error:").strip()
    if verdict.step is None and run_dir:   # no rank's record: the step both launches resumed from stands in
        verdict.step = newest_checkpoint_step(run_dir)
    before = previous(run_dir, restart)
    stop = None
    if not verdict.cls.relaunch and verdict.cls is not classes.EXCLUDE:   # a move off a node: exclude.py
        stop = f"a relaunch cannot fix a {verdict.cls.name} ({verdict.cls.meaning})"
    elif crash_loop(before, verdict):
        stop = (f"launch {restart} failed as launch {restart - 1} did, at step {verdict.step} with the same first "
                f"error line: a crash loop, which a relaunch does not end")
    if run_dir:
        os.makedirs(os.path.dirname(history_path(run_dir)), exist_ok=True)
        with open(history_path(run_dir), "a") as f:
            f.write(json.dumps({"restart": restart, "time": time.time(), "exit": code, "class": verdict.cls.name,
                                "rank": verdict.rank, "step": verdict.step, "line": verdict.line,
                                "key": verdict.key(), "relaunch": stop is None}) + "\n")
    return verdict, stop


def crash_loop(before: dict | None, verdict: classes.Verdict) -> bool:
    """Whether a launch failed as the one before it did (`before`: its row in the history): the same class, step
    and line but for the numbers that change by the second (an older row's line is made steady here). An outage
    (transient) that lasts is no loop: it passes by itself; the backoff and --max-restarts bound it."""
    if verdict.step is None or not before or verdict.cls is classes.TRANSIENT:
        return False
    cls, step, line = before["key"]
    return (cls, step, classes.steady(line)) == verdict.key()


def newest_checkpoint_step(run_dir: str) -> int | None:
    """The step of the newest complete checkpoint under <run_dir>/checkpoints (checkpoint.dir's default): a tag
    with its complete.json, which a save writes last before it renames `<tag>.partial`; None where there is none."""
    folder = os.path.join(run_dir, "checkpoints")
    tags = [t for t in os.listdir(folder) if t.startswith("step_") and t[5:].isdigit()] if os.path.isdir(folder) else []
    tags.sort(key=lambda t: int(t[5:]), reverse=True)   # (a `.partial` tag is not a step: left out)
    for tag in tags:
        try:
            with open(os.path.join(folder, tag, "complete.json")) as f:
                return int(json.load(f)["step"])
        except (OSError, ValueError, KeyError, TypeError):   # no complete.json yet: not complete
            continue
    return None


def wait_s(cls: classes.FailureClass, backoff: float, in_a_row: int) -> float:
    """Seconds before a relaunch after the `in_a_row`-th failure in a row (0 the first): `backoff`, doubled per
    failure, at most MAX_BACKOFF_S; after an outage TRANSIENT_FACTOR times longer, at most TRANSIENT_MAX_S."""
    if cls is classes.TRANSIENT:
        return min(TRANSIENT_MAX_S, TRANSIENT_FACTOR * backoff * 2 ** in_a_row)
    return min(MAX_BACKOFF_S, backoff * 2 ** in_a_row)


def failure_line(verdict: classes.Verdict, run_dir: str | None) -> str:
    """`error: rank k failed first (its class): its line; its log: …` (or without a rank where none left a record)."""
    if verdict.rank is None:
        return f"error: the launch failed ({verdict.cls.name}): {verdict.line}"
    where = f"; its log: {log_path(run_dir, verdict.rank)}" if run_dir else ""
    if verdict.cls is classes.HANG:
        return f"error: {verdict.line}{where}"
    return f"error: rank {verdict.rank} failed first ({verdict.cls.name}): {verdict.line}{where}"


def run_once(command: list[str], env: dict, stopping: list, run_dir: str | None = None, restart: int = 0,
             board: nodes.Board | None = None, node: Node | None = None) -> tuple[int, list[str], dict | None]:
    """Run the launch command in its own session, its stderr passed through line by line; (its exit status, its
    `error: …` lines, the failure on the board that made this node stop it or None).

    A launch of the trainer (`run_dir` known) starts with the stop signals (SIGTERM, SIGINT, SIGUSR1/2: a scheduler's
    preemption) blocked. Every process under it inherits that, so the launchers (DeepSpeed's two, torchrun's agent)
    never act on one, whoever sends it (SLURM signals every process of a job step), and never end ranks that are
    saving; each rank unblocks them and acts on its own (supervision/rank.py), and its DataLoader workers ignore its
    preemption signals (tokendata/reading.py). A stop signal to the supervisor is passed on to every process of the
    launch, as SLURM would, and written in the run directory for ranks not under it (DeepSpeed over ssh: nodes.py),
    and noted in `stopping`: the ranks finish their step, save and exit 0, and so do the launchers. Another command
    gets it in its process group, as from a shell. With `node` (one supervisor a node), a failure of launch `restart`
    on the run's `board` stops this node's launcher (end_tree) after the node's grace. Once the command has ended,
    whatever it left behind (a rank, a data worker) is killed with its group."""
    trainer = run_dir is not None
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS) if trainer else None   # till `forward` is set
    try:
        proc = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True, errors="replace",
                                start_new_session=True)
    except BaseException:
        if trainer:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        raise
    errors: list[str] = []
    stopped_for: list[dict] = []
    ended = threading.Event()

    def relay():
        for line in proc.stderr:
            sys.stderr.write(line)
            sys.stderr.flush()
            if line.startswith("error:"):
                errors.append(line.strip())

    def forward(signum, frame):
        stopping.append(signum)
        if trainer:
            nodes.request_stop(run_dir, restart, signal.Signals(signum).name)
            signal_tree(proc.pid, signum)
        else:
            os.killpg(proc.pid, signum)

    def watch_board():
        while not ended.wait(POLL_S):
            failure = board.failure(restart, node.rank)
            if failure is None:
                continue
            print(f"node {node.rank}: {nodes.failure_words(failure)}; stopping this node's launcher in "
                  f"{node.grace:g} s", file=sys.stderr, flush=True)
            if not ended.wait(node.grace):
                stopped_for.append(failure)
                end_tree(proc.pid)
            return

    threads = [threading.Thread(target=relay, daemon=True)] + (
        [threading.Thread(target=watch_board, daemon=True)] if node else [])
    before = {s: signal.signal(s, forward) for s in STOP_SIGNALS}
    if trainer:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    for thread in threads:
        thread.start()
    try:
        code = proc.wait()
    finally:
        ended.set()
        for s, handler in before.items():
            signal.signal(s, handler)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for thread in threads:
            thread.join(timeout=10)
    return (128 - code if code < 0 else code), errors, (stopped_for[0] if stopped_for else None)


def signal_tree(pid: int, signum: int) -> None:
    """`signum` to every process of a launch: the launcher and all under it, in sessions of their own too (torchrun's
    ranks), once each."""
    try:
        tree = [psutil.Process(pid)] + psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return
    for p in tree:
        try:
            p.send_signal(signum)
        except psutil.Error:
            pass


def end_tree(pid: int) -> None:
    """SIGKILL to every process of a launch (its group, and those under it in sessions of their own)."""
    signal_tree(pid, signal.SIGKILL)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def wait_for_nodes(board: nodes.Board, node: Node, restart: int, stopping: list) -> None:
    """Until every node's launch `restart` has ended (so that all read the same records, and start the next one
    together), NODES_WAIT_S at most: a node that said nothing by then (lost with its supervisor) is not waited for."""
    deadline = time.monotonic() + NODES_WAIT_S
    while len(board.ended(restart)) < node.count and time.monotonic() < deadline and not stopping:
        time.sleep(POLL_S / 4)
    missing = sorted(set(range(node.count)) - board.ended(restart))
    if missing and not stopping:
        print(f"node {node.rank}: node {', '.join(map(str, missing))} did not say that launch {restart} ended within "
              f"{NODES_WAIT_S:g} s; going on without it", file=sys.stderr, flush=True)


def relaunch(command: list[str], max_restarts: int, backoff: float, run_dir: str | None = None,
             node: Node | None = None) -> int:
    """Run `command`; after a failure a relaunch can fix, wait and run it again, at most `max_restarts` times. The
    exit status: 0, or the last launch's class's (classes.py). `node`: one supervisor of several, one a node (it needs
    `run_dir`)."""
    env = dict(os.environ)
    found: dict = {"dir": run_dir, "mark": classes.mark(run_dir) if run_dir else None}   # before any launch
    finder = threading.Thread(target=lambda: found.update(dir=(d := run_dir_of(command)),
                                                          mark=classes.mark(d) if d else None), daemon=True)
    if run_dir is None:   # found while the first launch runs
        finder.start()
    restarts = int(env.get(RESTARTS) or 0)   # a supervisor started as a relaunch goes on counting
    if node and exclude.kept_out(run_dir):   # this node is in the run's excluded nodes (fleet.exclude)
        print(exclude.kept_out(run_dir), file=sys.stderr, flush=True)
        return 0
    board = nodes.Board(run_dir, node.rank, node.count, restarts, found["mark"]) if node else None
    if board is not None:   # a late node reads the records from where the first node's began
        found["mark"] = board.mark
    try:
        return launches(command, max_restarts, backoff, run_dir, node, board, restarts, env, found, finder)
    finally:
        if board is not None:   # for a later job's late joiner (nodes.session)
            board.close(restarts)


def launches(command: list[str], max_restarts: int, backoff: float, run_dir: str | None, node: Node | None,
             board: nodes.Board | None, restarts: int, env: dict, found: dict, finder: threading.Thread) -> int:
    """relaunch()'s launches, from launch `restarts` on, till one ends the run: its exit status."""
    first, in_a_row, stopping = restarts, 0, []   # first: moved on by each move off a node (no failures)
    for s in STOP_SIGNALS:   # also while it waits to relaunch
        signal.signal(s, lambda signum, frame: stopping.append(signum))
    while True:
        started, since = time.monotonic(), time.time()
        if run_dir:   # for ranks that this environment does not reach
            nodes.announce(run_dir, restarts, env.get(RESTART_CAUSE))
        command = exclude.honour(command, run_dir)   # over ssh: the hostfile without the run's excluded nodes
        code, errors, stopped_for = run_once(command, {**env, RESTARTS: str(restarts)}, stopping, run_dir, restarts,
                                             board, node)
        if run_dir:
            nodes.withdraw(run_dir, restarts)
        if node:
            nodes.tell(run_dir, restarts, "ended", node=node.rank, status=code,
                       stopped=bool(stopped_for or stopping))
        if stopping:
            return code
        if finder.is_alive():
            finder.join()
        run_dir = found["dir"]
        if node:   # (a clean end too: rank 0's record of a move off a node may be another node's last)
            wait_for_nodes(board, node, restarts, stopping)
        verdict, stop = judge(run_dir, restarts, found["mark"] if found["mark"] is not None else since, code, errors)
        if verdict.cls in (classes.DONE, classes.PREEMPTED) and code == 0:
            return 0
        if verdict.cls is classes.EXCLUDE and code == 0:   # every rank saved and stopped to move off a node
            moved = exclude.move(run_dir, command, node.count if node else 1, node.rank if node else 0, board,
                                 restarts)
            if moved.command is None:
                return moved.status
            command, node = moved.command, node and Node(moved.count, moved.rank, node.grace)
            env.update({RESTART_CAUSE: verdict.line, **({"NNODES": str(moved.count), "NODE_RANK": str(moved.rank)}
                                                         if node else {})})
            restarts, first = restarts + 1, first + 1
            continue
        print(failure_line(verdict, run_dir), file=sys.stderr, flush=True)
        status = verdict.cls.exit or code or 1
        if max_restarts == 0:   # no relaunch was asked for: the failure's line says it all
            return status
        if stop:
            print(f"error: not relaunching: {stop}", file=sys.stderr, flush=True)
            return status
        in_a_row = 0 if time.monotonic() - started >= STABLE_S else in_a_row   # it ran a while: a new failure
        if restarts - first == max_restarts:
            print(f"error: the run failed {restarts - first + 1} times (launch/pretrain.sh --max-restarts "
                  f"{max_restarts}); not restarting again. The last failure: {verdict.line}", file=sys.stderr,
                  flush=True)
            return status
        wait = wait_s(verdict.cls, backoff, in_a_row)
        restarts, in_a_row = restarts + 1, in_a_row + 1
        print(f"restart {restarts - first} of at most {max_restarts} in {wait:g} s, from the newest checkpoint, "
              f"after: {verdict.line}", file=sys.stderr, flush=True)
        time.sleep(wait)
        if stopping:
            return status
        env[RESTART_CAUSE] = verdict.line
