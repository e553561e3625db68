"""tools/convert.py: DeepSpeed checkpoints of (TP, PP, DP) = (2, 2, 1), (1, 1, 2) with ZeRO-3 and a gMLP model at
(1, 1, 2) with ZeRO-2 → release → Hugging Face, each checked by the logits of a fixed input against the training-time
model as DeepSpeed restores it; → universal checkpoints, resumed in another layout with the optimizer state."""
import json
import os
import shutil
import subprocess

import pytest
import torch

from model import ConfigError, variants
from model.release import load_model, read_release
from pretrain.checkpoints.resume import layout_problem
from pretrain.config import load_config
from tests.support.dump_logits import fixed_tokens
from tests.support.runs import PY, ROOT, launch, losses, run_py, spawn, write_config

MIXERS = variants.subset("layers")   # one layer of each: every variant is converted in every layout
MODEL = {"n_layers": len(MIXERS), "mixer": MIXERS, "position": "rope"}
GMLP = {"n_layers": 2, "mixer": "sgu", "block": "gmlp", "position": "rope"}
LAYOUTS = {"221": ({"tp": 2, "pp": 2, "zero_stage": 1, "partition": "uniform"}, 4, MODEL),
           "112-zero3": ({"zero_stage": 3}, 2, MODEL),
           "112-zero2-gmlp": ({"zero_stage": 2}, 2, GMLP)}
pytestmark = pytest.mark.slow


def convert(*args, check=True):
    r = run_py([PY, os.path.join(ROOT, "tools", "convert.py"), *map(str, args)], timeout=300)
    if check:
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return r


def config(tmp, shards, name, layout=None, parallel=None, checkpoint=None, **train):
    """The config of run `name`: the model and layout of LAYOUTS[layout or name], `parallel` changing the layout;
    20 steps of schedule, of which the runs train 15 (checkpoints at 10 and 15). LR 1e-2: AdamW's moments then
    matter, and a restart without them shows (test_universal_checkpoint_…)."""
    layout_parallel, _, model = LAYOUTS[layout or name]
    return write_config(tmp / f"{name}.yaml", shards, tmp / name, model=model,
                        parallel={"zero_stage": 0, **(parallel or layout_parallel)},
                        checkpoint={"every": 10, "keep": 5, **(checkpoint or {})},
                        train={"max_steps": 20, "stop_after_steps": 15, "micro_batch_size": 2, "lr": 1e-2,
                               "min_lr": 1e-3, **train})


@pytest.fixture(scope="module")
def runs(shards, tmp_path_factory):
    """Each layout trained 15 steps (checkpoints at 10 and 15), its step-10 release, and the training-time logits."""
    tmp = tmp_path_factory.mktemp("convert")
    out = {}
    for name, (_, nproc, _) in LAYOUTS.items():
        cfg = config(tmp, shards, name)
        launch(cfg, nproc)
        tag = tmp / name / "checkpoints" / "step_00000010"
        spawn(os.path.join(ROOT, "tests", "support", "dump_logits.py"), [cfg, tag, tmp / f"{name}-logits.pt"], nproc)
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
    assert hf["layers"] == LAYOUTS[name][2]["n_layers"]
    assert hf["generated"].shape == (1, 13) and torch.equal(hf["generated"][0, :8], x[0, :8])

    convert("from-hf", tmp_path / "hf", tmp_path / "back")
    _, back, _ = read_release(tmp_path / "back")
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], tensors[k]) for k in tensors)


def test_round_trip_is_bit_identical(runs, tmp_path):
    first = runs["221"]["release"]
    convert("to-deepspeed", first, tmp_path / "ds", "parallel.zero_stage=0", "--tp", 1, "--pp", 2)
    convert("to-release", tmp_path / "ds", tmp_path / "second", "--quiet")
    r = convert("to-universal", tmp_path / "ds", tmp_path / "universal", check=False)   # fp32 ZeRO-0: no per-
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "ZeRO-0" in r.stderr   # parameter state
    cfg_a, a, meta_a = read_release(first)
    cfg_b, b, meta_b = read_release(tmp_path / "second")
    assert cfg_a == cfg_b and meta_b["training"]["step"] == 10
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# (source run, target layout, ranks): the acceptance moves of universal checkpoints, every mixer and a gMLP model
MOVES = {"221-to-112": ("221", {"zero_stage": 1}, 2),
         "221-to-121": ("221", {"pp": 2, "zero_stage": 1, "partition": "uniform"}, 2),
         "112-zero2-gmlp-to-211": ("112-zero2-gmlp", {"tp": 2, "zero_stage": 1}, 2),
         "112-zero3-to-111": ("112-zero3", {"zero_stage": 1}, 1)}
TOLERANCE = 1e-4   # relative, fp32 on CPU


def relative_differences(got, original):
    assert sorted(got) == [11, 12, 13, 14, 15], sorted(got)
    return [abs(got[s] - original[s]) / abs(original[s]) for s in sorted(got)]


@pytest.mark.parametrize("move", list(MOVES))
def test_universal_checkpoint_resumes_another_layout_with_its_optimizer(runs, shards, move, tmp_path):
    """Step 10 of a run → universal checkpoint → steps 11-15 in another layout: the losses of the uninterrupted run.
    The same move through a release (weights, step, schedule, data position; fresh AdamW moments) is ≥ 100× further
    off. The ZeRO-3 move goes through the launcher's checkpoint.relayout=true, the others through tools/convert.py."""
    source, parallel, nproc = MOVES[move]
    original, step_10 = losses(runs[source]["run"]), runs[source]["run"] / "checkpoints" / "step_00000010"
    ckpt = tmp_path / "ckpt"
    if source == "112-zero3":   # stop, then one command: the relaunch converts before its ranks start
        shutil.copytree(step_10, ckpt / step_10.name)
        (ckpt / "latest").write_text(step_10.name)
        cfg = config(tmp_path, shards, "resumed", source, parallel, {"dir": str(ckpt), "relayout": True},
                     stop_after_steps=5)
        r = launch(cfg, nproc, launcher=True)
        assert "converting" in r.stderr and "to a universal checkpoint" in r.stderr, r.stderr[-2000:]
    else:
        convert("to-universal", step_10, ckpt)
        r = launch(config(tmp_path, shards, "resumed", source, parallel, {"dir": str(ckpt)}, stop_after_steps=5),
                   nproc)
    assert "resumed at step 10 from the universal checkpoint" in r.stdout
    universal = ckpt / "universal_step_00000010" / "zero"
    _, release, _ = read_release(runs[source]["release"])
    for name, tensor in release.items():   # every weight, merged over TP/PP/ZeRO by DeepSpeed's converter
        assert torch.equal(torch.load(universal / name / "fp32.pt", weights_only=False)["param"], tensor), name
    with_moments = relative_differences(losses(tmp_path / "resumed"), original)
    zero0 = load_config(str(tmp_path / "resumed.yaml"), ["parallel.zero_stage=0"]).to_dict()
    assert "loads into ZeRO stages 1 and 2" in layout_problem(str(universal.parent), zero0, nproc)

    launch(config(tmp_path, shards, "fresh-moments", source, parallel, stop_after_steps=5,
                  init_from=str(runs[source]["release"])), nproc)
    fresh = relative_differences(losses(tmp_path / "fresh-moments"), original)
    print(f"\n{move}: largest relative loss difference over steps 11-15 from the uninterrupted run: "
          f"universal checkpoint {max(with_moments):.2g}, release (fresh moments) {max(fresh):.2g}")
    assert max(with_moments) <= TOLERANCE, with_moments
    assert fresh[0] <= TOLERANCE   # step 11: the same weights
    assert max(fresh) >= 100 * TOLERANCE, fresh


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
