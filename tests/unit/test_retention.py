"""Retention (pretrain/checkpoints/retention.py) on a checkpoints folder made as the checkpointer makes it: the last
`checkpoint.keep`, every `checkpoint.keep_every`-th step for good, never what `latest` names nor a save being
written."""
import os
from types import SimpleNamespace

import pytest

from model import ConfigError
from pretrain.checkpoints.checkpointer import Checkpointer
from pretrain.checkpoints.durable import publish
from pretrain.config.checkpoint_section import CheckpointSection


def save(directory, step, commit=True):
    """A tag as Checkpointer.save leaves it: files in step_N.partial/, then complete.json, rename, `latest`."""
    partial = os.path.join(directory, f"step_{step:08d}.partial")
    os.makedirs(partial)
    with open(os.path.join(partial, "trainer_rank0.pt"), "wb") as f:
        f.write(b"x" * step)
    if commit:
        publish(partial, os.path.join(directory, f"step_{step:08d}"), os.path.join(directory, "latest"), step)


def prune(directory, keep, keep_every=None):
    more = {"keep_every": keep_every} if keep_every else {}
    ck = Checkpointer(SimpleNamespace(), str(directory), keep, {}, {}, "", 0, 1, **more)
    ck._prune()
    return sorted(os.listdir(directory))


def test_the_last_keep_and_every_keep_every_th_step_stay(tmp_path):
    for step in range(100, 1300, 100):
        save(tmp_path, step)
    left = prune(tmp_path, keep=2, keep_every=500)
    assert left == ["latest", "step_00000500", "step_00001000", "step_00001100", "step_00001200"]
    assert prune(tmp_path, keep=2) == ["latest", "step_00001100", "step_00001200"]   # null: the last two only


def test_never_the_checkpoint_latest_names_nor_one_being_written(tmp_path):
    for step in (10, 20, 30):
        save(tmp_path, step)
    save(tmp_path, 40, commit=False)                   # being written (an async save): newer than any commit
    save(tmp_path, 5, commit=False)                    # a crashed save's leftover, older than the newest commit
    with open(tmp_path / "latest", "w") as f:          # `latest` names an old one (a rewind)
        f.write("step_00000010")
    with open(tmp_path / "latest_universal", "w") as f:
        f.write("universal_step_00000020")
    assert prune(tmp_path, keep=1) == ["latest", "latest_universal", "step_00000010", "step_00000030",
                                       "step_00000040.partial"]


def test_keep_every_is_checked_with_its_dotted_key():
    assert CheckpointSection(keep_every=10000).keep_every == 10000
    with pytest.raises(ConfigError, match="checkpoint.keep_every"):
        CheckpointSection(keep_every=0)
