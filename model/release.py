"""Release directories: one model, full (unsharded) tensors under canonical names, independent of any parallel layout.

    <dir>/config.json        {"format": "synthformer-release", "format_version": 1, "model": ModelConfig fields,
                              "dtype": "float32" | "bfloat16", "training": {"step", "tokens", "source"}}
    <dir>/model.safetensors  canonical names of `SynthesizerLM.state_dict()` (`wte.weight`, `blocks.3.mixer.…`)
    <dir>/tokenizer.model    the sentencepiece model the run trained with (when known), or its Hugging Face tokenizer:
                             tokenizer.json and tokenizer_config.json (TOKENIZER_FILES)
    <dir>/train_config.yaml  the training config of the run (when known)

Written by `tools/convert.py`, read by the trainer (`train.init_from=DIR`), the Hugging Face export and the evaluation
tools. Canonical order of heads: a TP-sharded tensor is the concatenation of its shards in TP-rank order along the
dimension it is split on (`partition_dim`), which is exactly how `parallel.init_from_seed` slices it.
"""
from __future__ import annotations

import json
import os
import shutil

import torch

from . import parallel as tp
from .accounting import parameters
from .config import ConfigError, ModelConfig
from .lm import SynthesizerLM

FORMAT, FORMAT_VERSION = "synthformer-release", 1
# what a release, a checkpoint or an export carries of the run's tokenizer (written by tokendata/tokenizer.py): a
# sentencepiece model, or a Hugging Face tokenizer.json with the tokenizer_config.json that names its eos_token
SP_TOKENIZER, HF_TOKENIZER, HF_TOKENIZER_CONFIG = "tokenizer.model", "tokenizer.json", "tokenizer_config.json"
TOKENIZER_FILES = (SP_TOKENIZER, HF_TOKENIZER, HF_TOKENIZER_CONFIG)


def tokenizer_files(path: str) -> list[str]:
    """The files of the tokenizer at `path`: itself, and for a tokenizer.json the tokenizer_config.json beside it."""
    config = os.path.join(os.path.dirname(path), HF_TOKENIZER_CONFIG)
    return [path] + ([config] if os.path.basename(path) == HF_TOKENIZER and os.path.isfile(config) else [])


def find_tokenizer(directory: str) -> str | None:
    """The tokenizer a directory carries (its tokenizer.model or tokenizer.json), or None."""
    return next((os.path.join(directory, name) for name in (SP_TOKENIZER, HF_TOKENIZER)
                 if os.path.isfile(os.path.join(directory, name))), None)


def copy_tokenizer(path: str | None, directory: str) -> None:
    """The files of the tokenizer at `path` (if any) into `directory`, under the names TOKENIZER_FILES. A tokenizer
    of any other name is a sentencepiece model (data.tokenizer may name one)."""
    if path and os.path.exists(path):
        for source in tokenizer_files(path):
            name = os.path.basename(source) if os.path.basename(path) == HF_TOKENIZER else SP_TOKENIZER
            shutil.copy(source, os.path.join(directory, name))
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def check_tensors(cfg: ModelConfig, tensors: dict[str, torch.Tensor], where: str) -> None:
    """ConfigError naming the first tensor that the config does not expect, lacks, or shapes differently."""
    expected = parameters(cfg)
    for name in tensors:
        if name not in expected:
            raise ConfigError(f"{where}: tensor '{name}' is not part of the model its config describes "
                              f"(mixer={cfg.mixer}, n_layers={cfg.n_layers}); the weights and config.json do not match")
    for name, (shape, _, _) in expected.items():
        if name not in tensors:
            raise ConfigError(f"{where}: tensor '{name}' is missing; the weights and config.json do not match")
        if list(tensors[name].shape) != shape:
            raise ConfigError(f"{where}: tensor '{name}' has shape {list(tensors[name].shape)} but the config "
                              f"needs {shape}; the weights and config.json do not match")


def save_release(directory: str, cfg: ModelConfig, tensors: dict[str, torch.Tensor], dtype: str = "float32",
                 tokenizer: str | None = None, train_config: str | None = None, training: dict | None = None) -> None:
    """Write a release directory (checked against the config first; written under a temporary name, then renamed)."""
    from safetensors.torch import save_file

    if dtype not in DTYPES:
        raise ConfigError(f"dtype={dtype!r} is not one of {sorted(DTYPES)}")
    check_tensors(cfg, tensors, directory)
    tmp = directory.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    out = {name: t.detach().to(DTYPES[dtype]).contiguous().cpu() for name, t in sorted(tensors.items())}
    save_file(out, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "model": cfg.to_dict(), "dtype": dtype,
            "training": training or {}}
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(meta, f, indent=2)
    copy_tokenizer(tokenizer, tmp)
    if train_config and os.path.exists(train_config):
        shutil.copy(train_config, os.path.join(tmp, "train_config.yaml"))
    shutil.rmtree(directory, ignore_errors=True)
    os.rename(tmp, directory)


def is_release(directory: str) -> bool:
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        return False
    try:
        with open(path) as f:
            return json.load(f).get("format") == FORMAT
    except (OSError, ValueError):
        return False


def read_meta(directory: str) -> dict:
    """The config.json of a release directory."""
    with open(os.path.join(directory, "config.json")) as f:
        return json.load(f)


def read_release(directory: str) -> tuple[ModelConfig, dict[str, torch.Tensor], dict]:
    """(config, full tensors by canonical name, the config.json dict); ConfigError for anything that is not one."""
    from safetensors.torch import load_file

    if not is_release(directory):
        raise ConfigError(f"{directory} is not a release directory (no config.json with format '{FORMAT}'); "
                          f"make one with tools/convert.py to-release")
    with open(os.path.join(directory, "config.json")) as f:
        meta = json.load(f)
    cfg = ModelConfig.from_dict(meta["model"], f"{directory}/config.json")
    weights = os.path.join(directory, "model.safetensors")
    if not os.path.isfile(weights):
        raise ConfigError(f"{weights} is missing; the release directory is incomplete")
    tensors = load_file(weights)
    check_tensors(cfg, tensors, weights)
    return cfg, tensors, meta


@torch.no_grad()
def load_into(model: torch.nn.Module, tensors: dict[str, torch.Tensor], rename=lambda name: name) -> None:
    """Copy full tensors into a (possibly TP-sharded, possibly pipeline-stage) model: each rank keeps its slice."""
    for local_name, p in model.named_parameters():
        p.copy_(tp.local_slice(tensors[rename(local_name)].to(torch.float32), p))


def load_model(directory: str) -> SynthesizerLM:
    """The release as a SynthesizerLM of this process's TP rank (TP=1 without a process group), in float32."""
    cfg, tensors, _ = read_release(directory)
    model = SynthesizerLM(cfg)
    load_into(model, tensors)
    return model
