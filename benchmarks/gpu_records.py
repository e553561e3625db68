"""The GPU records (docs/gpu/<date>-<commit>-<device>/part<k>/): what a GPU part writes as each point finishes, which
code and machine measured it, and reading them back (benchmarks/gpu_queue.py says from them which points stand).

A part's folder holds points.jsonl, one row per measured point appended as it finishes ({part, key, spec, result,
machine, tree, wall_s, at}: what a part cut short keeps), and census.json, rewritten from those rows after each one
(`write_index`): {commit, tree, device, torch (the census's: null, counted later on a CPU), census_version, parts:
{part: [keys measured without error]}, configurations: {key: {spec, census, machine, tree, wall_s, at}}, failed}.

- machine(): what moves a figure on the measuring side: the device, torch, CUDA, triton and DeepSpeed versions and
  the environment that steers the compiler and kernels (ENV_PREFIXES); `boot` (the kernel's boot id) tells one
  machine's session from another's, so that a ratio's two points are known to come from one run.
- tree_state(): the commit measured and a digest of the code (every tracked file outside docs/): from git; where
  the tree was copied without .git, from the stamp (STAMP, `benchmarks/gpu_window.py --dry-run` writes it before
  the copy: the commit, the file list and their digest), checked against the files; else $GPU_COMMIT or "unknown".
  Two points of one digest ran the same code, whatever the commit says.
"""
from __future__ import annotations

import datetime
import glob
import hashlib
import json
import os
import re
import subprocess

from benchmarks.kernel_census import CENSUS_VERSION, key

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORDS = os.path.join(ROOT, "docs", "gpu")
STAMP = ".gpu-window.json"   # in the tree's root; not committed (each dry run writes it afresh)
ENV_PREFIXES = ("SYNTHFORMER_", "TORCHINDUCTOR_", "TORCHDYNAMO_", "TORCH_COMPILE", "PYTORCH_CUDA_ALLOC_CONF",
                "NVIDIA_TF32_OVERRIDE", "CUBLAS_", "CUDNN_", "TORCH_CUDNN_", "TORCH_BLAS_")
COMPARED = ("device", "torch", "cuda", "triton", "deepspeed", "env")   # a point stands only where these are equal


def boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None


def steering_env(environ=None) -> dict:
    environ = os.environ if environ is None else environ
    return {k: v for k, v in sorted(environ.items()) if k.startswith(ENV_PREFIXES)}


def machine(device: str | None = None) -> dict:
    """This machine's side of a measurement (module docstring); `device`: the GPU's name (default CUDA device 0's)."""
    from importlib.metadata import PackageNotFoundError, version

    import torch

    def installed(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return None
    if device is None and torch.cuda.is_available():
        device = torch.cuda.get_device_name(0)
    return {"device": device, "torch": torch.__version__, "cuda": torch.version.cuda,
            "triton": installed("triton"), "deepspeed": installed("deepspeed"), "env": steering_env(),
            "boot": boot_id()}


def differences(then: dict, now: dict | None, compare=COMPARED) -> list[str]:
    """What of `compare` differs between a point's machine and this one (None: no machine to compare with); a
    version a record did not keep is not compared."""
    if now is None:
        return []
    out = []
    for k in compare:
        if k in then and then[k] is not None and now.get(k) is not None and then[k] != now[k]:
            out.append(f"{k} {then[k]} here {now[k]}" if k != "env" else f"environment {then[k]} here {now[k]}")
    return out


def short_device(name: str | None) -> str:
    """"NVIDIA H100 80GB HBM3" → h100, "NVIDIA H200" → h200; no device → cpu."""
    if not name:
        return "cpu"
    found = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Za-z]?)\b", name)
    return (found.group(1) if found else re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-")).lower()


# ---- the code measured ---------------------------------------------------------------------------------------------
def git(root: str, *args: str) -> str | None:
    try:
        r = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
    except OSError:
        return None
    return r.stdout if r.returncode == 0 else None


def code_files(root: str) -> list[str] | None:
    """The tracked files outside docs/ (None without git)."""
    listed = git(root, "ls-files")
    if listed is None:
        return None
    return sorted(p for p in listed.splitlines() if p and not p.startswith("docs/"))


def tree_digest(root: str, files: list[str]) -> str:
    h = hashlib.sha256()
    for path in files:
        full = os.path.join(root, path)
        h.update(path.encode() + b"\0")
        if os.path.isfile(full):
            with open(full, "rb") as f:
                h.update(hashlib.sha256(f.read()).digest())
        else:
            h.update(b"missing")
    return h.hexdigest()[:16]


def read_stamp(root: str) -> dict | None:
    path = os.path.join(root, STAMP)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def write_stamp(root: str = ROOT, **extra) -> dict:
    """ROOT/STAMP: the commit, the code's file list and digest (and `extra`, e.g. the queue's verdicts), for a copy
    of the tree without .git. RuntimeError without git."""
    state = tree_state(root, use_stamp=False)
    if state["source"] != "git":
        raise RuntimeError("no git here: the stamp is written where the commit is known (before the tree is copied)")
    stamp = {"commit": state["commit"], "dirty": state["dirty"], "digest": state["digest"],
             "files": code_files(root), "written": now_iso(), **extra}
    with open(os.path.join(root, STAMP), "w") as f:
        json.dump(stamp, f, indent=1)
    return stamp


def tree_state(root: str = ROOT, use_stamp: bool = True) -> dict:
    """{commit, dirty, digest, source} of the code in `root` (module docstring). `dirty`: tracked files differ from
    the commit (the record then names a commit that is not quite what ran)."""
    if os.environ.get("GPU_COMMIT"):
        files = code_files(root) or (read_stamp(root) or {}).get("files")
        return {"commit": os.environ["GPU_COMMIT"], "dirty": None, "source": "GPU_COMMIT",
                "digest": tree_digest(root, files) if files else None}
    files = code_files(root)
    if files is not None:
        commit = (git(root, "rev-parse", "--short", "HEAD") or "unknown").strip()
        status = git(root, "status", "--porcelain", "--untracked-files=no", "--", ".", ":!docs") or ""
        return {"commit": commit, "dirty": bool(status.strip()), "digest": tree_digest(root, files), "source": "git"}
    stamp = read_stamp(root) if use_stamp else None
    if stamp:
        digest = tree_digest(root, stamp["files"])
        same = digest == stamp["digest"]
        return {"commit": stamp["commit"] if same else f"{stamp['commit']}+changed", "digest": digest,
                "dirty": bool(stamp.get("dirty")) or not same, "source": "stamp" if same else "stamp, files changed"}
    return {"commit": "unknown", "dirty": None, "digest": None, "source": "none"}


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def default_out(tree: dict, device: str | None, root: str = ROOT) -> str:
    """docs/gpu/<date>-<commit>-<device>/"""
    return os.path.join(root, "docs", "gpu", f"{datetime.date.today():%Y-%m-%d}-{tree['commit']}-"
                                             f"{short_device(device)}")


# ---- a part's rows and its census.json ------------------------------------------------------------------------------
def read_rows(folder: str) -> list[dict]:
    """points.jsonl's rows; a last line cut by a kill is skipped."""
    path = os.path.join(folder, "points.jsonl")
    rows = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    return rows


def append_row(out: str, row: dict) -> None:
    """One measured point onto out/points.jsonl, on disk before anything else runs; then census.json again."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "points.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())
    write_index(out)


def write_index(out: str) -> str:
    """out/census.json from out/points.jsonl (module docstring), written whole and then renamed over the old one."""
    rows = [r for r in read_rows(out) if "part" in r]
    newest = {}
    for r in rows:
        newest[(r["part"], key(r["spec"]))] = r
    last = rows[-1] if rows else {}
    record = {"commit": last.get("tree", {}).get("commit"), "tree": last.get("tree"),
              "device": last.get("machine", {}).get("device"), "torch": None, "census_version": CENSUS_VERSION,
              "error": "not counted here: the census is counted on a CPU at the commit (make gpu-queue)",
              "parts": {}, "configurations": {}, "failed": {}}
    for (part, k), r in newest.items():
        error = r["result"].get("error")
        if error:
            record["failed"][k] = error
            continue
        record["parts"].setdefault(str(part), []).append(k)
        record["configurations"][k] = {"spec": r["spec"], "census": None, "machine": r.get("machine"),
                                       "tree": r.get("tree"), "wall_s": r.get("wall_s"), "at": r.get("at")}
    record["parts"] = {p: sorted(keys) for p, keys in sorted(record["parts"].items())}
    path = os.path.join(out, "census.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f, indent=1)
    os.replace(path + ".tmp", path)
    return path


# ---- reading the records back ---------------------------------------------------------------------------------------
def history_depth(commit: str | None) -> int:
    """How many commits lead to `commit` (git rev-list --count); -1 where git does not know it."""
    out = git(ROOT, "rev-list", "--count", str(commit)) if commit else None
    return int(out) if out and out.strip().isdigit() else -1


def records(root: str = RECORDS) -> list[tuple[str, dict]]:
    """(folder, census.json) of every record, oldest first: by the folder's date (<date>-<commit>-<device>), then by
    the record's commit in git's history (two records of one day: the later commit is the newer)."""
    paths = glob.glob(os.path.join(root, "*", "census.json")) + glob.glob(os.path.join(root, "*", "*", "census.json"))
    out = []
    for path in paths:
        with open(path) as f:
            out.append((os.path.dirname(path), json.load(f)))
    return sorted(out, key=lambda r: (os.path.relpath(r[0], root)[:10], history_depth(r[1].get("commit")),
                                      os.path.relpath(r[0], root)))


def measurements(root: str = RECORDS) -> dict[str, list[dict]]:
    """{key: [measurement, ...] newest first}: every configuration a record measured without error, in any part,
    keyed as today (a record made before compiled points had keys of their own is keyed again from its specs).
    A measurement: {folder, part, key, spec, commit, digest, machine, run, wall_s, record}; `run` is the machine's
    boot id, or the folder where none was kept."""
    out: dict[str, list[dict]] = {}
    for folder, record in records(root):
        for part, keys in record["parts"].items():
            for k in keys:
                conf = record["configurations"][k]
                tree = conf.get("tree") or {}
                found = conf.get("machine") or {"device": record.get("device")}
                m = {"folder": folder, "part": int(part), "key": key(conf["spec"]), "spec": conf["spec"],
                     "commit": tree.get("commit") or record["commit"], "digest": tree.get("digest"),
                     "machine": found, "run": found.get("boot") or folder, "wall_s": conf.get("wall_s"),
                     "record": record}
                out.setdefault(m["key"], []).insert(0, m)
    return out


def result_of(m: dict) -> dict | None:
    """The result a measurement's folder (or a part folder in it, as records kept them before) keeps for its key."""
    folders = [m["folder"]] + sorted(glob.glob(os.path.join(m["folder"], "*", "")))
    rows = [r for f in folders for r in read_rows(f) if "spec" in r and key(r["spec"]) == m["key"]]
    return rows[-1]["result"] if rows else None
