"""Synthetic shard sets for the data part of benchmarks/bench.py and the tests of scale (tests/unit/test_order_scale.py):
as many shards as a cluster's corpus, made of arithmetic, and an HTTP server on 127.0.0.1 that serves them without
writing them anywhere, counting every request.

    source = Synthetic(shards=100_000, per_shard=2, seq_len=16, vocab=512)   real format-2 shards, their manifest
    source.write(directory, names)          some of them (or all) as files, beside manifest.json
    with SyntheticServer(source, tokenizer) as srv:   srv.url serves manifest.json, tokenizer.model, every shard
        srv.requests                        Counter of (method, "manifest" | "tokenizer" | "shard" | path)
        srv.shards                          Counter of the shards asked for, by name
"""
from __future__ import annotations

import collections
import http.server
import json
import os
import signal
import threading

import numpy as np

from tokendata.shards import DTYPES, HASH, MANIFEST_FORMAT, content_hash, tar_file


class Synthetic:
    """A train split of `shards` shards of `per_shard` samples (sample k of shard i: ids (i·per_shard + k + j) mod
    vocab, j = 0 … seq_len), and a val split of one shard; manifest format 2 with every size and content hash."""

    def __init__(self, shards: int, per_shard: int, seq_len: int, vocab: int, tokenizer_sha256: str = "0" * 64):
        self.per_shard, self.seq_len, self.vocab = per_shard, seq_len, vocab
        self.dtype, self.member = "uint16", DTYPES["uint16"][1]
        self._template = bytearray(tar_file(f"train-000000.{self.member}", self._payload(0))[:512])
        self._template[148:156] = b" " * 8   # tar's checksum is the header's byte sum with these as spaces
        self._template_sum = sum(self._template) - sum(self._template[:100])
        names = [f"train-{i:06d}.tar" for i in range(shards)] + ["val-000000.tar"]
        records = {"train": [], "val": []}
        width = per_shard * (seq_len + 1)   # every payload at once: numpy once, not 100k times
        ids = np.arange(width) % (seq_len + 1) + np.arange(width) // (seq_len + 1)
        payloads = ((ids[None, :] + np.arange(shards)[:, None] * per_shard) % vocab).astype("<u2")
        for i, name in enumerate(names):
            data = self.shard(name, payloads[i].tobytes() if i < shards else None)
            records[name.split("-")[0]].append({"name": name, "samples": per_shard, "first_id": f"{name[:-4]}-000000",
                                                "first_index": i * per_shard, "bytes": len(data),
                                                "hash": content_hash(data)})
        self.manifest = {"format": MANIFEST_FORMAT, "seq_len": seq_len, "vocab_size": vocab, "eos_id": 2,
                         "tokenizer": "tokenizer.model", "tokenizer_kind": "sentencepiece",
                         "tokenizer_sha256": tokenizer_sha256, "dtype": self.dtype, "hash": HASH, "seed": 0,
                         "val_fraction": 0.0, "inputs": ["synthetic"],
                         "splits": {split: {"samples": per_shard * len(r), "tokens": per_shard * len(r) * seq_len,
                                            "shards": r} for split, r in records.items()}}
        self.manifest_bytes = json.dumps(self.manifest).encode()

    def _payload(self, i: int) -> bytes:
        ids = np.arange(self.seq_len + 1)[None, :] + np.arange(self.per_shard)[:, None] + i * self.per_shard
        return (ids % self.vocab).astype("<u2").tobytes()

    def shard(self, name: str, payload: bytes | None = None) -> bytes:
        """The shard's file: tokendata.shards.tar_file's, its header made once and patched (name and checksum)."""
        i = int(name[len("train-"):-len(".tar")]) if name.startswith("train-") else 10 ** 9
        payload, member = payload or self._payload(i), f"{name[:-4]}.{self.member}".encode()
        header = bytearray(self._template)
        header[:100] = member.ljust(100, b"\0")
        header[148:156] = b"%06o\0 " % (self._template_sum + sum(member))
        return bytes(header) + payload + bytes(-len(payload) % 512 + 1024)

    def write(self, directory: str, names: list[str] | None = None) -> str:
        os.makedirs(directory, exist_ok=True)
        for s in self.manifest["splits"]["train"]["shards"] + self.manifest["splits"]["val"]["shards"]:
            if names is None or s["name"] in names:
                with open(os.path.join(directory, s["name"]), "wb") as f:
                    f.write(self.shard(s["name"]))
        with open(os.path.join(directory, "manifest.json"), "wb") as f:
            f.write(self.manifest_bytes)
        return directory


class _Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _body(self):
        srv, name = self.server, os.path.basename(self.path)
        kind = "manifest" if name == "manifest.json" else "tokenizer" if name == "tokenizer.model" else \
            "shard" if name.endswith(".tar") else name
        with srv.lock:
            srv.requests[(self.command, kind)] += 1
            if kind == "shard":
                srv.shards[name] += 1
        if kind == "manifest":
            return srv.source.manifest_bytes
        if kind == "tokenizer" and srv.tokenizer:
            return open(srv.tokenizer, "rb").read()
        if kind == "shard" and name in srv.names:
            return srv.source.shard(name)
        return None

    def _send(self, head_only):
        body = self._body()
        if body is None:
            return self.send_error(404)
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head_only:
            self.wfile.write(body)

    def do_GET(self):
        self._send(False)

    def do_HEAD(self):
        self._send(True)


class Serving:
    """`with` it: its `httpd` serves in a daemon thread until the block ends (then shut down and closed)."""
    httpd: http.server.HTTPServer

    def __enter__(self):
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


class SyntheticServer(Serving):
    """`with SyntheticServer(source, tokenizer) as srv:` serves a Synthetic source at srv.url (http://127.0.0.1:PORT):
    its manifest, `tokenizer` (a file, optional) as tokenizer.model, and each shard made when asked."""

    def __init__(self, source: Synthetic, tokenizer: str | None = None):
        self.httpd = h = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        h.daemon_threads, h.request_queue_size = True, 512
        h.source, h.tokenizer, h.lock, h.requests = source, tokenizer, threading.Lock(), collections.Counter()
        h.shards = collections.Counter()
        h.names = {s["name"] for split in source.manifest["splits"].values() for s in split["shards"]}
        self.url, self.requests, self.shards = f"http://127.0.0.1:{h.server_address[1]}", h.requests, h.shards


def run_reader(spec: dict) -> dict:
    """A rank's reader memory: one rank (no DataLoader workers: the reader is this process) reading `batches` global
    batches of spec["global_batch"] samples from three local sources blended 0.5 / 0.3 / 0.2, in the default order
    (C = min(64, G)). Its resident memory is sampled every 5 ms while it reads; the figure is the peak above the
    process before reading. Also: the most shards held in memory at once (being fetched), and the shards fetched."""
    import shutil
    import tempfile
    import time

    import psutil

    from tokendata import shard_pool
    from tokendata.sources import Source
    from tokendata.stream import TokenStream

    G, tmp = spec["global_batch"], tempfile.mkdtemp(prefix="bench-reader-")
    try:
        sources = [Source(Synthetic(spec["shards"], spec["per_shard"], spec["seq_len"], 4096).write(f"{tmp}/{name}"),
                          weight, name) for name, weight in (("one", 0.5), ("two", 0.3), ("three", 0.2))]
        stream = TokenStream(sources, G, spec["seq_len"], global_batch_size=G, fetch_threads=spec["fetch_threads"])
        me, peak, done = psutil.Process(), [0], threading.Event()

        def sample():
            while not done.is_set():
                peak[0] = max(peak[0], me.memory_info().rss)
                time.sleep(0.005)

        base = me.memory_info().rss
        watcher = threading.Thread(target=sample, daemon=True)
        watcher.start()
        shard_pool.reset_stats()
        t0, batches = time.perf_counter(), iter(stream)
        for _ in range(spec["batches"]):
            next(batches)
        seconds = time.perf_counter() - t0
        done.set()
        watcher.join()
        shard_mb = len(Synthetic(1, spec["per_shard"], spec["seq_len"], 4096).shard("train-000000.tar")) / 2**20
        return {"rss_mb": [(peak[0] - base) / 2**20], "held_shards": [shard_pool.STATS["peak_in_flight"]],
                "fetched": shard_pool.STATS["fetched"], "streams": stream.canonical_streams, "shard_mb": shard_mb,
                "seconds": seconds, "rank": 0}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run_startup(spec: dict) -> dict:
    """Seconds from starting the trainer (configs/demo-cpu.yaml, 1 rank, launch/pretrain.sh as a scheduler starts
    it) to its first step, with data.shard_dir a server of spec["shards"] synthetic shards on 127.0.0.1 (its
    tokenizer the demo's); and the requests the server answered by then."""
    import subprocess
    import sys
    import tempfile
    import time

    from pretrain.distributed import free_local_port

    import shutil

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    source = Synthetic(spec["shards"], 2, 128, 4096)
    run = tempfile.mkdtemp(prefix="bench-startup-")
    with SyntheticServer(source, os.path.join(root, spec["tokenizer"])) as srv:
        env = {**os.environ, "PYTHONPATH": root, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_SIZE": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_local_port()), "PYTHON": sys.executable}
        overrides = [f"data.shard_dir={srv.url}", f"train.run_dir={run}", "train.max_steps=2", "train.warmup_steps=1",
                     "logging.every=1", "logging.val_every=0", "logging.image_every=0", "checkpoint.every=1000",
                     "data.num_workers=1"]
        t0, first = time.perf_counter(), None
        proc = subprocess.Popen([os.path.join(root, "launch", "pretrain.sh"), os.path.join(root, spec["config"]),
                                 *overrides], cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        metrics = os.path.join(run, "metrics.jsonl")
        while proc.poll() is None and first is None and time.perf_counter() - t0 < 1200:
            if os.path.exists(metrics) and any('"train/loss"' in line for line in open(metrics)):
                first = time.perf_counter() - t0   # the first step's row: the step is done
            time.sleep(0.05)
        requests = {f"{m} {k}": n for (m, k), n in srv.requests.items()}
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        out = proc.communicate()[0]
    shutil.rmtree(run, ignore_errors=True)   # the run's directory: its metrics and tokenizer copy
    if first is None:
        raise RuntimeError(f"the trainer gave no step: {(out or '').strip().splitlines()[-1:]}")
    return {"seconds": [first], "requests": requests, "shards": spec["shards"], "rank": 0}
