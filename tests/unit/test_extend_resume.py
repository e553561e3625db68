"""checkpoint.extend_length: a run trained at max_seq_len 32 resumed at 64 loads its checkpoint grown by model/extend.py,
the same tensors tools/convert.py extend-length writes from it; without the key the resume is a one-line error naming
both keys."""
import os

import torch
import yaml

from model import release
from pretrain.checkpoints.ds_checkpoint import read_weights
from pretrain.checkpoints.resume import architecture_problem
from tests.support.runs import launch, tool, write_config

# every rule of model/extend.py but SUM's twin MAP alone: R (random), W_2 (dense), a·b (factorized dense), SGU's W and b
MODEL = {"vocab_size": 512, "d_model": 32, "n_layers": 3, "n_heads": 4, "max_seq_len": 32,
         "mixer": ["random+dense", "factorized_dense", "sgu"]}
GROWN = ["model.max_seq_len=64", "model.factorized_a=8", "model.factorized_b=8"]   # a·b = 4·8 grows to 8·8


def test_a_resume_at_a_larger_length_loads_the_extended_weights(blend, tmp_path):
    cfg = write_config(tmp_path / "c.yaml", blend["a"], tmp_path / "run", model=MODEL, train={"warmup_steps": 1})
    launch(cfg, 1, "train.max_steps=2", "checkpoint.every=2")
    step2 = str(tmp_path / "run" / "checkpoints" / "step_00000002")

    saved = yaml.safe_load(open(os.path.join(step2, "config.yaml")))
    bigger = dict(saved, model=dict(saved["model"], max_seq_len=64, factorized_a=8, factorized_b=8))
    problem = architecture_problem(step2, bigger)   # what the launcher's check and the trainer's load both say
    assert problem and "\n" not in problem and "model.max_seq_len=32" in problem, problem
    assert "checkpoint.extend_length=true" in problem and "this config has 64" in problem, problem
    assert architecture_problem(step2, dict(bigger, checkpoint=dict(saved["checkpoint"], extend_length=True))) is None

    # step 3 at lr 1e-30 moves no weight by more than ~1e-30 (Adam's step is lr·m̂/(√v̂+ε) ≤ ~lr): the checkpoint it
    # writes holds the weights as loaded, grown
    launch(cfg, 1, *GROWN, "checkpoint.extend_length=true", "train.max_steps=3", "checkpoint.every=3",
           "train.lr=1e-30", "train.min_lr=0")
    _, got = read_weights(str(tmp_path / "run" / "checkpoints" / "step_00000003"))
    tool("convert.py", "extend-length", step2, tmp_path / "r64", "--to", 64)
    _, want, _ = release.read_release(str(tmp_path / "r64"))
    assert sorted(got) == sorted(want)
    grown = [name for name in want if want[name].shape != read_weights(step2)[1][name].shape]
    assert len(grown) >= 5, grown   # R, W_2 and b_2, F_A and b_A, SGU's W and b, of three layers
    for name in want:
        torch.testing.assert_close(got[name], want[name].float(), rtol=0, atol=1e-20, msg=name)
