"""The machine's limits, measured here: matmul peak FLOP/s and memory copy bandwidth (for MFU and decode bounds)."""

from __future__ import annotations

import time

import torch


def default_device() -> torch.device:
    """CUDA when present, else CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_matmul_size(device: torch.device) -> int:
    """Side of the square matmul: compute-bound, yet well under a second per call."""
    return 8192 if device.type == "cuda" else 1024


def default_copy_bytes(device: torch.device) -> int:
    """Bytes per copy buffer: larger than the last-level cache (300 MiB L3 on the CI hosts), so it is DRAM speed."""
    return (1 << 30) if device.type == "cuda" else (384 << 20)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_seconds(fn, device: torch.device, repeats: int, warmup: int, min_seconds: float = 0.0) -> float:
    """Fastest of at least `repeats` timed calls, repeated for at least `min_seconds`: a peak is what the
    hardware can do, noise from other processes only ever adds time, so a longer window finds a quiet moment."""
    for _ in range(warmup):
        fn()
    _sync(device)
    best = float("inf")
    calls = 0
    window_end = time.perf_counter() + min_seconds
    while calls < repeats or time.perf_counter() < window_end:
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
        calls += 1
    return best


def matmul_peak_flops(
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    *,
    size: int | None = None,
    repeats: int = 5,
    min_seconds: float = 0.0,
) -> float:
    """Best achieved FLOP/s of a square matmul: fp32 on CPU, bf16 on GPU unless `dtype` says otherwise."""
    device = torch.device(device) if device is not None else default_device()
    if dtype is None:
        # CPU training runs in fp32 (bf16 matmul is far slower on these CPUs); GPUs train in bf16.
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    size = default_matmul_size(device) if size is None else size
    if size < 1:
        raise ValueError(f"matmul size must be positive, got {size}")
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    out = torch.empty(size, size, device=device, dtype=dtype)
    seconds = _best_seconds(lambda: torch.mm(a, b, out=out), device, repeats, warmup=2, min_seconds=min_seconds)
    return 2.0 * size**3 / seconds


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
    seconds = _best_seconds(lambda: dst.copy_(src), device, repeats, warmup=1, min_seconds=min_seconds)
    return 2.0 * numel * 4 / seconds


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
