"""lm-evaluation-harness's own CLI, with the `synthformer` model registered and the repository's tasks/ included.

    python tools/run_lm_eval.py --model synthformer --model_args path=runs/demo-release --tasks austen_cloze,austen_mc4
    python tools/run_lm_eval.py --model synthformer --model_args path=runs/demo,batch_size=32 --tasks austen_cloze \\
        --output_path runs/demo/eval                      # a DeepSpeed run directory works too (newest checkpoint)
    python tools/run_lm_eval.py ls tasks                      # lm-eval's other subcommands pass through

Every argument goes to lm-eval 0.4.13's CLI unchanged (`lm-eval run --help` lists them). The plain `lm_eval` command
cannot see this model: lm-eval looks models up in an in-process registry filled by imports (it reads no entry points,
lm_eval/api/registry.py), so this wrapper imports evaluation.lm_eval_adapter first. It adds `--include_path tasks/`
(absolute, so any working directory works) unless you give --include_path yourself, and --device for the device
that exists (cuda:0, else cpu; lm-eval's own default is cuda:0) unless you give --device. Nothing is fetched for the local
tasks; set HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 to make sure no other task tries. model_args of `synthformer`:
see evaluation/lm_eval_adapter.py (path, tokenizer, batch_size, device, dtype, newline, rolling_context, max_gen_toks).
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = os.path.join(ROOT, "tasks")
SUBCOMMANDS_WITH_TASKS = ("run", "ls", "validate")


def with_defaults(argv: list[str]) -> list[str]:
    """argv with the subcommand made explicit (lm-eval inserts `run` the same way) and --include_path tasks/."""
    argv = list(argv)
    if argv and argv[0] not in SUBCOMMANDS_WITH_TASKS and argv[0] not in ("-h", "--help"):
        argv.insert(0, "run")
    if argv and argv[0] in SUBCOMMANDS_WITH_TASKS and not any(a.split("=")[0] == "--include_path" for a in argv):
        argv[1:1] = ["--include_path", TASKS]
    if argv and argv[0] == "run" and not any(a.split("=")[0] == "--device" for a in argv):
        argv[1:1] = ["--device", default_device()]   # lm-eval's own default is cuda:0, also without a GPU
    return argv


def default_device() -> str:
    import torch

    return "cuda:0" if torch.cuda.is_available() else "cpu"


def model_paths(argv: list[str]) -> list[str]:
    """The path=... values among the --model_args/-a words (`k=v,k2=v2` or `k=v k2=v2`; JSON ones are skipped)."""
    paths, inside = [], False
    for word in argv:
        if word.startswith("-"):
            inside = word.split("=")[0] in ("--model_args", "-a")
            word = word.split("=", 1)[1] if inside and "=" in word else ""
        if inside and not word.lstrip().startswith("{"):
            paths += [kv[5:] for kv in word.split(",") if kv.startswith("path=")]
    return paths


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        print("lm-eval's own help follows (`python tools/run_lm_eval.py run --help` for the evaluation options).\n")
    for path in model_paths(argv):   # fail in a second, not after lm-eval has indexed its thousands of tasks
        if not os.path.exists(path):
            print(f"error: model_args path={path} does not exist; give a release directory or a DeepSpeed "
                  f"checkpoint (run directory, its checkpoints/ or a step_* directory)", file=sys.stderr)
            return 2
    from model import ConfigError

    import evaluation.lm_eval_adapter  # noqa: F401 -- registers "synthformer"
    from lm_eval.__main__ import cli_evaluate

    sys.argv = [sys.argv[0]] + with_defaults(argv)
    try:
        cli_evaluate()
    except ConfigError as e:   # a bad path or model_arg: one line, like every tool here
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
