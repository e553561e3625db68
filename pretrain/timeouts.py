"""Timeouts that agree: every process group of a run waits in a collective for the same time, C, and C is longer than
the hang watchdog's train.hang_timeout, H, so that on a hang the watchdog acts first, on every rank: it writes the
stacks and the flight recorder's dump that name the stuck rank, which a collective's timeout (NCCL aborting the waiting
ranks) would cut short.

    C = train.collective_timeout, or H + MARGIN_S where it is null; 1800 s where H is null too
    C > H + MIN_MARGIN_S (a config error otherwise): the watchdog's backstop, faulthandler's C thread, acts at
        H + 60 s where the Python watchdog cannot run; a rank waiting in a collective entered it after its last
        heartbeat, so its watchdog expires before the collective has waited H.

The groups and where each gets C: the world group (deepspeed.init_distributed's `timeout`, whose own default is
10 minutes, DEEPSPEED_TIMEOUT), megatron-core's TP, PP, DP and model-parallel groups (initialize_model_parallel's
`distributed_timeout_minutes`, default 30, rounded up to whole minutes), and the groups DeepSpeed makes itself with
no timeout at all (the pipeline grid's stage, data-parallel, slice and p2p groups, the tied-weights groups: torch's
backend default, 10 minutes on NCCL, 30 on gloo). C is computed once, by distributed.init, and kept in the rank's
Layout; `agree(C)` sets each group of the rank that waits another time to exactly C (torch's `_set_pg_timeout`, per
group) and reads every group back: at distributed.init for the groups made there, and once the engine is built
(supervision/rank.py `supervise`) for the groups DeepSpeed made.

A checkpoint save watched by the watchdog (train.hang_timeout set) raises every group to SAVE_S while it runs and sets
C again after (`raised`, supervision/saves.py): its barriers, the checkpointer's and DeepSpeed's, wait for a slow
writer as long as the save moves; the watchdogs end one that stops (no rank's own files grow for H).

With train.hang_timeout null there is no watchdog: a hang ends when a collective times out after C (1800 s by
default). On NCCL the waiting ranks' communicators are aborted and, with TORCH_NCCL_DUMP_ON_TIMEOUT (set by
launch/pretrain.sh), each writes its flight recorder to <run_dir>/hang/flight_recorder/; on gloo the collective raises.
Either way the rank ends in the class `hang` (classes.py) and is relaunched, without the stacks of the stuck rank.
"""
from __future__ import annotations

import contextlib
import datetime

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

MARGIN_S = 120            # C - H where train.collective_timeout is null
MIN_MARGIN_S = 60         # the least C - H: the watchdog's faulthandler backstop (watchdog.BACKSTOP_S)
WITHOUT_WATCHDOG_S = 1800
SAVE_S = 24 * 3600        # what a collective waits during a watched save: a bound where no watchdog can act


def collective_timeout(train) -> float:
    """C, in seconds, for a config's `train` section."""
    if train.collective_timeout is not None:
        return float(train.collective_timeout)
    return WITHOUT_WATCHDOG_S if train.hang_timeout is None else train.hang_timeout + MARGIN_S


def as_timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def groups() -> list:
    """Every process group this rank belongs to, the world's first (torch's registry of groups)."""
    if not dist.is_initialized():
        return []
    return list(c10d._world.pg_map)


def describe(group) -> str:
    """'<name> (<description>, ranks a-b)': torch's group name (the same on every rank), the description its maker
    gave (megatron-core names its groups), and its global ranks."""
    ranks = sorted(c10d._world.pg_group_ranks.get(group, {}))
    span = f"{ranks[0]}-{ranks[-1]}" if ranks and ranks == list(range(ranks[0], ranks[-1] + 1)) else \
        ",".join(map(str, ranks))
    return f"{group.group_name} ({getattr(group, 'group_desc', '') or 'undefined'}, ranks {span})"


def group_timeout(group) -> float:
    """The timeout, in seconds, a group's backends wait in a collective (the longest, where it has several)."""
    longest = 0.0
    for device in (torch.device("cpu"), torch.device("cuda")):
        try:
            backend = group._get_backend(device)
        except (RuntimeError, ValueError):
            continue
        options = getattr(backend, "options", None)
        if options is not None:
            longest = max(longest, options._timeout.total_seconds())
    return longest


def agree(seconds: float) -> dict[str, float]:
    """Set every process group of this rank that waits another time to `seconds` (each group is set once: at
    distributed.init those made there, once the engine is built those it made); {group: its timeout read back}."""
    for group in groups():
        if group_timeout(group) != seconds:
            c10d._set_pg_timeout(as_timedelta(seconds), group)
    return {describe(g): group_timeout(g) for g in groups()}


@contextlib.contextmanager
def raised(seconds: float, after: float):
    """Every process group of this rank waits `seconds` in a collective inside the block, `after` again once it
    ends (where the block raised, a group that cannot be set back is left: the error is the block's)."""
    for group in groups():
        c10d._set_pg_timeout(as_timedelta(seconds), group)
    try:
        yield
    except BaseException:
        with contextlib.suppress(Exception):
            agree(after)
        raise
    agree(after)


def collectives_entered() -> dict[str, dict]:
    """Per process group of this rank: its description, timeout and how many collectives this rank has entered (what
    the hang records compare across ranks: classes.culprit)."""
    out = {}
    for group in groups():
        try:
            entered = group._get_sequence_number_for_group()
        except RuntimeError:
            continue
        out[group.group_name] = {"desc": describe(group), "timeout_s": group_timeout(group), "entered": entered}
    return out


def words(timeouts: dict[str, float], hang_timeout: float | None) -> str:
    """One line for the log: how many groups, and their timeout."""
    values = sorted(set(timeouts.values()))
    each = f"each with a {values[0]:g} s timeout" if len(values) == 1 else \
        f"with timeouts {', '.join(f'{v:g}' for v in values)} s"
    watchdog = (f"train.hang_timeout {hang_timeout:g} s acts first" if hang_timeout is not None else
                "no hang watchdog (train.hang_timeout null): a hang ends when a collective times out")
    return f"process groups: {len(timeouts)} on this rank, {each} (train.collective_timeout); {watchdog}"
