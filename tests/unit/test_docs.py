"""Docs a user can trust: every command shown runs through the parser that would receive it, the key reference is
the config's own and complete, the README stays short, and no tool's help shows a hidden subcommand."""
import contextlib
import io
import re

import pytest
import yaml

from tests.support.doc_commands import ROOT, SKIP, CommandError, check, commands, help_text

README_MAX_LINES = 300


def test_every_command_shown_in_the_docs_parses():
    """Each command of the README, docs/*.md and the configs' headers, placeholders substituted, goes through its
    parser (tests/support/doc_commands.py); a wrong one fails with where it is shown and what its parser said."""
    shown = commands()
    assert len(shown) > 60, shown   # the finder finds them: README alone shows dozens
    failures, checked = [], {}
    for where, command in shown:
        try:
            checked[command] = check(command)
        except (CommandError, ValueError, SyntaxError) as e:
            failures.append(f"{where}: {command}\n    {e}")
    skipped = sorted({how for how in checked.values() if how.startswith("skipped")})
    print(f"{len(checked)} commands checked; skipped: {skipped}")
    assert not failures, "\n".join(failures)
    for launcher in ("DeepSpeed's runner", "torchrun's parser"):   # each under the supervisor
        assert any(how.startswith(f"launch/pretrain.sh --dry-run, then pretrain.supervision's parser, then {launcher}, "
                                  f"then pretrain.train") for how in checked.values()), launcher
    assert all(reason for reason in SKIP.values())   # each skip says why


def test_the_checker_refuses_what_a_parser_refuses():
    """The wrong commands the docs showed before, each caught by its own parser."""
    wrong = {"deepspeed --num_gpus 2 -m pretrain.train configs/demo-cpu.yaml": "deepspeed",
             "python tools/convert.py to-releese runs/demo out": "invalid choice",
             "launch/pretrain.sh configs/nope.yaml": "not found",
             "python -m pretrain.config configs/demo-cpu.yaml train.learning_rate=1": "did you mean 'train.lr'",
             "python tools/lm_eval.py --tasks x": "does not exist",
             "make no-such-target": "No rule",
             "sbatch --ntasks-per-node=8 --cpus-per-task=64 launch/slurm.sbatch configs/demo-cpu.yaml":
                 "Requested node configuration is not available"}
    for command, needle in wrong.items():
        with pytest.raises(CommandError, match=re.escape(needle)):
            check(command)


def test_the_key_reference_is_complete_and_docs_config_md_is_current():
    """`python -m pretrain.config --keys` needs no config; docs/config.md is its markdown; every key that a shipped
    config uses is in it (the mapping-valued ones down to their own keys)."""
    from pretrain.config import reference

    from pretrain.prelaunch import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["--keys", "logging"]) == 0   # python -m pretrain.config --keys logging: no config given
    assert "logging.profile.start  (int, required)" in out.getvalue() and "model." not in out.getvalue()
    assert "train.lr  (float, default 0.0003)" in reference.text("train")
    assert (ROOT / "docs" / "config.md").read_text() == reference.markdown(), \
        "docs/config.md is stale: python -m pretrain.config --keys --markdown > docs/config.md"
    known = set(reference.keys())
    assert {"model.mixer", "train.lr", "data.sources", "deepspeed.zero_optimization", "logging.wandb.project"} <= known
    for path in sorted((ROOT / "configs").glob("*.yaml")) + sorted((ROOT / "configs" / "variants").glob("*.yaml")):
        tree = yaml.safe_load(path.read_text())
        for section, values in tree.items():
            used = [section] if not isinstance(values, dict) else [f"{section}.{k}" for k in values]
            used += [f"{section}.{k}.{sub}" for k, v in (values if isinstance(values, dict) else {}).items()
                     if isinstance(v, dict) and f"{section}.{k}.{next(iter(v), '')}" in known or False
                     for sub in v]
            assert set(used) <= known, (path.name, set(used) - known)


def test_readme_stays_short_and_tools_hide_nothing_in_their_help():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines: link out to docs/ instead"
    for tool in sorted((ROOT / "tools").glob("*.py")):
        if tool.name == "__init__.py":
            continue
        text = help_text(tool)
        assert "SUPPRESS" not in text and "_rank" not in text, (tool.name, text[:2000])


def test_study_presets_have_a_documented_schema():
    """tools/ablate.py's help lists a preset's keys; every shipped preset uses only those, and a misspelt key is one
    line naming it."""
    from model import ConfigError
    from tools import ablate

    for key in ablate.PRESET_KEYS:
        assert re.search(rf"^    {key} ", ablate.__doc__, re.M), key
    for preset in sorted((ROOT / "configs" / "studies").glob("*.yaml")):
        assert set(yaml.safe_load(preset.read_text())) <= set(ablate.PRESET_KEYS), preset.name
    bad = ROOT / "configs" / "studies" / "cpu.yaml"
    with pytest.raises(ConfigError, match="did you mean 'study.steps'"):
        ablate.check_keys({**yaml.safe_load(bad.read_text()), "stpes": 3}, "study", ablate.PRESET_KEYS, str(bad))
