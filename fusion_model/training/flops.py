"""The matmul peak FLOP/s of this machine: the MFU denominator of training (callbacks) and of the benchmarks."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def default_device() -> torch.device:
    """CUDA when present, else CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_matmul_size(device: torch.device) -> int:
    """Side of the square matmul: compute-bound, yet well under a second per call."""
    return 8192 if device.type == "cuda" else 1024


def sync(device: torch.device) -> None:
    """Wait for the device's queued kernels, so host clocks measure their work (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_seconds(
    fn: Callable[[], object], device: torch.device, repeats: int, warmup: int, min_seconds: float = 0.0
) -> float:
    """Fastest of at least `repeats` timed calls, repeated for at least `min_seconds`: a peak is what the
    hardware can do, noise from other processes only ever adds time, so a longer window finds a quiet moment."""
    for _ in range(warmup):
        fn()
    sync(device)
    best = float("inf")
    calls = 0
    window_end = time.perf_counter() + min_seconds
    while calls < repeats or time.perf_counter() < window_end:
        start = time.perf_counter()
        fn()
        sync(device)
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
    seconds = best_seconds(lambda: torch.mm(a, b, out=out), device, repeats, warmup=2, min_seconds=min_seconds)
    return 2.0 * size**3 / seconds
