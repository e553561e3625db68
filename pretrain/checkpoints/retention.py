"""Which checkpoints a run deletes after a save: all but the last `checkpoint.keep` complete ones, except every
`checkpoint.keep_every`-th step (kept for good), the ones `latest` and `latest_universal` name, and any not yet
committed (a `.partial` directory, or a tag without a verified complete.json: one being written or published).
Leftover `.partial` directories of crashed saves are removed only when older than the newest committed step: a
newer one may be a save still being written."""
from __future__ import annotations

import os
import shutil

from pretrain.checkpoints.resume import complete_tags

PARTIAL = ".partial"


def step_of_tag(tag: str) -> int | None:
    """`step_00000100` / `step_00000100.partial` → 100; None for other names."""
    name = tag[:-len(PARTIAL)] if tag.endswith(PARTIAL) else tag
    if not name.startswith("step_"):
        return None
    try:
        return int(name[len("step_"):])
    except ValueError:
        return None


def named(directory: str) -> set[str]:
    """The tags that `latest` and `latest_universal` name (never deleted)."""
    out = set()
    for name in ("latest", "latest_universal"):
        try:
            with open(os.path.join(directory, name)) as f:
                out.add(f.read().strip())
        except OSError:
            pass
    return out


def doomed(directory: str, keep: int, keep_every: int | None = None) -> list[str]:
    """The names in `directory` that retention deletes, oldest first."""
    partial = [n for n in sorted(os.listdir(directory)) if n.endswith(PARTIAL)] if os.path.isdir(directory) else []
    return choose(complete_tags(directory), partial, named(directory), keep, keep_every)


def choose(complete: list[str], unfinished: list[str], pointed: set[str], keep: int,
           keep_every: int | None = None) -> list[str]:
    """Of the committed tags `complete` (verified, oldest first) and the `unfinished` ones (not committed: being
    written, or left by a crashed save), those retention deletes, oldest first; `pointed`: what the pointers name.
    Shared by a local directory and a bucket (pretrain/checkpoints/bucket.py)."""
    protected = pointed | set(complete[-keep:])
    steps = [s for s in map(step_of_tag, protected) if s is not None]
    last = max(steps) if steps else None                    # nothing newer than what `latest` names is deleted
    out = [t for t in complete[:-keep] if t not in protected and step_of_tag(t) < last
           and not (keep_every and step_of_tag(t) % keep_every == 0)]
    newest = step_of_tag(complete[-1]) if complete else None
    if newest is not None:
        for name in sorted(unfinished):                     # leftovers of crashed saves, never a newer save's
            step = step_of_tag(name)
            if step is not None and step <= newest and name not in protected:
                out.append(name)
    return out


def prune(directory: str, keep: int, keep_every: int | None = None) -> list[str]:
    """Delete what `doomed` lists; returns it."""
    gone = doomed(directory, keep, keep_every)
    for name in gone:
        shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
    return gone
