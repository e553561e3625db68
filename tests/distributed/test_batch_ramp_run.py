"""train.batch_ramp in a real run (the trainer on 2 gloo ranks, ZeRO-1, a DataLoader worker each): global batches of
4 (one micro-batch of 2 a rank) for the ramp's first 16 samples, then of 8 (two: DeepSpeed's accumulation follows).
Rank 1 is killed (kill -9) in the save of step 6 and the same command relaunched: it resumes at step 3, mid-ramp, and
runs steps 4–6 again across the change of batch, bit for bit (losses and sample ids). The samples it read are the
unramped order's, in sequence: steps 1+2 and 3+4 hold global batches 0 and 1 of 8, step s ≥ 5 is batch s − 3, sample
for sample; the LR follows the tokens (lr_lambda with the ramp's progress); progress/samples_seen adds the batches."""
import pytest

from pretrain.config import load_config
from pretrain.engine import lr_lambda
from tests.support.runs import id_rows, launch, metric_rows, write_config
from tokendata.stream import TokenStream

pytestmark = pytest.mark.slow
STEPS, SEQ = 8, 32


@pytest.fixture(scope="module")
def run(shards, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ramp")
    cfg = write_config(tmp / "ramp.yaml", shards, tmp / "run", data={"num_workers": 1}, parallel={"zero_stage": 1},
                       train={"global_batch_size": 8, "micro_batch_size": 2, "max_steps": STEPS,
                              "batch_ramp": {"start": 4, "increment": 4, "tokens": 16 * SEQ}},
                       checkpoint={"every": 3, "keep": 2}, logging={"every": 1, "sample_ids": True})
    r = launch(cfg, 2, check=False, env={"SYNTHFORMER_FAULTS": "kill-save-begin@6@1"})
    assert r.returncode != 0 and "saved checkpoint" in r.stdout, r.stdout[-3000:]
    r = launch(cfg, 2, env={"SYNTHFORMER_FAULTS": "kill-save-begin@6@1"})
    assert "resumed at step 3" in r.stdout, r.stdout[-3000:]
    return tmp / "run", load_config(cfg)


def by_step(rows) -> dict:
    """{step: the ids of its micro-batches, in order} of one rank's rows (a row per micro-batch)."""
    out = {}
    for row in rows:
        out.setdefault(row["step"], []).extend(row["ids"])
    return out


def test_a_ramped_run_killed_mid_ramp_reads_the_unramped_order_in_sequence(run, shards):
    path, cfg = run
    loss = {row["step"]: row["train/loss"] for row in metric_rows(path) if "train/loss" in row}
    replayed = {row["step"]: row["train/loss"] for row in metric_rows(path, replayed=True) if "train/loss" in row}
    assert sorted(loss) == list(range(1, STEPS + 1)) and set(replayed) >= {4, 5}
    assert all(loss[s] == x for s, x in replayed.items())   # bit for bit after the kill, across the change of batch
    ranks = [by_step(id_rows(path, r)) for r in (0, 1)]
    for r in (0, 1):
        again = by_step(id_rows(path, r, replayed=True))
        assert set(again) >= {4, 5} and all(ranks[r][s] == ids for s, ids in again.items()), r
    steps = {s: ranks[0][s] + ranks[1][s] for s in range(1, STEPS + 1)}   # the global batch in position order
    assert [len(steps[s]) for s in steps] == [4, 4, 4, 4, 8, 8, 8, 8]
    plain = TokenStream(shards, 8, SEQ, seed=cfg.data.seed, global_batch_size=8)
    it = iter(plain)
    unramped = [next(it)["ids"] for _ in range(6)]   # global batches 0–5 of 8
    assert sorted(steps[1] + steps[2]) == sorted(unramped[0]) and sorted(steps[3] + steps[4]) == sorted(unramped[1])
    assert [steps[s] for s in range(5, STEPS + 1)] == unramped[2:]
    rows = {row["step"]: row for row in metric_rows(path) if "train/loss" in row}
    ramp = cfg.batch_ramp()
    f = lr_lambda(cfg.train, cfg.total_steps(), ramp.full_batches)
    for s in range(1, STEPS + 1):
        assert rows[s]["train/lr"] == pytest.approx(cfg.train.lr * f(s)), s
        assert rows[s]["progress/samples_seen"] == ramp.samples_before(s)
    assert rows[2]["train/lr"] == pytest.approx(cfg.train.lr * (8 / 8) / 3)   # 8 samples in = one full batch of 3
