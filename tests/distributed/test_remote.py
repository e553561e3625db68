"""Shards streamed from where clusters keep them (tokendata/remote.py): over HTTP from a real server on 127.0.0.1 that
drops connections, answers 503 and 404, honours Range requests or not; over HTTPS with a certificate made in the test
and a bearer token; through a `pipe:` command; through fsspec. The batches must be those of the local directory,
sample for sample, whatever the network did."""
import contextlib
import http.server
import itertools
import os
import shutil
import ssl
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import trustme

from model.config import ConfigError
from tokendata import remote
from pretrain.config import DataSection, load_config
from tokendata.stream import TokenStream
from pretrain.prelaunch import check_launch
from tokendata.shard_files import folder_for
from tokendata.shards import DataError, read_manifest
from tests.support.http_shards import ShardServer
from tests.support.runs import (built_once, launch, losses, ids_per_step, metric_rows, reference_config,
                                tensorboard_scalars, tool, write_config)

SEQ, B, BATCHES = 32, 4, 12


@pytest.fixture(scope="module")
def few_shards(shards, tmp_path_factory):
    """The trainer tests' text and tokenizer in shards of 8 samples (~110 train shards): fewer requests per test."""
    def build(tmp):
        src = os.path.dirname(shards)
        tool("make_shards.py", "--input", f"{src}/corpus.txt", "--tokenizer", f"{src}/tokenizer.model", "--out",
             tmp / "shards", "--seq-len", SEQ, "--samples-per-shard", 8, "--val-fraction", 0.05, "--quiet")
    return str(built_once(tmp_path_factory, "remote-shards", build) / "shards")


@pytest.fixture(autouse=True)
def quick_backoff(monkeypatch):
    monkeypatch.setattr(remote, "BACKOFF_S", 0.01)
    monkeypatch.setenv(remote.HTTP_SETTINGS, "")   # the system's CAs, no headers; what remote.configure() sets: undone


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    """A CA made here, and a server context with a certificate it signed for 127.0.0.1: (context, the CA's PEM)."""
    ca, pem = trustme.CA(), tmp_path_factory.mktemp("tls") / "ca.pem"
    ca.cert_pem.write_to_path(str(pem))
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(context)
    return context, str(pem)


TOKEN = "s3cr3t-8c1f0e2a9d"   # the bearer token of the private servers below: it must appear nowhere


def stream(location, rank=0, **kw):
    return TokenStream(location, B, SEQ, dp_rank=rank, dp_world=2, num_workers=kw.pop("num_workers", 1), seed=3, **kw)


def batches(s, n=BATCHES):
    """(ids, tokens) of the first n train batches, and the fetches they retried."""
    got, retries, it = [], 0, iter(s)
    for _ in range(n):
        b = next(it)
        got.append((b["ids"], b["tokens"].tolist()))
        retries += b["retries"]
    return got, retries


def val(s):
    return [(b["ids"], b["tokens"].tolist()) for b in s.val_batches(3)]


def first_read(s, k):
    """k of the shards this rank's worker fetches first (the first group of each of its streams, in turn): their
    faults come back within the first batches."""
    return s.upcoming_shards()[:k]


def test_http_shards_give_the_local_batches_through_dropped_connections_and_503s(few_shards):
    local = [stream(few_shards, rank) for rank in (0, 1)]
    with ShardServer(few_shards) as srv:
        for rank in (0, 1):
            drop, busy = first_read(local[rank], 2), first_read(local[rank], 4)[2:]
            srv.faults.update({**{n: ["drop"] for n in drop}, **{n: ["503"] for n in busy}})
            s = stream(srv.url, rank)
            got, retries = batches(s)
            assert got == batches(local[rank])[0]
            assert retries == 4 and all(srv.gets[n] == 2 for n in drop + busy)   # one failed GET, one retry each
            assert val(s) == val(local[rank]) and s.state_dict() == local[rank].state_dict()
        resumed = stream(srv.url, 1)   # exact resume: batches 6-8 of a new stream told that 5 global batches are done
        resumed.start_at(5)
        assert batches(resumed, 3)[0] == batches(stream(few_shards, 1), 8)[0][5:]


@pytest.mark.parametrize("ranges", [True, False])
def test_a_dropped_read_resumes_at_the_byte_it_reached_or_starts_over(few_shards, monkeypatch, ranges):
    """A connection dropped half-way through a shard: the retry asks for the rest (`Range: bytes=k-`, k the bytes
    delivered). A server that honours it (object stores) sends only the rest: no more than the file and one read chunk
    in all; one that ignores it (tools/serve_shards.py) sends the whole file again, whose first k bytes are dropped.
    The batches are the local directory's either way."""
    monkeypatch.setattr(remote, "CHUNK", 1024)   # reads of 1 KiB: a shard is ~20 reads, half of one is ~10
    local = stream(few_shards, num_workers=0)
    name = first_read(local, 1)[0]
    size = os.path.getsize(os.path.join(few_shards, name))
    with ShardServer(few_shards, ranges=ranges) as srv:
        srv.faults[name] = ["drop"]
        got, retries = batches(stream(srv.url, num_workers=0), 3)
        assert got == batches(local, 3)[0] and retries == 1
    delivered = size // 2   # what the server sent before the connection went
    assert srv.ranges[name] == [None, f"bytes={delivered}-"], srv.ranges[name]
    if ranges:
        assert srv.served[name] == size <= size + remote.CHUNK, (srv.served[name], size)
    else:
        assert srv.served[name] == delivered + size, (srv.served[name], size)


def test_a_certificate_that_fails_verification_is_one_line_at_once_and_the_ca_bundle_makes_it_work(few_shards,
                                                                                                   tls):
    """HTTPS with a certificate of a CA made in the test: without data.ca_bundle the first request fails verification
    and that is final (one connection, no retry, one line naming the URL and why); with the bundle the batches are the
    local directory's."""
    context, pem = tls
    with ShardServer(few_shards, tls=context) as srv:
        remote.configure()   # the system's CAs: they do not know this one
        with pytest.raises(DataError) as e:
            stream(srv.url)
        assert srv.connections == 1 and not srv.gets, (srv.connections, srv.gets)   # no retry, not one request
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(f"manifest {srv.url}/manifest.json: TLS certificate verification "
                                                   "failed (certificate verify failed"), msg
        assert "data.ca_bundle" in msg, msg
        with pytest.raises(remote.CertificateError):   # nor is it a missing shard that data.bad_shards=skip would skip
            remote.sizes([f"{srv.url}/{first_read(stream(few_shards), 1)[0]}"])
        remote.configure(ca_bundle=pem)
        assert batches(stream(srv.url)) == batches(stream(few_shards))


def test_a_bearer_token_comes_from_the_environment_and_is_never_shown(few_shards, tls, monkeypatch):
    context, pem = tls
    with ShardServer(few_shards, tls=context, token=TOKEN) as srv:
        with pytest.raises(DataError) as e:   # the variable named in the config is not set
            remote.configure(pem, {"Authorization": "SHARDS_TOKEN"})
        assert str(e.value) == ("data.http_headers_from_env: the header Authorization comes from the environment "
                                "variable SHARDS_TOKEN, which is not set: export it on every node before the launch")
        monkeypatch.setenv("SHARDS_TOKEN", f"Bearer {TOKEN}-old")   # a stale token: refused, in one line without it
        remote.configure(pem, {"Authorization": "SHARDS_TOKEN"})
        with pytest.raises(DataError) as e:
            stream(srv.url)
        assert "HTTP 401 Unauthorized" in str(e.value) and TOKEN not in str(e.value) and srv.refused == 1, e.value
        monkeypatch.setenv("SHARDS_TOKEN", f"Bearer {TOKEN}")
        assert batches(stream(srv.url)) == batches(stream(few_shards)) and srv.refused == 1
        assert TOKEN not in os.environ[remote.HTTP_SETTINGS]   # what workers inherit names the variable only
        with redirecting_to(srv.url) as elsewhere:   # a server that sends the client on: the token does not follow
            remote.configure(pem, {"Authorization": "SHARDS_TOKEN"}, headers_over_http=True)   # (a plain http:// one)
            with pytest.raises(DataError) as e:
                remote.fetch(f"{elsewhere}/manifest.json")
        assert "HTTP 401 Unauthorized" in str(e.value) and srv.refused == 2, e.value


def test_a_token_is_refused_over_plain_http_unless_allowed(few_shards, tmp_path, monkeypatch):
    """Headers configured for an http:// source: the config is refused in one line naming the key, and so is every
    request of a process configured so (the manifest, a shard, a PUT of make_shards); nothing reaches the server.
    data.headers_over_http=true lets them through (a network the user trusts)."""
    monkeypatch.setenv("SHARDS_TOKEN", f"Bearer {TOKEN}")
    with ShardServer(few_shards, token=TOKEN) as srv:
        headers = {"http_headers_from_env": {"Authorization": "SHARDS_TOKEN"}}
        with pytest.raises(ConfigError) as e:
            load_config(write_config(tmp_path / "c.yaml", srv.url, tmp_path / "run", data=headers), [])
        assert str(e.value) == (f"data.shard_dir={srv.url} is plain http://: data.http_headers_from_env (Authorization) "
                                "would go out unencrypted; serve it over https://, or set data.headers_over_http=true "
                                "on a network you trust")
        sources = [{"name": "a", "path": few_shards, "weight": 1}, {"name": "b", "path": srv.url, "weight": 1}]
        with pytest.raises(ConfigError) as e:
            load_config(write_config(tmp_path / "c.yaml", None, tmp_path / "run",
                                     data={"sources": sources, **headers}), [])
        assert str(e.value).startswith(f"data.sources[1].path={srv.url} is plain http://"), e.value
        remote.configure(None, {"Authorization": "SHARDS_TOKEN"})
        for attempt in (lambda: stream(srv.url), lambda: remote.fetch(f"{srv.url}/train-000000.tar"),
                        lambda: remote.writer(f"{srv.url}/new.tar")):
            with pytest.raises(remote.CredentialError) as e:
                attempt()
            assert "\n" not in str(e.value) and "would be sent unencrypted over plain http://" in str(e.value)
            assert "data.headers_over_http=true" in str(e.value) and TOKEN not in str(e.value)
        assert not srv.gets and not srv.heads and srv.connections == 0
        allowed = load_config(write_config(tmp_path / "c.yaml", srv.url, tmp_path / "run",
                                           data={**headers, "headers_over_http": True}), [])
        remote.configure(None, allowed.data.http_headers_from_env, allowed.data.headers_over_http)
        assert batches(stream(srv.url)) == batches(stream(few_shards)) and srv.refused == 0


@contextlib.contextmanager
def redirecting_to(target):
    """An HTTP server on 127.0.0.1 that answers every GET with a redirect (302) to the same path on `target`."""
    class Redirect(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(302)
            self.send_header("Location", target + self.path)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Redirect)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_fault_that_does_not_pass_is_one_line_after_the_retries(few_shards, monkeypatch):
    monkeypatch.setattr(remote, "RETRIES", 2)
    with ShardServer(few_shards) as srv:
        s = stream(srv.url, num_workers=0)
        name = first_read(s, 1)[0]
        srv.faults[name] = ["503", "drop", "503"]   # the first try and both retries fail
        with pytest.raises(DataError) as e:
            batches(s, 2)
    msg = str(e.value)
    assert "\n" not in msg and srv.gets[name] == 3, msg
    assert msg == (f"shard {srv.url}/{name}: HTTP 503 Service Unavailable, still after 2 retries (an outage, not a "
                   "fault of the file)"), msg   # no advice to rebuild it or skip it: tests/unit/test_fetch_outage.py


def test_a_404_shard_fails_in_one_line_or_is_skipped_as_a_local_bad_shard_is(few_shards, tmp_path):
    local = stream(few_shards)
    name = first_read(local, 3)[1]
    with ShardServer(few_shards) as srv:
        srv.missing.add(name)
        s = stream(srv.url)   # nothing is asked of a shard before a batch reads it
        assert not srv.heads and not any(n.endswith(".tar") for n in srv.gets)
        with pytest.raises(DataError) as e:
            batches(s)
        assert str(e.value) == (f"shard {srv.url}/{name}: HTTP 404 Not Found: rebuild {srv.url} with "
                                "tools/make_shards.py, or set data.bad_shards=skip to train without it")
        s = stream(srv.url, bad_shards="skip")
        got, reported = [], []
        for b in itertools.islice(iter(s), BATCHES):
            got.append((b["ids"], b["tokens"].tolist()))
            reported += b["skipped_shards"]
        assert reported == [f"{srv.url}/{name}"]
    # the same order as a local directory where that shard is damaged (empty)
    damaged = tmp_path / "shards"
    shutil.copytree(few_shards, damaged)
    (damaged / name).write_bytes(b"")
    assert got == batches(stream(str(damaged), bad_shards="skip"))[0]
    assert name.removesuffix(".tar") not in str(got)


def test_a_pipe_command_and_an_fsspec_url_read_the_local_batches(few_shards):
    expected = batches(stream(few_shards))[0]
    assert batches(stream(f"pipe:cat {few_shards}/{{}}"))[0] == expected
    assert batches(stream(f"file://{few_shards}"))[0] == expected
    assert read_manifest(f"pipe:cat {few_shards}/{{}}")["splits"] == read_manifest(few_shards)["splits"]


def test_cache_dir_fetches_each_shard_once(few_shards, tmp_path):
    cache = tmp_path / "cache"
    with ShardServer(few_shards) as srv:
        expected = batches(stream(few_shards), 30)[0]
        assert batches(stream(srv.url, num_workers=0, cache_dir=str(cache)), 30)[0] == expected
        first = {n for n in srv.gets if n.startswith("train")}
        assert batches(stream(srv.url, num_workers=0, cache_dir=str(cache)), 30)[0] == expected
        # no shard fetched twice: the second run read the first one's from the disk (and fetched only what its
        # prefetch reached beyond them)
        assert all(count == 1 for name, count in srv.gets.items() if name != "manifest.json"), srv.gets
    sizes = {s["name"]: s["bytes"] for s in read_manifest(few_shards)["splits"]["train"]["shards"]}
    assert {f"{n}.{sizes[n]}" for n in first} <= {f.name for f in (cache / folder_for(srv.url)).iterdir()}


def test_readers_sharing_the_cache_fetch_a_shard_once(few_shards, tmp_path):
    """Eight readers of one node (threads here: the lock is per open file, so threads exclude each other as processes
    do) want the same shard at once: one GET, and every reader gets its bytes."""
    record = read_manifest(few_shards)["splits"]["train"]["shards"][0]
    cache, start = str(tmp_path / "cache" / f"{record['name']}.{record['bytes']}"), threading.Barrier(8)
    with ShardServer(few_shards) as srv:
        def read():
            start.wait()
            return remote.fetch(remote.join(srv.url, record["name"]), record["bytes"], cache)[0]
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda _: read(), range(8)))
        assert srv.gets[record["name"]] == 1, srv.gets
    assert {len(g) for g in got} == {record["bytes"]} and len(set(got)) == 1


def test_the_launch_check_reads_the_manifest_over_http(few_shards, tmp_path):
    with ShardServer(few_shards) as srv:
        cfg = load_config(write_config(tmp_path / "c.yaml", srv.url, tmp_path / "run"), [])
        assert check_launch(cfg, 2).dp == 2
        cfg = load_config(write_config(tmp_path / "c.yaml", srv.url + "/nothing", tmp_path / "run"), [])
        with pytest.raises(DataError) as e:
            check_launch(cfg, 2)
    assert str(e.value).startswith(f"manifest {srv.url}/nothing/manifest.json: HTTP 404 File not found: is "
                                   f"data.shard_dir={srv.url}/nothing right?"), str(e.value)


def test_make_shards_writes_through_a_pipe_command_and_https_the_files_it_writes_to_a_directory(shards, tmp_path, tls,
                                                                                                 monkeypatch):
    """The same files in a directory, through a pipe: command, and PUT to a private HTTPS server (its CA and a bearer
    token from the environment, as training reads it: --ca-bundle, --header-from-env); the token is in no output."""
    src, piped, put = os.path.dirname(shards), tmp_path / "piped", tmp_path / "put"
    piped.mkdir()
    put.mkdir()
    args = ["--input", f"{src}/corpus.txt", "--tokenizer", f"{src}/tokenizer.model", "--seq-len", SEQ,
            "--samples-per-shard", 50, "--quiet"]
    tool("make_shards.py", *args, "--out", tmp_path / "local")
    tool("make_shards.py", *args, "--out", f"pipe:cat > {piped}/{{}}")
    context, pem = tls
    monkeypatch.setenv("SHARDS_TOKEN", f"Bearer {TOKEN}")
    with ShardServer(str(put), tls=context, token=TOKEN) as srv:
        r = tool("make_shards.py", *args, "--out", srv.url, "--ca-bundle", pem, "--header-from-env",
                 "Authorization=SHARDS_TOKEN")
    names = sorted(os.listdir(tmp_path / "local"))
    assert sorted(os.listdir(piped)) == sorted(os.listdir(put)) == names and "manifest.json" in names and len(names) > 5
    assert all((piped / n).read_bytes() == (put / n).read_bytes() == (tmp_path / "local" / n).read_bytes()
               for n in names)
    assert set(srv.puts) == set(names) and set(srv.puts.values()) == {1} and srv.refused == 0
    assert TOKEN not in r.stdout + r.stderr


def first_shards_of_each_worker(shards, ranks=2, workers=2, batch=4, seed=1234):
    """The first shard each DataLoader worker of each rank reads in tests/support/runs.py's reference run."""
    return [TokenStream(shards, batch, SEQ, dp_rank=r, dp_world=ranks, num_workers=workers, seed=seed)
            .upcoming_shards(w)[0] for r in range(ranks) for w in range(workers)]


@pytest.mark.slow
def test_a_run_streamed_over_http_through_faults_matches_the_local_run(shards, reference_run, tmp_path):
    """tests/support/runs.py's reference run (2 ranks, 2 data workers each, 40 steps), its shards served over HTTP: the first
    shard of each worker has its connection dropped half-way or gets a 503. Same losses and sample ids, bit for bit,
    as the run from the local directory; the four retries are counted in metrics.jsonl and TensorBoard (its own
    reader). No shard is asked for its size: each is checked when read.""" 
    firsts = first_shards_of_each_worker(shards)
    with ShardServer(shards) as srv:
        srv.faults.update({name: [fault] for name, fault in zip(firsts, ["drop", "503", "503", "drop"])})
        launch(reference_config(tmp_path, srv.url, "run"), 2)
    run = tmp_path / "run"
    assert losses(run) == losses(reference_run)
    assert all(ids_per_step(run, r) == ids_per_step(reference_run, r) for r in (0, 1))
    assert [r["data/retries"] for r in metric_rows(run) if "data/retries" in r][-1] == 4
    retries = tensorboard_scalars(run, "data/retries")
    assert sorted(retries) == list(range(1, 41)) and retries[40] == 4, retries
    assert all(srv.gets[n] >= 2 for n in firsts) and not srv.heads   # (a shard two ranks read: fetched by both)


@pytest.mark.slow
def test_a_private_https_server_serves_a_run_whose_404_shard_stays_skipped_across_a_kill(few_shards, tls, tmp_path):
    """A real run on 2 ranks from a server that wants a bearer token, over TLS with the test's CA (data.ca_bundle,
    data.http_headers_from_env: {Authorization: SHARDS_TOKEN}), one train shard answered 404 under
    data.bad_shards=skip (found when the first step reads it, then kept in the checkpoints); rank 1 is killed (SIGKILL,
    in the save of step 6) and the run relaunched. data/skipped_shards is 1 at every step before and after the kill,
    in metrics.jsonl and in TensorBoard; every request carried the token (manifest, shards, tokenizer); the token's
    value is in no file of the run directory (grep -r) and in nothing the run printed."""
    context, pem = tls
    seed = DataSection(shard_dir=few_shards).seed   # the run's: data.seed's default
    name = TokenStream(few_shards, 4, SEQ, dp_world=2, seed=seed).upcoming_shards()[1]   # rank 0 reads it first
    run = tmp_path / "run"
    with ShardServer(few_shards, tls=context, token=TOKEN) as srv:
        srv.missing.add(name)
        cfg = write_config(tmp_path / "c.yaml", srv.url, run, train={"max_steps": 9}, checkpoint={"every": 3},
                           data={"bad_shards": "skip", "ca_bundle": pem,
                                 "http_headers_from_env": {"Authorization": "SHARDS_TOKEN"}})
        token = {"SHARDS_TOKEN": f"Bearer {TOKEN}"}
        killed = launch(cfg, 2, check=False, env={**token, "SYNTHFORMER_FAULTS": "kill-save-begin@6@1"})
        assert killed.returncode != 0 and (run / "checkpoints" / "latest").read_text() == "step_00000003"
        resumed = launch(cfg, 2, env=token)
    assert "resumed at step 3" in resumed.stdout and "done: validation perplexity" in resumed.stdout
    assert (f"warning: shard {srv.url}/{name}: HTTP 404 Not Found; skipping it (data.bad_shards=skip)" in
            killed.stdout + killed.stderr), killed.stderr[-3000:]
    assert (f"data: skipping 1 shards found bad before this checkpoint (data.bad_shards=skip): {srv.url}/{name}" in
            resumed.stdout), resumed.stdout[-3000:]
    skipped = [(row["step"], row["data/skipped_shards"]) for row in metric_rows(run) + metric_rows(run, replayed=True)
               if "data/skipped_shards" in row]
    assert sorted(skipped) == sorted([(s, 1) for s in range(1, 10)] + [(4, 1), (5, 1), (6, 1)]), skipped   # 4-6 twice
    assert tensorboard_scalars(run, "data/skipped_shards") == {s: 1 for s in range(1, 10)}
    assert srv.refused == 0 and srv.gets["tokenizer.model"] and srv.gets["manifest.json"] >= 2 and not srv.heads
    grep = lambda text: subprocess.run(["grep", "-r", "-l", text, str(run)], capture_output=True, text=True)  # noqa
    assert grep("SHARDS_TOKEN").returncode == 0   # the copies of the config name the variable: grep reads them
    assert grep(TOKEN).returncode == 1, grep(TOKEN).stdout
    assert TOKEN not in killed.stdout + killed.stderr + resumed.stdout + resumed.stderr
