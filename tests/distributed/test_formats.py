"""Files written by earlier code still load, to the same numbers: tests/data/pre_redesign holds a 2-rank ZeRO-1
checkpoint (mixers random+dot and factorized_dense), its release and its Hugging Face export, all written before the
one-formula-per-place redesign, with the logits that code computed for a fixed input, and the losses it logged when it
resumed that checkpoint on the frozen format-1 shards beside them (shards/, plain files: a newer shard format must keep
reading them)."""
import json
import os
import shutil

import pytest
import torch
import yaml

from model.release import load_model
from pretrain.checkpoints.ds_checkpoint import load_any
from tests.support.runs import PY, ROOT, launch, metric_rows, run_py, write_config

DATA = os.path.join(ROOT, "tests", "data", "pre_redesign")
EXPECTED = torch.load(os.path.join(DATA, "logits.pt"))


def close_to_expected(logits: torch.Tensor) -> None:
    assert logits.shape == EXPECTED["logits"].shape
    assert (logits - EXPECTED["logits"]).abs().max() <= 1e-5


@torch.no_grad()
def test_release_and_checkpoint_give_the_logits_they_gave():
    close_to_expected(load_model(os.path.join(DATA, "release")).eval()(EXPECTED["tokens"]))
    model, tokenizer, info = load_any(os.path.join(DATA, "checkpoints"))
    assert info["step"] == 2 and tokenizer.endswith("tokenizer.model")
    close_to_expected(model(EXPECTED["tokens"]))


@torch.no_grad()
def test_hugging_face_export_gives_the_logits_it_gave(tmp_path):
    from transformers import AutoModelForCausalLM

    export = shutil.copytree(os.path.join(DATA, "hf"), tmp_path / "hf")   # transformers may write beside it
    model = AutoModelForCausalLM.from_pretrained(str(export), trust_remote_code=True).eval()
    close_to_expected(model(EXPECTED["tokens"]).logits)
    r = run_py([PY, "tools/convert.py", "from-hf", str(export), str(tmp_path / "release")])
    assert r.returncode == 0, r.stderr
    close_to_expected(load_model(str(tmp_path / "release")).eval()(EXPECTED["tokens"]))
    # generate.py on it: its model code predates cached decoding (full recompute then), and its run's shards are gone
    train_config = export / "train_config.yaml"
    settings = yaml.safe_load(train_config.read_text())
    settings["data"]["shard_dir"] = str(tmp_path / "gone")
    train_config.write_text(yaml.safe_dump(settings))
    r = generate(export, "--max-new-tokens", "4")
    assert "prompt 'The': a generic prompt: no shards of" in r.stderr, r.stderr
    assert decoding(r) == "full recompute: the model's code predates incremental decoding (a Hugging Face export made "\
                          "before it)", r.stderr


def generate(checkpoint, *args):
    r = run_py([PY, "tools/generate.py", str(checkpoint), *args])
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    return r


def decoding(r) -> str:
    """How generate.py says it decoded: its timing line's "(… tokens/s, HOW) from …"."""
    line = next(line for line in r.stderr.splitlines() if " tokens/s, " in line)
    return line.split(" tokens/s, ", 1)[1].rsplit(") from ", 1)[0]


def test_generate_says_how_it_decoded():
    """Today's model code in a release decodes incrementally (the pre-redesign export's full recompute: the test
    above; the sliding window past max_seq_len and --no-cache: tests/distributed/test_eval_tools.py)."""
    assert decoding(generate(os.path.join(DATA, "release"), "--max-new-tokens", "4")) == "incremental"


@pytest.mark.slow
def test_the_trainer_resumes_the_old_checkpoint(tmp_path):
    """Its engine, optimizer, LR schedule and data position load into today's trainer, which trains on from step 2 to
    the losses the old code logged on the same frozen format-1 shards (tests/data/pre_redesign/resume.json says how
    they were made): a data position, optimizer moment or schedule step lost in the load changes them."""
    run = tmp_path / "run"
    shutil.copytree(os.path.join(DATA, "checkpoints"), run / "checkpoints")
    cfg = write_config(tmp_path / "c.yaml", os.path.join(DATA, "shards"), run,
                       model={"d_model": 32, "n_layers": 2, "n_heads": 4, "max_seq_len": 32,
                              "mixer": ["random+dot", "factorized_dense"]},
                       parallel={"zero_stage": 1}, train={"max_steps": 4, "warmup_steps": 1})
    r = launch(cfg, 2)
    assert "resumed at step 2" in r.stdout
    with open(os.path.join(DATA, "resume.json")) as f:
        old = json.load(f)
    rows = metric_rows(run)
    for tag in ("train/loss", "val/loss"):
        got = {str(row["step"]): row[tag] for row in rows if tag in row}
        assert got == pytest.approx(old[tag], rel=0, abs=1e-5), (tag, got, old[tag])
