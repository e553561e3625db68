"""The machine a step runs on, as the time model sees it: one GPU's peak and memory, and the links between GPUs.

    python -m pretrain.config CONFIG --world-size N --plan --cluster h100        (a preset)
    python -m pretrain.config CONFIG --world-size N --plan --cluster my.yaml     (a file)

A cluster file names a preset to start from and changes what differs (every key optional but `preset`):

    preset: h100
    name: our H100 pods, 4×400 Gb/s
    gpu: {bf16_tflops: 989.4, fp32_tflops: 66.9, hbm_gbps: 3350, memory_gib: 80, sms: 132}
    gpus_per_node: 8
    intra_node: {gbps: 450, latency_us: 3.4}    # per GPU, one direction (NVLink); latency per ring step
    inter_node: {gbps: 25, latency_us: 14}      # per GPU, one direction (its NIC)

The presets are the vendors' data-sheet figures: dense tensor-core peaks (no sparsity), HBM bandwidth, NVLink per
GPU and direction, and one NIC per GPU (8×400 Gb/s NDR InfiniBand on H100/H200 nodes, 8×200 Gb/s HDR on A100
nodes). Latencies are NCCL's own model of a ring step (src/graph/tuning.cc, the Simple protocol: 3.4 µs over NVLink,
14 µs over the network), not measured here. `cpu` is this repository's CI machine: one core
per rank, gloo over loopback TCP (its compute is calibrated, pretrain/plan/calibration.yaml).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace

import yaml

from model.config import ConfigError
from model.fields import check_keys


@dataclass(frozen=True)
class GPU:
    name: str
    bf16_tflops: float    # dense half-precision tensor-core peak, TFLOP/s (the MFU denominator)
    fp32_tflops: float    # fp32 peak (train.precision fp32)
    hbm_gbps: float       # device memory bandwidth, GB/s
    memory_gib: float     # device memory, GiB
    sms: int              # streaming multiprocessors: how many GEMM tiles run at once (wave quantization)

    def peak(self, precision: str) -> float:
        """FLOP/s of train.precision's GEMMs."""
        return 1e12 * (self.fp32_tflops if precision == "fp32" else self.bf16_tflops)


@dataclass(frozen=True)
class Link:
    gbps: float           # GB/s per GPU and direction
    latency_us: float     # per message, and per step of a ring collective (NCCL's ring latency over this hop)

    @property
    def bytes_per_s(self) -> float:
        return self.gbps * 1e9

    @property
    def latency_s(self) -> float:
        return self.latency_us * 1e-6


@dataclass(frozen=True)
class Cluster:
    name: str
    gpu: GPU
    gpus_per_node: int
    intra_node: Link      # NVLink / NVSwitch between the GPUs of a node
    inter_node: Link      # between nodes: each GPU's own NIC
    device: str = "cuda"  # the ranks' device: "cpu" for the CPU preset (and files made from it)

    @property
    def family(self) -> str:
        """Whose calibration prices its compute (pretrain/plan/calibration.yaml): "gpu" or "cpu"."""
        return "cpu" if self.device == "cpu" else "gpu"

    def group_link(self, ranks: int, stride: int) -> Link:
        """The link a collective over `ranks` ranks spaced `stride` apart runs at (ranks are numbered node by node):
        NVLink while the group stays within a node; across nodes the ring's traffic leaves each node through the
        NICs of the group's ranks there, one each, so β = min(NVLink, g·NIC) with g of its ranks in a node, at the
        network's latency."""
        if ranks * stride <= self.gpus_per_node:
            return self.intra_node
        g = max(1, min(ranks, self.gpus_per_node // stride))
        return Link(min(self.intra_node.gbps, g * self.inter_node.gbps), self.inter_node.latency_us)

    def describe(self) -> str:
        g = self.gpu
        return (f"{self.name}: {g.name} ({g.bf16_tflops:g} TFLOP/s bf16, {g.hbm_gbps:g} GB/s HBM, {g.memory_gib:g} GiB), "
                f"{self.gpus_per_node} a node, {self.intra_node.gbps:g} GB/s within a node, "
                f"{self.inter_node.gbps:g} GB/s per GPU across nodes")


H100 = GPU("H100 SXM", 989.4, 66.9, 3350, 80, 132)
H200 = GPU("H200", 989.4, 66.9, 4800, 141 / 1.073741824, 132)
A100 = GPU("A100 80GB SXM", 312.0, 19.5, 2039, 80, 108)
CPU_CORE = GPU("CPU core (fp32, calibrated)", 0.1, 0.1, 10, 4, 1)
NVLINK4, NVLINK3 = Link(450, 3.4), Link(300, 3.4)     # 900 / 600 GB/s both directions; NCCL ring step 3.4 µs
NDR, HDR = Link(50, 14), Link(25, 14)                 # 400 / 200 Gb/s per GPU; NCCL ring step 14 µs
PRESETS = {
    "h100": Cluster("h100", H100, 8, NVLINK4, NDR),
    "h200": Cluster("h200", H200, 8, NVLINK4, NDR),
    "a100": Cluster("a100", A100, 8, NVLINK3, HDR),
    "cpu": Cluster("cpu", CPU_CORE, 64, Link(1.0, 60), Link(1.0, 60), "cpu"),   # gloo over loopback TCP
}
DEVICE_NAMES = (("H100", "h100"), ("H200", "h200"), ("A100", "a100"))   # torch's device name → preset


def preset_for_device(device_name: str) -> Cluster | None:
    """The preset of a torch device name ('NVIDIA H100 80GB HBM3' → h100; 'cpu' → cpu), None for one not known."""
    if device_name == "cpu":
        return PRESETS["cpu"]
    return next((PRESETS[key] for part, key in DEVICE_NAMES if part in device_name), None)


def load_cluster(spec: str, key: str = "--cluster") -> Cluster:
    """A preset by name, or a cluster YAML file (see the module docstring); ConfigError naming the key otherwise
    (`key`: where `spec` came from, --cluster or logging.cluster)."""
    if spec in PRESETS:
        return PRESETS[spec]
    if not os.path.isfile(spec):
        raise ConfigError(f"{key}={spec!r} is neither a preset ({', '.join(PRESETS)}) nor a cluster YAML file")
    try:
        with open(spec) as f:
            tree = yaml.safe_load(f) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{spec}: invalid YAML: {getattr(e, 'problem', None) or e}") from None
    check_keys(tree, "cluster", ["preset", "name", "gpu", "gpus_per_node", "intra_node", "inter_node"], spec)
    base = tree.get("preset")
    if base not in PRESETS:
        raise ConfigError(f"{spec}: preset={base!r} must name the preset it changes: {', '.join(PRESETS)}")
    out = PRESETS[base]
    for key, kind in (("gpu", GPU), ("intra_node", Link), ("inter_node", Link)):
        if key in tree:
            changes = tree[key] or {}
            check_keys(changes, key, [f.name for f in fields(kind)], spec)
            for name, value in changes.items():
                if name != "name" and not (isinstance(value, (int, float)) and value > 0):
                    raise ConfigError(f"{spec}: {key}.{name}={value!r} must be a number > 0")
            out = replace(out, **{key: replace(getattr(out, key), **changes)})
    count = tree.get("gpus_per_node", out.gpus_per_node)
    if not (isinstance(count, int) and count >= 1):
        raise ConfigError(f"{spec}: gpus_per_node={count!r} must be an integer ≥ 1")
    return replace(out, name=str(tree.get("name", os.path.basename(spec))), gpus_per_node=count)
