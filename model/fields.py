"""Config fields and their one checker of keys and types, for every config section: `ModelConfig` (model/config.py)
and the training sections (pretrain/config/), wherever a config comes from (YAML, a checkpoint, a release, a
Hugging Face export). Every mistake is a `ConfigError`: one line naming the dotted key, the value and what to do.
"""
from __future__ import annotations

import difflib
import types
from dataclasses import MISSING, field, fields, is_dataclass
from typing import Any, Callable, Union, get_args, get_origin, get_type_hints


class ConfigError(ValueError):
    """A bad configuration value; the message is one line naming the key and the fix."""


def described(help: str, default: Any = MISSING) -> Any:
    """A dataclass field with its docstring; no default means the config must set it."""
    return field(default=default, metadata={"help": help})


def check_keys(mapping: Any, prefix: str, valid: list[str], source: str,
               suggest: Callable[[str], str | None] | None = None) -> None:
    """Every key of `mapping` must be one of `valid`: a typo fails loudly, naming the nearest valid key (`suggest`
    of the dotted key, by default the closest spelling in this section) instead of being silently ignored."""
    if not isinstance(mapping, dict):
        raise ConfigError(f"config section '{prefix}' in {source} must be a mapping, got {mapping!r}")
    for key in mapping:
        if key not in valid:
            dotted = f"{prefix}.{key}"
            if suggest is None:
                close = difflib.get_close_matches(str(key), valid, n=1)
                guess = f"{prefix}.{close[0]}" if close else None
            else:
                guess = suggest(dotted)
            hint = f"did you mean '{guess}'?" if guess else f"valid keys: {', '.join(valid)}"
            raise ConfigError(f"unknown config key '{dotted}' in {source}; {hint}")


def build(cls, mapping: Any, prefix: str, source: str, suggest: Callable[[str], str | None] | None = None):
    """A config section (dataclass `cls`) from a mapping: unknown keys named with the nearest valid one, missing
    required keys named with what they are; a field that is itself a section (`nested`) is built the same way from
    its mapping, under `prefix.field`; then the section's own checks (`__post_init__`, types first)."""
    check_keys(mapping, prefix, [f.name for f in fields(cls)], source, suggest)
    for f in fields(cls):
        if f.name not in mapping and f.default is MISSING and f.default_factory is MISSING:
            raise ConfigError(f"missing required config key '{prefix}.{f.name}' ({f.metadata.get('help', '')}) "
                              f"in {source}")
    values = dict(mapping)
    for name, sub in nested(cls).items():
        if values.get(name) is not None and not isinstance(values[name], sub):   # null: the section is off
            values[name] = build(sub, values[name], f"{prefix}.{name}", source, suggest)
    return cls(**values)


def nested(cls) -> dict[str, type]:
    """{field: its section class} of the fields of dataclass `cls` that are sections themselves (`profile:
    ProfileSection | None`): written in YAML as a mapping of their own keys, or null where None is allowed."""
    out = {}
    for name, want in get_type_hints(cls).items():
        options = get_args(want) if get_origin(want) in (Union, types.UnionType) else (want,)
        sub = next((t for t in options if is_dataclass(t)), None)
        if sub is not None and name in {f.name for f in fields(cls)}:
            out[name] = sub
    return out


def check_types(section: Any, prefix: str) -> None:
    """Check each field of a dataclass against its annotation, naming the key; ints are widened to floats where a
    float is declared (YAML `lr: 1` is an int), tuples accept YAML lists. Range checks stay with each section."""
    hints = get_type_hints(type(section))
    for f in fields(section):
        key, value, want = f"{prefix}.{f.name}", getattr(section, f.name), hints[f.name]
        if want is Any:
            continue
        options = get_args(want) if get_origin(want) in (Union, types.UnionType) else (want,)
        if value is None:
            if type(None) in options:
                continue
            raise ConfigError(f"{key} must be set: {f.metadata.get('help', '')}")
        want = next(t for t in options if t is not type(None))
        if get_origin(want) is tuple and get_args(want)[-1] is Ellipsis:        # tuple[str, ...]: any length
            kind = get_args(want)[0]
            if not isinstance(value, (list, tuple)) or not all(isinstance(v, kind) for v in value):
                raise ConfigError(f"{key}={value!r} must be a list of {kind.__name__}")
            setattr(section, f.name, tuple(value))
        elif get_origin(want) is tuple:
            n = len(get_args(want))
            if not isinstance(value, (list, tuple)) or len(value) != n or not all(is_number(v) for v in value):
                raise ConfigError(f"{key}={value!r} must be a list of {n} numbers")
            setattr(section, f.name, tuple(float(v) for v in value))
        elif want is float and is_number(value):
            setattr(section, f.name, float(value))
        elif not isinstance(value, want) or (want is int and isinstance(value, bool)):
            raise ConfigError(f"{key}={value!r} must be of type {want.__name__}")


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def need(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r} is out of range; allowed: {allowed}")


def nearest_key(key: str, valid: list[str]) -> str | None:
    """The valid dotted key nearest to a mistyped one: the same field in another section (train.tp → parallel.tp), an
    acronym (learning_rate → lr), else by spelling (difflib); None when nothing is close."""
    section, _, leaf = key.rpartition(".")

    def acronym(s: str) -> str:
        return "".join(w[0] for w in s.split("_") if w)

    def score(cand: str) -> float:
        c_section, _, c_leaf = cand.rpartition(".")
        s = difflib.SequenceMatcher(None, key, cand).ratio()
        s += c_leaf == leaf and c_section != section
        s += c_section == section and len(leaf) > 1 and (acronym(leaf) == c_leaf or acronym(c_leaf) == leaf)
        return s

    best = max(valid, key=score)
    return best if score(best) >= 0.6 else None
