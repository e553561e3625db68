"""W&B after a rewind: a run sent back to an older checkpoint than a relaunch would resume (checkpoint.resume=PATH, to
get past a loss spike) trains the steps after it anew, and W&B must get them again, while a plain relaunch replays
its steps bit for bit and does not send them twice. The Logger of three launches, with the real wandb library:
offline (its own records read back, as tests/distributed/test_operate.py reads them), a rewind starts a new run that
names its parent; online, against the local W&B server of tests/support/wandb_server.py, W&B's rewind truncates the
run's history, or, where the server refuses it, a new run names its parent (pretrain/observe/monitor.py WandbRun)."""
import glob
import json
import os

import pytest

from tests.distributed.test_operate import wandb_records

OFFLINE = {"WANDB_SILENT": "true", "WANDB_MODE": "offline"}


@pytest.fixture
def wandb_env(monkeypatch):
    """Sets W&B's environment for this test: wandb reads it once a process (its settings singleton, and the service
    it starts), so the library is torn down before and after."""
    import wandb

    def use(env: dict):
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        wandb.teardown()
    yield use
    wandb.teardown()


def offline_runs(run_dir):
    """[(run id, its config, {training step: train/loss})] of each offline run directory, oldest first."""
    out = []
    for path in sorted(glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "*.wandb")), key=os.path.getmtime):
        run_id, config, rows = None, {}, {}
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run_id = record.run.run_id
                config = {i.key: json.loads(i.value_json) for i in record.run.config.update}
            elif kind == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                if "train/loss" in items:
                    rows[int(items["trainer/step"])] = items["train/loss"]
        out.append((run_id, config, rows))
    return out


def launch(tmp_path, resume: int, steps, loss, rewind: bool = False, mode: str = "offline"):
    from pretrain.config import WandbSection
    from pretrain.observe.metrics import Logger

    log = Logger(True, str(tmp_path / "tb"), str(tmp_path / "run"), WandbSection(project="p", mode=mode),
                 {"train": {"lr": 3e-4}})
    log.resume_at(resume, rewind=rewind)
    if resume and not rewind:   # a relaunch's event, at the step it resumed (after rows of later steps)
        log.event(resume, {"run/restarts": 1}, {})
    for step in steps:
        log.scalars(step, {"train/loss": loss(step)})
    log.close()


def test_a_rewind_sends_the_steps_it_trains_anew_and_a_relaunch_does_not_send_its_replay_twice(tmp_path, wandb_env):
    """Launch 1 logs steps 1-6; launch 2, a relaunch from the checkpoint of step 4, replays 5 and 6 (not sent again)
    and logs 7, 8; launch 3 rewinds to step 2 with another learning rate: steps 3-8, trained anew, are sent, to a new
    W&B run whose config names its parent and the step (offline, W&B's rewind point is not known: each launch's
    directory numbers its rows from 0). Before, launch 3 sent nothing: every step up to 8 counted as sent."""
    wandb_env(OFFLINE)
    launch(tmp_path, 0, range(1, 7), float)
    first = (tmp_path / "run" / "wandb-run-id").read_text().strip()
    launch(tmp_path, 4, range(5, 9), float)                        # the same losses: a bit-exact replay
    launch(tmp_path, 2, range(3, 9), lambda s: s / 10, rewind=True)
    (id1, config1, rows1), (id2, config2, rows2), (id3, config3, rows3) = offline_runs(tmp_path / "run")
    assert id1 == id2 == first and "wandb_parent" not in config1 and "wandb_parent" not in config2
    assert rows1 == {s: float(s) for s in range(1, 7)}
    assert rows2 == {7: 7.0, 8: 8.0}                               # 5 and 6 were sent by launch 1
    assert id3 != first and id3 == (tmp_path / "run" / "wandb-run-id").read_text().strip()
    assert config3["wandb_parent"] == {"run_id": first, "step": 2}
    assert rows3 == {s: s / 10 for s in range(3, 9)}               # the steps trained anew, all of them
    assert [line.split()[0] for line in open(tmp_path / "run" / "wandb-steps")] == [str(s) for s in range(3, 9)]


@pytest.mark.parametrize("rewind", [True, False], ids=["server-rewinds", "server-refuses-rewind"])
def test_online_a_rewind_truncates_the_run_or_starts_one_that_names_its_parent(tmp_path, wandb_env, capsys, rewind):
    """The same three launches online. Where the server rewinds (W&B's `resume_from`), the run goes back to its row
    before the first of a step after 2 (launch 2's restart event, at step 4, came after rows of steps 5 and 6) and
    holds steps 1-8 once each, 3-8 as trained anew. Where it refuses (a self-managed server), one warning line, and a
    new run, whose config names its parent, holds 3-8; the parent keeps what it had."""
    from tests.support.wandb_server import accepting_wandb

    with accepting_wandb(rewind) as (env, runs):
        wandb_env(env)
        launch(tmp_path, 0, range(1, 7), float, mode="online")
        first = (tmp_path / "run" / "wandb-run-id").read_text().strip()
        launch(tmp_path, 4, range(5, 9), float, mode="online")
        launch(tmp_path, 2, range(3, 9), lambda s: s / 10, rewind=True, mode="online")
    rows = {run: [(r["_step"], r["trainer/step"], r.get("train/loss")) for r in runs[run]["history"]] for run in runs}
    old = [(0, 1, 1.0), (1, 2, 2.0)]
    new = [(k, s, s / 10) for k, s in enumerate(range(3, 9))]
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: W&B")]
    if rewind:
        assert runs.requests.count("RewindRun") == 1 and not warnings, warnings
        assert rows == {first: old + [(k + 2, s, loss) for k, s, loss in new]}
    else:
        second = (tmp_path / "run" / "wandb-run-id").read_text().strip()
        assert warnings == [f"warning: W&B did not rewind run {first} to step 2 (CommError: failed to rewind run: "
                            f"input: rewind is not enabled on this server); a new W&B run names it as its parent"]
        assert rows[first] == old + [(k, s, float(s)) for k, s in enumerate(range(3, 7), 2)] + [
            (6, 4, None), (7, 7, 7.0), (8, 8, 8.0)]                   # as launches 1 and 2 left it
        assert rows[second] == new
        assert runs[second]["config"]["wandb_parent"] == {"value": {"run_id": first, "step": 2}}


def test_only_a_checkpoint_older_than_the_one_a_relaunch_resumes_is_a_rewind(tmp_path):
    """checkpoint.resume=auto, or a path to the newest checkpoint, resumes where a relaunch would: its replay is bit
    for bit; a path to an older one, or none, trains anew."""
    from pretrain.checkpoints.resume import rewinds

    ckpt = tmp_path / "checkpoints"
    for tag in ("step_00000004", "step_00000006"):
        (ckpt / tag).mkdir(parents=True)
        (ckpt / tag / "complete.json").write_text(json.dumps({"step": int(tag[5:]), "files": {}}))
    (ckpt / "latest").write_text("step_00000006")
    older, newest = str(ckpt / "step_00000004"), str(ckpt / "step_00000006")
    assert not rewinds(newest, "auto", str(ckpt), {}, 2)
    assert not rewinds(newest, newest, str(ckpt), {}, 2)
    assert rewinds(older, older, str(ckpt), {}, 2)
    assert rewinds(None, "none", str(ckpt), {}, 2)
    assert not rewinds(None, "none", str(tmp_path / "empty"), {}, 2)   # no checkpoint: a relaunch starts at 0 too
