"""Runs of the real trainer for the tests: tiny shards, a config writer, the launcher, and what a run wrote."""
import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import psutil
import yaml
from filelock import FileLock

from pretrain.distributed import free_local_port
from tests.support import warm_ranks
from tools.train_tokenizer import EOS_ID   # the eos of build_shards' tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CORPUS = os.path.join(ROOT, "data", "austen.txt.gz")
PY = sys.executable


def tool(name, *args, env=None):
    r = run_py([PY, os.path.join(ROOT, "tools", name), *map(str, args)],
               env={**os.environ, **(env or {}), "PYTHONPATH": ROOT})   # the project, also where it is not installed
    assert r.returncode == 0, r.stderr
    return r


def run_py(cmd, cwd=ROOT, env=None, timeout=600):
    """`subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)` for a command
    `[PY, SCRIPT.py, args...]` or `[PY, "-m", MODULE, args...]`, its process forked warm (tests/support/warm_ranks.py: run as
    __main__ without paying torch's and DeepSpeed's imports again). Fresh with SYNTHFORMER_TEST_FRESH_RANKS=1, for
    another command, or where env's PYTHONPATH puts more than the project first (a test hiding or faking a package:
    a warm process has imported with the test's path)."""
    cmd, env = [str(c) for c in cmd], dict(os.environ if env is None else env)
    module = len(cmd) > 2 and cmd[1] == "-m"
    path = env.get("PYTHONPATH", ROOT)
    if (warm_ranks.fresh() or cmd[0] != PY or not (module or cmd[1:2] and cmd[1].endswith(".py"))
            or path not in ("", ROOT)):
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    target, argv = (cmd[2], cmd[3:]) if module else (os.path.join(str(cwd), cmd[1]), cmd[2:])
    out, err = (tempfile.NamedTemporaryFile("w+") for _ in range(2))
    with out, err:
        proc = warm_ranks.start(target, argv, env, str(cwd), out, err)
        if proc.wait(timeout) is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise subprocess.TimeoutExpired(cmd, timeout)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(cmd, proc.returncode, out.read(), err.read())


def built_once(tmp_path_factory, name, build):
    """The directory `name`, filled by `build(path)` once per test session, also when pytest-xdist runs the tests
    in several processes: the first worker that needs it builds it under a file lock, the others wait for it and
    read it (pytest-xdist's recipe for session fixtures)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        path = tmp_path_factory.mktemp(name)
        build(path)
        return path
    path = tmp_path_factory.getbasetemp().parent / name      # the session's directory, above the workers' own
    with FileLock(f"{path}.lock"):
        if not (path / ".built").exists():
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir()
            build(path)
            (path / ".built").touch()
    return path


def build_shards(tmp):
    """~60 KB of Austen, a 512-piece tokenizer, seq_len 32, ONE sample per shard: a global batch is then the same
    set of samples whether 1 or 2 data-parallel ranks read it (rank r takes shards r, r+2, …)."""
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        text = f.read(120_000)
    (tmp / "corpus.txt").write_text(text, encoding="utf-8")
    tool("train_tokenizer.py", "--input", tmp / "corpus.txt", "--vocab-size", 512, "--out", tmp / "tokenizer.model",
         "--quiet")
    tool("make_shards.py", "--input", tmp / "corpus.txt", "--tokenizer", tmp / "tokenizer.model", "--out",
         tmp / "shards", "--seq-len", 32, "--samples-per-shard", 1, "--val-fraction", 0.05, "--quiet")
    return str(tmp / "shards")


BLEND = {"a": (0, 60_000, 0.5), "b": (60_000, 100_000, 0.3), "c": (100_000, 103_000, 0.2)}   # (text slice, weight)


def build_blend(tmp, shards):
    """Three shard sets of 8 samples a shard, cut from the trainer tests' text with its tokenizer (build_shards): a
    (~100 train shards), b (~70), and c (~5: it runs out and starts its next epoch within a short run)."""
    src = os.path.dirname(shards)
    text = open(os.path.join(src, "corpus.txt"), encoding="utf-8").read()
    for name, (start, end, _) in BLEND.items():
        (tmp / f"{name}.txt").write_text(text[start:end], encoding="utf-8")
        tool("make_shards.py", "--input", tmp / f"{name}.txt", "--tokenizer", os.path.join(src, "tokenizer.model"),
             "--out", tmp / name, "--seq-len", 32, "--samples-per-shard", 8, "--val-fraction", 0.05, "--quiet")


def blend_sources(blend, **paths):
    """data.sources of the three shard sets (BLEND's weights); `paths` replaces some (a URL serving one)."""
    return [{"name": n, "path": paths.get(n, blend[n]), "weight": w} for n, (_, _, w) in BLEND.items()]


def write_config(path, shards, run_dir, **sections):
    cfg = {"model": {"vocab_size": 512, "d_model": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 32,
                     "mixer": "random+dot"},
           "data": {"shard_dir": shards, "num_workers": 0, "val_batches": 2},
           "parallel": {"zero_stage": 0},
           "train": {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 3, "global_batch_size": 8, "micro_batch_size": 4,
                     "max_steps": 20, "run_dir": str(run_dir), "grad_clip": 1.0},
           "checkpoint": {"every": 100},
           "logging": {"every": 1, "val_every": 0, "image_every": 0}}
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def reference_config(tmp_path, shards, name, **sections):
    """The shared reference run's config (2 ranks, ZeRO-1, 2 data workers each, 40 steps, a checkpoint every 3,
    sample ids recorded, images at step 10, the document mask on): the tests of exact resume, kill -9 and damaged
    checkpoints rerun it with interruptions and compare with the `reference_run` fixture, trained once per session."""
    settings = dict(model={"document_mask": True, "eos_id": EOS_ID},
                    data={"num_workers": 2}, parallel={"zero_stage": 1}, train={"max_steps": 40},
                    checkpoint={"every": 3, "keep": 2},
                    logging={"every": 1, "val_every": 0, "image_every": 10, "sample_ids": True, "sample_tokens": 4})
    for section, values in sections.items():
        settings[section] = {**settings.get(section, {}), **values}
    return write_config(tmp_path / f"{name}.yaml", shards, tmp_path / name, **settings)


def start(config, *overrides, env):
    """Start launch/pretrain.sh in its own session, so that a timeout can kill its trainers too; its stdout and
    stderr go to files, which `output(proc)` reads while it runs."""
    out, err = (tempfile.NamedTemporaryFile("w+", suffix=f".{name}") for name in ("out", "err"))
    proc = subprocess.Popen([os.path.join(ROOT, "launch", "pretrain.sh"), config, *overrides], cwd=ROOT,
                            env={**os.environ, "PYTHON": PY, **env}, stdout=out, stderr=err, text=True,
                            start_new_session=True)
    proc.logs = out, err
    return proc


def output(proc) -> str:
    """What a started launch has printed to stdout so far."""
    with open(proc.logs[0].name) as f:
        return f.read()


def finish(proc, timeout=600):
    """Wait for a started launch; on timeout kill the whole process group so no trainer starves later tests."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    out, err = (open(log.name).read() for log in proc.logs)
    for log in proc.logs:
        log.close()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def spawn(script, args, nproc, timeout=300):
    """Run `python script args` as nproc ranks of one torch.distributed job on this host (the launcher's env)."""
    if warm_ranks.fresh():
        r = ranks([PY, script, *map(str, args)], nproc, {"PYTHONPATH": ROOT}, timeout)
    else:   # forked warm, as run_ranks' trainers
        r = ranks([*map(str, args)], nproc, {"PYTHONPATH": ROOT}, timeout, warm=script)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]


def launch(config, nproc, *overrides, check=True, env=None, launcher=False):
    """Train `config` on nproc ranks of this host. By default the ranks are started directly, as a cluster
    scheduler starts them (launch/pretrain.sh with RANK set runs the trainer in place): that leaves out the
    launcher's pre-launch check and its two Python processes, about 10 s of a core per run. `launcher=True` goes
    through the DeepSpeed launcher, for tests of what a user sees from it (one-line errors, exit codes)."""
    pinned = "MASTER_PORT" in (env or {})
    for _ in range(3):   # again with another port when the one picked was taken before the rendezvous listened
        if launcher:
            r = finish(start(config, *overrides, env={"NPROC": str(nproc), "MASTER_PORT": str(free_local_port()),
                                                      **(env or {})}))
        else:
            r = run_ranks(config, nproc, *overrides, env=env or {})
        if r.returncode == 0 or pinned or "EADDRINUSE" not in r.stdout + r.stderr:
            break
    if check:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def run_ranks(config, nproc, *overrides, env, timeout=600):
    """The nproc trainers of one job, started as a scheduler would: forked from a warm process that has imported the
    trainer (tests/support/warm_ranks.py), or with SYNTHFORMER_TEST_FRESH_RANKS=1 each through launch/pretrain.sh."""
    env = {"PYTHON": PY, **env}
    if warm_ranks.fresh():
        return ranks([os.path.join(ROOT, "launch", "pretrain.sh"), config, *overrides], nproc, env, timeout)
    pythonpath = os.pathsep.join([ROOT] + [p for p in [env.get("PYTHONPATH", os.environ.get("PYTHONPATH"))] if p])
    return ranks([config, *overrides], nproc, {**env, "PYTHONPATH": pythonpath}, timeout, warm="pretrain.train")


def ranks(cmd, nproc, env, timeout, warm=None):
    """nproc processes of `cmd` as the ranks of one job on this host (the env a launcher gives each); with `warm` (a
    module, or a script's path), `python -m warm cmd...` (`python warm cmd...`) forked warm (tests/support/warm_ranks.py).
    When one fails the others are ended, as the launcher does. stdout and stderr are the ranks' in rank order (files,
    not pipes: no rank blocks on a full pipe); the return code is the first failure's."""
    shared = {**os.environ, **env, "WORLD_SIZE": str(nproc), "LOCAL_SIZE": str(nproc),
              "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_local_port())}
    logs = [[tempfile.NamedTemporaryFile("w+") for _ in range(2)] for _ in range(nproc)]
    if warm:
        procs = [warm_ranks.start(warm, cmd, {**shared, "RANK": str(r), "LOCAL_RANK": str(r)}, ROOT, out, err)
                 for r, (out, err) in enumerate(logs)]
    else:
        procs = [subprocess.Popen(cmd, cwd=ROOT, env={**shared, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=out,
                                  stderr=err, text=True, start_new_session=True) for r, (out, err) in enumerate(logs)]
    deadline, code = time.time() + timeout, 0
    try:
        while any(p.poll() is None for p in procs) and not code:
            code = next((p.returncode for p in procs if p.returncode), 0)
            assert time.time() < deadline, f"the ranks of {cmd} ran past {timeout} s"
            time.sleep(0.05)
        code = code or next((p.returncode for p in procs if p.returncode), 0)
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:   # a forked rank not yet in its own session
                    os.kill(p.pid, signal.SIGKILL)
                p.wait()
    texts = []
    for pair in logs:
        for f in pair:
            f.seek(0)
        texts.append([f.read() for f in pair])
    return subprocess.CompletedProcess(cmd, code, "".join(t[0] for t in texts), "".join(t[1] for t in texts))


def losses(run_dir):
    rows = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl"))]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


def ids_per_step(run_dir, rank):
    rows = [json.loads(l) for l in open(os.path.join(run_dir, "sample_ids", f"rank{rank}.jsonl"))]
    out = {}
    for r in rows:
        out.setdefault(r["step"], []).extend(r["ids"])
    return out


def trainer_ranks(launcher_pid: int) -> dict[int, psutil.Process]:
    """{local rank: process} of the trainers under a launcher: `python -u -m pretrain.train --local_rank=R ...` under
    DeepSpeed's, LOCAL_RANK in the environment under torchrun's (a DataLoader worker, a trainer's child, is none)."""
    def trainer(args):   # python [-u] -m pretrain.train …
        return "-m" in args and args[args.index("-m") + 1:args.index("-m") + 2] == ["pretrain.train"]

    ranks = {}
    for p in psutil.Process(launcher_pid).children(recursive=True):
        try:
            args, parent = p.cmdline(), p.parent().cmdline()
            if not trainer(args) or trainer(parent):
                continue
            flag = [a for a in args if a.startswith("--local_rank=")]
            ranks[int(flag[0].split("=")[1]) if flag else int(p.environ()["LOCAL_RANK"])] = p
        except (psutil.Error, KeyError):
            continue
    return ranks


def jsonl(path) -> list[dict]:
    return [json.loads(line) for line in open(path) if line.strip()] if os.path.exists(path) else []


def metric_rows(run_dir, replayed: bool = False) -> list[dict]:
    """metrics.jsonl (each step once), or the rows a resumed run replaced (metrics.replayed.jsonl)."""
    return jsonl(os.path.join(run_dir, "metrics.replayed.jsonl" if replayed else "metrics.jsonl"))


def id_rows(run_dir, rank, replayed: bool = False) -> list[dict]:
    return jsonl(os.path.join(run_dir, "sample_ids", f"rank{rank}{'.replayed' if replayed else ''}.jsonl"))


def tensorboard_scalars(run_dir, tag) -> dict[int, float]:
    """{step: value} of a scalar as TensorBoard's own reader finds it in the run's event files (every file of the
    run: a resumed run adds one; a step written again after a resume counts as TensorBoard shows it, the last)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(os.path.join(run_dir, "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    return {e.step: e.value for e in events.Scalars(tag)} if tag in events.Tags()["scalars"] else {}


def record(run):
    """Every logged loss and every read batch of a run, those a resume replaced included; a step run twice (before
    and after a crash) must have given the same both times, and the run's own files hold each step once."""
    loss, ids = {}, {0: {}, 1: {}}
    steps = [r["step"] for r in metric_rows(run) if "train/loss" in r]
    assert len(steps) == len(set(steps)), "metrics.jsonl holds a step twice"
    for row in metric_rows(run) + metric_rows(run, replayed=True):
        if "train/loss" in row:
            assert loss.setdefault(row["step"], row["train/loss"]) == row["train/loss"], row
    for rank in (0, 1):
        steps = [r["step"] for r in id_rows(run, rank)]
        assert len(steps) == len(set(steps)), f"sample_ids/rank{rank}.jsonl holds a step twice"
        for row in id_rows(run, rank) + id_rows(run, rank, replayed=True):
            assert ids[rank].setdefault(row["step"], row["ids"]) == row["ids"], (rank, row)
    return loss, ids


def logged_step(run) -> int:
    """The newest step with a logged loss."""
    return max([r["step"] for r in metric_rows(run) if "train/loss" in r], default=0)
