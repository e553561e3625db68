"""Loads that run no code (pretrain/checkpoints/safe_load.py): a checkpoint from elsewhere whose pickle would call
os.system is refused by tools/convert.py and tools/evaluate.py in one line, before anything in it runs; the files the
project writes (the frozen 2-rank ZeRO-1 checkpoint of tests/data/pre_redesign) still load with weights_only=True."""
import glob
import os
import shutil

import pytest
import torch

from tests.support.runs import ROOT
from tools import convert, evaluate

CHECKPOINT = os.path.join(ROOT, "tests", "data", "pre_redesign", "checkpoints", "step_00000002")


class RunsCode:
    """Pickled as a call of os.system: what a hostile checkpoint carries."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_every_file_of_a_run_loads_with_weights_only():
    from pretrain.checkpoints import safe_load

    for path in glob.glob(os.path.join(CHECKPOINT, "*.pt")):
        safe_load.check(path)
        assert isinstance(safe_load.load(path, map_location="cpu"), dict), path


@pytest.mark.parametrize("victim", ["mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"])
def test_the_tools_refuse_a_pickle_that_would_run_code_in_one_line(tmp_path, capsys, victim):
    tag = shutil.copytree(CHECKPOINT, tmp_path / "step_00000002")
    marker = tmp_path / "ran"
    state = torch.load(tag / victim, weights_only=False)   # a real file of the checkpoint, with a callable added
    state["extra"] = RunsCode(marker)
    torch.save(state, tag / victim)
    (tmp_path / "text.txt").write_text("a held-out line of text\n")
    for run in (lambda: convert.main(["to-release", str(tag), str(tmp_path / "release"), "--quiet"]),
                lambda: evaluate.main([str(tag), "--text", str(tmp_path / "text.txt"), "--quiet"])):
        assert run() == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and victim in err[0] and "would run code" in err[0] and "posix.system" in err[0], err
    assert not marker.exists() and not (tmp_path / "release").exists()


def test_a_resume_checks_each_file_before_deepspeed_loads_it_with_weights_only_false(tmp_path):
    from types import SimpleNamespace

    from pretrain.checkpoints.checkpointer import Checkpointer
    from pretrain.checkpoints.safe_load import UnsafeCheckpoint

    marker, hostile = tmp_path / "ran", tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": {}, "extra": RunsCode(marker)}, hostile)
    load = lambda path, map_location=None: torch.load(path, map_location=map_location, weights_only=False)  # noqa: E731
    engine = SimpleNamespace(checkpoint_engine=SimpleNamespace(save=torch.save, load=load))   # as DeepSpeed 0.19's
    Checkpointer(engine, str(tmp_path), 3, {}, {}, "", 0, 1)
    assert "module" in engine.checkpoint_engine.load(os.path.join(CHECKPOINT, "mp_rank_00_model_states.pt"))
    with pytest.raises(UnsafeCheckpoint, match="mp_rank_00_model_states.pt holds a pickle that would run code"):
        engine.checkpoint_engine.load(str(hostile))
    assert not marker.exists()
