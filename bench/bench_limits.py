"""The machine's limits as a benchmark: fp32 (CPU) or bf16 (GPU) matmul peak and memory copy bandwidth."""

from __future__ import annotations

import torch

from bench.harness import write_result
from bench.limits import (
    copy_bandwidth,
    default_copy_bytes,
    default_device,
    default_matmul_size,
    matmul_peak_flops,
)


def run(smoke: bool = False) -> dict:
    """Measure the limits that MFU and decode-bound figures are fractions of; writes `limits.json`."""
    device = default_device()
    train_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    size = 256 if smoke else None
    copy_bytes = (16 << 20) if smoke else None
    repeats = 2 if smoke else 7
    # shared machines: keep measuring for a few seconds so the best call falls in a quiet moment
    window = 0.0 if smoke else 4.0
    figures = {
        "matmul_peak": {
            "value": matmul_peak_flops(train_dtype, device, size=size, repeats=repeats, min_seconds=window),
            "unit": "FLOP/s",
            "dtype": str(train_dtype).removeprefix("torch."),
        },
        "copy_bandwidth": {
            "value": copy_bandwidth(device, nbytes=copy_bytes, repeats=repeats, min_seconds=window),
            "unit": "B/s",
            "note": "bytes read + bytes written",
        },
    }
    if device.type == "cpu":
        # the other dtype too: recent Xeons have bf16 matrix units, so this says whether bf16 is worth trying
        figures["matmul_peak_bf16"] = {
            "value": matmul_peak_flops(torch.bfloat16, device, size=size, repeats=repeats, min_seconds=window),
            "unit": "FLOP/s",
            "dtype": "bfloat16",
        }
    payload = {
        "figures": figures,
        "config": {
            "device": str(device),
            "matmul_size": size or default_matmul_size(device),
            "copy_bytes_per_buffer": copy_bytes or default_copy_bytes(device),
            "repeats": repeats,
            "min_seconds_each": window,
            "threads": torch.get_num_threads(),
        },
    }
    write_result("limits", payload)
    return payload
