"""Durable writes, in one place: what makes a checkpoint either complete or not there at all.

    write_durably(path, text)   replace a small file atomically (temporary file, fsync, rename): `latest`
    record_complete(dir, step)  fsync every file of a written checkpoint, then record each one's size in complete.json
    verify(dir)                 None if every file complete.json records is there at its size, else why not
    publish(partial, final, …)  record, rename `<tag>.partial` to `<tag>`, then point `latest` at it
"""
from __future__ import annotations

import json
import os
import shutil


def verify(path: str) -> str | None:
    """None if the checkpoint directory holds every file its complete.json records, at the recorded size; else why not.
    A directory without complete.json (written before atomic saves, or by hand) is accepted as it is."""
    if not os.path.isdir(path):
        return "no such directory"
    record = os.path.join(path, "complete.json")
    if not os.path.exists(record):
        return None if any(n.endswith("_model_states.pt") for n in os.listdir(path)) else "no model states"
    try:
        with open(record) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError):
        return "complete.json is unreadable"
    for name, size in files.items():
        file = os.path.join(path, name)
        if not os.path.exists(file):
            return f"{name} is missing"
        if os.path.getsize(file) != size:
            return f"{name} has {os.path.getsize(file)} bytes, {size} were written"
    return None


def record_complete(directory: str, step: int) -> None:
    """fsync every file under a written checkpoint directory, then record their sizes in complete.json, which
    `verify` checks."""
    sizes = {}
    for root, _, files in os.walk(directory):
        for name in sorted(files):
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                os.fsync(f.fileno())
            sizes[os.path.relpath(path, directory)] = os.path.getsize(path)
    write_durably(os.path.join(directory, "complete.json"), json.dumps({"step": step, "files": sizes}, indent=1))


def write_durably(path: str, text: str) -> None:
    """Replace `path` atomically: write a temporary file, fsync it, rename it over the old one."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_dir(path: str) -> None:
    """Make a directory's entries (a rename into it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(partial: str, final: str, pointer: str, step: int, after_rename=lambda: None) -> None:
    """Make a checkpoint written into `partial` the one `pointer` names, so that a crash at any moment leaves either
    the previous checkpoint named or this one complete: every file fsynced and recorded (`record_complete`), the
    directory renamed to `final` (replacing a checkpoint of the same step), then `pointer` (`latest`,
    `latest_universal`) replaced atomically by its name. `after_rename`: a hook between the two (fault tests)."""
    record_complete(partial, step)
    shutil.rmtree(final, ignore_errors=True)                   # re-saving a step (e.g. after a resume)
    os.rename(partial, final)
    fsync_dir(os.path.dirname(final) or ".")
    after_rename()
    write_durably(pointer, os.path.basename(final))
