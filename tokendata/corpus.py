"""Reading a text corpus: plain or gzip files, one document (paragraph) per line, blank lines skipped — the one
definition that the tokenizer trainer, the shard writer, the task builder and evaluation on text files share."""
from __future__ import annotations

import gzip
import io
import os
import sys

from tqdm import tqdm

from tokendata.shards import DataError


def check_inputs(paths):
    for path in paths:
        if not os.path.isfile(path):
            raise DataError(f"input file not found: {path}")


def open_text(raw):
    """A text stream over a binary file object, gunzipping when the file starts with the gzip magic bytes."""
    if raw.peek(2)[:2] == b"\x1f\x8b":
        return gzip.open(raw, "rt", encoding="utf-8", errors="replace")
    return io.TextIOWrapper(raw, encoding="utf-8", errors="replace")


def iter_documents(paths, desc="reading", progress=True):
    """Yield the non-empty lines (stripped) of all files in turn, with a tqdm bar over the bytes read from disk."""
    total = sum(os.path.getsize(p) for p in paths)
    with tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=not progress, file=sys.stderr) as bar:
        for path in paths:
            with open(path, "rb") as raw:
                done = 0
                for line in open_text(raw):
                    pos = raw.tell()  # position in the file on disk: compressed bytes for .gz, so the total is right
                    if pos != done:
                        bar.update(pos - done)
                        done = pos
                    line = line.strip()
                    if line:
                        yield line


def documents(text: str) -> list[str]:
    """The documents of a text: its non-empty lines, stripped."""
    return [line.strip() for line in text.splitlines() if line.strip()]


def read_texts(paths: list[str]) -> list[str]:
    """Each file's whole text, plain or gzip."""
    texts = []
    for path in paths:
        if not os.path.isfile(path):
            raise DataError(f"text file not found: {path}")
        with open(path, "rb") as raw:
            texts.append(open_text(raw).read())
    return texts
