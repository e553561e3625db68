"""Config files: YAML with `base:` chains, read into one nested dict, and `section.key=value` overrides on top.

`base: other.yaml` (relative to the file) is merged recursively under the file, so a variant is a few lines; each
file's keys are checked by the caller's `check(tree, source)` as it is read, so that an error names the file.
Values are YAML: `3e-4` is a float (YAML 1.1 would want `3.0e-4`), `[random, dot]` a list, `null` None.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Callable

import yaml

from model.config import ConfigError


class Loader(yaml.SafeLoader):
    """SafeLoader that also reads `3e-4` as a float: YAML 1.1 insists on `3.0e-4`, and LRs are written the short way."""


Loader.add_implicit_resolver("tag:yaml.org,2002:float",
                             re.compile(r"^[-+]?(?:\d[\d_]*(?:\.\d*)?|\.\d+)[eE][-+]?\d+$"), list("-+.0123456789"))


def merge(base: dict, over: dict) -> dict:
    """`over` on top of `base`: mappings merge recursively, anything else (lists, null) replaces."""
    out = dict(base)
    for k, v in over.items():
        if isinstance(out.get(k), dict) and (v is None or isinstance(v, dict)):  # an empty `train:` changes nothing
            out[k] = merge(out[k], v or {})
        else:
            out[k] = v
    return out


def read(path: str, check: Callable[[dict, str], None], chain: tuple[str, ...] = ()) -> dict:
    """One YAML file with its `base:` chain merged underneath, each file checked by `check` as it is read."""
    path = os.path.normpath(path)
    if path in chain:
        raise ConfigError(f"config 'base' cycle: {' -> '.join(chain + (path,))}")
    via = f" (the base: of {chain[-1]})" if chain else ""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}{via}") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}{via}: {e.strerror}") from None
    try:
        tree = yaml.load(text, Loader=Loader) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}: invalid YAML{where}: {getattr(e, 'problem', None) or e}") from None
    base = tree.pop("base", None) if isinstance(tree, dict) else None
    check(tree, path)
    if base is None:
        return tree
    if not isinstance(base, str):
        raise ConfigError(f"{path}: base={base!r} must be the path of one YAML file")
    return merge(read(os.path.join(os.path.dirname(path), base), check, chain + (path,)), tree)


def override(item: str) -> tuple[str, str, object]:
    """(section, key, value) of one `section.key=value`; the value parsed as YAML (3e-4, true, null, [random, dot])."""
    key, eq, text = item.partition("=")
    section, _, name = key.partition(".")
    if not eq or not section:
        raise ConfigError(f"override '{item}' must look like section.key=value (e.g. train.lr=3e-4)")
    try:
        return section, name, yaml.load(text, Loader=Loader)
    except yaml.YAMLError:
        raise ConfigError(f"override '{item}': the value is not a YAML scalar or list") from None
