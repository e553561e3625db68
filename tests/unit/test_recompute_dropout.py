"""Activation checkpointing recomputes a block with the dropout masks of its forward, those of the TP-rank RNG stream
too (model/parallel.py `rng_tracker`: head dropout, and the residual dropouts under sequence parallelism): the
gradients equal those of the same step without recomputation."""
import torch

from model import ModelConfig, build_model
from model import parallel as tp
from pretrain.engine import checkpoint_activations


def grads(recompute: bool) -> dict:
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=16, mixer="dense",
                      dropout=0.2, mixer_dropout=0.5, seed=3)
    model = build_model(cfg)
    if recompute:
        checkpoint_activations(model, 1)
    tp.rng_tracker.set_seed(9)
    torch.manual_seed(4)
    tokens = torch.randint(0, 64, (2, 13), generator=torch.Generator().manual_seed(0))
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def test_recomputed_blocks_draw_the_forward_s_masks():
    plain, recomputed = grads(False), grads(True)
    for name, g in plain.items():
        assert torch.allclose(recomputed[name], g, atol=1e-6), name
