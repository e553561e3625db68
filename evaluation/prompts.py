"""Prompts as the model saw documents in training: after an eos, and generated ids back to text."""
from __future__ import annotations


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
