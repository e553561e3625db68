"""A rank's DataLoader workers (real worker processes, in this process): they read on through the rank's preemption
signals (a scheduler sends them to every process of the job), and what ends them is classed by its cause: an
exception raised in a worker by what it is, a worker killed as a lost process, never as a rank lost mid-collective."""
import itertools
import os
import signal
import subprocess
import time

import psutil
import pytest
import torch

from tests.support.runs import PY, ROOT
from tokendata.shards import DataError


class Reading(torch.utils.data.IterableDataset):
    """A worker's reading: endless, or one that raises (a damaged shard, a bug) or is killed (the OOM killer)."""

    def __init__(self, how: str = "reads"):
        self.how = how

    def __iter__(self):
        if self.how == "data error":
            raise DataError("shard /d/s3.tar has content hash 1f, the manifest says 2e")
        if self.how == "bug":
            raise ValueError("cannot reshape array of size 33 into shape (4,)")
        if self.how == "killed":
            os.kill(os.getpid(), signal.SIGKILL)
        for i in itertools.count():
            time.sleep(0.01)
            yield i


RANK = """\
import itertools, signal, sys, time
import torch
from tokendata.reading import start

class Reading(torch.utils.data.IterableDataset):
    def __iter__(self):
        for i in itertools.count():
            time.sleep(0.01)
            yield i

batches = start(torch.utils.data.DataLoader(Reading(), batch_size=None, num_workers=2),
                (signal.SIGTERM, signal.SIGUSR1))
next(batches)
print(signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, []), flush=True)
sys.stdin.readline()                      # the scheduler's signals
print(len([next(batches) for _ in range(20)]), flush=True)
"""   # and it exits with its loader open: multiprocessing ends the workers (terminate(): SIGTERM from the rank)


def test_loader_workers_read_on_through_the_rank_s_preemption_signals():
    rank = subprocess.Popen([PY, "-c", RANK], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert rank.stdout.readline() == "False\n"   # blocked in the rank only while its workers started
    workers = psutil.Process(rank.pid).children()
    assert len(workers) == 2
    for name in ("TERM", "USR1"):                # from another process, as a scheduler sends them
        subprocess.run(["kill", f"-{name}", *(str(p.pid) for p in workers)], check=True)
    time.sleep(0.5)
    assert all(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in workers)
    rank.stdin.write("\n")
    rank.stdin.flush()
    assert rank.stdout.readline() == "20\n"      # they read on
    assert rank.wait(timeout=30) == 0            # and the rank's own SIGTERM still ends them when it exits


@pytest.mark.parametrize("how,cls,line", [
    ("data error", "config or data error", "shard /d/s3.tar has content hash 1f, the manifest says 2e"),
    ("bug", "unknown", "ValueError in a DataLoader worker: cannot reshape array of size 33 into shape (4,)"),
    ("killed", "lost rank", "a DataLoader worker of this rank died (DataLoader worker (pid")])
def test_what_ends_a_loader_worker_is_classed_by_its_cause(how, cls, line):
    """A worker's exception, which torch raises again in the rank with the worker's traceback, is a data error or an
    unknown error (relaunched, and before a lost rank in precedence: it names the launch); a worker killed is a lost
    process."""
    from pretrain.supervision.rank import classify

    with pytest.raises(Exception) as raised:
        next(iter(torch.utils.data.DataLoader(Reading(how), batch_size=None, num_workers=1)))
    got, words = classify(raised.value, None)
    assert (got.name, words[:len(line)]) == (cls, line), words
