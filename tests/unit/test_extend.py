"""Growing a model's length (model/extend.py, tools/convert.py extend-length): for every variant the extended weights
have the shapes of the model at the new length and load strictly; at the grid points that the rule keeps (new
position 2i is old position i) every position-indexed weight, and every synthesizer's logits, are the original's;
errors are one line."""
import math
import os

import pytest
import torch

from model import ConfigError, ModelConfig, build_model, release, variants
from model.extend import AXIS, BLOCK, MAP, SUM, extend_length, lerp, position_weights
from model.synthesizers import Dense, FactorizedDense, FactorizedRandom, Random
from tests.support.runs import PY, ROOT, launch, losses, run_py, tool, write_config
from tests.unit.test_model import config

L, N = 16, 32   # g = N/L = 2: new position 2i is old position i


def weights(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("variant", variants.subset("all"))
def test_every_variant_extends_to_the_new_shapes_and_keeps_the_grid(variant):
    old = build_model(config(variant))
    cfg, out = extend_length(old.cfg, weights(old), N)
    assert cfg.max_seq_len == N
    release.check_tensors(cfg, out, "extended")   # strict: every tensor, none extra, the shapes of the model at N
    new = build_model(cfg)
    release.load_into(new, out)
    rules, before = position_weights(old.cfg), weights(old)
    assert "wpe.weight" in rules   # position: learned
    for name, t in before.items():
        got = out[name]
        if name not in rules:
            assert torch.equal(got, t), name   # nothing else moves
            continue
        rule, dim = rules[name]
        grid = got[:, ::2] if dim == 1 else got[::2]
        if rule in (MAP, SUM):   # the entries the causal mask keeps, j ≤ i
            kept = got[:, ::2, ::2].tril() * (2 if rule == SUM else 1)
            assert torch.equal(kept, t.tril()), name
        elif rule == BLOCK:      # a grows to 2a: F_A'[2r] = F_A[r]
            assert torch.equal(got[:, ::2], t), name
        else:
            assert torch.equal(grid, t), name
    check_logits(old, new)


def check_logits(old, new):
    """Each synthesizer's logits at the grid: query-indexed ones (R, R_1 R_2ᵀ) at (2i, 2j), key-indexed ones (Dense's
    W_2, factorized dense's a·b) at key 2j for the same input."""
    x = torch.randn(2, L, old.cfg.d_model, generator=torch.Generator().manual_seed(1))
    x2 = torch.randn(2, N, old.cfg.d_model)
    mods = dict(new.named_modules())
    seen = 0
    for name, module in old.named_modules():
        with torch.no_grad():
            if isinstance(module, (Random, FactorizedRandom)):
                S, S2 = module.logits(x), mods[name].logits(x2)                  # (1, H, L, L), (1, H, N, N)
                assert torch.allclose(S2[..., ::2, ::2].tril(), S.tril(), atol=1e-6), name
            elif isinstance(module, (Dense, FactorizedDense)):
                S, S2 = module.logits(x), mods[name].logits(x)                   # (B, H, L, L) each
                assert torch.allclose(S2[..., ::2], S[..., :L // 2], atol=1e-5), name
            else:
                continue
        seen += 1
    assert seen or not any(isinstance(m, (Random, FactorizedRandom, Dense, FactorizedDense)) for m in old.modules())


def test_lerp_is_linear_between_old_positions_and_clamped_past_the_last():
    t = torch.tensor([[0.0, 10.0, 20.0, 40.0]])
    assert lerp(t, 1, 8).tolist() == [[0.0, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 40.0]]
    assert lerp(t, 1, 6).tolist()[0][:3] == [0.0, pytest.approx(20 / 3), pytest.approx(40 / 3)]


def test_a_map_mixes_only_entries_the_causal_mask_kept():
    """R with garbage above the diagonal: the extended map's kept entries do not see it."""
    old = build_model(config("random"))
    w = weights(old)
    name = next(n for n in w if n.endswith(".R"))
    dirty = dict(w, **{name: w[name] + torch.triu(torch.full_like(w[name], 1e6), diagonal=1)})
    a, b = extend_length(old.cfg, w, N)[1][name], extend_length(old.cfg, dirty, N)[1][name]
    assert torch.equal(a.tril(), b.tril())


def test_errors_are_one_line():
    old = build_model(config("factorized_dense"))   # a·b = 16: a 4, b 4
    for to, needles in ((L, ["--to 16", "larger", "max_seq_len=16"]), (34, ["--to 34", "factorized_b=4", "--to 36"])):
        with pytest.raises(ConfigError) as e:
            extend_length(old.cfg, weights(old), to)
        assert "\n" not in str(e.value) and all(n in str(e.value) for n in needles), str(e.value)
    cfg, _ = extend_length(old.cfg, weights(old), 64)
    assert (cfg.factorized_a, cfg.factorized_b) == (16, 4)
    rope = build_model(config("dot", position="rope"))
    assert position_weights(rope.cfg) == {} and extend_length(rope.cfg, weights(rope), N)[0].max_seq_len == N


def test_the_tool_writes_a_release_that_loads_at_the_new_length(tmp_path):
    model = build_model(config("random+dot"))
    release.save_release(str(tmp_path / "r16"), model.cfg, weights(model))
    r = tool("convert.py", "extend-length", tmp_path / "r16", tmp_path / "r32", "--to", N)
    assert f"train.init_from={tmp_path / 'r32'} model.max_seq_len={N}" in r.stdout, r.stdout
    new = release.load_model(str(tmp_path / "r32"))
    assert new.cfg.max_seq_len == N and release.read_meta(str(tmp_path / "r32"))["training"]["extended"] == \
        {"from": L, "to": N}
    bad = run_py([PY, os.path.join(ROOT, "tools", "convert.py"), "extend-length", str(tmp_path / "r16"),
                  str(tmp_path / "x"), "--to", "8"], env={**os.environ, "PYTHONPATH": ROOT})
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--to 8" in bad.stderr, bad.stderr
    assert "--to N" in tool("convert.py", "extend-length", "--help").stdout


def test_training_goes_on_from_the_extended_release_on_the_same_shards(blend, tmp_path):
    """A model of 32 positions with every rule (R, W_2, a·b, SGU's W, the position table), extended to 64: the trainer
    loads it strictly (train.init_from) and trains 3 steps on the shards of 32, joined in pairs as read."""
    model = {"vocab_size": 512, "d_model": 32, "n_layers": 3, "n_heads": 4, "max_seq_len": 32,
             "mixer": ["random+dense", "factorized_dense", "sgu"]}
    release.save_release(str(tmp_path / "r32"), ModelConfig(**model), weights(build_model(ModelConfig(**model))))
    r = tool("convert.py", "extend-length", tmp_path / "r32", tmp_path / "r64", "--to", 64)
    assert "model.factorized_a=8 model.factorized_b=8" in r.stdout, r.stdout   # a·b = 4·8 grows to 8·8
    cfg = write_config(tmp_path / "c.yaml", blend["a"], tmp_path / "run", model=model)
    launch(cfg, 1, f"train.init_from={tmp_path / 'r64'}", "model.max_seq_len=64", "model.factorized_a=8",
           "model.factorized_b=8", "train.max_steps=3")
    got = losses(tmp_path / "run")
    assert sorted(got) == [1, 2, 3] and all(math.isfinite(v) for v in got.values()), got
