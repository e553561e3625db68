"""The nested config sections, logging.profile (ProfileSection) and logging.wandb (WandbSection): one declaration of
their keys drives `--keys` and docs/config.md; YAML, `logging.profile={…}` and `logging.wandb.mode=…` overrides load
to the typed section; a bad key or value is a one-line ConfigError naming the dotted key; null or absent is off; a
run's saved config of the dict form still loads."""
from __future__ import annotations

import contextlib
import dataclasses
import io
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from model.config import ConfigError
from model.fields import described
from pretrain.checkpoints.ds_checkpoint import read_config
from pretrain.config import ProfileSection, TrainConfig, WandbSection, load_config, reference
from pretrain.prelaunch import main

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "demo-cpu.yaml"


def error_of(*args) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(*args)
    assert "\n" not in str(e.value), f"multi-line error: {e.value!r}"
    return str(e.value)


def variant(tmp_path: Path, text: str, name: str = "v.yaml") -> Path:
    p = tmp_path / name
    p.write_text(f"base: {DEMO}\n" + textwrap.dedent(text))
    return p


def keys_output(*args: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["--keys", *args]) == 0
    return out.getvalue()


# ---- one declaration -----------------------------------------------------------------------------------------------
def test_the_reference_lists_each_nested_field_from_its_dataclass():
    """Every field of ProfileSection and WandbSection, and nothing else, is a `logging.<section>.<field>` row with the
    field's own type, default and description, right after its `logging.<section>` row (a mapping or null)."""
    rows = {key: rest for _, _, section in reference.sections() for key, *rest in section}
    order = reference.keys()
    for name, cls in (("profile", ProfileSection), ("wandb", WandbSection)):
        prefix = f"logging.{name}"
        assert rows[prefix][:2] == ["mapping | None", "null"]
        declared = [f"{prefix}.{f.name}" for f in dataclasses.fields(cls)]
        assert [k for k in order if k.startswith(prefix + ".")] == declared
        assert order[order.index(prefix) + 1:order.index(prefix) + 1 + len(declared)] == declared
        for f in dataclasses.fields(cls):
            kind, default, help = rows[f"{prefix}.{f.name}"]
            assert kind == f.type and help == f.metadata["help"]
            assert default == ("required" if f.default is dataclasses.MISSING else reference.shown(f.default))
    assert rows["logging.profile.ranks"][1] == "[0]" and rows["logging.profile.start"][1] == "required"
    assert rows["logging.wandb.mode"][1] == "online" and rows["logging.wandb.tags"][1] == "[]"


def test_changing_the_declaration_changes_keys_and_docs(monkeypatch):
    """`--keys logging.profile` and docs/config.md read the dataclass: a changed description or default of a field
    shows there, with nothing else to edit."""
    old = ProfileSection.__dataclass_fields__["steps"]
    new = described("NEW: optimizer steps in each window", 7)
    new.name, new.type, new._field_type = old.name, old.type, old._field_type
    monkeypatch.setitem(ProfileSection.__dataclass_fields__, "steps", new)
    text = keys_output("logging.profile")
    assert "logging.profile.steps  (int, default 7)\n      NEW: optimizer steps in each window" in text
    assert "logging.wandb" not in text and text.startswith("logging: ")
    assert "| `logging.profile.steps` | int | `7` | NEW: optimizer steps in each window |" in reference.markdown()


@dataclass(kw_only=True)
class Inner:
    size: int = described("the size")
    names: tuple[str, ...] = described("the names", ("a",))


@dataclass(kw_only=True)
class Outer:
    inner: Inner | None = described("a nested one", None)
    after: bool = described("a plain one", False)


def test_a_nested_section_of_any_section_is_listed_under_its_field():
    """The reference's rows of a section with a nested section: the field, then its keys under `field.`."""
    assert reference.section_rows(Outer, "s") == [("s.inner", "mapping | None", "null", "a nested one"),
                                                   ("s.inner.size", "int", "required", "the size"),
                                                   ("s.inner.names", "tuple[str, ...]", "[a]", "the names"),
                                                   ("s.after", "bool", "false", "a plain one")]


# ---- loading -------------------------------------------------------------------------------------------------------
def test_yaml_and_overrides_load_to_the_typed_sections(tmp_path):
    p = variant(tmp_path, """\
        logging:
          profile: {start: 5, steps: 2, ranks: [1]}
          wandb: {project: synth, mode: online}
        """)
    cfg = load_config(p)
    assert cfg.logging.profile == ProfileSection(start=5, steps=2, ranks=(1,), every=None, memory=False)
    assert cfg.logging.wandb == WandbSection(project="synth", entity=None, mode="online", tags=())
    assert type(cfg.logging.profile.ranks) is tuple and type(cfg.logging.wandb.tags) is tuple
    over = load_config(DEMO, ["logging.profile={start: 5, steps: 2, ranks: [1]}",
                              "logging.wandb={project: synth, mode: online, tags: [a, b]}"])
    assert over.logging.profile == cfg.logging.profile and over.logging.wandb.tags == ("a", "b")
    # a nested key on its own: over the file's section, or starting one
    dotted = load_config(p, ["logging.wandb.mode=offline", "logging.profile.steps=4", "logging.profile.every=10"])
    assert dotted.logging.wandb == WandbSection(project="synth", mode="offline")
    assert dotted.logging.profile == ProfileSection(start=5, steps=4, ranks=(1,), every=10)
    assert load_config(DEMO, ["logging.profile.start=3"]).logging.profile == ProfileSection(start=3)
    # the file's mapping merges under an override of the whole mapping, as any section's does
    assert load_config(p, ["logging.profile={start: 9}"]).logging.profile == ProfileSection(start=9, steps=2, ranks=[1])


def test_null_or_absent_is_off(tmp_path):
    assert load_config(DEMO).logging.profile is None and load_config(DEMO).logging.wandb is None
    off = load_config(variant(tmp_path, "logging:\n  profile: null\n  wandb: null\n"))
    assert off.logging.profile is None and off.logging.wandb is None
    assert off.to_dict()["logging"]["profile"] is None and off.to_dict()["logging"]["wandb"] is None


def test_the_saved_config_round_trips_and_an_old_dict_form_still_loads(tmp_path):
    """to_dict (what a checkpoint's config.yaml and W&B get) holds every nested key; a config.yaml that earlier code
    wrote, with only the keys the user gave, loads to the same typed section with the defaults filled in."""
    cfg = load_config(DEMO, ["logging.profile={start: 5, steps: 2, ranks: [1]}", "logging.wandb={project: synth}"])
    saved = cfg.to_dict()
    assert saved["logging"]["profile"] == {"start": 5, "steps": 2, "ranks": [1], "every": None, "memory": False}
    assert saved["logging"]["wandb"] == {"project": "synth", "entity": None, "mode": "online", "tags": []}
    assert yaml.safe_load(yaml.safe_dump(saved)) == saved and TrainConfig.from_dict(saved) == cfg
    old = {**saved, "logging": {**saved["logging"], "profile": {"start": 5, "steps": 2, "ranks": [1]},
                                "wandb": {"project": "synth", "tags": []}}}
    tag = tmp_path / "checkpoints" / "step_00000002"
    tag.mkdir(parents=True)
    (tag / "config.yaml").write_text(yaml.safe_dump(old, sort_keys=False))
    assert read_config(str(tag)) == cfg


# ---- one-line errors naming the dotted key -------------------------------------------------------------------------
@pytest.mark.parametrize("value, expect", [
    ("logging.profile={strat: 3}", "unknown config key 'logging.profile.strat' in {p}; did you mean "
                                   "'logging.profile.start'?"),
    ("logging.profile={steps: 2}", "missing required config key 'logging.profile.start' (the first optimizer step of "
                                   "the window (the step before it runs as the profiler's warm-up)) in {p}"),
    ("logging.profile={start: 5, steps: two}", "logging.profile.steps='two' must be of type int"),
    ("logging.profile={start: 5, steps: 0}", "logging.profile.steps=0 is out of range; allowed: ≥ 1"),
    ("logging.profile={start: 5, memory: 1}", "logging.profile.memory=1 must be of type bool"),
    ("logging.profile={start: 5, ranks: [0, true]}", "logging.profile.ranks=[0, True] is out of range; allowed: a "
                                                     "list of global ranks, e.g. [0, 8]"),
    ("logging.profile={start: null}", "logging.profile.start must be set: the first optimizer step of the window (the "
                                      "step before it runs as the profiler's warm-up)"),
    ("logging.profile=5", "config section 'logging.profile' in {p} must be a mapping, got 5"),
    ("logging.wandb={project: p, mdoe: offline}", "unknown config key 'logging.wandb.mdoe' in {p}; did you mean "
                                                  "'logging.wandb.mode'?"),
    ("logging.wandb={mode: offline}", "missing required config key 'logging.wandb.project' (the W&B project) in {p}"),
    ("logging.wandb={project: p, mode: live}", "logging.wandb.mode='live' is out of range; allowed: online, offline, "
                                               "disabled"),
    ("logging.wandb={project: ''}", "logging.wandb.project='' is out of range; allowed: a W&B project name"),
    ("logging.wandb={project: p, tags: [1]}", "logging.wandb.tags=[1] must be a list of str"),
    ("logging.wandb.mdoe=offline", "unknown config key 'logging.wandb.mdoe' in override 'logging.wandb.mdoe=offline'; "
                                   "did you mean 'logging.wandb.mode'?"),
    ("logging.profile.strat=3", "unknown config key 'logging.profile.strat' in override 'logging.profile.strat=3'; "
                                "did you mean 'logging.profile.start'?"),
    ("logging.wandb.mode=offline", "missing required config key 'logging.wandb.project' (the W&B project) in {p}"),
    ("logging.every.often=3", "unknown config key 'logging.every.often' in override 'logging.every.often=3'; did you "
                              "mean 'logging.every'?"),
])
def test_a_bad_nested_key_or_value_is_one_line_naming_it(value, expect):
    assert error_of(DEMO, [value]) == expect.format(p=DEMO)


def test_a_typo_in_a_files_nested_section_names_that_file(tmp_path):
    """As for any section, the file named is the one with the typo, a base file included."""
    base = variant(tmp_path, "logging:\n  profile: {start: 5, rank: [1]}\n", "base.yaml")
    child = tmp_path / "child.yaml"
    child.write_text("base: base.yaml\n")
    assert error_of(child) == (f"unknown config key 'logging.profile.rank' in {base}; did you mean "
                               "'logging.profile.ranks'?")
    assert error_of(variant(tmp_path, "logging:\n  profile: [5]\n")) == (
        f"config section 'logging.profile' in {tmp_path / 'v.yaml'} must be a mapping, got [5]")


def test_context_parallel_layouts_and_what_it_refuses():
    """parallel.cp: dp = world / (tp·cp·pp); DeepSpeed counts dp × cp ranks for its batch; a one-line error naming the
    keys for what the trainer does not run with it."""
    from pretrain.config.deepspeed_dict import deepspeed_config

    cfg = load_config(DEMO, ["parallel.cp=2"])
    rt = cfg.check_runtime(4)
    ds = deepspeed_config(cfg, rt.dp)
    assert rt.dp == 2 and ds["train_batch_size"] == ds["train_micro_batch_size_per_gpu"] * \
        ds["gradient_accumulation_steps"] * rt.dp * 2
    assert load_config(DEMO, ["parallel.cp=2", "parallel.tp=2"]).check_runtime(4).dp == 1
    assert load_config(DEMO, ["parallel.cp=2", "parallel.pp=2", "parallel.zero_stage=1"]).check_runtime(8).dp == 2
    cp2, sp = ["parallel.cp=2"], ["parallel.tp=2", "parallel.sequence_parallel=true"]
    # sequence parallelism inside a chunk and recomputation run with cp (tests/distributed/test_context_parallel*.py)
    assert load_config(DEMO, cp2 + sp + ["parallel.activation_checkpointing=1"]).check_runtime(4).dp == 1
    for overrides, needles in [(["parallel.cp=3"], ["model.max_seq_len=128", "2·parallel.cp = 6"]),
                               (cp2 + sp + ["model.max_seq_len=132"],   # 132 = 4·33: two chunks of 33, not over tp 2
                                ["model.max_seq_len=132", "2·parallel.cp·parallel.tp = 8",
                                 "parallel.sequence_parallel=false"]),
                               (cp2 + ["train.compile=true"], ["train.compile=false"])]:
        with pytest.raises(ConfigError) as e:
            load_config(DEMO, overrides).check_runtime(12)
        assert "\n" not in str(e.value) and all(n in str(e.value) for n in needles), str(e.value)
