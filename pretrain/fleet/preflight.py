"""The check before launch: a fixed GEMM timed on every rank, a two-way exchange timed over every link, and the
ranks and links well below the median named with their figures.

    GEMM      C = A·B of n × n matrices (n = 4096 in bf16 on a GPU, 384 in fp32 on a CPU), the best of `repeats`
              timed runs on every rank at once (thermal throttling shows under load; on CPU the ranks of a host share
              its cores and take turns), as TFLOP/s = 2n³ / time. A rank below fleet.gpu_floor (0.9) × the
              median is named.
    links     a node pair exchanges a tensor of `mb` MiB both ways at once (pretrain/distributed.py `exchange`), best of
              `repeats`, as GB/s each way. Every pair of nodes (their first ranks), in rounds of disjoint pairs (the
              circle method: n − 1 rounds for n nodes); on one host, every pair of ranks, one pair at a time. A link below
              fleet.link_floor (0.8) × the median is named.

A pass that names something is run again (`confirm` passes more, 1 by default) and each figure taken as its best
over the passes, so a passing load names nothing and a slow device is named in every pass.

Timing waits for the device by reading the result (a host read; the check runs before any step). The figures are
gathered to rank 0 in one all-reduce; every rank gets the verdict, so all exit alike.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from pretrain import distributed
from pretrain.distributed import Layout
from pretrain.faults import Faults
from pretrain.fleet.detector import Place, places

Figures = tuple[list[float], dict[tuple[int, int], float]]   # every rank's GEMM TFLOP/s, every link's GB/s


def gemm_size(device: torch.device) -> tuple[int, torch.dtype]:
    return (384, torch.float32) if device.type == "cpu" else (4096, torch.bfloat16)


def best_of(repeats: int, work) -> float:
    """The shortest of `repeats` timed runs of `work()` (which returns a device tensor, read to wait for it)."""
    times = []
    for _ in range(repeats + 1):   # the first run warms up (allocations, kernels' first launch) and is not counted
        began = time.perf_counter()
        float(work().reshape(-1)[0])
        times.append(time.perf_counter() - began)
    return min(times[1:])


def gemm_tflops(lay: Layout, repeats: int, faults: Faults) -> float:
    n, dtype = gemm_size(lay.device)
    g = torch.Generator(device=lay.device).manual_seed(0)
    a, b = (torch.randn(n, n, device=lay.device, dtype=dtype, generator=g) for _ in range(2))

    def work():
        faults.slow(lambda: a @ b, 1)   # a test's slow GPU (SYNTHFORMER_FAULTS=slow@1@RANK); nothing by default
        return a @ b
    return 2 * n ** 3 / best_of(repeats, work) / 1e12


def units(where: list[Place]) -> list[int]:
    """The ranks whose links are timed: the first rank of each host; on one host, every rank."""
    firsts = {}
    for rank, p in enumerate(where):
        firsts.setdefault(p.host, rank)
    return list(firsts.values()) if len(firsts) > 1 else list(range(len(where)))


def rounds(n: int) -> list[list[tuple[int, int]]]:
    """Every pair of n items once, in n − 1 rounds (n rounds for an odd n) of disjoint pairs (the circle method)."""
    items = list(range(n)) + ([None] if n % 2 else [])
    out = []
    for _ in range(len(items) - 1):
        half = len(items) // 2
        out.append([tuple(sorted((a, b))) for a, b in zip(items[:half], reversed(items[half:]))
                    if a is not None and b is not None])
        items = [items[0], items[-1], *items[1:-1]]
    return out


def schedule(members: list[int], where: list[Place]) -> list[list[tuple[int, int]]]:
    """The rounds of pairs (indices into members): disjoint node pairs at once across nodes (each has its own NICs);
    on one host one pair at a time (its pairs share the host's memory and cores, and would time each other)."""
    if len({where[m].host for m in members}) > 1:
        return rounds(len(members))
    return [[pair] for pairs in rounds(len(members)) for pair in pairs]


def link_gbps(lay: Layout, members: list[int], mb: float, repeats: int) -> torch.Tensor:
    """[len(members)]² GB/s each way, filled where this rank took part (the others gather it)."""
    table = torch.zeros(len(members), len(members))
    t = torch.ones(int(mb * 2 ** 20) // 4, device=lay.device)
    for pairs in schedule(members, places(lay.peers)):
        together(lay)   # a round's pairs start together: a rank still busy (a slow GEMM, the last round) skews none
        for a, b in pairs:
            if lay.rank in (members[a], members[b]):
                peer = members[b] if lay.rank == members[a] else members[a]
                table[a, b] = t.numel() * 4 / best_of(repeats, lambda: distributed.exchange(t, peer, lay)) / 1e9
    return table


def together(lay: Layout) -> None:
    """Every rank here before any goes on (a one-element all-reduce, waited for)."""
    float(distributed.all_reduce(torch.zeros(1, device=lay.device), lay)[0])


def named(rates: list[float], floor: float, what) -> list[str]:
    """A phrase for each rate below floor × the median: `what(i)` names item i."""
    median = statistics.median(rates)
    return [f"{what(i)} {r:.3g} ({r / median:.0%} of the median {median:.3g})" for i, r in enumerate(rates)
            if r < floor * median]


def verdict(gemm: list[float], links: dict[tuple[int, int], float], where: list[Place], gpu_floor: float,
            link_floor: float) -> tuple[str, bool]:
    """(one line, whether anything was named) from every rank's GEMM TFLOP/s and every link's GB/s."""
    slow = named(gemm, gpu_floor, lambda r: f"rank {r} (host {where[r].host}, GPU {where[r].gpu}) GEMM TFLOP/s")
    pairs = list(links)
    slow += named([links[p] for p in pairs], link_floor, lambda i: f"link rank {pairs[i][0]} ↔ rank {pairs[i][1]} "
                                                                   f"({where[pairs[i][0]].host} ↔ "
                                                                   f"{where[pairs[i][1]].host}) GB/s")
    if slow:
        return "preflight: slow: " + "; ".join(slow), True
    span = lambda xs: f"{min(xs):.3g}–{max(xs):.3g}" if xs else "none"
    return (f"preflight: {len(gemm)} ranks even (GEMM TFLOP/s {span(gemm)}, none below {gpu_floor:.0%} of the "
            f"median); {len(links)} links even (GB/s {span(list(links.values()))}, none below {link_floor:.0%})"), False


def measure(lay: Layout, members: list[int], mb: float, repeats: int, faults: Faults) -> Figures:
    """One pass: every rank's GEMM TFLOP/s and every link's GB/s, the same on every rank."""
    gemm = torch.zeros(lay.world)
    # GPUs are timed all at once (throttling shows under load); a CPU host's ranks share its cores, so they take turns
    for turn in range(lay.world) if lay.device.type == "cpu" else [lay.rank]:
        together(lay)
        if turn == lay.rank:
            gemm[lay.rank] = gemm_tflops(lay, repeats, faults)
    links = link_gbps(lay, members, mb, repeats)
    both = distributed.all_reduce(torch.cat([gemm, links.reshape(-1)]).to(lay.device), lay).tolist()
    table, n = both[lay.world:], len(members)
    rates = {(members[a], members[b]): table[a * n + b] / 2 for pairs in rounds(n) for a, b in pairs}   # both ends
    return both[:lay.world], rates


def confirmed(one_pass: Callable[[], Figures], judge: Callable[[Figures], tuple[str, bool]],
              confirm: int) -> tuple[str, bool]:
    """Judge `one_pass()`'s figures; while it names something, up to `confirm` passes more, each figure then its
    best over the passes so far: a load that passed over a host during one pass (another job's burst, a page-cache
    flush) names nothing, while a slow GPU or link is slow in every pass and is still named."""
    gemm, rates = one_pass()
    line, slow = judge((gemm, rates))
    passes = 1
    while slow and passes <= confirm:
        gemm_again, rates_again = one_pass()
        gemm = [max(a, b) for a, b in zip(gemm, gemm_again)]
        rates = {pair: max(rate, rates_again[pair]) for pair, rate in rates.items()}
        line, slow = judge((gemm, rates))
        passes += 1
    return (f"{line} (the best of {passes} passes)" if passes > 1 else line), slow


def check(lay: Layout, gpu_floor: float, link_floor: float, mb: float = 4.0, repeats: int = 10,
          faults: Faults | None = None, confirm: int = 1) -> tuple[str, bool]:
    """Run the check on every rank of the layout: (the verdict's line, whether a rank or link was named), the same
    on every rank (the figures are gathered before each judgement, so every rank runs the same passes). A pass that
    names something is confirmed by up to `confirm` passes more (`confirmed`); an even first pass costs no second."""
    where = places(lay.peers)
    members = units(where)
    faults = faults or Faults.from_environment(lay.rank)
    return confirmed(lambda: measure(lay, members, mb, repeats, faults),
                     lambda figures: verdict(*figures, where, gpu_floor, link_floor), confirm)
