"""lm-eval 0.4.13 adapter (evaluation/lm_eval_adapter.py), local tasks (tools/make_tasks.py, tasks/) and the CLI
wrapper (tools/run_lm_eval.py), on a tiny model with random weights saved as a release in the test.

Every number the harness reports is recomputed by hand from the model: the log-likelihood of a continuation is the
sum of its tokens' log-softmax from one unpadded forward pass; the rolling log-likelihood covers every token once in
windows of max_seq_len; greedy generation is model/generate.py's argmax decoding cut at the stop string.
"""
import gzip
import json
import os
import re
import subprocess

import pytest
import sentencepiece as spm
import torch
import torch.nn.functional as F

from model import ConfigError, ModelConfig, build_model
from model.generate import sample
from model.release import save_release
from tests.support.runs import CORPUS, PY, ROOT

OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
CFG = ModelConfig(vocab_size=512, d_model=32, n_layers=2, n_heads=4, max_seq_len=32, mixer=["dense", "random+dot"])


@pytest.fixture
def datasets_cache(monkeypatch, tmp_path):
    """Offline, and datasets' arrow cache in tmp (both read at import: setting the environment alone is too late)."""
    import datasets

    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))


def make_tasks(*args):
    from tools.make_tasks import main

    assert main([*map(str, args), "--quiet"]) == 0


@pytest.fixture(scope="module")
def tiny(shards, tmp_path_factory):
    """(release dir, sentencepiece processor, model, tasks dir): the shards fixture's 512-piece tokenizer, a random
    model saved as a release, tasks `tiny_*` from Austen text after the part the tokenizer was trained on."""
    tmp = tmp_path_factory.mktemp("lm_eval")
    tokenizer = os.path.join(shards, "tokenizer.model")
    model = build_model(CFG).eval()
    save_release(str(tmp / "release"), CFG, dict(model.named_parameters()), tokenizer=tokenizer)
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        f.read(200_000)
        (tmp / "heldout.txt").write_text(f.read(30_000), encoding="utf-8")
    make_tasks("--input", tmp / "heldout.txt", "--out", tmp / "tasks", "--prefix", "tiny", "--cloze-items", 12,
               "--mc-items", 8, "--passage-words", 60)
    return str(tmp / "release"), spm.SentencePieceProcessor(model_file=tokenizer), model, str(tmp / "tasks")


def encode(sp, text):
    """The training stream's layout: every line encoded on its own, eos between lines."""
    ids = []
    for k, line in enumerate(re.split(r"\n+", text)):
        ids += ([sp.eos_id()] if k else []) + (sp.encode(line) if line else [])
    return ids


@torch.no_grad()
def by_hand(model, context_ids, continuation_ids):
    """(Σ log p(continuation | context), is_greedy), one unpadded forward over the last ≤ L+1 tokens of each
    block of ≤ L continuation tokens (one block unless the continuation is longer than L)."""
    L, ll, greedy = model.cfg.max_seq_len, 0.0, True
    for a in range(0, len(continuation_ids), L):
        block = continuation_ids[a:a + L]
        seq = (context_ids + continuation_ids[:a + len(block)])[-(L + 1):]
        logp = F.log_softmax(model(torch.tensor([seq[:-1]]))[0], dim=-1)[-len(block):]   # (k, V)
        target = torch.tensor(block)
        ll += logp.gather(-1, target[:, None]).sum().item()
        greedy = greedy and bool((logp.argmax(-1) == target).all())
    return ll, greedy


def adapter(release, **kwargs):
    from evaluation.lm_eval_adapter import SynthformerLM

    return SynthformerLM(path=release, device="cpu", **kwargs)


def request(kind, *arguments):
    from lm_eval.api.instance import Instance

    return Instance(request_type=kind, doc={}, arguments=tuple(arguments), idx=0)


def test_simple_evaluate_offline_matches_by_hand(tiny, datasets_cache):
    import lm_eval
    from lm_eval.tasks import TaskManager

    import evaluation.lm_eval_adapter  # noqa: F401 -- registers "synthformer"

    release, sp, model, tasks = tiny
    out = lm_eval.simple_evaluate(model="synthformer", model_args=f"path={release},batch_size=5",
                                  tasks=["tiny_cloze", "tiny_mc4"], log_samples=True, device="cpu",
                                  task_manager=TaskManager(include_path=tasks, include_defaults=False))
    cloze, mc = out["samples"]["tiny_cloze"], out["samples"]["tiny_mc4"]
    assert len(cloze) == 12 and len(mc) == 8
    for s in cloze:
        context, target = s["doc"]["context"], " " + s["doc"]["target"]
        ctx = encode(sp, context)
        assert len(ctx) > CFG.max_seq_len   # the passages are longer than the model: the context is truncated
        ll, greedy = by_hand(model, ctx, encode(sp, context + target)[len(ctx):])
        assert s["resps"][0][0][0] == pytest.approx(ll, abs=1e-4) and s["resps"][0][0][1] == greedy
    correct, longest = 0, 0
    for s in mc:
        doc = s["doc"]
        ctx = encode(sp, doc["context"])
        conts = [encode(sp, doc["context"] + doc["sep"] + c)[len(ctx):] for c in doc["choices"]]
        lls = [by_hand(model, ctx, cont)[0] for cont in conts]
        assert [r[0][0] for r in s["resps"]] == pytest.approx(lls, abs=1e-4)
        correct += max(range(4), key=lls.__getitem__) == doc["label"]
        longest = max([longest] + [len(c) for c in conts])
    assert longest > CFG.max_seq_len            # some choice is scored in more than one block
    assert out["results"]["tiny_mc4"]["acc,none"] == pytest.approx(correct / len(mc))
    assert out["results"]["tiny_cloze"]["acc,none"] == sum(s["resps"][0][0][1] for s in cloze) / len(cloze)


@pytest.mark.parametrize("rolling_context", [1, 20])
def test_rolling_loglikelihood_covers_every_token_once(tiny, rolling_context):
    release, sp, model, _ = tiny
    text = "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in " \
           "want of a wife.\nHowever little known the feelings or views of such a man may be on his first " \
           "entering a neighbourhood, this truth is so well fixed in the minds of the surrounding families."
    ids, L, eos = encode(sp, text), CFG.max_seq_len, sp.eos_id()
    assert len(ids) > 2 * L
    lm = adapter(release, rolling_context=rolling_context, batch_size=3)
    seen, score = [], lm._loglikelihood_tokens

    def spy(windows, *args, **kwargs):
        for _, context, continuation in windows:
            assert 1 <= len(context) and len(context) + len(continuation) - 1 <= L   # one forward of ≤ L tokens
            seen.extend(continuation)
        return score(windows, *args, **kwargs)

    lm._loglikelihood_tokens = spy
    [total] = lm.loglikelihood_rolling([request("loglikelihood_rolling", text)])
    assert seen == ids                          # each token predicted exactly once, in order
    # by hand: the first window predicts L tokens from eos + the first L-1; each later one predicts the next
    # L - C + 1 tokens from the L tokens before its end (≥ C - 1 already scored ones; C = 1: disjoint blocks of L)
    expected, done, stream = 0.0, 0, [eos] + ids   # stream[j] is the input that predicts ids[j]
    while done < len(ids):
        end = min(done + (L if done == 0 else L - rolling_context + 1), len(ids))
        start = max(0, end - L)
        with torch.no_grad():
            logp = F.log_softmax(model(torch.tensor([stream[start:end]]))[0], dim=-1)
        expected += sum(logp[j - start, ids[j]].item() for j in range(done, end))
        done = end
    assert total == pytest.approx(expected, abs=1e-3)


def test_generate_until_is_greedy_decoding_cut_at_the_stop_string(tiny, monkeypatch):
    import pretrain.observe.downstream as downstream

    release, sp, model, _ = tiny
    phrases = ["Emma Woodhouse, handsome, clever, and rich", "Mr. Darcy walked with Elizabeth in the park",
               "It is a truth universally acknowledged", "Sir Walter Elliot, of Kellynch Hall",
               "The family of Dashwood had long been settled", "No one who had ever seen Catherine Morland"]
    # two prompts of one token length go through generation as one batch
    prompts = next([a, b] for a in phrases for b in phrases if a < b and len(encode(sp, a)) == len(encode(sp, b)))
    n = 12
    refs = []
    for p in prompts:
        ids = encode(sp, p)
        new = sample(model, torch.tensor([ids]), n, temperature=0)[0, len(ids):].tolist()
        new = new[:new.index(sp.eos_id())] if sp.eos_id() in new else new
        refs.append(sp.decode(ids + new)[len(sp.decode(ids)):])   # the text the argmax tokens add
    lm = adapter(release, batch_size=4)
    plain = lm.generate_until([request("generate_until", p, {"until": [], "max_gen_toks": n}) for p in prompts])
    assert plain == refs
    stop = refs[0][len(refs[0]) // 2:len(refs[0]) // 2 + 2]
    steps = []
    monkeypatch.setattr(downstream, "sample", lambda *a, **k: steps.append(1) or sample(*a, **k))
    [cut] = lm.generate_until([request("generate_until", prompts[0], {"until": [stop], "max_gen_toks": 64})])
    assert cut == refs[0].split(stop)[0] and len(steps) < 64   # stopped once the stop string appeared


def test_tokenization_follows_the_training_stream(tiny):
    release, sp, _, _ = tiny
    lm = adapter(release)
    text = "First line, said she.\n\nSecond   line\nthird"
    assert lm.tok_encode(text) == encode(sp, text) and lm.tok_encode(text).count(sp.eos_id()) == 2
    assert lm.tok_decode(lm.tok_encode(text)) == "First line, said she.\nSecond   line\nthird"
    assert lm.tok_decode(sp.encode("Emma said"), continuation=True) == " Emma said"
    assert adapter(release, newline="text").tok_encode("a\nb") == sp.encode("a\nb")


def test_adapter_errors_are_one_line(tiny, tmp_path):
    release = tiny[0]
    for path, kwargs, words in [(str(tmp_path), {}, "not a DeepSpeed training checkpoint"),
                                (release, {"batch_size": "x"}, "batch_size"),
                                (release, {"dtype": "fp8"}, "dtype"),
                                (release, {"rolling_context": 99}, "rolling_context")]:
        with pytest.raises(ConfigError, match=words) as e:
            adapter(path, **kwargs)
        assert "\n" not in str(e.value)


def test_make_tasks_is_deterministic_and_loads_from_any_cwd(shards, datasets_cache, tmp_path, monkeypatch):
    from lm_eval.tasks import TaskManager

    for out in ("a", "b"):
        make_tasks("--shards", shards, "--out", tmp_path / out, "--prefix", "held", "--min-context-words", 2,
                   "--cloze-items", 10, "--mc-items", 5)   # the fixture's val samples hold 32 tokens: short contexts
    files = sorted(os.listdir(tmp_path / "a"))
    assert files == ["held_cloze.jsonl", "held_cloze.yaml", "held_mc4.jsonl", "held_mc4.yaml", "local_data.py"]
    for name in files:   # the yaml headers name their own --out
        a, b = (tmp_path / "a" / name).read_text(), (tmp_path / "b" / name).read_text()
        assert a == b.replace(f"--out {tmp_path / 'b'}", f"--out {tmp_path / 'a'}")
    items = [json.loads(line) for line in (tmp_path / "a" / "held_mc4.jsonl").read_text().splitlines()]
    assert len(items) == 5 and all(len(set(i["choices"])) == 4 and 0 <= i["label"] < 4 for i in items)
    monkeypatch.chdir("/")                      # relative data_files resolve next to the yaml, not in the cwd
    task = TaskManager(include_path=str(tmp_path / "a"), include_defaults=False).load("held_cloze")["tasks"]
    assert len(list(task["held_cloze"].test_docs())) == 10


@pytest.mark.slow
def test_make_tasks_rebuilds_the_shipped_files(demo, tmp_path):
    """The command in the shipped tasks' header, on the demo's shards as `make demo` builds them, writes them again
    byte for byte."""
    shipped = os.path.join(ROOT, "tasks")
    header = open(os.path.join(shipped, "austen_cloze.yaml")).read()
    command = re.search(r"#   python tools/make_tasks.py (.*)", header).group(1).split()
    assert json.load(open(os.path.join(demo["shards"], "manifest.json")))["tokenizer_sha256"][:16] in header
    shards = tmp_path / command[command.index("--shards") + 1]              # the header's paths, relative, here
    shards.parent.mkdir(parents=True)
    shards.symlink_to(demo["shards"])
    subprocess.run([PY, os.path.join(ROOT, "tools", "make_tasks.py"), *command, "--quiet"], cwd=tmp_path, check=True)
    for name in ("austen_cloze.jsonl", "austen_mc4.jsonl", "austen_cloze.yaml", "austen_mc4.yaml"):
        assert (tmp_path / "tasks" / name).read_text() == open(os.path.join(shipped, name)).read(), name


def test_cli_wrapper_runs_the_shipped_tasks_offline_from_another_cwd(tiny, tmp_path):
    release = tiny[0]
    env = {**os.environ, **OFFLINE, "HF_HOME": str(tmp_path / "hf")}
    run = [PY, os.path.join(ROOT, "tools", "run_lm_eval.py"), "--model", "synthformer"]   # no --device: the CPU
    r = subprocess.run(run + ["--model_args", f"path={release}", "--batch_size", "8", "--tasks",
                              "austen_cloze,austen_mc4", "--limit", "3", "--output_path", str(tmp_path / "out")],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "CUDA is not available" not in r.stderr and "cuda:0" not in r.stderr, r.stderr[-3000:]
    assert re.search(r"austen_cloze.*acc", r.stdout) and re.search(r"austen_mc4.*acc", r.stdout)
    bad = subprocess.run(run + ["--model_args", f"path={tmp_path}/nowhere", "--tasks", "austen_cloze"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("error: ")
    assert "nowhere" in bad.stderr.strip().splitlines()[-1]


def test_the_scorer_finds_the_shipped_tasks():
    """The live scorer's task folder is the repository's tasks/, wherever its module sits (it moved a floor down once
    and looked in pretrain/tasks)."""
    from pretrain.observe.downstream import TASKS

    assert os.path.samefile(TASKS, os.path.join(ROOT, "tasks"))
    assert {"austen_cloze.yaml", "austen_mc4.yaml"} <= set(os.listdir(TASKS))
