"""tools/evaluate.py, tools/generate.py (+ model/decoding.py), tools/plot_attention.py on tiny models built here.

Numbers are checked against references computed another way: per-token loops with a hand-written log-softmax, tar
members read directly, documents decoded by sentencepiece; cached decoding against the full recompute."""
import gzip
import json
import math
import os
import subprocess
import tarfile

import numpy as np
import pytest
import torch

from model import ModelConfig, build_model, variants
from model.decoding import CachedLM, IncrementalDecoder
from model.generate import sample
from model.hf import release_to_hf
from model.release import save_release
from tests.support.runs import CORPUS, PY, ROOT, run_py, write_config
from evaluation import perplexity
from evaluation.loading import load
from evaluation.prompts import prompt_ids
from tokendata.corpus import documents
from pretrain.observe.metrics import layer_maps
from tools import evaluate, generate, plot_attention

L = 16
# every registered mixer, gMLP, and the mixtures of model/variants.py this test has always run
VARIANTS = [v for v in variants.subset("all") if v not in ("random+dense", "random+dot+dense")]


def tiny(mixer="dense", vocab=512, max_seq_len=L, **kw) -> torch.nn.Module:
    extra = variants.model_fields(mixer) if isinstance(mixer, str) else {"mixer": mixer}
    # Large inits: far-from-uniform predictions and maps, so every cached quantity visibly matters.
    cfg = ModelConfig(**{**dict(vocab_size=vocab, d_model=32, n_layers=2, n_heads=4, max_seq_len=max_seq_len,
                                factorized_k=4, init_std=0.3, random_init_std=1.0, sgu_init_eps=4.0 * max_seq_len,
                                seed=5), **extra, **kw})
    return build_model(cfg).eval()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy machine the thread hand-offs cost ~100× a
    forward (0.8 ms → 170 ms measured on 2 shared cores); restored for the other test modules."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def sp(shards):
    import sentencepiece as spm
    return spm.SentencePieceProcessor(model_file=os.path.join(shards, "tokenizer.model"))


@pytest.fixture(scope="module")
def text():
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        lines = f.read(200_000)[150_000:].splitlines()[1:]   # whole lines from past the shards' 120 kB
    return "\n".join([line for line in lines if 30 < len(line) < 200][:4]) + "\n"


@torch.no_grad()
def reference_nll(model, ids, t, start):
    """−log p(ids[t] | ids[start:t]) with an explicit log-softmax in float64."""
    logits = model(torch.tensor([ids[start:t]]))[0, -1].double()
    return float(logits.logsumexp(-1) - logits[ids[t]])


# ---- evaluate -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stride", [1, 5, L])
def test_text_windows_match_a_per_token_loop(sp, text, stride):
    model = tiny(max_seq_len=L)
    ids = [sp.eos_id()]
    for doc in documents(text):
        ids += sp.encode(doc) + [sp.eos_id()]
    T, first_end = len(ids) - 1, min(L, len(ids) - 1)
    nll = 0.0
    for t in range(1, T + 1):   # target t: scored by the first window ending at ≥ t, whose inputs start at end − L
        k = 0 if t <= first_end else math.ceil((t - first_end) / stride)
        end = min(first_end + k * stride, T)
        nll += reference_nll(model, ids, t, max(0, end - L))
        if stride == 1:
            assert max(0, end - L) == max(0, t - L)   # stride 1: every token sees the full L − 1 earlier tokens
    r = perplexity.evaluate_text(model, sp, [text], stride=stride, batch_size=3)
    assert r["tokens"] == T
    assert r["loss"] * T == pytest.approx(nll, rel=1e-5)
    assert r["bits_per_byte"] == pytest.approx(nll / math.log(2) / r["bytes"], rel=1e-5)


def test_bits_per_byte_hand_built(sp):
    r = perplexity.summarize(12 * math.log(2), tokens=4, n_bytes=6)
    assert (r["bits_per_token"], r["bits_per_byte"], r["ppl"]) == pytest.approx((3.0, 2.0, 8.0))
    text = "Hello world\n\n  Émile ça va\n"                 # 11 + 1 and 13 + 1 bytes (É, ç take 2 each)
    model = tiny()
    r = perplexity.evaluate_text(model, sp, [text])
    assert r["bytes"] == 26
    # The shard rule (bytes from the pieces) counts the same bytes on the same stream.
    ids = [sp.eos_id()] + sp.encode("Hello world") + [sp.eos_id()] + sp.encode("Émile ça va") + [sp.eos_id()]
    prev, tgt = torch.tensor(ids[:-1]), torch.tensor(ids[1:])
    assert perplexity.target_bytes(perplexity.piece_bytes(sp), prev, tgt, sp.eos_id(), True) == 26
    assert r["tokens"] == len(ids) - 1


def read_split(shard_dir, split):
    """Every sample of a split straight from the tar files (not through tokendata.stream): each shard's one member
    holds its samples of n+1 ids back to back."""
    n = json.load(open(os.path.join(shard_dir, "manifest.json")))["seq_len"]
    out = []
    for name in sorted(f for f in os.listdir(shard_dir) if f.startswith(split + "-")):
        with tarfile.open(os.path.join(shard_dir, name)) as tar:
            (m,) = tar.getmembers()
            out += list(np.frombuffer(tar.extractfile(m).read(), dtype="<u2").astype(np.int64).reshape(-1, n + 1))
    return out


def decoded_bytes(sp, sample):
    """Bytes of targets 1..n by decoding: eos-separated documents (a newline per eos); a first segment that continues
    the document of the sample's token 0 counts as text(ids[0:k]) − text(ids[0])."""
    eos, segments, cur = sp.eos_id(), [], []
    for t in sample[1:].tolist():
        if t == eos:
            segments.append(cur)
            cur = []
        else:
            cur.append(t)
    first, *rest = segments + [cur]                     # one more segment than eos tokens
    if sample[0] == eos:
        head = len(sp.decode(first).encode())
    else:
        head = len(sp.decode([int(sample[0])] + first).encode()) - len(sp.decode([int(sample[0])]).encode())
    return head + sum(len(sp.decode(s).encode()) for s in rest) + len(rest)


@torch.no_grad()
def test_shards_match_direct_reading(shards, sp):
    model = tiny(max_seq_len=32)
    samples = read_split(shards, "val")
    nll = 0.0
    for s in samples:   # one sample at a time; causal, so one forward gives every prefix's prediction
        logits = model(torch.from_numpy(s[None, :-1]))[0].double()            # (n, V)
        nll += float((logits.logsumexp(-1) - logits[torch.arange(len(s) - 1), torch.from_numpy(s[1:])]).sum())
    n_bytes = sum(decoded_bytes(sp, s) for s in samples)
    bs = next(b for b in (5, 7, 11) if len(samples) % b)   # a partial last batch: val_batches wraps round to fill it
    r = perplexity.evaluate_shards(model, shards, "val", batch_size=bs)
    assert r["samples"] == len(samples) and r["tokens"] == len(samples) * 32
    assert r["loss"] * r["tokens"] == pytest.approx(nll, rel=1e-5)
    assert r["bytes"] == n_bytes
    assert perplexity.evaluate_shards(model, shards, "val", max_samples=2)["tokens"] == 64


def test_release_checkpoint_and_hf_export_give_the_same_results(shards, sp, text, tmp_path):
    model = tiny(max_seq_len=32, mixer="random+dot")
    cfg_path = write_config(tmp_path / "run.yaml", shards, tmp_path / "run", model=model.cfg.to_dict())
    tag = tmp_path / "run" / "checkpoints" / "step_00000007"   # the layout DeepSpeed writes at ZeRO-0, TP = PP = 1
    tag.mkdir(parents=True)
    (tag / "config.yaml").write_text(open(cfg_path).read())
    torch.save({"module": model.state_dict()}, tag / "mp_rank_00_model_states.pt")
    (tag.parent / "latest").write_text(tag.name)
    tok = os.path.join(shards, "tokenizer.model")
    (tag / "tokenizer.model").write_bytes(open(tok, "rb").read())
    save_release(str(tmp_path / "release"), model.cfg, dict(model.named_parameters()), tokenizer=tok,
                 train_config=cfg_path, training={"step": 7})
    release_to_hf(str(tmp_path / "release"), str(tmp_path / "hf"))
    results = []
    for path in (tmp_path / "run", tmp_path / "release", tmp_path / "hf"):
        m, s, info = load(str(path))
        assert info["step"] == 7
        results.append((perplexity.evaluate_shards(m, shards, max_samples=5), perplexity.evaluate_text(m, s, [text])))
    assert results[0] == results[1]
    for native, hf in zip(results[0], results[2]):      # the HF export, run by transformers: the same perplexity
        assert native["tokens"] == hf["tokens"] and abs(hf["ppl"] - native["ppl"]) <= 1e-4 * native["ppl"]
    # generate.py on each, cached and not: the same greedy text everywhere (the export's own SynthesizerLM decodes
    # incrementally); without --prompt, the opening of a validation document of the run's shards, said on stderr
    texts = {}
    for path in (tmp_path / "run", tmp_path / "release", tmp_path / "hf"):
        for cache in ([], ["--no-cache"]):
            r = run_py([PY, "tools/generate.py", str(path), "--max-new-tokens", "8", "--temperature", "0", "--json",
                        "--quiet", *cache], timeout=300)
            assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
            assert "the opening of a validation document in" in r.stderr, r.stderr
            texts[(path.name, bool(cache))] = json.loads(r.stdout.splitlines()[-1])["text"]
    assert len(set(texts.values())) == 1, texts


@pytest.mark.slow
def test_demo_release_equals_demo_checkpoint(demo):
    a, b = (perplexity.evaluate_shards(load(demo[p])[0], demo["shards"], max_samples=4) for p in ("run", "release"))
    assert a == b and a["tokens"] == 4 * 128


# ---- generate / decoding ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("position", ["learned", "rope"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_cached_decoding_equals_full_recompute(variant, position):
    model = tiny(variant, vocab=64, position=position)
    x = torch.randint(0, 64, (2, L), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(x)
    dec = IncrementalDecoder(model)
    steps = [dec(x[:, :5])] + [dec(x[:, t:t + 1]) for t in range(5, L)]   # a prompt, then one token at a time
    assert (torch.cat(steps, dim=1) - full).abs().max() <= 1e-5


@pytest.mark.parametrize("variant", ["dense", "random+dot", "sgu"])
def test_cached_sampling_equals_uncached_past_max_seq_len(variant):
    model = tiny(variant, vocab=64)
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    for kw in ({"temperature": 0.0}, {"temperature": 0.9, "top_k": 20, "top_p": 0.9, "seed": 4}):
        cached = CachedLM(model)
        ours = sample(cached, prompt, 2 * L, **kw)          # crosses L: the window slides, full recomputes
        assert torch.equal(ours, sample(model, prompt, 2 * L, **kw))
        assert cached.recomputes == 1 + (prompt.shape[1] + 2 * L - 1 - L)   # the prefill, then each slid window


def test_generate_is_reproducible_per_seed(sp):
    model = tiny()
    run = lambda **kw: generate.generate(model, sp, "It was", 12, temperature=1.0, top_k=50, **kw)
    three, again = run(seed=3, num_samples=3), run(seed=3, num_samples=3)
    assert three == again and len({s["text"] for s in three}) > 1
    assert run(seed=4, num_samples=1)[0] == three[1]                  # sample k uses seed + k
    recomputed = run(seed=3, num_samples=1, use_cache=False)[0]
    assert recomputed == {**three[0], "decoding": "full recompute: the cache is disabled"}   # the same sample
    assert three[0]["decoding"] == "incremental"
    t = len(prompt_ids(sp, "It was"))   # the model sees t … t+L+4 tokens: the t+4 calls on more than L slide
    slid = generate.generate(model, sp, "It was", L + 5, temperature=0.0)[0]["decoding"]
    assert slid == f"incremental up to max_seq_len={L}, then {t + 4} full recomputes of the sliding window"
    assert all(len(s["ids"]) == 12 for s in three)


# ---- plot_attention ---------------------------------------------------------------------------------------------
def test_attention_plot_data_and_png(sp, tmp_path):
    model = tiny(mixer=["dense", "sgu"], max_seq_len=32)
    ids = prompt_ids(sp, "It is a truth universally acknowledged")
    with torch.no_grad():
        data = layer_maps(model.cfg, model.attention_maps(torch.tensor([ids])))
    assert [name for _, name, _, _ in data] == ["dense", "sgu"] and [s for _, _, s, _ in data] == [True, False]
    n = len(ids)
    for _, _, softmax, maps in data:
        assert maps.shape == (4, n, n)
        assert np.all(np.triu(maps, k=1) == 0)                         # nothing above the diagonal
        if softmax:
            assert np.allclose(maps.sum(-1), 1.0, atol=1e-6)
    out = tmp_path / "maps.png"
    plot_attention.plot(data, [sp.id_to_piece(i) for i in ids], str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_plot_cli_writes_png_from_a_release(sp, shards, tmp_path):
    model = tiny(mixer="random+dot", max_seq_len=32)
    save_release(str(tmp_path / "rel"), model.cfg, dict(model.named_parameters()),
                 tokenizer=os.path.join(shards, "tokenizer.model"))
    assert plot_attention.main([str(tmp_path / "rel"), "--prompt", "Emma", "--out", str(tmp_path / "a.png")]) == 0
    assert (tmp_path / "a.png").stat().st_size > 0


# ---- command lines ----------------------------------------------------------------------------------------------
def test_cli_help_and_one_line_errors(tmp_path):
    bogus = tmp_path / "not-a-checkpoint"
    bogus.mkdir()
    runs = {
        "evaluate --help": ["tools/evaluate.py", "--help"],
        "generate --help": ["tools/generate.py", "--help"],
        "plot --help": ["tools/plot_attention.py", "--help"],
        "profile --help": ["benchmarks/profile_step.py", "--help"],
        "bench_generate --help": ["benchmarks/bench_generate.py", "--help"],
        "evaluate bogus": ["tools/evaluate.py", bogus, "--shards", bogus],
        "generate bogus": ["tools/generate.py", bogus],
        "plot bogus": ["tools/plot_attention.py", bogus, "--out", tmp_path / "x.png"],
        "profile bogus": ["benchmarks/profile_step.py", bogus / "c.yaml"],
        "bench_generate bogus": ["benchmarks/bench_generate.py", "--shapes", bogus],
        "profile bad key": ["benchmarks/profile_step.py", "configs/demo-cpu.yaml", f"train.no_such_key={bogus}"],
    }
    procs = {k: subprocess.Popen([PY, os.path.join(ROOT, v[0]), *map(str, v[1:])], cwd=ROOT, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE) for k, v in runs.items()}
    done = {k: (p.communicate(timeout=120), p.returncode) for k, p in procs.items()}   # run side by side: fast
    for k, ((out, err), rc) in done.items():
        if k.endswith("--help"):
            assert rc == 0 and out.startswith("usage:"), (k, err)
            continue
        lines = [line for line in err.splitlines() if "[WARNING]" not in line]
        assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), (k, err)
        assert "Traceback" not in err
        assert str(bogus) in lines[0], (k, lines)


def test_bad_arguments_are_one_line_errors(tmp_path, capsys):
    for main, args, named in ((evaluate.main, [str(tmp_path), "--text", str(tmp_path / "nope.txt")], "nope.txt"),
                              (generate.main, [str(tmp_path), "--top-p", "1.5"], "--top-p 1.5"),
                              (plot_attention.main, [str(tmp_path), "--out", "x.jpg"], "x.jpg")):
        assert main(args) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err and named in err, err
