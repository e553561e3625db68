#!/usr/bin/env python
"""One block's forward+backward time and peak memory for each mixer variant, fused vs reference.

    python benchmarks/bench_mixer.py [--variants dot,dense,...] [--lengths 256,1024,2048,4096] [--json out.json]

Each (variant, impl, n) runs in its own process (d=512, 8 heads, batch 4 by default), so peak memory is that
configuration's alone: on CUDA the allocator's peak, on CPU the growth of the process's peak RSS over its RSS
before the first forward. Printed as ratios to `dot` (same impl, same n), memory(4096)/memory(1024), the kernel
that ran (from torch.profiler op names) and, at n=1024, time ratio vs the FLOP ratio from model accounting.
The flagship's widths (d_h 128: dense+dot's q·k 256 wide, its Triton key-bias kernel on CUDA):
    python benchmarks/bench_mixer.py --variants dot,dense+dot --d-model 2048 --heads 16 --impls fused
The cost of model.document_mask (model/documents.py), the fused block with the mask ÷ without, in one process per
variant whose steps alternate (A B B A …), each timed as the CPU time of one thread (a shared machine's load, which
stretches wall-clock time many-fold, does not enter it), on random tokens with an eos at each position with
probability 1/95 (the demo corpus's mean document length); the masked step makes its documents itself (once a block
here, once a forward pass in the model):
    python benchmarks/bench_mixer.py --documents --d-model 128 --heads 4 --lengths 128 --batch 8
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from benchmarks.bench_points import GOAL_MEM
from model import variants
from pretrain.observe.metrics import memory_mb, reset_peak_memory

VARIANTS = ",".join(variants.subset("layers"))


# The autograd Functions of model/gpu_kernels/ (Triton), by the name the profiler records for each
TRITON_FUNCTIONS = {"KeyBiasFlashAttention": "triton-key-bias", "BiasedFlashAttention": "triton-biased",
                    "FactorizedDenseFlash": "triton-factorized-dense"}


def kernel_name(events) -> str:
    names = {e.name for e in events}
    triton = [label for fn, label in TRITON_FUNCTIONS.items() if any(n.startswith(fn) for n in names)]
    if triton:
        return triton[0]
    if any("flash" in n or "efficient_attention" in n or "cudnn_attention" in n for n in names):
        return "sdpa-flash" + ("+tiled-bwd" if any("BiasedQKAttention" in n for n in names) else "")
    if any("_scaled_dot_product_attention_math" in n for n in names):
        return "sdpa-math"
    return "matmul"


def worker(args) -> dict:
    """Measure one configuration in this process; print one JSON line."""
    import torch
    from torch.profiler import profile

    from model import ModelConfig
    from model.lm import Block

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=8, d_model=args.d_model, n_layers=1, n_heads=args.heads, max_seq_len=args.n,
                      mixer=args.variant, impl=args.impl)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    block = Block(cfg, args.variant).to(device)
    x = torch.randn(args.batch, args.n, args.d_model, device=device, requires_grad=True)

    def step():
        block(x).sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()

    base = 0.0 if device.type == "cuda" else memory_mb(device, peak=False)   # CPU: what the block itself adds
    reset_peak_memory(device)
    step()                                                # warm-up (also the first, honest peak)
    times, deadline = [], time.perf_counter() + args.budget_s
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
        if time.perf_counter() > deadline:
            break
    peak = memory_mb(device) - base
    with profile() as prof:
        step()
    return {"variant": args.variant, "impl": args.impl, "n": args.n, "time_ms": 1e3 * min(times),
            "peak_mb": peak, "kernel": kernel_name(prof.events()),
            "train_flops_per_token": block.train_flops(args.n), "device": device.type}


def documents_worker(args) -> dict:
    """Step times of the block with and without the document mask, alternated; the throughput ratio on ÷ off is the
    median over pairs of t_off / t_on."""
    import statistics

    import torch

    from model import ModelConfig
    from model.documents import Documents
    from model.lm import Block

    torch.manual_seed(0)
    shape = dict(vocab_size=8, d_model=args.d_model, n_layers=1, n_heads=args.heads, max_seq_len=args.n,
                 **variants.model_fields(args.variant))
    off = Block(ModelConfig(**shape), args.variant)
    on = Block(ModelConfig(**shape, document_mask=True, eos_id=1), args.variant)
    on.load_state_dict(off.state_dict())
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(2, 8, (args.batch, args.n), generator=g)
    tokens[torch.rand(args.batch, args.n, generator=g) < 1 / 95] = 1
    x = torch.randn(args.batch, args.n, args.d_model, requires_grad=True)

    torch.set_num_threads(1)   # CPU time of one thread: what a step costs, whatever else runs on the machine

    def timed(masked: bool) -> float:
        t0 = time.process_time()
        if masked:
            on(x, docs=Documents.of(tokens, 1)).sum().backward()
        else:
            off(x).sum().backward()
        return time.process_time() - t0

    timed(False), timed(True)   # warm-up
    pairs = []
    for r in range(max(2, args.repeats)):
        first = r % 2 == 0      # A B, then B A
        a = timed(not first)
        b = timed(first)
        t_off, t_on = (b, a) if first else (a, b)
        pairs.append((t_off, t_on))
    ratios = [t_off / t_on for t_off, t_on in pairs]
    return {"variant": args.variant, "n": args.n, "off_ms": 1e3 * statistics.median(p[0] for p in pairs),
            "on_ms": 1e3 * statistics.median(p[1] for p in pairs), "ratio": statistics.median(ratios),
            "range": [min(ratios), max(ratios)], "pairs": len(pairs)}


def run_documents(args) -> list[dict]:
    from tqdm import tqdm

    results = []
    for v, n in tqdm([(v, n) for v in args.variants for n in args.lengths], desc="bench", unit="config"):
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--documents", "--variant", v, "--n", str(n),
               "--batch", str(args.batch), "--d-model", str(args.d_model), "--heads", str(args.heads),
               "--repeats", str(args.repeats)]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
        results.append(json.loads(lines[-1]) if out.returncode == 0 and lines else
                       {"variant": v, "n": n, "error": (out.stderr.strip().splitlines() or ["failed"])[-1]})
    print("\n## the block under the document mask ÷ without: throughput ratio (1 thread's CPU time per step, median "
          "over alternated pairs)")
    for r in results:
        print(f"{r['variant']:<20}n {r['n']:<6}" + (r["error"] if "error" in r else
              f"{r['ratio']:.2f} [{r['range'][0]:.2f}, {r['range'][1]:.2f}]  off {r['off_ms']:.1f} ms, "
              f"on {r['on_ms']:.1f} ms, {r['pairs']} pairs"))
    return results


def run_all(args) -> list[dict]:
    from tqdm import tqdm

    jobs = [(v, impl, n) for v in args.variants for impl in args.impls for n in args.lengths]
    results = []
    for v, impl, n in tqdm(jobs, desc="bench", unit="config"):
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--variant", v, "--impl", impl, "--n", str(n),
               "--batch", str(args.batch), "--d-model", str(args.d_model), "--heads", str(args.heads),
               "--repeats", str(args.repeats), "--budget-s", str(args.budget_s)]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            lines = [l for l in out.stdout.splitlines() if l.startswith("{")]
            res = json.loads(lines[-1]) if out.returncode == 0 and lines else \
                {"variant": v, "impl": impl, "n": n, "error": (out.stderr.strip().splitlines() or ["failed"])[-1]}
        except subprocess.TimeoutExpired:
            res = {"variant": v, "impl": impl, "n": n, "error": f"timeout {args.timeout}s"}
        results.append(res)
    return results


def print_tables(results: list[dict], lengths: list[int]) -> None:
    get = {(r["variant"], r["impl"], r["n"]): r for r in results}
    variants = list(dict.fromkeys(r["variant"] for r in results))
    impls = list(dict.fromkeys(r["impl"] for r in results))

    def cell(v, impl, n, key):
        r, ref = get.get((v, impl, n)), get.get(("dot", impl, n))
        if not r or "error" in r:
            return "OOM/err" if r else "-"
        if not ref or "error" in ref:
            return f"{r[key]:.0f}"
        return f"{r[key] / ref[key]:.2f}"

    for key, title in (("time_ms", "time ÷ dot (fwd+bwd of one block)"), ("peak_mb", "peak memory ÷ dot")):
        print(f"\n## {title}")
        head = "".join(f"{impl[:3]}@{n:<6}" for n in lengths for impl in impls)
        print(f"{'variant':<20}{head}")
        for v in variants:
            print(f"{v:<20}" + "".join(f"{cell(v, impl, n, key):<10}" for n in lengths for impl in impls))
    print("\n## absolute (ms / MB), kernel, memory(4096)/memory(1024)")
    for v in variants:
        for impl in impls:
            rs = [get.get((v, impl, n)) for n in lengths]
            abs_ = "  ".join(f"{n}:{r['time_ms']:.0f}ms/{r['peak_mb']:.0f}MB" if r and "error" not in r
                             else f"{n}:{(r or {}).get('error', '-')[:30]}" for n, r in zip(lengths, rs))
            kernel = next((r["kernel"] for r in rs if r and "error" not in r), "-")
            m1, m4 = get.get((v, impl, 1024)), get.get((v, impl, 4096))
            ratio = f"{m4['peak_mb'] / m1['peak_mb']:.2f}" if m1 and m4 and "error" not in m1 and "error" not in m4 else "-"
            goal = f" (goal ≤ {GOAL_MEM[v]})" if impl == "fused" and v in GOAL_MEM else ""
            print(f"{v:<20}{impl:<10}{kernel:<26}mem4096/1024={ratio}{goal}  {abs_}")
    if ("dot", "fused", 1024) in get and "error" not in get[("dot", "fused", 1024)]:
        dot = get[("dot", "fused", 1024)]
        print("\n## n=1024, fused: time ratio vs FLOP ratio to dot (goal: time ≤ 1.1 × FLOPs)")
        for v in variants:
            r = get.get((v, "fused", 1024))
            if r and "error" not in r:
                tr, fr = r["time_ms"] / dot["time_ms"], r["train_flops_per_token"] / dot["train_flops_per_token"]
                print(f"{v:<20}time {tr:.2f}  flops {fr:.2f}  {'ok' if tr <= 1.1 * fr else 'MISSED'}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default=VARIANTS, help="comma-separated mixer names")
    ap.add_argument("--lengths", default="256,1024,2048,4096", help="comma-separated sequence lengths")
    ap.add_argument("--impls", default="fused,reference")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3, help="timed iterations after one warm-up (min is kept)")
    ap.add_argument("--budget-s", type=float, default=30.0, help="stop repeating after this long")
    ap.add_argument("--timeout", type=float, default=600.0, help="per-configuration time limit (s)")
    ap.add_argument("--json", default=None, help="also write the raw results here")
    ap.add_argument("--documents", action="store_true", help="the block under model.document_mask ÷ without, "
                    "alternated in one process per variant (fused path; --impls is ignored)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    ap.add_argument("--impl", help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(documents_worker(args) if args.documents else worker(args)))
        return 0
    from model.config import ConfigError, parse_mixer

    try:
        args.variants = [v for v in args.variants.split(",") if parse_mixer(v, "--variants")]
        args.lengths = [int(n) for n in args.lengths.split(",")]
        args.impls = args.impls.split(",")
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    results = run_documents(args) if args.documents else run_all(args)
    if args.documents:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
        return 0
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print_tables(results, args.lengths)
    return 0


if __name__ == "__main__":
    sys.exit(main())
