#!/usr/bin/env python
"""Generate text from a checkpoint or release: temperature, top-k, nucleus (top-p), reproducible for a seed.

    python tools/generate.py runs/demo --max-new-tokens 60        # prompt: the opening of a validation document
    python tools/generate.py runs/demo-release --prompt "Emma" --temperature 0.8 --top-p 0.9 --num-samples 3 --seed 7

CHECKPOINT: a release directory or any DeepSpeed checkpoint path (run directory, its checkpoints/, a step_* dir).
The prompt is tokenized after an eos, the "new document" context the model saw in training; an eos it generates is
printed as a newline. Sample k uses seed + k, so a sample does not depend on --num-samples.

Decoding is incremental (model/decoding.py): every mixer keeps a cache of what later positions need (v and the dot
keys; SGU's normed gate inputs), so a step costs one position instead of the whole prefix, with the same logits
(≤ 1e-5) and hence the same samples as the full recompute of model/generate.py. Past max_seq_len tokens the window
slides, positions shift and each step is a full recompute of the last max_seq_len tokens. --no-cache recomputes
always (for comparison). A Hugging Face export made before cached decoding carries model code without a cache: it is
decoded by full recompute. The timing line (and --json's "decoding") says which of these happened. Errors are one
line (exit 2).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from tqdm import tqdm

from cli import UsageError, one_line_errors
from cli.remote_args import add_remote_arguments, configure_remote
from evaluation.loading import load
from evaluation.prompts import decode, default_prompt, prompt_ids, run_data
from model.decoding import CachedLM
from model.generate import sample



def check(args) -> None:
    for name, value, ok, want in (("--max-new-tokens", args.max_new_tokens, args.max_new_tokens >= 0, "≥ 0"),
                                  ("--num-samples", args.num_samples, args.num_samples >= 1, "≥ 1"),
                                  ("--temperature", args.temperature, args.temperature >= 0, "≥ 0 (0 = greedy)"),
                                  ("--top-k", args.top_k, args.top_k is None or args.top_k >= 1, "≥ 1"),
                                  ("--top-p", args.top_p, args.top_p is None or 0 < args.top_p <= 1, "in (0, 1]")):
        if not ok:
            raise UsageError(f"{name} {value} must be {want}")


def generate(model, sp, prompt: str, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
             top_p: float | None = None, seed: int = 0, num_samples: int = 1, use_cache: bool = True,
             progress: bool = False) -> list[dict]:
    """[{"seed", "prompt" (as decoded), "text" (the continuation), "ids" (its ids), "decoding" (how it was decoded:
    model/decoding.py CachedLM.describe)}] for samples seed … seed+N−1."""
    prompt_t = torch.tensor([prompt_ids(sp, prompt)], dtype=torch.int64)            # (1, t)
    out = []
    with tqdm(total=num_samples * max_new_tokens, unit="tok", desc="generating", disable=not progress,
              file=sys.stderr) as bar:
        for k in range(num_samples):
            lm = CachedLM(model, use_cache=use_cache, on_call=lambda: bar.update(1))
            tokens = sample(lm, prompt_t, max_new_tokens, temperature, top_k, top_p, seed + k)   # (1, t + new)
            new = tokens[0, prompt_t.shape[1]:].tolist()
            # Decoded together with the prompt: a first piece "▁word" keeps its space (alone it would lose it).
            head = decode(sp, prompt_t[0, 1:].tolist())
            text = decode(sp, prompt_t[0, 1:].tolist() + new)[len(head):]
            out.append({"seed": seed + k, "prompt": head, "text": text, "ids": new, "decoding": lm.describe()})
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="release directory or DeepSpeed run / checkpoints / step_* directory")
    p.add_argument("--prompt", default=None, help="text to continue (default: the opening words of a validation "
                                                  "document of the run's shards; without them, a generic prompt)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per sample (default 64)")
    p.add_argument("--temperature", type=float, default=1.0, help="softmax temperature; 0 = greedy (default 1.0)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="nucleus: the smallest set with probability ≥ p")
    p.add_argument("--seed", type=int, default=0, help="seed of the first sample; sample k uses seed + k (default 0)")
    p.add_argument("--num-samples", type=int, default=1, help="how many continuations (default 1)")
    p.add_argument("--tokenizer", metavar="PATH",
                   help="tokenizer.model or tokenizer.json, if the checkpoint carries none")
    p.add_argument("--no-cache", action="store_true", help="recompute the whole prefix at every step")
    p.add_argument("--json", action="store_true", help="one JSON object per sample instead of text")
    add_remote_arguments(p)
    p.add_argument("--quiet", action="store_true", help="no progress bar and no timing line")
    return p.parse_args(argv)


@one_line_errors
def main(argv=None) -> int:
    args = parse_args(argv)
    check(args)
    model, sp, info = load(args.checkpoint, args.tokenizer)
    if args.prompt is None:   # the run's shards, read with its data.ca_bundle and headers (or the flags)
        configure_remote(args, run_data(info["source"]))
        args.prompt, where = default_prompt(info, sp)
        print(f"prompt {args.prompt!r}: {where}", file=sys.stderr)
    t0 = time.perf_counter()
    samples = generate(model, sp, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                       args.seed, args.num_samples, not args.no_cache, progress=not args.quiet)
    seconds = time.perf_counter() - t0
    for s in samples:
        if args.json:
            print(json.dumps({**s, "source": info["source"], "step": info["step"]}))
        else:
            print(f"--- sample seed={s['seed']} ---\n{s['prompt']}{s['text']}")
    if not args.quiet:
        n = args.num_samples * args.max_new_tokens
        mode = "; ".join(dict.fromkeys(s["decoding"] for s in samples))   # what CachedLM did, not what was asked
        print(f"{n} tokens in {seconds:.2f} s ({n / max(seconds, 1e-9):.1f} tokens/s, {mode}) from {info['source']} "
              f"(step {info['step']})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
