"""What each rank does to be supervised: its own log file, the flight recorder, timeouts that agree, the hang
watchdog, and its failure record.

    run_rank(load, make_trainer)   the whole life of a rank (pretrain/train.py main): the config, the rank's log
                                   (ranklog.py), the flight recorder on (flight_recorder.py), the trainer built and run,
                                   and how it ended written as its failure class (classes.py), with one `error:` line
    supervise(trainer)             at the end of the trainer's construction: every process group set to the collective
                                   timeout (pretrain/timeouts.py), the restart that started this launch logged, and the hang
                                   watchdog (watchdog.py) wrapped around the trainer's work from outside
"""
from __future__ import annotations

import faulthandler
import os
import signal
import socket
import sys
import threading
import time

from model import ConfigError
from pretrain import distributed, timeouts
from pretrain.checkpoints.checkpointer import CheckpointError
from pretrain.fleet import exclusion
from pretrain.step_guard import TrainingStopped
from pretrain.supervision import classes, flight_recorder, nodes, ranklog
from pretrain.supervision.relaunch import STOP_SIGNALS
from pretrain.supervision.saves import SaveProgress, waiting
from pretrain.supervision.watchdog import Watchdog
from tokendata.remote import FetchFailed
from tokendata.shards import DataError

RESTARTS, RESTART_CAUSE = nodes.RESTARTS, nodes.RESTART_CAUSE
# what a collective that timed out says: NCCL's watchdog, gloo
TIMED_OUT = ("collective operation timeout", "Timed out waiting", "timed out waiting")
# What torch raises in the rank when one of its DataLoader workers raised ("Caught ValueError in DataLoader worker
# process 0. Original Traceback …", of the worker's exception's type), and when one died ("DataLoader worker (pid
# 4242) is killed by signal: Killed.", "… exited unexpectedly")
IN_WORKER, WORKER_DIED = " in DataLoader worker process ", "DataLoader worker (pid"
STOP_POLL_S = 5.0   # how often global rank 0 of a launch not under the supervisor looks for a stop request


def restart_number(run_dir: str) -> int:
    """Which launch of the run this is: 0 the first, k the k-th relaunch (the supervisor's, or SLURM's requeue;
    on a node the supervisor's environment does not reach, as it wrote in the run directory: nodes.py)."""
    return nodes.launch_of(run_dir)[0]


def classify(e: BaseException, layout) -> tuple[classes.FailureClass, str]:
    """The failure class of an exception that ended a rank, and its one line. An outage that outlasted the data
    retries (FetchFailed) is transient. An exception raised in a DataLoader worker is classed by what it is (a
    DataError: config or data error; any other: unknown), never as a collective's failure: a worker takes part in
    none. A worker that died (killed by the OOM killer or kill -9, or with the rank's tree by a launcher ending the
    launch; it ignores the preemption signals) is a lost process: relaunched, and below any rank's error in
    precedence, so that an error elsewhere still names the launch."""
    if isinstance(e, FetchFailed):   # an outage that outlasted the data retries: not the data's fault
        return classes.TRANSIENT, classes.first_line(e)
    if isinstance(e, (ConfigError, DataError)):
        return classes.CONFIG, classes.first_line(e)
    if isinstance(e, (TrainingStopped, CheckpointError)):
        return classes.STOPPED, classes.first_line(e)
    caught = next((seen for seen in chain(e) if IN_WORKER in str(seen).split("\n", 1)[0]), None)
    if caught is not None:
        return classes.UNKNOWN, f"{type(caught).__name__} in a DataLoader worker: {classes.first_line(caught)}"
    if any(WORKER_DIED in str(seen) for seen in chain(e)):
        return classes.LOST, (f"a DataLoader worker of this rank died ({classes.first_line(e)}): killed (the OOM "
                              f"killer, kill -9) or ended with its launch; relaunch the same command to resume from "
                              f"the newest checkpoint")
    lost = distributed.lost_peer(e, layout) if layout is not None else None
    if lost is not None or distributed.is_peer_loss(e):
        return classes.LOST, lost or f"lost another rank while building the trainer ({classes.first_line(e)})"
    if any(words in str(e) for words in TIMED_OUT):
        return classes.HANG, f"a collective timed out (train.collective_timeout): {classes.first_line(e)}"
    return classes.UNKNOWN, f"{type(e).__name__}: {classes.first_line(e)}"


def chain(e: BaseException) -> list[BaseException]:
    """`e` and what it arose from."""
    seen = []
    while e is not None and e not in seen:
        seen.append(e)
        e = e.__cause__ or e.__context__
    return seen


def run_rank(load, make_trainer) -> int:
    """Load the config (`load()`), build the trainer (`make_trainer(cfg)`) and train; the rank's exit status. Every
    way out but a kill writes the rank's failure record (and a failure a line on the run's board, for the other
    nodes: nodes.py); an unknown error is raised on (its traceback in the log). The stop signals, which the
    supervisor blocks for its launcher (relaunch.py), are unblocked first: the trainer acts on its own."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    rank = int(os.environ.get("RANK", 0))
    try:
        cfg = load()
    except (ConfigError, DataError) as e:   # no run directory to write to: the exit status says it
        print(f"error: {e}", file=sys.stderr)
        return (classes.TRANSIENT if isinstance(e, FetchFailed) else classes.CONFIG).exit
    run_dir = cfg.train.run_dir
    restart = restart_number(run_dir)
    ranklog.start(run_dir, rank, f"rank {rank} (pid {os.getpid()} on {socket.gethostname()}), launch {restart}")
    flight_recorder.enable(run_dir)
    trainer = None
    try:
        trainer = make_trainer(cfg)
        trainer.train()
        stopped = getattr(trainer, "stopped_by", None)   # fleet.exclude's stop names its move (fleet/exclusion.py)
        cls = (classes.EXCLUDE if str(stopped).startswith(exclusion.REASON) else classes.PREEMPTED) if stopped else \
            classes.DONE
        line = f"stopped at step {trainer.step} ({stopped})" if stopped else f"trained to step {trainer.step}"
        final_record(run_dir, trainer, classes.Ending(rank, cls.name, line, trainer.step, restart))
        return 0
    except Exception as e:
        cls, line = classify(e, trainer.layout if trainer is not None else None)
        final_record(run_dir, trainer, classes.Ending(rank, cls.name, line,
                                                      trainer.step if trainer is not None else None, restart,
                                                      collectives=safe_collectives()))
        nodes.tell(run_dir, restart, "failed", rank=rank, cls=cls.name, line=line)
        if cls is classes.UNKNOWN:
            raise
        if cls is classes.LOST:   # the launcher now ends every rank and their data workers: torch's SIGCHLD
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)   # handler would raise again
        print(f"error: {line}", file=sys.stderr)
        return cls.exit
    finally:
        if trainer is not None:
            trainer.close()
        distributed.shutdown()
        faulthandler.cancel_dump_traceback_later()   # the teardown is over: its backstop (final_record) too


def final_record(run_dir: str, trainer, ending: classes.Ending) -> None:
    """The rank's record of how it ended, its hang watchdog stopped first: a teardown that blocks after it (W&B's
    finish, NCCL's) writes no hang over it (the watchdog's backstop still ends it); a hang the watchdog had already
    begun to record wins instead (the rank ends there, in the watchdog)."""
    dog = getattr(trainer, "watchdog", None)
    if dog is not None:
        dog.stop(teardown=True)
    classes.write(run_dir, ending)


def safe_collectives() -> dict:
    try:
        return timeouts.collectives_entered()
    except Exception:   # a broken group: the record is written without it
        return {}


def supervise(trainer) -> Watchdog | None:
    """Every process group to the collective timeout; the restart that started this launch logged, if it is one; the
    rank's hang watchdog where train.hang_timeout is set, its heartbeats wrapped around the trainer's steps,
    validation, images and downstream scores, and its save watched while its bytes grow, its collectives waiting for
    it meanwhile (supervision/saves.py)."""
    cfg = trainer.cfg.train
    agreed = timeouts.agree(trainer.layout.collective_timeout_s)   # C as distributed.init computed it
    if agreed:
        trainer.log.info(timeouts.words(agreed, cfg.hang_timeout))
    log_restart(trainer.log, trainer.step, cfg.run_dir)
    if trainer.layout.rank == 0 and nodes.from_run_dir(cfg.run_dir):   # not under its supervisor (DeepSpeed over ssh)
        watch_stop(trainer, cfg.run_dir)
    if cfg.hang_timeout is None:
        return None
    dog = Watchdog(cfg.hang_timeout, cfg.run_dir, trainer.layout.rank, lambda: trainer.step,
                   restart_number(cfg.run_dir), ranklog.ACTIVE)
    for owner, name in ((trainer, "train_step"), (trainer, "validate"), (trainer, "log_samples"),
                        (trainer, "log_scores"), (trainer, "train")):   # train: then the way out
        setattr(owner, name, dog.after(getattr(owner, name)))
    saver = trainer.checkpointer
    saver.save = dog.during("the checkpoint save of step {0}", waiting(saver.save, trainer.layout.collective_timeout_s),
                            SaveProgress(saver))
    if cfg.compile:
        dog.on_compilation()
    dog.start()
    return dog


def watch_stop(trainer, run_dir: str, every: float = STOP_POLL_S) -> threading.Thread:
    """A thread that polls the run directory for a stop the supervisor was asked for (nodes.py request_stop) and
    stops the trainer as its preemption signals do: after the step, every rank together, with a checkpoint."""
    restart = restart_number(run_dir)

    def poll():
        while trainer.stop_reason is None:
            why = nodes.stop_requested(run_dir, restart)
            if why:
                trainer.stop_reason = f"{why} to the supervisor"
                return
            time.sleep(every)

    thread = threading.Thread(target=poll, daemon=True, name="stop-requests")
    thread.start()
    return thread


def log_restart(log, step: int, run_dir: str) -> None:
    """A relaunch by the supervisor (or SLURM's requeue) in metrics.jsonl, TensorBoard and W&B, with its cause."""
    count, cause = nodes.launch_of(run_dir)
    if count:
        cause = cause or "not recorded (see the previous launch's log)"
        log.event(step, {"run/restarts": count}, {"run/restart_cause": cause})
        log.info(f"restart {count} of this run, resumed at step {step}, after: {cause}")
