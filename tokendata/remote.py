"""Where shards live: a local directory, `http(s)://…`, `pipe:COMMAND`, or any fsspec URL (`s3://`, `gs://`, `az://`…,
with fsspec and its backend installed). Everything that reads or writes a shard set goes through these functions.

    location  data.shard_dir / make_shards --out: a directory path or URL. A file in it is `join(location, name)`:
              a path or URL joined by "/", or for `pipe:` the command with `{}` replaced by the name (appended after a
              "/" when the command has no `{}`):  pipe:aws s3 cp s3://bucket/shards/{} -
    fetch(url, size, cache)   the whole file's bytes, retried on transient faults; ("bytes", retries it took)
    sizes(urls)               {url: bytes | None (unknown) | Missing(reason)}, checked in parallel (the size check
                              of the orders of older checkpoints; new runs request nothing per shard before reading it)
    writer(url)               a binary file object that writes there (local, pipe:, fsspec, http(s):// by PUT)

Faults. Transient: a dropped or reset connection, a read cut short, a timeout, HTTP 408/425/429/5xx, a pipe: command
that exits non-zero (a command cannot say which it was). Each is retried up to RETRIES times with exponential backoff;
an HTTP read resumes at the byte it had reached (a Range request; from the start, discarding what was read, where the
server ignores ranges), and a file is handed on only whole, so a retry never reads a sample twice or loses one.
A transient fault that outlasts the retries (an outage of the server, the store or the network) is FetchFailed, a
DataError that says nothing against the file: a reader must not record the shard as bad for it, and a trainer may try
again later. Permanent: HTTP 4xx other than those, a missing file or object: a DataError naming the URL and the status
at once.
A certificate that fails verification is permanent too (CertificateError): it is never retried, and verification is
never switched off.

HTTP(S) trust and credentials (`configure`, from data.ca_bundle and data.http_headers_from_env): every http(s)://
request of this module (the size check, the shards, the manifest, the tokenizer) verifies the server against the CA
bundle (default: the system's, which honours SSL_CERT_FILE) and carries the configured headers, whose values are read
from environment variables at each request: they are kept in no file, no config, no message. They are not sent on
when a server redirects (urllib's unredirected headers), so a token goes to no other host than data.shard_dir's.
fsspec URLs use their backend's own settings, pipe: commands their own.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import ssl
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from http.client import HTTPException

from filelock import FileLock

RETRIES = int(os.environ.get("SYNTHFORMER_DATA_RETRIES", 6))   # ~25 s of backoff before a fault counts as permanent
BACKOFF_S, BACKOFF_MAX_S = 0.2, 8.0
TIMEOUT_S = 60                            # a stalled read is a transient fault, not a hang
TRANSIENT_HTTP = {408, 425, 429, 500, 502, 503, 504}
CHUNK = 1 << 20


class DataError(ValueError):
    """A problem with the shard data or its settings; the message is one line that names the path/value and the fix."""


class Transient(Exception):
    """A fault worth retrying (the message says what happened)."""


class FetchFailed(DataError):
    """Transient faults that outlasted the retries: an outage, not a fault of the file (it is not bad)."""


class CertificateError(DataError):
    """A server whose TLS certificate fails verification: permanent, never retried."""


class CredentialError(DataError):
    """Configured headers that would go out unencrypted (http://): refused, never retried."""


class Missing(str):
    """Why a file cannot be had at all: "HTTP 404 Not Found", "not found"…"""


def is_remote(location: str) -> bool:
    return location.startswith("pipe:") or "://" in location


def join(location: str, name: str) -> str:
    if location.startswith("pipe:"):
        return location.replace("{}", name) if "{}" in location else f"{location.rstrip('/')}/{name}"
    return f"{location.rstrip('/')}/{name}" if "://" in location else os.path.join(location, name)


HTTP_SETTINGS = "SYNTHFORMER_HTTP"   # configure()'s settings, in the environment: DataLoader workers and child
                                    # processes see them under any start method


def configure(ca_bundle: str | None = None, headers_from_env: dict | None = None,
              headers_over_http: bool = False) -> None:
    """Trust and credentials of every HTTP(S) request of this process and its children: `ca_bundle`, a PEM file of the
    CAs to trust (None: the system's); `headers_from_env`, {header: name of the environment variable holding its
    value} (e.g. {"Authorization": "SHARDS_TOKEN"}, the variable set to "Bearer …"); `headers_over_http`: send them
    to http:// URLs too. Only the names are kept; a variable that is not set is a DataError naming it (never a
    value)."""
    if ca_bundle is not None and not os.path.isfile(ca_bundle):
        raise DataError(f"data.ca_bundle={ca_bundle}: no such file; give the PEM file of the CA certificates that "
                        "signed the shard server's certificate")
    headers = dict(headers_from_env or {})
    for header, variable in headers.items():
        _header_value(header, variable)
    os.environ[HTTP_SETTINGS] = json.dumps({"ca_bundle": ca_bundle, "headers_from_env": headers,
                                            "headers_over_http": bool(headers_over_http)})


def _settings() -> dict:
    return json.loads(os.environ.get(HTTP_SETTINGS) or '{"ca_bundle": null, "headers_from_env": {}}')


def _header_value(header: str, variable: str) -> str:
    value = os.environ.get(variable)
    if value is None:
        raise DataError(f"data.http_headers_from_env: the header {header} comes from the environment variable "
                        f"{variable}, which is not set: export it on every node before the launch")
    return value


@functools.lru_cache(maxsize=None)
def _tls(ca_bundle: str | None) -> ssl.SSLContext:
    """Certificates and host names verified (ssl's defaults, never turned off), against ca_bundle or the system's."""
    return ssl.create_default_context(cafile=ca_bundle)


def refuse_plain_http(url: str, settings: dict | None = None) -> None:
    """A CredentialError where configured headers would go to a plain http:// URL without headers_over_http."""
    settings = settings or _settings()
    if url.startswith("http://") and settings["headers_from_env"] and not settings.get("headers_over_http"):
        names = ", ".join(settings["headers_from_env"])
        raise CredentialError(f"{url}: data.http_headers_from_env ({names}) would be sent unencrypted over plain "
                              "http://: serve the shards over https://, or set data.headers_over_http=true on a "
                              "network you trust")


def _http(url: str, method: str = "GET", offset: int = 0, body: bytes | None = None):
    settings = _settings()
    refuse_plain_http(url, settings)
    request = urllib.request.Request(url, method=method, data=body,
                                     headers={"Range": f"bytes={offset}-"} if offset else {})
    for header, variable in settings["headers_from_env"].items():
        request.add_unredirected_header(header, _header_value(header, variable))
    try:   # the context also for http://: a server may redirect to https://
        return urllib.request.urlopen(request, timeout=TIMEOUT_S, context=_tls(settings["ca_bundle"]))
    except urllib.error.HTTPError as e:
        e.close()
        if e.code in TRANSIENT_HTTP:
            raise Transient(f"HTTP {e.code} {e.reason}") from None
        if e.code in (401, 403):
            raise PermissionError(f"HTTP {e.code} {e.reason} (are data.http_headers_from_env and its variables "
                                  "right?)") from None
        raise FileNotFoundError(f"HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, OSError, HTTPException) as e:
        reason = getattr(e, "reason", e)
        if isinstance(reason, ssl.SSLCertVerificationError):
            trusted = settings["ca_bundle"] or "the system's CAs"
            raise CertificateError(f"TLS certificate verification failed (certificate verify failed: "
                                   f"{reason.verify_message}; trusted: {trusted}): set data.ca_bundle to the PEM file "
                                   "of the CA that signed the server's certificate") from None
        raise Transient(f"{type(e).__name__}: {reason}") from None


def _chunks(url: str, offset: int, got: dict):
    """The file's bytes from `offset` on, in chunks; Transient or FileNotFoundError/PermissionError on faults.
    got["total"]: the file's whole size where the source says it (a read that ends there is whole, if short)."""
    if url.startswith("pipe:"):
        proc = subprocess.Popen(url[len("pipe:"):], shell=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        data, err = proc.communicate()
        if proc.returncode != 0:
            last = (err.decode(errors="replace").strip().splitlines() or [""])[-1]
            raise Transient(f"the command exited with status {proc.returncode}: {last}")
        got["total"] = len(data)   # a command that succeeded wrote all it had
        yield data[offset:]   # a command has no ranges: it starts over, and what was read before is dropped
    elif url.startswith(("http://", "https://")):
        with _http(url, offset=offset) as resp:
            skip = offset if resp.status == 200 else 0   # a server that ignores Range sends the file from the start
            whole = (resp.headers.get("Content-Range") or "").rsplit("/", 1)[-1] if resp.status == 206 else \
                resp.headers.get("Content-Length")
            got["total"] = int(whole) if whole and whole.isdigit() else None
            try:
                while chunk := resp.read(CHUNK):
                    chunk, skip = chunk[skip:], max(0, skip - len(chunk))
                    yield chunk
            except (OSError, HTTPException) as e:   # IncompleteRead, a reset or a timeout in mid-file
                raise Transient(f"{type(e).__name__} after {resp.length or 0} bytes were left unread") from None
    elif "://" in url:
        fs, path = filesystem(url)
        try:   # one request (an object store's GET, ranged from `offset`): no size asked first
            data = fs.cat_file(path, start=offset)
            got["total"] = offset + len(data)
            yield data
        except (FileNotFoundError, PermissionError):
            raise
        except Exception as e:   # the backends' own network errors
            raise Transient(f"{type(e).__name__}: {e}") from None
    else:
        got["total"] = os.path.getsize(url) if os.path.isfile(url) else None
        with open(url, "rb") as f:
            f.seek(offset)
            while chunk := f.read(CHUNK):
                yield chunk


def filesystem(url: str):
    """(fsspec filesystem, path) of a URL (s3://, gs://, az://…): the backend takes its credentials, endpoint and CA
    bundle from its own settings (for s3:// the AWS variables and files: AWS_ENDPOINT_URL, AWS_CA_BUNDLE…)."""
    try:
        import fsspec
    except ImportError:
        raise DataError(f"{url}: reading {url.split('://')[0]}:// URLs needs fsspec and its backend "
                        "(pip install fsspec s3fs / gcsfs / adlfs)") from None
    try:
        return fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as e:
        raise DataError(f"{url}: {e}") from None


def retrying(what: str, url: str, attempt):
    """attempt(progress) until it returns, retrying Transient faults with backoff; (result, retries); FetchFailed once
    the retries are spent. `progress` is a dict the attempt may keep state in across tries (how far it got)."""
    progress, retries = {}, 0
    while True:
        try:
            return attempt(progress), retries
        except Transient as e:
            if retries == RETRIES:
                raise FetchFailed(f"{what} {url}: {e}, still after {RETRIES} retries (an outage, not a fault of the "
                                  "file)") from None
            time.sleep(min(BACKOFF_MAX_S, BACKOFF_S * 2 ** retries))
            retries += 1
        except (FileNotFoundError, PermissionError) as e:
            raise DataError(f"{what} {url}: {_reason(e)}") from None
        except CertificateError as e:
            raise CertificateError(f"{what} {url}: {e}") from None


def _reason(e: OSError) -> str:
    return e.args[0] if e.args and isinstance(e.args[0], str) and e.args[0].startswith("HTTP") else \
        ("not found" if isinstance(e, FileNotFoundError) else "permission denied")


def fetch(url: str, size: int | None = None, cache: str | None = None, what: str = "shard",
          refresh: bool = False) -> tuple[bytes, int]:
    """(the file's bytes, retries it took). `size` (the manifest's) makes a short read a transient fault and keys the
    cache: with `cache` (a local file path, unique to the name and size) a file already there is read from it (unless
    `refresh`), and a fetched one is written there (under a temporary name, then renamed: readers on the node share
    it). A fetch into the cache holds the file's lock (`<cache>.lock`, filelock's: released when its holder exits,
    even killed), so readers of one node that want the same shard at once fetch it once: the others wait, then read
    the copy; a copy already there is read without the lock."""
    if not cache or size is None:
        return _fetch(url, size, None, what, refresh)
    if _cached(cache, size, refresh):
        return _fetch(url, size, cache, what, refresh)
    os.makedirs(os.path.dirname(cache) or ".", exist_ok=True)
    with FileLock(f"{cache}.lock"):   # (threads of one process exclude each other too)
        return _fetch(url, size, cache, what, refresh)


def _cached(cache: str, size: int, refresh: bool) -> bool:
    return not refresh and os.path.isfile(cache) and os.path.getsize(cache) == size


def _fetch(url, size, cache, what, refresh):
    if cache and _cached(cache, size, refresh):
        url = cache

    def attempt(got):
        data = got.setdefault("data", bytearray())
        for chunk in _chunks(url, len(data), got):
            data += chunk
        if size is not None and len(data) < size and is_remote(url) and got.get("total") != len(data):
            raise Transient(f"the read ended after {len(data)} of {size} bytes")   # (a whole short file is the
        return bytes(data)                                                          # caller's to judge)

    data, retries = retrying(what, url, attempt)
    if cache and url != cache and len(data) == size:
        write_whole(cache, data)
    return data, retries


def write_whole(path: str, data: bytes) -> None:
    """A local file written under a temporary name and renamed: processes of a node that share it see all or none."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.{os.getpid()}-{threading.get_ident()}.tmp"   # one per writer, threads too
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _size(url: str) -> int | None:
    """The file's size without reading it (None where the source cannot tell: a pipe: command, no Content-Length)."""
    if url.startswith("pipe:"):
        return None
    if url.startswith(("http://", "https://")):
        with _http(url, method="HEAD") as resp:   # (resp.length is 0 for a HEAD: no body follows)
            length = resp.headers.get("Content-Length")
            return int(length) if length is not None and length.isdigit() else None
    if "://" in url:
        fs, path = filesystem(url)
        try:
            return fs.size(path)
        except (FileNotFoundError, PermissionError):
            raise
        except Exception as e:
            raise Transient(f"{type(e).__name__}: {e}") from None
    if not os.path.isfile(url):
        raise FileNotFoundError("not found")
    return os.path.getsize(url)


def sizes(urls: list[str]) -> tuple[dict, int]:
    """({url: size | None | Missing(reason)}, retries): every file checked, remote ones in parallel."""
    def check(url):
        try:
            return retrying("shard", url, lambda _: _size(url))
        except (CertificateError, CredentialError, FetchFailed):
            raise   # the server, the settings or an outage, not this shard: no data.bad_shards=skip of any shard
        except DataError as e:
            return Missing(str(e).removeprefix(f"shard {url}: ")), 0

    with ThreadPoolExecutor(max_workers=64 if any(map(is_remote, urls)) else 1) as pool:
        results = list(pool.map(check, urls))
    return {u: s for u, (s, _) in zip(urls, results)}, sum(r for _, r in results)


def local_copy(url: str, directory: str | None = None) -> str:
    """A local path holding the file at `url`: the path itself when local; a remote file is fetched into `directory`
    (default: the temporary folder) under a name unique to the URL, once, and renamed into place when whole."""
    if not is_remote(url):
        return url
    directory = directory or tempfile.gettempdir()
    tail = re.sub(r"[^\w.-]", "_", url.rstrip("/ -").rsplit("/", 1)[-1])[-40:]   # readable; the hash makes it unique
    path = os.path.join(directory, f"{hashlib.sha1(url.encode()).hexdigest()[:12]}-{tail}")
    if not os.path.isfile(path):
        write_whole(path, fetch(url, what="file")[0])
    return path


class _PutWriter:
    """An http(s):// file written by one PUT of the whole file when closed (an object store's upload, a WebDAV
    server), with the trust and headers of `configure`, retried on transient faults like a read."""

    def __init__(self, url):
        self.url, self.data = url, bytearray()

    def write(self, data):
        self.data += data
        return len(data)

    def close(self):
        def attempt(_):
            with _http(self.url, method="PUT", body=bytes(self.data)) as resp:
                return resp.status
        retrying("writing", self.url, attempt)


class _PipeWriter:
    """stdin of a pipe: command as a binary file; close() waits for it and raises on a non-zero exit."""

    def __init__(self, url):
        self.url, self.proc = url, subprocess.Popen(url[len("pipe:"):], shell=True, stdin=subprocess.PIPE)

    def write(self, data):
        return self.proc.stdin.write(data)

    def close(self):
        self.proc.stdin.close()
        if self.proc.wait() != 0:
            raise DataError(f"writing {self.url}: the command exited with status {self.proc.returncode}")


def writer(url: str):
    """A binary file object writing `url` (a path, pipe:COMMAND, http(s):// by PUT, or an fsspec URL); closing it
    finishes the write."""
    if url.startswith("pipe:"):
        return _PipeWriter(url)
    if url.startswith(("http://", "https://")):
        refuse_plain_http(url)   # before a byte is written, not at close
        return _PutWriter(url)
    if "://" in url:
        fs, path = filesystem(url)
        return fs.open(path, "wb")
    return open(url, "wb")
