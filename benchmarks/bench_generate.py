#!/usr/bin/env python
"""Generation speed of the Hugging Face export, with and without its cache, measured side by side in one run.

    python benchmarks/bench_generate.py                       # both shapes below, greedy, 1 sequence
    python benchmarks/bench_generate.py --shapes demo --mixer dot --reps 3

Each shape is a model of configs/demo-cpu.yaml's kind (its mixer unless --mixer), randomly initialised, written as a
release and exported (model/hf.py), then loaded the way users load it: AutoModelForCausalLM.from_pretrained(DIR,
trust_remote_code=True). `generate(do_sample=False)` runs with use_cache=True (incremental: one new position a
step) and use_cache=False (the last ≤ L tokens recomputed every step); the tokens must be the same. Shapes:
    demo   the demo model (L 128): a 16-token prompt, 100 new tokens
    d512   d 512, 8 layers, 8 heads, L 512: a 32-token prompt, 256 new tokens
Prints per shape the seconds (median of --reps) and tokens/s of both, and the speed-up.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "configs", "demo-cpu.yaml")
SHAPES = {   # name: (overrides of the demo config, prompt tokens, new tokens)
    "demo": ([], 16, 100),
    "d512": (["model.d_model=512", "model.n_layers=8", "model.n_heads=8", "model.max_seq_len=512"], 32, 256),
}


def export(model_cfg, out: str) -> str:
    """A randomly initialised model of model_cfg as a Hugging Face export in out/hf."""
    from model import build_model
    from model.hf import release_to_hf
    from model.release import save_release

    model = build_model(model_cfg)
    save_release(os.path.join(out, "release"), model_cfg, dict(model.named_parameters()))
    release_to_hf(os.path.join(out, "release"), os.path.join(out, "hf"))
    return os.path.join(out, "hf")


def time_generate(model, prompt, new: int, use_cache: bool, reps: int):
    import torch

    seconds, tokens = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                 use_cache=use_cache)
        seconds.append(time.perf_counter() - t0)
        tokens = out if tokens is None else tokens
    return statistics.median(seconds), tokens


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--mixer", help="the model's mixer (default: the demo config's)")
    ap.add_argument("--reps", type=int, default=3, help="timed generations per setting (default 3; the median)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    a = ap.parse_args(argv)
    shapes = [s.strip() for s in a.shapes.split(",") if s.strip()]
    bad = [s for s in shapes if s not in SHAPES]
    if bad or not shapes:
        print(f"error: --shapes: unknown shape {', '.join(map(repr, bad)) or '(none given)'}; valid: "
              f"{', '.join(SHAPES)}", file=sys.stderr)
        return 2
    import torch
    from transformers import AutoModelForCausalLM

    from model import ConfigError
    from pretrain.config import load_config

    if a.threads:
        torch.set_num_threads(a.threads)
    mixer = [f"model.mixer={a.mixer}"] if a.mixer else []
    try:
        cfgs = {name: load_config(DEMO, SHAPES[name][0] + mixer).model for name in shapes}
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("| shape | mixer | prompt + new | with cache | without | speed-up |\n|---|---|---|---|---|---|")
    for name in shapes:
        cfg, (_, n_prompt, n_new) = cfgs[name], SHAPES[name]
        with tempfile.TemporaryDirectory() as tmp:
            model = AutoModelForCausalLM.from_pretrained(export(cfg, tmp), trust_remote_code=True).eval()
            prompt = torch.randint(cfg.vocab_size, (1, n_prompt), generator=torch.Generator().manual_seed(0))
            time_generate(model, prompt, 4, True, 1)   # warm-up: first-call allocations
            cached, tokens = time_generate(model, prompt, n_new, True, a.reps)
            full, reference = time_generate(model, prompt, n_new, False, a.reps)
        if not torch.equal(tokens, reference):
            print(f"error: {name}: generate() gave different tokens with and without the cache", file=sys.stderr)
            return 1
        mixer = cfg.mixer if isinstance(cfg.mixer, str) else "+".join(cfg.mixer)
        print(f"| {name} (d {cfg.d_model}, {cfg.n_layers} layers, L {cfg.max_seq_len}) | {mixer} | "
              f"{n_prompt} + {n_new} | {cached:.2f} s ({n_new / cached:.0f} tok/s) | "
              f"{full:.2f} s ({n_new / full:.0f} tok/s) | {full / cached:.1f}× |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
