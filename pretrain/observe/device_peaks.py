"""What speed is measured against: each device's dense peak TFLOP/s. MFU = model/accounting.py's FLOP count ×
tokens/s ÷ the peak, for the trainer's log and benchmarks/bench.py alike.

    peak_tflops(device, precision, configured)   the MFU denominator of a run
    peak_tflops_of(name, precision)              the table's figure for a device name
"""
from __future__ import annotations

import torch

# Dense peak TFLOP/s per device (no sparsity), by a part of torch's device name: (bf16/fp16 tensor cores, fp32).
# The longest matching name wins ("H100 PCIe" before "H100"). From the vendors' data sheets.
PEAK_TFLOPS = {
    "H100 PCIe": (756.0, 51.2),
    "H100": (989.4, 66.9),    # SXM
    "H200": (989.4, 66.9),
    "A100": (312.0, 19.5),
    "L40S": (362.1, 91.6),
}


def peak_tflops_of(device_name: str, precision: str) -> float | None:
    """The table's peak for a device name at train.precision, or None for a device it does not know."""
    known = [name for name in PEAK_TFLOPS if name in device_name]
    if not known:
        return None
    half, fp32 = PEAK_TFLOPS[max(known, key=len)]
    return fp32 if precision == "fp32" else half


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def peak_tflops(device: torch.device, precision: str, configured: float | None = None) -> float | None:
    """The MFU denominator: logging.peak_tflops_per_device when a config sets it, else the table's figure for this
    device, else None (a CPU, or a GPU the table does not know: MFU is then not a number anyone should quote)."""
    return configured if configured is not None else peak_tflops_of(device_name(device), precision)
