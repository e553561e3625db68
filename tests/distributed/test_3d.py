"""Tensor × pipeline × data parallelism (3D) and multi-node launch, against the one-process run."""
import os
import signal

import pytest

from model import variants
from tests.support.distributed import run_distributed
from tests.support.runs import PY, finish, free_local_port, launch, losses, run_py, start, write_config
from tools.train_tokenizer import EOS_ID

MIXERS = variants.subset("layers")   # one layer of each: every stage holds several variants


def config(tmp_path, shards, name, mixers=MIXERS, **parallel):
    """Under the document mask: its document ids travel between the pipeline's stages. With sequence parallelism
    where tp > 1 (the plain TP layouts without it are test_training's)."""
    return write_config(tmp_path / f"{name}.yaml", shards, tmp_path / name,
                        model={"n_layers": len(mixers), "mixer": mixers, "document_mask": True, "eos_id": EOS_ID},
                        parallel={"zero_stage": 1, "partition": "uniform", "sequence_parallel": True, **parallel},
                        train={"max_steps": 10, "micro_batch_size": 2})


def assert_close(got, ref, rel=1e-4):
    assert sorted(got) == sorted(ref) and len(ref) > 0
    for step in ref:
        assert abs(got[step] - ref[step]) <= rel * abs(ref[step]), (step, got[step], ref[step])


@pytest.fixture(scope="module")
def reference(shards, tmp_path_factory):
    """(TP, PP, DP) = (1, 1, 1) losses for both layer orders."""
    tmp = tmp_path_factory.mktemp("ref")
    out = {}
    for order, mixers in (("fwd", MIXERS), ("rev", MIXERS[::-1])):
        launch(config(tmp, shards, f"ref-{order}", mixers), 1)
        out[order] = losses(tmp / f"ref-{order}")
    return out


@pytest.fixture(scope="module")
def run_221(shards, tmp_path_factory):
    """(TP, PP, DP) = (2, 2, 1), forward order: its losses."""
    tmp = tmp_path_factory.mktemp("221")
    launch(config(tmp, shards, "221-fwd", tp=2, pp=2), 4)
    return losses(tmp / "221-fwd")


# With pipeline stages (TP alone and TP × DP: test_training's layouts). The reversed layer order, on one of them,
# puts each mixer in the other stage as well.
LAYOUTS = [(1, 2, 1), (2, 2, 1), (1, 2, 2)]


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,dp", LAYOUTS, ids=lambda x: str(x))
def test_layout_matches_one_process(tp, pp, dp, shards, tmp_path, reference, run_221):
    if (tp, pp, dp) == (2, 2, 1):   # trained once, for the resume test as well
        assert_close(run_221, reference["fwd"])
        return
    orders = ("fwd", "rev") if (tp, pp, dp) == (1, 2, 1) else ("fwd",)
    for order in orders:
        mixers = MIXERS if order == "fwd" else MIXERS[::-1]
        name = f"{tp}{pp}{dp}-{order}"
        launch(config(tmp_path, shards, name, mixers, tp=tp, pp=pp), tp * pp * dp)
        assert_close(losses(tmp_path / name), reference[order])


@pytest.mark.slow
def test_222_on_eight_processes(shards, tmp_path, reference):
    launch(config(tmp_path, shards, "222", tp=2, pp=2), 8)
    assert_close(losses(tmp_path / "222"), reference["fwd"])


@pytest.mark.slow
def test_resume_and_activation_checkpointing_in_221(shards, tmp_path, run_221):
    """Stopped at step 5 and relaunched, with activations recomputed in the pipeline's backward (both legs), the
    run gives the straight run's losses bit for bit; recomputing every 2nd layer without pipeline stages too."""
    resumed_cfg = config(tmp_path, shards, "resumed", tp=2, pp=2, activation_checkpointing=1)
    launch(resumed_cfg, 4, "train.stop_after_steps=5", "checkpoint.every=5")
    r = launch(resumed_cfg, 4, "checkpoint.every=5")
    assert "resumed at step 5" in r.stdout
    # the tied embedding's broadcast between stages (at build and at load) makes no autograd warning on any rank
    assert "autograd kernel was not registered" not in r.stdout + r.stderr
    assert losses(tmp_path / "resumed") == run_221              # identical, steps 1-10
    launch(config(tmp_path, shards, "recompute-k2", tp=2, pp=1, activation_checkpointing=2), 2)
    assert_close(losses(tmp_path / "recompute-k2"), run_221)


@pytest.mark.slow
def test_two_nodes_match_one_node(shards, tmp_path, run_221):
    """(2, 2, 1) as two launchers of 2 ranks each, as a scheduler starts them on two nodes (the pipeline's stages
    on different nodes): the one-node run's losses."""
    two = config(tmp_path, shards, "two-nodes", tp=2, pp=2)
    port = free_local_port()
    procs = [start(two, env={"NNODES": "2", "NODE_RANK": str(r), "NPROC": "2", "MASTER_PORT": str(port)})
             for r in (0, 1)]
    try:
        results = [finish(p) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    for r in results:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert_close(losses(tmp_path / "two-nodes"), run_221, rel=1e-6)


def topology_worker(rank, world, layouts):
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
    from megatron.core import parallel_state as ps

    out = []
    for tp, pp in layouts:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        ours = (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
                ps.get_data_parallel_rank())
        c = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=world // (tp * pp)).get_coord(rank)
        out.append((ours, (c.model, c.pipe, c.data)))
        ps.destroy_model_parallel()
    return out


@pytest.mark.slow
def test_megatron_and_deepspeed_agree_on_every_rank():
    layouts = [(2, 2), (1, 2), (2, 1), (4, 1), (1, 4), (1, 1)]   # world 8: test_222_on_eight_processes trains it
    for per_rank in run_distributed(topology_worker, 4, layouts):
        for (tp, pp), (ours, deepspeed) in zip(layouts, per_rank):
            assert ours == deepspeed, (tp, pp, ours, deepspeed)


@pytest.mark.parametrize("overrides,world,needles", [
    (["parallel.tp=2", "parallel.pp=2"], 6, ["world size 6", "parallel.tp × parallel.cp × parallel.pp"]),
    (["parallel.tp=3"], 3, ["model.n_heads=4", "parallel.tp=3"]),
    (["parallel.pp=4", "model.n_layers=2", "model.mixer=dot"], 4, ["model.n_layers", "parallel.pp"]),
    (["parallel.pp=2", "parallel.zero_stage=2"], 2, ["parallel.pp", "parallel.zero_stage"]),
])
def test_layout_errors_are_one_line(overrides, world, needles, shards, tmp_path):
    cfg = config(tmp_path, shards, "bad")
    r = run_py([PY, "-m", "pretrain.config", cfg, *overrides, "--world-size", str(world)])
    assert r.returncode == 2 and "Traceback" not in r.stderr
    line = r.stderr.strip()
    assert "\n" not in line and line.startswith("error: ")
    for n in needles:
        assert n in line, line
