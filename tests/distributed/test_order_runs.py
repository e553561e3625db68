"""Real runs of the data order (the trainer on gloo ranks; three sources of shards of 8 samples blended 0.5 / 0.3 /
0.2, windows of 4 shards; the small source c wraps within the run):
- 2 data-parallel ranks of 2 workers and 4 of 1 read the same samples in every global batch and give the same losses
  (relative 1e-4); at 4 ranks source a is streamed from a real HTTP server, which counts what each rank fetched;
- after every step every source is within one sample of its weight; c is in its second epoch, each of its samples
  drawn once or twice; validation per source and combined is in metrics.jsonl and in TensorBoard;
- the 2-rank run with its three sources in an S3-protocol store (moto's server on 127.0.0.1, credentials from the
  environment; c written there by make_shards), killed (kill -9 of a rank, in a save), relaunched, stopped at step
  20 (SIGTERM) and continued on one rank with checkpoint.relayout=true: bit for bit the run of the local shards up to
  the stop, then its samples step for step and its losses (relative 1e-4), no sample of a or b twice; each launch
  asked the store for each source's manifest once a process and for no shard before reading it."""
import collections
import os

import fsspec
import pytest

from tests.support.http_shards import ShardServer
from tests.support.runs import BLEND, blend_sources, id_rows, launch, losses, metric_rows, tool, write_config
from tests.support.s3_server import S3Server
from tokendata.order import layout, rank_slice
from tokendata.sources import Source
from tokendata.stream import TokenStream

pytestmark = pytest.mark.slow
STEPS, G, SEQ = 40, 8, 32   # tests/support/runs.py write_config: global batch 8, micro-batch 4; data.seed 1234, C = 8


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


def to_store(blend, s3, tmp):
    """The three sources in a bucket: c written there by make_shards (the same files as the local c), a and b
    uploaded; their data.sources."""
    bucket = s3.bucket("shards")
    src, c = os.path.dirname(blend["a"]), f"{bucket}/c"
    tool("make_shards.py", "--input", os.path.join(src, "c.txt"), "--tokenizer", os.path.join(blend["a"], "tokenizer.model"),
         "--out", c, "--seq-len", SEQ, "--samples-per-shard", 8, "--val-fraction", 0.05, "--quiet", env=s3.env)
    fs = fsspec.filesystem("s3", endpoint_url=s3.url, key=s3.env["AWS_ACCESS_KEY_ID"],
                           secret=s3.env["AWS_SECRET_ACCESS_KEY"])
    for name in ("a", "b"):
        fs.put(blend[name] + "/", f"shards/{name}/", recursive=True)
    local = sorted(n for n in os.listdir(blend["c"]) if n.endswith(".tar"))
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls("shards/c") if p.endswith(".tar")) == local
    assert all(fs.cat(f"shards/c/{n}") == open(os.path.join(blend["c"], n), "rb").read() for n in local)
    return blend_sources(blend, **{name: f"{bucket}/{name}" for name in BLEND})


def startup_requests(s3, before):
    """The requests a launch made of the store other than GETs of shards: (method, bucket/key) -> count."""
    now = collections.Counter(s3.requests)
    now.subtract(before)
    return {k: n for k, n in now.items() if n and not (k[0] == "GET" and k[1].endswith(".tar"))}


@pytest.fixture(scope="module")
def runs(blend, tmp_path_factory):
    """The blend on 2 ranks; on 4 ranks with a served over HTTP; and from the store on 2 ranks interrupted, then on
    1 (the module docstring). Each launch starts its ranks directly, as a scheduler does, but the last: the launcher
    converts the checkpoint to a universal one before its rank starts."""
    tmp = tmp_path_factory.mktemp("blended")
    data = {"shard_dir": None, "sources": blend_sources(blend)}
    out = launch(config(tmp, "dp2", data), 2).stdout
    with ShardServer(blend["a"]) as srv:
        launch(config(tmp, "dp4", {**data, "sources": blend_sources(blend, a=srv.url), "num_workers": 1}), 4,
               "train.micro_batch_size=2")
    with S3Server() as s3:
        chain, asked = config(tmp, "chain", {**data, "sources": to_store(blend, s3, tmp)}, every=3), []
        before = collections.Counter(s3.requests)
        r = launch(chain, 2, check=False, env={**s3.env, "SYNTHFORMER_FAULTS": "kill-save-begin@9@1"})  # SIGKILL rank 1
        assert r.returncode != 0 and "saved checkpoint" in r.stdout and "step_00000009" not in r.stdout
        asked.append((2, startup_requests(s3, before)))
        before = collections.Counter(s3.requests)
        r = launch(chain, 2, env={**s3.env, "SYNTHFORMER_FAULTS": "term@20@0"})   # rank 0 gets SIGTERM in step 20
        assert "resumed at step 6" in r.stdout and "stopped at step 20 (SIGTERM)" in r.stdout, r.stdout[-3000:]
        asked.append((2, startup_requests(s3, before)))
        before = collections.Counter(s3.requests)
        r = launch(chain, 1, "checkpoint.relayout=true", launcher=True, env=s3.env)
        assert "resumed at step 20 from the universal checkpoint" in r.stdout, r.stdout[-3000:]
        asked.append((1 + 1, startup_requests(s3, before)))   # the launcher's launch check reads them too
    return {"dp2": tmp / "dp2", "dp4": tmp / "dp4", "chain": tmp / "chain", "stdout": out, "gets": srv.gets,
            "heads": srv.heads, "asked": asked}


def test_2_and_4_ranks_read_the_same_global_batches_and_give_the_same_losses(runs):
    reference = global_batches(runs["dp2"])
    assert sorted(reference) == list(range(1, STEPS + 1)) and all(sum(b.values()) == G for b in reference.values())
    assert global_batches(runs["dp4"]) == reference
    assert_close(losses(runs["dp4"]), losses(runs["dp2"]), range(1, STEPS + 1), "4 ranks")


def test_each_rank_fetches_only_the_shards_of_the_windows_it_reads_and_each_once(blend, runs):
    """4 ranks × 1 worker read a over HTTP: each shard of a was fetched at most once by each rank whose positions
    drew from its window (or the window after: read ahead), by no other; no shard was asked for its size (no HEAD);
    the manifest once by each rank."""
    stream = TokenStream([Source(**s) for s in blend_sources(blend)], 2, SEQ, dp_world=4, seed=1234,
                         global_batch_size=G)
    order, pos, readers = stream.orders[0], stream.blend.start(), collections.Counter()
    for _ in range(STEPS + 3):   # the readers run ahead of training by the DataLoader's prefetch: up to 3 batches
        lay = layout(stream.blend, pos, G, stream.canonical_streams)
        for r in range(4):
            lo, hi = rank_slice(G, r, 4)
            windows = {(c, *order.where(c, j)[:2]) for s, c, j in zip(lay.sources[lo:hi].tolist(),
                                                                      lay.streams[lo:hi].tolist(),
                                                                      lay.draws[lo:hi].tolist()) if s == 0}
            readers.update({(name, r) for c, e, k in windows for w in ((c, e, k), (c, e, k + 1), (c, e + 1, 0))
                            for name in order.window_shards(*w)})
    most = collections.Counter(name for name, _ in readers)
    gets = {name: n for name, n in runs["gets"].items() if name.startswith("train-")}
    assert gets and all(n <= most[name] for name, n in gets.items()), {n: (k, most[n]) for n, k in gets.items()
                                                                      if k > most[n]}
    assert runs["gets"]["manifest.json"] == 4 and not runs["heads"]
    print(f"\n{len(gets)} shards of a fetched, {sum(gets.values())} GETs by 4 ranks "
          f"({sum(gets.values()) / len(gets):.2f} a shard)")


def test_the_store_was_asked_for_each_manifest_once_a_process_and_for_no_shard_before_it_was_read(runs):
    """The three launches from the S3-protocol store (2 ranks, 2 ranks, the launcher and 1 rank): besides the GETs of
    shards, one GET of each source's manifest per process, the tokenizer, and nothing else (no HEAD, no listing)."""
    for processes, asked in runs["asked"]:
        manifests = {key: n for (method, key), n in asked.items() if key.endswith("/manifest.json")}
        assert manifests == {f"shards/{name}/manifest.json": processes for name in BLEND}, asked
        others = {k: n for k, n in asked.items() if not k[1].endswith(("/manifest.json", "/tokenizer.model"))}
        assert not others and all(method == "GET" for method, _ in asked), asked


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
    # c (5 shards for 8 streams) is in its second epoch: each of its samples drawn once or twice; a and b once
    assert 1 < epochs < 2 and {n for i, n in seen.items() if i.startswith("c/")} == {1, 2}
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
