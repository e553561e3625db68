"""Process groups for a run: torch.distributed through DeepSpeed, TP, CP and PP groups through megatron-core, and the
MPU adapter that tells DeepSpeed which ranks form the model-parallel and data-parallel groups.

Context parallelism (parallel.cp, model/context.py): the cp ranks of a group read the same samples (their data rank
is the data-parallel rank without cp, `Layout.dp_rank`) and each computes the loss of its own chunks of every
window. Their parameters are replicated like data-parallel ones, so gradients are averaged over the dp × cp ranks
(`Layout.grad_group`, DeepSpeed's data-parallel group through `MegatronMPU`), as is the logged loss: each cp rank's
loss is the mean over the same number of targets, so the mean over the cp ranks is the windows' mean.

The backend follows DeepSpeed's accelerator (NCCL on GPUs, gloo on CPU); no device is hard-coded.
"""
from __future__ import annotations

import math
import os
import pickle
import socket
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pretrain.config import TrainConfig
from model import parallel as tp
from pretrain import timeouts
from pretrain.node import node_name


@dataclass
class Layout:
    """Where this process sits: global rank, data-parallel rank and group, tensor/context/pipeline sizes, and its
    device. `dp_group` (the ranks that read different samples) and `grad_group` (the ranks whose gradients are
    averaged: dp × cp) None are the whole world (a layout without TP, CP or PP)."""
    rank: int
    world: int
    dp_rank: int
    dp: int
    tp: int
    pp: int
    grad_accum: int
    device: torch.device
    dp_group: object = None
    peers: tuple = ()    # (node name: pretrain/node.py, pid) of every rank, to name the one that is lost if a rank dies
    collective_timeout_s: float = 0.0   # C of pretrain/timeouts.py: computed once, here, for every process group
    cp: int = 1
    dp_cp_group: object = None   # megatron's data-parallel group with context parallelism, where cp > 1

    @property
    def grad_group(self):
        """The dp × cp ranks that hold the same parameters (of their TP shard and stage): `dp_group` where cp = 1."""
        return self.dp_cp_group if self.cp > 1 else self.dp_group

    @property
    def replicas(self) -> int:   # ranks of `grad_group`
        return self.dp * self.cp

    @property
    def is_main(self) -> bool:
        return self.rank == 0


# ---- the trainer's collectives -------------------------------------------------------------------------------------
class CollectiveTime:
    """Seconds this rank spent inside the trainer's collectives, for fleet health (pretrain/fleet/): a rank that
    waits here is waiting for a slower peer. On CPU the wall clock around the call (gloo returns when it is done);
    on CUDA a pair of events on the current stream around it, read with `query()` once both have completed, which
    never waits: no device synchronization is added."""

    def __init__(self):
        self.open: list = []   # (start, end) marks not yet read
        self.seconds = 0.0

    @staticmethod
    def mark(device: torch.device):
        if device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def add(self, start, end) -> None:
        if isinstance(start, float):
            self.seconds += end - start
        else:
            self.open.append((start, end))

    def take(self) -> float:
        """The seconds read since the last call (pairs whose events have not completed wait for the next)."""
        while self.open and self.open[0][1].query():
            start, end = self.open.pop(0)
            self.seconds += start.elapsed_time(end) / 1e3
        out, self.seconds = self.seconds, 0.0
        return out


COLLECTIVES = CollectiveTime()   # this process's: every collective of the trainer passes all_reduce below


def all_reduce(t: torch.Tensor, lay: Layout, op=dist.ReduceOp.SUM, group=None) -> torch.Tensor:
    """dist.all_reduce in place of a tensor that must live on the layout's device; every collective of the trainer
    goes through here. NCCL takes only CUDA tensors and gloo takes CPU ones, so a tensor built on the wrong device
    passes on one machine and crashes on the other: this check fails on both."""
    if t.device != lay.device:
        raise RuntimeError(f"collective on a tensor on {t.device}, but this rank's device is {lay.device}: "
                           f"build it with device=layout.device")
    start = COLLECTIVES.mark(t.device)
    dist.all_reduce(t, op=op, group=group)
    COLLECTIVES.add(start, COLLECTIVES.mark(t.device))
    return t


def exchange(t: torch.Tensor, peer: int, lay: Layout) -> torch.Tensor:
    """`t` sent to global rank `peer` while its tensor of the same shape comes back: both ways of a link at once
    (the check before launch, pretrain/fleet/preflight.py). Waits for both."""
    if t.device != lay.device:
        raise RuntimeError(f"exchange of a tensor on {t.device}, but this rank's device is {lay.device}")
    got = torch.empty_like(t)
    for request in dist.batch_isend_irecv([dist.P2POp(dist.isend, t, peer), dist.P2POp(dist.irecv, got, peer)]):
        request.wait()
    return got


def dp_mean(x: torch.Tensor, lay: Layout) -> torch.Tensor:
    """The mean of a scalar (a loss) over the data-parallel ranks, and over the context-parallel ranks, each of whose
    losses covers its own chunks of the same windows, as a 1-element fp32 tensor on the device (not read)."""
    return all_reduce(x.detach().float().reshape(1) / lay.replicas, lay, group=lay.grad_group)


def from_rank0(fn, lay: Layout):
    """fn() run on global rank 0 alone, its result on every rank (or the error it raised, raised on every rank): a
    decision all ranks must share, made once (which shards are good: one rank's requests, not every rank's)."""
    box, error = [None], None
    if lay.rank == 0:
        try:
            box[0] = (fn(), None)
        except Exception as e:   # handed to every rank, which raise it (as a RuntimeError if it does not pickle)
            error = e
            try:
                box[0] = (None, pickle.loads(pickle.dumps(e)))
            except Exception:
                box[0] = (None, RuntimeError(f"{type(e).__name__}: {e}"))
    dist.broadcast_object_list(box, src=0, device=lay.device)
    if box[0][1] is not None:
        raise error or box[0][1]
    return box[0][0]


def free_local_port() -> int:
    """A TCP port free on 127.0.0.1 now: for a process group of this host's processes that must not meet another
    job's (launch/pretrain.sh's default 29500 is taken by any other run on the machine)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dp_sum(counts: list[int], lay: Layout) -> torch.Tensor:
    """Counts, each summed over the data-parallel ranks, on the device (not read)."""
    return all_reduce(torch.tensor([float(c) for c in counts], device=lay.device), lay, group=lay.dp_group)


def dp_union(names: set[str], lay: Layout) -> set[str]:
    """The union of a set of names over the data-parallel ranks (rare: bad shards two ranks may both find)."""
    gathered = [None] * lay.dp
    dist.all_gather_object(gathered, sorted(names), group=lay.dp_group)
    return set().union(*map(set, gathered))


def every_rank(obj) -> list:
    """`obj` of every rank of the world, in rank order, on every rank: for rare, small answers (why each rank's
    checkpoint write failed; whether each rank's upload succeeded and what it uploaded, checkpoints/bucket.py), not
    for a step's numbers."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def any_rank(flags: list[bool], lay: Layout) -> torch.Tensor:
    """Per flag, 1.0 where it is set on any rank of the world, else 0.0: a tensor on the device (not read)."""
    t = torch.tensor([float(f) for f in flags]).to(lay.device, non_blocking=True)
    return all_reduce(t, lay, op=dist.ReduceOp.MAX)


def step_outcome(loss: torch.Tensor, count: torch.Tensor, flags: list[bool], lay: Layout) -> torch.Tensor:
    """What a training step ends with, as one tensor on the device for one read by the host:
    [loss's mean over the DP ranks, a count this rank holds (the same on all), each flag set on any rank]."""
    return torch.cat([dp_mean(loss, lay), count.float().reshape(1), any_rank(flags, lay)])


class MegatronMPU:
    """DeepSpeed's `mpu` interface over megatron-core's parallel_state (the Megatron-DeepSpeed pattern).

    "Model parallel" here is tensor parallel: DeepSpeed reduces gradients over the data-parallel group, counts
    replicated parameters once in the gradient norm, and names checkpoint files by the model-parallel rank. Its
    "data parallel" is dp × cp (megatron's group with context parallelism): the cp ranks hold the same parameters,
    and each one's gradient is of its own chunks' loss, so the gradient is their mean, as over dp ranks (ZeRO
    partitions over the same ranks).
    """

    def __init__(self):
        from megatron.core import parallel_state

        self.ps = parallel_state

    def get_model_parallel_rank(self):
        return self.ps.get_tensor_model_parallel_rank()

    def get_model_parallel_world_size(self):
        return self.ps.get_tensor_model_parallel_world_size()

    def get_model_parallel_group(self):
        return self.ps.get_tensor_model_parallel_group()

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_tensor_model_parallel_src_rank(self):
        return self.ps.get_tensor_model_parallel_src_rank()

    def get_data_parallel_rank(self):
        return self.ps.get_data_parallel_rank(with_context_parallel=True)

    def get_data_parallel_world_size(self):
        return self.ps.get_data_parallel_world_size(with_context_parallel=True)

    def get_data_parallel_group(self):
        return self.ps.get_data_parallel_group(with_context_parallel=True)

    def get_pipeline_model_parallel_world_size(self):
        return self.ps.get_pipeline_model_parallel_world_size()


def _single_process_env() -> None:
    """A bare `python -m pretrain.train` (no launcher) runs as a world of one."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_local_port()))


def _release_shm_segment_name() -> None:
    """Unlink the name of DeepSpeed's CPU shared-memory all-reduce segment once every rank has mapped it.

    On CPU, DeepSpeed creates /dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank> (69 MB per rank) and
    never unlinks it, so every run leaks RAM until the machine runs out. Once all ranks have opened each other's
    segments (done inside init_distributed, hence the barrier), the names can go: the mappings stay valid, and the
    memory is freed when the processes exit, even on kill -9.
    """
    name = "/dev/shm/deepspeed_allreduce_buffer_{}_{}_{}_{}".format(
        os.getuid(), os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", ""), dist.get_rank())
    if os.environ.get("LOCAL_SIZE") == os.environ.get("WORLD_SIZE"):    # DeepSpeed's own condition for using shm
        dist.barrier()
        if os.path.exists(name):
            os.unlink(name)


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to keep freed memory in the process instead of returning it to the kernel.

    By default every block over 32 MB is its own mmap, unmapped on free: a training step that allocates and frees
    the same big tensors (n² gradients, activations) page-faults them back in every step. Measured on the CPU
    machine (d=512, 8 layers, n=1024): gMLP step 5.6 → 4.5 s, dot 5.7 → 5.4 s. What CUDA's caching allocator does
    for GPU memory, at a price: freed memory stays resident, and what the heap fragments too (at n=4096 the
    resident peak of a dot step is ~1.8× its live tensors). Off glibc a no-op (False).
    """
    import ctypes
    import ctypes.util

    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4   # mallopt(3) parameter numbers, from glibc's malloc.h
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        # no mmap'd blocks (all from the heap), and no trimming of any arena's top (-1: mallopt(3) "disables
        # trimming completely"; a 2 GB threshold still let some gMLP processes give back and re-fault ~1 GB a step)
        return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, -1))
    except (OSError, AttributeError):   # not glibc
        return False


def world_size() -> int:
    """Ranks of this launch (1 for a bare `python -m pretrain.train`)."""
    _single_process_env()
    return int(os.environ["WORLD_SIZE"])


def init(cfg: TrainConfig) -> Layout:
    """Check the config against the launch, then start torch.distributed, and megatron-core's groups where the layout
    has tensor, context or pipeline parallelism. A data-parallel layout (TP = CP = PP = 1) needs none of them: its
    data-parallel group is the world, the model's layers are plain torch ones, and megatron-core is not even imported
    (seconds of every rank's start)."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    _single_process_env()
    world = int(os.environ["WORLD_SIZE"])
    runtime = cfg.check_runtime(world)          # one-line errors before any process group exists
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    accel = get_accelerator()
    if accel.device_name() != "cpu":
        accel.set_device(local_rank)
    else:   # ranks on one host share its cores
        local = int(os.environ.get("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", 1)))
        threads = os.environ.get("OMP_NUM_THREADS")   # the user's choice (torchrun sets 1), else a share each
        torch.set_num_threads(int(threads) if threads else max(1, (os.cpu_count() or 1) // max(1, local)))
        if cfg.parallel.cpu_keep_freed_memory:
            keep_freed_memory()
    # C, computed once (pretrain/timeouts.py) and kept in the layout: given to the groups made here, then set exactly
    # on those that took another (megatron rounds to minutes, some groups take none); the groups the engine makes
    # later get it in supervision/rank.py's `supervise`, from the layout
    timeout = timeouts.as_timedelta(timeouts.collective_timeout(cfg.train))
    deepspeed.init_distributed(dist_backend=accel.communication_backend_name(), timeout=timeout)
    if accel.device_name() == "cpu":
        _release_shm_segment_name()
    p = cfg.parallel
    dp_rank, dp_group, dp_cp_group = dist.get_rank(), None, None   # TP = CP = PP = 1: the world is the DP group
    if p.tp > 1 or p.cp > 1 or p.pp > 1:
        from megatron.core import parallel_state

        # megatron's rank order (tp fastest, then cp, dp, pp) is DeepSpeed's PipeModelDataParallelTopology's, its
        # data axis dp × cp wide (pretrain/pipeline.py build_pipeline)
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=p.tp, context_parallel_size=p.cp,
                                                 pipeline_model_parallel_size=p.pp,
                                                 distributed_timeout_minutes=math.ceil(timeout.total_seconds() / 60))
        # the data rank is the DP rank without cp: a cp group's ranks read the same samples
        dp_rank, dp_group = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_group()
        dp_cp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    tp.set_sequence_parallel(cfg.parallel.sequence_parallel and cfg.parallel.tp > 1)   # before any model is built
    timeouts.agree(timeout.total_seconds())
    device = torch.device(accel.current_device_name())
    peers = [None] * world
    dist.all_gather_object(peers, (node_name(), os.getpid()))
    return Layout(rank=dist.get_rank(), world=world, dp_rank=dp_rank, dp=runtime.dp, tp=p.tp, pp=p.pp,
                  grad_accum=runtime.grad_accum, device=device, dp_group=dp_group, peers=tuple(peers),
                  collective_timeout_s=timeout.total_seconds(), cp=p.cp, dp_cp_group=dp_cp_group)


# What a rank sees when another one dies mid-collective (gloo, NCCL), or when the launcher then ends its data workers
# ("DataLoader worker (pid 4242) is killed by signal: …"). An exception raised in a worker ("Caught ValueError in
# DataLoader worker process 0 …") is none: the supervision classes it by its cause (supervision/rank.py classify).
LOSS_GRACE_S = 3.0   # how long a rank that saw a peer's connection drop waits to see that peer's process gone
PEER_LOSS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Socket Timeout",
             "NCCL communicator was aborted", "DataLoader worker (pid")


def is_peer_loss(e: BaseException) -> bool:
    """Whether `e`, or what it arose from, is what a rank sees when another one died (see PEER_LOSS)."""
    seen = e
    while seen is not None:
        if any(needle in str(seen) for needle in PEER_LOSS):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def lost_peer(e: BaseException, lay: Layout) -> str | None:
    """If `e` (or what it arose from) is a collective that failed because another rank died: one line naming the
    lost ranks (those of this host whose process is gone; others are not visible from here) and what to do."""
    if not is_peer_loss(e):
        return None
    here = node_name()
    deadline = time.monotonic() + LOSS_GRACE_S
    while True:   # a killed rank's sockets close before its process is gone: give it a moment to be seen gone
        lost = [r for r, (host, pid) in enumerate(lay.peers) if host == here and r != lay.rank and not _alive(pid)]
        if lost or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    who = (f"rank {', '.join(map(str, lost))} (its process is gone: killed, or out of memory)" if lost else
           "another rank (on another host, or still stopping)")
    return (f"lost {who} in the middle of a step; relaunch the same command to resume from the newest "
            f"checkpoint")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # someone else's process under that number: not ours, so ours is gone
        return False
    try:   # a zombie (dead, not yet reaped by the launcher) still answers kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except (OSError, IndexError):   # no /proc here (macOS): alive as far as this host can tell
        return True


def shutdown() -> None:
    parallel_state = sys.modules.get("megatron.core.parallel_state")   # imported only by a TP, CP or PP layout
    if parallel_state is not None and parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if not dist.is_initialized():
        return
    import deepspeed.comm as ds_comm

    if ds_comm.is_initialized():   # DeepSpeed's own destroy also drops its copies of the groups (its clone of the
        ds_comm.destroy_process_group()   # world, which a DP layout's engine uses), or the next init would find them
    else:
        dist.destroy_process_group()
