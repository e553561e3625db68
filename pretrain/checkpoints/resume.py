"""Which checkpoint a run resumes, and whether it can: the tags in a checkpoint directory, the newest complete one
(regular or universal), and one-line reasons why a run of a given config and world cannot load a checkpoint as it
is. Reads only `latest`, complete.json, config.yaml, file names and a universal checkpoint's trainer state: cheap
enough for the check before a launch."""
from __future__ import annotations

import glob
import os

import yaml

from model import ConfigError
from model.config import architecture_difference
from pretrain.checkpoints import safe_load
from pretrain.checkpoints.durable import verify
from tokendata import shard_stream_order
from tokendata.shards import DataError


def is_universal(path: str) -> bool:
    """Whether a checkpoint directory holds a universal checkpoint (pretrain/checkpoints/universal.py) of any layout."""
    return os.path.isfile(os.path.join(path, "trainer_state.pt")) and os.path.isdir(os.path.join(path, "zero"))


def deepspeed_clipped(path: str | None) -> bool:
    """Whether the ZeRO-1/2 checkpoint at `path` (a tag directory, or None) was written by an engine in which
    DeepSpeed clipped the gradients (its optimizer state records clip_grad > 0): every one written before
    GuardedAdamW clipped them on the device (pretrain/config/deepspeed_dict.py clips_on_device). One optimizer-state file is read,
    memory-mapped; a universal checkpoint is loaded another way and never is one."""
    if path is None or is_universal(path):
        return False
    files = sorted(glob.glob(os.path.join(path, "*zero_pp_rank_*_optim_states.pt")))
    if not files:
        return False
    state = safe_load.load(files[0], map_location="cpu", mmap=True)
    return float(state.get("optimizer_state_dict", {}).get("clip_grad", 0.0) or 0.0) > 0


def newest_universal(directory: str) -> str | None:
    """The complete universal checkpoint that `latest_universal` names in `directory`, or None."""
    named = os.path.join(directory, "latest_universal")
    tag = open(named).read().strip() if os.path.isfile(named) else None
    complete = tag and os.path.isfile(os.path.join(directory, tag, "complete.json"))   # not one being written
    return tag if complete and verify(os.path.join(directory, tag)) is None else None


def resume_point(resume: str, directory: str, config: dict, world: int, announce: bool = False) -> str | None:
    """The checkpoint directory a run resumes from, or None. resume='none': None; a path: that path; 'auto': the
    newest complete checkpoint in `directory`, unless a universal one is newer, or as new while the newest regular
    one is of another layout (tools/convert.py to-universal wrote it for the relaunch in a new layout)."""
    if resume == "none":
        return None
    if resume != "auto":
        problem = verify(os.path.abspath(resume))
        if problem:
            raise ConfigError(f"checkpoint.resume={resume} is not a complete checkpoint: {problem}")
        return os.path.abspath(resume)
    tag, uni = newest_complete(directory, announce), newest_universal(directory)
    chosen = auto_choice(tag, uni, lambda: layout_problem(os.path.join(directory, tag), config, world))
    return os.path.join(directory, chosen) if chosen else None


def auto_choice(tag: str | None, uni: str | None, other_layout) -> str | None:
    """Of the newest complete regular tag and universal tag (either None), the one 'auto' resumes: the universal one
    when newer, or as new while `other_layout()` (the regular one is of another layout) is true."""
    step = lambda t: int(t.rsplit("_", 1)[-1])   # noqa: E731  step_00000100, universal_step_00000100
    if uni and (tag is None or step(uni) > step(tag) or (step(uni) == step(tag) and other_layout())):
        return uni
    return tag


def rewinds(resume: str | None, setting: str, directory: str, config: dict, world: int) -> bool:
    """Whether resuming `resume` (resume_point's answer to checkpoint.resume=`setting`) goes back before the checkpoint
    a relaunch resumes by itself (`auto`): a rewind (`setting` names an older checkpoint, or is 'none'), whose steps
    after it are trained anew, not replayed bit for bit."""
    if setting == "auto":
        return False
    newest = resume_point("auto", directory, config, world)
    return (resume and os.path.realpath(resume)) != (newest and os.path.realpath(newest))


def newest_complete(directory: str, announce: bool = False) -> str | None:
    """The tag to resume from: the one `latest` names if it verifies, else the newest that does (said when
    `announce`), else None."""
    latest = os.path.join(directory, "latest")
    named = open(latest).read().strip() if os.path.exists(latest) else None
    why = verify(os.path.join(directory, named)) if named else None
    if named and why is None:
        return named
    complete = complete_tags(directory)
    if named and complete and announce:
        print(f"checkpoint {os.path.join(directory, named)} is incomplete ({why}); resuming from {complete[-1]}",
              flush=True)
    return complete[-1] if complete else None


def complete_tags(directory: str) -> list[str]:
    """Tags whose every recorded file is present with its recorded size, oldest first."""
    if not os.path.isdir(directory):
        return []
    tags = sorted(t for t in os.listdir(directory) if t.startswith("step_") and not t.endswith(".partial"))
    return [t for t in tags if verify(os.path.join(directory, t)) is None]


def compatibility_problem(path: str, config: dict, world: int) -> str | None:
    """Why a run of `config` on `world` ranks cannot resume the checkpoint at `path` (another model, another
    layout, another world size), as one line with what to do; None if it can. Reads only config.yaml and the file
    names: cheap enough for the check before launch."""
    return architecture_problem(path, config) or layout_problem(path, config, world)


def saved_config(path: str) -> dict | None:
    saved_file = os.path.join(path, "config.yaml")
    if not os.path.exists(saved_file):
        return None
    with open(saved_file) as f:
        return yaml.safe_load(f)


def architecture_problem(path: str, config: dict) -> str | None:
    """Why the checkpoint at `path` holds another model than `config` describes (one line), or None. A smaller
    max_seq_len is no problem with checkpoint.extend_length (`grown_from`)."""
    saved = saved_config(path)
    if not saved:
        return None
    theirs = dict(saved.get("model", {}))
    if grown_from(path, config):   # the sizes extend-length changes are the new config's; every other key must agree
        theirs.update({k: config["model"].get(k) for k in LENGTH_KEYS})
    key = architecture_difference(theirs, config["model"])
    if key == "max_seq_len":
        return (f"checkpoint {path} was trained at model.max_seq_len={theirs.get(key)}, this config has "
                f"{config['model'][key]}: set model.max_seq_len back, or grow the model with "
                f"checkpoint.extend_length=true (to a larger length only)")
    if key:
        return (f"checkpoint {path} holds a model with model.{key}={saved['model'].get(key)!r}, this config has "
                f"{config['model'][key]!r}: set it back, or start a new run (train.run_dir / checkpoint.dir)")
    return None


LENGTH_KEYS = ("max_seq_len", "factorized_a", "factorized_b")   # what model/extend.py extended_config sets


def grown_from(path: str, config: dict) -> int | None:
    """The max_seq_len of the checkpoint at `path` where a run of `config` resumes it grown to a larger one
    (checkpoint.extend_length), else None."""
    saved = saved_config(path)
    ell = saved and saved.get("model", {}).get("max_seq_len")
    wanted = config.get("checkpoint", {}).get("extend_length") and config["model"]["max_seq_len"]
    return ell if ell and wanted and wanted > ell else None


def layout_problem(path: str, config: dict, world: int) -> str | None:
    """Why a run in the layout of `config` on `world` ranks cannot load the checkpoint at `path` as it is (another
    TP, CP, PP, ZeRO-3 or world size), with what to do; None if it can."""
    saved = saved_config(path)
    if saved is None:
        return None
    if is_universal(path):
        if config["parallel"]["zero_stage"] not in (1, 2):   # DeepSpeed's loader is in the ZeRO-1/2 optimizers
            return (f"checkpoint {path} is a universal checkpoint, which loads into ZeRO stages 1 and 2: set "
                    f"parallel.zero_stage=1 or 2 to resume from it (and change the stage at the next checkpoint)")
        return None   # written to be resumed in any layout
    change = (f"to change the layout and keep the optimizer state, relaunch with checkpoint.relayout=true (or "
              f"convert it first: tools/convert.py to-universal {path})")
    for key in ("tp", "cp", "pp"):   # cp: a checkpoint of before the key was at 1
        theirs, ours = saved.get("parallel", {}).get(key, 1), config["parallel"][key]
        if theirs != ours:
            return (f"checkpoint {path} was written with parallel.{key}={theirs}, this run has parallel.{key}={ours}: "
                    f"launch with parallel.{key}={theirs} to resume it, or {change}")
    theirs, ours = saved.get("parallel", {}).get("zero_stage", 0), config["parallel"]["zero_stage"]
    if (theirs == 3) != (ours == 3):   # ZeRO-3 partitions parameters: its files are not those of stages 0-2
        return (f"checkpoint {path} was written with parallel.zero_stage={theirs}, this run has "
                f"parallel.zero_stage={ours}: launch with parallel.zero_stage={theirs} to resume it, or {change}")
    ranks = sum(n.startswith("trainer_rank") and n.endswith(".pt") for n in os.listdir(path))
    if ranks and ranks != world:
        return (f"checkpoint {path} was written by {ranks} ranks, this launch has {world}: launch {ranks} to resume "
                f"it, or {change}")
    return None


def data_problem(path: str, dp: int) -> str | None:
    """Why a universal checkpoint's data order cannot go on with `dp` data-parallel ranks: that of canonical streams
    dealt by shard (tokendata/shard_stream_order.py) gives each rank whole streams; None if it can (every newer order reads
    any divisor of the global batch; a regular checkpoint is resumed in its own layout)."""
    if not is_universal(path):
        return None
    data = safe_load.load(os.path.join(path, "trainer_state.pt")).get("data") or {}
    if data.get("order") != shard_stream_order.ORDER:
        return None
    try:
        shard_stream_order.check_streams(data["canonical_streams"], data["layout"]["global_batch_size"], dp)
    except DataError as e:
        return f"checkpoint {path}: {e}"
    return None
