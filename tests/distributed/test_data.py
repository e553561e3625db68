"""The data path of issue #3: tokenizer and shard tools, and the streaming, resumable loader (tokendata/stream.py).

Real files in tmp dirs, the real tools run as subprocesses, real webdataset tars, real DataLoader worker processes.
"""

import collections
import gzip
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tarfile

import numpy as np
import pytest
import sentencepiece as spm
import torch
import xxhash

from model.config import ConfigError
from pretrain.config import load_config
from tokendata.stream import TokenStream, merged_state
from tokendata.shard_files import folder_for
from tokendata.shards import DataError, check_vocab, read_manifest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CORPUS = os.path.join(ROOT, "data", "austen.txt.gz")
SEQ, VOCAB, PER_SHARD, B = 32, 512, 50, 4


def run_tool(name, *args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", name), *map(str, args), "--quiet"],
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="session")
def built(tmp_path_factory):
    """~250 KB of Austen -> a 512-piece tokenizer -> seq_len 32 shards of 50 samples (about 70 train shards)."""
    tmp = tmp_path_factory.mktemp("data")
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        lines, size = [], 0
        for line in f:
            lines.append(line)
            size += len(line)
            if size > 250_000:
                break
    text = tmp / "corpus.txt"
    text.write_text("".join(lines), encoding="utf-8")
    tok = tmp / "tok" / "tokenizer.model"
    r = run_tool("train_tokenizer.py", "--input", text, "--vocab-size", VOCAB, "--out", tok)
    assert r.returncode == 0, r.stderr
    shards = tmp / "shards"
    r = run_tool("make_shards.py", "--input", text, "--tokenizer", tok, "--out", shards, "--seq-len", SEQ,
                 "--samples-per-shard", PER_SHARD, "--val-fraction", 0.05, "--seed", 7)
    assert r.returncode == 0, r.stderr
    return {"dir": str(shards), "text": text, "tok": tok, "docs": [l.strip() for l in lines if l.strip()],
            "stdout": r.stdout, "manifest": read_manifest(str(shards))}


def tar_samples(path):
    """(key, token array) of every sample in a shard of format 2, read with tarfile alone (independent of the
    loader): its one member holds the samples back to back."""
    with tarfile.open(path) as tar:
        (member,) = tar.getmembers()
        stem, ext = member.name.split(".", 1)
        assert ext == "tokens.u16" and stem == os.path.basename(path)[:-len(".tar")], member.name
        ids = np.frombuffer(tar.extractfile(member).read(), dtype="<u2").reshape(-1, SEQ + 1)
    return [(f"{stem}-{k:06d}", row) for k, row in enumerate(ids)]


def stream(built, **kw):
    args = dict(micro_batch_size=B, seq_len=SEQ, dp_rank=0, dp_world=1, num_workers=0, seed=0)
    args.update(kw)
    return TokenStream(built["dir"], **args)


def take(s, n):
    it = iter(s)
    return [next(it) for _ in range(n)]


def one_line(exc_info, *needles):
    msg = str(exc_info.value)
    assert "\n" not in msg, msg
    for needle in needles:
        assert str(needle) in msg, (needle, msg)
    return msg


# ---- tools ----

def test_make_shards_manifest_matches_tars(built):
    m, d = built["manifest"], built["dir"]
    assert (m["format"], m["seq_len"], m["vocab_size"], m["dtype"], m["hash"]) == (2, SEQ, VOCAB, "uint16", "xxh3_128")
    assert (m["tokenizer"], m["tokenizer_kind"]) == ("tokenizer.model", "sentencepiece")
    all_ids = []
    for split in ("train", "val"):
        info = m["splits"][split]
        assert len(info["shards"]) >= (40 if split == "train" else 2)
        for shard in info["shards"]:
            samples = tar_samples(os.path.join(d, shard["name"]))
            assert len(samples) == shard["samples"] and shard["first_id"] == samples[0][0]
            assert shard["bytes"] == os.path.getsize(os.path.join(d, shard["name"]))
            assert shard["hash"] == xxhash.xxh3_128_hexdigest(open(os.path.join(d, shard["name"]), "rb").read())
            assert all(len(tokens) == SEQ + 1 for _, tokens in samples)
            all_ids += [key for key, _ in samples]
        assert info["samples"] == sum(s["samples"] for s in info["shards"]) and info["tokens"] == info["samples"] * SEQ
    assert len(all_ids) == len(set(all_ids)) == m["splits"]["train"]["samples"] + m["splits"]["val"]["samples"]
    assert {f for f in os.listdir(d) if f.endswith(".tar")} == {
        s["name"] for split in m["splits"].values() for s in split["shards"]}
    copy = os.path.join(d, m["tokenizer"])
    assert open(copy, "rb").read() == open(built["tok"], "rb").read()
    assert hashlib.sha256(open(copy, "rb").read()).hexdigest() == m["tokenizer_sha256"]
    assert "MB/s" in built["stdout"] and "tokens/s" in built["stdout"]


def test_shard_tokens_decode_to_corpus_text(built):
    sp = spm.SentencePieceProcessor(model_file=str(built["tok"]))
    corpus = "\n".join(built["docs"])
    d, m = built["dir"], built["manifest"]
    samples = tar_samples(os.path.join(d, m["splits"]["train"]["shards"][3]["name"]))
    pieces = 0
    for _, tokens in samples:
        ids = tokens.tolist()
        cut = [-1] + [i for i, t in enumerate(ids) if t == sp.eos_id()] + [len(ids)]
        for a, b in zip(cut, cut[1:]):  # eos separates documents: each run of ids lies inside one document
            text = sp.decode(ids[a + 1 : b])
            if len(text) > 3:
                assert text in corpus, text
                pieces += 1
    assert pieces >= len(samples)
    # windows are taken with stride seq_len, so neighbours in the stream share their boundary token; neighbours in a
    # shard are stream neighbours unless a val sample fell between them (5%)
    shared = sum(int(a[-1]) == int(b[0]) for (_, a), (_, b) in zip(samples, samples[1:]))
    assert shared >= 0.8 * (len(samples) - 1)


def test_tokenizer_is_deterministic_and_lossless(built, tmp_path):
    out = tmp_path / "again.model"
    r = run_tool("train_tokenizer.py", "--input", built["text"], "--vocab-size", VOCAB, "--out", out)
    assert r.returncode == 0, r.stderr
    assert out.read_bytes() == built["tok"].read_bytes()
    sp = spm.SentencePieceProcessor(model_file=str(out))
    assert (sp.vocab_size(), sp.bos_id(), sp.eos_id()) == (VOCAB, 1, 2)
    odd = "Tschüß  —  日本語 \t 42"
    assert sp.decode(sp.encode(odd)) == odd and sp.unk_id() not in sp.encode(odd)  # byte fallback: no <unk>


@pytest.mark.parametrize("tool", ["train_tokenizer.py", "make_shards.py"])
def test_tools_missing_input_is_one_line(tool, built, tmp_path):
    missing = tmp_path / "no_such.txt.gz"
    extra = (["--vocab-size", VOCAB] if tool == "train_tokenizer.py"
             else ["--tokenizer", built["tok"], "--seq-len", SEQ])
    r = run_tool(tool, "--input", missing, "--out", tmp_path / "out", *extra)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == f"error: input file not found: {missing}"
    assert run_tool(tool, "--help").returncode == 0


# ---- loader ----

def global_batches(streams, steps):
    """Each of the next `steps` global batches as read by these streams (one per data-parallel rank, in rank order):
    (ids, tokens) in order."""
    its, out = [iter(s) for s in streams], []
    for _ in range(steps):
        batches = [next(it) for s, it in zip(streams, its) for _ in range(s.grad_accum)]
        out.append(([i for b in batches for i in b["ids"]], torch.cat([b["tokens"] for b in batches]).tolist()))
    return out


def read_epochs(s, epochs=1):
    """(the sample ids of the global batches that hold the first `epochs` epochs of the one source, the micro-batches
    read), by one stream (one rank): the order draws a source's epoch e as its draws e·n … (e+1)·n − 1."""
    n = sum(count for _, count in s.orders[0].shards)
    steps = -(-epochs * n // s.global_batch_size)
    batches = take(s, steps * s.grad_accum)
    return [[i for b in batches[g * s.grad_accum:(g + 1) * s.grad_accum] for i in b["ids"]] for g in range(steps)], \
        batches


def assert_epochs(batches, expected, epochs=1):
    """The first `epochs` epochs of a source are each of its samples `epochs` times: over the global batches that
    hold them, every sample `epochs` times, and once more only as many as the last batch took of the next epoch."""
    seen = collections.Counter(i for ids in batches for i in ids)
    assert set(seen) == set(expected), set(seen) ^ set(expected)
    assert set(seen.values()) <= {epochs, epochs + 1}, collections.Counter(seen.values())
    assert sum(seen.values()) - epochs * len(expected) < len(batches[-1])


def test_one_epoch_two_ranks_two_workers_sees_every_sample_once(built):
    streams = [stream(built, dp_rank=rank, dp_world=2, num_workers=2, global_batch_size=32, canonical_streams=8)
               for rank in range(2)]
    assert [(s.lo, s.hi, s.grad_accum) for s in streams] == [(0, 16, 4), (16, 32, 4)]
    n = built["manifest"]["splits"]["train"]["samples"]
    batches = [ids for ids, _ in global_batches(streams, -(-n // 32))]
    assert_epochs(batches, split_ids(built, "train"))


def test_worker_batches_are_pickled_not_shared_file_descriptors(built):
    # a tensor from a worker arrives as shared memory whose file descriptor a thread of the worker serves: a rank
    # killed in mid-handover (kill -9) made that thread print a traceback (seen in CI). Pickled numpy tokens need no such thread.
    batches = take(stream(built, num_workers=2), 3)
    assert all(b["tokens"].dtype == torch.int64 and not b["tokens"].is_shared() for b in batches)


def test_resume_is_exact_in_its_own_layout_and_goes_on_in_another(built):
    settings = dict(global_batch_size=16, canonical_streams=8)
    straight = global_batches([stream(built, micro_batch_size=8, **settings)], 12)   # 1 rank, in the process
    assert len({i for ids, _ in straight for i in ids}) == 12 * 16
    first = [stream(built, dp_rank=r, dp_world=2, num_workers=2, **settings) for r in range(2)]
    assert global_batches(first, 5) == straight[:5]
    # what a checkpoint keeps must survive serialization; counted at hand-over, not what the workers prefetched
    states = [json.loads(json.dumps(s.state_dict())) for s in first]
    assert states[0]["samples"] == 5 * 16 and states[0]["micro_batches"] == 0
    same = lambda state: {k: v for k, v in state.items() if k != "layout"}  # noqa: E731
    assert same(states[0]) == same(states[1])   # the position is the same on every rank
    again = stream(built, dp_rank=1, dp_world=2, num_workers=2, **settings)   # the same layout, rank 1
    again.load_state_dict(states[1])
    rank1 = global_batches([again], 7)
    assert [b[0] for b in rank1] == [ids[8:] for ids, _ in straight[5:12]]
    assert [b[1] for b in rank1] == [tokens[8:] for _, tokens in straight[5:12]]
    later = [stream(built, micro_batch_size=1, dp_rank=r, dp_world=4, num_workers=1, **settings) for r in range(4)]
    for s in later:   # another layout: 4 ranks, 1 worker, micro-batch 1 (4 a step)
        s.load_state_dict(merged_state(states))
    assert global_batches(later, 7) == straight[5:12]
    assert str(straight[0][1][0][0]).isdigit() and len(straight[0][1][0]) == SEQ + 1


def test_resume_across_an_epoch_boundary(built):
    settings = dict(dp_rank=1, dp_world=2, num_workers=2, global_batch_size=16, canonical_streams=8)
    s = stream(built, **settings)
    boundary = built["manifest"]["splits"]["train"]["samples"] // 16   # the global batch that starts epoch 1
    straight = take(s, (boundary + 6) * s.grad_accum)
    assert s.progress()[0]["epochs"] > 1
    first = stream(built, **settings)
    take(first, (boundary - 5) * s.grad_accum)
    again = stream(built, **settings)
    again.load_state_dict(first.state_dict())
    got = take(again, 11 * s.grad_accum)
    assert [b["ids"] for b in got] == [b["ids"] for b in straight[(boundary - 5) * s.grad_accum:]]
    assert all((a["tokens"] == b["tokens"]).all() for a, b in zip(got, straight[(boundary - 5) * s.grad_accum:]))


def test_resume_without_workers_and_a_second_iterator_continues(built):
    straight = take(stream(built), 9)
    s = stream(built)
    got = take(s, 4) + take(s, 5)  # a fresh iter() on the same stream continues where the last one stopped
    assert [b["ids"] for b in got] == [b["ids"] for b in straight]
    old = iter(s)
    next(old)
    iter(s)  # a newer iterator makes the old one stale rather than letting both advance the position
    with pytest.raises(RuntimeError):
        next(old)


def test_a_stream_stopped_inside_a_global_batch_resumes_in_its_own_layout_only(built):
    settings = dict(global_batch_size=16, canonical_streams=4)
    straight = take(stream(built, **settings), 12)   # micro-batches of 4: 4 a global batch
    first = stream(built, **settings)
    take(first, 6)
    state = first.state_dict()
    assert state["samples"] == 16 and state["micro_batches"] == 2
    again = stream(built, **settings)
    again.load_state_dict(state)
    assert [b["ids"] for b in take(again, 6)] == [b["ids"] for b in straight[6:]]
    with pytest.raises(DataError) as e:
        stream(built, micro_batch_size=8, **settings).load_state_dict(state)
    one_line(e, "inside a global batch", "resume it in that layout")


def test_shuffling_is_seeded_per_epoch(built):
    one = [b["ids"] for b in take(stream(built, seed=0), 10)]
    assert one == [b["ids"] for b in take(stream(built, seed=0), 10)]
    assert one != [b["ids"] for b in take(stream(built, seed=1), 10)]
    s = stream(built, micro_batch_size=16, canonical_streams=1)   # one stream: draws in order, epoch after epoch
    n = built["manifest"]["splits"]["train"]["samples"]
    ids = [i for g in read_epochs(s, epochs=2)[0] for i in g]
    e0, e1 = ids[:n], ids[n:2 * n]
    assert len(e0) == len(e1) == n and sorted(e0) == sorted(e1) == sorted(split_ids(built, "train")) and e0 != e1
    assert s.orders[0].epoch(0)[0] != s.orders[0].epoch(1)[0]   # the shards, shuffled anew each epoch
    # samples are shuffled, not just shards: few neighbours in the stream are neighbours in a shard
    pos = [tuple(map(int, i.split("-")[1:])) for i in e0]
    adjacent = sum(a[0] == b[0] and b[1] == a[1] + 1 for a, b in zip(pos, pos[1:]))
    assert adjacent < n // 20


def test_validation_batches_are_fixed_and_equal_per_rank(built):
    val = built["manifest"]["splits"]["val"]
    runs = [list(stream(built, dp_rank=r, dp_world=2).val_batches()) for r in range(2)]
    assert len(runs[0]) == len(runs[1]) > 0
    assert [b["ids"] for b in runs[0]] == [b["ids"] for b in stream(built, dp_rank=0, dp_world=2).val_batches()]
    # rank 0 then rank 1 read the split in manifest order, once, and the last rank wraps round to fill its share
    ids = [i for run in runs for b in run for i in b["ids"]]
    ordered = [f"{s['name'][:-4]}-{k:06d}" for s in val["shards"] for k in range(s["samples"])]
    assert len(ids) >= len(ordered) and ids == (ordered * 2)[: len(ids)]
    capped = list(stream(built, dp_rank=1, dp_world=2).val_batches(max_batches=3))
    assert [b["ids"] for b in capped] == [b["ids"] for b in runs[1][:3]]


def legacy_state(consumed, **layout):
    """A data state as checkpoints wrote it before canonical streams (tests/data/pre_redesign has a real one)."""
    return {"consumed_batches": consumed, **dict(dp_rank=0, dp_world=2, num_workers=2, micro_batch_size=B,
                                                 seq_len=SEQ, seed=0, mix_shards=4), **layout}


def test_an_old_data_state_resumes_the_old_order_in_its_own_layout_only(built):
    kw = dict(dp_rank=1, dp_world=2, num_workers=2)
    straight = stream(built, **kw)
    straight.load_state_dict(legacy_state(0, dp_rank=1))
    batches = take(straight, 12)
    assert straight.legacy_order and straight.state_dict()["consumed_batches"] == 12
    # the old order: rank 1 of 2 reads shards[1::2] of each epoch's list, its worker w those [w::2], a batch each
    order = list(straight.train)
    random.Random("0/0").shuffle(order)
    first_worker = {n[:-4] for n, _ in order[1::2][0::2][:4]}
    assert {i.rsplit("-", 1)[0] for i in batches[0]["ids"]} <= first_worker
    again = stream(built, **kw)
    again.load_state_dict(json.loads(json.dumps(legacy_state(5, dp_rank=1))))
    assert [b["ids"] for b in take(again, 7)] == [b["ids"] for b in batches[5:]]
    for change, value in (("dp_world", 4), ("num_workers", 1), ("micro_batch_size", 8)):
        kw = dict(dict(dp_rank=0, dp_world=2, num_workers=2), **{change: value})
        with pytest.raises(DataError) as e:
            stream(built, **kw).load_state_dict(legacy_state(3))
        one_line(e, f"{change}={legacy_state(3)[change]}", f"{change}={value}", "before canonical streams",
                 "checkpoint.relayout=true")


def test_an_old_data_state_resumes_exactly_past_a_shard_found_bad_while_reading(built, tmp_path):
    """In the old order too, a shard found bad while reading (skip) is recorded in the data state and counted empty
    when a resumed stream finds its position: the resumed stream gives the uninterrupted one's batches."""
    d, path = damaged_copy(built, tmp_path, "flipped")
    name = os.path.basename(path)
    kw = dict(micro_batch_size=B, seq_len=SEQ, dp_rank=0, dp_world=1, num_workers=0, seed=0, bad_shards="skip")
    old = legacy_state(0, dp_world=1, num_workers=0)
    straight = TokenStream(d, **kw)
    straight.load_state_dict(old)
    n = sum(x["samples"] for x in built["manifest"]["splits"]["train"]["shards"]) // B
    batches = take(straight, n)
    found = next(j for j, b in enumerate(batches) if b["skipped_shards"])
    first = TokenStream(d, **kw)
    first.load_state_dict(old)
    take(first, found + 2)
    state = json.loads(json.dumps(first.state_dict()))
    assert state["bad_shards_read"] == [name] and state["consumed_batches"] == found + 2
    again = TokenStream(d, **kw)
    again.load_state_dict(state)
    assert [b["ids"] for b in take(again, n - found - 2)] == [b["ids"] for b in batches[found + 2:]]


# ---- errors: DataError, one line, naming the path or value ----

def test_missing_and_empty_shard_dirs(tmp_path):
    with pytest.raises(DataError) as e:
        TokenStream(str(tmp_path / "nope"), B, SEQ)
    one_line(e, tmp_path / "nope", "does not exist")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError) as e:
        TokenStream(str(tmp_path / "empty"), B, SEQ)
    one_line(e, tmp_path / "empty", "empty")


def test_malformed_manifests(built, tmp_path):
    good = built["manifest"]
    cases = {"notjson": "{not json", "noseq": {k: v for k, v in good.items() if k not in ("seq_len", "shard_dir")},
             "badcount": dict({k: v for k, v in good.items() if k != "shard_dir"},
                              splits={"train": dict(good["splits"]["train"], samples=1)})}
    for name, content in cases.items():
        d = tmp_path / name
        d.mkdir()
        (d / "manifest.json").write_text(content if isinstance(content, str) else json.dumps(content))
        with pytest.raises(DataError) as e:
            read_manifest(str(d))
        one_line(e, d / "manifest.json", "malformed")
    d = tmp_path / "nomanifest"
    shutil.copytree(built["dir"], d)
    os.remove(d / "manifest.json")
    with pytest.raises(DataError) as e:
        TokenStream(str(d), B, SEQ)
    one_line(e, d, "no manifest.json")


def test_seq_len_vocab_and_shard_count_errors(built):
    with pytest.raises(DataError) as e:   # samples are cut or joined to lengths that divide or that SEQ divides
        TokenStream(built["dir"], B, SEQ + SEQ // 2)
    one_line(e, built["dir"], f"{SEQ} tokens", f"model.max_seq_len={SEQ + SEQ // 2}", "neither divides")
    assert check_vocab(built["manifest"], VOCAB) is None
    note = check_vocab(built["manifest"], 640)   # padded (tensor parallelism splits 640 evenly): a note, no error
    assert "model.vocab_size=640" in note and f"ids {VOCAB}..639 are padding" in note
    with pytest.raises(DataError) as e:
        check_vocab(built["manifest"], 300)
    one_line(e, f"vocab_size={VOCAB}", "model.vocab_size=300", "tokenizer.model", "rebuild the shards")
    with pytest.raises(DataError) as e:
        TokenStream(built["dir"], B, SEQ, global_batch_size=16, canonical_streams=17)
    one_line(e, "data.canonical_streams=17 must be between 1 and train.global_batch_size=16")
    s = TokenStream(built["dir"], 1, SEQ, dp_world=2, num_workers=8, global_batch_size=8, canonical_streams=4)
    assert s.workers == 4 and "4 workers read them" in s.notes[0]   # a worker reads whole streams


def test_no_val_shards(built, tmp_path):
    d = tmp_path / "noval"
    shutil.copytree(built["dir"], d)
    m = json.loads((d / "manifest.json").read_text())
    m["splits"]["val"] = {"samples": 0, "tokens": 0, "shards": []}
    (d / "manifest.json").write_text(json.dumps(m))
    s = TokenStream(str(d), B, SEQ)
    with pytest.raises(DataError) as e:
        s.val_batches()
    one_line(e, d, "split 'val'")


def test_a_data_state_refuses_another_order(built):
    saved = stream(built, dp_world=2, num_workers=2, global_batch_size=16)
    take(saved, 3)
    state = saved.state_dict()
    for change, value, key in (("canonical_streams", 8, "data.canonical_streams=16"), ("seed", 5, "data.seed=0")):
        with pytest.raises(DataError) as e:
            stream(built, global_batch_size=16, **{change: value}).load_state_dict(state)
        one_line(e, key, str(value), "the samples of every global batch depend on it")


# ---- bad shards: named, then fatal or skipped (data.bad_shards) ----

def damaged_copy(built, tmp_path, how, split="train", index=3):
    """A copy of the shard directory with one shard damaged; returns (directory, path of that shard)."""
    d = tmp_path / f"{how}-{split}"
    shutil.copytree(built["dir"], d)
    path = str(d / built["manifest"]["splits"][split]["shards"][index]["name"])
    if how == "missing":
        os.remove(path)
    elif how == "truncated":
        os.truncate(path, os.path.getsize(path) // 2)
    elif how == "empty":
        open(path, "wb").close()
    elif how == "corrupt-header":  # garbage over the middle of the member's 512-byte header: its checksum fails
        with open(path, "r+b") as f:
            f.seek(100)
            f.write(bytes(range(200)))
    else:  # "flipped": one bit of one token id of sample 2 (past the 512-byte header), the size unchanged
        with open(path, "r+b") as f:
            f.seek(512 + 2 * (SEQ + 1) * 2 + 6)
            byte = f.read(1)[0]
            f.seek(-1, 1)
            f.write(bytes([byte ^ 0x01]))
    return str(d), path


def split_ids(built, split, exclude=()):
    """Every sample id of a split in manifest order, built from first_id and samples (not by reading the tars)."""
    return [f"{s['first_id'].rsplit('-', 1)[0]}-{k:06d}" for s in built["manifest"]["splits"][split]["shards"]
            if s["name"] not in exclude for k in range(s["samples"])]


@pytest.mark.parametrize("how", ["truncated", "empty", "missing"])
def test_a_bad_shard_size_is_found_when_read_and_fails_or_is_skipped(built, tmp_path, capfd, how):
    """Nothing is checked before training but the manifest: a shard cut short, empty or missing is found when a batch
    needs it, and fails in one line or (skip) is replaced, reported once, and resumed past exactly."""
    d, path = damaged_copy(built, tmp_path, how)
    name = os.path.basename(path)
    s = TokenStream(d, B, SEQ, global_batch_size=16)
    assert s.skipped_shards == []   # nothing dropped before reading
    with pytest.raises(DataError) as e:
        read_epochs(s)
    why = {"truncated": "bytes, manifest.json says", "empty": "is empty (0 bytes)", "missing": ": not found"}[how]
    one_line(e, path, why, "data.bad_shards=skip")
    settings = dict(bad_shards="skip", global_batch_size=16)
    batches, micro = read_epochs(TokenStream(d, B, SEQ, **settings))
    seen = collections.Counter(i for ids in batches for i in ids)   # its draws take other samples of their window
    assert set(seen) == set(split_ids(built, "train", exclude={name})) and sum(seen.values()) - len(seen) < PER_SHARD + 16
    assert max(collections.Counter(i for ids in batches[:-1] for i in ids).values()) == 2   # (the last batch also
                                                                                           # holds the next epoch's)
    assert [p for b in micro for p in b["skipped_shards"]] == [path] and path in capfd.readouterr().err
    # the same files give the same order, so a resume is exact, and the position keeps the shard out
    first = TokenStream(d, B, SEQ, **settings)
    take(first, 5 * 4)
    again = TokenStream(d, B, SEQ, **settings)
    again.load_state_dict(first.state_dict())
    assert [b["ids"] for b in take(again, 16)] == [b["ids"] for b in micro[20:36]]


@pytest.mark.parametrize("how,verify", [("corrupt-header", "size"), ("flipped", "hash")])
def test_corrupt_shard_fails_or_is_skipped_while_reading(built, tmp_path, capfd, how, verify):
    """A damaged header is found by tar's checksum (data.verify=size); a flipped bit in a token, by the content hash
    (the default, hash), which names both hashes."""
    d, path = damaged_copy(built, tmp_path, how)
    name = os.path.basename(path)
    assert TokenStream(d, B, SEQ, verify=verify).skipped_shards == []  # the size is right: found only when read
    counts = dict((x["name"], x["samples"]) for x in built["manifest"]["splits"]["train"]["shards"])
    want = built["manifest"]["splits"]["train"]["shards"][3]["hash"]
    for workers in (0, 2):
        with pytest.raises(DataError) as e:  # a worker's DataError arrives as one line, not its traceback
            take(TokenStream(d, B, SEQ, num_workers=workers, verify=verify), sum(counts.values()) // B + 1)
        assert type(e.value) is DataError
        got = xxhash.xxh3_128_hexdigest(open(path, "rb").read())
        one_line(e, path, *(["unreadable (ReadError"] if how == "corrupt-header" else
                             ["content hash", f"xxh3_128:{got}", f"manifest.json says xxh3_128:{want}"]),
                 "data.bad_shards=skip")
    capfd.readouterr()
    settings = dict(bad_shards="skip", global_batch_size=16, canonical_streams=8, verify=verify)
    s = TokenStream(d, B, SEQ, num_workers=2, **settings)
    epoch, batches = read_epochs(s)
    err = capfd.readouterr().err
    warnings = [line for line in err.splitlines() if line.startswith("warning: ")]
    # once per worker whose streams read the shard (a worker may be read ahead: prefetched batches are not taken)
    assert warnings and all(path in line for line in warnings)
    reported = [p for b in batches for p in b["skipped_shards"]]
    assert set(reported) == {path} and len(reported) <= len(warnings)
    seen = collections.Counter(i for ids in epoch for i in ids)   # its draws take other samples of their windows
    assert set(seen) == set(split_ids(built, "train", exclude={name}))
    assert max(collections.Counter(i for ids in epoch[:-1] for i in ids).values()) == 2
    assert not any(i.startswith(name[: -len(".tar")]) for b in take(s, 40) for i in b["ids"])   # nor later
    # the position records the shard found bad: a resume after it is exact, in the same layout and in another
    A, k = s.grad_accum, len(batches) // s.grad_accum - 3
    first = TokenStream(d, B, SEQ, num_workers=2, **settings)
    take(first, k * A)
    state = first.state_dict()
    assert state["bad_read"] == [[name]]
    straight = [([i for b in batches[g * A:(g + 1) * A] for i in b["ids"]],
                 torch.cat([b["tokens"] for b in batches[g * A:(g + 1) * A]]).tolist()) for g in range(k, k + 3)]
    again = TokenStream(d, B, SEQ, num_workers=2, **settings)
    again.load_state_dict(state)
    assert global_batches([again], 3) == straight
    ranks = [TokenStream(d, B, SEQ, dp_rank=r, dp_world=2, num_workers=1, **settings) for r in range(2)]
    for r in ranks:
        r.load_state_dict(merged_state([state]))
    assert global_batches(ranks, 3) == straight


def test_a_flipped_token_is_found_by_the_hash_not_by_the_size(built, tmp_path):
    """Under data.verify=size the flipped bit reaches a batch as a wrong token id; under hash (the default) the shard
    is read twice and then refused."""
    d, path = damaged_copy(built, tmp_path, "flipped")
    key = os.path.basename(path)[:-len(".tar")] + "-000002"
    original = dict(tar_samples(os.path.join(built["dir"], os.path.basename(path))))[key]
    n = built["manifest"]["splits"]["train"]["samples"] // B + 1
    rows = {k: row for b in take(TokenStream(d, B, SEQ, verify="size"), n) for k, row in zip(b["ids"], b["tokens"])}
    assert (rows[key].numpy() != original).sum() == 1   # trained on silently: one token id off by one bit
    with pytest.raises(DataError) as e:
        take(TokenStream(d, B, SEQ), n)
    one_line(e, path, "content hash", "(read twice)")


def test_a_damaged_cached_copy_is_fetched_again_past_the_cache_and_replaced(built, tmp_path):
    """data.cache_dir holds a copy with a flipped bit: the hash fails, the shard is read again from its source
    (past the cache), the batch is right, and the good copy replaces the damaged one."""
    cache, source = tmp_path / "cache", f"file://{built['dir']}"   # a URL: a local directory is read in place
    n = built["manifest"]["splits"]["train"]["samples"] // B
    straight = take(TokenStream(source, B, SEQ, cache_dir=str(cache)), n)
    name = built["manifest"]["splits"]["train"]["shards"][3]
    copy = cache / folder_for(source) / f"{name['name']}.{name['bytes']}"
    good = copy.read_bytes()
    damaged = bytearray(good)
    damaged[512 + 7] ^= 0x01
    copy.write_bytes(bytes(damaged))
    again = take(TokenStream(source, B, SEQ, cache_dir=str(cache)), n)
    assert [b["ids"] for b in again] == [b["ids"] for b in straight]
    assert all((a["tokens"] == b["tokens"]).all() for a, b in zip(again, straight))
    assert copy.read_bytes() == good


@pytest.mark.parametrize("found", ["before", "after"])
def test_resume_is_exact_with_a_shard_found_bad_while_reading(built, tmp_path, found):
    """A shard whose hash fails gives no samples wherever it is read (its draws take other samples of their windows),
    and the stream remembers the ones its batches reported: resumed before or after the batch that reported it, the batches are the uninterrupted run's."""
    d, path = damaged_copy(built, tmp_path, "flipped")
    kw = dict(num_workers=2, bad_shards="skip")
    s = TokenStream(d, B, SEQ, **kw)
    _, straight = read_epochs(s, epochs=2)
    reported = next(j for j, b in enumerate(straight) if b["skipped_shards"])
    assert straight[reported]["skipped_shards"] == [path] and s.state_dict()["bad_read"] == [[os.path.basename(path)]]
    cut = len(straight) - 20 if found == "after" else max(1, reported - 2)   # "after": in the next epoch
    first = TokenStream(d, B, SEQ, **kw)
    take(first, cut)
    state = json.loads(json.dumps(first.state_dict()))
    assert state["bad_read"] == [[os.path.basename(path)] if found == "after" else []]
    again = TokenStream(d, B, SEQ, **kw)
    again.load_state_dict(state)
    got = take(again, len(straight) - cut)
    assert [b["ids"] for b in got] == [b["ids"] for b in straight[cut:]]
    assert all((a["tokens"] == b["tokens"]).all() for a, b in zip(got, straight[cut:]))
    # a shard reported before the checkpoint is not opened again; one reported after it is found as before
    reports = sum(len(b["skipped_shards"]) for b in got)
    assert reports == 0 if found == "after" else reports >= 1


def test_bad_val_shard_in_validation_batches(built, tmp_path, capfd):
    d, path = damaged_copy(built, tmp_path, "flipped", split="val", index=1)
    with pytest.raises(DataError) as e:
        list(TokenStream(d, B, SEQ).val_batches())
    one_line(e, path, "content hash")
    batches = list(TokenStream(d, B, SEQ, bad_shards="skip").val_batches())
    assert path in capfd.readouterr().err
    assert [p for b in batches for p in b["skipped_shards"]] == [path]
    ids, good = [i for b in batches for i in b["ids"]], split_ids(built, "val", exclude={os.path.basename(path)})
    assert ids == (good * 2)[: len(ids)]  # manifest order with the bad shard passed over, wrapping round
    d, path = damaged_copy(built, tmp_path, "empty", split="val", index=1)   # found when read, as the train ones
    batches = list(TokenStream(d, B, SEQ, bad_shards="skip").val_batches())
    assert [p for b in batches for p in b["skipped_shards"]] == [path]
    ids = [i for b in batches for i in b["ids"]]
    assert ids == (good * 2)[: len(ids)]


def test_manifest_without_bytes_still_loads_and_names_a_short_shard(tmp_path):
    """A format-1 manifest of older code, without "bytes" (tests/data/format1, its sizes removed)."""
    d = str(shutil.copytree(os.path.join(ROOT, "tests", "data", "format1", "shards"), tmp_path / "old"))
    path = os.path.join(d, "train-000003.tar")
    os.truncate(path, os.path.getsize(path) // 2)
    m = json.loads(open(os.path.join(d, "manifest.json")).read())
    for split in m["splits"].values():
        for shard in split["shards"]:
            del shard["bytes"]
    with open(os.path.join(d, "manifest.json"), "w") as f:
        json.dump(m, f)
    s = TokenStream(d, 2, m["seq_len"])  # an older manifest: no size check, the shard is found when read
    with pytest.raises(DataError) as e:
        take(s, m["splits"]["train"]["samples"] // 2 + 1)
    one_line(e, path, "rebuild")


def test_too_many_skipped_shards_and_bad_setting(built, tmp_path):
    d = tmp_path / "fewer"
    shutil.copytree(built["dir"], d)
    shards = built["manifest"]["splits"]["train"]["shards"]
    for shard in shards[2:]:
        open(d / shard["name"], "wb").close()
    # two good shards still feed 8 streams (the others' draws take their samples): 4 workers read them
    s = TokenStream(str(d), B, SEQ, num_workers=4, bad_shards="skip", global_batch_size=8)
    ids = {i.rsplit("-", 1)[0] for b in take(s, 30) for i in b["ids"]}
    assert ids == {shard["name"][:-4] for shard in shards[:2]} and s.canonical_streams == 8
    for shard in shards[:2]:
        open(d / shard["name"], "wb").close()
    with pytest.raises(DataError) as e:
        take(TokenStream(str(d), B, SEQ, bad_shards="skip"), 1)
    one_line(e, f"every train shard in {d} is bad (see the warnings above)")
    with pytest.raises(DataError) as e:
        TokenStream(built["dir"], B, SEQ, bad_shards="maybe")
    one_line(e, "bad_shards", "fail, skip", "'maybe'")
    with pytest.raises(ConfigError) as e:
        load_config(os.path.join(ROOT, "configs", "demo-cpu.yaml"), ["data.bad_shards=maybe"])
    assert one_line(e) == "data.bad_shards='maybe' is out of range; allowed: fail, skip"
    assert load_config(os.path.join(ROOT, "configs", "demo-cpu.yaml")).data.bad_shards == "fail"


# ---- memory on a large input ----

@pytest.mark.slow
def test_make_shards_streams_a_50mb_file_in_bounded_memory(built, tmp_path):
    big = tmp_path / "big.txt"
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        lines = [l for l in f if l.strip()]
    rng = random.Random(0)
    with open(big, "w", encoding="utf-8") as f:
        while f.tell() < 50_000_000:
            rng.shuffle(lines)
            f.writelines(lines)
    size = os.path.getsize(big)
    # a wrapper process runs the tool and reports its children's peak RSS, so nothing else pytest started counts
    probe = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
             "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(r.returncode)")
    cmd = [sys.executable, "-c", probe, sys.executable, os.path.join(ROOT, "tools", "make_shards.py"), "--input", big,
           "--tokenizer", built["tok"], "--out", tmp_path / "shards", "--seq-len", 1024, "--quiet"]
    r = subprocess.run(list(map(str, cmd)), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr
    *report, peak_kb = r.stdout.strip().splitlines()
    print(f"\n{size / 1e6:.0f} MB input, peak RSS {int(peak_kb) / 1024:.0f} MB\n" + "\n".join(report))
    # ru_maxrss is in KiB on Linux. The bound is 1 GB; 768 MB leaves room over the ~330 MB measured (torch is imported
    # by webdataset), while reading the file whole and encoding it in one call peaked at 1.65 GB when measured.
    assert int(peak_kb) < 768 * 1024
    m = read_manifest(str(tmp_path / "shards"))
    assert m["splits"]["train"]["tokens"] > size / 10  # the whole file went through (about 3 bytes per token)
    assert "MB/s" in report[-1] and "tokens/s" in report[-1]
