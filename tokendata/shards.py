"""The shard format: what tools/make_shards.py writes and tokendata/stream.py reads, defined here once, and the checks
of a shard set against a model (`check_vocab`, `check_seq_len`; training's length rule: tokendata/lengths.py).

    <shard_dir>/manifest.json     {"format": 2, "seq_len": n, "vocab_size": V, "eos_id", "tokenizer": "tokenizer.model"
                                   | "tokenizer.json", "tokenizer_kind": "sentencepiece" | "huggingface",
                                   "tokenizer_sha256", "dtype": "uint16" | "int32", "hash": "xxh3_128", "seed",
                                   "val_fraction", "inputs", "splits": {"train" | "val": {"samples", "tokens",
                                   "shards": [{"name", "samples", "first_id", "first_index", "bytes", "hash"}, ...]}}}
    <shard_dir>/<split>-NNNNNN.tar  a tar of ONE member "<split>-NNNNNN.tokens.u16" (or .tokens.i32): the shard's
                                   samples back to back, each n + 1 little-endian token ids, a window of the tokenized
                                   stream (documents joined by eos) whose last id starts the next one. Sample k of
                                   the shard is "<split>-NNNNNN-kkkkkk": ids [k(n+1), (k+1)(n+1)) of the member.
                                   One 512-byte header, the payload padded to 512, two zero blocks, no record
                                   padding: shard bytes / token bytes ≤ 1 + 2048 / payload (≤ 1.01 at 1000 samples
                                   of n 128). "hash": the HASH of the whole file, checked when a shard is read.
    <shard_dir>/tokenizer.model   a copy of the sentencepiece model the tokens come from (or tokenizer.json and
                                   tokenizer_config.json of a Hugging Face tokenizer: tokendata/tokenizer.py)

Format 1 (still read): each sample its own tar member "<split>-NNNNNN-kkkkkk.tokens.u16", written by Python's tarfile
(a PAX header per member, record padding); no "hash", no "tokenizer_kind" (sentencepiece).
"""
from __future__ import annotations

import glob
import hashlib
import io
import json
import os
import tarfile

import numpy as np
import xxhash

from tokendata import remote
from tokendata.remote import DataError  # defined beside the opener that raises it first


def dtype_for(vocab_size: int) -> str:
    """The manifest dtype of token ids below vocab_size."""
    return "uint16" if vocab_size <= 65535 else "int32"


MANIFEST_FORMAT, READ_FORMATS = 2, (1, 2)
HASH = "xxh3_128"   # 15 GB/s against blake2b's 0.9 GB/s where measured (docs/benchmarks.md); both are read
HASHES = {"xxh3_128": xxhash.xxh3_128_hexdigest,
          "blake2b": lambda data: hashlib.blake2b(data, digest_size=16).hexdigest()}
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
        except remote.CredentialError:
            raise   # the settings, not the location
        except DataError as e:   # an outage stays one (FetchFailed)
            raise type(e)(f"{e}: is data.shard_dir={shard_dir} right? (shards written with {MAKE} --out, "
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
    need(isinstance(m, dict) and m.get("format") in READ_FORMATS,
          f"{bad} expected a JSON object with \"format\": {MANIFEST_FORMAT} (or 1): rebuild it with {MAKE}")
    v2 = m["format"] >= 2
    need(not v2 or m.get("hash") in HASHES, f"{bad} \"hash\" must be one of {sorted(HASHES)}, got {m.get('hash')!r}")
    for key in ("seq_len", "vocab_size"):
        need(isinstance(m.get(key), int) and m[key] > 0,
              f"{bad} \"{key}\" must be a positive integer, got {m.get(key)!r}")
    need(m.get("dtype") in DTYPES, f"{bad} \"dtype\" must be one of {sorted(DTYPES)}, got {m.get('dtype')!r}")
    need(isinstance(m.get("tokenizer"), str), f"{bad} \"tokenizer\" must be a file name, got {m.get('tokenizer')!r}")
    need(isinstance(m.get("splits"), dict) and "train" in m["splits"], f"{bad} no \"splits\" with a \"train\" entry")
    for name, split in m["splits"].items():
        ok = isinstance(split, dict) and isinstance(split.get("shards"), list) and all(
            isinstance(s, dict) and isinstance(s.get("name"), str) and isinstance(s.get("samples"), int)
            and s["samples"] > 0 and isinstance(s.get("bytes", 1), int)
            and (not v2 or isinstance(s.get("bytes"), int) and isinstance(s.get("hash"), str)) for s in split["shards"])
        need(ok, f"{bad} split \"{name}\" needs \"shards\": [{{\"name\": str, \"samples\": int > 0, "
                  f"\"bytes\": int" + (", \"hash\": str" if v2 else " (optional)") + "}, ...]")
        total = sum(s["samples"] for s in split["shards"])
        need(split.get("samples") == total,
              f"{bad} split \"{name}\" says {split.get('samples')} samples but its shards hold {total}")
    return dict(m, shard_dir=shard_dir)


def tokenizer_path(manifest):
    return remote.join(manifest["shard_dir"], manifest["tokenizer"])


def check_vocab(manifest, model_vocab_size) -> str | None:
    """A DataError where the model has fewer ids than the tokenizer; where it has more (padding, Megatron's
    make-vocab-size-divisible-by: parallel.tp splits the vocabulary evenly), a note for the log; else None."""
    v = manifest["vocab_size"]
    need(model_vocab_size >= v,
          f"data {manifest['shard_dir']} has vocab_size={v} (tokenizer {tokenizer_path(manifest)}) but "
          f"model.vocab_size={model_vocab_size}: set model.vocab_size={v} (or more) or rebuild the shards")
    if model_vocab_size > v:
        return (f"model.vocab_size={model_vocab_size} is above the tokenizer's {v} ids ({tokenizer_path(manifest)}):"
                f" ids {v}..{model_vocab_size - 1} are padding, never in the data")
    return None


def check_seq_len(manifest: dict, max_seq_len: int) -> None:
    """The rule between shards of n tokens a sample and a model of L = max_seq_len positions for evaluation, a
    DataError that names both and the fix where it fails: each sample is scored in one forward pass, which a model of
    L positions can do for any n ≤ L. (Training cuts or joins samples to L: tokendata/lengths.py.)"""
    n, where = manifest["seq_len"], manifest["shard_dir"]
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


def content_hash(data: bytes, algorithm: str = HASH) -> str:
    return HASHES[algorithm](data)


def tar_header(member: str, size: int) -> bytes:
    """The ustar header (mtime 0, no PAX) of a tar's one member of `size` bytes."""
    info = tarfile.TarInfo(member)
    info.size, info.mtime, info.mode = size, 0, 0o644
    return info.tobuf(format=tarfile.USTAR_FORMAT)


def tar_file(member: str, payload: bytes) -> bytes:
    """A tar of one member: its header, the payload padded to 512 bytes, two zero blocks."""
    return tar_header(member, len(payload)) + payload + bytes(-len(payload) % 512 + 1024)


class SplitWriter:
    """Writes one split's samples into numbered shards (format 2), each written whole once it is full: a block of
    them (`write_block`: rows of a 2-D array, copied once), or bytes filled in place (`reserve`, then `commit`)."""

    def __init__(self, out_dir, split, samples_per_shard, dtype):
        self.out_dir, self.split, self.per_shard = out_dir, split, samples_per_shard
        self.member = DTYPES[dtype][1]
        self.shards = []  # manifest records of the shards written so far
        self.samples = 0
        # the open shard's payload: one buffer, kept from shard to shard (a fresh one would be faulted in anew)
        self.buffer, self.used = np.empty(0, dtype=np.uint8), 0

    @property
    def room(self) -> int:
        """Samples the open shard (or the next) still takes."""
        return self.per_shard - (self.shards[-1]["samples"] if self.used else 0)

    def write_block(self, block: np.ndarray, count: int):
        """`count` (≤ room) samples back to back: an array of their ids, copied once, into place."""
        self.reserve(block.nbytes).view(block.dtype).reshape(block.shape)[...] = block
        self.commit(count, block.nbytes)

    def reserve(self, nbytes: int) -> np.ndarray:
        """The open shard's next `nbytes` (uint8), to be filled in place and then commit()ted."""
        if not self.used:
            self.shards.append({"name": f"{self.split}-{len(self.shards):06d}.tar", "samples": 0,
                                "first_id": f"{self.split}-{len(self.shards):06d}-000000", "first_index": self.samples})
        end = self.used + nbytes
        if end > len(self.buffer):
            grown = np.empty(max(end, 2 * len(self.buffer)), dtype=np.uint8)
            grown[:self.used] = self.buffer[:self.used]
            self.buffer = grown
        return self.buffer[self.used:end]

    def commit(self, count: int, nbytes: int):
        """The `count` samples of the `nbytes` last reserved are in place."""
        self.used += nbytes
        self.shards[-1]["samples"] += count
        self.samples += count
        if self.shards[-1]["samples"] == self.per_shard:
            self.close()

    def close(self):
        """Write the open shard: its tar (tar_file's bytes) written and hashed piece by piece, never joined."""
        if self.used:
            record, size = self.shards[-1], self.used
            header = tar_header(f"{record['name'][:-len('.tar')]}.{self.member}", size)
            pieces = [header, memoryview(self.buffer[:size]), bytes(-size % 512 + 1024)]
            digest, f = xxhash.xxh3_128(), remote.writer(remote.join(self.out_dir, record["name"]))
            for piece in pieces:
                digest.update(piece)
                f.write(piece)
            f.close()
            record.update(bytes=len(header) + size + len(pieces[-1]), hash=digest.hexdigest())
            self.used = 0


def sample_index(data: bytes, manifest: dict, shard: dict, url: str, nbytes: int | None = None) -> list[tuple]:
    """(sample id, byte offset in the file) of every sample of one shard's bytes, in order: sample k is
    data[offset:offset + nbytes]. A DataError (naming `url`) where the file is not what the manifest says. nbytes: each
    sample's size (default (n+1) ids)."""
    member = DTYPES[manifest["dtype"]][1]
    nbytes = nbytes or (manifest["seq_len"] + 1) * np.dtype(DTYPES[manifest["dtype"]][0]).itemsize
    count, stem = shard["samples"], shard["name"][:-len(".tar")] if shard["name"].endswith(".tar") else shard["name"]
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:   # uncompressed: one error, not four
            if manifest["format"] == 1:   # a member a sample: "<stem>-kkkkkk.<member>"
                found = [(info.name[:-len(member) - 1], info.offset_data, info.size) for info in tar
                         if info.isfile() and info.name.endswith(f".{member}")]
            else:
                info = tar.next()
                found = [(info.name, info.offset_data, info.size)] if info is not None and info.isfile() else []
    except (tarfile.TarError, OSError) as e:
        raise DataError(f"shard {url} is unreadable ({type(e).__name__}: {str(e).splitlines()[0]})") from None
    if manifest["format"] == 1:
        # tarfile ends quietly at a damaged header after the first, so a cut or corrupted shard may just look short
        need(len(found) == count, f"shard {url} holds {len(found)} samples but manifest.json says {count}")
        for key, _, size in found:
            need(size == nbytes, f"shard {url}: sample {key} has {size} bytes of {member}, not {nbytes} (seq_len+1 "
                                 f"tokens)")
        return [(key, offset) for key, offset, _ in found]
    need(found and found[0][0] == f"{stem}.{member}",
         f"shard {url} does not hold the member {stem}.{member} (found {found[0][0] if found else 'none'})")
    (_, first, size), = found
    need(size == count * nbytes and first + size <= len(data),
         f"shard {url} holds {min(size, len(data) - first)} bytes of tokens but manifest.json says {count} samples of "
         f"{nbytes} bytes")
    return [(f"{stem}-{k:06d}", first + k * nbytes) for k in range(count)]


def samples_of(data: bytes, manifest: dict, shard: dict, url: str, nbytes: int | None = None) -> list[dict]:
    """The samples of one shard's bytes, in order: {"__key__": sample id, member: its bytes, "__url__"}
    (`sample_index`)."""
    member = DTYPES[manifest["dtype"]][1]
    nbytes = nbytes or (manifest["seq_len"] + 1) * np.dtype(DTYPES[manifest["dtype"]][0]).itemsize
    view = memoryview(data)
    return [{"__key__": key, member: bytes(view[offset:offset + nbytes]), "__url__": url}
            for key, offset in sample_index(data, manifest, shard, url, nbytes)]


def shard_samples(manifest: dict, shard: dict) -> list[tuple[str, np.ndarray]]:
    """(sample id, token ids) of every sample of one shard, read whole (no verification: tools and tests)."""
    url = remote.join(manifest["shard_dir"], shard["name"])
    dtype, member = DTYPES[manifest["dtype"]]
    data, _ = remote.fetch(url, shard.get("bytes"))
    return [(s["__key__"], np.frombuffer(s[member], dtype=dtype).astype(np.int64))
            for s in samples_of(data, manifest, shard, url)]


def first_sample(manifest: dict, split: str = "val"):
    """The token ids (numpy) of the first sample of a split's first shard."""
    shards = manifest["splits"].get(split, {}).get("shards") or manifest["splits"]["train"]["shards"]
    return shard_samples(manifest, shards[0])[0][1]


def opening(ids, eos: int, n: int) -> list[int]:
    """The first n ids of the first document that starts inside `ids` (after an eos), else of `ids` itself: a neutral
    prompt taken from the data, that begins where a document does."""
    ids = [int(i) for i in ids]
    document = ids[ids.index(eos) + 1:] if eos in ids[:-1] else ids
    end = document.index(eos) if eos in document else len(document)
    return document[:min(n, end)]
