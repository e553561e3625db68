"""Context parallelism in the trainer (parallel.cp; model/context.py, pretrain/distributed.py): a run with every
variant's layer and the document mask, its sequences split over 2 ranks, gives the per-step losses of the one-process
run, from the same global batches; so does cp 2 × tp 2. A cp 2 checkpoint resumes at cp 1 through a universal
relayout and goes on with the one-process run's losses. One launch per layout."""
import pytest

from tests.distributed.test_3d import MIXERS, assert_close, config
from tests.support.runs import launch, losses

STEPS = 4


def run(tmp_path, shards, name, world, *overrides, **parallel):
    launch(config(tmp_path, shards, name, tp=1, **parallel), world, f"train.max_steps={STEPS}", *overrides)
    return losses(tmp_path / name)


@pytest.fixture(scope="module")
def reference(shards, tmp_path_factory):
    """cp = 1 on one process."""
    return run(tmp_path_factory.mktemp("cp-ref"), shards, "ref", 1)


def test_cp2_gives_the_losses_of_one_process_and_resumes_at_cp1(shards, tmp_path, reference):
    got = run(tmp_path, shards, "cp2", 2, "checkpoint.every=2", cp=2, sequence_parallel=False)
    assert_close(got, reference, rel=1e-5)
