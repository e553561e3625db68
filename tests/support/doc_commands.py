"""Every command shown in the docs, through the parser that would receive it (tests/unit/test_docs.py).

Where commands are found, generically, so that new docs are checked without a change here:
- README.md and docs/*.md (with docs/gpu/README.md and docs/study/README.md; the dated GPU records are logs of what
  ran then): every line of a fenced block marked bash/sh/shell/console or unmarked, and every inline `code` span
  whose first word (after VAR=value assignments) is a program of PROGRAMS;
- the header comment of configs/*.yaml and configs/studies/*.yaml: each line that starts with such a program; a
  comment after the command is set off by two spaces and a parenthesis.

Placeholders are substituted (PLACEHOLDERS; an optional `[--opt …]` is kept, `[WORDS]` dropped, `…` is the value `x`
after an option and dropped elsewhere), and a line of options under a command is checked as that command (the one
before it in its file, else the one after) with those options in place of its own. Then:
- `make …`: `make -n` (a recipe that recurses into $(MAKE) would run: the Makefile keeps those on their own lines);
- `launch/pretrain.sh …`: the script's own argument handling with `--dry-run`, then the command it prints, checked
  in turn (the DeepSpeed runner, pretrain.supervision);
- `deepspeed …` / `python -m deepspeed.launcher.runner …`: DeepSpeed's runner's `parse_args`, then what it would start
  (`--module M`, `--no_python` a program, or a script);
- `torchrun …` / `python -m torch.distributed.run …`: torch.distributed.run's parser, then what it would start;
- `sbatch [options] SCRIPT CONFIG …`: the faked sbatch of tests/support/fake_slurm.py reads the script's #SBATCH
  lines with the command line's options and refuses what its cluster (4 nodes of 8 GPUs, 192 CPUs) cannot grant;
  then the config with its overrides is loaded (the job is not run);
- `python -m pretrain.train CONFIG overrides`: its parser, load_config; `python -m <module>` (this project's, or
  another package's such as torch's fr_trace), `python tools/*.py`, `python benchmarks/*.py`: the program runs in
  this process until its argparse parser has parsed the arguments (ArgumentParser.parse_args / parse_known_args
  return into a `Parsed` exception), nothing after; `python -c CODE`: compiled;
- after any of those, a `configs/….yaml` argument with `section.key=value` words is loaded with them (load_config).
SKIP names the programs that cannot be checked here, each with its reason; anything else fails as "no checker".
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PYTHONS = ("python", "python3", ".venv/bin/python", "$(VPY)", "$PYTHON")
PROGRAMS = PYTHONS + ("launch/pretrain.sh", "deepspeed", "torchrun", "make", "sbatch")
SKIP = {
    "pip": "installs packages: needs an index (the network) and would change this environment",
    "hf": "the Hugging Face Hub's downloader: needs the network",
    "mkdir": "a coreutils command, not a parser of this project",
    "export": "a shell built-in",
    "grep": "a coreutils command, not a parser of this project",
    "ls": "a coreutils command, not a parser of this project",
    "aws": "the AWS CLI: needs credentials and the network",
    "tensorboard.main": "TensorBoard's server: its own flags (absl), and it serves until stopped",
}
PLACEHOLDERS = [  # (pattern, replacement), in order
    (r"\bCONFIG\b", "configs/demo-cpu.yaml"), (r"\$SLURM_NNODES\b", "2"), (r"\$SLURM_NODEID\b", "0"),
    (r"\$i\b", "0"), (r"<i>", "0"), (r"<first node>|<node 0>", "127.0.0.1"), (r"(?<![\w/.-])N(?![\w/.-])", "2"),
    (r"(?<![\w/.-])R(?![\w/.-])", "0"), (r"(?<=PART=)k\b", "1"), (r"\bRUN\b", "runs/demo"), (r"\bDIR\b", "runs/demo"),
    (r"\$PWD\b", str(ROOT)),
    (r"\bruns/[\w.-]+/config\.yaml\b", "configs/demo-cpu.yaml"),   # a run's config an earlier command wrote (branch.py)
]
MISSING_MODEL = "tests/data/pre_redesign/release"   # a real release, for model paths that a tool checks before parsing


class Parsed(Exception):
    """An argparse parser parsed the arguments: the program stops here."""


class CommandError(AssertionError):
    pass


# ---- finding the commands --------------------------------------------------------------------------------------------
def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "docs" / "gpu" / "README.md",
            ROOT / "docs" / "study" / "README.md"]


def config_files() -> list[Path]:
    return sorted((ROOT / "configs").glob("*.yaml")) + sorted((ROOT / "configs" / "studies").glob("*.yaml"))


def first_word(line: str) -> str:
    words = line.split()
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        words = words[1:]
    return words[0] if words else ""


def from_markdown(path: Path) -> list[str]:
    lines, out, fence, pending = path.read_text().splitlines(), [], None, ""
    for line in lines:
        if line.lstrip().startswith("```"):
            fence = None if fence is not None else line.strip()[3:].strip()
            continue
        if fence is not None:
            if fence in ("", "bash", "sh", "shell", "console"):
                text = pending + line.strip().removeprefix("$ ")
                if text.endswith("\\"):
                    pending = text[:-1] + " "
                    continue
                pending = ""
                if text and not text.startswith("#"):
                    out.append(text)
            continue
        for span in re.findall(r"`([^`\n]+)`", line):
            if first_word(span) in PROGRAMS and (len(span.split()) > 1 or first_word(span) == "make"):
                out.append(span)
    return out


def from_config_header(path: Path) -> list[str]:
    out = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        text = re.split(r"\s{2,}\(", line.lstrip("#").strip())[0]
        if first_word(text) in PROGRAMS or first_word(text).split("/")[0] in ("tools", "benchmarks"):
            out.append(text)
    return out


def commands() -> list[tuple[str, str]]:
    """(where, command) of every command shown, placeholders substituted, option lines made whole."""
    out = []
    for path in doc_files() + config_files():
        found = [substituted(text) for text in (from_markdown(path) if path.suffix == ".md" else
                                                from_config_header(path))]
        for i, text in enumerate(found):
            if text.startswith("-"):   # options under a command: the one before, else the first after it
                before = [t for t in found[:i] if not t.startswith("-")]
                base = before[-1] if before else next((t for t in found[i:] if not t.startswith("-")), None)
                if base is None:
                    raise CommandError(f"{path.name}: options without a command to check them with: {text}")
                text = with_options(base, text)
            out.append((str(path.relative_to(ROOT)), text))
    return list(dict.fromkeys(out))


def substituted(text: str) -> str:
    # an optional option `[--opt value]` is kept, without its brackets (its value may be quoted)
    text = re.sub(r"(?<![\w=:,])\[(--?\w[^\[\]]*)\]", lambda m: m.group(1) if "..." not in m.group(1) else "", text)
    parts = re.split(r"(\"[^\"]*\"|'[^']*')", text)   # outside quotes only: a YAML list inside them stays
    for i in range(0, len(parts), 2):
        part = re.sub(r"(?<![\w=:,])\[[^\[\]]*\]", "", parts[i])   # [WORDS], [section.key=value ...]: left out
        for pattern, value in PLACEHOLDERS:
            part = re.sub(pattern, value, part)
        parts[i] = part
    return "".join(parts)


def with_options(base: str, fragment: str) -> str:
    """`base` with the options of `fragment` (a line of options shown under it) in place of its own."""
    words, new = shlex.split(base, comments=True), shlex.split(fragment, comments=True)
    given = {w for w in new if w.startswith("--")}
    kept, skipping = [], False
    for w in words:
        if w.startswith("--"):
            skipping = w in given
        if not skipping:
            kept.append(w)
    return shlex.join(kept + new)


# ---- checking one command --------------------------------------------------------------------------------------------
def check(command: str) -> str:
    """What checked `command` (a word for the report); a CommandError saying why it does not parse."""
    words = shlex.split(command, comments=True)
    cut = [i for i, w in enumerate(words) if w in (">", ">>", "|", "&&", ";") or w.startswith(("2>", "1>"))]
    words = words[:cut[0]] if cut else words   # the command itself, not where its output goes
    env = {}
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    # `…` after an option is its value (a placeholder word), anywhere else it stands for more of the same: dropped
    words = [("x" if i and words[i - 1].startswith("-") else None) if w in ("…", "...") else w
             for i, w in enumerate(words)]
    words = [w for w in words if w is not None]
    return check_words(words, env)


def check_words(words: list[str], env: dict) -> str:
    program, args = words[0], words[1:]
    if program in SKIP:
        return f"skipped: {SKIP[program]}"
    if program == "make":
        r = subprocess.run(["make", "-n", *args], cwd=ROOT, capture_output=True, text=True,
                           env={**os.environ, **env}, timeout=60)
        if r.returncode:
            raise CommandError(f"make -n {' '.join(args)}: {r.stderr.strip()[-500:]}")
        return "make -n"
    if program == "launch/pretrain.sh":
        r = subprocess.run([str(ROOT / program), "--dry-run", *args], cwd=ROOT, capture_output=True, text=True,
                           env={**os.environ, "NPROC": "2", "PYTHON": "python", **env}, timeout=60)
        if r.returncode:
            raise CommandError(f"launch/pretrain.sh: {(r.stdout + r.stderr).strip()[-500:]}")
        return "launch/pretrain.sh --dry-run, then " + check_words(r.stdout.splitlines(), env)
    if program == "deepspeed":
        return deepspeed(args, env)
    if program == "torchrun":
        return torchrun(args, env)
    if program == "sbatch":
        return sbatch(args)
    if program in PYTHONS:
        if args[:2] == ["-m", "deepspeed.launcher.runner"]:
            return deepspeed(args[2:], env)
        if args[:2] == ["-m", "torch.distributed.run"]:   # torchrun, as launch/pretrain.sh starts it
            return torchrun(args[2:], env)
        if args[:1] == ["-m"]:
            return module(args[1], args[2:], env)
        if args[:1] == ["-c"]:
            compile(args[1], "<python -c>", "exec")
            return "compiled"
        return script(args[0], args[1:])
    raise CommandError(f"no checker for the program {program!r}: add one to tests/support/doc_commands.py, or a SKIP entry "
                       f"with the reason it cannot be checked")


def deepspeed(args: list[str], env: dict) -> str:
    from deepspeed.launcher.runner import parse_args

    a = parse_or_fail(lambda: parse_args(args), "deepspeed")
    if a.module:
        return "DeepSpeed's runner, then " + module(a.user_script, a.user_args, env)
    if a.no_python:
        return "DeepSpeed's runner, then " + check_words([a.user_script, *a.user_args], env)
    return "DeepSpeed's runner, then " + script(a.user_script, a.user_args)


def torchrun(args: list[str], env: dict) -> str:
    from torch.distributed.run import get_args_parser

    a = parse_or_fail(lambda: get_args_parser().parse_args(args), "torchrun")
    start = [a.training_script, *a.training_script_args]
    if a.module:
        return "torchrun's parser, then " + module(start[0], start[1:], env)
    if a.no_python:
        return "torchrun's parser, then " + check_words(start, env)
    return "torchrun's parser, then " + script(start[0], start[1:])


def sbatch(args: list[str]) -> str:
    from tests.support.fake_slurm import Rejected, allocate, request

    try:
        job, script = request(args, cwd=str(ROOT))
        allocate(job, 1)
    except Rejected as e:
        raise CommandError(str(e)) from None
    config_args(script[0], script[1:], required=True)
    return "the faked sbatch (its #SBATCH lines and the command line's options on its cluster), then the config"


def module(name: str, args: list[str], env: dict) -> str:
    if name in SKIP:
        return f"skipped: {SKIP[name]}"
    if name.split(".")[0] in ("pip",):
        return f"skipped: {SKIP['pip']}"
    if name == "pretrain.train":   # its parser: the config and its overrides (--local_rank from a launcher dropped)
        config_args(name, [a for a in args if not a.startswith("--local_rank")], required=True)
        return "pretrain.train's load_config"
    ns = run_parser(lambda: runpy.run_module(name, run_name="__main__", alter_sys=True), [name, *args], name)
    if name == "pretrain.supervision":
        inner = [w for w in ns.command if w != "--"]   # none: its --help, or --classify
        return "pretrain.supervision's parser" + (", then " + check_words(inner, env) if inner else "")
    config_args(name, args)
    return f"python -m {name}'s parser"


def script(path: str, args: list[str]) -> str:
    full = ROOT / path
    if not full.is_file():
        raise CommandError(f"{path} does not exist")
    args = [f"path={MISSING_MODEL}" if a.startswith("path=") and not (ROOT / a[5:]).exists() else
            re.sub(r"(?<=path=)[^,]+", lambda m: m.group(0) if (ROOT / m.group(0)).exists() else MISSING_MODEL, a)
            for a in args]
    run_parser(lambda: runpy.run_path(str(full), run_name="__main__"), [str(full), *args], path)
    config_args(path, args)
    return f"{path}'s parser"


def config_args(where: str, args: list[str], required: bool = False) -> None:
    """A configs/….yaml among `args`, loaded with the section.key=value words after it (a study preset after
    `--preset` is tools/ablate.py's, not a training config)."""
    from pretrain.config import load_config

    configs = [i for i, a in enumerate(args) if a.endswith((".yaml", ".yml")) and "configs/" in a
               and (i == 0 or args[i - 1] != "--preset")]
    if not configs:
        if required:
            raise CommandError(f"{where}: no config file among {args}")
        return
    i = configs[0]
    overrides = [a for a in args[i + 1:] if re.match(r"^[a-z_]+\.[a-z_.]+=", a)]
    try:
        load_config(ROOT / args[i], overrides)
    except ValueError as e:
        raise CommandError(f"{where}: {e}") from None


def parse_or_fail(parse, where: str):
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            return parse()
    except SystemExit as e:
        raise CommandError(f"{where}: exit {e.code}: {err.getvalue().strip()[-600:]}") from None


def run_parser(run, argv: list[str], where: str):
    """Run a program in this process until its argparse parser has parsed `argv`: the namespace."""
    cls, state = argparse.ArgumentParser, {"depth": 0, "strict": False}
    parse_args, parse_known_args = cls.parse_args, cls.parse_known_args

    def strict(self, args=None, namespace=None):
        if state["depth"]:
            return parse_args(self, args, namespace)
        state["strict"] = True
        try:
            ns = parse_args(self, args, namespace)
        finally:
            state["strict"] = False
        raise Parsed(ns)

    def known(self, args=None, namespace=None):
        state["depth"] += 1
        try:
            result = parse_known_args(self, args, namespace)
        finally:
            state["depth"] -= 1
        if not state["depth"] and not state["strict"]:
            raise Parsed(result[0])
        return result

    old_argv, old_cwd = sys.argv, os.getcwd()
    err, out = io.StringIO(), io.StringIO()
    cls.parse_args, cls.parse_known_args, sys.argv = strict, known, list(argv)
    try:
        os.chdir(ROOT)
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            run()
    except Parsed as p:
        return p.args[0]
    except SystemExit as e:
        raise CommandError(f"{where}: exit {e.code} before its arguments were parsed: "
                           f"{(err.getvalue() or out.getvalue()).strip()[-600:]}") from None
    finally:
        cls.parse_args, cls.parse_known_args, sys.argv = parse_args, parse_known_args, old_argv
        os.chdir(old_cwd)
    raise CommandError(f"{where}: returned without parsing its arguments with argparse")


def help_text(path: Path) -> str:
    """`python <tool> --help`, in this process."""
    out = io.StringIO()
    old = sys.argv
    sys.argv = [str(path), "--help"]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            runpy.run_path(str(path), run_name="__main__")
    except SystemExit:
        pass
    finally:
        sys.argv = old
    return out.getvalue()
