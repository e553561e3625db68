"""Universal checkpoints: change the (TP, PP, DP, ZeRO) layout of a run and keep AdamW's moments.

DeepSpeed's mechanism does the work. Its converter (`deepspeed.checkpoint.ds_to_universal`) writes one folder per
parameter, `zero/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt`, each the full tensor merged over ZeRO partitions and TP
ranks; an engine built with `"checkpoint": {"load_universal": true}` then loads its own slices of them in any
layout. What this module adds, and why:
- the merge rule of every parameter (`universal_info`, DeepSpeed's UNIVERSAL_CHECKPOINT_INFO) from the model's own
  TP annotations (model/accounting.py `parameters`): heads, column-parallel weights and the per-head synthesizer
  weights W₂/R/R₁/R₂/F_A/F_B/θ are split along dim 0, row-parallel weights along dim 1, the rest is replicated.
  DeepSpeed's patterns express all of these splits: no reshaper of our own is needed;
- the converter's input: a staged copy of the model-state files with megatron-core's `*._extra_state` entries left
  out (they are None in the saved module state and the converter calls `.float()` on every entry), and the
  merge rules added; every other file is a symlink;
- canonical folder names (model.SynthesizerLM's: `blocks.3.mixer…`), so a PipelineModule run and a plain-model run
  read the same checkpoint; a resuming rank sees it through a view named by its own parameters (`view_for`);
- frozen tensors (random_fixed's R is in no optimizer, so in no ZeRO fragment): written whole, restored by
  `restore_frozen`;
- the trainer's own state (`trainer_state.pt`): the step, from which the resumed run sets its LR schedule, the loss
  guard's window, and the data position of every rank merged into one (tokendata.stream.merged_state: the same
  global batches go on in any layout; none for a run in the order of before canonical streams, whose step sets it).

Layout: `<dir>/universal_step_00000100/` beside the run's `step_*` checkpoints (`latest_universal` names it), with
`zero/`, DeepSpeed's `mp_rank_*_model_states.pt` (LR schedule), `config.yaml`, `tokenizer.model`,
`trainer_state.pt` and `complete.json`. A run resumes from it when no checkpoint of its own layout is as new.
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import io
import os
import re
import shutil
import tempfile

import torch

from model import ConfigError
from model import parallel as tp
from model.accounting import parameters
from model.release import TOKENIZER_FILES
from pretrain.checkpoints import safe_load
from pretrain.checkpoints.durable import publish
from pretrain.checkpoints.ds_checkpoint import canonical_names, read_config, read_weights, step_of
from tokendata.stream import merged_state

PREFIX = "universal_"


def _rank_of(path: str) -> int:
    return int(re.search(r"trainer_rank(\d+)\.pt$", path).group(1))


def universal_info(split_dims: dict[str, int | None], tied: list[str]) -> dict:
    """DeepSpeed's UNIVERSAL_CHECKPOINT_INFO for parameters named as in the checkpoint: split dim None →
    replicated over TP, 1 → row-parallel (concatenated along dim 1), 0 → DeepSpeed's default (dim 0). `tied`: names
    held by the first and the last pipeline stage alike (the tied embedding), read from the first."""
    from deepspeed.checkpoint import constants as c   # DeepSpeed, heavy to import, only where it is used

    exact = lambda names: [re.escape(name) + "$" for name in sorted(names)]   # noqa: E731
    return {c.UNIVERSAL_CHECKPOINT_VERSION_KEY: c.UNIVERSAL_CHECKPOINT_VERSION_VALUE,
            c.TP_REPLICATED_PARAMETER_PATTERNS: exact(n for n, d in split_dims.items() if d is None),
            c.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: exact(n for n, d in split_dims.items() if d == 1),
            c.PIPELINE_REPLICATED_PARAMETER_PATTERNS: exact(tied)}


def convert(tag_dir: str, out_dir: str, workers: int = 1) -> str:
    """Write the universal form of the checkpoint `tag_dir` into `out_dir` (a checkpoint directory, possibly the
    run's own); returns the new tag directory. Atomic: written as `<tag>.partial`, renamed when complete."""
    from deepspeed.checkpoint import ds_to_universal

    cfg = read_config(tag_dir)
    step = step_of(tag_dir)
    if not glob.glob(os.path.join(tag_dir, "*zero_pp_rank_*_optim_states.pt")):
        raise ConfigError(f"{tag_dir} was written with ZeRO-0 in fp32, whose optimizer state DeepSpeed keeps whole, "
                          f"not per parameter: a universal checkpoint needs ZeRO-1/2/3 (or bf16); to change the "
                          f"layout without the optimizer state use tools/convert.py to-release and train.init_from")
    rename = canonical_names(cfg)
    params = parameters(cfg.model)
    tag = f"{PREFIX}step_{step:08d}"
    final, partial = os.path.join(out_dir, tag), os.path.join(out_dir, tag + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".staging-") as staging:
        _stage(tag_dir, staging, params, rename)
        args = argparse.Namespace(input_folder=staging, output_folder=partial, num_extract_workers=workers,
                                  num_merge_workers=workers, keep_temp_folder=False, strict=True,
                                  inject_missing_state=False)
        with contextlib.redirect_stdout(io.StringIO()):   # a line per step of its work
            ds_to_universal.main(args)
    os.remove(os.path.join(out_dir, "latest_universal"))   # the converter names the .partial folder: ours comes last
    zero = os.path.join(partial, "zero")
    for name in os.listdir(zero):                          # pipeline names → canonical names
        if os.path.isdir(os.path.join(zero, name)) and rename(name) != name:
            os.rename(os.path.join(zero, name), os.path.join(zero, rename(name)))
    if cfg.parallel.zero_stage == 3:
        _as_stage_1_2(zero, cfg)
    _write_frozen(tag_dir, cfg, zero)
    _one_set_of_model_states(partial)
    for name in ("config.yaml",) + TOKENIZER_FILES:
        if os.path.exists(os.path.join(tag_dir, name)):
            shutil.copy(os.path.join(tag_dir, name), partial)
    ranks = [safe_load.load(path)["stateful"]   # rank 0 first: trainer_rank0.pt … sorted by rank
             for path in sorted(glob.glob(os.path.join(tag_dir, "trainer_rank*.pt")), key=_rank_of)]
    data = merged_state([r["data"] for r in ranks if "data" in r])   # the data position, the same in any layout
    torch.save({"step": step, "guard": ranks[0].get("guard") if ranks else None, "data": data},
               os.path.join(partial, "trainer_state.pt"))
    publish(partial, final, os.path.join(out_dir, "latest_universal"), step)
    return final


def _stage(tag_dir: str, staging: str, params: dict, rename) -> None:
    """The converter's input: DeepSpeed's files of `tag_dir` as symlinks, its `mp_rank_*` model states rewritten
    with the merge rules (of every stage's parameters: the converter reads them from the first file) and without
    megatron-core's `_extra_state` entries."""
    from deepspeed.checkpoint import constants as c

    model_states = sorted(glob.glob(os.path.join(tag_dir, "mp_rank_*_model_states.pt")))
    states = [safe_load.load(path, map_location="cpu") for path in model_states]
    names = {n for state in states for group in state.get(c.PARAM_SHAPES, []) for n in group}
    unknown = sorted(n for n in names if rename(n) not in params)
    if unknown:
        raise ConfigError(f"{tag_dir}: parameters {unknown[:3]} are not in the model that config.yaml describes; "
                          f"the checkpoint does not match its config.yaml")
    info = universal_info({n: params[rename(n)].split_dim for n in names},
                          [n for n in names if n.startswith("tied_modules.")])
    for path, state in zip(model_states, states):
        if state.get("module") is not None:
            state["module"] = {k: v for k, v in state["module"].items() if not k.endswith("_extra_state")}
        state[c.UNIVERSAL_CHECKPOINT_INFO] = info
        torch.save(state, os.path.join(staging, os.path.basename(path)))
    for path in glob.glob(os.path.join(tag_dir, "*.pt")):
        name = os.path.basename(path)
        if path not in model_states and not name.startswith("trainer_rank"):
            safe_load.check(path)                          # the converter loads it with weights_only=False
            os.symlink(os.path.abspath(path), os.path.join(staging, name))


def _one_set_of_model_states(directory: str) -> None:
    """DeepSpeed names its model-state files `zero_pp_rank_<dp>_mp_rank_<m>_…` under ZeRO-3 and `mp_rank_<m>_…`
    otherwise, and a universal load reads those of its own stage (dp 0's under ZeRO-3): keep both names of each."""
    for path in glob.glob(os.path.join(directory, "*_model_states.pt")):
        name = os.path.basename(path)
        zero3 = re.match(r"zero_pp_rank_(\d+)_(mp_rank_\d+_model_states\.pt)$", name)
        if zero3 and zero3.group(1) != "0":
            os.remove(path)
        elif zero3:
            os.link(path, os.path.join(directory, zero3.group(2)))
        elif name.startswith("mp_rank_"):
            os.link(path, os.path.join(directory, "zero_pp_rank_0_" + name))


def _as_stage_1_2(zero: str, cfg) -> None:
    """DeepSpeed's converter writes a ZeRO-3 checkpoint in a form that only a ZeRO-3 engine loads: flat tensors,
    the step and the global state inside optimizer_state.pt. Rewritten here in the form of stages 1-2 (full-shape
    tensors with their TP split dim, a step per parameter), which every layout of the trainer but ZeRO-3 loads."""
    import deepspeed

    sd = safe_load.load(os.path.join(zero, "optimizer_state.pt"))
    base = sd["optimizer_state_dict"]
    step = base["state"][0]["step"]
    for name, p in parameters(cfg.model).items():
        folder = os.path.join(zero, name)
        if not os.path.isdir(folder):
            continue   # frozen: no optimizer state (_write_frozen)
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            path = os.path.join(folder, f"{state}.pt")
            tensor = safe_load.load(path)
            if torch.is_tensor(tensor):
                torch.save({"param": tensor.view(p.shape), "cat_dim": p.split_dim or 0}, path)
        if not os.path.exists(os.path.join(folder, "step.pt")):
            torch.save(step.clone(), os.path.join(folder, "step.pt"))
    torch.save({"loss_scaler": sd["loss_scaler"], "dynamic_loss_scale": sd["dynamic_loss_scale"],
                "overflow": sd["overflow"], "clip_grad": cfg.train.grad_clip, "zero_stage": sd["zero_stage"],
                "partition_count": sd["partition_count"], "ds_version": deepspeed.__version__,
                "param_groups": base["param_groups"]}, os.path.join(zero, "optimizer_state.pt"))


def _write_frozen(tag_dir: str, cfg, zero: str) -> None:
    """Full tensors of the parameters no optimizer holds (consolidated as tools/convert.py to-release does)."""
    frozen = [name for name, p in parameters(cfg.model).items() if not p.trainable]
    if not frozen:
        return
    full = read_weights(tag_dir)[1]
    for name in frozen:
        os.makedirs(os.path.join(zero, name), exist_ok=True)
        torch.save({"param": full[name]}, os.path.join(zero, name, "fp32.pt"))


def view_for(tag_dir: str, module: torch.nn.Module, into: str) -> str:
    """A directory `into/<tag>` that shows the universal checkpoint `tag_dir` under this rank's own parameter names
    (DeepSpeed looks up `zero/<name>` by them): symlinks only."""
    rename = getattr(module, "canonical_name", lambda name: name)
    view = os.path.join(into, os.path.basename(os.path.normpath(tag_dir)))
    os.makedirs(os.path.join(view, "zero"))
    for name in os.listdir(tag_dir):
        if name != "zero":
            os.symlink(os.path.abspath(os.path.join(tag_dir, name)), os.path.join(view, name))
    zero = os.path.abspath(os.path.join(tag_dir, "zero"))
    for path in glob.glob(os.path.join(zero, "**", "*.pt"), recursive=True):
        safe_load.check(path)                              # DeepSpeed loads them with weights_only=False
    os.symlink(os.path.join(zero, "optimizer_state.pt"), os.path.join(view, "zero", "optimizer_state.pt"))
    for name, _ in module.named_parameters():
        source = os.path.join(zero, rename(name))
        if not os.path.isdir(source):
            raise ConfigError(f"universal checkpoint {tag_dir} has no zero/{rename(name)}: it was written for "
                              f"another model")
        os.symlink(source, os.path.join(view, "zero", name))
    return view


def restore_frozen(tag_dir: str, module: torch.nn.Module) -> None:
    """Copy this rank's slices of the frozen tensors (never in a ZeRO partition) from the universal checkpoint."""
    rename = getattr(module, "canonical_name", lambda name: name)
    frozen = {name: p for name, p in module.named_parameters() if not p.requires_grad}
    full = {rename(name): safe_load.load(os.path.join(tag_dir, "zero", rename(name), "fp32.pt"))["param"]
            for name in frozen}
    with torch.no_grad():
        for name, p in frozen.items():
            p.copy_(tp.local_slice(full[rename(name)], p))
