"""Checkpoints in a bucket (pretrain/checkpoints/bucket.py) against a real S3-protocol server on 127.0.0.1 (moto), on
objects made by hand: the commit order (complete.json, then `latest`), what a reader trusts, downloads, and retention
in the bucket (the last `keep`, every `keep_every`-th step, never what `latest` names nor a save being uploaded)."""
import json
import os
from types import SimpleNamespace

import pytest

from pretrain.checkpoints import retention
from pretrain.checkpoints.bucket import Bucket, local_checkpoint, resume_from, rewinds
from pretrain.config.checkpoint_section import CheckpointSection
from model import ConfigError
from tests.support.s3_server import S3Server


@pytest.fixture(scope="module")
def s3():
    with S3Server() as server:
        yield server


@pytest.fixture
def store(s3, monkeypatch, request):
    import s3fs

    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    s3fs.S3FileSystem.clear_instance_cache()   # one made for another server's endpoint
    name = request.node.name.replace("_", "-")[:50].strip("-")
    return Bucket(s3.bucket(name) + "/run")


def upload(store, tmp_path, step, commit=True, size=None):
    """A tag as a save leaves it: every rank's files uploaded, then (commit) complete.json and `latest`."""
    tag, files = f"step_{step:08d}", {}
    for name in ("mp_rank_00_model_states.pt", "trainer_rank0.pt", "trainer_rank1.pt"):
        local = tmp_path / f"{tag}-{name}"
        local.write_bytes(b"x" * (size or step))
        files[name] = store.upload(str(local), tag, name)
    if commit:
        store.commit(tag, files, step)
    return tag


def test_a_reader_trusts_a_tag_only_after_complete_json_and_latest_comes_last(store, tmp_path):
    first = upload(store, tmp_path, 3)
    tag = upload(store, tmp_path, 6, commit=False)   # every file there, not committed: a save being uploaded
    assert store.verify(tag) == "no complete.json (not committed)"
    assert store.newest_complete() == first and store.complete_tags() == [first]
    seen = {}

    def between():   # complete.json written, `latest` not yet: a reader resumes the previous, or this one whole
        seen["latest"], seen["verify"] = store.named(), store.verify(tag)

    files = json.loads(json.dumps(store.files()[tag]))
    store.commit(tag, files, 6, after_record=between)
    assert seen == {"latest": first, "verify": None}
    assert store.named() == tag and store.newest_complete() == tag


def test_a_file_short_of_its_recorded_size_is_not_trusted(store, tmp_path, capsys):
    first, tag = upload(store, tmp_path, 3), upload(store, tmp_path, 6)
    store.fs.pipe_file(store.key(tag, "trainer_rank1.pt"), b"x" * 2)   # cut off (a hand-made damage)
    assert store.verify(tag) == "trainer_rank1.pt has 2 bytes, 6 were written"
    assert store.newest_complete(announce=True) == first
    assert f"checkpoint {store.where(tag)} is incomplete" in capsys.readouterr().out


def test_a_download_is_the_tag_as_uploaded_and_the_tools_take_a_bucket_path(store, tmp_path):
    upload(store, tmp_path, 3)
    tag = upload(store, tmp_path, 6)
    local = store.download(tag, str(tmp_path / "staging"))
    assert sorted(os.listdir(local)) == [".downloaded", "complete.json", "mp_rank_00_model_states.pt", "trainer_rank0.pt",
                                         "trainer_rank1.pt"]
    assert (tmp_path / "staging" / tag / "trainer_rank1.pt").read_bytes() == b"x" * 6
    assert store.download(tag, str(tmp_path / "staging")) == local   # the same commit: the copy is used
    store.fs.pipe_file(store.key(tag, "trainer_rank1.pt"), b"y" * 6)   # the tag saved again (after a rewind)
    store.commit(tag, {n: 6 for n in ("mp_rank_00_model_states.pt", "trainer_rank0.pt", "trainer_rank1.pt")}, 6)
    assert (tmp_path / "staging" / tag / "trainer_rank1.pt").read_bytes() == b"x" * 6
    store.download(tag, str(tmp_path / "staging"))   # another commit of the same tag: downloaded again
    assert (tmp_path / "staging" / tag / "trainer_rank1.pt").read_bytes() == b"y" * 6
    assert local_checkpoint(store.url, str(tmp_path / "tools")) == str(tmp_path / "tools" / tag)
    assert local_checkpoint(store.where("step_00000003"), str(tmp_path / "t2")) == str(tmp_path / "t2" /
                                                                                          "step_00000003")
    with pytest.raises(ConfigError, match="no complete checkpoint there"):
        local_checkpoint(store.where("nothing"), str(tmp_path / "t3"))


def test_retention_in_the_bucket_keeps_the_last_keep_every_keep_every_th_latest_and_a_save_under_way(store,
                                                                                                     tmp_path):
    steps = [100, 200, 300, 400, 500, 600, 700]
    for step in steps:
        upload(store, tmp_path, step, size=1)
    upload(store, tmp_path, 250, commit=False, size=1)   # a crashed save's leftover, older than the newest
    upload(store, tmp_path, 800, commit=False, size=1)   # a save being uploaded: newer than any committed
    store.write_text("latest", "step_00000300")          # a rewind: `latest` names an older one
    # the reference, computed by hand: keep 2 (600, 700), every 500th (500), `latest` (300), the save under way
    # (800); deleted: 100, 200, 400 and the leftover 250
    gone = store.prune(keep=2, keep_every=500)
    assert gone == ["step_00000100", "step_00000200", "step_00000400", "step_00000250"]
    assert sorted(store.files()) == ["step_00000300", "step_00000500", "step_00000600", "step_00000700",
                                     "step_00000800"]
    assert store.newest_complete() == "step_00000300"


def test_retention_chooses_alike_for_a_directory_and_a_bucket(tmp_path):
    complete = [f"step_{s:08d}" for s in (1, 2, 3, 4, 5)]
    assert retention.choose(complete, ["step_00000003.partial", "step_00000009.partial"], {"step_00000005"}, 2) == \
        ["step_00000001", "step_00000002", "step_00000003", "step_00000003.partial"]


def test_a_checkpoint_dir_over_http_or_a_pipe_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"checkpoint.dir=.*http://host/x.*an object store URL"):
        CheckpointSection(dir="http://host/x")
    assert CheckpointSection(dir="s3://bucket/prefix").dir == "s3://bucket/prefix"


def test_resuming_an_older_tag_of_the_bucket_is_a_rewind_and_the_newest_is_not(store, tmp_path):
    upload(store, tmp_path, 3)
    newest = upload(store, tmp_path, 6)
    staging = str(tmp_path / "staging")
    older = SimpleNamespace(dir=store.url, resume=store.where("step_00000003"), staging_dir=staging)
    path = resume_from(older, {}, 2)
    assert path == os.path.join(staging, "step_00000003") and rewinds(path, older, {}, 2)
    auto = SimpleNamespace(dir=store.url, resume="auto", staging_dir=staging)
    assert resume_from(auto, {}, 2) == os.path.join(staging, newest) and not rewinds(path, auto, {}, 2)
    named = SimpleNamespace(dir=store.url, resume=store.where(newest), staging_dir=staging)
    assert not rewinds(resume_from(named, {}, 2), named, {}, 2)
