"""Planning a run before any process starts: the memory each rank needs, whether it fits a GPU, and one optimizer
step's predicted time for a config, a layout and a cluster.

    python -m pretrain.config CONFIG --world-size N --plan [--cluster h100]   every layout that fits, ranked
    python -m pretrain.plan calibration                                       the fit, and its held-out error
    python -m pretrain.plan published tests/data/megatron_2021_layouts.yaml   the paper's layout orders, predicted

    memory.py       memory per rank: model states, DeepSpeed's buffers, activations (model/memory.py), the peak
    verdict.py      fits, tight or does not fit a GPU, with headroom for what the memory plan does not count
    cluster.py      the GPU and its links: presets (h100, h200, a100, cpu) and small YAML files
    terms.py        each term's formula, pure arithmetic (GEMM, memory-bound, ring collectives, sends, 1F1B)
    workload.py     what a rank computes, keeps and sends per micro-batch, read off the model and the memory plan
    step.py         the terms summed into one step: compute, memory, TP, PP sends, bubble, DP, optimizer
    calibration.py  the compute efficiency fitted on the GPU records (calibration.yaml, one file)
    search.py       `--plan`: layouts × micro-batches × checkpointing, the memory verdict, the ranked table
    published.py    the check against Narayanan et al. 2021's figures (test data: tests/data/)
    run_prediction.py  the run's own line: its predicted step at launch, measured ÷ predicted once it runs

What is measured and what is not: compute is calibrated on one-GPU steps of this engine; every communication term is
the model's own, ordered against the paper's measurements and never checked on a multi-GPU run of this engine.
"""
from pretrain.plan.cluster import PRESETS, Cluster, load_cluster, preset_for_device
from pretrain.plan.step import Efficiency, Prediction, predict

__all__ = ["PRESETS", "Cluster", "Efficiency", "Prediction", "load_cluster", "predict", "preset_for_device"]
