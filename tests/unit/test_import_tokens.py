"""tools/import_tokens.py: corpora tokenized elsewhere (Megatron .bin/.idx written by megatron-core's own
IndexedDatasetBuilder, MDS written by Streaming's MDSWriter: tests/data/mds/, .npy token arrays with and without a
header) become shards whose stream is exactly the source's ids with an eos after each document, and which the
trainer's TokenStream reads."""
import os
import random

import numpy as np
import pytest
import torch
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from tokendata.shards import read_manifest, shard_samples
from tokendata.stream import TokenStream
from tools.import_tokens import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENIZER = os.path.join(ROOT, "tests", "data", "format1", "shards", "tokenizer.model")   # 320 ids, eos 2
MDS = os.path.join(ROOT, "tests", "data", "mds")
EOS, VOCAB, SEQ = 2, 320, 16


def documents(seed=0, n=40):
    rng = np.random.default_rng(seed)
    docs = [rng.integers(3, VOCAB, size=int(rng.integers(1, 50))) for _ in range(n)]
    docs[3][-1] = EOS   # ends with eos already: not doubled
    return docs


def expected_stream(docs):
    return np.concatenate([np.append(d, EOS) if d[-1] != EOS else d for d in docs])


def imported(out, *args):
    """Run the tool; the stream its shards hold (every sample, train and val, in stream order, overlaps removed)."""
    assert main(["--tokenizer", TOKENIZER, "--out", str(out), "--seq-len", str(SEQ), "--samples-per-shard", "5",
                 "--val-fraction", "0.2", "--quiet", *map(str, args)]) == 0
    m = read_manifest(str(out))
    windows = in_stream_order(m)
    return m, np.concatenate([windows[0]] + [w[1:] for w in windows[1:]])


def in_stream_order(m):
    """Every window of the shards in stream order: the seeded coin that split them (tokendata/packing.py) replayed."""
    split = {name: [ids for shard in part["shards"] for _, ids in shard_samples(m, shard)]
             for name, part in m["splits"].items()}
    coin, taken, out = random.Random(m["seed"]), {"train": 0, "val": 0}, []
    for _ in range(len(split["train"]) + len(split["val"])):
        name = "val" if coin.random() < m["val_fraction"] else "train"
        out.append(split[name][taken[name]])
        taken[name] += 1
    return out


def test_megatron_documents_and_ids_kept(tmp_path):
    docs = documents()
    builder = IndexedDatasetBuilder(str(tmp_path / "corpus.bin"), dtype=np.uint16)
    for k, d in enumerate(docs):   # every third document of two sequences (Megatron's sentence split)
        for part in np.array_split(d, 2 if k % 3 == 0 and len(d) > 1 else 1):
            builder.add_item(torch.from_numpy(part.astype(np.int64)))
        builder.end_document()
    builder.finalize(str(tmp_path / "corpus.idx"))
    m, stream = imported(tmp_path / "out", "--format", "megatron", "--input", tmp_path / "corpus")
    want = expected_stream(docs)
    assert m["dtype"] == "uint16" and m["eos_id"] == EOS
    assert np.array_equal(stream, want[:len(stream)]) and len(want) - len(stream) < SEQ
    assert np.count_nonzero(stream == EOS) == np.count_nonzero(want[:len(stream)] == EOS)


def test_mds_written_by_streaming(tmp_path):
    source = np.load(os.path.join(MDS, "source.npz"))
    docs = np.split(source["tokens"], np.cumsum(source["lengths"])[:-1])
    m, stream = imported(tmp_path / "out", "--format", "mds", "--input", os.path.join(MDS, "set"))
    want = expected_stream(docs)
    assert np.array_equal(stream, want[:len(stream)]) and len(want) - len(stream) < SEQ


@pytest.mark.parametrize("header", [True, False])
def test_npy_arrays(tmp_path, header):
    docs = documents(1)
    parts = [expected_stream(docs[:20]), expected_stream(docs[20:])[:-1]]   # the second file ends without eos
    paths = []
    for i, part in enumerate(parts):
        path = tmp_path / (f"part-{i}.npy")
        np.save(path, part.astype(np.uint32)) if header else part.astype(np.uint32).tofile(path)
        paths.append(path)
    dtype = [] if header else ["--dtype", "uint32"]
    m, stream = imported(tmp_path / "out", "--format", "npy", *dtype, "--input", *paths)
    want = expected_stream(docs)
    assert np.array_equal(stream, want[:len(stream)]) and len(want) - len(stream) < SEQ


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])   # as wide as the shards' ids (copied as they lie), or not
def test_foreign_ids_stop_with_one_line(tmp_path, capsys, dtype):
    ids = np.concatenate([documents(2)[0], [VOCAB + 7], documents(2)[1]]).astype(dtype)   # inside a window
    ids.tofile(tmp_path / "other.npy")
    assert main(["--format", "npy", "--dtype", dtype, "--input", str(tmp_path / "other.npy"), "--tokenizer",
                 TOKENIZER, "--out", str(tmp_path / "out"), "--seq-len", str(SEQ), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"{tmp_path / 'other.npy'} holds token id {VOCAB + 7}, outside the tokenizer's {VOCAB} ids" in err
    assert main(["--format", "npy", "--input", str(tmp_path / "other.npy"), "--tokenizer", TOKENIZER, "--out",
                 str(tmp_path / "out2"), "--seq-len", str(SEQ), "--quiet"]) == 2   # headerless, no --dtype
    assert "needs --dtype" in capsys.readouterr().err


def test_trainer_reads_imported_shards(tmp_path):
    docs = documents(3, 200)
    np.save(tmp_path / "ids.npy", expected_stream(docs).astype(np.uint16))
    m, stream = imported(tmp_path / "out", "--format", "npy", "--input", tmp_path / "ids.npy")
    batch = next(iter(TokenStream(str(tmp_path / "out"), 4, SEQ, seed=0)))
    windows = {stream[i * SEQ:i * SEQ + SEQ + 1].tobytes() for i in range(len(stream) // SEQ)}
    rows = batch["tokens"].numpy().astype(stream.dtype)
    assert rows.shape == (4, SEQ + 1) and all(r.tobytes() in windows for r in rows)
