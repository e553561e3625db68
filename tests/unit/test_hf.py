"""Hugging Face export and import (model/hf.py): release → HF directory → AutoModelForCausalLM, and back.

The loading side runs in a fresh interpreter whose cwd and sys.path do not contain the repository, offline, with
megatron made unimportable: it proves the export is self-contained (remote code copied, nothing fetched).
"""
import json
import os
import subprocess
import sys

import pytest
import sentencepiece as spm
import torch
from safetensors.torch import load_file

from model import ConfigError, ModelConfig, build_model, variants
from model.generate import sample
from model.hf import hf_to_release, release_to_hf
from model.release import read_release, save_release

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ALL_MIXERS = (variants.names(synthesizer=True) + list(variants.PAPER_MIXTURES) + ["dense+random+factorized_random"]
              + variants.names(synthesizer=False))
SMALL = dict(d_model=32, n_heads=4, max_seq_len=24)
CASES = {
    "every_mixer_rope": ModelConfig(vocab_size=96, n_layers=10, mixer=ALL_MIXERS, position="rope", **SMALL),
    "gmlp": ModelConfig(vocab_size=96, n_layers=2, block="gmlp", mixer="sgu", **SMALL),
    # vocab 384 = the tokenizer trained below, so this case also checks AutoTokenizer; under the document mask (its
    # prompts hold an eos: generation, the cache and beam search mask and restart positions as training did)
    "untied_learned": ModelConfig(vocab_size=384, n_layers=2, mixer=["random+dot", "factorized_dense"],
                                  tie_embeddings=False, position="learned", document_mask=True, eos_id=2, **SMALL),
}
PROMPT, NEW = 12, 5   # prompt + new tokens ≤ max_seq_len
LONG = 20             # 12 + 20 > max_seq_len 24: the window slides past L
TEXT = "Emma Woodhouse, handsome, clever — Tschüß 日本 42\n  and rich."

# Runs in the fresh interpreter: loads every export, writes what the tests compare into results.pt.
LOADER = r"""
import glob, importlib.util, sys
sys.modules["megatron"] = None          # the export must not need megatron-core
# nor this repository, which `make setup` installs in editable mode: drop that install's import finder
sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
assert importlib.util.find_spec("model") is None, "the repository is importable: the check would prove nothing"
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.dynamic_module_utils import check_imports

for path in glob.glob("*/*.py"):        # what loading from the Hub checks, file by file
    check_imports(path)

inputs, results = torch.load("inputs.pt"), {}
for name, x in inputs.items():
    config = AutoConfig.from_pretrained(name, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(name, trust_remote_code=True)
    fresh = AutoModelForCausalLM.from_config(config, trust_remote_code=True)
    with torch.no_grad():
        out = model(x, labels=x)
        r = {"logits": out.logits, "loss": out.loss, "fresh_logits": fresh(x).logits, "dtype": str(model.dtype),
             "sizes": [config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
                       config.max_position_embeddings, config.vocab_size, config.document_mask, config.eos_id],
             "generated": model.generate(x, max_new_tokens=%(new)d, do_sample=False),
             "frozen": sorted(n for n, p in model.named_parameters() if not p.requires_grad)}
        fed, forward = [], model.forward   # the positions each step hands the model
        model.forward = lambda input_ids, **kw: (fed.append(input_ids.shape[1]), forward(input_ids, **kw))[1]
        for cache in (True, False):   # past max_seq_len too; beam search reorders the cache
            fed.clear()
            r[f"long_{cache}"] = model.generate(x, max_new_tokens=%(long)d, do_sample=False, use_cache=cache)
            r[f"fed_{cache}"] = list(fed)
            r[f"beams_{cache}"] = model.generate(x, max_new_tokens=%(new)d, do_sample=False, num_beams=3,
                                                 use_cache=cache)
        first = model(x[:, :5], use_cache=True)   # the cache by hand: a prefill, then the rest
        rest = model(x[:, 5:], past_key_values=first.past_key_values)
        r["cached_logits"] = torch.cat([first.logits, rest.logits], 1)
        r["cache_length"] = rest.past_key_values.get_seq_length()
    if name == "untied_learned":
        tok = AutoTokenizer.from_pretrained(name, trust_remote_code=True)
        ids = tok(%(text)r).input_ids
        r["tokenizer"] = {"ids": ids, "decoded": tok.decode(ids), "eos": tok.eos_token_id}
    results[name] = r
torch.save(results, "results.pt")
""" % {"new": NEW, "long": LONG, "text": TEXT}


def train_tokenizer(path):
    """A 384-piece tokenizer from the start of the Austen corpus, made by the project's own tool."""
    import gzip

    from tools.train_tokenizer import train

    with gzip.open(os.path.join(ROOT, "data", "austen.txt.gz"), "rt", encoding="utf-8") as f:
        text = "".join(line for _, line in zip(range(400), f))
    corpus = path.parent / "corpus.txt"
    corpus.write_text(text, encoding="utf-8")
    return train([str(corpus)], 384, str(path), progress=False)


def greedy(model, x, n):
    """n tokens of argmax decoding with the original SynthesizerLM (the whole prefix every step)."""
    with torch.no_grad():
        for _ in range(n):
            x = torch.cat((x, model(x)[:, -1].argmax(-1, keepdim=True)), dim=1)
    return x[:, -n:]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """Export every case, load them all in one fresh offline interpreter; (references, its results, tmp dir)."""
    tmp = tmp_path_factory.mktemp("hf")
    tokenizer = train_tokenizer(tmp / "tokenizer.model")
    refs, inputs = {}, {}
    for i, (name, cfg) in enumerate(CASES.items()):
        model = build_model(cfg).eval()
        release = str(tmp / f"{name}-release")
        save_release(release, cfg, dict(model.named_parameters()),
                     tokenizer=tokenizer if name == "untied_learned" else None)
        release_to_hf(release, str(tmp / name))
        x = torch.randint(0, cfg.vocab_size, (2, PROMPT), generator=torch.Generator().manual_seed(i))
        if cfg.document_mask:
            x[:, 3] = cfg.eos_id   # documents end within the prompt (and the cache by hand's prefill)
        with torch.no_grad():
            refs[name] = {"cfg": cfg, "logits": model(x), "loss": model(x[:, :-1], x[:, 1:]),
                          "greedy": greedy(model, x, NEW), "release": release,
                          "long": sample(model, x, LONG, temperature=0)}
        inputs[name] = x
    torch.save(inputs, tmp / "inputs.pt")
    (tmp / "load.py").write_text(LOADER)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME=str(tmp / "hf_home"))
    r = subprocess.run([sys.executable, "load.py"], cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return refs, torch.load(tmp / "results.pt"), tmp


@pytest.mark.parametrize("name", CASES)
def test_hf_logits_and_config_match_the_original(loaded, name):
    refs, results, _ = loaded
    ref, res, cfg = refs[name], results[name], CASES[name]
    assert res["dtype"] == "torch.float32"
    assert res["sizes"] == [cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.max_seq_len, cfg.vocab_size,
                            cfg.document_mask, cfg.eos_id]
    assert (res["logits"] - ref["logits"]).abs().max().item() <= 1e-5
    assert abs(res["loss"].item() - ref["loss"].item()) <= 1e-5          # labels: shifted LM loss
    # from_config draws the same weights as model.build_model (same seed, same per-name generators)
    assert (res["fresh_logits"] - ref["logits"]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("name", CASES)
def test_hf_generate_is_greedy_decoding_of_the_original(loaded, name):
    refs, results, _ = loaded
    generated = results[name]["generated"]
    assert generated.shape == (2, PROMPT + NEW)
    assert torch.equal(generated[:, PROMPT:], refs[name]["greedy"])


@pytest.mark.parametrize("name", CASES)
def test_hf_generate_decodes_incrementally_as_the_full_recompute(loaded, name):
    """generate() with the cache gives the tokens it gives without (every position recomputed each step), past
    max_seq_len too, where both equal model/generate.py's window of the last L tokens; beam search alike; a cache
    driven by hand gives the full forward's logits."""
    refs, results, _ = loaded
    r = results[name]
    assert torch.equal(r["long_True"], r["long_False"]) and r["long_True"].shape == (2, PROMPT + LONG)
    assert torch.equal(r["long_True"], refs[name]["long"])
    L = SMALL["max_seq_len"]   # with the cache: the prompt, then 1 position a step until L, then the window
    assert r["fed_True"] == [PROMPT] + [1] * (L - PROMPT) + [L] * (PROMPT + LONG - 1 - L)
    assert r["fed_False"] == [min(n, L) for n in range(PROMPT, PROMPT + LONG)]
    assert torch.equal(r["beams_True"], r["beams_False"])
    assert (r["cached_logits"] - refs[name]["logits"]).abs().max() <= 1e-5 and r["cache_length"] == PROMPT


def test_hf_keeps_random_fixed_frozen(loaded):
    _, results, _ = loaded
    assert results["every_mixer_rope"]["frozen"] == ["model.blocks.3.mixer.synth.random_fixed.R"]
    assert results["gmlp"]["frozen"] == []


def test_hf_tokenizer_encodes_like_sentencepiece(loaded):
    _, results, tmp = loaded
    sp = spm.SentencePieceProcessor(model_file=str(tmp / "untied_learned" / "tokenizer.model"))
    tok = results["untied_learned"]["tokenizer"]
    assert tok["ids"] == sp.encode(TEXT)        # no BOS, exactly the ids training saw
    assert tok["decoded"] == TEXT and tok["eos"] == sp.eos_id()
    generation = json.loads((tmp / "untied_learned" / "generation_config.json").read_text())
    assert generation["eos_token_id"] == sp.eos_id() and generation["use_cache"] is True


def test_hf_directory_layout(loaded):
    refs, _, tmp = loaded
    _, tensors, meta = read_release(refs["every_mixer_rope"]["release"])
    hf = load_file(tmp / "every_mixer_rope" / "model.safetensors")
    assert sorted(hf) == sorted("model." + k for k in tensors)
    config = json.loads((tmp / "every_mixer_rope" / "config.json").read_text())
    assert config["auto_map"] == {"AutoConfig": "configuration_synthformer.SynthformerConfig",
                                  "AutoModelForCausalLM": "modeling_synthformer.SynthformerForCausalLM"}
    assert config["architectures"] == ["SynthformerForCausalLM"] and config["dtype"] == "float32"
    assert config["tie_word_embeddings"] is False and config["mixer"] == ALL_MIXERS
    assert not (tmp / "every_mixer_rope" / "tokenizer.model").exists()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_release_hf_release_is_bit_identical(tmp_path, dtype):
    cfg = CASES["untied_learned"]
    tok = train_tokenizer(tmp_path / "tokenizer.model")
    yaml = tmp_path / "train.yaml"
    yaml.write_text("model:\n  d_model: 32\n")
    training = {"step": 7, "tokens": 1234, "source": "runs/x/step_7"}
    save_release(str(tmp_path / "a"), cfg, dict(build_model(cfg).named_parameters()), dtype=dtype,
                 tokenizer=tok, train_config=str(yaml), training=training)
    release_to_hf(str(tmp_path / "a"), str(tmp_path / "hf"))
    hf_to_release(str(tmp_path / "hf"), str(tmp_path / "b"))
    cfg_a, tensors_a, meta_a = read_release(str(tmp_path / "a"))
    cfg_b, tensors_b, meta_b = read_release(str(tmp_path / "b"))
    assert cfg_a == cfg_b and meta_a == meta_b and meta_b["dtype"] == dtype and meta_b["training"] == training
    assert sorted(tensors_a) == sorted(tensors_b)
    for name, t in tensors_a.items():
        assert tensors_b[name].dtype == t.dtype and torch.equal(tensors_b[name], t), name
    for name in ("tokenizer.model", "train_config.yaml"):
        assert (tmp_path / "b" / name).read_bytes() == (tmp_path / "a" / name).read_bytes()


def test_hf_to_release_refuses_what_is_not_an_export(tmp_path):
    cfg = CASES["gmlp"]
    save_release(str(tmp_path / "release"), cfg, dict(build_model(cfg).named_parameters()))
    for bad in (tmp_path / "empty", tmp_path / "release"):    # no config.json; a release's config.json
        bad.mkdir(exist_ok=True)
        with pytest.raises(ConfigError) as e:
            hf_to_release(str(bad), str(tmp_path / "out"))
        msg = str(e.value)
        assert str(bad) in msg and "\n" not in msg and "not a Synthformer Hugging Face export" in msg
    assert not (tmp_path / "out").exists()
