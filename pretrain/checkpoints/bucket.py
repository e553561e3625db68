"""Checkpoints in object storage: `checkpoint.dir: s3://bucket/prefix` (gs://, az://… through the same fsspec layer).

A bucket has no rename, so a checkpoint there is committed by its last two writes, in this order:

    <prefix>/<tag>/…             every rank's files, uploaded from its local staging copy (checkpoint.staging_dir)
    <prefix>/<tag>/complete.json written by rank 0 only after every rank reported its upload done (one collective):
                                 each file's size, as every rank uploaded it
    <prefix>/latest              then replaced by the tag's name

A reader trusts a tag only with a complete.json whose every file is listed at its size (`verify`), so it never sees a
half checkpoint: a tag without one is being written or was cut off. A failed upload (after its retries) or one rank's
is one line naming the checkpoint and the cause; `latest` keeps naming the previous checkpoint and training goes on.
Loads download the tag into the staging directory (once per node: a file lock) and read it there as a local one.

Credentials, endpoint and CA bundle are the backend's own settings, as for shards in a bucket (tokendata/remote.py
`filesystem`): for s3:// the AWS variables and files (AWS_ENDPOINT_URL, AWS_CA_BUNDLE, …), never in the config, never
printed. Uploads are s3fs's (multipart above its block size); a fault of the store is retried with backoff
(tokendata/remote.py `retrying`)."""
from __future__ import annotations

import json
import os
import shutil
import uuid

from filelock import FileLock

from model import ConfigError
from pretrain import distributed
from pretrain.checkpoints import retention
from pretrain.checkpoints.durable import verify as verify_local
from pretrain.checkpoints.resume import auto_choice, layout_problem
from pretrain.checkpoints.resume import resume_point as local_resume_point
from pretrain.checkpoints.resume import rewinds as local_rewinds
from tokendata import remote

POINTERS = ("latest", "latest_universal")


def is_bucket(location: str | None) -> bool:
    """Whether a checkpoint location is an object store URL (s3://, gs://…), not a local or shared path."""
    return bool(location) and "://" in location


class Bucket:
    """A checkpoint directory in an object store: tags, pointers, uploads and downloads, each retried on faults of
    the store (an outage that outlasts the retries is remote.FetchFailed; a denied or missing object a DataError)."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.fs, self.root = remote.filesystem(self.url)
        self.root = self.root.rstrip("/")

    def key(self, *names: str) -> str:
        return "/".join([self.root, *names])

    def where(self, *names: str) -> str:
        return "/".join([self.url, *names])

    def _retried(self, what: str, name: str, call):
        def attempt(_):
            try:
                return call()
            except (FileNotFoundError, PermissionError):
                raise
            except Exception as e:   # the backend's own network and service errors
                raise remote.Transient(f"{type(e).__name__}: {e}") from None
        return remote.retrying(what, self.where(name), attempt)[0]

    # ---- small objects ------------------------------------------------------------------------------------------
    def read_text(self, name: str) -> str | None:
        """The object's text, or None where there is none."""
        try:
            return self._retried("reading", name, lambda: self.fs.cat_file(self.key(name))).decode()
        except remote.DataError as e:
            if "not found" in str(e):
                return None
            raise

    def write_text(self, name: str, text: str) -> None:
        """One PUT: an object store replaces an object whole, so a reader sees the old text or the new one."""
        self._retried("writing", name, lambda: self.fs.pipe_file(self.key(name), text.encode()))

    # ---- listings -----------------------------------------------------------------------------------------------
    def files(self) -> dict[str, dict[str, int]]:
        """{tag: {file name under the tag: size}} of every object under the prefix (one listing)."""
        self.fs.invalidate_cache()   # s3fs keeps listings: another process may have written since
        found = self._retried("listing", "", lambda: self.fs.find(self.root, detail=True))
        out: dict[str, dict[str, int]] = {}
        for path, info in found.items():
            rel = path[len(self.root):].lstrip("/")
            if "/" in rel:
                tag, name = rel.split("/", 1)
                out.setdefault(tag, {})[name] = int(info.get("size") or 0)
        return out

    def verify(self, tag: str, listed: dict[str, int] | None = None) -> str | None:
        """None if the tag's complete.json lists every file at its size; else why not (no complete.json: being
        written or cut off, unlike a local directory written before atomic saves)."""
        listed = self.files().get(tag, {}) if listed is None else listed
        if "complete.json" not in listed:
            return "no complete.json (not committed)"
        try:
            files = json.loads(self.read_text(f"{tag}/complete.json") or "")["files"]
        except (ValueError, KeyError):
            return "complete.json is unreadable"
        for name, size in files.items():
            if name not in listed:
                return f"{name} is missing"
            if listed[name] != size:
                return f"{name} has {listed[name]} bytes, {size} were written"
        return None

    def complete_tags(self, prefix: str = "step_") -> list[str]:
        listing = self.files()
        return sorted(t for t in listing if t.startswith(prefix) and self.verify(t, listing[t]) is None)

    def named(self, pointer: str = "latest") -> str | None:
        text = self.read_text(pointer)
        return text.strip() if text else None

    def newest_complete(self, announce: bool = False) -> str | None:
        """As resume.newest_complete: the tag `latest` names if it verifies, else the newest that does."""
        named = self.named()
        why = self.verify(named) if named else None
        if named and why is None:
            return named
        complete = self.complete_tags()
        if named and complete and announce:
            print(f"checkpoint {self.where(named)} is incomplete ({why}); resuming from {complete[-1]}", flush=True)
        return complete[-1] if complete else None

    def newest_universal(self) -> str | None:
        tag = self.named("latest_universal")
        return tag if tag and self.verify(tag) is None else None

    # ---- moving files -------------------------------------------------------------------------------------------
    def upload(self, local: str, tag: str, name: str) -> int:
        """Put the local file as <tag>/<name> (multipart when large, retried); its size."""
        self._retried("uploading", f"{tag}/{name}", lambda: self.fs.put_file(local, self.key(tag, name)))
        return os.path.getsize(local)

    def upload_tree(self, local_dir: str, tag: str) -> dict[str, int]:
        """Every file under a local directory, uploaded as <tag>/…: {name: size}."""
        sizes = {}
        for root, _, names in os.walk(local_dir):
            for n in sorted(names):
                path = os.path.join(root, n)
                name = os.path.relpath(path, local_dir).replace(os.sep, "/")
                if name != "complete.json":   # the commit writes the bucket's own, last
                    sizes[name] = self.upload(path, tag, name)
        return sizes

    def commit(self, tag: str, files: dict[str, int], step: int, pointer: str = "latest",
               after_record=lambda: None) -> None:
        """complete.json (the files every rank uploaded, at their sizes), then the pointer: in this order only."""
        # `commit`: this commit's own id, so that a copy downloaded of an earlier commit of the tag (a step saved
        # again after a rewind, the same sizes) is told apart by complete.json's ETag
        record = {"step": step, "files": files, "commit": uuid.uuid4().hex}
        self.write_text(f"{tag}/complete.json", json.dumps(record, indent=1))
        after_record()
        self.write_text(pointer, tag)

    def remove(self, tag: str) -> None:
        """A tag's objects, complete.json first: a reader never sees it complete with files missing."""
        for name in ("complete.json", ""):
            path = self.key(tag, name) if name else self.key(tag)
            try:
                self._retried("deleting", tag, lambda: self.fs.rm(path, recursive=not name))
            except remote.DataError:   # already gone
                pass

    def download(self, tag: str, staging: str) -> str:
        """The tag as a local directory under `staging`, downloaded once per node (ranks that share `staging` wait
        for the first under a file lock); a copy already there that verifies is used as it is."""
        local = os.path.join(staging, tag)
        os.makedirs(staging, exist_ok=True)
        with FileLock(local + ".lock"):
            # this commit of the tag, not an earlier one: complete.json holds the commit's own id (`commit`), read
            # alike from any backend (an ETag is s3's name for what gcsfs calls etag and the memory store lacks)
            stamp = self.read_text(f"{tag}/complete.json")
            if stamp is None:
                raise remote.DataError(f"reading {self.where(tag, 'complete.json')}: not found")
            mark = os.path.join(local, ".downloaded")
            if os.path.isfile(mark) and open(mark).read() == stamp and verify_local(local) is None:
                return local
            part = local + ".download"
            shutil.rmtree(part, ignore_errors=True)
            for name in self.files().get(tag, {}):
                target = os.path.join(part, *name.split("/"))
                os.makedirs(os.path.dirname(target), exist_ok=True)
                self._retried("downloading", f"{tag}/{name}", lambda: self.fs.get_file(self.key(tag, name), target))
            with open(os.path.join(part, ".downloaded"), "w") as f:
                f.write(stamp)
            shutil.rmtree(local, ignore_errors=True)
            os.rename(part, local)
        return local

    # ---- retention ----------------------------------------------------------------------------------------------
    def doomed(self, keep: int, keep_every: int | None = None) -> list[str]:
        """retention.doomed's choice on the bucket: a tag without a verified complete.json counts as a `.partial`
        (deleted only when older than the newest committed one: a newer one may be a save being uploaded)."""
        listing = self.files()
        complete = sorted(t for t in listing if t.startswith("step_") and self.verify(t, listing[t]) is None)
        unfinished = [t for t in listing if t.startswith("step_") and t not in complete]
        named = {n for n in map(self.named, POINTERS) if n}
        return retention.choose(complete, unfinished, named, keep, keep_every)

    def prune(self, keep: int, keep_every: int | None = None) -> list[str]:
        gone = self.doomed(keep, keep_every)
        for tag in gone:
            self.remove(tag)
        return gone


def resume_from(checkpoint, config: dict, world: int, announce: bool = False) -> str | None:
    """The local checkpoint directory a run resumes from (resume.resume_point), for the run's checkpoint section:
    checkpoint.dir and checkpoint.resume local, or in a bucket (the tag downloaded into checkpoint.staging_dir)."""
    if is_bucket(checkpoint.dir) or is_bucket(checkpoint.resume):
        return resume_point(checkpoint.resume, checkpoint.dir, checkpoint.staging_dir, config, world, announce)
    return local_resume_point(checkpoint.resume, checkpoint.dir, config, world, announce)


def rewinds(resume: str | None, checkpoint, config: dict, world: int) -> bool:
    """resume.rewinds for the run's checkpoint section (in a bucket: the tag resumed is not the newest there)."""
    if not is_bucket(checkpoint.dir):
        return local_rewinds(resume, checkpoint.resume, checkpoint.dir, config, world)
    if checkpoint.resume == "auto":
        return False
    store = Bucket(checkpoint.dir)
    newest = auto_choice(store.newest_complete(), store.newest_universal(), lambda: False)
    return (resume and os.path.basename(resume)) != newest


def publish_universal(local: str, location: str) -> str:
    """A universal checkpoint converted into the staging directory (checkpoint.relayout), uploaded and named by the
    bucket's `latest_universal`, committed as a save is; its URL."""
    store, tag = Bucket(location), os.path.basename(local)
    files = store.upload_tree(local, tag)
    store.commit(tag, files, int(tag.rsplit("_", 1)[-1]), pointer="latest_universal")
    return store.where(tag)


def resume_point(setting: str, location: str, staging: str, config: dict, world: int,
                 announce: bool = False) -> str | None:
    """resume.resume_point for a checkpoint directory in a bucket: the tag chosen there, downloaded into `staging`;
    its local path. `setting` may name a tag in a bucket (s3://…/step_00000100)."""
    if setting == "none":
        return None
    if not is_bucket(setting) and setting != "auto":
        return local_resume_point(setting, location, config, world, announce)
    if setting != "auto":
        url, tag = setting.rstrip("/").rsplit("/", 1)
        store = Bucket(url)
        problem = store.verify(tag)
        if problem:
            raise ConfigError(f"checkpoint.resume={setting} is not a complete checkpoint: {problem}")
        return store.download(tag, staging)
    store = Bucket(location)
    tag, uni = store.newest_complete(announce), store.newest_universal()
    regular = store.download(tag, staging) if tag else None
    chosen = auto_choice(tag, uni, lambda: layout_problem(regular, config, world))
    return store.download(chosen, staging) if chosen and chosen != tag else regular


def is_tag(path: str) -> bool:
    return path.rstrip("/").rsplit("/", 1)[-1].startswith(("step_", "universal_step_"))


def directory_of(path: str) -> str:
    """The checkpoint directory of a bucket path: the path itself, or the one above a tag."""
    return path.rstrip("/").rsplit("/", 1)[0] if is_tag(path) else path.rstrip("/")


def local_checkpoint(path: str, staging: str) -> str:
    """A checkpoint path for the tools: a local path as it is; in a bucket, a tag (…/step_00000100) or a checkpoint
    directory (its newest complete tag, or `latest_universal`'s), downloaded under `staging`."""
    if not is_bucket(path):
        return path
    if is_tag(path):
        return resume_point(path, directory_of(path), staging, {}, 0)
    store = Bucket(path)
    tag = store.newest_complete() or store.newest_universal()
    if tag is None:
        raise ConfigError(f"{path}: no complete checkpoint there (no tag with a complete.json)")
    return store.download(tag, staging)


class Saves:
    """The bucket's part of Checkpointer.save, on every rank, after the ranks wrote the checkpoint into the local
    staging directory: each uploads the files it wrote, all of them learn whether every upload succeeded (one gather
    through pretrain/distributed.py), and only then rank 0 commits (complete.json, then `latest`) and applies
    retention in the bucket. In three parts, so that an async save (checkpoint.async_save) uploads in its writer
    thread: `prepare` (collective, at the save), `uploading` (this rank alone: no collective), `conclude`
    (collective, once every rank's upload is done)."""

    def __init__(self, url: str, staging: str, lay):
        self.store, self.staging, self.lay = Bucket(url), staging, lay

    def publish(self, partial: str, tag: str, step: int, own: list[str], faults, previous: str | None,
                keep: int, keep_every: int | None, progress=lambda path: None) -> bool:
        """Whether the checkpoint written into `partial` (`own`: this rank's files in it) is committed."""
        mine, problem = self.prepare(partial, tag, own)
        report = self.uploading(mine, problem, tag, step, faults, progress)
        return self.conclude(tag, step, distributed.every_rank(report), faults, previous, keep, keep_every)

    def prepare(self, partial: str, tag: str, own: list[str]) -> tuple[list[str], str | None]:
        """Collective, before any rank uploads: rank 0 removes a crashed earlier attempt at this tag from the bucket.
        The files this rank uploads: its own (`own`, written or queued), and on rank 0 those in `partial` that no rank
        writes (DeepSpeed's recovery scripts, written outside its checkpoint engine); rank 0's problem clearing."""
        rank = self.lay.rank
        problem = self._clear(tag) if rank == 0 else None
        wrote = set().union(*distributed.every_rank([os.path.basename(p) for p in own]))
        mine = list(dict.fromkeys(own))   # (a file written twice is uploaded once)
        if rank == 0:
            mine += [os.path.join(partial, n) for n in sorted(os.listdir(partial)) if n not in wrote]
        return mine, problem

    def uploading(self, paths: list[str], problem: str | None, tag: str, step: int, faults,
                  progress=lambda path: None, stopped=lambda: False) -> tuple[str | None, dict[str, int]]:
        """This rank's files uploaded as <tag>/<name> (no collective: an async save's writer thread runs it), each
        told to `progress` once up (the hang watchdog's view); stops early where `stopped()`. (Why not, or None;
        {name: size} uploaded.) Never raises: a refused or cut-off upload is its one line."""
        sizes = {}
        try:
            for i, path in enumerate(p for p in paths if os.path.isfile(p)):
                if stopped():
                    break
                if i == 1:
                    faults.uploading(step)
                sizes[os.path.basename(path)] = self.store.upload(path, tag, os.path.basename(path))
                progress(path)
        except (remote.DataError, OSError) as e:
            problem = problem or (str(e).splitlines() or [type(e).__name__])[0]
        faults.saving("uploaded", step)
        return problem, sizes

    def conclude(self, tag: str, step: int, results: list[tuple[str | None, dict[str, int]]], faults,
                 previous: str | None, keep: int, keep_every: int | None) -> bool:
        """Collective's aftermath, on every rank with every rank's `uploading` result: rank 0 commits and applies
        retention where every upload succeeded, or says in one line which rank's failed and why; whether committed
        (on rank 0: also its commit's outcome)."""
        rank = self.lay.rank
        failed = next((f"rank {r}: {p}" for r, (p, _) in enumerate(results) if p), None)
        if rank == 0 and failed is None:
            files = {name: size for _, s in results for name, size in s.items()}
            try:
                self.store.commit(tag, files, step, after_record=lambda: faults.saving("renamed", step))
                self.store.prune(keep, keep_every)
            except (remote.DataError, OSError) as e:
                failed = f"rank 0: {(str(e).splitlines() or [type(e).__name__])[0]}"
        if failed is None:   # copies downloaded for a resume are not read again: give the disk back
            for name in os.listdir(self.staging):
                if name.startswith(("step_", "universal_step_")) and name[-1].isdigit():   # not a .partial
                    shutil.rmtree(os.path.join(self.staging, name), ignore_errors=True)
        if rank == 0 and failed:
            kept = f"the previous checkpoint {previous} stays latest" if previous else "there is no earlier checkpoint"
            print(f"error: checkpoint {self.store.where(tag)} was not committed ({failed}); {kept}; training goes "
                  f"on and the next save tries again", flush=True)
        return failed is None

    def _clear(self, tag: str) -> str | None:
        try:
            if tag in self.store.files():
                self.store.remove(tag)
        except (remote.DataError, OSError) as e:
            return (str(e).splitlines() or [type(e).__name__])[0]
        return None
