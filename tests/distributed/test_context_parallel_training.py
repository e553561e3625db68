"""Context parallelism in the trainer (parallel.cp; model/context.py, pretrain/distributed.py): a run with a layer of
every variant and the document mask, its sequences split over 2 ranks and its batches over 2 data-parallel replicas
(cp 2 × dp 2, ZeRO-1), gives the per-step losses and gradient norms of the one-process run, from the same global
batches; so do cp 2 × tp 2 (without ZeRO) with sequence parallelism inside each chunk and every other block
recomputed in backward, and cp 2 × pp 2 (pipeline stages on the rank's chunks, pretrain/pipeline.py). The cp 2 × dp 2
checkpoint, made universal, resumes at cp 1 on one process and goes on with the one-process run's losses (the
parameters are replicated over cp as over dp). One launch per layout."""
import pytest

from pretrain.checkpoints.resume import layout_problem
from pretrain.config import load_config
from tests.distributed.test_3d import assert_close, config
from tests.distributed.test_convert import convert
from tests.support.runs import launch, losses, metric_rows

STEPS, TOL = 4, 1e-5   # fp32, sums in another order
MICRO_4 = "train.micro_batch_size=4"   # the reference's global batches in fewer, larger micro-batches: fewer launches
# of each collective on gloo (the cp 2 × tp 2 run's by half: 21 s, not 33 s)


def run(tmp_path, shards, name, world, *overrides, **parallel):
    """(the run's losses, its gradient norms, what it printed). The norms show the gradients' scale, which AdamW's
    update and clipping mostly hide from the losses: averaged over dp × cp, and each replica counted once."""
    r = launch(config(tmp_path, shards, name, **{"sequence_parallel": False, **parallel}), world,
               f"train.max_steps={STEPS}", *overrides)
    norms = {row["step"]: row["train/grad_norm"] for row in metric_rows(tmp_path / name) if "train/grad_norm" in row}
    return losses(tmp_path / name), norms, r.stdout


@pytest.fixture(scope="module")
def reference(shards, tmp_path_factory):
    """cp = 1 on one process."""
    return run(tmp_path_factory.mktemp("cp-ref"), shards, "ref", 1)[:2]


def test_cp2_dp2_gives_the_losses_of_one_process_and_resumes_at_cp1(shards, tmp_path, reference):
    """cp 2 × dp 2 under ZeRO-1 (its partitions over the dp × cp = 4 ranks): each data rank reads its own samples, the
    two cp ranks of a replica the same ones; its checkpoint, made universal, resumes on one process."""
    got = run(tmp_path, shards, "cp2dp2", 4, "checkpoint.every=2", MICRO_4, cp=2)
    for have, want in zip(got, reference):
        assert_close(have, want, rel=TOL)
    step_2 = tmp_path / "cp2dp2" / "checkpoints" / "step_00000002"
    cp1 = load_config(str(tmp_path / "cp2dp2.yaml"), ["parallel.cp=1"]).to_dict()
    assert "parallel.cp=2" in layout_problem(str(step_2), cp1, 4)   # the same world, another layout: not as it is
    convert("to-universal", step_2, tmp_path / "universal")
    resumed, _, out = run(tmp_path, shards, "cp1", 1, f"checkpoint.dir={tmp_path / 'universal'}")
    assert "resumed at step 2 from the universal checkpoint" in out and sorted(resumed) == [3, 4], out[-2000:]
    assert_close(resumed, {s: reference[0][s] for s in (3, 4)}, rel=TOL)


def test_cp2_tp2_sequence_parallel_recomputed_without_zero_gives_the_losses_of_one_process(shards, tmp_path,
                                                                                         reference):
    """ZeRO-0: the trainer's own clipping norm (GuardedAdamW, each replica's gradient counted by one rank). Sequence
    parallelism inside each chunk (the norms, residuals and the loss's input on s/tp of its s positions), and every
    other block recomputed in backward (layers 0, 2, …: attention and SGU among them, between blocks that are not):
    each chunk's recomputation redoes its TP and cp gathers, in the same order on every rank."""
    got = run(tmp_path, shards, "cp2tp2", 4, MICRO_4, cp=2, tp=2, zero_stage=0,
              sequence_parallel=True, activation_checkpointing=2)
    for have, want in zip(got, reference):
        assert_close(have, want, rel=TOL)


def test_cp2_pp2_gives_the_losses_of_one_process(shards, tmp_path, reference):
    """Pipeline stages on this rank's two chunks (pretrain/pipeline.py): the stages pass n/cp positions, each block
    runs its chunks with its own ContextCache, the last stage's loss covers the rank's chunks' targets."""
    got = run(tmp_path, shards, "cp2pp2", 4, cp=2, pp=2, zero_stage=1)
    for have, want in zip(got, reference):
        assert_close(have, want, rel=TOL)
