"""Parameter and FLOP accounting read off the real modules (TP-sharded tensors counted at full size).

Everything here comes from a ModelConfig alone, through one shape-only (meta-device) build of the whole model per
config (`shape_model`): the parameters' canonical names, full shapes, TP split dims (`parameters`, what releases,
checkpoint readers and converters check and merge by), and
- trainable / frozen: numel of the parameters with / without requires_grad;
- Table 1 (Tay et al. 2020): the trainable parameters of each layer's synthesizing function, excluding the
  value/output projections and biases (each mixer lists them in `synthesizer_parameters()`);
- training FLOPs per token: forward + backward (2 × forward: input and weight gradients; a map with nothing to
  learn skips dA), 2 FLOPs per multiply-add, with the full n² terms of attention/synthesis at sequence length n (no causal discount).
"""
from __future__ import annotations

import functools
import json
import math
from typing import NamedTuple

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from . import parallel as tp
from .config import ModelConfig
from .lm import SynthesizerLM


class Param(NamedTuple):
    shape: list[int]        # the full (TP=1) shape
    split_dim: int | None   # the dimension TP ranks split it along, None where every rank holds all of it
    trainable: bool


def shape_model(cfg: ModelConfig) -> SynthesizerLM:
    """The whole model on the meta device (shapes only: no memory, no init), built once per config."""
    return _meta_model(cfg.key())


class _ShapesOnly(TorchFunctionMode):
    """The modules' own random fills (nn.Embedding's normal_, nn.Linear's kaiming_uniform_, …) skipped: a meta
    tensor has no values to fill, and torch's meta normal_ imports torch._dynamo on first use (seconds of a planning
    command's start). The real model draws every parameter from (seed, name) in parallel.init_from_seed."""
    FILLS = {torch.Tensor.normal_, torch.Tensor.uniform_, nn.init.normal_, nn.init.uniform_, nn.init.trunc_normal_,
             nn.init.kaiming_uniform_, nn.init.kaiming_normal_, nn.init.xavier_uniform_, nn.init.xavier_normal_}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.FILLS:   # the tensor filled in place, untouched
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


@functools.lru_cache(maxsize=16)
def _meta_model(config: str) -> SynthesizerLM:
    with torch.device("meta"), _ShapesOnly():
        return SynthesizerLM(ModelConfig.from_dict(json.loads(config)))


def parameters(cfg: ModelConfig) -> dict[str, Param]:
    """Canonical name → (full shape, TP split dim, trainable) of every parameter of the model `cfg` describes."""
    return {name: Param(list(shape), dim, trainable)
            for name, shape, dim, trainable in _parameters(cfg.key(), tp.tp_world())}


@functools.lru_cache(maxsize=16)
def _parameters(config: str, tp_world: int) -> tuple:
    """Read once per config (the memory and time plans ask for every layout they rank)."""
    return tuple((name, tuple(tp.full_shape(p)), getattr(p, "partition_dim", None), p.requires_grad)
                 for name, p in _meta_model(config).named_parameters())


def full_numel(p) -> int:
    return math.prod(tp.full_shape(p))


def count(params) -> tuple[int, int]:
    """(trainable, frozen) element counts."""
    trainable = frozen = 0
    for p in params:
        if p.requires_grad:
            trainable += full_numel(p)
        else:
            frozen += full_numel(p)
    return trainable, frozen


def table1_count(mixer: nn.Module) -> int:
    return sum(full_numel(p) for _, p in mixer.synthesizer_parameters() if p.requires_grad)


def train_flops_per_token(cfg: ModelConfig, n: int | None = None) -> int:
    """Forward + backward FLOPs per token of the whole model at length n (default L): the numerator of MFU, in the
    trainer's log and in benchmarks/bench.py."""
    return _train_flops(cfg.key(), n)


@functools.lru_cache(maxsize=64)
def _train_flops(config: str, n: int | None) -> int:
    return model_stats(ModelConfig.from_dict(json.loads(config)), n)["total"]["train_flops_per_token"]


def model_stats(cfg: ModelConfig, n: int | None = None) -> dict:
    """Per layer and in total: parameters (trainable, frozen), Table-1 count, training FLOPs per token at n."""
    model = shape_model(cfg)
    n = n or cfg.max_seq_len
    flops = model.train_flops_per_token(n)
    layers = []
    for i, (block, mixer_name) in enumerate(zip(model.blocks, cfg.layer_mixers())):
        trainable, frozen = count(block.parameters())
        layers.append({"layer": i, "mixer": mixer_name, "trainable": trainable, "frozen": frozen,
                       "table1": table1_count(block.mixer),
                       "train_flops_per_token": flops["layers"][i]})
    other = [p for name, p in model.named_parameters() if not name.startswith("blocks.")]
    trainable, frozen = count(other)
    outside = {"trainable": trainable, "frozen": frozen, "train_flops_per_token": flops["head"]}
    total_trainable, total_frozen = count(model.parameters())
    return {
        "seq_len": n,
        "layers": layers,
        "embeddings_and_head": outside,
        "total": {"trainable": total_trainable, "frozen": total_frozen,
                  "table1": sum(l["table1"] for l in layers),
                  "train_flops_per_token": sum(l["train_flops_per_token"] for l in layers)
                  + outside["train_flops_per_token"]},
    }
