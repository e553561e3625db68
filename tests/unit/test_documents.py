"""Documents, not windows (model.document_mask, model/documents.py): every variant attends within its document and
reads its position-indexed weights at the position in the document, on the fused path, the reference path, the GPU
path's formula and cached decoding; the setting is checked, saved and compared like every architecture field."""
import pytest
import torch
import torch.nn.functional as F

from model import ConfigError, build_model, variants
from model.config import architecture_difference
from model.decoding import CachedLM, IncrementalDecoder
from model.documents import document_ids, positions_in_documents
from model.generate import sample
from model.release import load_model, read_release, save_release
from pretrain.prelaunch import check_eos
from tests.unit.test_model import assert_fused_matches_reference, config as model_config

VARIANTS = variants.subset("all")   # every registered mixer, gMLP, and the mixtures of every fused form
L, EOS = 16, 1
FIRST = 6                            # document 1: positions 0-5, its eos at 5; document 2: positions 6-15


def config(variant, document_mask=True, impl="fused", **kw):
    """tests/unit/test_model.py's (large inits: maps far from uniform, every weight visibly matters), n ≤ 16."""
    return model_config(variant, impl, document_mask=document_mask, **{"eos_id": EOS, **kw})


def window(B=2, seed=0) -> torch.Tensor:
    """(B, L) tokens with no eos but the one that ends document 1, at FIRST − 1."""
    x = torch.randint(2, 64, (B, L), generator=torch.Generator().manual_seed(seed))
    x[:, FIRST - 1] = EOS
    return x


def second_document(model, x):
    """(the logits of document 2, the gradient of document 2's loss with respect to the input embeddings)."""
    docs = model.documents(x)
    embedded = model.embed(x, docs=docs)
    embedded.retain_grad()
    h = embedded
    for block in model.blocks:
        h = block(h, docs=docs)
    logits = model.logits(h)
    F.cross_entropy(logits[:, FIRST:-1].flatten(0, 1), x[:, FIRST + 1:].flatten()).backward()
    return logits[:, FIRST:].detach(), embedded.grad


def independence(variant, document_mask):
    """(how far document 2's logits move when document 1's tokens change, the largest gradient of document 2's loss
    at document 1's input embeddings)."""
    model = build_model(config(variant, document_mask))
    x = window()
    y = x.clone()
    y[:, :FIRST - 1] = (y[:, :FIRST - 1] + 7) % 62 + 2          # other tokens for document 1 (its eos kept)
    a, grad = second_document(model, x)
    b, _ = second_document(model, y)
    return (a - b).abs().max().item(), grad[:, :FIRST].abs().max().item()


def assert_independent(variant, document_mask=True):
    moved, grad = independence(variant, document_mask)
    assert moved <= 1e-6, f"{variant}: document 2's logits moved by {moved:.3g} when document 1 changed"
    assert grad == 0.0, f"{variant}: document 2's loss has gradient {grad:.3g} at document 1's embeddings"


@pytest.mark.parametrize("variant", VARIANTS)
def test_documents_are_independent(variant):
    """With the mask, document 2 neither sees document 1 nor sends it gradient; without it, it does both (the same
    check fails: tools show it with `assert_independent(variant, document_mask=False)`)."""
    assert_independent(variant)
    moved, grad = independence(variant, document_mask=False)
    assert moved > 1e-4 and grad > 1e-6, (variant, moved, grad)


@pytest.mark.parametrize("position", ["learned", "rope"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_a_document_gives_the_logits_it_gives_alone(variant, position):
    """A document at offset s of a packed window gives the logits of the same document alone at offset 0 (fp32,
    1e-5), on the fused path and the reference path: positions restart, position-indexed weights line up."""
    for impl in ("fused", "reference"):
        model = build_model(config(variant, position=position, impl=impl)).eval()
        x = window(B=3, seed=1)
        x[1, 10] = EOS                                           # sample 1: documents at 0, 6 and 11
        with torch.no_grad():
            packed = model(x)
            for b, (s, e) in ((0, (FIRST, L)), (1, (FIRST, 11)), (1, (11, L)), (2, (0, FIRST))):
                alone = model(x[b:b + 1, s:e])
                err = (packed[b:b + 1, s:e] - alone).abs().max().item()
                assert err <= 1e-5, f"{variant} {impl} {position}: sample {b} positions {s}-{e}: {err:.3g}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_fused_matches_reference_under_the_mask(variant):
    """The fused path against the materialized reference: logits and every gradient to 1e-5, three documents."""
    x = window(B=3, seed=2)
    x[0, 11], x[2, 0] = EOS, EOS
    assert_fused_matches_reference(variant, L - 1, x, document_mask=True, eos_id=EOS)


# every term of the GPU path's FlexAttention call: q·k, a key bias, a map, factors, and their mixtures
FLEX = ["dot", "dense", "random", "factorized_dense", "factorized_random", "random+dot", "random+dense",
        "dot+dense+factorized_random"]


@pytest.mark.parametrize("variant", FLEX)
def test_the_gpu_paths_formula_matches_the_reference(variant, monkeypatch):
    """SYNTHFORMER_KERNELS=gpu: the GPU path's FlexAttention call (block mask from the document ids, maps and factors
    in its score_mod), run eagerly here, forward only (FlexAttention has no CPU backward), gives the reference."""
    x = window(B=3, seed=3)
    x[1, 12] = EOS
    ref = build_model(config(variant, impl="reference")).eval()
    monkeypatch.setenv("SYNTHFORMER_KERNELS", "gpu")
    fused = build_model(config(variant)).eval()
    with torch.no_grad():
        assert (fused(x) - ref(x)).abs().max() <= 1e-5


@pytest.mark.parametrize("variant", VARIANTS)
def test_cached_decoding_sees_the_documents_as_training_did(variant):
    """Incremental decoding over a prompt with an eos and new tokens with another: the full pass's logits; sampling
    through the cache gives the tokens of the full recompute."""
    model = build_model(config(variant)).eval()
    x = window(B=2, seed=4)
    x[0, 12] = EOS
    decoder = IncrementalDecoder(model)
    rows = [decoder(x[:, :9])] + [decoder(x[:, i:i + 1]) for i in range(9, L)]
    with torch.no_grad():
        assert (torch.cat(rows, 1) - model(x)).abs().max() <= 1e-5
    prompt = x[:, :7]
    assert torch.equal(sample(CachedLM(model), prompt, 12, seed=1), sample(model, prompt, 12, seed=1))


def test_the_setting_is_checked_saved_and_compared(tmp_path):
    with pytest.raises(ConfigError, match="model.document_mask=true needs model.eos_id"):
        config("dot", eos_id=None)
    with pytest.raises(ConfigError, match=r"model.eos_id=64 is not a token id below model.vocab_size=64"):
        config("dot", eos_id=64)
    cfg = config("random+dot")
    with pytest.raises(ConfigError, match=r"eos_id=2 .*: set model.eos_id=2") as e:
        check_eos({"eos_id": 2, "shard_dir": "build/demo/shards"}, cfg)
    assert "\n" not in str(e.value)
    check_eos({"eos_id": EOS, "shard_dir": "x"}, cfg)
    # a checkpoint saved before the fields existed is the default (off); turning the mask on is a difference
    old = {k: v for k, v in config("dot", False, eos_id=None).to_dict().items() if k not in ("document_mask", "eos_id")}
    assert architecture_difference(old, config("dot", False, eos_id=None).to_dict()) is None
    assert architecture_difference(old, config("dot").to_dict()) == "document_mask"
    # a release keeps it, and the loaded model applies it
    model = build_model(cfg)
    save_release(str(tmp_path / "release"), cfg, dict(model.named_parameters()))
    assert read_release(str(tmp_path / "release"))[0].document_mask
    x = window()
    with torch.no_grad():
        assert torch.equal(load_model(str(tmp_path / "release"))(x), model(x))


def test_document_ids_and_positions_follow_megatrons_rule():
    x = torch.tensor([[5, 5, EOS, 7, EOS, EOS, 8, 9], [EOS, 4, 4, 4, 4, 4, 4, 4]])
    assert document_ids(x, EOS).tolist() == [[0, 0, 0, 1, 1, 2, 3, 3], [0, 1, 1, 1, 1, 1, 1, 1]]
    # an eos ends its document; the next token starts one at 0; the window's leading part starts at 0 too
    assert positions_in_documents(document_ids(x, EOS)).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1],
                                                                     [0, 0, 1, 2, 3, 4, 5, 6]]


def test_document_lengths_of_a_shard_set(shards, capsys):
    """tools/document_lengths.py against numpy over the raw samples: documents, documents per window, moved tokens."""
    import json

    import numpy as np

    from tokendata.shards import read_manifest, shard_samples
    from tools.document_lengths import main

    assert main([shards, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    manifest = read_manifest(shards)
    n, eos = manifest["seq_len"], manifest["eos_id"]
    rows = np.stack([s for shard in manifest["splits"]["train"]["shards"] for _, s in shard_samples(manifest, shard)])
    assert got["documents"] == int((rows == eos).sum()) and got["windows"] == len(rows)
    inputs = rows[:, :n] == eos
    assert got["documents_per_window"] == pytest.approx(1 + inputs[:, :-1].sum(1).mean())
    first_end = np.where(inputs.any(1), inputs.argmax(1), n)   # tokens after a window's first eos moved
    assert got["tokens_moved"] == pytest.approx((n - 1 - first_end).clip(0).sum() / rows[:, :n].size)
    assert main([shards, "--split", "nope"]) == 2 and "has no split 'nope'" in capsys.readouterr().err
