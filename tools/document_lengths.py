#!/usr/bin/env python
"""How a shard set's documents lie in its windows: what model.document_mask changes for a model trained on it.

    python tools/document_lengths.py build/demo/shards [--split train] [--json]

A document is what an eos ends (tools/make_shards.py appends one after each). Printed: the documents' lengths (with
their eos) in the stream against the window n (the manifest's seq_len: the model's inputs), how many documents a
window holds, and what the mask changes (model/documents.py, Megatron's rule): the share of tokens whose position in
their document differs from their position in the window, and the share of causal (query, key) pairs it masks.
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch

from model.documents import dense_mask, document_ids, positions_in_documents
from tokendata.shards import DataError, read_manifest, shard_samples


def document_lengths(shard_dir: str, split: str = "train") -> dict:
    manifest = read_manifest(shard_dir)
    if split not in manifest["splits"]:
        raise DataError(f"{shard_dir} has no split {split!r}; it has {', '.join(manifest['splits'])}")
    n, eos = manifest["seq_len"], manifest["eos_id"]
    rows = [s for shard in manifest["splits"][split]["shards"] for _, s in shard_samples(manifest, shard)]
    samples = torch.from_numpy(np.stack(rows).astype(np.int64))                    # (N, n + 1): inputs and targets
    windows, stream = samples[:, :n], samples.flatten()                           # the model's inputs; the corpus
    ends = torch.nonzero(stream == eos).flatten()
    lengths = torch.diff(ends, prepend=torch.tensor([-1])).double()                # tokens of each whole document
    ids = document_ids(windows, eos)
    positions = positions_in_documents(ids)
    per_window = ids[:, -1] + 1
    causal = n * (n + 1) / 2
    kept = sum(dense_mask(ids[k:k + 256]).sum().item() for k in range(0, len(ids), 256)) / len(ids)
    return {"shard_dir": shard_dir, "split": split, "windows": len(windows), "n": n, "eos_id": eos,
            "documents": len(lengths), "length_mean": lengths.mean().item(), "length_median": lengths.median().item(),
            "length_p10": lengths.quantile(0.1).item(), "length_p90": lengths.quantile(0.9).item(),
            "length_max": int(lengths.max().item()), "longer_than_window": (lengths > n).double().mean().item(),
            "documents_per_window": per_window.double().mean().item(),
            "windows_with_one": (per_window == 1).double().mean().item(),
            "tokens_moved": (positions != torch.arange(n)).double().mean().item(),
            "position_mean": positions.double().mean().item(), "causal_pairs_masked": 1 - kept / causal}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shard_dir", help="a shard directory (tools/make_shards.py output) or URL")
    p.add_argument("--split", default="train", help="train or val (default train)")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = p.parse_args(argv)
    try:
        s = document_lengths(args.shard_dir, args.split)
    except (DataError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(s))
        return 0
    print(f"{s['shard_dir']} ({s['split']}): {s['windows']:,} windows of n = {s['n']} tokens, eos id {s['eos_id']}")
    print(f"documents: {s['documents']:,}, length with the eos: mean {s['length_mean']:.1f}, median "
          f"{s['length_median']:.0f}, 10-90% {s['length_p10']:.0f}-{s['length_p90']:.0f}, max {s['length_max']:,}; "
          f"longer than the window: {s['longer_than_window']:.1%}")
    print(f"per window: {s['documents_per_window']:.2f} documents on average; one document only: "
          f"{s['windows_with_one']:.1%}")
    print(f"under model.document_mask: {s['tokens_moved']:.1%} of the tokens sit at another position in their "
          f"document than in the window (mean {s['position_mean']:.1f}, against {(s['n'] - 1) / 2:.1f}); "
          f"{s['causal_pairs_masked']:.1%} of the causal (query, key) pairs are masked")
    return 0


if __name__ == "__main__":
    sys.exit(main())
