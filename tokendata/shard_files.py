"""Reading one shard for tokendata/stream.py: where it is fetched from and how it is checked (ShardFiles: a
directory or URL, tokendata/remote.py; data.verify) and what a bad one does (ShardReader: fail, or skip it and say so
on the next batch).

data.verify (VERIFY):
    hash  the size of every shard before training (the manifest's "bytes"), and the content hash of each shard when
          it has been fetched (the whole file is in memory then): on a mismatch the shard is fetched once more,
          bypassing data.cache_dir (a damaged local copy is replaced by the good one); if the second copy mismatches
          too, the shard is bad (data.bad_shards): "shard … has content hash xxh3_128:… but manifest.json says …".
          Shards of manifest format 1 have no hashes: checked as under size (TokenStream.notes says so once).
    size  the sizes before training, and each shard's structure when read (its member, its sample count and sizes)
    none  no size check before training (no request per shard at start); the structure when read
"""
import dataclasses
import functools
import os
import sys

from tokendata import remote
from tokendata.shards import MAKE, DataError, content_hash, need, samples_of

VERIFY = ("hash", "size", "none")


def fix(location):
    return f"rebuild {location} with {MAKE}, or set data.bad_shards=skip to train without it"


@dataclasses.dataclass(frozen=True)
class ShardFiles:
    """Where a stream's shards are (data.shard_dir: a path or URL, tokendata/remote.py), how they are fetched and
    checked: picklable, so each DataLoader worker fetches for itself. `manifest`: read_manifest's; `cache_dir`:
    optional local copies, keyed by name and size; `verify`: one of VERIFY."""
    location: str
    manifest: dict
    cache_dir: str | None = None
    verify: str = "hash"

    def __post_init__(self):
        need(self.verify in VERIFY, f"data.verify={self.verify!r} is not one of {', '.join(VERIFY)}")

    @functools.cached_property
    def records(self) -> dict:
        """The manifest's record of each shard, by name."""
        return {s["name"]: s for split in self.manifest["splits"].values() for s in split["shards"]}

    @property
    def hashing(self) -> bool:
        return self.verify == "hash" and self.manifest["format"] >= 2

    def url(self, name):
        return remote.join(self.location, name)

    def load(self, name, count, member, nbytes):
        """(the samples of one shard in file order, {"__key__", member: bytes, "__url__"}, each checked to hold
        `member` of `nbytes` bytes; the retries the fetch took). The file is fetched whole before it is parsed, so a
        retried fetch gives each sample once. Any fault in it is a DataError naming it."""
        record, url, remedy = self.records[name], self.url(name), fix(self.location)
        size = record.get("bytes")
        cache = os.path.join(self.cache_dir, f"{name}.{size}") if self.cache_dir and size is not None else None
        try:
            data, retries = remote.fetch(url, size, cache)
            if self.hashing and content_hash(data, self.manifest["hash"]) != record["hash"]:
                data, again = remote.fetch(url, size, cache, refresh=True)   # past the cache; a good copy replaces it
                retries += again
                got = content_hash(data, self.manifest["hash"])
                need(got == record["hash"],
                     f"shard {url} has content hash {self.manifest['hash']}:{got} but manifest.json says "
                     f"{self.manifest['hash']}:{record['hash']} (read twice" + (", the second time past data.cache_dir"
                                                                              if cache else "") + ")")
            samples = samples_of(data, self.manifest, dict(record, samples=count), url, nbytes)
        except DataError as e:
            raise DataError(f"{e}: {remedy}") from None
        return samples, retries


class ShardReader:
    """Reads the shards of one iterator. Under bad_shards="skip" a bad shard gives no samples, is warned about on
    stderr once and not reopened. What a sample's reader learned rides on the next sample out (`tag`): the URLs of
    shards found bad, and the retries that fetches took, so the batch that takes that sample reports them: the only
    way out of a DataLoader worker that keeps the batch order. Shards in `known_bad` are bad from the start (found
    while reading before a resume) and not reported again. `fetch` touches no state (a prefetch thread calls it);
    `accept` does the bookkeeping in the reading thread."""

    def __init__(self, files, fmt, bad_shards, split, n_shards, known_bad=()):
        self.files, self.fmt, self.bad_shards, self.split, self.n_shards = files, fmt, bad_shards, split, n_shards
        self.bad = {files.url(name) for name in known_bad}   # URLs found bad (known_bad: names, found before)
        self.skipped, self.retries = [], 0  # URLs found bad not yet handed on; retries

    def fetch(self, name, count):
        """(samples, retries), or (the DataError, retries) for a bad shard."""
        if self.files.url(name) in self.bad:
            return [], 0
        try:
            return self.files.load(name, count, *self.fmt)
        except DataError as e:
            return e, 0

    def accept(self, name, fetched):
        samples, retries = fetched
        self.retries += retries
        if not isinstance(samples, DataError):
            return samples
        if self.bad_shards != "skip":
            raise samples
        url = self.files.url(name)
        what = str(samples).removesuffix(f": {fix(self.files.location)}")
        print(f"warning: {what}; skipping it (data.bad_shards=skip)", file=sys.stderr, flush=True)
        self.bad.add(url)
        self.skipped.append(url)
        need(len(self.bad) < self.n_shards,  # else the reader would go round for ever without a sample
              f"every {self.split} shard in {self.files.location} is bad (see the warnings above): rebuild it "
              f"with {MAKE}")
        return []

    def read(self, name, count):
        return self.accept(name, self.fetch(name, count))

    def tag(self, sample):
        if self.skipped or self.retries:
            sample, self.skipped, self.retries = dict(sample, __skipped__=self.skipped, __retries__=self.retries), [], 0
        return sample
