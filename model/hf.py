"""Hugging Face export and import of a release directory (model/release.py).

    <hf dir>/config.json               SynthformerConfig: the release's `model` fields, model_type "synthformer",
                                       architectures, auto_map (remote code), dtype, and `synthformer_training`
    <hf dir>/model.safetensors         the release's tensors, byte for byte, each renamed `model.<canonical name>`
    <hf dir>/generation_config.json    use_cache (incremental decoding); bos/eos/pad ids from the tokenizer when there is one
    <hf dir>/*.py                      configuration_synthformer.py, modeling_synthformer.py and the model files they
                                       import (config, decoding, documents, fields, forms, lm, mixers, synthesizers,
                                       variants, kernels, parallel)
    <hf dir>/tokenizer.model           + tokenization_synthformer.py, tokenizer_config.json (when the release has one)
    <hf dir>/tokenizer.json            + tokenizer_config.json (PreTrainedTokenizerFast, its eos_token): a release
                                       trained with a Hugging Face tokenizer; AutoTokenizer gives the training ids
                                       (the tokenizer adds no bos or eos unless its own post-processor does)
    <hf dir>/train_config.yaml         (when the release has one)

The directory loads on its own, offline, from any working directory:
    AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)    (and AutoConfig, AutoTokenizer)

Both directions only move tensors and JSON: no model is built and transformers is not imported, so they are fast
and need only safetensors. `hf_to_release(release_to_hf(r))` reproduces the release's tensors bit for bit.
"""
from __future__ import annotations

import json
import ast
import os
import shutil
from dataclasses import fields

from .config import ConfigError, ModelConfig
from .release import DTYPES, HF_TOKENIZER, HF_TOKENIZER_CONFIG, find_tokenizer, read_release, save_release

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL_TYPE = "synthformer"
ENTRY_FILES = ("configuration_synthformer.py", "modeling_synthformer.py")


def code_files(entry=ENTRY_FILES) -> list[str]:
    """The remote code of an export: the entry files and every model file they reach through module-level relative
    imports (`from .x import …`), found by reading them. transformers' loader copies them from the export into its
    module cache, so the set must be complete; tests/unit/test_hf.py loads an export in isolation."""
    seen, todo = [], list(entry)
    while todo:
        name = todo.pop(0)
        if name in seen:
            continue
        seen.append(name)
        with open(os.path.join(HERE, name), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in tree.body:   # module level only: function-local imports are GPU-only kernels (model/gpu_kernels)
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                modules = [node.module] if node.module else [alias.name for alias in node.names]
                todo += [m + ".py" for m in modules if os.path.isfile(os.path.join(HERE, m + ".py"))]
    return seen
TOKENIZER_FILE = "tokenization_synthformer.py"
AUTO_MAP = {"AutoConfig": "configuration_synthformer.SynthformerConfig",
            "AutoModelForCausalLM": "modeling_synthformer.SynthformerForCausalLM"}
PREFIX = "model."


def _transformers_version() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return None


def _special_ids(tokenizer: str) -> dict:
    """bos/eos/pad ids of a sentencepiece model (sentencepiece reports an absent one as -1), or the eos id of a
    Hugging Face tokenizer.json (its eos_token: the tokenizer_config.json beside it)."""
    if os.path.basename(tokenizer) == HF_TOKENIZER:
        from tokenizers import Tokenizer

        eos = _hf_tokenizer_config(tokenizer).get("eos_token")
        eos_id = Tokenizer.from_file(tokenizer).token_to_id(eos) if isinstance(eos, str) else None
        return {} if eos_id is None else {"eos_token_id": eos_id}
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=tokenizer)
    ids = {"bos_token_id": sp.bos_id(), "eos_token_id": sp.eos_id(), "pad_token_id": sp.pad_id()}
    return {k: v for k, v in ids.items() if v >= 0}


def _hf_tokenizer_config(tokenizer: str) -> dict:
    path = os.path.join(os.path.dirname(tokenizer), HF_TOKENIZER_CONFIG)
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _copy_tokenizer(tokenizer: str, tmp: str, cfg: ModelConfig) -> None:
    """The release's tokenizer into an export, with what AutoTokenizer needs to load it offline."""
    shutil.copy(tokenizer, os.path.join(tmp, os.path.basename(tokenizer)))
    if os.path.basename(tokenizer) == HF_TOKENIZER:
        config = {**_hf_tokenizer_config(tokenizer), "tokenizer_class": "PreTrainedTokenizerFast",
                  "model_max_length": cfg.max_seq_len, "padding_side": "right"}
        _write_json(os.path.join(tmp, HF_TOKENIZER_CONFIG), config)
        return
    shutil.copy(os.path.join(HERE, TOKENIZER_FILE), os.path.join(tmp, TOKENIZER_FILE))
    _write_json(os.path.join(tmp, "tokenizer_config.json"),
                {"tokenizer_class": "SynthformerTokenizer", "model_max_length": cfg.max_seq_len,
                 "auto_map": {"AutoTokenizer": ["tokenization_synthformer.SynthformerTokenizer", None]}})


def hf_config(cfg: ModelConfig, dtype: str, training: dict | None = None, special_ids: dict | None = None) -> dict:
    """The config.json of an export (the fields SynthformerConfig reads, plus what transformers looks for)."""
    return {"model_type": MODEL_TYPE, "architectures": ["SynthformerForCausalLM"], "auto_map": dict(AUTO_MAP),
            **cfg.to_dict(), "dtype": dtype, "tie_word_embeddings": False, "use_cache": True,
            **(special_ids or {}), "synthformer_training": training or {},
            "transformers_version": _transformers_version()}


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def release_to_hf(release_dir: str, out_dir: str) -> None:
    """Write the Hugging Face export of a release (under a temporary name, then renamed)."""
    from safetensors.torch import save_file

    cfg, tensors, meta = read_release(release_dir)
    tokenizer = find_tokenizer(release_dir)
    special = _special_ids(tokenizer) if tokenizer else {}
    tmp = out_dir.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    # Same tensors, same dtype: only the names change (safetensors stores each tensor's bytes as they are).
    save_file({PREFIX + name: t.contiguous() for name, t in tensors.items()}, os.path.join(tmp, "model.safetensors"),
              metadata={"format": "pt"})
    _write_json(os.path.join(tmp, "config.json"), hf_config(cfg, meta["dtype"], meta.get("training"), special))
    generation = {"use_cache": True, **special, "transformers_version": _transformers_version()}
    _write_json(os.path.join(tmp, "generation_config.json"), generation)
    for name in code_files():
        shutil.copy(os.path.join(HERE, name), os.path.join(tmp, name))
    if tokenizer:
        _copy_tokenizer(tokenizer, tmp, cfg)
    train_config = os.path.join(release_dir, "train_config.yaml")
    if os.path.isfile(train_config):
        shutil.copy(train_config, os.path.join(tmp, "train_config.yaml"))
    shutil.rmtree(out_dir, ignore_errors=True)
    os.rename(tmp, out_dir)


def read_hf_config(hf_dir: str) -> dict:
    """config.json of a Synthformer export; ConfigError (one line, naming the path) for anything else."""
    path = os.path.join(hf_dir, "config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{hf_dir} is not a Synthformer Hugging Face export: {path} does not exist") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} is not readable JSON: {str(e).splitlines()[0]}") from None
    if not isinstance(config, dict) or config.get("model_type") != MODEL_TYPE:
        found = config.get("model_type") if isinstance(config, dict) else None
        raise ConfigError(f"{hf_dir} is not a Synthformer Hugging Face export: {path} has model_type={found!r}, "
                          f"expected '{MODEL_TYPE}' (make one with release_to_hf)")
    return config


def hf_to_release(hf_dir: str, out_dir: str) -> None:
    """Write the release directory of a Hugging Face export, keeping its dtype and tensors unchanged."""
    from safetensors.torch import load_file

    config = read_hf_config(hf_dir)
    names = [f.name for f in fields(ModelConfig)]   # the HF-only keys (auto_map, dtype, …) are left out
    cfg = ModelConfig.from_dict({k: config[k] for k in names if k in config}, f"{hf_dir}/config.json")
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32").removeprefix("torch.")
    if dtype not in DTYPES:
        raise ConfigError(f"{hf_dir}/config.json: dtype={dtype!r} is not one of {sorted(DTYPES)}")
    weights = os.path.join(hf_dir, "model.safetensors")
    if not os.path.isfile(weights):
        raise ConfigError(f"{weights} is missing (sharded or .bin exports are not supported); "
                          f"save the model with save_pretrained(..., safe_serialization=True) as one file")
    tensors = load_file(weights)
    stray = sorted(name for name in tensors if not name.startswith(PREFIX))
    if stray:
        raise ConfigError(f"{weights}: tensor '{stray[0]}' does not start with '{PREFIX}'; "
                          "not the weights of a SynthformerForCausalLM")
    tensors = {name[len(PREFIX):]: t for name, t in tensors.items()}
    if any(t.dtype != DTYPES[dtype] for t in tensors.values()):
        # save_release would cast; say so rather than silently change the bits of a re-saved model.
        found = sorted({str(t.dtype).removeprefix("torch.") for t in tensors.values()})
        raise ConfigError(f"{weights} holds {', '.join(found)} tensors but config.json says dtype={dtype}")
    save_release(out_dir, cfg, tensors, dtype=dtype, tokenizer=find_tokenizer(hf_dir),
                 train_config=os.path.join(hf_dir, "train_config.yaml"),
                 training=config.get("synthformer_training") or {})
