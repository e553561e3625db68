#!/usr/bin/env python
"""GPU part 0: is the whole model compiled (the plain loop's `torch.compile`) the eager model, loss and gradients?

    python benchmarks/compile_check.py [--quick] [--mixers dot,dense+dot] [--checks loss,grads,loop,harness]
                                       [--harness-at DIR ...] [--fx-graph-cache off] [--out DIR]
    make gpu-bench PART=0            (benchmarks/bench.py --gpu-part 0: the GPU queue's part 0, PART0_ARGS below)

At the bench's shape (synth-1.3b's widths, B 4, n 2048, V 32000, 2 layers; --quick: d 64, n 64, V 512, and the fused
loss's chunks forced small, so that it runs in several chunks as at the bench shape), one batch, bf16 autocast over
fp32 weights as the plain loop runs:
  grads   loss and every parameter's gradient of the model under each torch.compile backend (aot_eager: the traced
          graph without inductor; inductor: the default) ÷ eager's: relative error ‖g − g_eager‖ / ‖g_eager‖, the
          worst parameters named. The noise floor beside them: a second eager run at another chunk size.
  isolate the same for the fused head + loss alone (model/linear_cross_entropy.py on random x, W), and for the whole
          model with the unfused head (logits, then cross-entropy): which piece a wrong gradient comes from.
  loop    the plain loop as the H200 record ran it (lr 2e-4 from step 0, no warm-up, the same batch every step), eager
          and compiled: each step's loss. Eager falls; a compiled run whose loss rises reproduces the record.
  harness the record's point through the bench's own harness (`benchmarks/bench.py _one HARNESS`: the plain loop
          compiled, synth-1.3b's dot, lr 2e-4 from step 0 on one batch, warm-up 2, 2 × 3 steps; loss = each
          repetition's mean) in each checkout of --harness-at (a git worktree of 5ee72c4 reproduced the rise on an
          H200: docs/gpu/2026-11-27-7f38757-h200/); with --fx-graph-cache off, inductor's FX graph cache is off
          (TORCHINDUCTOR_FX_GRAPH_CACHE=0) here and in those processes.
Writes DIR/compile-check.json and prints one line per comparison.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BIG = "configs/synth-1.3b.yaml"
SHAPE = dict(d=2048, heads=16, n=2048, batch=4, vocab=32000, layers=2)
QUICK = dict(d=64, heads=4, n=64, batch=2, vocab=512, layers=2)
QUICK_CHUNK = 2**12   # logits per chunk under --quick: 8 rows at V 512, so 16 chunks
# The record's point (docs/gpu/2026-11-26-5ee72c4-h200/part2-points.jsonl), in the form any checkout's bench.py reads:
# `schedule`/`same_batch` give today's loop the old one's lr 2e-4 from step 0 on one batch (older code ignores them).
HARNESS = {"kind": "loop", "config": BIG, "overrides": ["parallel.tp=1", "train.global_batch_size=4", "model.mixer=dot",
           "train.precision=bf16"], "world": 1, "env": {}, "warmup": 2, "reps": 2, "steps": 3, "threads": None,
           "compile": True, "schedule": False, "same_batch": True}
HARNESS_QUICK = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.max_seq_len=64",
                 "model.vocab_size=512", "train.micro_batch_size=1", "train.global_batch_size=1"]
CHECKS = ("loss", "grads", "loop", "harness")
# GPU part 0 (benchmarks/gpu_queue.py): both binding mixers, and the record's point (synth-1.3b's depth) here and, if
# present, in .old (a git worktree of 5ee72c4), with inductor's FX graph cache off.
PART0_ARGS = ["--mixers", "dot,dense+dot", "--checks", ",".join(CHECKS), "--fx-graph-cache", "off"]


def model_config(shape: dict, mixer: str):
    from pretrain.config import load_config

    s = shape
    return load_config(BIG, [f"model.vocab_size={s['vocab']}", f"model.d_model={s['d']}",
                             f"model.n_layers={s['layers']}", f"model.n_heads={s['heads']}",
                             f"model.max_seq_len={s['n']}", f"model.mixer={mixer}", "parallel.tp=1",
                             f"train.micro_batch_size={s['batch']}", f"train.global_batch_size={s['batch']}"])


def rel(a, b) -> float:
    """‖a − b‖ / ‖b‖ in fp32."""
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def compare(ref: tuple, got: tuple, floor: dict | None = None) -> dict:
    """(loss, {name: grad}) against the reference's: the loss's relative error, the worst gradients' relative errors,
    and with `floor` ({name: bf16's own relative error}) the worst ratios to it: a gradient within bf16's rounding is
    ≲ 1, a wrong one far above (a gradient that is 0 in exact arithmetic, as a key bias's, has a large relative error
    in both, and a ratio near 1)."""
    loss_r, g_r = ref
    loss_g, g_g = got
    missing = sorted(set(g_r) ^ set(g_g))
    errs = {k: rel(g_g[k], g_r[k]) for k in g_r if k in g_g}
    worst = sorted(errs, key=errs.get, reverse=True)[:4]
    out = {"loss": loss_g, "loss_ref": loss_r, "loss_rel": abs(loss_g - loss_r) / abs(loss_r),
           "grad_rel_max": errs[worst[0]] if worst else None, "worst": [[k, errs[k]] for k in worst],
           "missing": missing, "errors": errs}
    if floor:
        ratio = {k: e / max(floor.get(k, 0.0), 1e-6) for k, e in errs.items()}
        top = sorted(ratio, key=ratio.get, reverse=True)[:4]
        out.update(ratio_to_bf16_max=ratio[top[0]] if top else None, worst_ratio=[[k, ratio[k]] for k in top])
    return out


def backward_of(module, backend: str | None, inputs, targets, dtype):
    """(loss, {param name: grad}) of one forward + backward of `module` (compiled by `backend` when given)."""
    import torch

    torch._dynamo.reset()
    run = module if backend is None else torch.compile(module, backend=backend)
    module.zero_grad(set_to_none=True)
    with torch.autocast(inputs.device.type, dtype=dtype, enabled=dtype is not None):
        loss = run(inputs, targets)
    loss.backward()
    grads = {n: p.grad.detach().float().clone() for n, p in module.named_parameters() if p.grad is not None}
    return float(loss), grads


class Unfused:
    """The whole model with the unfused head: logits (B, n, V), then Head.loss (no fused chunked loss)."""

    def __new__(cls, model):
        import torch

        from model.lm import Head

        class UnfusedLM(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lm = model

            def forward(self, inputs, targets):
                return Head.loss(self.lm(inputs), targets)

        return UnfusedLM()


def check_grads(shape, mixer, device, dtype, backends, log) -> list[dict]:
    import torch

    from model import build_model

    cfg = model_config(shape, mixer)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(shape["vocab"], (shape["batch"], shape["n"] + 1), generator=g).to(device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    model = build_model(cfg.model).to(device)
    out = []
    ref = backward_of(model, None, inputs, targets, dtype)
    # the noise floor: bf16's own error, eager under autocast against eager in fp32
    fp32 = compare(backward_of(model, None, inputs, targets, None), ref)
    floor = {k: e for k, e in fp32.pop("errors").items()}
    out.append(dict(check="grads", mixer=mixer, backend="eager fp32 vs eager bf16 (the noise floor)", **fp32))
    log(out[-1])
    for backend in backends:
        t = time.time()
        res = compare(ref, backward_of(model, backend, inputs, targets, dtype), floor)
        out.append(dict(check="grads", mixer=mixer, backend=backend, seconds=round(time.time() - t, 1), **res))
        log(out[-1])
    unfused = Unfused(model)
    ref_u = backward_of(unfused, None, inputs, targets, dtype)
    renamed = (ref_u[0], {k.removeprefix("lm."): v for k, v in ref_u[1].items()})
    out.append(dict(check="unfused head, eager vs fused eager", mixer=mixer, backend="eager", **compare(ref, renamed)))
    log(out[-1])
    for backend in backends:
        res = compare(ref_u, backward_of(unfused, backend, inputs, targets, dtype),
                      {f"lm.{k}": e for k, e in floor.items()})
        out.append(dict(check="grads, unfused head", mixer=mixer, backend=backend, **res))
        log(out[-1])
    return out


def check_loss_alone(shape, device, dtype, backends, log) -> list[dict]:
    """The fused head + loss on its own: x (N, d) and W (V, d) random leaves, compiled vs eager."""
    import torch

    from model.linear_cross_entropy import linear_cross_entropy

    g = torch.Generator().manual_seed(1)
    B, n, d, V = shape["batch"], shape["n"], shape["d"], shape["vocab"]
    x0 = torch.randn(B, n, d, generator=g).to(device)
    w0 = (0.02 * torch.randn(V, d, generator=g)).to(device)
    t = torch.randint(V, (B, n), generator=g).to(device)

    def run(backend):
        torch._dynamo.reset()
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        f = linear_cross_entropy if backend is None else torch.compile(linear_cross_entropy, backend=backend)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = f(x, w, t)
        loss.backward()
        return float(loss), {"x": x.grad.float(), "W": w.grad.float()}

    ref, out = run(None), []
    for backend in backends:
        out.append(dict(check="fused loss alone", backend=backend, **compare(ref, run(backend))))
        log(out[-1])
    return out


def check_loop(shape, mixer, device, dtype, steps, log) -> list[dict]:
    """The plain loop of benchmarks/bench_lib.py as the record ran it: lr 2e-4 at once, one batch; eager, compiled."""
    import torch

    from benchmarks.bench_lib import PlainLoop

    cfg = model_config(shape, mixer)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(shape["vocab"], (shape["batch"], shape["n"] + 1), generator=g).to(device)
    out = []
    for compiled in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(cfg.train.seed)
        loop = PlainLoop(cfg, SimpleNamespace(device=device, grad_accum=1), schedule=False)
        if compiled:
            loop.compile()
        losses = []
        for _ in range(steps):
            loss = loop(tokens[:, :-1], tokens[:, 1:])
            loop.backward(loss)
            loop.step()
            losses.append(round(float(loss), 4))
        out.append(dict(check="loop, lr 2e-4, no warm-up, same batch", mixer=mixer, layers=shape["layers"],
                        backend="inductor" if compiled else "eager", losses=losses))
        log(out[-1])
    return out


def harness_spec(quick: bool) -> dict:
    return {**HARNESS, "overrides": HARNESS["overrides"] + (HARNESS_QUICK if quick else []),
            **({"compile": False, "warmup": 1, "reps": 2, "steps": 1} if quick else {})}


def check_harness(trees: list[str], quick: bool, timeout: float, log) -> list[dict]:
    """The record's point (HARNESS; under --quick tiny and eager) by `bench.py _one` in each checkout of `trees`, a
    fresh process each: its loss per repetition and step time."""
    import subprocess

    from benchmarks.bench_lib import RESULT_MARK
    from pretrain.distributed import free_local_port

    spec, out = harness_spec(quick), []
    for tree in trees:
        tree = os.path.abspath(tree)
        env = {**os.environ, "PYTHONPATH": tree, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_SIZE": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_local_port())}
        t = time.time()
        try:
            r = subprocess.run([sys.executable, os.path.join(tree, "benchmarks", "bench.py"), "_one", json.dumps(spec)],
                               cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
            text = r.stdout + r.stderr
        except subprocess.TimeoutExpired:
            text = f"timeout after {timeout:g} s"
        lines = [line for line in text.splitlines() if line.startswith(RESULT_MARK)]
        res = json.loads(lines[-1][len(RESULT_MARK):]) if lines else {"error": text.strip()[-500:]}
        out.append(dict(check="harness: the record's point (loop compiled, lr 2e-4 from step 0, one batch)",
                        tree=tree, fx_graph_cache=os.environ.get("TORCHINDUCTOR_FX_GRAPH_CACHE", "default"),
                        seconds=round(time.time() - t, 1), loss=res.get("loss"), step_s=res.get("step_s"),
                        peak_mb=res.get("peak_mb"), error=res.get("error")))
        log(out[-1])
    return out


def configurations(mixers: list[str], repro_layers: int, harness: bool, quick: bool = False) -> list[dict]:
    """The training configurations this check runs, as bench points (kind, config, overrides) for the kernel census
    (benchmarks/kernel_census.py): the plain loop's model at the shape, per mixer, at --repro-layers, and HARNESS."""
    shape = QUICK if quick else SHAPE

    def over(s, m):   # model_config's overrides
        return [f"model.vocab_size={s['vocab']}", f"model.d_model={s['d']}", f"model.n_layers={s['layers']}",
                f"model.n_heads={s['heads']}", f"model.max_seq_len={s['n']}", f"model.mixer={m}", "parallel.tp=1",
                f"train.micro_batch_size={s['batch']}", f"train.global_batch_size={s['batch']}"]

    specs = [{"kind": "loop", "config": BIG, "overrides": over(shape, m), "compile": True} for m in mixers]
    if repro_layers:
        specs.append({"kind": "loop", "config": BIG, "overrides": over({**shape, "layers": repro_layers}, "dot"),
                      "compile": True})
    return specs + ([harness_spec(quick)] if harness else [])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny shape with the fused loss in 16 chunks (CPU tests)")
    ap.add_argument("--mixers", default="dot", help="comma-separated mixers of the gradient checks (default dot)")
    ap.add_argument("--backends", default="aot_eager,inductor", help="torch.compile backends to compare with eager")
    ap.add_argument("--loop-steps", type=int, default=6, help="steps of each plain-loop run (0: no loop check)")
    ap.add_argument("--repro-layers", type=int, default=0, help="then the loop check again at this depth (24: "
                    "synth-1.3b's, as the record ran it), if --budget-s allows")
    ap.add_argument("--budget-s", type=float, default=420.0, help="skip the --repro-layers check past this many "
                                                                  "seconds (default 420)")
    ap.add_argument("--checks", default="loss,grads,loop", help=f"comma-separated checks to run, of "
                                                               f"{', '.join(CHECKS)} (default loss,grads,loop)")
    ap.add_argument("--harness-at", action="append", metavar="DIR", help="a checkout the harness check runs the "
                    "record's point in (repeatable; default: this one, and .old where it is a checkout)")
    ap.add_argument("--fx-graph-cache", choices=("default", "off"), default="default",
                    help="off: TORCHINDUCTOR_FX_GRAPH_CACHE=0 here and in the harness's processes")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench"), help="directory of compile-check.json")
    a = ap.parse_args(argv)
    checks = [c.strip() for c in a.checks.split(",") if c.strip()]
    if not checks or any(c not in CHECKS for c in checks):
        ap.error(f"--checks={a.checks!r}: give some of {', '.join(CHECKS)}")
    if a.fx_graph_cache == "off":   # before torch is imported: inductor reads it when its config loads
        os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "0"

    import torch

    from model import linear_cross_entropy as lce

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" or a.quick else None
    shape = QUICK if a.quick else SHAPE
    if a.quick:
        lce.CHUNK_ELEMENTS = QUICK_CHUNK
    backends, t0 = [b for b in a.backends.split(",") if b], time.time()
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "compile-check.json")
    results = []

    def log(r):
        r.pop("errors", None)
        results.append(r)
        print(json.dumps(r), flush=True)
        with open(path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
                       "torch": torch.__version__, "shape": shape, "chunk_elements": lce.CHUNK_ELEMENTS,
                       "results": results}, f, indent=1)

    rows = lce.chunk_rows(shape["vocab"], shape["batch"] * shape["n"])
    print(f"compile check on {device}: {shape}, the fused loss in chunks of {rows} rows "
          f"({-(-shape['batch'] * shape['n'] // rows)} chunks)", flush=True)
    if "loss" in checks:
        check_loss_alone(shape, device, dtype, backends, log)
    for mixer in a.mixers.split(",") if "grads" in checks else []:
        check_grads(shape, mixer, device, dtype, backends, log)
    if a.loop_steps and "loop" in checks:
        check_loop(shape, "dot", device, dtype, a.loop_steps, log)
    if a.loop_steps and a.repro_layers and "loop" in checks:
        if time.time() - t0 < a.budget_s:
            check_loop({**shape, "layers": a.repro_layers}, "dot", device, dtype, a.loop_steps, log)
        else:
            log(dict(check=f"loop at {a.repro_layers} layers", skipped=f"past --budget-s {a.budget_s:g}"))
    if "harness" in checks:
        old = os.path.join(ROOT, ".old")
        trees = a.harness_at or [ROOT] + ([old] if os.path.exists(os.path.join(old, "benchmarks", "bench.py")) else [])
        check_harness(trees, a.quick, 150.0 if device.type == "cuda" else 600.0, log)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
