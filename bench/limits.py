"""The machine's limits, measured here: matmul peak FLOP/s and memory copy bandwidth (for MFU and decode bounds)."""

from __future__ import annotations

import torch

# the matmul peak is the training layer's too (its MFU denominator): one implementation, in fusion_model
from fusion_model.training.flops import best_seconds, default_device, default_matmul_size, matmul_peak_flops

__all__ = [
    "copy_bandwidth",
    "read_bandwidth",
    "decode_seconds_bound",
    "default_copy_bytes",
    "default_device",
    "default_matmul_size",
    "matmul_peak_flops",
    "model_flops_utilization",
]


def default_copy_bytes(device: torch.device) -> int:
    """Bytes per copy buffer: larger than the last-level cache (300 MiB L3 on the CI hosts), so it is DRAM speed."""
    return (1 << 30) if device.type == "cuda" else (384 << 20)


def copy_bandwidth(
    device: torch.device | str | None = None,
    *,
    nbytes: int | None = None,
    repeats: int = 5,
    min_seconds: float = 0.0,
) -> float:
    """Best memory copy bandwidth in bytes/s, counting bytes read plus bytes written (STREAM's convention)."""
    device = torch.device(device) if device is not None else default_device()
    nbytes = default_copy_bytes(device) if nbytes is None else nbytes
    if nbytes < 4:
        raise ValueError(f"copy buffer must be at least 4 bytes, got {nbytes}")
    numel = nbytes // 4
    src = torch.ones(numel, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    seconds = best_seconds(lambda: dst.copy_(src), device, repeats, warmup=1, min_seconds=min_seconds)
    return 2.0 * numel * 4 / seconds


def read_bandwidth(device: torch.device | str | None = None, *, nbytes: int, repeats: int = 5) -> float:
    """Best read-only bandwidth in bytes/s over a buffer of `nbytes` (a sum: every byte read once, nothing written):
    what a decode step needs to stream its weights, which a copy's read + write traffic understates."""
    device = torch.device(device) if device is not None else default_device()
    if nbytes < 4:
        raise ValueError(f"read buffer must be at least 4 bytes, got {nbytes}")
    numel = nbytes // 4
    src = torch.ones(numel, device=device, dtype=torch.float32)
    seconds = best_seconds(lambda: src.sum(), device, repeats, warmup=1, min_seconds=0.0)
    return numel * 4 / seconds


def decode_seconds_bound(weight_bytes: float, bandwidth: float) -> float:
    """Lower bound on one decoding step: every weight is read once from memory (bytes / bytes-per-second)."""
    if bandwidth <= 0:
        raise ValueError(f"bandwidth must be positive bytes/s, got {bandwidth}")
    return weight_bytes / bandwidth


def model_flops_utilization(flops_per_second: float, peak_flops: float) -> float:
    """MFU: achieved model FLOP/s as a fraction of the peak."""
    if peak_flops <= 0:
        raise ValueError(f"peak FLOP/s must be positive, got {peak_flops}")
    return flops_per_second / peak_flops
