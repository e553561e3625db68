"""tools/convert.py: DeepSpeed checkpoints of (TP, PP, DP) = (2, 2, 1) and (1, 1, 2) with ZeRO-3 → release → Hugging
Face, each checked by the logits of a fixed input against the training-time model as DeepSpeed restores it."""
import json
import os
import subprocess

import pytest
import torch

from model import ConfigError
from model.release import load_model, read_release
from pretrain.config import load_config
from tests.dump_logits import fixed_tokens
from tests.runs import PY, ROOT, launch, losses, spawn, write_config

MIXERS = ["dot", "dense", "random", "random_fixed", "factorized_dense", "factorized_random", "random+dot",
          "dense+dot", "sgu"]   # one layer of each: every variant is converted in every layout
LAYOUTS = {"221": ({"tp": 2, "pp": 2, "zero_stage": 1, "partition": "uniform"}, 4),
           "112-zero3": ({"zero_stage": 3}, 2)}
pytestmark = pytest.mark.slow


def convert(*args, check=True):
    r = subprocess.run([PY, os.path.join(ROOT, "tools", "convert.py"), *map(str, args)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    if check:
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return r


def config(tmp, shards, name, **train):
    parallel, _ = LAYOUTS.get(name, ({}, 0))
    return write_config(tmp / f"{name}.yaml", shards, tmp / name,
                        model={"n_layers": len(MIXERS), "mixer": MIXERS, "position": "rope"},
                        parallel={"zero_stage": 0, **parallel}, checkpoint={"every": 10, "keep": 5},
                        train={"max_steps": 11, "micro_batch_size": 2, **train})


@pytest.fixture(scope="module")
def runs(shards, tmp_path_factory):
    """Each layout trained 11 steps (checkpoints at 10 and 11), its step-10 release, and the training-time logits."""
    tmp = tmp_path_factory.mktemp("convert")
    out = {}
    for name, (_, nproc) in LAYOUTS.items():
        cfg = config(tmp, shards, name)
        launch(cfg, nproc)
        tag = tmp / name / "checkpoints" / "step_00000010"
        spawn(os.path.join(ROOT, "tests", "dump_logits.py"), [cfg, tag, tmp / f"{name}-logits.pt"], nproc)
        convert("to-release", tag, tmp / f"{name}-release", "--quiet")
        out[name] = {"config": cfg, "run": tmp / name, "release": tmp / f"{name}-release",
                     "logits": torch.load(tmp / f"{name}-logits.pt")}
    out["tmp"] = tmp
    return out


HF_CHECK = """
import sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
x = torch.load(sys.argv[2])
with torch.no_grad():
    logits = model(x).logits
generated = model.generate(x[:1, :8], max_new_tokens=5, do_sample=False)
torch.save({"logits": logits, "generated": generated, "layers": model.config.num_hidden_layers}, sys.argv[3])
"""


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_release_and_hf_logits_equal_training(runs, name, tmp_path):
    r = runs[name]
    cfg, tensors, meta = read_release(r["release"])
    assert meta["training"]["step"] == 10 and "wte.weight" in tensors
    x = fixed_tokens(load_config(r["config"], []))
    with torch.no_grad():
        ours = load_model(r["release"])(x)
    assert (ours - r["logits"]).abs().max() <= 1e-5
    print(f"\n{name}: max |release − training| logits = {(ours - r['logits']).abs().max():.3g}")

    convert("to-hf", r["release"], tmp_path / "hf")
    torch.save(x, tmp_path / "x.pt")
    (tmp_path / "check.py").write_text(HF_CHECK)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME=str(tmp_path / "hf-home"))
    p = subprocess.run([PY, "check.py", tmp_path / "hf", "x.pt", "out.pt"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)   # a fresh process, outside the repo, offline
    assert p.returncode == 0, p.stderr[-3000:]
    hf = torch.load(tmp_path / "out.pt")
    assert (hf["logits"] - r["logits"]).abs().max() <= 1e-5
    print(f"{name}: max |HF − training| logits = {(hf['logits'] - r['logits']).abs().max():.3g}, "
          f"generated {hf['generated'][0, 8:].tolist()}")
    assert hf["layers"] == len(MIXERS)
    assert hf["generated"].shape == (1, 13) and torch.equal(hf["generated"][0, :8], x[0, :8])

    convert("from-hf", tmp_path / "hf", tmp_path / "back")
    _, back, _ = read_release(tmp_path / "back")
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], tensors[k]) for k in tensors)


def test_round_trip_is_bit_identical(runs, tmp_path):
    first = runs["221"]["release"]
    convert("to-deepspeed", first, tmp_path / "ds", "--tp", 1, "--pp", 2)
    convert("to-release", tmp_path / "ds", tmp_path / "second", "--quiet")
    cfg_a, a, meta_a = read_release(first)
    cfg_b, b, meta_b = read_release(tmp_path / "second")
    assert cfg_a == cfg_b and meta_b["training"]["step"] == 10
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_continue_training_in_another_layout(runs, shards, tmp_path):
    """Release (from TP=2, PP=2) → TP=1, PP=2: the step-11 loss equals the original run's step-11 loss."""
    original = losses(runs["221"]["run"])
    cfg = write_config(tmp_path / "cont.yaml", shards, tmp_path / "cont",
                       model={"n_layers": len(MIXERS), "mixer": MIXERS, "position": "rope"},
                       parallel={"pp": 2, "zero_stage": 1, "partition": "uniform"},
                       train={"max_steps": 11, "micro_batch_size": 2, "init_from": str(runs["221"]["release"])})
    r = launch(cfg, 2)
    assert "initialised from release" in r.stdout
    got = losses(tmp_path / "cont")
    assert sorted(got) == [11]
    assert abs(got[11] - original[11]) <= 1e-4 * abs(original[11]), (got[11], original[11])
    print(f"\nstep-11 loss: original (2,2,1) {original[11]:.7f}, from release in (1,2,1) {got[11]:.7f}")


def test_one_line_errors(runs, tmp_path):
    r = convert("to-release", tmp_path, tmp_path / "x", check=False)
    assert r.returncode == 2 and "is not a DeepSpeed training checkpoint" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = convert("to-deepspeed", runs["221"]["release"], tmp_path / "ds", "--tp", 3, check=False)
    assert r.returncode == 2 and "not divisible by parallel.tp=3" in r.stderr.strip().splitlines()[-1]
    # weights that do not match their config: a release whose config.json claims another mixer
    r = convert("from-hf", runs["221"]["release"], tmp_path / "x", check=False)   # a release is no HF export
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    bad = tmp_path / "bad"
    meta = json.loads((runs["221"]["release"] / "config.json").read_text())
    meta["model"]["mixer"] = ["dot"] * len(MIXERS)
    os.makedirs(bad, exist_ok=True)
    (bad / "config.json").write_text(json.dumps(meta))
    os.symlink(runs["221"]["release"] / "model.safetensors", bad / "model.safetensors")
    with pytest.raises(ConfigError, match="weights and config.json do not match"):
        read_release(bad)
    r = convert("to-hf", bad, tmp_path / "hf", check=False)
    assert r.returncode == 2 and "do not match" in r.stderr
