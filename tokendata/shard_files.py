"""Reading one shard for tokendata/stream.py: where it is fetched from and how it is checked (ShardFiles: a
directory or URL, tokendata/remote.py; data.verify) and what a bad one does (ShardReader: fail, or skip it and say so
on the next batch).

Nothing is requested before training but each source's manifest: a shard's size is the manifest's "bytes", and a
shard is checked when it is read (data.verify, VERIFY):
    hash  its size (a missing, empty or cut shard is bad) and the content hash of the whole file, once fetched: on a
          mismatch the shard is fetched once more, bypassing data.cache_dir (a damaged local copy is replaced by the
          good one); if the second copy mismatches too, the shard is bad (data.bad_shards): "shard … has content hash
          xxh3_128:… but manifest.json says …". Shards of manifest format 1 have no hashes: checked as under size
          (TokenStream.notes says so once).
    size  its size, and its structure (its member, its sample count and sizes)
    none  its structure only
"""
import dataclasses
import functools
import hashlib
import os
import re
import sys

from tokendata import remote
from tokendata.shards import MAKE, DataError, content_hash, need, sample_index, samples_of

VERIFY = ("hash", "size", "none")


def fix(location):
    return f"rebuild {location} with {MAKE}, or set data.bad_shards=skip to train without it"


def folder_for(location: str) -> str:
    """A folder name unique to a shard location, readable: shards of two sources may share names and sizes."""
    tail = re.sub(r"[^\w.-]", "_", location.rstrip("/").rsplit("/", 1)[-1])[-40:]
    return f"{tail}-{hashlib.sha1(location.encode()).hexdigest()[:10]}"


@dataclasses.dataclass
class Loaded:
    """One shard, fetched and checked, to be read sample by sample from a local file: `path` (the source's own file,
    data.cache_dir's copy, or a spilled copy: `spilled`, deleted when no stream needs it), where its samples are
    (`locate`), and the retries its fetch took. Small: a reader keeps one for each shard of the windows it reads."""
    path: str
    index: tuple   # (stem, first byte, sample bytes): sample k is "<stem>-kkkkkk" at first + k·bytes; or [(id, byte)]
    retries: int
    spilled: bool = False

    def locate(self, k: int) -> tuple[str, int]:
        """(sample id, byte offset) of sample k."""
        if isinstance(self.index, list):   # manifest format 1: a tar member a sample
            return self.index[k]
        stem, first, nbytes = self.index
        return f"{stem}-{k:06d}", first + k * nbytes


@dataclasses.dataclass(frozen=True)
class ShardFiles:
    """Where a stream's shards are (data.shard_dir: a path or URL, tokendata/remote.py), how they are fetched and
    checked: picklable, so each DataLoader worker fetches for itself. `manifest`: read_manifest's; `cache_dir`:
    optional local copies of remote shards, keyed by source, name and size; `verify`: one of VERIFY."""
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

    def cache_path(self, name: str) -> str | None:
        """The local copy of a remote shard in data.cache_dir (None: no cache, a local source, or no size known)."""
        size = self.records[name].get("bytes")
        if not self.cache_dir or size is None or not remote.is_remote(self.location):
            return None
        return os.path.join(self.cache_dir, folder_for(self.location), f"{name}.{size}")

    def fetch_checked(self, name) -> tuple[bytes, int]:
        """(the whole file, retries), checked as data.verify says; a DataError naming it and the fix."""
        record, url = self.records[name], self.url(name)
        size, cache = record.get("bytes"), self.cache_path(name)
        try:
            data, retries = remote.fetch(url, size, cache)
            if self.verify != "none" and size is not None and len(data) != size:
                need(data, f"shard {url} is empty (0 bytes)")
                raise DataError(f"shard {url} has {len(data)} bytes, manifest.json says {size}" +
                                (" (truncated?)" if len(data) < size else " (overwritten?)"))
            if self.hashing and content_hash(data, self.manifest["hash"]) != record["hash"]:
                data, again = remote.fetch(url, size, cache, refresh=True)   # past the cache; a good copy replaces it
                retries += again
                got = content_hash(data, self.manifest["hash"])
                need(got == record["hash"],
                     f"shard {url} has content hash {self.manifest['hash']}:{got} but manifest.json says "
                     f"{self.manifest['hash']}:{record['hash']} (read twice" + (", the second time past data.cache_dir"
                                                                              if cache else "") + ")")
        except remote.FetchFailed:
            raise   # an outage: the shard is not bad
        except DataError as e:
            raise DataError(f"{e}: {fix(self.location)}") from None
        return data, retries

    def load(self, name, count, member, nbytes):
        """(the samples of one shard in file order, {"__key__", member: bytes, "__url__"}, each checked to hold
        `member` of `nbytes` bytes; the retries the fetch took). The file is fetched whole before it is parsed, so a
        retried fetch gives each sample once. Any fault in it is a DataError naming it."""
        data, retries = self.fetch_checked(name)
        try:
            samples = samples_of(data, self.manifest, dict(self.records[name], samples=count), self.url(name), nbytes)
        except DataError as e:
            raise DataError(f"{e}: {fix(self.location)}") from None
        return samples, retries

    def open(self, name, count, nbytes, spill_dir) -> Loaded:
        """One shard fetched, checked and indexed, left on the local disk (Loaded): a local source's file where it
        is, a remote one's copy in data.cache_dir, or else written to `spill_dir()` (a callable: the folder is made
        only when needed). Its bytes are not kept."""
        data, retries = self.fetch_checked(name)
        url = self.url(name)
        try:
            index = sample_index(data, self.manifest, dict(self.records[name], samples=count), url, nbytes)
        except DataError as e:
            raise DataError(f"{e}: {fix(self.location)}") from None
        if self.manifest["format"] >= 2:   # evenly spaced: three numbers, not a list
            index = (index[0][0].rsplit("-", 1)[0], index[0][1], nbytes) if index else ("", 0, nbytes)
        if not remote.is_remote(self.location):
            return Loaded(url, index, retries)
        cache = self.cache_path(name)
        if cache is not None and os.path.isfile(cache) and os.path.getsize(cache) == len(data):
            return Loaded(cache, index, retries)
        path = os.path.join(spill_dir(), folder_for(self.location) + "-" + name)
        remote.write_whole(path, data)
        return Loaded(path, index, retries, spilled=True)


class ShardReader:
    """Reads the shards of one iterator. Under bad_shards="skip" a bad shard gives no samples, is warned about on
    stderr once and not reopened; an outage (FetchFailed) is raised, never recorded. What a sample's reader learned
    rides on the next sample out (`tag`): the URLs of shards found bad, and the retries that fetches took, so the
    batch that takes that sample reports them: the only way out of a DataLoader worker that keeps the batch order.
    Shards in `known_bad` are bad from the start (found while reading before a resume) and not reported again. `fetch` touches no state (a prefetch thread calls it);
    `accept` does the bookkeeping in the reading thread."""

    def __init__(self, files, fmt, bad_shards, split, n_shards, known_bad=()):
        self.files, self.fmt, self.bad_shards, self.split, self.n_shards = files, fmt, bad_shards, split, n_shards
        self.bad = {files.url(name) for name in known_bad}   # URLs found bad (known_bad: names, found before)
        self.skipped, self.retries = [], 0  # URLs found bad not yet handed on; retries

    def fetch(self, name, count):
        """(samples, retries), or (the DataError, retries) for a bad shard or an outage (FetchFailed)."""
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
        if self.bad_shards != "skip" or isinstance(samples, remote.FetchFailed):   # an outage is no bad shard
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
