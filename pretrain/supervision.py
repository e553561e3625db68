"""A run that looks after itself: each rank's hang watchdog (train.hang_timeout), and the relaunch of a failed launch
(launch/pretrain.sh --max-restarts N, modelled on torchrun's --max-restarts).

Hang detection. Progress is a heartbeat: a finished training step, validation, checkpoint save, attention images
and text sample, and the start and end of each torch.compile compilation (train.compile). `supervise(trainer)` wraps
those methods of the trainer from outside, so the loop does not change. When no heartbeat has come for hang_timeout
seconds, the rank writes the stack of every thread to <run_dir>/hang/rank<k>.txt (faulthandler), prints one line
(`error: rank k made no progress …`: the rank, the last step it finished, the file) and exits with HANG_EXIT. A rank
stuck in a collective or on storage keeps the others waiting in their next collective, so every rank's watchdog
expires and writes its file: the culprit is the one whose stack is elsewhere. The watchdog is a Python thread (it
needs the interpreter: a hung collective or read releases it); should a C call hold the interpreter, faulthandler's
own C thread dumps the stacks to stderr and ends the rank BACKSTOP_S later.

Restarts. `python -m pretrain.supervision --max-restarts N -- COMMAND…` runs the launch command and, when it fails (a
hang, a lost rank, any exit but 0 and 2: a config or data error that a relaunch cannot fix), waits with exponential
backoff (--backoff, doubling with each failure in a row, at most MAX_BACKOFF_S; a launch that ran STABLE_S before
failing starts again from --backoff) and runs it again, up to N times in all; the trainer resumes from the
newest checkpoint by itself. The relaunch is told its number and cause (SYNTHFORMER_RESTARTS and
SYNTHFORMER_RESTART_CAUSE, or SLURM_RESTART_COUNT under SLURM's requeue), which the trainer logs at the step it resumed
(`run/restarts` and its cause in metrics.jsonl; TensorBoard's run/restarts scalar and run/restart_cause text).
"""
from __future__ import annotations

import argparse
import faulthandler
import functools
import os
import signal
import subprocess
import sys
import threading
import time

HANG_EXIT = 3                 # a rank ended by its watchdog
NO_RESTART_EXIT = 2           # a config or data error (pretrain/train.py main): the same command fails the same way
BACKSTOP_S = 60               # faulthandler's dump and exit, after hang_timeout, where the Python watchdog cannot run
MAX_BACKOFF_S = 300
STABLE_S = 600                # a launch that ran this long before failing starts the backoff again from --backoff
RESTARTS, RESTART_CAUSE = "SYNTHFORMER_RESTARTS", "SYNTHFORMER_RESTART_CAUSE"


class Watchdog:
    """beat() on progress; after `timeout` seconds without one, `expire()` (from its own thread)."""

    def __init__(self, timeout: float, run_dir: str, rank: int, finished_step):
        self.timeout, self.rank, self.finished_step = timeout, rank, finished_step
        self.path = os.path.join(run_dir, "hang", f"rank{rank}.txt")
        self.last, self.stopped, self.undo = time.monotonic(), False, []
        self.thread = threading.Thread(target=self.run, name="hang-watchdog", daemon=True)

    def beat(self, *_) -> None:
        if not self.stopped:
            self.last = time.monotonic()
            faulthandler.dump_traceback_later(self.timeout + BACKSTOP_S, exit=True)   # re-armed: the backstop

    def after(self, method):
        """`method`, followed by a heartbeat when it returns."""
        @functools.wraps(method)
        def beating(*args, **kwargs):
            result = method(*args, **kwargs)
            self.beat()
            return result
        return beating

    def on_compilation(self) -> None:
        """The start and the end of every torch.compile compilation are heartbeats (a first one may take minutes)."""
        from torch._dynamo import callback

        callback.on_compile_start(self.beat)
        callback.on_compile_end(self.beat)
        self.undo += [lambda: callback.callback_handler.remove_start_callback(self.beat),
                      lambda: callback.callback_handler.remove_end_callback(self.beat)]

    def start(self) -> None:
        self.beat()
        self.thread.start()

    def stop(self) -> None:
        """No more watching (the process goes on without it)."""
        self.stopped = True
        faulthandler.cancel_dump_traceback_later()
        for undo in self.undo:
            undo()

    def run(self) -> None:
        while not self.stopped:
            idle = time.monotonic() - self.last
            if idle > self.timeout:
                self.expire(idle)
            time.sleep(min(1.0, self.timeout / 10))

    def expire(self, idle: float) -> None:
        step = self.finished_step()
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with open(self.path, "w") as f:
            f.write(f"rank {self.rank} (pid {os.getpid()}) made no progress for {idle:.0f} s (train.hang_timeout="
                    f"{self.timeout:g}) after finishing step {step}, at {time.strftime('%Y-%m-%d %H:%M:%S')}; the "
                    f"stack of each of its threads follows, most recent call first\n\n")
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)
        print(f"error: rank {self.rank} made no progress for {idle:.0f} s (train.hang_timeout={self.timeout:g}) "
              f"after finishing step {step}: stopped; the stacks of its threads are in {self.path}", file=sys.stderr,
              flush=True)
        os._exit(HANG_EXIT)


def supervise(trainer) -> Watchdog | None:
    """Log the restart that started this launch, if it is one; start the rank's hang watchdog where train.hang_timeout
    is set, its heartbeats wrapped around the trainer's steps, validation, images, downstream scores and checkpoint
    saves."""
    log_restart(trainer.log, trainer.step)
    timeout = trainer.cfg.train.hang_timeout
    if timeout is None:
        return None
    dog = Watchdog(timeout, trainer.cfg.train.run_dir, trainer.layout.rank, lambda: trainer.step)
    for owner, name in ((trainer, "train_step"), (trainer, "validate"), (trainer, "log_samples"),
                        (trainer, "log_scores"), (trainer.checkpointer, "save"),
                        (trainer, "train")):   # train: then the way out
        setattr(owner, name, dog.after(getattr(owner, name)))
    if trainer.cfg.train.compile:
        dog.on_compilation()
    dog.start()
    return dog


def log_restart(log, step: int) -> None:
    """A relaunch by --max-restarts (or SLURM's requeue) in metrics.jsonl and TensorBoard, with its cause."""
    count = int(os.environ.get(RESTARTS) or os.environ.get("SLURM_RESTART_COUNT") or 0)
    if count:
        cause = os.environ.get(RESTART_CAUSE) or "not recorded (see the previous launch's log)"
        log.event(step, {"run/restarts": count}, {"run/restart_cause": cause})
        log.info(f"restart {count} of this run, resumed at step {step}, after: {cause}")


# ---- the relaunching launcher --------------------------------------------------------------------------------------
def run_once(command: list[str], env: dict, stopping: list) -> tuple[int, list[str]]:
    """Run the launch command in its own process group, its stderr passed through line by line; (its exit status,
    its `error: …` lines). A signal that stops a run (SIGTERM, SIGINT, SIGUSR1/2: a scheduler's preemption) is passed
    on to the whole group and noted in `stopping`; once the command has ended, whatever it left behind (a rank, a data
    worker) is killed with its group."""
    proc = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True, errors="replace",
                            start_new_session=True)
    errors: list[str] = []

    def relay():
        for line in proc.stderr:
            sys.stderr.write(line)
            sys.stderr.flush()
            if line.startswith("error:"):
                errors.append(line.strip())

    def forward(signum, frame):
        stopping.append(signum)
        os.killpg(proc.pid, signum)

    reader = threading.Thread(target=relay, daemon=True)
    reader.start()
    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)}
    try:
        code = proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        reader.join(timeout=10)
    return (128 - code if code < 0 else code), errors


def relaunch(command: list[str], max_restarts: int, backoff: float) -> int:
    """Run `command`; after a failure wait and run it again, at most `max_restarts` times. Its exit status."""
    env, restarts, in_a_row, stopping = dict(os.environ), 0, 0, []   # stopping: signals to stop the run
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):   # also while it waits to relaunch
        signal.signal(s, lambda signum, frame: stopping.append(signum))
    while True:
        started = time.monotonic()
        code, errors = run_once(command, {**env, RESTARTS: str(restarts)}, stopping)
        if code == 0 or code == NO_RESTART_EXIT or stopping:
            return code
        in_a_row = 0 if time.monotonic() - started >= STABLE_S else in_a_row   # it ran a while: a new failure
        cause = errors[0].removeprefix("error:").strip() if errors else f"the launch ended with exit status {code}"
        if restarts == max_restarts:
            print(f"error: the run failed {restarts + 1} times (launch/pretrain.sh --max-restarts {max_restarts}); "
                  f"not restarting again. The last failure: {cause}", file=sys.stderr, flush=True)
            return code
        wait = min(MAX_BACKOFF_S, backoff * 2 ** in_a_row)
        restarts, in_a_row = restarts + 1, in_a_row + 1
        print(f"restart {restarts} of at most {max_restarts} in {wait:g} s, from the newest checkpoint, after: "
              f"{cause}", file=sys.stderr, flush=True)
        time.sleep(wait)
        if stopping:
            return code
        env[RESTART_CAUSE] = cause


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pretrain.supervision", description="Run a launch command and relaunch "
                                "it after a failure (a hang, a lost rank), with backoff: launch/pretrain.sh "
                                "--max-restarts N runs the DeepSpeed launcher under it.")
    p.add_argument("--max-restarts", type=int, required=True, help="relaunches at most (torchrun's --max-restarts)")
    p.add_argument("--backoff", type=float, default=10.0,
                   help=f"seconds before the first relaunch, doubled per failure in a row, at most {MAX_BACKOFF_S} "
                        "(default 10)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- the launch command and its arguments")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command or args.max_restarts < 0 or args.backoff < 0:
        p.error("give --max-restarts ≥ 0, --backoff ≥ 0 and, after --, the command to run")
    return relaunch(command, args.max_restarts, args.backoff)


if __name__ == "__main__":
    sys.exit(main())
