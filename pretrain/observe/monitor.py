"""Watching a run, beside TensorBoard (pretrain/observe/metrics.py): Weights & Biases, the time left, downstream scores.

    WandbRun.open(settings, run_dir, config, n)  logging.wandb on rank 0: the same scalars, images and text as
                                                TensorBoard; every launch resumes the same W&B run by its id, each row
                                                carrying the training step as its x axis; the steps a relaunch replays
                                                are not sent twice, those a rewind trains anew are (W&B's rewind, or a
                                                new run naming its parent); a refused or unreachable W&B is one warning
    Eta                                         elapsed time and the estimate of the time left (formula below)
    deepspeed_readback(engine, passed)          what the engine reports of the `deepspeed:` section's settings
    requirements(cfg)                           one line naming the extra to install for what the config asks
"""
from __future__ import annotations

import html
import math
import os
import secrets
import sys
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING

from model import ConfigError

if TYPE_CHECKING:
    from pretrain.config.sections import WandbSection

WANDB_ID_FILE = "wandb-run-id"
WANDB_STEPS_FILE = "wandb-steps"   # a line a row W&B was sent: "<training step> <W&B's _step of the row>"
STEP_METRIC = "trainer/step"   # the x axis of every W&B chart: the training step


def requirements(cfg) -> None:
    """A ConfigError (one line, before any rank starts) when the config asks for an optional extra not installed."""
    for wanted, module, extra in ((cfg.logging.wandb, "wandb", "wandb"), (cfg.logging.eval_tasks, "lm_eval", "eval")):
        if not wanted:
            continue
        try:
            __import__(module)
        except ImportError:
            key = "logging.wandb" if extra == "wandb" else "logging.eval_tasks"
            raise ConfigError(f"{key} needs the {module} package, which is not installed: pip install "
                              f"'synthformer[{extra}]' (or pip install -r requirements.txt)") from None


class WandbRun:
    """One W&B run per training run, from rank 0. Its id is kept in <run_dir>/wandb-run-id, and every launch of the
    run opens that run again (`id=…, resume="allow"`: W&B's plain resume, which every server has). Each row carries
    the training step as its own metric (STEP_METRIC, W&B's `define_metric` step), so W&B's internal step, which only
    grows, never decides what is kept. A relaunch that resumes at step s replays the steps after s that the launch
    before it had already logged (up to `logged_up_to`, the last step in metrics.jsonl): those rows are not sent again,
    so W&B holds each step once, as first logged (a resumed run replays them bit for bit; metrics.jsonl keeps the
    replay's rows and moves the first ones aside). Events (a restart, at the step it resumed) are always sent.

    A rewind (`rewind_to` s: the run went back to a checkpoint older than the one a relaunch resumes, and trains the
    steps after s anew, e.g. after a loss spike) sends those steps again. Online, the run is rewound to the row before
    its first of a step after s (`resume_from="<id>?_step=k"`: W&B truncates the history after row k and archives
    the rows it drops); k, W&B's own step, is read from <run_dir>/wandb-steps, the rows sent. Where the server
    refuses the rewind (a preview that self-managed servers lack), and offline (each launch's directory numbers its
    rows from 0, so no k is known for `wandb sync`), a new run takes over: a new id in <run_dir>/wandb-run-id, its
    config naming the parent (`wandb_parent: {run_id, step}`), its rows the steps after s; the parent keeps what
    it had.

    `open` returns None, after one warning line, where W&B cannot be reached or refuses the run: the training goes on
    (metrics.jsonl and TensorBoard have everything) and no restart is spent on it. In offline mode each launch writes
    its own directory under <run_dir>/wandb with the same id; `wandb sync` uploads them in order."""

    def __init__(self, settings: WandbSection, run_dir: str, config: dict, logged_up_to: int | None = None,
                 rewind_to: int | None = None):
        import wandb

        self.wandb, self.logged_up_to = wandb, logged_up_to
        self.id_path, self.steps_path = os.path.join(run_dir, WANDB_ID_FILE), os.path.join(run_dir, WANDB_STEPS_FILE)
        if os.path.exists(self.id_path):
            run_id = open(self.id_path).read().strip()
        else:   # chosen before the first init: a launch whose init failed leaves the id for the next to use
            run_id = self.new_id(run_dir)
        where = dict(project=settings.project, entity=settings.entity, mode=settings.mode,
                     tags=list(settings.tags) or None, dir=run_dir)
        if rewind_to is None:
            self.run = wandb.init(**where, config=config, id=run_id, resume="allow")
        else:
            self.run = self.rewound(where, run_dir, config, run_id, rewind_to)
        self.next_step = self.run.starting_step   # W&B's _step of the next row: each log() is one row
        self.run.define_metric(STEP_METRIC)
        self.run.define_metric("*", step_metric=STEP_METRIC)

    def new_id(self, run_dir: str) -> str:
        run_id = secrets.token_hex(4)   # W&B's ids: 8 characters of [a-z0-9]
        os.makedirs(run_dir, exist_ok=True)
        with open(self.id_path + ".tmp", "w") as f:
            f.write(run_id + "\n")
        os.replace(self.id_path + ".tmp", self.id_path)
        return run_id

    def rewound(self, where: dict, run_dir: str, config: dict, run_id: str, step: int):
        """The W&B run, rewound to the row before its first of a training step after `step` (a restart's event, at the
        step a relaunch resumed, may follow rows of later steps); where that cannot be, a new run that names `run_id`
        as its parent."""
        words = [line.split() for line in open(self.steps_path)] if os.path.exists(self.steps_path) else []
        rows = [(int(w[0]), int(w[1])) for w in words if len(w) == 2]   # a line cut short by a crash is left out
        after = [k for s, k in rows if s > step]
        if where["mode"] == "online" and not after:   # W&B got none of the steps after it: nothing to take back
            return self.wandb.init(**where, config=config, id=run_id, resume="allow")
        if where["mode"] == "online" and min(after) > 0:
            k = min(after) - 1
            try:
                run = self.wandb.init(**where, config=config, resume_from=f"{run_id}?_step={k}")
                self.write_steps([(s, row) for s, row in rows if row <= k])
                return run
            except Exception as e:   # a server without rewind: a new run
                print(f"warning: W&B did not rewind run {run_id} to step {step} ({type(e).__name__}: "
                      f"{first_line(e)}); a new W&B run names it as its parent", file=sys.stderr, flush=True)
        self.write_steps([])
        return self.wandb.init(**where, id=self.new_id(run_dir), resume="allow",
                               config={**config, "wandb_parent": {"run_id": run_id, "step": step}},
                               notes=f"rewound to training step {step} of W&B run {run_id}")

    def write_steps(self, rows: list[tuple[int, int]]) -> None:
        with open(self.steps_path + ".tmp", "w") as f:
            f.writelines(f"{s} {k}\n" for s, k in rows)
        os.replace(self.steps_path + ".tmp", self.steps_path)

    @classmethod
    def open(cls, settings: WandbSection, run_dir: str, config: dict,
             logged_up_to: int | None = None, rewind_to: int | None = None) -> "WandbRun | None":
        try:
            return cls(settings, run_dir, config, logged_up_to, rewind_to)
        except Exception as e:   # unreachable, refused, a bad key: W&B is a mirror, not a reason to stop
            print(f"warning: W&B could not start the run ({type(e).__name__}: {first_line(e)}); training goes on "
                  f"without it (metrics.jsonl and TensorBoard have every step)", file=sys.stderr, flush=True)
            return None

    def sent(self, step: int) -> bool:
        """Whether the launch before this one already sent `step` (a replayed step)."""
        return self.logged_up_to is not None and step <= self.logged_up_to

    def log(self, step: int, row: dict) -> None:
        """One row, and its W&B step in <run_dir>/wandb-steps (the rewind point of a later rewind)."""
        self.run.log({STEP_METRIC: step, **row})
        with open(self.steps_path, "a") as f:
            f.write(f"{step} {self.next_step}\n")
        self.next_step += 1

    def scalars(self, step: int, values: dict, event: bool = False) -> None:
        if event or not self.sent(step):
            self.log(step, {tag: float(v) for tag, v in values.items()})

    def figure(self, step: int, tag: str, fig) -> None:
        if not self.sent(step):
            self.log(step, {tag: self.wandb.Image(fig)})

    def text(self, step: int, tag: str, text: str, event: bool = False) -> None:
        if event or not self.sent(step):
            self.log(step, {tag: self.wandb.Html(f"<pre>{html.escape(text)}</pre>")})

    def close(self) -> None:
        try:
            self.run.finish()
        except Exception as e:   # the server went away during the run: what was logged stays in <run_dir>/wandb
            print(f"warning: W&B did not finish the run cleanly ({type(e).__name__}: {e})", file=sys.stderr)


def first_line(e: Exception) -> str:
    return next((line.strip() for line in str(e).splitlines() if line.strip()), "")[:300]


class Eta:
    """Elapsed time and the time left, of this launch:

        ETA(s) = (T − s) · t_step  +  Σ_e n_e(s) · t_e

    s the step reached, T the run's last step (TrainConfig.total_steps); t_step the mean wall time of a training
    step since the previous estimate, without the events timed inside that window; for each event e (validation,
    checkpoint, samples, eval), t_e its measured mean duration so far (0 until it has run once) and n_e(s) how many
    are still due: the multiples of its period in [s, T) (the step line comes before the events of its own step),
    plus the one at T (validation, eval and a checkpoint always run at the end; samples only on their period)."""

    def __init__(self, total: int, periods: dict[str, int], at_end: tuple[str, ...] = ("validation", "checkpoint",
                                                                                         "eval"), step: int = 0,
                 clock=time.time):
        self.total, self.periods, self.at_end, self.clock = total, periods, at_end, clock
        self.started = clock()
        self.durations: dict[str, list[float]] = {}
        self.window_start, self.window_step, self.window_events, self.step_time = self.started, step, 0.0, None

    @classmethod
    def for_config(cls, cfg, step: int = 0) -> "Eta":
        """The events of a TrainConfig's loop (pretrain/train.py), from `step` (a resumed run's)."""
        lg = cfg.logging
        return cls(cfg.total_steps(), {"validation": lg.val_every, "checkpoint": cfg.checkpoint.every,
                                       "samples": lg.image_every, "eval": lg.eval_every if lg.eval_tasks else 0},
                   ("validation", "checkpoint") + (("eval",) if lg.eval_tasks else ()), step)

    def timed(self, event: str, call, *args):
        """call(*args), its duration counted as one `event`."""
        with self.timing(event):
            return call(*args)

    @contextmanager
    def timing(self, event: str):
        t0 = self.clock()
        try:
            yield
        finally:
            dt = self.clock() - t0
            self.durations.setdefault(event, []).append(dt)
            self.window_events += dt

    def due(self, event: str, step: int) -> int:
        """n_e(s): the events still due at step s."""
        period = self.periods.get(event, 0)
        before_end = len(range(period * -(-step // period), self.total, period)) if period else 0
        at_end = step <= self.total and (event in self.at_end or (period > 0 and self.total % period == 0))
        return before_end + at_end

    def mark(self, step: int) -> None:
        """At a log line: t_step over the steps since the previous mark (or the start), the events timed in between
        left out."""
        now = self.clock()
        if step > self.window_step:
            self.step_time = max(0.0, now - self.window_start - self.window_events) / (step - self.window_step)
        self.window_start, self.window_step, self.window_events = now, step, 0.0

    def estimate(self, step: int) -> float | None:
        """Seconds left, or None before a step time is known."""
        if self.step_time is None:
            return None
        events = sum(self.due(e, step) * sum(d) / len(d) for e, d in self.durations.items())
        return (self.total - step) * self.step_time + events

    def elapsed(self) -> float:
        return self.clock() - self.started

    def scalars(self, step: int) -> dict:
        left = self.estimate(step)
        return {"time/elapsed_s": self.elapsed(), **({"time/eta_s": left} if left is not None else {})}

    def words(self, step: int) -> str:
        left = self.estimate(step)
        return f"elapsed {clock_text(self.elapsed())} | ETA {clock_text(left) if left is not None else 'n/a'}"


def clock_text(seconds: float) -> str:
    """1:02:03 (h:mm:ss), or 3d 4:05:06."""
    seconds = max(0, int(math.ceil(seconds)))
    days, rest = divmod(seconds, 86400)
    h, rest = divmod(rest, 3600)
    text = f"{h}:{rest // 60:02d}:{rest % 60:02d}"
    return f"{days}d {text}" if days else text


# engine.<method>() for each `deepspeed:` key whose value DeepSpeed's engine reports
READBACK = {"zero_optimization.overlap_comm": "zero_overlap_comm",
            "zero_optimization.reduce_bucket_size": "zero_reduce_bucket_size",
            "zero_optimization.allgather_bucket_size": "zero_allgather_bucket_size",
            "zero_optimization.contiguous_gradients": "zero_contiguous_gradients",
            "zero_optimization.reduce_scatter": "zero_reduce_scatter",
            "communication_data_type": "communication_data_type",
            "wall_clock_breakdown": "wall_clock_breakdown"}


def deepspeed_readback(engine, passed: dict) -> str | None:
    """'deepspeed: zero_optimization.overlap_comm=True, …' as the engine reports the section's settings (those it
    has a reader for; the others as given), or None without a `deepspeed:` section."""
    if not passed:
        return None
    flat = {}
    for key, value in passed.items():
        for inner, v in (value.items() if isinstance(value, dict) else [(None, value)]):
            flat[f"{key}.{inner}" if inner else key] = v
    words = [f"{k}={getattr(engine, READBACK[k])()!r}" if k in READBACK else f"{k}={v!r} (as given)"
             for k, v in flat.items()]
    return "deepspeed section applied, as the engine reports it: " + ", ".join(words)
