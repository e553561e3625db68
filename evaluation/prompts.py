"""Prompts as the model saw documents in training: after an eos, and generated ids back to text.

A tool given no --prompt opens with the first words of a document of the run's own validation data (found through
the training config kept beside a checkpoint, a release or an export); with no shards at hand, with GENERIC_PROMPT,
and it says which.
"""
from __future__ import annotations

import os

import yaml

from tokendata.shards import DataError, first_sample, opening, read_manifest

GENERIC_PROMPT = "The"
OPENING_TOKENS = 12


def prompt_ids(sp, text: str) -> list[int]:
    """[eos] + the prompt's pieces: generation starts where a training document would."""
    return [sp.eos_id()] + sp.encode(text)


def decode(sp, ids: list[int]) -> str:
    """Text of generated ids, an eos as the newline that ended its document."""
    eos, parts, current = sp.eos_id(), [], []
    for i in ids:
        if i == eos:
            parts.append(current)
            current = []
        else:
            current.append(i)
    return "\n".join(sp.decode(p) for p in parts + [current])


def run_data(source: str) -> dict:
    """The data section of the training config kept beside a checkpoint, in a release or an export ({} if none)."""
    for name in ("config.yaml", "train_config.yaml"):
        path = os.path.join(source, name)
        if os.path.isfile(path):
            with open(path) as f:
                return (yaml.safe_load(f) or {}).get("data") or {}
    return {}


def default_prompt(info: dict, sp) -> tuple[str, str]:
    """(prompt, where it comes from) for a model loaded by evaluation.loading.load (info has its "source")."""
    data = run_data(info["source"])
    shard_dir = data.get("shard_dir") or (data.get("sources") or [{}])[0].get("path")   # a blend: its first
    if shard_dir:
        try:
            ids = opening(first_sample(read_manifest(shard_dir)), sp.eos_id(), OPENING_TOKENS)
            if ids:
                return sp.decode(ids), f"the opening of a validation document in {shard_dir}"
        except (DataError, OSError, StopIteration):
            pass
    return GENERIC_PROMPT, f"a generic prompt: no shards of {info['source']} at hand (pass --prompt)"
