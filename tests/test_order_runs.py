"""Real runs of the data order (the trainer on gloo ranks; three sources of shards of 8 samples blended 0.5 / 0.3 /
0.2, the groups of 4 shards pooled; the small source c wraps within the run):
- 2 data-parallel ranks of 2 workers and 4 of 1 read the same samples in every global batch and give the same losses
  (relative 1e-4); at 4 ranks source a is streamed from a real HTTP server, which counts each shard fetched once;
- after every step every source is within one sample of its weight; c is in its second epoch; validation per source
  and combined is in metrics.jsonl and in TensorBoard;
- the 2-rank run killed (kill -9 of a rank, in a save), relaunched, stopped at step 20 (SIGTERM) and continued on one
  rank with checkpoint.relayout=true: bit for bit the run left alone up to the stop, then its samples step for step
  and its losses (relative 1e-4), no sample of a or b twice."""
import collections
import os

import pytest

from tests.http_shards import ShardServer
from tests.runs import BLEND, blend_sources, id_rows, launch, losses, metric_rows, write_config
from tokendata.shards import read_manifest
from tokendata.sources import Source
from tokendata.stream import TokenStream

pytestmark = pytest.mark.slow
STEPS, G, SEQ = 40, 8, 32   # tests/runs.py write_config: global batch 8, micro-batch 4; data.seed 1234, C = 8


def config(tmp, name, data, every=100):
    return write_config(tmp / f"{name}.yaml", None, tmp / name, data={"num_workers": 2, **data},
                        parallel={"zero_stage": 1}, train={"max_steps": STEPS}, checkpoint={"every": every, "keep": 2},
                        logging={"every": 1, "val_every": 20, "image_every": 0, "sample_ids": True})


def global_batches(run):
    """{step: Counter of the sample ids of its global batch}, from every rank's sample_ids file."""
    out = collections.defaultdict(collections.Counter)
    for name in os.listdir(run / "sample_ids"):
        if not name.endswith(".replayed.jsonl"):
            for row in id_rows(run, int(name[len("rank"):-len(".jsonl")])):
                out[row["step"]].update(row["ids"])
    return dict(out)


def assert_close(got, ref, steps, what):
    assert sorted(got) == list(steps)
    print(f"\n{what}: largest relative loss difference from 2 ranks over steps {steps.start}-{steps.stop - 1}: "
          f"{max(abs(got[s] - ref[s]) / abs(ref[s]) for s in steps):.2g}")
    for step in steps:
        assert abs(got[step] - ref[step]) <= 1e-4 * abs(ref[step]), (step, got[step], ref[step])


@pytest.fixture(scope="module")
def runs(blend, tmp_path_factory):
    """The blend on 2 ranks; on 4 ranks with a served over HTTP; and on 2 ranks interrupted, then on 1 (the module
    docstring). Each launch starts its ranks directly, as a scheduler does, but the last: the launcher converts the
    checkpoint to a universal one before its rank starts."""
    tmp = tmp_path_factory.mktemp("blended")
    data = {"shard_dir": None, "sources": blend_sources(blend)}
    out = launch(config(tmp, "dp2", data), 2).stdout
    with ShardServer(blend["a"]) as srv:
        launch(config(tmp, "dp4", {**data, "sources": blend_sources(blend, a=srv.url), "num_workers": 1}), 4,
               "train.micro_batch_size=2")
    chain = config(tmp, "chain", data, every=3)
    r = launch(chain, 2, check=False, env={"SYNTHFORMER_FAULTS": "kill-save-begin@9@1"})   # SIGKILL of rank 1
    assert r.returncode != 0 and "saved checkpoint" in r.stdout and "step_00000009" not in r.stdout
    r = launch(chain, 2, env={"SYNTHFORMER_FAULTS": "term@20@0"})   # rank 0 gets SIGTERM in step 20
    assert "resumed at step 6" in r.stdout and "stopped at step 20 (SIGTERM)" in r.stdout, r.stdout[-3000:]
    r = launch(chain, 1, "checkpoint.relayout=true", launcher=True)
    assert "resumed at step 20 from the universal checkpoint" in r.stdout, r.stdout[-3000:]
    return {"dp2": tmp / "dp2", "dp4": tmp / "dp4", "chain": tmp / "chain", "stdout": out, "gets": srv.gets,
            "heads": srv.heads}


def test_2_and_4_ranks_read_the_same_global_batches_and_give_the_same_losses(runs):
    reference = global_batches(runs["dp2"])
    assert sorted(reference) == list(range(1, STEPS + 1)) and all(sum(b.values()) == G for b in reference.values())
    assert global_batches(runs["dp4"]) == reference
    assert_close(losses(runs["dp4"]), losses(runs["dp2"]), range(1, STEPS + 1), "4 ranks")


def test_each_train_shard_is_fetched_once_by_the_one_rank_that_trains_on_it(blend, runs):
    """4 ranks × 1 worker read a over HTTP: the server saw one GET of each shard of the groups the 8 streams started
    (plus the group each fetches ahead), none twice, none of another group; one HEAD of every shard (rank 0's check)."""
    stream = TokenStream([Source(**s) for s in blend_sources(blend)], 2, SEQ, dp_world=4, seed=1234,
                         global_batch_size=G)
    order = stream.orders[0]

    def fetched(step):   # the groups of a each stream has started by global batch `step`, and the one after each
        names, position = set(), stream.blend.position_at(step, G)
        for c in range(order.streams):
            start = 0
            for group in order.walk(c, 0):
                names.update(group["names"])
                if start >= position.streams[c][0]:
                    break
                start += sum(dict(order.shards)[n] for n in group["names"])
        return names

    gets = {name: n for name, n in runs["gets"].items() if name.startswith("train-")}
    assert set(gets.values()) == {1}, gets
    # the readers run ahead of training by the DataLoader's prefetch: up to 3 global batches
    assert fetched(STEPS) <= set(gets) <= fetched(STEPS + 3)
    listed = {s["name"] for split in read_manifest(blend["a"])["splits"].values() for s in split["shards"]}
    assert set(runs["heads"]) == listed and set(runs["heads"].values()) == {1}


def test_every_source_stays_within_one_sample_of_its_weight_and_the_small_one_wraps(runs):
    run, weights = runs["dp2"], {name: w for name, (_, _, w) in BLEND.items()}
    batches, counts, worst = global_batches(run), collections.Counter(), 0.0
    rows = {row["step"]: row for row in metric_rows(run) if "train/loss" in row}
    for step in range(1, STEPS + 1):
        counts.update(i.split("/")[0] for i in batches[step].elements())
        worst = max([worst] + [abs(counts[n] - w * G * step) for n, w in weights.items()])
        assert all(rows[step][f"data/{n}/tokens"] == counts[n] * SEQ for n in weights), step
    print(f"\nlargest |count − w·N| over {STEPS} steps of the 0.5/0.3/0.2 blend: {worst:.2f} samples")
    assert worst <= 1
    epochs = rows[STEPS]["data/c/epochs"]
    seen = collections.Counter(i for b in batches.values() for i in b.elements())
    # c (5 shards for 8 streams: several of its epochs are read side by side) has samples read again; a and b not
    assert epochs > 1 and max(n for i, n in seen.items() if i.startswith("c/")) >= 2
    assert max(n for i, n in seen.items() if not i.startswith("c/")) == 1
    assert "data: source c is in its epoch 2 by step" in runs["stdout"]


def test_validation_per_source_and_combined_in_metrics_and_tensorboard(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, names = runs["dp2"], list(BLEND)
    rows = [row for row in metric_rows(run) if "val/loss" in row]
    assert [row["step"] for row in rows] == [0, 20, 40]
    for row in rows:   # the combined loss weighs the sources' by their weights
        assert abs(row["val/loss"] - sum(BLEND[n][2] * row[f"val/{n}/loss"] for n in names)) < 1e-6
        assert all(f"val/{n}/ppl" in row for n in names)
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"tensors": 0, "scalars": 0}).Reload()
    tags = set(events.Tags()["tensors"]) | set(events.Tags()["scalars"])
    assert {f"val/{n}/{k}" for n in names for k in ("loss", "ppl")} | {"val/loss", "data/c/epochs"} <= tags
    loss = events.Tensors("val/a/loss") if "val/a/loss" in events.Tags()["tensors"] else events.Scalars("val/a/loss")
    assert [e.step for e in loss] == [0, 20, 40]
    description = events.SummaryMetadata("val/loss").summary_description
    assert "weighted by their data.sources weights (0.5 × a, 0.3 × b, 0.2 × c)" in description, description


def test_a_blend_killed_stopped_and_continued_on_one_rank_reads_what_the_run_left_alone_read(runs):
    straight, chain, stopped = runs["dp2"], runs["chain"], 20
    reference = {row["step"]: row["train/loss"] for row in metric_rows(straight) if "train/loss" in row}
    every = [row for row in metric_rows(chain) + metric_rows(chain, replayed=True) if "train/loss" in row]
    assert all(row["train/loss"] == reference[row["step"]] for row in every if row["step"] <= stopped)  # bit for bit
    assert {row["step"] for row in metric_rows(chain, replayed=True)} >= {7, 8}   # the steps the kill cost, run again
    assert_close({s: x for s, x in losses(chain).items() if s > stopped}, reference, range(stopped + 1, STEPS + 1),
                 "1 rank after the relayout")
    assert global_batches(chain) == global_batches(straight)
