"""Reading one shard for tokendata/stream.py: where it is fetched from (ShardFiles: a directory or URL,
tokendata/remote.py) and what a bad one does (ShardReader: fail, or skip it and say so on the next batch)."""
import dataclasses
import io
import os
import sys

from webdataset.tariterators import group_by_keys, tar_file_expander

from tokendata import remote
from tokendata.shards import MAKE, DataError, need


def fix(location):
    return f"rebuild {location} with {MAKE}, or set data.bad_shards=skip to train without it"


@dataclasses.dataclass(frozen=True)
class ShardFiles:
    """Where a stream's shards are (data.shard_dir: a path or URL, tokendata/remote.py) and how they are fetched:
    picklable, so each DataLoader worker fetches for itself. `sizes`: the manifest's bytes per shard name (None
    where an older manifest has none); `cache_dir`: optional local copies, keyed by name and size."""
    location: str
    sizes: dict
    cache_dir: str | None = None

    def url(self, name):
        return remote.join(self.location, name)

    def load(self, name, count, member, nbytes):
        """(the samples of one shard in file order, as raw bytes, each checked to hold `member` of `nbytes` bytes;
        the retries the fetch took). The file is fetched whole before it is parsed (webdataset's own tar reader), so a
        retried fetch gives each sample once. Any fault in it is a DataError naming it."""
        url, size, remedy = self.url(name), self.sizes.get(name), fix(self.location)
        cache = os.path.join(self.cache_dir, f"{name}.{size}") if self.cache_dir and size is not None else None
        try:
            data, retries = remote.fetch(url, size, cache)
        except DataError as e:
            raise DataError(f"{e}: {remedy}") from None
        try:
            samples = list(group_by_keys(tar_file_expander([{"url": url, "stream": io.BytesIO(data)}])))
        except Exception as e:  # tarfile/webdataset errors; webdataset appends its stream and url to e.args
            cause = str(e.args[0]).split(" @ ")[0] if e.args else ""
            raise DataError(f"shard {url} is unreadable ({type(e).__name__}: {cause}): {remedy}") from None
        # tarfile ends quietly at a damaged header after the first, so a cut or corrupted shard may just look short
        need(len(samples) == count, f"shard {url} holds {len(samples)} samples but manifest.json says {count}: {remedy}")
        for s in samples:
            got = len(s.get(member, b""))
            need(got == nbytes, f"shard {url}: sample {s.get('__key__')} has {got} bytes of {member}, not "
                                 f"{nbytes} (seq_len+1 tokens): {remedy}")
        return samples, retries


class ShardReader:
    """Reads the shards of one iterator. Under bad_shards="skip" a bad shard gives no samples, is warned about on
    stderr once and not reopened. What a sample's reader learned rides on the next sample out (`tag`): the URLs of
    shards found bad, and the retries that fetches took, so the batch that takes that sample reports them: the only
    way out of a DataLoader worker that keeps the batch order. `fetch` touches no state (a prefetch thread calls it);
    `accept` does the bookkeeping in the reading thread."""

    def __init__(self, files, fmt, bad_shards, split, n_shards):
        self.files, self.fmt, self.bad_shards, self.split, self.n_shards = files, fmt, bad_shards, split, n_shards
        self.bad, self.skipped, self.retries = set(), [], 0  # URLs found bad; those not yet handed on; retries

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
