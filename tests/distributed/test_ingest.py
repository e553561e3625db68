"""The corpora people have (issue 34): JSONL, Parquet and Hugging Face datasets whose documents keep their newlines,
Hugging Face tokenizers, parallel writing, the compact checksummed shards of manifest format 2, and the old format-1
shards (tests/data/format1, frozen).

Every input is written here, every tokenizer trained here (sentencepiece by tools/train_tokenizer.py, a byte-level
BPE by the `tokenizers` library), and the real tools run on them; shards are read back with tarfile alone.
"""
import gzip
import json
import os
import shutil
import subprocess
import tarfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from tests.support.runs import CORPUS, PY, ROOT, run_py, tool
from tokendata.shards import read_manifest
from tokendata.stream import TokenStream
from tools.make_shards import main as make_shards_main

FORMAT1 = os.path.join(ROOT, "tests", "data", "format1", "shards")
EOS = "<|endoftext|>"
CODE = ["def add(x, y):\n    return x + y\n", "for i in range(3):\n\tprint(i)\n\n# done\n",
        "Roses are red,\nviolets are blue,\n  sugar is sweet.\n"]


def paragraphs(count=400):
    """The first `count` paragraphs (non-empty lines) of Austen."""
    out = []
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                out.append(line.strip())
                if len(out) == count:
                    break
    return out


def newline_documents(count=120):
    """Documents with newlines inside: 1-3 Austen paragraphs joined by newlines, and code and verse between them."""
    paras, docs = paragraphs(count=3 * count), []
    for i in range(count):
        docs.append("\n".join(paras[3 * i:3 * i + 1 + i % 3]) if i % 4 else CODE[i // 4 % len(CODE)])
    return docs


def train_hf_tokenizer(path, texts, vocab=400):
    """A byte-level BPE tokenizer.json with <|endoftext|> as its one special token (GPT-2's layout, small)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOS], show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tok.save(str(path))
    return str(path)


@pytest.fixture(scope="module")
def hf_tok(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf_tok")
    return train_hf_tokenizer(tmp / "tokenizer.json", paragraphs(count=2000) + CODE)


def make(*args):
    """tools/make_shards.py's main, in this process (its exit status; the one-line error on stderr)."""
    return make_shards_main([*map(str, args), "--quiet"])


def write_jsonl(path, records, opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


def tars(directory):
    return {name: open(os.path.join(directory, name), "rb").read()
            for name in sorted(os.listdir(directory)) if name.endswith(".tar")}


def stream_ids(directory):
    """The token stream the shards were cut from, rebuilt with tarfile alone: every sample of the split, in stream
    order (first_index), each after the first without the boundary token it shares with the one before."""
    m = json.load(open(os.path.join(directory, "manifest.json")))
    dtype = "<u2" if m["dtype"] == "uint16" else "<i4"
    out = []
    for shard in sorted(m["splits"]["train"]["shards"], key=lambda s: s["first_index"]):
        with tarfile.open(os.path.join(directory, shard["name"])) as tar:
            (member,) = tar.getmembers()
            rows = np.frombuffer(tar.extractfile(member).read(), dtype=dtype).reshape(-1, m["seq_len"] + 1)
        for row in rows:
            out += row.tolist() if not out else row.tolist()[1:]
    return out, m


# ---- documents and formats ----

def test_newlines_are_kept_and_documents_separated_by_eos(hf_tok, tmp_path):
    from tokenizers import Tokenizer

    docs = newline_documents()
    write_jsonl(tmp_path / "docs.jsonl", [{"text": d, "id": i} for i, d in enumerate(docs)])
    assert make("--input", tmp_path / "docs.jsonl", "--tokenizer", hf_tok, "--out", tmp_path / "s", "--seq-len", 64,
                "--samples-per-shard", 20, "--val-fraction", 0) == 0
    ids, m = stream_ids(tmp_path / "s")
    tok = Tokenizer.from_file(hf_tok)
    eos = tok.token_to_id(EOS)
    assert (m["tokenizer"], m["tokenizer_kind"], m["eos_id"]) == ("tokenizer.json", "huggingface", eos)
    # split before each eos; decode drops the eos that starts each piece after the first
    decoded = [tok.decode(p.tolist()) for p in np.split(np.array(ids), np.flatnonzero(np.array(ids) == eos))][:-1]
    assert decoded[:-1] == docs[:len(decoded) - 1]     # the last one is cut off at the end of the last sample
    assert docs[len(decoded) - 1].startswith(decoded[-1])
    assert len(decoded) > 60 and sum(d.count("\n") for d in decoded) > 100 and "\n    return" in "".join(decoded)
    # the stream is the documents' ids with eos after each: one eos per document boundary, none inside
    expect = [i for d in docs for i in tok.encode(d, add_special_tokens=False).ids + [eos]]
    assert ids == expect[:len(ids)]


def test_jsonl_parquet_and_datasets_give_identical_shards(hf_tok, tmp_path):
    """The same documents as .jsonl, .jsonl.gz, .jsonl.zst, Parquet, a dataset saved with save_to_disk (a
    DatasetDict: --split), and a folder of data files read by `datasets`: the same .tar files, byte for byte."""
    import datasets

    docs = newline_documents(80)
    records = [{"text": d, "n": i} for i, d in enumerate(docs)]
    inputs = {"jsonl": write_jsonl(tmp_path / "a.jsonl", records),
              "gz": write_jsonl(tmp_path / "a.jsonl.gz", records, gzip.open),
              "parquet": tmp_path / "a.parquet"}
    with zstandard.open(tmp_path / "a.jsonl.zst", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    inputs["zst"] = tmp_path / "a.jsonl.zst"
    pq.write_table(pa.table({"text": docs, "n": list(range(len(docs)))}), inputs["parquet"], row_group_size=17)
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": docs}),
                          "test": datasets.Dataset.from_dict({"text": ["other"]})}).save_to_disk(tmp_path / "saved")
    inputs["saved"] = tmp_path / "saved"
    os.makedirs(tmp_path / "files" / "data")
    pq.write_table(pa.table({"text": docs}), tmp_path / "files" / "data" / "train-00000-of-00001.parquet")
    inputs["files"] = tmp_path / "files"
    written = {}
    for kind, path in inputs.items():
        assert make("--input", path, "--tokenizer", hf_tok, "--out", tmp_path / kind, "--seq-len", 48,
                    "--samples-per-shard", 16, "--val-fraction", 0.2) == 0, kind
        written[kind] = tars(tmp_path / kind)
        m = read_manifest(str(tmp_path / kind))
        assert m["input"]["formats"] == ["hf" if kind in ("saved", "files") else
                                         "parquet" if kind == "parquet" else "jsonl"]
    assert len(written["jsonl"]) > 4 and any(n.startswith("val-") for n in written["jsonl"])
    for kind in inputs:
        assert written[kind] == written["jsonl"], kind
    # the plain-text reading is unchanged: one document a line (the corpus as tools/train_tokenizer.py reads it)
    (tmp_path / "a.txt").write_text("\n".join(d.replace("\n", " ") for d in docs) + "\n")
    assert make("--input", tmp_path / "a.txt", "--tokenizer", hf_tok, "--out", tmp_path / "txt", "--seq-len", 48) == 0


def test_bad_records_are_one_line_or_skipped_and_counted(hf_tok, tmp_path, capsys):
    good = [{"text": d} for d in newline_documents(40)]
    lines = [json.dumps(r) for r in good]
    lines[3:3] = ['{"title": "no text"}']                  # line 4: no key
    lines[7:7] = ['{"text": 42}']                          # line 8: not a string
    lines[11:11] = ['{"text": "cut off']                   # line 12: invalid JSON
    bad = write_jsonl(tmp_path / "bad.jsonl", lines)
    args = ["--tokenizer", hf_tok, "--seq-len", 32, "--val-fraction", 0]
    assert make("--input", bad, "--out", tmp_path / "fail", *args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {bad} line 4: no key 'text' (it has 'title')") and "\n" not in err, err
    assert "--bad-records skip" in err
    assert make("--input", bad, "--out", tmp_path / "skip", "--bad-records", "skip", *args) == 0
    out = capsys.readouterr().out
    assert f"skipped 3 bad records (--bad-records skip); the first: {bad} line 4: no key 'text'" in out
    write_jsonl(tmp_path / "good.jsonl", good)
    assert make("--input", tmp_path / "good.jsonl", "--out", tmp_path / "good", *args) == 0
    assert tars(tmp_path / "skip") == tars(tmp_path / "good")   # the bad records left out, nothing else
    assert read_manifest(str(tmp_path / "skip"))["input"]["bad_records_skipped"] == 3
    # a null in a Parquet column: the row, counted from 0; a missing column is one line whatever --bad-records says
    pq.write_table(pa.table({"text": ["a b c " * 20, None, "d e f " * 20]}), tmp_path / "null.parquet")
    assert make("--input", tmp_path / "null.parquet", "--out", tmp_path / "pq", *args) == 2
    assert capsys.readouterr().err.strip().startswith(f"error: {tmp_path / 'null.parquet'} row 1: 'text' is null")
    assert make("--input", tmp_path / "null.parquet", "--text-key", "body", "--bad-records", "skip", "--out",
                tmp_path / "pq2", *args) == 2
    assert capsys.readouterr().err.strip() == (f"error: {tmp_path / 'null.parquet'} has no column 'body' (columns: "
                                               "text): pass --text-key COLUMN")


def test_without_datasets_one_line_names_the_extra(hf_tok, tmp_path):
    (tmp_path / "blocked").mkdir()
    (tmp_path / "blocked" / "datasets.py").write_text("raise ImportError('datasets is not installed')\n")
    (tmp_path / "d").mkdir()
    r = subprocess.run([PY, os.path.join(ROOT, "tools", "make_shards.py"), "--input", tmp_path / "d", "--tokenizer",
                        hf_tok, "--out", tmp_path / "s", "--seq-len", "8"], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": f"{tmp_path / 'blocked'}:{ROOT}"})
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
    assert "pip install 'synthformer[data]'" in r.stderr


def test_the_gpu_study_builds_its_shards_from_wikitext_parquet_in_one_command(tmp_path):
    """configs/study-gpu-50m.yaml's commands, as its header gives them (--vocab-size made small for a small corpus),
    on Parquet files of WikiText-103's schema: a `text` column, one paragraph or heading a row, empty rows between."""
    from pretrain.config import load_config

    config = os.path.join(ROOT, "configs", "study-gpu-50m.yaml")
    commands = [line.strip("# \n") for line in open(config) if line.startswith("#   python tools/")]
    assert [c.split()[1] for c in commands] == ["tools/train_tokenizer.py", "tools/make_shards.py"]
    folder = tmp_path / "build" / "study" / "wikitext-103-raw-v1"
    folder.mkdir(parents=True)
    rows = []
    for k, para in enumerate(paragraphs(count=1200)):
        rows += ([" = = Section {k} = = \n", ""] if k % 40 == 0 else []) + [f" {para} \n", ""]
    for part in range(2):
        pq.write_table(pa.table({"text": rows[part::2]}), folder / f"train-0000{part}-of-00002.parquet")
    for command in commands:
        command = command.replace("python ", f"{PY} ", 1).replace("tools/", f"{ROOT}/tools/", 1)
        r = subprocess.run(["bash", "-c", command.replace("--vocab-size 32000", "--vocab-size 600") + " --quiet"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, (command, r.stderr[-2000:])
    m = read_manifest(str(tmp_path / load_config(config).data.shard_dir))
    assert m["input"]["formats"] == ["parquet", "parquet"] and m["seq_len"] == 1024
    assert m["splits"]["train"]["samples"] >= 20


# ---- tokenizers ----

def test_tokenizer_without_eos_is_one_line_unless_eos_names_one(tmp_path, capsys):
    from tokenizers import Tokenizer

    path = train_hf_tokenizer(tmp_path / "t" / "tokenizer.json", paragraphs(count=300))
    tok = Tokenizer.from_file(path)
    tok.add_special_tokens(["<doc-end>"])
    bare = tmp_path / "bare" / "tokenizer.json"
    bare.parent.mkdir()
    data = json.loads(tok.to_str())
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] != EOS]
    bare.write_text(json.dumps(data))
    (tmp_path / "c.txt").write_text("\n".join(paragraphs(count=200)))
    args = ["--input", tmp_path / "c.txt", "--seq-len", 16, "--tokenizer", bare]
    assert make(*args, "--out", tmp_path / "a") == 2
    err = capsys.readouterr().err.strip()
    assert "has no eos token" in err and "--eos TOKEN" in err and "\n" not in err
    assert make(*args, "--out", tmp_path / "b", "--eos", "<doc-end>") == 0
    m = read_manifest(str(tmp_path / "b"))
    assert m["eos_id"] == tok.token_to_id("<doc-end>")
    assert json.load(open(tmp_path / "b" / "tokenizer_config.json"))["eos_token"] == "<doc-end>"


def test_workers_write_the_same_shards(tmp_path):
    """--workers 2 (batches of 4000 characters, so the two processes take turns many times) writes the .tar files
    and manifest of --workers 1, with a sentencepiece tokenizer trained by tools/train_tokenizer.py."""
    (tmp_path / "c.txt").write_text("\n".join(paragraphs(count=1500)) + "\n")
    tool("train_tokenizer.py", "--input", tmp_path / "c.txt", "--vocab-size", 400, "--out", tmp_path / "tok.model",
         "--quiet")
    for n in (1, 2):
        tool("make_shards.py", "--input", tmp_path / "c.txt", "--tokenizer", tmp_path / "tok.model", "--out",
             tmp_path / f"w{n}", "--seq-len", 64, "--samples-per-shard", 50, "--workers", n, "--threads", 1,
             "--batch-chars", 4000, "--quiet")
    one, two = tars(tmp_path / "w1"), tars(tmp_path / "w2")
    assert len(one) > 10 and one == two
    m1, m2 = (json.load(open(tmp_path / f"w{n}" / "manifest.json")) for n in (1, 2))
    assert m1["splits"] == m2["splits"]


def shard_overhead(directory):
    """(bytes of the shard files ÷ bytes of the target tokens they hold) of a shard directory, from the files."""
    m = json.load(open(os.path.join(directory, "manifest.json")))
    itemsize = 2 if m["dtype"] == "uint16" else 4
    files = sum(os.path.getsize(os.path.join(directory, s["name"])) for split in m["splits"].values()
                for s in split["shards"])
    return files / sum(split["tokens"] * itemsize for split in m["splits"].values())


def test_overhead_of_the_shard_format(hf_tok, tmp_path, capsys):
    """Shard bytes ÷ token bytes (seq_len ids of 2 bytes a sample), measured on the files written: ≤ 1.05 at n 2048
    (50 samples a shard) and ≤ 1.25 at n 128 (the default 1000 samples a shard). Format 1 paid a header per sample:
    1.51 and 8.14 (issue 34)."""
    (tmp_path / "c.txt").write_text("\n".join(paragraphs(count=6000)) + "\n")
    ratios = {}
    for n, per_shard in ((2048, 50), (128, 1000)):
        assert make("--input", tmp_path / "c.txt", "--tokenizer", hf_tok, "--out", tmp_path / f"n{n}",
                    "--seq-len", n, "--samples-per-shard", per_shard, "--val-fraction", 0.01) == 0
        ratios[n] = shard_overhead(tmp_path / f"n{n}")
    with capsys.disabled():
        print(f"\nshard bytes / token bytes: n 2048 {ratios[2048]:.4f}, n 128 {ratios[128]:.4f}")
    assert ratios[2048] <= 1.05 and ratios[128] <= 1.25


# ---- format 1 ----

def test_format1_shards_load_and_resume_checking_sizes(tmp_path):
    m = read_manifest(FORMAT1)
    assert m["format"] == 1 and "hash" not in m["splits"]["train"]["shards"][0]
    n = m["seq_len"]
    expect = {}   # every sample, read with tarfile alone: one member per sample
    for split in m["splits"].values():
        for shard in split["shards"]:
            with tarfile.open(os.path.join(FORMAT1, shard["name"])) as tar:
                for member in tar.getmembers():
                    expect[member.name.split(".")[0]] = np.frombuffer(tar.extractfile(member).read(), dtype="<u2")
    s = TokenStream(FORMAT1, 2, n, num_workers=2)
    assert s.notes == [f"the shards in {FORMAT1} are of manifest format 1, without content hashes: checking their "
                       f"sizes only (data.verify=size); rebuild them with tools/make_shards.py to have them hashed"]
    assert TokenStream(FORMAT1, 2, n, verify="size").notes == []
    it = iter(s)
    straight = [next(it) for _ in range(30)]   # past one epoch of 51 train samples
    for batch in straight:
        for key, row in zip(batch["ids"], batch["tokens"]):
            assert (row.numpy() == expect[key]).all()
    assert {k for b in straight for k in b["ids"]} == {k for k in expect if k.startswith("train-")}
    first = TokenStream(FORMAT1, 2, n, num_workers=2)
    it = iter(first)
    head = [next(it) for _ in range(11)]
    again = TokenStream(FORMAT1, 2, n, num_workers=2)
    again.load_state_dict(json.loads(json.dumps(first.state_dict())))
    it = iter(again)
    got = head + [next(it) for _ in range(19)]
    assert [b["ids"] for b in got] == [b["ids"] for b in straight]
    val = [i for b in s.val_batches() for i in b["ids"]]
    assert val[:5] == [f"val-000000-{k:06d}" for k in range(5)]


def test_format1_checkpoint_state_without_bad_shards_read_loads():
    """A data position saved by the code before format 2 and canonical streams (a count of micro-batches, no shards
    found bad while reading) resumes in the old order, on format-1 shards."""
    s = TokenStream(FORMAT1, 2, 16)
    s.load_state_dict({"consumed_batches": 3, "dp_rank": 0, "dp_world": 1, "num_workers": 0, "micro_batch_size": 2,
                       "seq_len": 16, "seed": 0, "mix_shards": 4})
    assert s.legacy_order and next(iter(s))["tokens"].shape == (2, 17)


# ---- a whole run with a Hugging Face tokenizer ----

@pytest.mark.slow
def test_hugging_face_tokenizer_end_to_end(hf_tok, tmp_path, capsys):
    """An AutoTokenizer directory (the test's byte-level BPE saved by transformers) makes the shards; the trainer
    trains (model.vocab_size 512 above its 400 ids: padding, noted in the log), validates, logs a text sample; the
    release's generate.py, evaluate.py (bits per byte from the decoded text), the Hugging Face export (its
    AutoTokenizer gives the training ids) and lm-eval on the shipped tasks all use that tokenizer."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from tests.support.runs import launch, write_config
    from tools import evaluate, generate

    def command(main, *args):   # a command's main in this process (no interpreter start): its stdout
        capsys.readouterr()
        assert main([*map(str, args)]) == 0, capsys.readouterr().err[-2000:]
        return capsys.readouterr().out

    directory = tmp_path / "tok"
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(hf_tok), eos_token=EOS).save_pretrained(directory)
    docs = newline_documents(300)
    write_jsonl(tmp_path / "docs.jsonl", [{"text": d} for d in docs])
    shards, run, release, hf = (tmp_path / name for name in ("shards", "run", "release", "hf"))
    tool("make_shards.py", "--input", tmp_path / "docs.jsonl", "--tokenizer", directory, "--out", shards,
         "--seq-len", 32, "--samples-per-shard", 8, "--val-fraction", 0.05, "--quiet")
    m = read_manifest(str(shards))
    assert (m["tokenizer"], m["tokenizer_kind"], m["vocab_size"]) == ("tokenizer.json", "huggingface", 400)
    cfg = write_config(tmp_path / "c.yaml", str(shards), run, model={"vocab_size": 512},
                       train={"max_steps": 6, "global_batch_size": 4, "micro_batch_size": 4},
                       checkpoint={"every": 6}, logging={"image_every": 3, "sample_tokens": 4})
    out = launch(cfg, 1).stdout
    assert "model.vocab_size=512 is above the tokenizer's 400 ids" in out and "ids 400..511 are padding" in out
    assert "validation at step 6" in out and "sample: " in out
    tool("convert.py", "to-release", run, release, "--quiet")
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(release))
    tool("convert.py", "to-hf", release, hf)
    auto, tok = AutoTokenizer.from_pretrained(str(hf)), Tokenizer.from_file(str(shards / "tokenizer.json"))
    for text in docs[:8]:
        assert auto(text).input_ids == tok.encode(text, add_special_tokens=False).ids
    assert auto.eos_token_id == m["eos_id"] == json.load(open(hf / "config.json"))["eos_token_id"]
    assert len(json.loads(command(generate.main, release, "--max-new-tokens", 6, "--quiet", "--json"))["ids"]) == 6
    r = json.loads(command(evaluate.main, release, "--shards", shards, "--json", "--quiet"))
    # bytes of the decoded text of the val targets, by hand: each eos one byte (a document boundary)
    val, expect = [], 0
    for shard in m["splits"]["val"]["shards"]:
        with tarfile.open(shards / shard["name"]) as tar:
            (member,) = tar.getmembers()
            val += list(np.frombuffer(tar.extractfile(member).read(), "<u2").reshape(-1, 33))
    for row in val:
        text = tok.decode(row.tolist(), skip_special_tokens=False)
        first = tok.decode(row[:1].tolist(), skip_special_tokens=False)
        expect += len(text.encode()) - len(first.encode()) - (len(EOS) - 1) * int((row[1:] == m["eos_id"]).sum())
    assert (r["tokens"], r["bytes"]) == (len(val) * 32, expect) and r["bits_per_byte"] > 0
    r = json.loads(command(evaluate.main, release, "--text", tmp_path / "docs.jsonl", "--json", "--quiet"))
    assert r["bytes"] == sum(len(d.encode()) + 1 for d in docs)   # the documents, newlines kept, + one eos each
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")}
    r = run_py([PY, os.path.join(ROOT, "tools", "run_lm_eval.py"), "--model", "synthformer", "--model_args",
                f"path={release},newline=text", "--tasks", "austen_cloze,austen_mc4", "--limit", "2", "--batch_size",
                "4"], cwd=tmp_path, env=env, timeout=300)
    assert r.returncode == 0 and "austen_mc4" in r.stdout, r.stderr[-3000:]
