"""Saves in the background (checkpoint.async_save, pretrain/checkpoints/async_save.py): the commit waits for the
writer, the file holds the state of the save's step (not what training changed since), a save waits for the one
before it, and a failed background write is one line with the previous checkpoint still `latest`. One rank, in this
process (a gloo group of one); the engine is a stand-in whose files go through its checkpoint engine, as DeepSpeed's
do, with a gate that holds the writer mid-file."""
import os
import threading

import pytest
import torch
import torch.distributed as dist
from types import SimpleNamespace

from pretrain.checkpoints.async_save import HostCopy
from pretrain.checkpoints.checkpointer import CheckpointError, Checkpointer


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


def test_async_saves_to_a_bucket_are_refused_in_one_line():
    """A bucket's saves upload before they commit, in the step; async saves to one are not built yet: one line."""
    from model import ConfigError
    from pretrain.config import load_config

    with pytest.raises(ConfigError) as e:
        load_config("configs/demo-cpu.yaml", ["checkpoint.async_save=true", "checkpoint.dir=s3://bucket/run"])
    assert "\n" not in str(e.value) and str(e.value).startswith("checkpoint.async_save=true with checkpoint.dir=")
