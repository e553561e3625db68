#!/usr/bin/env python
"""Context parallelism (model/context.py) measured on the CPU: memory per rank, bytes sent, and throughput.

    PYTHONPATH=. python benchmarks/bench_context.py [--cps 1,2,4] [--n 4096] [--n-time 2048] [--json]

One launch of cp gloo processes per cp size (one thread each), each running the model's forward and backward under
`context.loss`, as tests/distributed/test_context_parallel.py does, on random tokens (micro-batch 1; the model of
configs/demo-cpu.yaml at d 128, 4 heads, 2 layers, vocabulary 512, fp32, no dropout). Measured per rank:

  memory     at n (--n): the peak resident memory of one forward + backward above the process just before it, the
             gradients already allocated by a warm-up step (resident set less the pages of mapped files, the
             kernel's high-water mark reset before the step: benchmarks/bench_memory.py cpu_memory_mb; malloc
             returns every freed block over 64 kB, bench_points.py LIVE_MEMORY_ENV, so freed memory is not counted
             as resident), and the bytes the step's autograd graph saves for backward (each storage once, parameters
             and their views left out: torch.autograd.graph.saved_tensors_hooks). Beside them the memory plan's
             activations (pretrain/plan/memory.py: kept, and kept + the largest temporary) of the same layout. cp 1
             runs twice: `context.loss` on a group of one (the materialized path, two chunks) and the model's own
             fused forward (what a run without cp does).
             Goals: activations at cp ÷ at cp 1 within 10% of 1/cp; the plan within 15% of the measured peak.
  bytes      sent by cp per step and rank, for dense (a synthesizer) and dot at n: torch.distributed's all_gather,
             all_gather_into_tensor, all_reduce and reduce_scatter wrapped at module level in the measuring processes
             (a counting function around each, nothing inside torch changed), each call's ring traffic per rank:
             all-gather (r − 1)·input, all-reduce 2·(r − 1)/r·size, reduce-scatter (r − 1)/r·input. Beside it the
             formula (pretrain/plan/context_parallel.py sent_per_step: forward 2 rounds · (cp − 1)·B·s·F·a a layer,
             backward as much by a reduce-scatter; gloo all-reduces the stacked gradients instead, twice that).
             Goal: dense ÷ dot = 0.5, and each figure equal to its formula.
  throughput at --n-time: tokens/s of the job (B·n per step ÷ the slowest rank's step) at cp 2 ÷ cp 1
             (`context.loss` on one process, and the fused forward), the median of --steps steps after a warm-up;
             and the same ratio by the slowest rank's process CPU time, what the job would take with a core a rank
             and the communication free. The processes share this machine's cores with whatever else runs (the
             load average is in the output). No goal: the issue asks for the figure.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

MODEL = ["model.vocab_size=512", "model.d_model=128", "model.n_heads=4", "model.n_layers=2", "model.dropout=0.0",
         "train.micro_batch_size=1", "train.global_batch_size=1", "parallel.zero_stage=0"]
LIVE_MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}   # bench_points.py's
COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_reduce", "reduce_scatter")
MB = 2**20
CHECKED = ("dense", "dot", "random", "factorized_random", "factorized_dense", "sgu", "random+dot", "dense+dot")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cps", default="1,2,4", help="cp sizes, one launch each (default 1,2,4; 1 is always run)")
    p.add_argument("--n", type=int, default=4096, help="sequence length of the memory and bytes points (4096)")
    p.add_argument("--n-time", type=int, default=2048, help="sequence length of the throughput points (2048)")
    p.add_argument("--steps", type=int, default=3, help="timed steps of each throughput point (3)")
    p.add_argument("--reps", type=int, default=2, help="memory repetitions, the median kept (2)")
    p.add_argument("--check-n", type=int, default=256, help="sequence length of the saved-bytes check of every "
                   "variant at micro-batch 2 (256)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return p.parse_args(argv)


def config(mixer: str, n: int, cp: int):
    from pretrain.config import load_config

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return load_config(os.path.join(root, "configs", "demo-cpu.yaml"),
                       MODEL + [f"model.mixer={mixer}", f"model.max_seq_len={n}", f"parallel.cp={cp}"])


# ---- inside a measuring process ----------------------------------------------------------------------------------
class Sent:
    """Ring traffic per rank of the collectives called while `on`, by name: a counting wrapper around each of
    torch.distributed's functions, installed in this process only."""

    def __init__(self):
        import torch.distributed as dist

        self.on, self.bytes = False, {}
        for name in COLLECTIVES:
            setattr(dist, name, self.wrap(name, getattr(dist, name)))

    def wrap(self, name, fn):
        import torch.distributed as dist

        def counted(*args, **kwargs):
            if self.on:
                group = kwargs.get("group")
                r = dist.get_world_size(group)
                if name in ("all_gather", "all_gather_into_tensor"):
                    sent = (r - 1) * args[1].nbytes
                elif name == "all_reduce":
                    sent = 2 * (r - 1) * args[0].nbytes // r
                else:
                    sent = (r - 1) * sum(t.nbytes for t in args[1]) // r
                self.bytes[name] = self.bytes.get(name, 0) + sent
            return fn(*args, **kwargs)
        return counted


def saved_bytes(model):
    """A context manager and its count: the bytes autograd saves for backward, each storage once, parameters (and
    views of them) left out."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and t.device.type != "meta":
            seen[storage.data_ptr()] = storage.nbytes()
        return t
    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), seen


def step(model, tokens, group, fused: bool, count=None):
    from model import context

    hooks, seen = saved_bytes(model) if count else (None, None)
    if hooks:
        hooks.__enter__()
    try:
        loss = model(tokens[:, :-1], tokens[:, 1:]) if fused else context.loss(model, tokens[:, :-1], tokens[:, 1:],
                                                                               group)
    finally:
        if hooks:
            hooks.__exit__(None, None, None)
    loss.backward()
    return sum(seen.values()) if seen is not None else None


def memory_point(model, tokens, group, fused: bool, reps: int) -> dict:
    """The median over `reps` of (peak above rest, saved bytes) of one forward + backward, in MB."""
    import gc

    import torch
    import torch.distributed as dist

    from benchmarks.bench_memory import cpu_memory_mb
    from pretrain.observe.metrics import reset_peak_memory

    step(model, tokens, group, fused)   # warm-up: the gradients, the code's pages
    peaks, kept = [], []
    for _ in range(reps):
        for p in model.parameters():
            if p.grad is not None:   # (dense's key bias has none on the materialized path)
                p.grad.zero_()
        gc.collect()
        dist.barrier(group)
        rest = cpu_memory_mb()[1]
        reset_peak_memory(torch.device("cpu"))
        saved = step(model, tokens, group, fused, count=True)
        peaks.append(cpu_memory_mb()[0] - rest)
        kept.append(saved / MB)
    return {"peak_mb": round(statistics.median(peaks), 1), "saved_mb": round(statistics.median(kept), 1),
            "peaks_mb": [round(x, 1) for x in peaks]}


def time_point(model, tokens, group, fused: bool, steps: int) -> tuple[float, float]:
    """The medians over `steps` of the slowest rank's forward + backward, in seconds: wall-clock, and the CPU time of
    its process (all its threads: what the step costs a core, whatever else the machine runs)."""
    import torch
    import torch.distributed as dist

    step(model, tokens, group, fused)
    times, cpu = [], []
    for _ in range(steps):
        dist.barrier(group)
        t, c = time.perf_counter(), time.process_time()
        step(model, tokens, group, fused)
        slowest = torch.tensor([time.perf_counter() - t, time.process_time() - c])
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
        times.append(slowest[0].item())
        cpu.append(slowest[1].item())
    return statistics.median(times), statistics.median(cpu)


def measure(rank: int, cp: int, n: int, n_time: int, steps: int, reps: int, check_n: int) -> dict:
    import torch
    import torch.distributed as dist

    from model import build_model, context

    group, sent, out = dist.group.WORLD, Sent(), {"saved_by_variant": {}}
    for mixer in CHECKED:   # what one forward under context.loss saves for backward, micro-batch 2
        model = build_model(config(mixer, check_n, cp).model)
        tokens = torch.randint(model.cfg.vocab_size, (2, check_n + 1), generator=torch.Generator().manual_seed(2))
        hooks, seen = saved_bytes(model)
        with hooks:
            context.loss(model, tokens[:, :-1], tokens[:, 1:], group)
        out["saved_by_variant"][mixer] = sum(seen.values())
    for mixer in ("dense", "dot"):
        model = build_model(config(mixer, n, cp).model)
        tokens = torch.randint(model.cfg.vocab_size, (1, n + 1), generator=torch.Generator().manual_seed(0))
        if mixer == "dense":
            out["memory"] = memory_point(model, tokens, group, False, reps)
            if cp == 1:
                out["memory_fused"] = memory_point(model, tokens, group, True, reps)
            print(f"  rank {rank}: cp {cp} memory {out['memory']}", file=sys.stderr, flush=True)
        sent.on, sent.bytes = True, {}
        step(model, tokens, group, False)
        sent.on, out[f"sent_{mixer}"] = False, dict(sent.bytes)
        del model
    model = build_model(config("dense", n_time, cp).model)
    tokens = torch.randint(model.cfg.vocab_size, (1, n_time + 1), generator=torch.Generator().manual_seed(1))
    out["step_s"], out["cpu_s"] = time_point(model, tokens, group, False, steps)
    if cp == 1:
        out["step_fused_s"], out["cpu_fused_s"] = time_point(model, tokens, group, True, steps)
    print(f"  rank {rank}: cp {cp} step {out['step_s']:.3f} s", file=sys.stderr, flush=True)
    return out


def entry(rank, world, port, out_dir, args):
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = measure(rank, world, *args)
        with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def launch(cp: int, args) -> list[dict]:
    import torch.multiprocessing as mp

    from pretrain.distributed import free_local_port

    os.environ.update(LIVE_MEMORY_ENV)   # read by malloc as each process starts
    with tempfile.TemporaryDirectory(prefix="bench-context-") as out_dir:
        spec = (args.n, args.n_time, args.steps, args.reps, args.check_n)
        mp.start_processes(entry, args=(cp, free_local_port(), out_dir, spec),
                           nprocs=cp, start_method="spawn")
        out = []
        for r in range(cp):
            with open(os.path.join(out_dir, f"{r}.json")) as f:
                out.append(json.load(f))
        return out


# ---- the figures -------------------------------------------------------------------------------------------------
def planned(n: int, cp: int, fused: bool = False) -> dict:
    """The memory plan's activations of one rank, MB: kept, and kept + the largest temporary."""
    from pretrain.plan.memory import layout_of, plan

    cfg = config("dense", n, cp)
    stage = plan(cfg, layout_of(cfg, cp), device="cpu").stages[0]
    act = stage.activations
    if fused:   # cp 1 without context.loss: the plan of parallel.cp=1 is the fused path's already
        assert cp == 1
    elif cp == 1:   # the materialized path on a group of one
        from pretrain.plan.context_parallel import cp_activations
        act = cp_activations(cfg.model, 1, n, 1)
    return {"kept_mb": round(act.total / MB, 1), "peak_mb": round(act.peak / MB, 1)}


def formula(mixer: str, n: int, cp: int) -> dict:
    from pretrain.plan.context_parallel import sent_per_step

    return sent_per_step(config(mixer, n, cp).model, 1, n, cp, 1, 4)


def report(runs: dict[int, list[dict]], args) -> dict:
    cps = sorted(runs)
    base = max(r["memory"]["peak_mb"] for r in runs[1])
    rows = []
    for cp in cps:
        worst = max(runs[cp], key=lambda r: r["memory"]["peak_mb"])["memory"]
        plan_mb = planned(args.n, cp)
        rows.append({"cp": cp, "path": "context.loss", "peak_mb": worst["peak_mb"], "saved_mb": worst["saved_mb"],
                     "plan_peak_mb": plan_mb["peak_mb"], "plan_kept_mb": plan_mb["kept_mb"],
                     "ratio_to_cp1": round(worst["peak_mb"] / base, 3), "goal_ratio": round(1 / cp, 3),
                     "within_10pct_of_1_over_cp": worst["peak_mb"] / base <= 1.1 / cp,
                     "plan_error": round(plan_mb["peak_mb"] / worst["peak_mb"] - 1, 3),
                     "saved_plan_error": round(plan_mb["kept_mb"] / worst["saved_mb"] - 1, 3)})
    fused = runs[1][0]["memory_fused"]
    plan_fused = planned(args.n, 1, fused=True)
    rows.append({"cp": 1, "path": "fused (no cp)", "peak_mb": fused["peak_mb"], "saved_mb": fused["saved_mb"],
                 "plan_peak_mb": plan_fused["peak_mb"], "plan_kept_mb": plan_fused["kept_mb"],
                 "plan_error": round(plan_fused["peak_mb"] / fused["peak_mb"] - 1, 3),
                 "saved_plan_error": round(plan_fused["kept_mb"] / fused["saved_mb"] - 1, 3)})
    traffic = []
    for cp in (c for c in cps if c > 1):
        sent = {m: runs[cp][0][f"sent_{m}"] for m in ("dense", "dot")}
        for m in ("dense", "dot"):
            f = formula(m, args.n, cp)
            traffic.append({"cp": cp, "mixer": m, "forward_mb": round(sent[m].get("all_gather", 0) / MB, 3),
                            "formula_forward_mb": round(f["forward"] / MB, 3),
                            "backward_mb": round((sent[m].get("all_reduce", 0) + sent[m].get("reduce_scatter", 0))
                                                 / MB, 3),
                            "formula_backward_mb": round(f["backward"] / MB, 3),
                            "formula_backward_gloo_mb": round(2 * f["backward"] / MB, 3)})
        total = {m: sum(sent[m].values()) for m in sent}
        traffic.append({"cp": cp, "dense_over_dot": round(total["dense"] / total["dot"], 4), "goal": 0.5})
    first = runs[1][0]
    one, fused_s = first["step_s"], first["step_fused_s"]
    speed = [{"cp": cp, "step_s": round(runs[cp][0]["step_s"], 3), "cpu_s": round(runs[cp][0]["cpu_s"], 3),
              "ratio_to_cp1_context": round(one / runs[cp][0]["step_s"], 3),
              "ratio_to_cp1_fused": round(fused_s / runs[cp][0]["step_s"], 3),
              "cpu_ratio_to_cp1_context": round(first["cpu_s"] / runs[cp][0]["cpu_s"], 3),
              "cpu_ratio_to_cp1_fused": round(first["cpu_fused_s"] / runs[cp][0]["cpu_s"], 3)}
             for cp in cps if cp > 1]
    from pretrain.plan.context_parallel import cp_activations

    check = [{"cp": cp, "mixer": m, "saved_mb": round(max(r["saved_by_variant"][m] for r in runs[cp]) / MB, 3),
              "plan_mb": round(cp_activations(config(m, args.check_n, cp).model, 2, args.check_n, cp).total / MB, 3)}
             for cp in cps for m in CHECKED]
    for c in check:
        c["plan_error"] = round(c["plan_mb"] / c["saved_mb"] - 1, 3)
    return {"n": args.n, "n_time": args.n_time, "check_n": args.check_n, "saved_check": check, "memory_measure": "peak RSS less file pages above rest (VmHWM "
            "reset by clear_refs), malloc returning blocks > 64 kB; saved = autograd's saved tensors",
            "memory": rows, "bytes": traffic, "throughput": speed, "cp1_step_s": round(one, 3),
            "cp1_fused_step_s": round(fused_s, 3), "cp1_cpu_s": round(first["cpu_s"], 3),
            "cp1_fused_cpu_s": round(first["cpu_fused_s"], 3), "load_average": os.getloadavg(), "cpus": os.cpu_count()}


def table(res: dict) -> str:
    lines = [f"memory per rank at n {res['n']} (MB; measured peak above rest, autograd's saved bytes; the plan's)",
             "  cp  path            peak   saved  plan peak  plan kept  peak÷cp1  goal  plan err"]
    for r in res["memory"]:
        ratio = f"{r['ratio_to_cp1']:8.3f}  {r['goal_ratio']:.3f}" if "ratio_to_cp1" in r else " " * 15
        lines.append(f"  {r['cp']:>2}  {r['path']:<14} {r['peak_mb']:6.1f}  {r['saved_mb']:6.1f}  {r['plan_peak_mb']:9.1f}"
                     f"  {r['plan_kept_mb']:9.1f}  {ratio}  {100 * r['plan_error']:+6.1f}%")
    lines.append(f"saved for backward at n {res['check_n']}, micro-batch 2 (MB, the fullest rank; the plan's kept)")
    for cp in dict.fromkeys(c["cp"] for c in res["saved_check"]):
        lines.append(f"  cp {cp}: " + ", ".join(f"{c['mixer']} {c['saved_mb']:.2f}/{c['plan_mb']:.2f} "
                                              f"({100 * c['plan_error']:+.0f}%)"
                                              for c in res["saved_check"] if c["cp"] == cp))
    lines.append("bytes sent per step and rank by cp (MB, ring traffic; formula beside)")
    for t in res["bytes"]:
        if "mixer" in t:
            lines.append(f"  cp {t['cp']} {t['mixer']:<6} forward {t['forward_mb']:.3f} (formula "
                         f"{t['formula_forward_mb']:.3f})  backward {t['backward_mb']:.3f} (formula "
                         f"{t['formula_backward_mb']:.3f}, gloo's all-reduce {t['formula_backward_gloo_mb']:.3f})")
        else:
            lines.append(f"  cp {t['cp']} dense ÷ dot = {t['dense_over_dot']} (goal {t['goal']})")
    lines.append(f"throughput at n {res['n_time']} (cp 1: context.loss {res['cp1_step_s']} s a step, CPU "
                 f"{res['cp1_cpu_s']} s; fused {res['cp1_fused_step_s']} s, CPU {res['cp1_fused_cpu_s']} s)")
    lines += [f"  cp {s['cp']}: {s['step_s']} s a step, ÷ cp 1 context.loss {s['ratio_to_cp1_context']}, ÷ cp 1 fused "
              f"{s['ratio_to_cp1_fused']}; by the slowest rank's CPU time {s['cpu_s']} s: "
              f"{s['cpu_ratio_to_cp1_context']}, {s['cpu_ratio_to_cp1_fused']}" for s in res["throughput"]]
    lines.append(f"load average {', '.join(f'{x:.2f}' for x in res['load_average'])} on {res['cpus']} CPUs")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        cps = sorted({1, *(int(c) for c in args.cps.split(","))})
    except ValueError:
        print(f"--cps={args.cps!r}: write sizes separated by commas, e.g. 1,2,4", file=sys.stderr)
        return 2
    bad = [c for c in cps if args.n % (2 * c) or args.n_time % (2 * c)]
    if bad:
        print(f"--cps: cp {bad[0]} splits a sequence into {2 * bad[0]} chunks, which must divide --n {args.n} and "
              f"--n-time {args.n_time}", file=sys.stderr)
        return 2
    runs, t0 = {}, time.time()
    for cp in cps:
        print(f"cp {cp}: {cp} process(es) …", file=sys.stderr, flush=True)
        runs[cp] = launch(cp, args)
        print(f"cp {cp}: done at {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    res = report(runs, args)
    print(json.dumps(res, indent=1) if args.json else table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
