"""Checkpoints in a bucket (`checkpoint.dir: s3://…`, pretrain/checkpoints/bucket.py), against a real S3-protocol server
on 127.0.0.1 (moto), with the shared reference run (2 ranks, a checkpoint every 3 steps): one launch in which rank 1's
upload of step 6 fails after its first file (the run goes on, step 3 stays `latest`) and rank 0 is killed (-9) in the
save of step 12 after its upload, before the commit (step 9 stays `latest`); a relaunch with async saves
(checkpoint.async_save: a writer thread writes to the staging directory, then uploads) resumes from step 9, the server
refuses rank 1's upload of step 15 with a 403 (the run goes on, step 12 stays `latest`) and rank 0's writer kills it
(-9) after its upload of step 21, before the commit (step 18 stays `latest`); the last relaunch resumes from the
bucket and every loss and sample id equals the uninterrupted run's, bit for bit; tools/evaluate.py and
tools/convert.py read the bucket. Then the bucket's step 9 moves to 1 rank: tools/convert.py to-universal from the
bucket into the bucket, and a 1-rank run resumes it from there, its losses those of the 2-rank run."""
import json

import pytest

from tools import convert, evaluate

from tests.support.runs import launch, record, reference_config
from tests.support.s3_server import S3Server

pytestmark = pytest.mark.slow
TOLERANCE = 1e-4   # relative, fp32 on CPU: 2 ranks → 1 sums the same global batch in another order


def bucket_latest(fs, prefix) -> str | None:
    fs.invalidate_cache()
    return fs.cat_file(f"{prefix}/latest").decode() if fs.exists(f"{prefix}/latest") else None


def losses(run):
    return {r["step"]: r["train/loss"] for r in map(json.loads, open(run / "metrics.jsonl")) if "train/loss" in r}


def evaluated(checkpoint, shards, capsys) -> dict:
    assert evaluate.main([str(checkpoint), "--shards", shards, "--max-samples", "4", "--json", "--quiet"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_save_kill_resume_and_relayout_through_a_bucket(shards, reference_run, tmp_path, monkeypatch, capsys):
    import s3fs

    reference = record(reference_run)
    with S3Server() as s3:
        url = s3.bucket("ckpt") + "/run"
        fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3.url}, key="testing-key", secret="testing-secret")
        run, cfg = tmp_path / "run", reference_config(tmp_path, shards, "run", checkpoint={"dir": url})
        faults = "upload-fail@6@1,kill-save-uploaded@12@0"
        r = launch(cfg, 2, check=False, env={**s3.env, "SYNTHFORMER_FAULTS": faults})
        assert r.returncode != 0
        failed = [line for line in r.stdout.splitlines() if "was not committed" in line]
        assert len(failed) == 1 and f"checkpoint {url}/step_00000006 was not committed (rank 1: " in failed[0] \
            and "upload denied" in failed[0] and "the previous checkpoint step_00000003 stays latest" in failed[0], \
            r.stdout[-3000:]
        assert f"saved checkpoint {url}/step_00000009" in r.stdout
        assert bucket_latest(fs, "ckpt/run") == "step_00000009"   # step 12 uploaded, never committed
        assert fs.exists("ckpt/run/step_00000012/trainer_rank0.pt")
        assert not fs.exists("ckpt/run/step_00000012/complete.json")
        moved = s3.bucket("moved") + "/run"   # step 9 in a bucket of its own, for the move to 1 rank below
        fs.copy("ckpt/run/step_00000009", "moved/run/step_00000009", recursive=True)
        fs.pipe_file("moved/run/latest", b"step_00000009")

        # async saves (checkpoint.async_save) to the bucket: the writer thread writes and uploads; the server refuses
        # rank 1's trainer file of step 15 (a real 403, as a bucket policy's Deny: after its engine's files), and
        # rank 0 is killed (-9) by its writer thread once its upload of step 21 is done, before the commit
        s3.refused.add("ckpt/run/step_00000015/trainer_rank1.pt")
        cfg = reference_config(tmp_path, shards, "run", checkpoint={"dir": url, "async_save": True})
        r = launch(cfg, 2, check=False, env={**s3.env, "SYNTHFORMER_FAULTS": "kill-save-uploaded@21@0"})
        assert r.returncode != 0 and "resumed at step 9" in r.stdout, r.stdout[-3000:]
        failed = [line for line in r.stdout.splitlines() if "was not committed" in line]
        assert len(failed) == 1 and f"checkpoint {url}/step_00000015 was not committed (rank 1: uploading " \
            in failed[0] and "trainer_rank1.pt: permission denied" in failed[0] \
            and "the previous checkpoint step_00000012 stays latest" in failed[0], r.stdout[-3000:]
        assert f"saved checkpoint {url}/step_00000012" in r.stdout and f"saved checkpoint {url}/step_00000018" \
            in r.stdout and "written and uploaded in the background" in r.stdout
        assert bucket_latest(fs, "ckpt/run") == "step_00000018"   # step 21 uploaded by rank 0, never committed
        assert fs.exists("ckpt/run/step_00000021/trainer_rank0.pt")
        assert not fs.exists("ckpt/run/step_00000021/complete.json")
        assert not fs.exists("ckpt/run/step_00000015")           # the refused save's part: removed by retention

        cfg = reference_config(tmp_path, shards, "run", checkpoint={"dir": url})
        r = launch(cfg, 2, env=s3.env)
        assert "resumed at step 18" in r.stdout, r.stdout[-3000:]
        assert record(run) == reference                         # every loss and sample id, bit for bit
        assert bucket_latest(fs, "ckpt/run") == "step_00000040"
        fs.invalidate_cache()
        assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls("ckpt/run")) == ["latest", "step_00000039",
                                                                           "step_00000040"]   # keep 2
        for name, value in s3.env.items():   # the tools read the bucket in this process
            monkeypatch.setenv(name, value)
        s3fs.S3FileSystem.clear_instance_cache()
        ours, theirs = evaluated(url, shards, capsys), evaluated(reference_run / "checkpoints", shards, capsys)
        assert (ours["step"], ours["loss"]) == (40, theirs["loss"])   # the same weights, read from the bucket
        assert convert.main(["to-release", f"{url}/step_00000039", str(tmp_path / "release"), "--quiet"]) == 0
        assert "step 39" in capsys.readouterr().out

        # 2 ranks → 1: tools/convert.py makes the universal checkpoint of the bucket's step 9 in the bucket (as
        # checkpoint.relayout's launch does, through the same functions), and 1 rank resumes it from there
        assert convert.main(["to-universal", moved]) == 0
        assert f"wrote universal checkpoint {moved}/universal_step_00000009" in capsys.readouterr().out
        cfg = reference_config(tmp_path, shards, "moved", checkpoint={"dir": moved}, train={"stop_after_steps": 3})
        r = launch(cfg, 1, env=s3.env)
        assert "resumed at step 9 from the universal checkpoint" in r.stdout, r.stdout[-3000:]
        got = losses(tmp_path / "moved")
        assert sorted(got) == [10, 11, 12]
        assert max(abs(got[s] - reference[0][s]) / abs(reference[0][s]) for s in got) <= TOLERANCE
