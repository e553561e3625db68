"""Read a DeepSpeed training checkpoint of any (TP, PP, DP, ZeRO stage) back into full tensors with canonical names.

A checkpoint tag directory (`<checkpoint.dir>/step_00000100/`, see pretrain/checkpoints/checkpointer.py) holds,
per model-parallel rank m = pp_stage × TP + tp_rank:
    ZeRO ≥ 1   `*mp_rank_<m>_model_states.pt` (names and shapes) + `zero_pp_rank_<dp>_mp_rank_<m>_optim_states.pt`
               (the fp32 master weights, partitioned over DP) → consolidated by DeepSpeed's own zero_to_fp32;
    always     the weights as the module held them (the only copy of frozen ones): `mp_rank_<m>_model_states.pt`
               ("module"), or with PP > 1 one file per layer spec and TP rank, `layer_<i>-model_<t>-model_states.pt`.
Each model-parallel rank's names are mapped to canonical ones (pipeline layer index → `blocks.<k>.`), then the
TP shards of a tensor are concatenated in TP-rank order along the dimension it is split on (from the model's own
annotations), which restores the canonical order of heads.
"""
from __future__ import annotations

import contextlib
import glob
import io
import os
import re
import tempfile
from functools import partial

import torch
import yaml

from model import ConfigError, SynthesizerLM
from model.accounting import parameters
from model.extend import extend_length
from model.release import find_tokenizer, is_release, load_into, read_release
from pretrain.checkpoints import safe_load
from pretrain.config import TrainConfig
from pretrain.pipeline import canonical_name, stage_prefixes


def resolve(path: str) -> str:
    """A tag directory from a tag directory, a checkpoint directory (its `latest`) or a run directory."""
    for candidate in (path, os.path.join(path, "checkpoints")):
        latest = os.path.join(candidate, "latest")
        if os.path.isfile(latest):
            with open(latest) as f:
                candidate = os.path.join(candidate, f.read().strip())
        if os.path.isfile(os.path.join(candidate, "config.yaml")) and glob.glob(os.path.join(candidate, "*_states.pt")):
            return candidate
    raise ConfigError(f"{path} is not a DeepSpeed training checkpoint (no config.yaml and *_model_states.pt in it, "
                      f"nor a 'latest' file naming one); pass a run directory, its checkpoints/ or a step_* directory")


def step_of(tag_dir: str) -> int:
    """The training step a checkpoint tag directory holds (`step_00000100` → 100; 0 for other names)."""
    base = os.path.basename(os.path.normpath(tag_dir))
    return int(base.split("_")[-1]) if base.startswith("step_") else 0


def read_config(tag_dir: str) -> TrainConfig:
    with open(os.path.join(tag_dir, "config.yaml")) as f:
        return TrainConfig.from_dict(yaml.safe_load(f), source=f"{tag_dir}/config.yaml")


def _quiet(fn, *args, **kwargs):
    """zero_to_fp32 prints a line per step of its work; keep the converter's output readable."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return fn(*args, **kwargs)


def _zero_consolidated(tag_dir: str, mp_rank: int) -> dict[str, torch.Tensor]:
    """fp32 weights of one model-parallel rank through DeepSpeed's zero_to_fp32 (it expects one rank's files only)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    mine = glob.glob(os.path.join(tag_dir, f"*mp_rank_{mp_rank:02d}_*_states.pt"))
    with tempfile.TemporaryDirectory() as tmp:
        os.makedirs(os.path.join(tmp, "tag"))
        for f in mine:
            link = os.path.join(tmp, "tag", os.path.basename(f))
            state = safe_load.load(f, map_location="cpu") if "model_states" in f else safe_load.check(f) or {}
            if "module" in state and state["module"] is None:   # PipelineEngine keeps weights in layer files
                torch.save({**state, "module": {}}, link)         # small: names and shapes only
            else:
                os.symlink(os.path.abspath(f), link)
        return _quiet(get_fp32_state_dict_from_zero_checkpoint, tmp, tag="tag")


def _module_weights(tag_dir: str, cfg: TrainConfig) -> dict[tuple[str, int], torch.Tensor]:
    """{(name, tp_rank): tensor} as the engine saved the modules; under ZeRO-3 only placeholders."""
    p = cfg.parallel
    out = {}
    if p.pp == 1:
        for m in range(p.tp):
            path = sorted(glob.glob(os.path.join(tag_dir, f"*mp_rank_{m:02d}_model_states.pt")))[0]  # ZeRO-3: dp 0's
            state = safe_load.load(path, map_location="cpu")
            out.update({(name, m): value for name, value in state["module"].items()})
        return out
    for path in glob.glob(os.path.join(tag_dir, "layer_*-model_*-model_states.pt")):   # PipelineModule's files
        layer, t = map(int, re.match(r"layer_(\d+)-model_(\d+)-", os.path.basename(path)).groups())
        out.update({(f"{layer}.{key}", t): value
                    for key, value in safe_load.load(path, map_location="cpu").items()})
    return out


def canonical_names(cfg: TrainConfig):
    """name -> canonical name of a run's parameters: a pipeline run's stage-local names (`3.mixer…`) become the plain
    model's (`blocks.2.mixer…`); other runs already use those."""
    if cfg.parallel.pp == 1:
        return lambda name: name
    return partial(canonical_name, prefixes=stage_prefixes(cfg.model))


def load_grown(module: torch.nn.Module, tag_dir: str, model: dict) -> None:
    """Load the checkpoint at `tag_dir` into `module` (this rank's TP slice / pipeline stage of the model that
    `model`, a config's model section, describes), every position-indexed weight grown from the checkpoint's
    max_seq_len to model["max_seq_len"] by model/extend.py: the tensors tools/convert.py extend-length would write.
    A one-line ConfigError where the grown model is not the one `model` describes."""
    saved, tensors = read_weights(tag_dir)
    grown, full = extend_length(saved.model, tensors, model["max_seq_len"])
    for key in ("factorized_a", "factorized_b"):   # factorized dense keeps b and grows a (model/extend.py BLOCK)
        if model.get(key) is not None and model[key] != getattr(grown, key):
            raise ConfigError(f"checkpoint.extend_length: {tag_dir} grown to max_seq_len={grown.max_seq_len} has "
                              f"model.{key}={getattr(grown, key)}, this config {model[key]}: set "
                              f"model.factorized_a={grown.factorized_a} model.factorized_b={grown.factorized_b}")
    load_into(module, full, rename=getattr(module, "canonical_name", lambda name: name))


def read_weights(tag_dir: str, progress=None) -> tuple[TrainConfig, dict[str, torch.Tensor]]:
    """(the run's config, full fp32 tensors by canonical name) of a checkpoint tag directory."""
    cfg = read_config(tag_dir)
    p = cfg.parallel
    for m in range(p.tp * p.pp):
        if not glob.glob(os.path.join(tag_dir, f"*mp_rank_{m:02d}_model_states.pt")):
            raise ConfigError(f"{tag_dir} lacks the files of model-parallel rank {m} (config.yaml says tp={p.tp}, "
                              f"pp={p.pp}): the checkpoint is incomplete")
    rename = canonical_names(cfg)
    weights = _module_weights(tag_dir, cfg)                      # frozen tensors (random_fixed's R) live only here
    if p.zero_stage >= 1 and glob.glob(os.path.join(tag_dir, "zero_pp_rank_*_optim_states.pt")):
        ranks = range(p.tp * p.pp)
        for m in (progress(ranks) if progress else ranks):     # the fp32 masters of the trained tensors
            weights.update({(name, m % p.tp): value for name, value in _zero_consolidated(tag_dir, m).items()})
    shards: dict[str, dict[int, torch.Tensor]] = {}
    for (name, t), value in weights.items():
        if not name.endswith("_extra_state"):                     # megatron's TE metadata, not a weight
            shards.setdefault(rename(name), {})[t] = value.detach().to(torch.float32)
    return cfg, merge_tp(cfg, shards, tag_dir)


def merge_tp(cfg: TrainConfig, shards: dict[str, dict[int, torch.Tensor]], where: str,
             names=None) -> dict[str, torch.Tensor]:
    """Concatenate each tensor's TP shards in rank order along its split dimension; replicated ones must agree.
    Every parameter of the model, or those in `names`."""
    out = {}
    for name, (shape, dim, _) in parameters(cfg.model).items():
        if names is not None and name not in names:
            continue
        parts = shards.get(name)
        if not parts or len(parts) != cfg.parallel.tp:
            raise ConfigError(f"{where}: no complete set of tensor-parallel shards of '{name}' "
                              f"(found ranks {sorted(parts or {})} of tp={cfg.parallel.tp}); the checkpoint does "
                              f"not match its config.yaml")
        ordered = [parts[r] for r in range(cfg.parallel.tp)]
        out[name] = torch.cat(ordered, dim=dim) if dim is not None else ordered[0]
        if list(out[name].shape) != shape:
            raise ConfigError(f"{where}: '{name}' has shape {list(out[name].shape)} after merging but the config "
                              f"needs {shape}; the checkpoint does not match its config.yaml")
    return out


def load_any(path: str):
    """(SynthesizerLM in fp32 at TP=1, tokenizer path (model.release.find_tokenizer) or None, info dict) from a
    release directory or any DeepSpeed checkpoint path that `resolve` accepts — what the evaluation and generation tools start from."""
    if is_release(path):
        cfg, tensors, meta = read_release(path)
        source, step = path, meta.get("training", {}).get("step", 0)
    else:
        source = resolve(path)
        train_cfg, tensors = read_weights(source)
        cfg, step = train_cfg.model, step_of(source)
    model = SynthesizerLM(cfg)
    load_into(model, tensors)
    return model.eval(), find_tokenizer(source), {"source": source, "step": step}
