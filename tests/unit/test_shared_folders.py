"""Folders a run leaves for later, on filesystems that nodes share: the flight recorder's folder exists from a rank's
start (torch's dump on a collective's timeout makes none), and a reader's spill clean-up removes only the folders of
readers of its own host that are gone (tokendata/shard_pool.py)."""
import os
import socket
import subprocess
import sys

from pretrain.supervision import flight_recorder
from tokendata.shard_pool import SPILL, ShardPool


def test_the_flight_recorder_s_folder_exists_from_the_rank_s_start(tmp_path, monkeypatch):
    """flight_recorder.enable (run_rank, before the first process group) points NCCL's dump-on-timeout at
    <run_dir>/hang/flight_recorder/ and makes that folder (before, nothing made it before a timeout, and torch's
    writer only logged that it failed); a dump file named by the environment (launch/slurm.sbatch sets one) gets its
    folder too."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("TORCH_FR_", "TORCH_NCCL_"))}
    monkeypatch.setattr(os, "environ", dict(clean))
    flight_recorder.enable(str(tmp_path / "run"))
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "run" / "hang" / "flight_recorder" / "rank_")
    assert (tmp_path / "run" / "hang" / "flight_recorder").is_dir()
    monkeypatch.setattr(os, "environ", {**clean, "TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "elsewhere" / "fr_")})
    flight_recorder.enable(str(tmp_path / "run2"))
    assert (tmp_path / "elsewhere").is_dir()


def test_spill_clean_up_removes_only_this_host_s_folders_whose_reader_is_gone(tmp_path):
    """In a spill root that nodes share (data.cache_dir): a folder of another host (whatever its pid does here), one
    named without a host (the old naming: its host unknown) and one of a live reader of this host stay; one of this
    host whose reader is gone is removed. The new folder is named by pid and host (before, the folders held only a
    pid, checked on this host: another node's live folder was removed)."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()   # a pid no process of this host has now
    host = socket.gethostname()
    root = tmp_path / SPILL
    kept = [f"{gone.pid}@other-node-7-abc_1", f"{gone.pid}-old_name", f"{os.getpid()}@{host}-live1"]
    for name in kept + [f"{gone.pid}@{host}-dead1"]:
        (root / name).mkdir(parents=True)
        (root / name / "shard").write_bytes(b"x")
    pool = ShardPool(1, str(tmp_path))
    mine = os.path.basename(pool.spill_dir())
    try:
        assert sorted(os.listdir(root)) == sorted(kept + [mine])
        assert mine.startswith(f"{os.getpid()}@{host}-")
    finally:
        pool.close()
