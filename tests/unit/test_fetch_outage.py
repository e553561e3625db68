"""An outage is not a bad shard (issue 52, finding 2): a fetch whose transient faults outlast the retries of
tokendata/remote.py raises FetchFailed, which the readers never record as bad (data.bad_shards=skip) and the trainer
classes `transient` (relaunched later); only content that is wrong (hash, size, parse) is a data error. Real servers on
127.0.0.1: one that answers 503 to every GET of a shard, and a port that refuses connections."""
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from benchmarks.bench_data import Synthetic
from pretrain import prelaunch
from pretrain.supervision import classes
from tests.support.http_shards import ShardServer
from tokendata import remote
from tokendata.shard_files import ShardFiles, ShardReader
from tokendata.shards import DataError, read_manifest
from tokendata.stream import TokenStream
from tools.serve_shards import serve

SEQ, PER_SHARD = 8, 4


@pytest.fixture(autouse=True)
def few_quick_retries(monkeypatch):
    """The retry budget made small through the module's own settings (SYNTHFORMER_DATA_RETRIES at import)."""
    monkeypatch.setattr(remote, "RETRIES", 2)
    monkeypatch.setattr(remote, "BACKOFF_S", 0.001)
    monkeypatch.setenv(remote.HTTP_SETTINGS, "")


@pytest.fixture
def served(tmp_path):
    """Six shards of four samples on a server: (server, its manifest, the name of a shard whose bytes are damaged
    (same size, one byte changed: its content hash fails), the name of one whose every GET answers 503)."""
    root = Synthetic(shards=6, per_shard=PER_SHARD, seq_len=SEQ, vocab=64).write(str(tmp_path / "shards"))
    damaged, down = "train-000001.tar", "train-000002.tar"
    path = tmp_path / "shards" / damaged
    data = bytearray(path.read_bytes())
    data[600] ^= 0xFF   # in the first sample's payload
    path.write_bytes(bytes(data))
    with ShardServer(root) as srv:
        srv.faults[down] = ["503"] * 1000
        yield srv, read_manifest(srv.url), damaged, down


def outage(e: BaseException) -> bool:
    """Whether an error is the outage's type (by name: the code before it had none, and its tests fail here)."""
    return type(e).__name__ == "FetchFailed"


def refused_url() -> str:
    """A URL on 127.0.0.1 whose port nobody listens on (bound, then closed): every connection is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def test_a_fetch_that_outlasts_the_retries_raises_fetch_failed_and_a_corrupt_shard_a_data_error(served):
    srv, manifest, damaged, down = served
    files = ShardFiles(srv.url, manifest)
    with pytest.raises(DataError) as e:
        files.fetch_checked(down)
    assert outage(e.value), repr(e.value)
    assert srv.gets[down] == 3 and "\n" not in str(e.value), str(e.value)   # the first try and 2 retries
    assert str(e.value).startswith(f"shard {srv.url}/{down}: HTTP 503 Service Unavailable, still after 2 retries")
    assert "bad_shards" not in str(e.value)   # no advice to rebuild or skip a shard that is fine
    with pytest.raises(DataError) as e:
        files.fetch_checked(damaged)
    assert not outage(e.value) and "has content hash" in str(e.value), str(e.value)
    dead = refused_url()
    for fetch in (lambda: remote.fetch(f"{dead}/{down}", 10),
                  lambda: remote.sizes([f"{dead}/{down}"]),   # the size check of an older order: not a Missing shard
                  lambda: read_manifest(dead)):               # a source's manifest on a server that is down
        with pytest.raises(DataError) as e:
            fetch()
        assert outage(e.value), repr(e.value)


def test_the_skip_path_marks_a_corrupt_shard_bad_but_not_an_outage(served):
    """ShardReader (validation, older orders) and the train readers (reading.py, in the process and in a DataLoader
    worker) under data.bad_shards=skip: a damaged shard is skipped and recorded; an outage is raised, recorded
    nowhere."""
    srv, manifest, damaged, down = served
    files = ShardFiles(srv.url, manifest)
    names = [s["name"] for s in manifest["splits"]["train"]["shards"]]
    reader = ShardReader(files, ("tokens.u16", (SEQ + 1) * 2), "skip", "train", len(names))
    assert reader.read(damaged, PER_SHARD) == [] and reader.bad == {files.url(damaged)}
    with pytest.raises(DataError) as e:   # (before: [], the shard recorded bad for good)
        reader.read(down, PER_SHARD)
    assert outage(e.value), repr(e.value)
    assert reader.bad == {files.url(damaged)} and reader.skipped == [files.url(damaged)]
    for workers in (0, 1):
        srv.faults[down] = ["503"] * 1000
        stream = TokenStream(srv.url, 2, SEQ, num_workers=workers, seed=1, bad_shards="skip", canonical_streams=1,
                             global_batch_size=2)
        with pytest.raises(DataError) as e:
            it = iter(stream)
            for _ in range(len(names) * PER_SHARD // 2):   # every train sample once: shard `down` among them
                next(it)
        assert outage(e.value) and "\n" not in str(e.value) and down in str(e.value), repr(e.value)
        assert files.url(down) not in stream.bad_found(), stream.bad_found()


def test_the_check_before_a_launch_exits_transient_on_an_outage_and_the_script_tries_again(tmp_path):
    """The check before a launch (`python -m pretrain.config … --world-size N`) on a shard server that is down exits 6,
    the ranks' class `transient` (before: 2, a config error that no relaunch retries), in one line; launch/pretrain.sh
    with --max-restarts 1 checks again once after its wait, then passes the 6 through; a bad setting stays 2."""
    assert prelaunch.TRANSIENT_EXIT == classes.TRANSIENT.exit
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, SYNTHFORMER_DATA_RETRIES="1", RESTART_BACKOFF="0", NPROC="1",
               PYTHON=sys.executable, PYTHONPATH=root)
    common = ["configs/demo-cpu.yaml", f"train.run_dir={tmp_path}/run", f"checkpoint.dir={tmp_path}/ckpt"]
    down = subprocess.run(["bash", "launch/pretrain.sh", "--max-restarts", "1", *common,
                           f"data.shard_dir={refused_url()}/shards"], cwd=root, env=env, capture_output=True, text=True,
                          timeout=120)
    errors = [line for line in down.stderr.splitlines() if line.startswith("error:")]
    assert down.returncode == 6, down.stderr
    assert len(errors) == 2 and "an outage" in errors[0], down.stderr   # the check, and the check again
    assert down.stderr.count("checking again") == 1, down.stderr
    bad = subprocess.run(["bash", "launch/pretrain.sh", "--max-restarts", "1", *common, "train.lr=-1"], cwd=root,
                         env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "checking again" not in bad.stderr, bad.stderr


def test_a_client_gone_mid_transfer_is_one_line_of_the_shard_server_not_a_traceback(tmp_path, capfd):
    """tools/serve_shards.py: a rank killed while it reads a shard (the rehearsal's preemption and outage cases) closes
    its connection; the server says so in one line (before: socketserver's traceback of a BrokenPipeError)."""
    (tmp_path / "big.bin").write_bytes(os.urandom(32 << 20))
    server = serve(str(tmp_path))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        for _ in range(3):
            with socket.create_connection(server.server_address[:2]) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")   # RST
                s.sendall(b"GET /big.bin HTTP/1.1\r\nHost: x\r\n\r\n")
                s.recv(1024)
        time.sleep(0.5)
    finally:
        server.shutdown()
        server.server_close()
    err = capfd.readouterr().err
    assert "Traceback" not in err and "closed the connection mid-transfer" in err, err
