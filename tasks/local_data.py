"""Load a task's local JSONL files, with `data_files` relative to this directory, from any working directory.

lm-eval 0.4.13 hands a task's `dataset_kwargs` straight to `datasets.load_dataset`, which resolves a relative
`data_files` path against the current directory. A task yaml that also says `custom_dataset: !function local_data.load`
gets this function instead: lm-eval finds `local_data.py` next to the yaml (its own `!function` lookup) and calls it
with the task's metadata and dataset_kwargs as keyword arguments. tools/make_tasks.py writes a copy of this file next
to every set of tasks it builds; it needs nothing from the repository.
"""
import os


def load(data_files=None, **_metadata):
    """A DatasetDict of the JSONL files {split: path}; relative paths are taken from this file's directory."""
    import datasets

    if not isinstance(data_files, dict) or not data_files:
        raise ValueError(f"dataset_kwargs.data_files must map split names to JSONL paths, got {data_files!r}")
    here = os.path.dirname(os.path.abspath(__file__))
    files = {split: os.path.join(here, path) for split, path in data_files.items()}   # absolute paths stay as they are
    for path in files.values():
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: task data file missing; rebuild it with tools/make_tasks.py")
    return datasets.load_dataset("json", data_files=files)
