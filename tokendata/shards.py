"""The shard format: what tools/make_shards.py writes and tokendata/stream.py reads, defined here once, and the checks
of a shard set against a model (`check_vocab`, `check_seq_len`).

    <shard_dir>/manifest.json     {"format": 1, "seq_len": n, "vocab_size": V, "eos_id", "tokenizer": "tokenizer.model",
                                   "tokenizer_sha256", "dtype": "uint16" | "int32", "seed", "val_fraction", "inputs",
                                   "splits": {"train" | "val": {"samples", "tokens", "shards": [{"name", "samples",
                                   "first_id", "first_index", "bytes"}, ...]}}}
    <shard_dir>/<split>-NNNNNN.tar  WebDataset tars; sample k of shard NNNNNN is "<split>-NNNNNN-kkkkkk" with one
                                   member "tokens.u16" (or "tokens.i32"): n + 1 little-endian token ids, a window of
                                   the tokenized stream (documents joined by eos) whose last id starts the next one
    <shard_dir>/tokenizer.model   a copy of the sentencepiece model the tokens come from
"""
from __future__ import annotations

import glob
import io
import json
import os
import tarfile

import numpy as np

from tokendata import remote
from tokendata.remote import DataError  # defined beside the opener that raises it first


def dtype_for(vocab_size: int) -> str:
    """The manifest dtype of token ids below vocab_size."""
    return "uint16" if vocab_size <= 65535 else "int32"


MANIFEST_FORMAT = 1
DTYPES = {"uint16": ("<u2", "tokens.u16"), "int32": ("<i4", "tokens.i32")}  # manifest dtype -> (numpy, tar member)
MAKE = "tools/make_shards.py"


def need(cond, msg):
    if not cond:
        raise DataError(msg)


def read_manifest(shard_dir):
    """Load and validate <shard_dir>/manifest.json (shard_dir: a directory or a URL, tokendata/remote.py); the result
    also carries "shard_dir"."""
    path = remote.join(shard_dir, "manifest.json")
    if remote.is_remote(shard_dir):
        try:
            text = remote.fetch(path, what="manifest")[0]
        except DataError as e:
            raise DataError(f"{e}: is data.shard_dir={shard_dir} right? (shards written with {MAKE} --out, "
                            "manifest.json beside them)") from None
    else:
        need(os.path.isdir(shard_dir), f"shard directory {shard_dir} does not exist: build it with {MAKE} --out ...")
        if not os.path.isfile(path):
            tars = glob.glob(os.path.join(shard_dir, "*.tar"))
            need(tars, f"shard directory {shard_dir} is empty (no manifest.json, no .tar shards): build it with {MAKE}")
            raise DataError(f"{shard_dir} has {len(tars)} shards but no manifest.json (an unfinished {MAKE} run?): "
                            "rebuild it")
        with open(path, "rb") as f:
            text = f.read()
    try:
        m = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        where = f"at line {e.lineno}" if isinstance(e, json.JSONDecodeError) else "(not UTF-8 text)"
        raise DataError(f"malformed manifest {path}: {getattr(e, 'msg', 'bad bytes')} {where}: rebuild it with "
                        f"{MAKE}") from None
    bad = f"malformed manifest {path}:"
    need(isinstance(m, dict) and m.get("format") == MANIFEST_FORMAT,
          f"{bad} expected a JSON object with \"format\": {MANIFEST_FORMAT}: rebuild it with {MAKE}")
    for key in ("seq_len", "vocab_size"):
        need(isinstance(m.get(key), int) and m[key] > 0,
              f"{bad} \"{key}\" must be a positive integer, got {m.get(key)!r}")
    need(m.get("dtype") in DTYPES, f"{bad} \"dtype\" must be one of {sorted(DTYPES)}, got {m.get('dtype')!r}")
    need(isinstance(m.get("tokenizer"), str), f"{bad} \"tokenizer\" must be a file name, got {m.get('tokenizer')!r}")
    need(isinstance(m.get("splits"), dict) and "train" in m["splits"], f"{bad} no \"splits\" with a \"train\" entry")
    for name, split in m["splits"].items():
        ok = isinstance(split, dict) and isinstance(split.get("shards"), list) and all(
            isinstance(s, dict) and isinstance(s.get("name"), str) and isinstance(s.get("samples"), int)
            and s["samples"] > 0 and isinstance(s.get("bytes", 1), int) for s in split["shards"])
        need(ok, f"{bad} split \"{name}\" needs \"shards\": [{{\"name\": str, \"samples\": int > 0, "
                  f"\"bytes\": int (optional)}}, ...]")
        total = sum(s["samples"] for s in split["shards"])
        need(split.get("samples") == total,
              f"{bad} split \"{name}\" says {split.get('samples')} samples but its shards hold {total}")
    return dict(m, shard_dir=shard_dir)


def tokenizer_path(manifest):
    return remote.join(manifest["shard_dir"], manifest["tokenizer"])


def check_vocab(manifest, model_vocab_size):
    v = manifest["vocab_size"]
    need(v == model_vocab_size,
          f"data {manifest['shard_dir']} has vocab_size={v} (tokenizer {tokenizer_path(manifest)}) but "
          f"model.vocab_size={model_vocab_size}: set model.vocab_size={v} or rebuild the shards")


def check_seq_len(manifest: dict, max_seq_len: int, training: bool) -> None:
    """The one rule between shards of n tokens a sample and a model of L = max_seq_len positions, a DataError that
    names both and the fix where it fails. Training packs every sequence to the model's length: n == L. Evaluation
    scores each sample in one forward pass, which a model of L positions can do for any n ≤ L."""
    n, where = manifest["seq_len"], manifest["shard_dir"]
    if training:
        need(n == max_seq_len, f"shards in {where} hold sequences of {n} tokens but model.max_seq_len={max_seq_len}: "
                               f"set model.max_seq_len={n}, or rebuild the shards with {MAKE} --seq-len {max_seq_len}")
    else:
        need(n <= max_seq_len, f"shards in {where} have seq_len={n} > the model's max_seq_len={max_seq_len}: "
                               f"evaluate on shards made with {MAKE} --seq-len ≤ {max_seq_len}")


def write_file(location: str, name: str, data: bytes) -> None:
    """One whole file into a shard location (a directory, pipe:, fsspec URL: tokendata/remote.py)."""
    f = remote.writer(remote.join(location, name))
    f.write(data)
    f.close()


def write_manifest(out_dir: str, manifest: dict) -> None:
    """manifest.json, written last; in a directory under a temporary name and renamed: a reader sees all or none."""
    if remote.is_remote(out_dir):   # an object store's upload appears whole; a pipe: command's target is its own
        return write_file(out_dir, "manifest.json", json.dumps(manifest, indent=1).encode())
    tmp = os.path.join(out_dir, "manifest.json.tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
    os.replace(tmp, os.path.join(out_dir, "manifest.json"))


class SplitWriter:
    """Writes one split's samples into numbered tar shards, opening the next shard when one is full."""

    def __init__(self, out_dir, split, samples_per_shard, dtype):
        self.out_dir, self.split, self.per_shard = out_dir, split, samples_per_shard
        self.member = DTYPES[dtype][1]
        self.shards = []  # manifest records of the shards written so far
        self.samples = 0
        self.tar = self.file = None

    def write(self, payload):
        if self.tar is None:
            import webdataset as wds  # loaded already by make_shards(); not at the top, so --help and errors are quick

            index = len(self.shards)
            name = f"{self.split}-{index:06d}.tar"
            # mtime fixed and no encoder: the same input gives byte-identical shards
            self.file = CountingWriter(remote.writer(remote.join(self.out_dir, name)))
            self.tar = wds.TarWriter(self.file, encoder=False, mtime=0.0)
            self.shards.append({"name": name, "samples": 0, "first_id": f"{self.split}-{index:06d}-000000",
                                "first_index": self.samples})
        record = self.shards[-1]
        key = f"{self.split}-{len(self.shards) - 1:06d}-{record['samples']:06d}"
        self.tar.write({"__key__": key, self.member: payload})
        record["samples"] += 1
        self.samples += 1
        if record["samples"] == self.per_shard:
            self.close()

    def close(self):
        if self.tar is not None:
            self.tar.close()
            self.file.close()
            self.shards[-1]["bytes"] = self.file.bytes  # after close: the tar's end blocks are written
            self.tar = None


class CountingWriter:
    """A binary file object that counts the bytes written through it: a shard's size wherever it goes."""

    def __init__(self, f):
        self.f, self.bytes = f, 0

    def write(self, data):
        self.bytes += len(data)
        return self.f.write(data)

    def close(self):
        self.f.close()


def first_sample(manifest: dict, split: str = "val"):
    """The token ids (numpy) of the first sample of a split's first shard, read with tarfile alone."""
    shards = manifest["splits"].get(split, {}).get("shards") or manifest["splits"]["train"]["shards"]
    dtype, member = DTYPES[manifest["dtype"]]
    data, _ = remote.fetch(remote.join(manifest["shard_dir"], shards[0]["name"]), shards[0].get("bytes"))
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        info = next(m for m in tar if m.name.endswith("." + member))
        return np.frombuffer(tar.extractfile(info).read(), dtype=dtype).astype(np.int64)


def opening(ids, eos: int, n: int) -> list[int]:
    """The first n ids of the first document that starts inside `ids` (after an eos), else of `ids` itself: a neutral
    prompt taken from the data, that begins where a document does."""
    ids = [int(i) for i in ids]
    document = ids[ids.index(eos) + 1:] if eos in ids[:-1] else ids
    end = document.index(eos) if eos in document else len(document)
    return document[:min(n, end)]
