"""Trainer ranks forked from a warm process: the tests' way to start the ranks of one job without paying each rank's
Python start (torch, torch._dynamo, DeepSpeed and the project: ~6-7 s of a core a rank on the CI's machine).

A launcher starts each rank as `python -m pretrain.train CONFIG ...` in a fresh interpreter (launch/pretrain.sh does
the same in a rank that a scheduler started). Here a multiprocessing forkserver imports those modules once per test
process (PRELOAD); each rank is a real process forked from it, in its own session, with the job's environment, its
stdout and stderr in files, and `pretrain.train.main` run as `python -m` runs it: the same argv, SystemExit's code as
the exit status, an uncaught exception's traceback on stderr and status 1, non-daemon threads and atexit handlers
finished before it exits. Ranks meet over real torch.distributed (gloo) as launched ones do.

What a forked rank shares that fresh ones do not: the forkserver's modules as imported with its environment (a
variable read at import time takes the test process's value, not the job's: launch/pretrain.sh's exports are set
before the rank runs, see RANK_ENV), and Python's string-hash seed (every rank hashes alike, where fresh interpreters
differ). The tests that need a launcher's own processes (killed by pid, found by command line, the launcher's exit
status) start them through it (tests/support/runs.py launch(launcher=True)); SYNTHFORMER_TEST_FRESH_RANKS=1 starts every
rank fresh.
"""
from __future__ import annotations

import atexit
import faulthandler
import multiprocessing
import os
import runpy
import signal
import sys
import threading
import traceback

# The trainer's modules, and what a rank imports later on its way to the first step (~1,000 modules, 3-4 s of a core
# a rank): inductor (DeepSpeed's ZeRO optimizer check imports its Muon module, which compiles at import), TensorBoard's
# writer, and the torch.distributed modules that megatron imports. Not megatron itself: it imports wandb, whose import
# makes a temporary folder that an atexit handler removes, and every rank forked from a server holding it would run
# that handler (the first rank to end removed the folder under the others: FileNotFoundError in wandb.Image). A module
# missing from this torch is skipped (the forkserver ignores an ImportError in its preload).
PRELOAD = ["pretrain.train", "pretrain.engine", "deepspeed", "torch._inductor.compile_fx", "torch.utils.tensorboard",
           "torch.distributed.checkpoint", "torch.distributed.tensor", "torch.utils.cpp_extension"]
# What launch/pretrain.sh exports before it runs a rank in place (its defaults): the flight recorder's buffer and dump
RANK_ENV = {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
_context = None


def fresh() -> bool:
    """Start every rank as a fresh interpreter instead (SYNTHFORMER_TEST_FRESH_RANKS=1)."""
    return os.environ.get("SYNTHFORMER_TEST_FRESH_RANKS", "") not in ("", "0")


def context():
    """The forkserver context, its server importing PRELOAD once (started on the first rank, per test process)."""
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def _run(target: str, argv: list[str], env: dict, cwd: str, out: str, err: str) -> None:
    """In the forked process: become `python -m target argv` (a module's main(), or a package's __main__), or
    `python target argv` (a .py script, run as __main__), with env in cwd, writing to the files out and err."""
    os.setsid()   # its own process group, as tests/support/runs.py starts fresh ranks: a timeout kills its workers too
    multiprocessing.set_start_method(None, force=True)   # a forkserver's child defaults to it: the platform's again
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)
    sys.stdin = open(os.devnull)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    faulthandler.register(signal.SIGUSR1, all_threads=True)   # `kill -USR1 PID`: every thread's stack, on stderr
    script, mod = target.endswith(".py"), None
    if script:
        sys.argv, sys.path[0] = [target, *argv], os.path.dirname(os.path.abspath(target))
    else:
        mod = __import__(target, fromlist=["main"])
        sys.argv = [mod.__file__, *argv]
    code = 1
    try:
        if script:
            runpy.run_path(target, run_name="__main__")
            code = 0
        elif callable(getattr(mod, "main", None)):   # `python -m pretrain.train`: its main(), as its __main__ guard
            code = mod.main()
        else:   # a package's __main__.py (`python -m pretrain.config`)
            runpy.run_module(target, run_name="__main__", alter_sys=True)
            code = 0
    except SystemExit as e:
        code = e.code
    except BaseException:   # noqa: BLE001  as the interpreter does: the traceback, then status 1
        traceback.print_exc()
        code = 1
    finally:   # what the interpreter does at exit, in its order (multiprocessing's child would os._exit instead):
        threading._shutdown()   # threading's exit hooks (executors stop their workers), then join non-daemon threads
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    sys.exit(code)


class Rank:
    """A forked rank with subprocess.Popen's pid, poll(), wait() and returncode (negative: ended by that signal)."""

    def __init__(self, target: str, argv: list[str], env: dict, cwd: str, out, err):
        self.process = context().Process(target=_run, args=(target, list(argv), env, cwd, out.name, err.name))
        self.process.start()
        self.pid = self.process.pid

    @property
    def returncode(self):
        return self.process.exitcode

    def poll(self):
        return self.process.exitcode

    def wait(self, timeout=None):
        self.process.join(timeout)
        return self.process.exitcode


def start(target: str, argv: list[str], env: dict, cwd: str, out, err) -> Rank:
    """One process of `python -m target argv` (or of the script `python target argv`) under env ({**os.environ, ...}
    as a launcher gives it) in cwd, its stdout and stderr into the named files out and err. (multiprocessing also
    imports the test process's __main__ file in the rank, as `__mp_main__`: pytest's is guarded; a script that starts
    ranks needs `if __name__ == "__main__"`.)"""
    return Rank(target, argv, {**RANK_ENV, **env}, cwd, out, err)
