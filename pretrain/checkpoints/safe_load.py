"""Loads that run no code. A `.pt` file is a pickle, and a pickle may name any callable to call on load
(`os.system`, ...). Every checkpoint file the project reads is loaded with `torch.load(weights_only=True)`, whose
unpickler builds tensors, containers and plain values only, plus the few types below that the files of a run hold
(registered with `torch.serialization.add_safe_globals` as they are met). Files that DeepSpeed's own code loads with
`weights_only=False` (its engine's `load_checkpoint`, zero_to_fp32, the universal converter) are `check`ed first:
their pickle's globals are listed without loading it (`get_unsafe_globals_in_checkpoint`) and one outside the list is
refused. Either way a file that would run code is an `UnsafeCheckpoint`: one line naming the file and what to do."""
from __future__ import annotations

import importlib
import pickle
import re

import torch

from model import ConfigError

# The types, beyond torch's own safe set, that the files of a run hold: numpy's arrays and scalars (the RNG states
# in trainer_rank<R>.pt; numpy 1 and 2 names), DeepSpeed's optimizer-state helpers (ZeRO's loss scaler, stage
# enum and fragment addresses in *_optim_states.pt).
ALLOWED = {
    *(f"numpy.{core}.multiarray.{name}" for core in ("core", "_core") for name in ("_reconstruct", "scalar")),
    "numpy.ndarray", "numpy.dtype",
    *(f"numpy.dtypes.{kind}DType" for kind in ("UInt8", "UInt16", "UInt32", "UInt64", "Int8", "Int16", "Int32",
                                               "Int64", "Float16", "Float32", "Float64", "Bool")),
    "deepspeed.utils.tensor_fragment.fragment_address",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler", "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
}
_registered: set[str] = set()


class UnsafeCheckpoint(ConfigError):
    """A checkpoint file whose pickle would run code (or build a type the project never writes) on load."""


def refusal(path: str, names) -> UnsafeCheckpoint:
    shown = ", ".join(sorted(names)[:3]) or "an object outside the allowed types"
    return UnsafeCheckpoint(f"{path} holds a pickle that would run code on load ({shown}): refused, nothing in it "
                            f"was run; it was not written by this project's training or tools. If you trust its "
                            f"source, re-save it as plain tensors, or ask for a release (model.safetensors)")


def _register(names) -> None:
    """Add the allowed types among `names` to torch's safe globals (importing DeepSpeed only if a file needs it)."""
    for name in set(names) - _registered:
        module, _, attr = name.rpartition(".")
        try:
            obj = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError):   # numpy 1 has no numpy._core, numpy 2 warns on numpy.core
            continue
        torch.serialization.add_safe_globals([(obj, name)])
        _registered.add(name)


def check(path: str) -> None:
    """UnsafeCheckpoint if the pickle in `path` names a global outside torch's safe set and ALLOWED. Reads only the
    pickle's opcodes, not the tensors: cheap even for a file of many GB."""
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except ValueError:                           # not torch.save's zip format (a legacy file): load it the safe way
        load(path, map_location="cpu")
        return
    bad = [name for name in unsafe if name not in ALLOWED]
    if bad:
        raise refusal(path, bad)


def load(path: str, **kwargs):
    """torch.load(path, weights_only=True) with the allowed types; UnsafeCheckpoint for a file that would run code."""
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except ValueError:                           # a legacy file: its globals are known only while loading
        unsafe = ALLOWED
    bad = [name for name in unsafe if name not in ALLOWED]
    if bad:
        raise refusal(path, bad)
    _register({*unsafe, *(name for name in ALLOWED if name.startswith("numpy."))})   # a dtype's class: built, not named
    try:
        return torch.load(path, weights_only=True, **kwargs)
    except pickle.UnpicklingError as e:
        raise refusal(path, re.findall(r"GLOBAL ([\w.]+)", str(e))) from None
