"""The run's own prediction: one line before the launch and in the trainer's log, then measured ÷ predicted.

    perf/predicted_step_s          the time model's optimizer step for this config, layout and cluster
    perf/measured_over_predicted   the measured step ÷ it, from the second logged window on (the first holds the
                                   start: compilation, the first batches, allocator growth)

The measured step is perf/step_s where the trainer logs it, else tokens per step ÷ perf/tokens_per_s over the
logging window. The cluster is logging.cluster (a preset or a cluster YAML), else the preset of the device's name.
"""
from __future__ import annotations

import torch

from model.config import ConfigError
from pretrain.config import TrainConfig, cuda_available
from pretrain.config.deepspeed_dict import deepspeed_config
from pretrain.plan.memory import layout_of
from pretrain.plan.calibration import calibrated
from pretrain.plan.cluster import PRESETS, Cluster, load_cluster, preset_for_device
from pretrain.plan.search import largest_terms
from pretrain.plan.step import Prediction, predict
from pretrain.plan.workload import engine_of


def cluster_of(cfg: TrainConfig, device_name: str, given: str | None = None) -> Cluster | None:
    """--cluster, else logging.cluster, else the preset of `device_name` (None: a GPU no preset knows)."""
    spec = given or cfg.logging.cluster
    if spec:
        return load_cluster(spec, "--cluster" if given else "logging.cluster")
    return preset_for_device(device_name)


def expected(cfg: TrainConfig, world: int, cluster: Cluster) -> Prediction:
    """The predicted step of the config's own layout on `cluster`."""
    lay = layout_of(cfg, world)
    return predict(cfg, lay, cluster, calibrated(cluster.family).efficiency(cluster.family, cfg.train.compile),
                   engine_of(cfg, deepspeed_config(cfg, lay.dp)), gpu=cluster.device == "cuda")


def launch_line(p: Prediction, cluster: Cluster) -> str:
    terms = largest_terms(p)
    return (f"time plan: {p.layout}, micro-batch {p.micro} × {p.micro_batches}, on {cluster.name}: predicted step "
            f"{p.step_s:.3g} s, {p.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, MFU {100 * p.mfu:.0f}% ({terms}); "
            f"communication terms not checked on a multi-GPU run of this engine "
            f"(python -m pretrain.config … --plan ranks the other layouts)")


class StepCheck:
    """Measured ÷ predicted for the trainer's log: `line` before the launch, then `observe(values, …)` at each logged
    step. Without a prediction (no preset for the device, a config the model cannot price) `prediction` is None, the
    line says why and nothing is logged."""

    def __init__(self, prediction: Prediction | None, cluster: Cluster | None, line: str):
        self.prediction, self.cluster, self.line, self.windows = prediction, cluster, line, 0

    @classmethod
    def for_run(cls, cfg: TrainConfig, world: int, device_name: str, given: str | None = None) -> "StepCheck":
        """The check of the config's own layout and its launch line; `given`: --cluster."""
        try:
            cluster = cluster_of(cfg, device_name, given)
            if cluster is None:
                return cls(None, None, f"time plan: no cluster preset for {device_name!r} ({', '.join(PRESETS)}): no "
                                       f"predicted step; set logging.cluster to a preset or a cluster YAML "
                                       f"(pretrain/plan/cluster.py)")
            p = expected(cfg, world, cluster)
        except ConfigError as e:
            return cls(None, None, f"time plan: no predicted step: {e}")
        return cls(p, cluster, launch_line(p, cluster))

    def values(self, measured_step_s: float) -> tuple[dict, str | None]:
        """(the scalars to log, a line the first time measured ÷ predicted is logged)."""
        if self.prediction is None:
            return {}, None
        self.windows += 1
        predicted = self.prediction.step_s
        out = {"perf/predicted_step_s": predicted}
        if self.windows < 2 or not measured_step_s > 0:
            return out, None
        ratio = measured_step_s / predicted
        out["perf/measured_over_predicted"] = ratio
        line = None
        if self.windows == 2:
            line = (f"time plan: measured ÷ predicted step {ratio:.2f} ({measured_step_s:.3g} s measured, "
                    f"{predicted:.3g} s predicted on {self.cluster.name}; the first logged window left out)")
        return out, line

    def observe(self, values: dict, tokens_step_s: float) -> str | None:
        """Adds this window's scalars to the trainer's `values`; the measured step is perf/step_s where the trainer
        logged it (pretrain/observe/), else `tokens_step_s` (tokens a step ÷ tokens/s). The line to log, or None."""
        out, line = self.values(values.get("perf/step_s") or tokens_step_s)
        values.update(out)
        return line


def device_cluster_name() -> str:
    """This machine's device name as torch names it ('cpu' without CUDA or with DS_ACCELERATOR=cpu)."""
    return torch.cuda.get_device_name(0) if cuda_available() else "cpu"


__all__ = ["StepCheck", "cluster_of", "device_cluster_name", "expected", "launch_line"]
