"""Saves in the background (checkpoint.async_save, pretrain/checkpoints/async_save.py): the commit waits for the
writer, the file holds the state of the save's step (not what training changed since), a save waits for the one
before it, and a failed background write is one line with the previous checkpoint still `latest`; to a bucket (a real S3-protocol
server on 127.0.0.1, moto), the writer also uploads, the commit waits for the upload, and a refused upload is one line
while training goes on; fsspec's in-memory store stands in for any other protocol (gs://…). One rank, in this
process (a gloo group of one); the engine is a stand-in whose files go through its checkpoint engine, as DeepSpeed's
do, with a gate that holds the writer mid-file."""
import os
import threading

import pytest
import torch
import torch.distributed as dist
from types import SimpleNamespace

from pretrain.checkpoints.async_save import HostCopy
from pretrain.checkpoints.bucket import Bucket, Saves
from pretrain.checkpoints.checkpointer import CheckpointError, Checkpointer
from tests.support.s3_server import S3Server


class Engine:
    """Two files a save, written by the checkpoint engine's save (here: torch.save, held at `gate` when set, or
    failing where `fail` names the error)."""

    def __init__(self):
        self.weight = torch.zeros(1000)
        self.gate, self.fail, self.order = None, None, []
        self.checkpoint_engine = SimpleNamespace(save=self.write, load=torch.load)

    def save_checkpoint(self, directory, tag, save_latest):
        folder = os.path.join(directory, tag)
        self.checkpoint_engine.save({"module": {"w": self.weight, "tied": self.weight}},
                                    os.path.join(folder, "mp_rank_00_model_states.pt"))
        self.checkpoint_engine.save(state_dict={"moments": [self.weight * 2]},
                                    path=os.path.join(folder, "zero_pp_rank_0_mp_rank_00_optim_states.pt"))

    def write(self, state_dict, path):
        if self.gate is not None:
            self.gate.wait()
        if self.fail is not None:
            raise self.fail
        self.order.append(("write", os.path.basename(os.path.dirname(path))))
        torch.save(state_dict, path)


@pytest.fixture
def saver(tmp_path):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    engine = Engine()
    lines = []
    saver = Checkpointer(engine, str(tmp_path / "checkpoints"), 3, {}, {}, "", 0, 1, async_save=True,
                         announce=lambda line: (lines.append(line), engine.order.append(("log", line))))
    saver.lines = lines
    try:
        yield saver
    finally:
        dist.destroy_process_group()


def latest(saver) -> str | None:
    path = os.path.join(saver.dir, "latest")
    return open(path).read() if os.path.exists(path) else None


def test_the_commit_comes_after_the_writer_and_holds_the_step_s_state(saver):
    engine = saver.engine
    engine.gate = threading.Event()
    final = saver.save(3)                                    # returns with the writer held mid-file
    assert saver.writer_flags() == [True, False]
    engine.weight += 1                                       # training goes on, in place
    saver.written([1.0, 0.0])                                # the step's all-reduce: a rank still writing
    assert latest(saver) is None and not os.path.exists(final)
    assert not os.path.exists(os.path.join(saver.partial_path(3), "complete.json"))
    engine.gate.set()
    saver.background.writing.wait()
    assert saver.writer_flags() == [False, False]
    # the hang watchdog's view of this rank's save (supervision/saves.py reads `own`): the writer's files, all of them
    written = [os.path.join(saver.partial_path(3), name) for name in sorted(os.listdir(saver.partial_path(3)))]
    assert saver.own.progress() == (len(written), sum(os.path.getsize(f) for f in written)) and len(written) == 4   # + config.yaml
    saver.written([0.0, 0.0])                                # every rank done: committed now
    assert latest(saver) == "step_00000003" and os.path.exists(os.path.join(final, "complete.json"))
    state = torch.load(os.path.join(final, "mp_rank_00_model_states.pt"))
    assert torch.equal(state["module"]["w"], torch.zeros(1000))   # the step's values, not the changed ones
    assert state["module"]["w"] is state["module"]["tied"]        # a tied weight stored once, as torch.save would
    trainer = torch.load(os.path.join(final, "trainer_rank0.pt"), weights_only=False)
    assert trainer["step"] == 3
    assert saver.lines[-1] == f"saved checkpoint {final}"


def test_a_save_waits_for_the_previous_one_to_commit(saver):
    engine = saver.engine
    engine.gate = threading.Event()
    saver.save(3)
    threading.Timer(0.3, engine.gate.set).start()
    saver.save(6, last=True)                                 # settles step 3 first, then writes and commits 6
    writes = [e[1] for e in engine.order if e[0] == "write"]
    logs = [e[1] for e in engine.order if e[0] == "log"]
    assert writes == ["step_00000003.partial"] * 2 + ["step_00000006.partial"] * 2
    assert [line.startswith("saved") for line in logs] == [False, True, False, True], logs
    assert logs[1].endswith("step_00000003") and logs[3].endswith("step_00000006")
    assert latest(saver) == "step_00000006" and saver.background.pending is None


def test_a_failed_background_write_is_one_line_and_keeps_the_previous_latest(saver):
    saver.save(3, last=True)
    saver.engine.fail = OSError(28, "No space left on device")
    saver.save(6)
    saver.background.writing.wait()
    assert saver.writer_flags() == [False, True]
    with pytest.raises(CheckpointError) as e:
        saver.written([0.0, 1.0])
    line = str(e.value)
    assert "\n" not in line and "step_00000006" in line and "No space left on device" in line, line
    assert "the previous checkpoint step_00000003 is kept as latest" in line, line
    assert latest(saver) == "step_00000003"
    assert not os.path.exists(saver.partial_path(6))         # never published, its space given back
    assert saver.background.pending is None


def test_host_copies_are_rebuilt_containers_and_reused_buffers():
    host = HostCopy()
    w = torch.arange(6.0).view(2, 3)
    state = {"a": [w, (w, 3)], "b": {"c": w[0]}, "n": "name"}
    first = host.copy(state, "f.pt")
    assert first["a"][0] is first["a"][1][0] and first["a"][0] is not w   # shared once, copied away from w
    assert first["a"] is not state["a"] and first["b"] is not state["b"] and first["n"] == "name"
    w.add_(1)
    assert torch.equal(first["a"][0], torch.arange(6.0).view(2, 3))
    buffers = dict(host.buffers)
    second = host.copy(state, "f.pt")
    assert all(host.buffers[k] is v for k, v in buffers.items())   # the next save refills the same buffers
    assert torch.equal(second["a"][0], w) and host.bytes == (6 + 3) * 4


def test_async_saves_to_a_bucket_are_accepted():
    from pretrain.config import load_config

    cfg = load_config("configs/demo-cpu.yaml", ["checkpoint.async_save=true", "checkpoint.dir=s3://bucket/run"])
    assert cfg.checkpoint.async_save and cfg.checkpoint.staging_dir.endswith("checkpoint_staging")


@pytest.fixture(scope="module")
def s3():
    with S3Server() as server:
        yield server


def bucket_saver(tmp_path, url):
    """An async saver (one rank, in this process) whose checkpoint.dir is `url`, staged under tmp_path."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    lines, staging = [], str(tmp_path / "staging")
    saves = Saves(url, staging, SimpleNamespace(rank=0))
    saver = Checkpointer(Engine(), staging, 2, {}, {}, "", 0, 1, async_save=True, bucket=saves,
                         announce=lines.append)
    saver.lines = lines
    return saver


@pytest.fixture
def in_s3(s3, tmp_path, monkeypatch, request):
    import s3fs

    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    s3fs.S3FileSystem.clear_instance_cache()
    saver = bucket_saver(tmp_path, s3.bucket(request.node.name.replace("_", "-")[-40:].strip("-")) + "/run")
    try:
        yield saver
    finally:
        dist.destroy_process_group()


def test_an_async_save_to_a_bucket_commits_after_its_upload_and_holds_the_step_s_state(in_s3, tmp_path):
    saver, store = in_s3, in_s3.bucket.store
    saver.engine.gate = threading.Event()
    url = saver.save(3)                                      # returns with the writer held mid-file
    saver.engine.weight += 1                                 # training goes on, in place
    saver.written([1.0, 0.0])
    assert store.named() is None and "step_00000003" not in store.files()   # nothing uploaded while it writes
    saver.engine.gate.set()
    saver.background.writing.wait()
    assert saver.writer_flags() == [False, False]            # done: written and uploaded, not committed
    assert store.named() is None and store.verify("step_00000003") == "no complete.json (not committed)"
    assert sorted(store.files()["step_00000003"]) == ["config.yaml", "mp_rank_00_model_states.pt",
                                                      "trainer_rank0.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    saver.written([0.0, 0.0])                                # every rank's upload done: committed in the bucket now
    assert store.named() == "step_00000003" and store.verify("step_00000003") is None
    assert saver.lines[-1] == f"saved checkpoint {url}" and url == store.where("step_00000003")
    assert not os.path.exists(saver.partial_path(3))         # the staging copy given back
    local = store.download("step_00000003", str(tmp_path / "down"))
    state = torch.load(os.path.join(local, "mp_rank_00_model_states.pt"))
    assert torch.equal(state["module"]["w"], torch.zeros(1000))   # the step's values, not the changed ones


def test_a_refused_async_upload_is_one_line_keeps_the_previous_latest_and_training_goes_on(in_s3, s3, capsys):
    saver, store = in_s3, in_s3.bucket.store
    saver.save(3, last=True)
    assert store.named() == "step_00000003"
    bucket, prefix = store.root.split("/", 1)
    s3.refused.add(f"{bucket}/{prefix}/step_00000006/trainer_rank0.pt")   # a real 403, after the engine's files
    capsys.readouterr()
    saver.save(6)
    saver.background.writing.wait()
    assert saver.writer_flags() == [False, True]
    saver.written([0.0, 1.0])                                # no raise: training goes on
    lines = [line for line in capsys.readouterr().out.splitlines() if "not committed" in line]
    assert len(lines) == 1 and lines[0].startswith(f"error: checkpoint {store.where('step_00000006')} was not "
                                                   f"committed (rank 0: uploading ") and "denied" in lines[0].lower()
    assert "the previous checkpoint step_00000003 stays latest" in lines[0], lines
    assert store.named() == "step_00000003" and store.newest_complete() == "step_00000003"
    assert "mp_rank_00_model_states.pt" in store.files()["step_00000006"]   # cut off midway, never trusted
    saver.save(9, last=True)                                 # the next save commits; retention (keep 2) drops 6's
    assert store.named() == "step_00000009" and sorted(store.files()) == ["step_00000003", "step_00000009"]


def test_the_bucket_layer_is_fsspec_s_for_any_protocol(tmp_path):
    """gs://, az://… go through the same code as s3://: fsspec's in-memory store (memory://) runs an async save,
    its commit, the check a reader makes and the download of a resume, with nothing of s3's."""
    saver = bucket_saver(tmp_path, "memory://ckpt-test/run")
    store = Bucket("memory://ckpt-test/run")
    try:
        saver.save(3, last=True)
        saver.save(6, last=True)
        assert store.named() == "step_00000006" and store.complete_tags() == ["step_00000003", "step_00000006"]
        assert saver.lines[-1] == "saved checkpoint memory://ckpt-test/run/step_00000006"
        local = store.download("step_00000006", str(tmp_path / "down"))
        assert torch.load(os.path.join(local, "trainer_rank0.pt"), weights_only=False)["step"] == 6
    finally:
        dist.destroy_process_group()
        store.fs.rm(store.key(), recursive=True)   # the in-memory store is the process's
