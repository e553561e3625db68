"""A variant defined only here, as docs/adding-a-variant.md says: its class and one registry entry, nothing else. It
reuses an existing kernel form (a shared map, model/forms.py MapForm), so its fused path equals its formula, alone
and in a mixture, and a real run of the trainer (DeepSpeed, ZeRO-1) trains it: this file is also the script of that
run's rank."""
import sys

import pytest
import torch
import yaml

from model import ModelConfig, build_model, variants
from model.forms import MapForm
from model.parallel import normal
from model.synthesizers import per_head
from pretrain.train import main as train_main
from tests.support.runs import losses, spawn, write_config
from tests.unit.test_documents import assert_independent
from tests.unit.test_model import assert_fused_matches_reference, config

NAME = "relative_random"


class RelativeRandom(torch.nn.Module):
    """S_h[i, j] = r^h[i − j]: a random synthesizer that depends only on the distance back, `r` (Hl, L)."""

    input_dependent, cached = False, False

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.r = per_head(cfg.n_heads, cfg.max_seq_len, init=normal(cfg.random_init_std))

    def rows(self, t0: int, t1: int) -> torch.Tensor:
        distance = (torch.arange(t0, t1)[:, None] - torch.arange(t1)[None, :]).clamp(min=0)   # (m, t1); j > i masked
        return self.r[:, distance]                                                          # (Hl, m, t1)

    def projections(self):   # no linear of x
        return []

    def activations(self, B, n, mixed=False, documents=False):   # r is a parameter: nothing kept for backward
        return {}

    def fused(self, x, inputs, positions=None):   # under the document mask: the map read at p_i, p_j
        return MapForm(self.rows(0, x.shape[1]), positions)

    def logits(self, x, t0=0, keys=None, positions=None):   # r[i − j] = r[p_i − p_j] within a document
        return self.rows(t0, t0 + x.shape[1]).unsqueeze(0)

    def flops(self, n):
        return 0


def register() -> variants.Variant:
    return variants.register(variants.Variant(NAME, RelativeRandom, mixable=True, formula="S[i, j] = r[i − j]"))


@pytest.fixture
def registered():
    register()
    try:
        yield
    finally:
        variants.unregister(NAME)


@pytest.mark.parametrize("mixer", [NAME, f"{NAME}+dot"])
def test_the_new_variant_runs_on_the_existing_kernels(registered, mixer):
    """Fused (the shared-map kernel, or the biased q·k one in a mixture) equals the materialized formula: logits and
    every gradient, as for the built-in variants."""
    assert_fused_matches_reference(mixer, 12)
    assert_independent(mixer)   # and under the document mask, as the documentation's class says
    assert any(name.endswith(f"synth.{NAME}.r") for name, _ in build_model(config(mixer)).named_parameters())


def test_the_registry_gives_the_config_its_names(registered):
    assert NAME in variants.names(mixable=True) and NAME in variants.subset("all")
    assert ModelConfig(vocab_size=8, d_model=8, n_layers=1, n_heads=2, max_seq_len=8, mixer=f"dense+{NAME}")


def test_unregistered_it_is_an_unknown_mixer():
    with pytest.raises(ValueError, match=f"unknown mixer '{NAME}'"):
        ModelConfig(vocab_size=8, d_model=8, n_layers=1, n_heads=2, max_seq_len=8, mixer=NAME)


@pytest.mark.slow
def test_the_trainer_trains_it_through_the_registry_alone(shards, tmp_path):
    """The real trainer (DeepSpeed, ZeRO-1, a gloo process group of one rank), started as this file's __main__,
    which registers the variant before the config is read, trains a model whose layers are the variant and its
    mixture with dot."""
    run = tmp_path / "run"
    cfg = write_config(tmp_path / "c.yaml", shards, run, model={"mixer": [NAME, f"{NAME}+dot"]},
                       parallel={"zero_stage": 1}, train={"max_steps": 5, "warmup_steps": 1})
    spawn(__file__, [cfg], 1)
    assert sorted(losses(run)) == [1, 2, 3, 4, 5]
    assert losses(run)[5] < losses(run)[1]
    saved = yaml.safe_load((run / "checkpoints" / "step_00000005" / "config.yaml").read_text())
    assert saved["model"]["mixer"] == [NAME, f"{NAME}+dot"]


if __name__ == "__main__":   # one rank of the run above: the variant is registered, then the trainer reads the config
    register()
    sys.exit(train_main(sys.argv[1:]))
