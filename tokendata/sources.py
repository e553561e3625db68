"""The sources of a train stream: one shard set (data.shard_dir) or several blended by weight (data.sources), each
with its manifest, where its files are, and which of its shards are good; and the rules between them.

    Source(path, weight=1.0, name=None)   name None: the one source of data.shard_dir (sample ids unprefixed)
    as_sources(spec)                      a location, or a list of Source / {"name", "path", "weight"}
    as_stages(spec, names, weights0)      data.stages: [(first step, [weight of each source])], checked
    stage_lengths(spec, first)            data.seq_len and data.stages' seq_len: [(key, first step, L)]
    decay_stage(spec)                     the step of the stage that starts train.decay=wsd's decay, or None
    check_joined(sources, stages)         a source of weight 0 is weighed by a stage (it joins there)
    open_sources(sources, cache_dir, verify)  [Opened]: manifests read (once: Opened ones are taken as they are),
                                          checked against each other (`check_agree`)
    good_shards(opened, bad_shards)       the size check of every source's shards at once (the orders of older
                                          checkpoints; a new run requests nothing per shard before reading it)
"""
from __future__ import annotations

import dataclasses
import difflib
import re

from tokendata import remote
from tokendata.shard_files import ShardFiles, fix
from tokendata.shards import MAKE, DataError, need, read_manifest

# What every source of one run must share: the model reads them all with one tokenizer and one length.
SHARED = (("tokenizer_sha256", "tokenizer"), ("vocab_size", "vocabulary size"), ("seq_len", "seq_len"),
          ("eos_id", "eos id"), ("dtype", "token dtype"))
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")   # it names metrics (val/<name>/loss) and prefixes sample ids
SOURCE_KEYS = ("name", "path", "weight")
STAGE_KEYS = ("step", "weights", "decay", "seq_len")


@dataclasses.dataclass(frozen=True)
class Source:
    path: str
    weight: float = 1.0
    name: str | None = None

    @property
    def label(self) -> str:
        return f"source '{self.name}' ({self.path})" if self.name else self.path


def as_sources(spec) -> list[Source]:
    """[Source] from a location (one unnamed source) or a list of Source or {"name", "path", "weight"} (data.sources:
    each one-line error names the entry and the key)."""
    if isinstance(spec, str):
        return [Source(spec)]
    need(isinstance(spec, (list, tuple)) and spec, f"data.sources must be a non-empty list of {{name, path, weight}}, "
                                                   f"got {spec!r}")
    out = []
    for i, entry in enumerate(spec):
        where = f"data.sources[{i}]"
        if isinstance(entry, dict):
            for key in entry:
                close = difflib.get_close_matches(str(key), SOURCE_KEYS, n=1)
                need(key in SOURCE_KEYS, f"unknown config key '{where}.{key}'; " + (
                    f"did you mean '{where}.{close[0]}'?" if close else f"a source has {', '.join(SOURCE_KEYS)}"))
            for key in SOURCE_KEYS:
                need(key in entry, f"{where} has no '{key}': a source is {{name, path, weight}}")
            entry = Source(entry["path"], entry["weight"], entry["name"])
        need(isinstance(entry, Source), f"{where} must be a mapping {{name, path, weight}}, got {entry!r}")
        need(isinstance(entry.name, str) and bool(NAME.match(entry.name)),
             f"{where}.name={entry.name!r} must be letters, digits, '_', '-' or '.' (it names val/<name>/loss)")
        need(isinstance(entry.path, str) and bool(entry.path), f"{where}.path={entry.path!r} must be a shard "
                                                               f"directory or URL")
        need(isinstance(entry.weight, (int, float)) and not isinstance(entry.weight, bool) and entry.weight >= 0,
             f"{where}.weight={entry.weight!r} must be a number ≥ 0 (weights are proportions: 0.5, 0.3, 0.2 or 5, "
             f"3, 2; 0: the source joins in a data.stages entry that weighs it)")
        need(entry.name not in [s.name for s in out], f"{where}.name={entry.name!r} is used twice: names must differ")
        out.append(Source(entry.path, float(entry.weight), entry.name))
    need(sum(s.weight for s in out) > 0, "data.sources' weights are all 0: give a source of the first stage (from "
                                         "step 0) a weight > 0")
    return out


def as_stages(spec, names: list, weights0: list | None = None) -> list[tuple[int, list[float]]]:
    """data.stages ([{step, weights: {source name: weight ≥ 0}, seq_len, decay}], steps increasing from > 0; a source a
    stage's weights do not name has weight 0 in it; a stage without weights keeps the stage before's) as
    [(first step, [weight of each source, in data.sources' order])]; `weights0`: data.sources' weights (stage 0's)."""
    spec = [] if spec is None else spec
    need(isinstance(spec, (list, tuple)), f"data.stages must be a list of {{step, weights}}, got {spec!r}")
    need(all(not isinstance(e, dict) or "weights" not in e for e in spec) or None not in names,
         "data.stages' weights need data.sources (named sources), not data.shard_dir")
    out, last, before = [], 0, [1.0] * len(names) if weights0 is None else list(weights0)
    for i, entry in enumerate(spec):
        where = f"data.stages[{i}]"
        need(isinstance(entry, dict) and "step" in entry and ({"weights", "seq_len"} & set(entry))
             and set(entry) <= set(STAGE_KEYS), f"{where} must be a mapping {{step, weights[, seq_len][, decay]}} "
             f"or {{step, seq_len}} (e.g. {{step: 1000, weights: {{{names[0]}: 1}}}}), got {entry!r}")
        need(isinstance(entry.get("decay", False), bool), f"{where}.decay={entry.get('decay')!r} must be true (the "
             f"train.decay=wsd decay starts at this stage) or false")
        L = entry.get("seq_len", 1)
        need(isinstance(L, int) and not isinstance(L, bool) and L >= 1, f"{where}.seq_len={L!r} must be an integer "
             f"≥ 1 that divides model.max_seq_len (the stage trains rows of seq_len; docs/data.md)")
        step, weights = entry["step"], entry.get("weights")
        need(isinstance(step, int) and not isinstance(step, bool) and step > last, f"{where}.step={step!r} must be "
             f"an integer > {last}: stages start at increasing steps (stage 0, data.sources' weights, at step 0)")
        if weights is None:   # a change of length alone: the stage before's weights
            out.append((step, list(out[-1][1] if out else before)))
            last = step
            continue
        need(isinstance(weights, dict) and weights, f"{where}.weights must be a mapping {{source name: weight}}")
        for name, w in weights.items():
            near = difflib.get_close_matches(str(name), [str(n) for n in names], 1)
            need(name in names, f"{where}.weights names {name!r}, not a source of data.sources ({', '.join(names)})"
                 + (f": did you mean {near[0]!r}?" if near else ""))
            need(isinstance(w, (int, float)) and not isinstance(w, bool) and w >= 0,
                 f"{where}.weights.{name}={w!r} must be a number ≥ 0 (a proportion)")
        need(sum(weights.values()) > 0, f"{where}.weights are all 0: give a source a weight > 0")
        out.append((step, [float(weights.get(name, 0)) for name in names]))
        last = step
    need(sum(bool(entry.get("decay")) for entry in spec) <= 1, "data.stages: decay=true on more than one stage: "
                                                                "the decay starts once (keep it on one)")
    return out


def stage_lengths(spec, first: int | None) -> list[tuple[str, int, int]]:
    """[(key, first step, L)] of the stages that set a length: data.seq_len (`first`, from step 0) and data.stages'
    seq_len (`as_stages` checked them); a stage without one keeps the stage before's."""
    return ([("data.seq_len", 0, first)] if first is not None else []) + [
        (f"data.stages[{i}].seq_len", e["step"], e["seq_len"]) for i, e in enumerate(spec or []) if "seq_len" in e]


def decay_stage(spec) -> int | None:
    """The first step of the stage of data.stages (checked by `as_stages`) with decay: true, or None."""
    return next((entry["step"] for entry in spec or [] if entry.get("decay")), None)


def check_joined(sources: list[dict], stages: list[tuple[int, list[float]]]) -> None:
    """A source of weight 0 in data.sources must have a weight > 0 in a stage (else it is never read)."""
    for i, s in enumerate(sources):
        need(s["weight"] > 0 or any(weights[i] > 0 for _, weights in stages), f"data.sources[{i}].weight=0 "
             f"(source {s['name']!r}) and no data.stages entry gives it a weight > 0: it would never be read; give "
             f"it a weight, or remove it")


@dataclasses.dataclass
class Opened:
    """A source with its manifest and where its files are (picklable: DataLoader workers fetch for themselves)."""
    source: Source
    manifest: dict
    files: ShardFiles


def open_sources(sources: list, cache_dir: str | None = None, verify: str = "hash") -> list[Opened]:
    """Every source's manifest read and checked; then `check_agree`. `verify`: what is checked of each shard
    (tokendata/shard_files.py VERIFY). A source given as an Opened (the launch check read it) is not read again."""
    opened = []
    for s in sources:
        if isinstance(s, Opened):
            opened.append(Opened(s.source, s.manifest, ShardFiles(s.source.path, s.manifest, cache_dir, verify)))
            continue
        try:
            m = read_manifest(s.path)
        except DataError as e:
            raise type(e)(f"source '{s.name}': {e}" if s.name else str(e)) from None   # a CredentialError stays one
        opened.append(Opened(s, m, ShardFiles(s.path, m, cache_dir, verify)))
        need(m["splits"]["train"]["shards"], f"{s.label} has no train shards (its manifest.json lists none): "
                                             f"rebuild it with {MAKE}")
    check_agree(opened)
    return opened


def check_agree(opened: list[Opened]) -> None:
    """One line naming the source and the key where a source's manifest differs from the first source's in what the
    model shares (SHARED). A key one of the two manifests lacks (older ones have no eos_id) is not compared."""
    first = opened[0]
    for other in opened[1:]:
        for key, what in SHARED:
            a, b = first.manifest.get(key), other.manifest.get(key)
            need(a is None or b is None or a == b,
                 f"data.sources: {other.source.label} has {key}={b!r} but {first.source.label} has {key}={a!r}: "
                 f"every source must share one {what} (rebuild it with {MAKE} and the same tokenizer and --seq-len)")


def good_shards(opened: list[Opened], bad_shards: str) -> tuple[list[dict], list, int]:
    """([per source {split: [(name, samples)] sorted by name}], [(URL, reason) skipped], retries): every listed
    shard less those missing or whose size shows damage: "fail" refuses them, "skip" drops them here, before any order
    is computed. Only sizes are read (remote ones by parallel HEAD requests or their store's size call), of every
    source at once: no shard is opened."""
    listed = [{split: s["shards"] for split, s in o.manifest["splits"].items()} for o in opened]
    urls = [o.files.url(s["name"]) for o, splits in zip(opened, listed) for shards in splits.values() for s in shards]
    checked = opened[0].files.verify != "none"   # data.verify=none: no size check either
    sizes, retries = remote.sizes(urls) if checked else (dict.fromkeys(urls), 0)
    good, skipped = [], []
    for o, splits in zip(opened, listed):
        mine = {split: [] for split in splits}
        for split, shards in splits.items():
            for s in shards:
                path = o.files.url(s["name"])
                size = sizes[path]   # None: the source cannot tell (a pipe: command); checked when read
                if isinstance(size, remote.Missing):
                    reason = ("is missing (listed in manifest.json)" if size == "not found" else
                              f"cannot be read: {size}")
                elif size == 0:
                    reason = "is empty (0 bytes)"
                elif size is not None and s.get("bytes", size) != size:
                    reason = f"has {size} bytes, manifest.json says {s['bytes']}" + (
                        " (truncated?)" if size < s["bytes"] else " (overwritten?)")
                else:
                    mine[split].append((s["name"], s["samples"]))
                    continue
                need(bad_shards == "skip", f"shard {path} {reason}: {fix(o.source.path)}")
                skipped.append((path, reason))
        good.append({split: sorted(shards) for split, shards in mine.items()})
    return good, skipped, retries
